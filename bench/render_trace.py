"""Draw a Tandem trace (rl.observe.trace's Chrome trace JSON) as a Gantt chart PNG.

    .venv/bin/python bench/render_trace.py TRACE.json OUT.png [--from SECONDS] [--to SECONDS]

One row per lane (in the trace's lane order), one colour per phase, x axis in seconds since the
trace started (rl.observe.trace_plot). --from/--to crop a window, so that a few steps can be shown
legibly. The title gives the window's overlap fraction (generation running while the trainer
works) and the seconds each phase was busy; the file holds no device map, so busy fraction is
not shown.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rl.observe.trace import load_chrome, load_lanes
from rl.observe.trace_plot import draw_trace


def main(argv: list[str] | None = None) -> None:
    """The command line (see the module docstring); `argv` defaults to sys.argv[1:]."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "trace", type=Path, help="trace JSON written by rl.observe.trace.Trace.write"
    )
    parser.add_argument("out", type=Path, help="PNG to write")
    parser.add_argument("--from", dest="start", type=float, default=0.0, help="window start, s")
    parser.add_argument("--to", dest="end", type=float, help="window end, s (default: last end)")
    args = parser.parse_args(argv)
    spans = load_chrome(args.trace)
    end = args.end if args.end is not None else max((s.end for s in spans), default=0.0)
    if end <= args.start:
        parser.error(f"empty window: --to ({end}) must be after --from ({args.start})")
    title = f"Tandem trace: {args.trace.name}"
    fig = draw_trace(spans, load_lanes(args.trace), title, args.start, end)
    fig.savefig(args.out, dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main()
