"""Where step metrics go: always `metrics.jsonl` in the run directory (schema in
docs/metrics.md), the trackers the run asks for (rl.observe.trackers: wandb, tensorboard), and the
console (rl.observe.console: a live progress display, a line a step, or JSON lines)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rl.config import Config
from rl.observe.console import JsonConsole, ProgressConsole
from rl.observe.trackers import open_trackers


class MetricsLogger:
    def __init__(self, cfg: Config, run_dir: Path, resume_step: int | None = None) -> None:
        """A fresh run starts a new metrics.jsonl (its directory is its own: rl.run.directory).
        A run continued after step `resume_step` (a resume, or a fault restart: -1 when it
        starts over) keeps the records up to that step, so the file reads as the run's one
        timeline, and appends the later ones, which the interrupted attempt logged after its
        checkpoint, to metrics.replaced.jsonl: nothing logged is lost."""
        self.path = run_dir / "metrics.jsonl"
        kept = []
        if resume_step is not None and self.path.exists():
            lines = [line for line in self.path.read_text().splitlines(keepends=True) if line]
            kept = [line for line in lines if json.loads(line)["step"] <= resume_step]
            replaced = [line for line in lines if json.loads(line)["step"] > resume_step]
            if replaced:
                with (run_dir / "metrics.replaced.jsonl").open("a") as f:
                    f.writelines(replaced)
        self._file = self.path.open("w")
        self._file.writelines(kept)
        self._file.flush()
        if cfg.run.log_format == "json":
            self.console: JsonConsole | ProgressConsole = JsonConsole()
        else:
            self.console = ProgressConsole(
                cfg.run.name, cfg.run.num_steps, max(resume_step or 0, 0)
            )
        self._trackers = open_trackers(cfg, run_dir, resume_step)
        for tracker in self._trackers:
            self.console.message(tracker.where())

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record one step's flat `section/name` metrics; non-finite values are kept as null."""
        record = {
            "step": step,
            **{k: (v if math.isfinite(v) else None) for k, v in metrics.items()},
        }
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for tracker in self._trackers:
            tracker.log(step, metrics)
        self.console.step(record)

    def print(self, message: str) -> None:
        """A console line that leaves the progress display intact (a JSON object in json
        mode)."""
        self.console.message(message)

    def show_phases(self, phases: list[str]) -> None:
        """The phases running now, for the live display (a rl.observe.trace listener)."""
        self.console.phases(phases)

    def close(self) -> None:
        self.console.close()
        self._file.close()
        for tracker in self._trackers:
            tracker.close()


def is_measurement(key: str) -> bool:
    """Whether metric `key` measures the machine (wall time, throughput, memory) rather than
    the computation: only these differ between two runs of one seed, or a run and its
    resumption."""
    return key.startswith(("time/", "timing/", "perf/", "run/")) or key.endswith(
        ("_s", "_mb", "seconds")
    )
