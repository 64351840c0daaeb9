"""Time the main job and summarise where each step's seconds go.

    .venv/bin/python bench/demo.py [recipe] [key=value ...]

Runs `rl train` on the recipe (default: the demo) as a user would, then reads the run's
metrics.jsonl and the base checkpoint's base_info.json and prints a markdown table for
docs/benchmarks.md: base build time, total wall time, accuracy before/after, and seconds
per step split into generate / train / sync (busy seconds from the run's trace).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from scratch import clear_run

from rl.config.recipe import load_config

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> None:
    recipe = argv[0] if argv and "=" not in argv[0] else "recipes/grpo_addition_cpu.yaml"
    # Its own run directory: the user's demo run stays as it is.
    overrides = ["run.name=bench-demo", *(argv[1:] if argv and argv[0] == recipe else argv)]
    cfg = load_config(recipe, overrides)
    clear_run(cfg)
    base_existed = Path(cfg.model.path).exists()
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "rl.cli", "train", recipe, *overrides], cwd=REPO, check=True
    )
    wall_s = time.perf_counter() - start

    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0]
    evals = [r for r in records if r.get("eval/accuracy") is not None]
    base_info = json.loads((Path(cfg.model.path) / "base_info.json").read_text())

    def median(key: str) -> float:
        # At max_staleness 1 the last step has no generation of its own: no busy_s_generate.
        return statistics.median(r[key] for r in steps if key in r)

    rows = [
        ("recipe", f"`{recipe} {' '.join(overrides)}`".replace(" `", "`")),
        ("base build (SFT) s", "reused" if base_existed else f"{base_info['seconds']:.0f}"),
        ("base parameters", f"{base_info['num_parameters']:,}"),
        ("wall time s (incl. base build, Ray and engine start)", f"{wall_s:.0f}"),
        ("held-out greedy accuracy before", f"{evals[0]['eval/accuracy']:.1%}"),
        ("held-out greedy accuracy after", f"{evals[-1]['eval/accuracy']:.1%}"),
        ("GRPO steps", str(len(steps))),
        ("median s/step", f"{median('time/step_s'):.2f}"),
        ("  generate s (busy)", f"{median('perf/busy_s_generate'):.2f}"),
        ("  train s (busy)", f"{median('perf/busy_s_train'):.2f}"),
        ("  weight sync s", f"{median('time/sync_s'):.3f}"),
        ("median device-pool busy fraction", f"{median('perf/busy_fraction'):.0%}"),
        ("median overlap of generation and training", f"{median('perf/overlap_fraction'):.0%}"),
        ("median generated tokens/s", f"{median('perf/gen_tokens_per_s'):.0f}"),
    ]
    print("| metric | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main(sys.argv[1:])
