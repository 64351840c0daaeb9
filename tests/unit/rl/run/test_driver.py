"""The driver's evaluation callbacks, with the rollout and the logger faked."""

from __future__ import annotations

import pytest

from rl.config import Config
from rl.observe.trace import Trace
from rl.run import driver
from rl.types import SamplingParams


class _Rollout:
    def __init__(self) -> None:
        self.generated: list[list[list[int]]] = []

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list:
        self.generated.append(prompts)
        return []

    def peak_memory_mb(self) -> float:
        return 0.0


class _Logger:
    def __init__(self) -> None:
        self.records: list[tuple[int, dict[str, float]]] = []
        self.lines: list[str] = []

    def print(self, line: str) -> None:
        self.lines.append(line)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.records.append((step, metrics))


def _loop(num_eval_prompts: int, test_examples: list[dict]) -> tuple[driver._Loop, _Rollout]:
    cfg = Config(
        model={"path": "unused"},
        run={"num_steps": 4, "eval_every": 2, "num_eval_prompts": num_eval_prompts},
    )
    rollout, logger = _Rollout(), _Logger()
    trace = Trace({"rollout0": [0]})
    loop = driver._Loop(cfg, rollout, None, None, test_examples, None, trace, logger)
    return loop, rollout


def test_no_eval_prompts_turns_evaluation_off_and_step_0_still_logs_the_data_counts() -> None:
    # _Data.of keeps the first run.num_eval_prompts held-out examples: none.
    loop, rollout = _loop(num_eval_prompts=0, test_examples=[])
    assert loop.accuracy_before({"data/test_skipped_rows": 3.0}) is None
    assert [loop.on_version(version) for version in range(1, 5)] == [{}] * 4
    assert rollout.generated == []
    assert loop.logger.records == [
        (0, {"data/test_skipped_rows": 3.0, "memory/rollout_peak_mb": 0.0})
    ]
    assert not any("accuracy" in line for line in loop.logger.lines)


def test_evaluation_runs_at_start_every_eval_every_versions_and_at_the_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []
    monkeypatch.setattr(driver, "evaluate", lambda *args: calls.append(args) or 0.25)
    loop, _ = _loop(num_eval_prompts=2, test_examples=[{"prompt": "1+1"}, {"prompt": "2+2"}])
    assert loop.accuracy_before({}) == 0.25
    assert loop.logger.records == [(0, {"eval/accuracy": 0.25, "memory/rollout_peak_mb": 0.0})]
    versions = [version for version in range(1, 5) if loop.on_version(version)]
    assert versions == [2, 4] and len(calls) == 3
