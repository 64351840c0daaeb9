"""Draw a Tandem trace (rl.trace's Chrome trace JSON) as a Gantt chart PNG.

    .venv/bin/python bench/render_trace.py TRACE.json OUT.png [--from SECONDS] [--to SECONDS]

One row per lane (in the trace's lane order), one colour per phase, x axis in seconds since the
trace started. --from/--to crop a window, so that a few steps can be shown legibly. The title
gives the window's overlap fraction (generation running while the trainer works) and the
seconds each phase was busy; the file holds no device map, so busy fraction is not shown.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from rl.trace import PHASES, Span, load_chrome, load_lanes, summarise

# One fixed colour per phase, so the same phase looks the same in every picture.
COLOURS = dict(zip(PHASES, matplotlib.colormaps["tab10"].colors, strict=False))


def render(
    spans: list[Span], lanes: list[str], title: str, start: float, end: float, out: Path
) -> None:
    """Draw `spans` clipped to [start, end] seconds as one row per lane; write a PNG to `out`."""
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
    fig.savefig(out, dpi=120, bbox_inches="tight")


def _describe(stats: dict[str, float]) -> str:
    busy = [f"{p} {stats[f'perf/busy_s_{p}']:.2f} s" for p in PHASES if f"perf/busy_s_{p}" in stats]
    return f"overlap {stats['perf/overlap_fraction']:.1%} | busy: " + ", ".join(busy or ["none"])


def main(argv: list[str] | None = None) -> None:
    """The command line (see the module docstring); `argv` defaults to sys.argv[1:]."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="trace JSON written by rl.trace.Trace.write")
    parser.add_argument("out", type=Path, help="PNG to write")
    parser.add_argument("--from", dest="start", type=float, default=0.0, help="window start, s")
    parser.add_argument("--to", dest="end", type=float, help="window end, s (default: last end)")
    args = parser.parse_args(argv)
    spans = load_chrome(args.trace)
    end = args.end if args.end is not None else max((s.end for s in spans), default=0.0)
    if end <= args.start:
        parser.error(f"empty window: --to ({end}) must be after --from ({args.start})")
    title = f"Tandem trace: {args.trace.name}"
    render(spans, load_lanes(args.trace), title, args.start, end, args.out)


if __name__ == "__main__":
    main()
