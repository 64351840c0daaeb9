"""What a run prints while it runs (run.log_format).

`progress`: on a terminal, two live lines that rich redraws: the run's bar with step i/N,
elapsed time and ETA, and under it the phases running now (generate, train, sync...) and the
last step's key numbers; the driver's messages print above them. Where stdout is not a terminal (`ray job submit`
logs, CI, a pipe) a redrawn line would be noise, so the same status is printed as one plain
line per step. `json`: each step's record and each message as one JSON object a line.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from datetime import timedelta

from rich.console import Console, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

# The few numbers worth a glance; everything goes to metrics.jsonl and the trackers.
_SHOWN = (
    ("reward/mean", "reward {:.3g}"),
    ("eval/accuracy", "acc {:.1%}"),
    ("perf/gen_tokens_per_s", "gen {:,.0f} tok/s"),
    ("timing/train_tokens_per_s", "train {:,.0f} tok/s"),
    ("time/step_s", "{:.2f} s/step"),
)


def eta_seconds(num_done: int, elapsed_s: float, num_left: int) -> float | None:
    """Seconds until the last step at the pace of the `num_done` steps so far (None before
    the first: no pace yet)."""
    return elapsed_s / num_done * num_left if num_done else None


def format_duration(seconds: float | None) -> str:
    return "-:--:--" if seconds is None else str(timedelta(seconds=round(seconds)))


def summary_text(values: dict[str, float | None]) -> str:
    """The shown numbers among `values`, e.g. 'reward 0.713 · acc 77.0% · 1.22 s/step'."""
    return " · ".join(
        template.format(values[key]) for key, template in _SHOWN if values.get(key) is not None
    )


class JsonConsole:
    """One JSON object a line: step records as written to metrics.jsonl, and messages."""

    def step(self, record: dict) -> None:
        print(json.dumps(record), flush=True)

    def message(self, text: str) -> None:
        print(json.dumps({"message": text}), flush=True)

    def phases(self, phases: list[str]) -> None:
        """Phases change too often for a line each; machines read them from trace.json."""

    def close(self) -> None:
        pass


class _TwoLineProgress(Progress):
    """The bar's line, and under it a status line that is cut rather than wrapped: a narrow
    terminal keeps the bar whole."""

    status = ""

    def get_renderables(self) -> Iterable[RenderableType]:
        yield self.make_tasks_table(self.tasks)
        yield Text(self.status, no_wrap=True, overflow="ellipsis")


class ProgressConsole:
    """Step i/N, ETA, the running phases and key numbers: live on a terminal, else a line a
    step. `console` and `clock` are for tests."""

    def __init__(
        self,
        name: str,
        num_steps: int,
        first_step: int = 0,
        console: Console | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._console = console or Console()
        self._num_steps, self._first_step, self._step = num_steps, first_step, first_step
        self._clock, self._start = clock, clock()
        self._shown: dict[str, float | None] = {}
        self._phases: list[str] = []
        self._progress: _TwoLineProgress | None = None
        if self._console.is_terminal:
            self._progress = _TwoLineProgress(
                TextColumn(name, markup=False),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("ETA {task.fields[eta]}"),
                console=self._console,
                refresh_per_second=4,
            )
            self._task = self._progress.add_task(
                name, total=num_steps, completed=first_step, eta=format_duration(None)
            )
            self._progress.start()

    def step(self, record: dict) -> None:
        step = record["step"]
        self._shown.update({key: record[key] for key, _ in _SHOWN if key in record})
        if step == 0:  # the evaluation before training: the pace is that of steps from here
            self._start = self._clock()
            return
        self._step = step
        eta = format_duration(self._eta())
        if self._progress is not None:
            self._progress.update(self._task, completed=step, eta=eta)
            self._progress.status = self._status()
        else:
            parts = (f"step {step}/{self._num_steps}", f"ETA {eta}", self._status())
            self._print(" · ".join(part for part in parts if part))

    def message(self, text: str) -> None:
        self._print(text)

    def phases(self, phases: list[str]) -> None:
        """The phases running now (rl.observe.trace reports each change); shown live only."""
        self._phases = phases
        if self._progress is not None:
            self._progress.status = self._status()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()

    def _eta(self) -> float | None:
        return eta_seconds(
            self._step - self._first_step,
            self._clock() - self._start,
            self._num_steps - self._step,
        )

    def _status(self) -> str:
        """The running phases (live only) and the last step's key numbers."""
        phases = ", ".join(self._phases) if self._progress is not None else ""
        return " · ".join(part for part in (phases, summary_text(self._shown)) if part)

    def _print(self, text: str) -> None:
        # markup off: paths and dicts in messages hold brackets rich would take for styles.
        self._console.print(text, markup=False, highlight=False, soft_wrap=True)
