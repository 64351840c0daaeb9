"""A local judge against the rollout it scores, on the demo's shapes (64 prompts x 8 samples
a step, 3-digit addition, up to 8 new tokens).

    .venv/bin/python bench/judge.py [--engines torch vllm] [--rounds 3] [--steps 30]
                                    [--skip-throughput] [--skip-runs]

Part 1, the judge alone: the judge term of recipes/judge_addition_cpu.yaml (the demo's SFT
base reading the recipe's rubric, 2 new tokens) in a RewardScorer with its actor on a local
Ray of 2 CPUs, cache off, on one step's 512 rendered inputs: as a run calls it (64 calls of one
group of 8) and as one call of the whole step; judgements per second for each engine.

Part 2, the runs: `rl train` of the demo recipe and of the judge recipe, --steps each,
overlapped (k = 1) as the recipes are; per run the median seconds per step (after the first
3), the rollout's samples per second of generation time, the reward lane's busy seconds per
step, and the share of the reward lane's busy time during which a rollout worker was
generating: 0 would mean the scheduler stalls while the judge works.

Prints markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from scratch import clear_run

REPO = Path(__file__).resolve().parents[1]
DEMO = "recipes/grpo_addition_cpu.yaml"
JUDGE = "recipes/judge_addition_cpu.yaml"
PROMPTS, GROUP = 64, 8


def step_inputs(seed: int = 0) -> tuple[list[str], list[str], list[dict]]:
    """One step's prompts, responses and examples: 64 sums, 8 responses each, half right."""
    rng = random.Random(seed)
    prompts, responses, examples = [], [], []
    for _ in range(PROMPTS):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        example = {"prompt": f"{a}+{b}", "answer": str(a + b).zfill(4)}
        for _ in range(GROUP):
            wrong = rng.random() < 0.5
            response = str(a + b + (rng.choice([-10, -1, 1, 100]) if wrong else 0)).zfill(4)
            prompts.append(example["prompt"])
            responses.append(response)
            examples.append(example)
    return prompts, responses, examples


def judge_throughput(engine: str, rounds: int) -> tuple[float, float]:
    """(judgements/s called a group at a time, judgements/s called a step at a time)."""
    import ray

    from rl.config import RewardConfig
    from rl.config.recipe import load_config
    from rl.data.tasks import get_task
    from rl.rewards import RewardScorer

    cfg = load_config(REPO / JUDGE)
    judge_term = next(t for t in cfg.reward.terms if t.judge is not None)
    judge_term.judge.engine = engine
    judge_term.judge.cache_size = 0
    judge_term.judge.max_concurrency = PROMPTS * GROUP
    reward = RewardConfig(terms=[judge_term])
    prompts, responses, examples = step_inputs()
    n = len(responses)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with RewardScorer(reward, get_task("addition"), judge_options={"num_cpus": 1}) as scorer:
            scorer.score(prompts[:GROUP], responses[:GROUP], examples[:GROUP])  # warm
            per_group, per_step = [], []
            for _ in range(rounds):
                start = time.perf_counter()
                for g in range(0, n, GROUP):
                    part = slice(g, g + GROUP)
                    scorer.score(prompts[part], responses[part], examples[part])
                per_group.append(n / (time.perf_counter() - start))
                start = time.perf_counter()
                scorer.score(prompts, responses, examples)
                per_step.append(n / (time.perf_counter() - start))
    finally:
        ray.shutdown()
    return statistics.median(per_group), statistics.median(per_step)


def run(recipe: str, name: str, steps: int) -> dict[str, float]:
    """`rl train` a recipe for `steps` steps; its medians and the reward lane's overlap."""
    from rl.config.recipe import load_config
    from rl.observe.trace import covered_seconds, load_chrome

    args = [f"run.name={name}", f"run.num_steps={steps}", "run.eval_every=0"]
    args += ["run.num_eval_prompts=0", "run.wandb_mode=disabled", "run.export_hf=false"]
    cfg = load_config(REPO / recipe, args)
    run_dir = clear_run(cfg)
    subprocess.run([sys.executable, "-m", "rl.cli", "train", recipe, *args], cwd=REPO, check=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_after = [r for r in records if r["step"] > 3]
    spans = load_chrome(run_dir / "trace.json")
    generating = [(s.start, s.end) for s in spans if s.phase == "generate"]
    rewarding = [(s.start, s.end) for s in spans if s.lane == "reward"]
    busy = sum(end - start for start, end in rewarding)
    during = sum(covered_seconds(generating, start, end) for start, end in rewarding)
    samples = PROMPTS * GROUP
    return {
        "s_per_step": statistics.median(r["time/step_s"] for r in steps_after),
        "samples_per_gen_s": statistics.median(
            samples / r["perf/busy_s_generate"]
            for r in steps_after
            if r.get("perf/busy_s_generate")
        ),
        "reward_s": statistics.median(r.get("perf/busy_s_reward", 0.0) for r in steps_after),
        "generating_while_scoring": during / busy if busy else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", nargs="+", default=["torch", "vllm"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip-runs", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    if not args.skip_throughput:
        print(
            "| judge engine | judgements/s, a group (8) a call | judgements/s, a step (512) a call |"
        )
        print("|---|---:|---:|")
        for engine in args.engines:
            group, step = judge_throughput(engine, args.rounds)
            print(f"| {engine} | {group:,.0f} | {step:,.0f} |", flush=True)
        print()
    if args.skip_runs:
        return
    print(
        "| run | s/step | rollout samples/s of generation | reward lane busy s/step | generating while scoring |"
    )
    print("|---|---:|---:|---:|---:|")
    for recipe, name in ((DEMO, "bench-judge-demo"), (JUDGE, "bench-judge-judged")):
        m = run(recipe, name, args.steps)
        print(
            f"| {recipe} | {m['s_per_step']:.2f} | {m['samples_per_gen_s']:,.0f} | "
            f"{m['reward_s']:.2f} | {m['generating_while_scoring']:.0%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
