"""Where step metrics go: a JSONL file in the run directory, wandb, and the console: a progress
bar, or with `run.log_format=json` each record as one JSON line on stdout (messages as
{"message": ...}), for machines."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from tqdm import tqdm

from rl.config import Config

# The few numbers worth a glance on the console; everything goes to JSONL and wandb.
CONSOLE_KEYS = {
    "reward/mean": "reward",
    "eval/accuracy": "acc",
    "perf/gen_tokens_per_s": "tok/s",
    "time/step_s": "s/step",
}


class MetricsLogger:
    def __init__(self, cfg: Config, run_dir: Path, resume_step: int | None = None) -> None:
        """A fresh run starts a new metrics.jsonl (appending would mix two runs under one
        name); a run resumed at `resume_step` keeps the records up to that step and drops
        the later ones, which the interrupted run logged after its checkpoint."""
        self.path = run_dir / "metrics.jsonl"
        kept = []
        if resume_step is not None and self.path.exists():
            kept = [
                line
                for line in self.path.read_text().splitlines(keepends=True)
                if line.strip() and json.loads(line)["step"] <= resume_step
            ]
        self._file = self.path.open("w")
        self._file.writelines(kept)
        self._file.flush()
        self._wandb = None
        if cfg.run.wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wandb.init(
                project=cfg.run.wandb_project,
                name=cfg.run.name,
                dir=str(run_dir),
                mode=cfg.run.wandb_mode,
                config=cfg.model_dump(),
            )
        self._json = cfg.run.log_format == "json"
        self._bar = tqdm(
            total=cfg.run.num_steps,
            initial=resume_step or 0,
            desc=cfg.run.name,
            disable=self._json or not cfg.run.progress_bar,
        )
        self._postfix: dict[str, str] = {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record one step's flat `section/name` metrics; non-finite values are kept as null."""
        record = {
            "step": step,
            **{k: (v if math.isfinite(v) else None) for k, v in metrics.items()},
        }
        line = json.dumps(record)
        self._file.write(line + "\n")
        self._file.flush()
        if self._json:
            print(line, flush=True)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        for key, label in CONSOLE_KEYS.items():
            if key in metrics:
                self._postfix[label] = f"{metrics[key]:.3g}"
        if step > self._bar.n:
            self._bar.update(step - self._bar.n)
        self._bar.set_postfix(self._postfix, refresh=True)

    def print(self, message: str) -> None:
        """A console line that does not break the progress bar (a JSON object in json mode)."""
        if self._json:
            print(json.dumps({"message": message}), flush=True)
        else:
            self._bar.write(message)

    def close(self) -> None:
        self._bar.close()
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def is_measurement(key: str) -> bool:
    """Whether metric `key` measures the machine (wall time, throughput, memory) rather than
    the computation: only these differ between two runs of one seed, or a run and its
    resumption."""
    return key.startswith(("time/", "timing/", "perf/", "run/")) or key.endswith(
        ("_s", "_mb", "seconds")
    )
