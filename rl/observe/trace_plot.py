"""A Tandem trace (rl.observe.trace's spans) drawn as a Gantt chart: one row per lane, one colour per
phase, x in seconds since the trace started; the title gives the window's overlap fraction
and each phase's busy seconds. Used by `rl report` and bench/render_trace.py."""

from __future__ import annotations

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from rl.observe.trace import PHASES, Span, summarise

# One fixed colour per phase, so the same phase looks the same in every picture.
COLOURS = dict(zip(PHASES, matplotlib.colormaps["tab10"].colors, strict=False))


def draw_trace(spans: list[Span], lanes: list[str], title: str, start: float, end: float) -> Figure:
    """`spans` clipped to [start, end] seconds as a Gantt chart, one row per lane."""
    stats = summarise(spans, {}, start, end)
    # An Agg canvas of its own, not pyplot: no global backend, no display needed.
    fig = Figure(figsize=(12, 1.5 + 0.5 * len(lanes)))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    shown = [s for s in spans if s.end > start and s.start < end]
    for row, lane in enumerate(lanes):
        for phase in PHASES:
            bars = [
                (max(s.start, start), min(s.end, end) - max(s.start, start))
                for s in shown
                if s.lane == lane and s.phase == phase
            ]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), color=COLOURS[phase])
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(len(lanes) - 0.5, -0.5)  # first lane on top
    ax.set_xlim(start, end)
    ax.set_xlabel("seconds since trace start")
    present = [p for p in PHASES if any(s.phase == p for s in shown)]
    ax.legend(
        handles=[Patch(color=COLOURS[p], label=p) for p in present],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
    )
    ax.set_title(f"{title}\n{_describe(stats)}")
    return fig


def _describe(stats: dict[str, float]) -> str:
    busy = [f"{p} {stats[f'perf/busy_s_{p}']:.2f} s" for p in PHASES if f"perf/busy_s_{p}" in stats]
    return f"overlap {stats['perf/overlap_fraction']:.1%} | busy: " + ", ".join(busy or ["none"])
