"""bench/carry_over.py's summaries of a run's metrics records, which the published carry/abort
comparison is made of."""

from __future__ import annotations

import pytest

from tests.unit.bench.bench_modules import load_bench_module

carry_over = load_bench_module("carry_over")


def _step(step: int, seconds: float, reward: float, **extra: float) -> dict:
    return {
        "step": step,
        "time/step_s": seconds,
        "reward/mean": reward,
        "perf/busy_fraction": 0.5,
        "perf/overlap_fraction": 0.25,
        "response/mean_tokens": 10.0,
        **extra,
    }


def test_timings_leave_out_evaluations_and_accuracy_keeps_every_one() -> None:
    records = [
        {"step": 0, "eval/accuracy": 0.2},
        _step(1, 1.0, 0.0),
        _step(2, 9.0, 0.5, **{"eval/accuracy": 0.4}),  # evaluated: not timed
        _step(3, 2.0, 1.0),
        _step(4, 4.0, 1.0),
    ]
    summary = carry_over.summarize(records, wall_s=30.0)
    assert summary["s_per_step"] == 2.0  # median of 1, 2, 4
    assert summary["steps_per_hour"] == 1800.0
    assert summary["accuracy"] == {0: 0.2, 2: 0.4}
    assert summary["reward"] == pytest.approx(2.5 / 4)  # every trained step, not step 0
    assert summary["busy"] == 0.5 and summary["overlap"] == 0.25
    assert summary["carry"]["carry/carried_groups"] is None  # not a carry run


def test_reward_over_the_last_steps_and_carry_means_skip_steps_without_them() -> None:
    records = [_step(s, 1.0, float(s >= 6)) for s in range(1, 16)]
    for record, share in zip(records, [0.1, 0.3], strict=False):
        record["carry/stale_token_share"] = share
    del records[-1]["perf/busy_fraction"]  # the last overlapped step generated nothing
    summary = carry_over.summarize(records, wall_s=1.0)
    assert summary["reward_last"] == 1.0  # steps 6..15
    assert summary["reward"] == pytest.approx(10 / 15)
    assert summary["carry"]["carry/stale_token_share"] == pytest.approx(0.2)
    assert summary["busy"] == 0.5


def test_overrides_from_the_command_line_come_last() -> None:
    overrides = carry_over.run_overrides("carry", 1, 40, ["scheduler.abort_every=64"])
    assert "scheduler.partial_rollout=carry" in overrides
    assert "run.eval_every=10" in overrides and "scheduler.max_staleness=1" in overrides
    assert overrides[-1] == "scheduler.abort_every=64"
    assert overrides.index("scheduler.abort_every=auto") < len(overrides) - 1


def test_tables_compare_with_abort_and_show_the_carry_bias() -> None:
    def summary(s_per_step: float, carry: dict) -> dict:
        return {
            "s_per_step": s_per_step,
            "busy": 0.5,
            "overlap": 0.25,
            "reward": 0.5,
            "reward_last": 0.75,
            "response_tokens": 12.0,
            "accuracy": {0: 0.1, 10: 0.3},
            "carry": carry,
            "wall_s": 100.0,
        }

    empty = dict.fromkeys(carry_over.CARRY_METRICS)
    bias = {**empty, "carry/trained_mean_tokens": 9.0, "carry/finished_mean_tokens": 12.0}
    text = carry_over.tables(
        {("demo", "abort"): [summary(3.0, empty)], ("demo", "carry"): [summary(2.0, bias)]}, [0]
    )
    assert "| demo | carry | 2.000 (2.000) | 1,800 | 1.50x | 50% | 25% |" in text
    assert "| demo | abort | 0 | 0.500, 0.750 | 12.0 | 0: 10.0%, 10: 30.0% | 100 |" in text
    assert "| demo | 0 | 9.0 / 12.0 (0.75) | - | - | - | - |" in text


def test_stream_is_abort_at_the_same_k_with_the_trainer_streaming() -> None:
    stream = carry_over.run_overrides("stream", 1, 40, [])
    abort = carry_over.run_overrides("abort", 1, 40, [])
    assert "scheduler.partial_rollout=abort" in stream and "scheduler.max_staleness=1" in stream
    assert "scheduler.streaming=true" in stream and "scheduler.streaming=false" in abort
    assert set(stream) ^ set(abort) == {"scheduler.streaming=true", "scheduler.streaming=false"}
