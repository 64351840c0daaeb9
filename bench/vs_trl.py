"""Tandem against TRL's GRPOTrainer on the same workloads, one after the other on this
machine (`make bench`). TRL runs in .venv-bench (bench/trl/trl_grpo.py); both load the same
model directory and prompt files.

- throughput (bench/recipes/throughput_25m.yaml): a random ~25M-parameter Qwen2, 32 prompts
  x 8 samples, up to 128 new tokens ending at a sampled EOS; one warm-up step, then the
  timed ones. Tandem runs twice, synchronous (scheduler.max_staleness 0) and overlapped
  (max_staleness 1: step n+1 generates while step n trains). Seconds per step, generated
  tokens/s (over generation time and over the whole step), trained tokens/s (prompt +
  response tokens over training time), peak memory of the whole process tree (PSS,
  sampled), mean reward.
- time to accuracy (bench/recipes/time_to_accuracy.yaml): from the demo's ~1M SFT base, the
  training seconds (start-up and evaluations excluded) until held-out greedy accuracy on the
  same 500 prompts first reaches 80%.

    .venv/bin/python bench/vs_trl.py [--only throughput|accuracy] [--dtype float32] [--write-docs]

--dtype replaces both recipes' compute dtype on both sides, for a CPU without native bf16
matmuls (no AVX-512 BF16 or AMX), where bf16 is emulated and measures the emulation.

Prints the tables, keeps the raw results in .cache/bench/vs_trl.json, and with
--write-docs replaces the section between the markers in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
from docs_section import write_section
from scratch import clear_run

from rl.config.recipe import load_config
from rl.data.loading import prepare_splits

REPO = Path(__file__).resolve().parents[1]
TRL_PYTHON = REPO / ".venv-bench" / "bin" / "python"
RESULTS = REPO / ".cache" / "bench" / "vs_trl.json"
THROUGHPUT, ACCURACY = "bench/recipes/throughput_25m.yaml", "bench/recipes/time_to_accuracy.yaml"
TARGET_ACCURACY = 0.8


class TreeMemory:
    """The peak, over samples every `period_s`, of the summed proportional set size of a
    process and its descendants (Tandem's driver starts Ray and its workers as children):
    shared pages count once, split among the processes sharing them. A sample reads every
    process's /proc/PID/smaps, about 8 ms for a process holding torch: at 0.5 s over Tandem's
    15 processes that took a fifth of a core from the run it measured, hence 5 s."""

    def __init__(self, pid: int, period_s: float = 5.0) -> None:
        self.peak_mib = 0.0
        self._root, self._period = psutil.Process(pid), period_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(self._period):
            total = 0
            try:
                processes = [self._root, *self._root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for process in processes:
                try:
                    total += process.memory_full_info().pss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            self.peak_mib = max(self.peak_mib, total / (1 << 20))

    def stop(self) -> float:
        self._done.set()
        self._thread.join()
        return self.peak_mib


def run_measured(
    command: list[str], stop_when=None, log: Path | None = None
) -> tuple[str, float, float]:
    """Run `command` from the repo root; returns (stdout, wall seconds, peak tree MiB).
    `stop_when()` is polled each second: once true, the process gets SIGTERM (Tandem then
    stops after its current step)."""
    start = time.perf_counter()
    stderr = log.open("w") if log else subprocess.DEVNULL
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, text=True)
    memory = TreeMemory(process.pid)
    out_lines: list[str] = []
    reader = threading.Thread(target=lambda: out_lines.extend(process.stdout), daemon=True)
    reader.start()
    while process.poll() is None:
        time.sleep(1.0)
        if stop_when is not None and stop_when():
            process.send_signal(signal.SIGTERM)
            stop_when = None
    reader.join()
    peak = memory.stop()
    if process.returncode not in (0, -signal.SIGTERM):
        raise RuntimeError(f"{command[:4]} exited {process.returncode}; see {log}")
    return "".join(out_lines), time.perf_counter() - start, peak


def fresh_tandem_records(recipe: str, overrides: list[str]) -> Path:
    """The metrics.jsonl the run will write, its directory cleared of an earlier run's."""
    return clear_run(load_config(recipe, overrides)) / "metrics.jsonl"


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def build_base(recipe: str) -> Path:
    """The recipe's base, built on first use and then reused (the two systems and later
    runs start from the same weights)."""
    path = Path(load_config(recipe, []).model.path)
    if not path.exists():
        subprocess.run([sys.executable, "-m", "rl.cli", "build-base", recipe], cwd=REPO, check=True)
    return path


def data_file(recipe: str, split: str) -> Path:
    """The recipe's generated split, the file its Tandem run reads."""
    return prepare_splits(load_config(recipe, []).data)[split]


class NewRecords:
    """Each call: the records appended to a metrics.jsonl since the last call. Polled every
    second through a run of thousands of steps, so it reads only the new lines: parsing the
    whole file each time took a growing share of the two cores the run was measured on."""

    def __init__(self, path: Path) -> None:
        self._path, self._offset = path, 0

    def __call__(self) -> list[dict]:
        if not self._path.exists():
            return []
        with self._path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line being written waits for next time
        self._offset += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()]


def run_tandem(recipe: str, overrides: list[str], stop_when_accuracy: float | None = None):
    metrics = fresh_tandem_records(recipe, overrides)
    stop = None
    if stop_when_accuracy is not None:
        new_records = NewRecords(metrics)

        def stop() -> bool:
            return any(
                r["step"] > 0 and (r.get("eval/accuracy") or 0) >= stop_when_accuracy
                for r in new_records()
            )

    command = [sys.executable, "-m", "rl.cli", "train", recipe, *overrides]
    _, wall, peak = run_measured(command, stop, REPO / ".cache" / "bench" / "tandem.log")
    return read_records(metrics), wall, peak


def run_trl(args: list[str]) -> tuple[dict, float, float]:
    if not TRL_PYTHON.exists():
        raise SystemExit(f"{TRL_PYTHON} is missing: `make bench` creates the benchmark venv")
    command = [str(TRL_PYTHON), "bench/trl/trl_grpo.py", *args]
    out, wall, peak = run_measured(command, log=REPO / ".cache" / "bench" / "trl.log")
    return json.loads(out.strip().splitlines()[-1]), wall, peak


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def tandem_steps(records: list[dict]) -> list[dict]:
    """Tandem's metrics.jsonl records as the steps both systems are summarised from; a
    step's seconds leave out the evaluation it ran, as TRL's do. A step that generated
    nothing in its own window (the last of a run at max_staleness 1) has no generate time."""
    return [
        {
            "step": r["step"],
            "seconds": r["time/step_s"] - r.get("perf/busy_s_eval", 0.0),
            "generate_seconds": r.get("perf/busy_s_generate", 0.0),
            "generated_tokens": r["rollout/tokens"],
            "train_seconds": r["timing/train_step_s"],
            "trained_tokens": r["timing/train_tokens_per_s"] * r["timing/train_step_s"],
            "reward": r["reward/mean"],
            **({"accuracy": r["eval/accuracy"]} if "eval/accuracy" in r else {}),
        }
        for r in records
        if r["step"] > 0
    ]


def trl_steps(result: dict) -> list[dict]:
    """bench/trl/trl_grpo.py's steps; what is not generation counts as training."""
    return [r | {"train_seconds": r["seconds"] - r["generate_seconds"]} for r in result["steps"]]


def throughput_summary(all_steps: list[dict], warmup: int) -> dict:
    steps = [r for r in all_steps if r["step"] > warmup]

    def total(key: str) -> float:
        return sum(r[key] for r in steps)

    return {
        "timed_steps": len(steps),
        "seconds_per_step": _mean([r["seconds"] for r in steps]),
        "generated_tokens_per_step": _mean([r["generated_tokens"] for r in steps]),
        "generate_tokens_per_s": total("generated_tokens") / total("generate_seconds"),
        "step_tokens_per_s": total("generated_tokens") / total("seconds"),
        "train_tokens_per_s": total("trained_tokens") / total("train_seconds"),
        "reward": _mean([r["reward"] for r in steps]),
    }


def trl_workload(recipe: str, overrides: list[str], model: Path, num_steps: int) -> list[str]:
    """bench/trl/trl_grpo.py's arguments for `recipe`'s workload, as its Tandem run has it:
    prompts, batch shape, learning rate, response length and compute dtype."""
    cfg = load_config(recipe, overrides)
    return [
        *("--model", str(model), "--data", str(data_file(recipe, "train"))),
        *("--steps", str(num_steps), "--prompts-per-step", str(cfg.run.prompts_per_step)),
        *("--group-size", str(cfg.algorithm.group_size), "--lr", str(cfg.trainer.lr)),
        *("--max-new-tokens", str(cfg.rollout.max_new_tokens), "--dtype", cfg.model.dtype),
    ]


TANDEM_RUNS = {"tandem": 0, "tandem_k1": 1}  # result key: scheduler.max_staleness


def throughput(num_steps: int, warmup: int, overrides: list[str]) -> dict:
    model = build_base(THROUGHPUT)
    total = num_steps + warmup
    results = {}
    for key, k in TANDEM_RUNS.items():
        # At max_staleness k a run's last k steps generate nothing ahead (there is no later
        # step), so they are run but not timed: every timed step pays for the generation it
        # overlaps, as in a longer run.
        records, wall, peak = run_tandem(
            THROUGHPUT, [*overrides, f"run.num_steps={total + k}", f"scheduler.max_staleness={k}"]
        )
        timed = [r for r in tandem_steps(records) if r["step"] <= total]
        results[key] = throughput_summary(timed, warmup) | {"wall_s": wall, "peak_mib": peak}
    trl_args = [*trl_workload(THROUGHPUT, overrides, model, total), "--micro-batch-size", "64"]
    result, wall, peak = run_trl(trl_args)
    results["trl"] = throughput_summary(trl_steps(result), warmup) | {
        "wall_s": wall,
        "peak_mib": peak,
    }
    return results | {"num_parameters": result["num_parameters"]}


def time_to(steps: list[dict], target: float) -> dict:
    """Training seconds (evaluations excluded) until the first evaluation at `target`, and
    the best evaluation up to then (all of them when none reached it)."""
    seconds, best = 0.0, {"best_accuracy": 0.0, "best_step": None}
    for r in steps:
        seconds += r["seconds"]
        if r.get("accuracy", 0.0) > best["best_accuracy"]:
            best = {"best_accuracy": r["accuracy"], "best_step": r["step"]}
        if r.get("accuracy", 0.0) >= target:
            return {"step": r["step"], "seconds": seconds, "accuracy": r["accuracy"]} | best
    return {"step": None, "seconds": seconds, "accuracy": None} | best | {"num_steps": len(steps)}


def time_to_accuracy(target: float, overrides: list[str]) -> dict:
    cfg = load_config(ACCURACY, overrides)
    model = build_base(ACCURACY)
    records, _, _ = run_tandem(ACCURACY, overrides, stop_when_accuracy=target)
    tandem = time_to(tandem_steps(records), target) | {"before": records[0]["eval/accuracy"]}
    trl_args = [
        *trl_workload(ACCURACY, overrides, model, cfg.run.num_steps),
        *("--eval-data", str(data_file(ACCURACY, "test"))),
        *("--num-eval-prompts", str(cfg.run.num_eval_prompts)),
        *("--eval-every", str(cfg.run.eval_every), "--target-accuracy", str(target)),
        *("--micro-batch-size", str(cfg.run.prompts_per_step * cfg.algorithm.group_size)),
    ]
    result, _, _ = run_trl(trl_args)
    trl = time_to(trl_steps(result), target) | {"before": result["before"]["accuracy"]}
    return {"tandem": tandem, "trl": trl, "target": target}


def throughput_table(r: dict) -> str:
    rows = [
        ("seconds per step", "seconds_per_step", "{:.2f}", False),
        ("generated tokens per step", "generated_tokens_per_step", "{:,.0f}", None),
        ("generated tokens/s (generation time)", "generate_tokens_per_s", "{:,.0f}", True),
        ("generated tokens/s (whole step)", "step_tokens_per_s", "{:,.0f}", True),
        ("trained tokens/s (training time)", "train_tokens_per_s", "{:,.0f}", True),
        ("peak memory, process tree PSS (MiB)", "peak_mib", "{:,.0f}", False),
        ("mean reward (timed steps)", "reward", "{:.3f}", None),
        ("wall time incl. start-up (s)", "wall_s", "{:.0f}", False),
    ]
    lines = [
        "| metric | Tandem k = 0 | Tandem k = 1 | TRL | k = 0 / TRL | k = 1 / TRL |",
        "|---|---|---|---|---|---|",
    ]
    trl = r["trl"]
    for label, key, fmt, higher_is_better in rows:
        cells = [fmt.format(r[side][key]) for side in (*TANDEM_RUNS, "trl")]
        ratios = [
            f"{r[side][key] / trl[key]:.2f}x" if higher_is_better is not None and trl[key] else "-"
            for side in TANDEM_RUNS
        ]
        lines.append(f"| {label} | {' | '.join(cells)} | {' | '.join(ratios)} |")
    per_hour = [
        f"**{trl['seconds_per_step'] / r[side]['seconds_per_step']:.2f}x**" for side in TANDEM_RUNS
    ]
    lines.append(f"| **steps per hour, Tandem / TRL** | | | | {' | '.join(per_hour)} |")
    return "\n".join(lines)


def accuracy_table(r: dict) -> str:
    def cell(side: dict) -> str:
        if side["step"] is None:
            return (
                f"not reached in {side['num_steps']} steps, {side['seconds']:.0f} s (best "
                f"{side['best_accuracy']:.1%}, step {side['best_step']})"
            )
        return f"{side['seconds']:.0f} s (step {side['step']}, {side['accuracy']:.1%})"

    tandem, trl = r["tandem"], r["trl"]
    return "\n".join(
        [
            "| | Tandem | TRL | Tandem / TRL |",
            "|---|---|---|---|",
            f"| held-out greedy accuracy before | {tandem['before']:.1%} | {trl['before']:.1%} | |",
            f"| training time to {r['target']:.0%} | {cell(tandem)} | {cell(trl)} | "
            f"{time_ratio(tandem, trl)} |",
        ]
    )


def time_ratio(tandem: dict, trl: dict) -> str:
    """Tandem's time to the target over TRL's; a bound when one side never reached it (its
    time is then more than all the seconds it ran)."""
    ratio = f"{tandem['seconds'] / trl['seconds']:.2f}x"
    if tandem["step"] and trl["step"]:
        return f"**{ratio}**"
    if tandem["step"]:
        return f"**< {ratio}**"
    if trl["step"]:
        return f"> {ratio}"
    return "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("throughput", "accuracy"))
    parser.add_argument("--steps", type=int, default=5, help="timed throughput steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), help="default: the recipe's")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    overrides = [f"model.dtype={args.dtype}"] if args.dtype else []
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if args.only in (None, "throughput"):
        results["throughput"] = throughput(args.steps, args.warmup, overrides)
    if args.only in (None, "accuracy"):
        results["accuracy"] = time_to_accuracy(TARGET_ACCURACY, overrides)
    RESULTS.write_text(json.dumps(results, indent=2))
    sections = []
    if "throughput" in results:
        n = results["throughput"]["num_parameters"]
        sections.append(
            f"Throughput: `{THROUGHPUT}` ({n / 1e6:.1f}M parameters), {args.warmup} warm-up "
            f"step, then {args.steps} timed.\n\n{throughput_table(results['throughput'])}"
        )
    if "accuracy" in results:
        sections.append(f"Time to accuracy: `{ACCURACY}`.\n\n{accuracy_table(results['accuracy'])}")
    command = " ".join(["bench/vs_trl.py", *(["--dtype", args.dtype] if args.dtype else [])])
    text = (
        f"Command: `.venv/bin/python {command} --write-docs`, {time.strftime('%Y-%m-%d')}, "
        f"{os.cpu_count()} CPU cores, compute dtype {args.dtype or 'as the recipes'}.\n\n"
        + "\n\n".join(sections)
    )
    print(text)
    if args.write_docs:
        write_section("vs_trl", text)


if __name__ == "__main__":
    main()
