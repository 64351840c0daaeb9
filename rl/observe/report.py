"""`rl report RUN_DIR`: a run's curves as PNG plots and a Markdown summary that embeds them.

Reads what every run leaves in its directory: metrics.jsonl (one record a step, step 0 the
evaluation before training) and trace.json (every phase of every worker). Writes, by default
to RUN_DIR/report/: reward and accuracy, response length, KL and entropy, expert load (MoE
models), step time stacked by phase, the overlap timeline of the last steps, and summary.md,
which has a table per MoE layer when the run logged `moe/layer<L>/...` metrics. A series the run
did not log (KL to a reference without one, say) is left out of its plot; a plot with none is
not drawn.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from rl.observe.trace import PHASES, load_chrome, load_lanes
from rl.observe.trace_plot import COLOURS, draw_trace

METRICS_FILE, TRACE_FILE, SUMMARY_FILE = "metrics.jsonl", "trace.json", "summary.md"
TIMELINE_WINDOW_S = 60.0  # the timeline shows the run's last minute, where steps are legible


class ReportError(ValueError):
    """The run directory cannot be reported on; the message names the file."""


@dataclass(frozen=True)
class Series:
    key: str  # metric name in metrics.jsonl
    label: str
    right_axis: bool = False


@dataclass(frozen=True)
class Panel:
    """One line plot over steps."""

    file: str
    title: str
    ylabel: str
    series: tuple[Series, ...]
    right_ylabel: str = ""


PANELS = (
    Panel(
        "reward.png",
        "Reward and held-out accuracy",
        "reward / accuracy",
        (
            Series("reward/mean", "reward (mean)"),
            Series("eval/accuracy", "held-out greedy accuracy"),
            Series("reward/solved_groups", "groups with a solved sample"),
        ),
    ),
    Panel(
        "length.png",
        "Response length",
        "tokens",
        (
            Series("response/mean_tokens", "mean response tokens"),
            Series("response/max_tokens", "longest response"),
            Series("response/truncated", "fraction truncated", right_axis=True),
        ),
        right_ylabel="fraction truncated",
    ),
    Panel(  # agent runs only (rl.agents.episode.episode_metrics)
        "agent.png",
        "Tool use",
        "fraction",
        (
            Series("agent/tool_call_turn_frac", "turns with a tool call"),
            Series("agent/well_formed_call_frac", "of those, all calls well-formed"),
            Series("agent/masked_token_frac", "tokens inserted by the environment"),
            Series("agent/turns_mean", "turns per episode", right_axis=True),
        ),
        right_ylabel="turns",
    ),
    Panel(
        "kl_entropy.png",
        "KL and entropy",
        "nats per token",
        (
            Series("actor/entropy", "entropy"),
            Series("actor/approx_kl_old", "KL to the old policy"),
            Series("actor/kl_ref", "KL to the reference"),
        ),
    ),
    Panel(  # MoE models only (rl.algorithms.router_losses.moe_metrics)
        "expert_load.png",
        "Expert load",
        "max/mean load; balance loss",
        (
            Series("moe/max_load_ratio", "max/mean expert load (worst layer)"),
            Series("moe/balance_loss", "balance loss (layer mean, 1 = balanced)"),
            Series("moe/z_loss", "router z-loss (layer mean)", right_axis=True),
        ),
        right_ylabel="z-loss",
    ),
)
STEP_TIME_FILE, TIMELINE_FILE = "step_time.png", "timeline.png"


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's step records, in step order; ReportError when there are none."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise ReportError(f"{path} is missing: give the directory of a run (runs/NAME)")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ReportError(f"{path}:{number} is not a JSON record ({e})") from None
    if not records:
        raise ReportError(f"{path} holds no step yet")
    return sorted(records, key=lambda record: record["step"])


def _points(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float)]
    return [step for step, _ in pairs], [value for _, value in pairs]


def _figure(width: float = 8.0, height: float = 4.5) -> Figure:
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)  # an Agg canvas of its own: no pyplot, no display needed
    return fig


def draw_panel(panel: Panel, records: list[dict]) -> Figure | None:
    """`panel`'s series over steps (None when the run logged none of them)."""
    present = [s for s in panel.series if _points(records, s.key)[0]]
    if not present:
        return None
    fig = _figure()
    ax = fig.subplots()
    right = ax.twinx() if any(s.right_axis for s in present) else None
    for index, series in enumerate(present):
        steps, values = _points(records, series.key)
        target = right if series.right_axis else ax
        marker = "o" if len(steps) < 30 else None
        # Explicit colours: a twin axis would restart the colour cycle.
        target.plot(steps, values, color=f"C{index}", marker=marker, label=series.label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    ax.set_title(panel.title)
    handles, labels = ax.get_legend_handles_labels()
    if right is not None:
        right.set_ylabel(panel.right_ylabel)
        more = right.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, loc="best")
    return fig


def draw_step_time(records: list[dict]) -> Figure | None:
    """Busy seconds of each phase per step, stacked, with the step's wall time over them
    (with overlap the phases can add up to more than the wall time)."""
    trained = [r for r in records if r["step"] > 0]
    phases = [p for p in PHASES if any(f"perf/busy_s_{p}" in r for r in trained)]
    if not phases:
        return None
    fig = _figure(9.0)
    ax = fig.subplots()
    steps = [r["step"] for r in trained]
    bottom = [0.0] * len(trained)
    for phase in phases:
        seconds = [r.get(f"perf/busy_s_{phase}") or 0.0 for r in trained]
        ax.bar(steps, seconds, bottom=bottom, color=COLOURS[phase], label=phase)
        bottom = [b + s for b, s in zip(bottom, seconds, strict=True)]
    wall_steps, wall = _points(trained, "time/step_s")
    if wall_steps:
        ax.plot(wall_steps, wall, color="black", marker=".", label="wall time")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("Step time by phase (busy seconds)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def draw_timeline(trace_path: Path) -> Figure | None:
    """The last TIMELINE_WINDOW_S seconds of the trace (None without a trace)."""
    if not trace_path.is_file():
        return None
    spans = load_chrome(trace_path)
    if not spans:
        return None
    end = max(span.end for span in spans)
    start = max(0.0, end - TIMELINE_WINDOW_S)
    title = f"Overlap timeline, {start:.0f}-{end:.0f} s"
    return draw_trace(spans, load_lanes(trace_path), title, start, end)


def build_figures(run_dir: Path, records: list[dict]) -> dict[str, Figure]:
    """File name -> figure, for every plot the run's `records` (read_metrics) and trace have
    data for."""
    figures = {panel.file: draw_panel(panel, records) for panel in PANELS}
    figures[STEP_TIME_FILE] = draw_step_time(records)
    figures[TIMELINE_FILE] = draw_timeline(run_dir / TRACE_FILE)
    return {name: fig for name, fig in figures.items() if fig is not None}


def write_report(run_dir: Path, out_dir: Path | None = None) -> Path:
    """Write the PNGs and summary.md to `out_dir` (default RUN_DIR/report); returns the
    summary's path."""
    out_dir = out_dir or run_dir / "report"
    records = read_metrics(run_dir)
    figures = build_figures(run_dir, records)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, fig in figures.items():
        fig.savefig(out_dir / name, dpi=110, bbox_inches="tight")
    summary = out_dir / SUMMARY_FILE
    summary.write_text(_summary(run_dir, records, list(figures)))
    return summary


# The summary's table: metric, how to read it.
_HEADLINES = (
    ("eval/accuracy", "held-out greedy accuracy"),
    ("reward/mean", "reward (mean)"),
    ("response/mean_tokens", "mean response tokens"),
    ("agent/turns_mean", "turns per episode"),
    ("agent/well_formed_call_frac", "turns whose tool calls were all well-formed"),
    ("actor/entropy", "entropy"),
    ("perf/gen_tokens_per_s", "generated tokens/s"),
    ("time/step_s", "seconds per step"),
)


def _summary(run_dir: Path, records: list[dict], images: list[str]) -> str:
    config_path = run_dir / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    algorithm = config.get("algorithm", {}).get("advantage", "?")
    model = config.get("model", {}).get("path", "?")
    last = records[-1]["step"]
    lines = [
        f"# Run report: {run_dir.name}",
        "",
        f"{algorithm} on `{model}`, {last} steps logged ({METRICS_FILE}).",
        "",
        "| metric | first | last | best |",
        "|---|---|---|---|",
    ]
    for key, label in _HEADLINES:
        _, values = _points(records, key)
        values = [v for v in values if math.isfinite(v)]
        if values:
            best = min(values) if key == "time/step_s" else max(values)
            lines.append(f"| {label} | {values[0]:.4g} | {values[-1]:.4g} | {best:.4g} |")
    lines += ["", *_expert_load_table(records)]
    for image in images:
        lines += [f"![{image.removesuffix('.png')}]({image})", ""]
    return "\n".join(lines)


_MOE_LAYER = re.compile(r"moe/layer(\d+)/max_load_ratio")


def _expert_load_table(records: list[dict]) -> list[str]:
    """Per MoE layer, over the run: its max/mean expert load (first, last, worst step), the
    share of assignments over capacity and its router losses; no lines when no layer was
    logged."""
    layers = sorted({int(m[1]) for r in records for key in r if (m := _MOE_LAYER.fullmatch(key))})
    if not layers:
        return []
    lines = [
        "## Expert load",
        "",
        "Load: max/mean, the busiest expert's routed tokens over the mean (1 = balanced). Over "
        "capacity: the share of assignments beyond ceil(k N / E) per forward (overloaded; the "
        "forward drops none).",
        "",
        "| layer | load first | load last | load worst | over capacity, last | balance loss first "
        "| balance loss last | z-loss first | z-loss last |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for layer in layers:
        ratio = _finite(records, f"moe/layer{layer}/max_load_ratio")
        over = _finite(records, f"moe/layer{layer}/overloaded_frac")
        balance = _finite(records, f"moe/layer{layer}/balance_loss")
        z = _finite(records, f"moe/layer{layer}/z_loss")
        cells = [
            *_first_last(ratio),
            _cell(max(ratio, default=None)),
            _cell(over[-1] if over else None),
            *_first_last(balance),
            *_first_last(z),
        ]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _finite(records: list[dict], key: str) -> list[float]:
    return [v for v in _points(records, key)[1] if math.isfinite(v)]


def _first_last(values: list[float]) -> list[str]:
    return [_cell(values[0] if values else None), _cell(values[-1] if values else None)]


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"
