"""bench/vs_trl.py's summaries, which decide the published Tandem/TRL ratios."""

from __future__ import annotations

import pytest

from tests.unit.bench.bench_modules import load_bench_module

vs_trl = load_bench_module("vs_trl")


def _record(step: int, eval_s: float | None = None, accuracy: float | None = None) -> dict:
    record = {
        "step": step,
        "time/step_s": 10.0,
        "perf/busy_s_generate": 4.0,
        "rollout/tokens": 400.0,
        "timing/train_step_s": 5.0,
        "timing/train_tokens_per_s": 100.0,
        "reward/mean": 0.5,
    }
    if eval_s is not None:
        record["perf/busy_s_eval"] = eval_s
    if accuracy is not None:
        record["eval/accuracy"] = accuracy
    return record


def test_tandem_steps_leave_out_evaluations_and_the_step_zero_record():
    steps = vs_trl.tandem_steps([_record(0, 2.0, 0.3), _record(1), _record(2, 3.0, 0.6)])
    assert [s["step"] for s in steps] == [1, 2]
    assert [s["seconds"] for s in steps] == [10.0, 7.0]
    assert steps[1]["accuracy"] == 0.6 and "accuracy" not in steps[0]
    assert steps[0]["trained_tokens"] == pytest.approx(500.0)


def test_a_step_that_generated_nothing_in_its_window_has_no_generate_time():
    """The last step of a run at max_staleness 1 trains on samples generated a step before."""
    last = _record(2)
    del last["perf/busy_s_generate"]
    steps = vs_trl.tandem_steps([_record(1), last])
    assert [s["generate_seconds"] for s in steps] == [4.0, 0.0]


def test_throughput_summary_skips_warmup_and_divides_totals():
    steps = [
        {"step": 1, "seconds": 99.0, "generated_tokens": 1, "generate_seconds": 1.0,
         "train_seconds": 1.0, "trained_tokens": 1, "reward": 9.0},
        {"step": 2, "seconds": 10.0, "generated_tokens": 300, "generate_seconds": 3.0,
         "train_seconds": 6.0, "trained_tokens": 600, "reward": 0.25},
        {"step": 3, "seconds": 20.0, "generated_tokens": 100, "generate_seconds": 1.0,
         "train_seconds": 14.0, "trained_tokens": 400, "reward": 0.75},
    ]  # fmt: skip
    summary = vs_trl.throughput_summary(steps, warmup=1)
    assert summary["timed_steps"] == 2
    assert summary["seconds_per_step"] == 15.0
    assert summary["generate_tokens_per_s"] == 100.0  # 400 tokens in 4 s, not a mean of rates
    assert summary["step_tokens_per_s"] == pytest.approx(400 / 30)
    assert summary["train_tokens_per_s"] == 50.0
    assert summary["reward"] == 0.5


def test_trl_steps_count_what_is_not_generation_as_training():
    result = {"steps": [{"step": 1, "seconds": 9.0, "generate_seconds": 4.0}]}
    assert vs_trl.trl_steps(result)[0]["train_seconds"] == 5.0


def _steps(accuracies: list[float | None]) -> list[dict]:
    return [
        {"step": i + 1, "seconds": 2.0, **({} if a is None else {"accuracy": a})}
        for i, a in enumerate(accuracies)
    ]


def test_time_to_counts_training_seconds_up_to_the_first_evaluation_at_target():
    reached = vs_trl.time_to(_steps([None, 0.7, None, 0.81, 0.9]), target=0.8)
    assert reached == {
        "step": 4, "seconds": 8.0, "accuracy": 0.81, "best_accuracy": 0.81, "best_step": 4
    }  # fmt: skip


def test_time_to_reports_the_best_evaluation_when_the_target_is_never_reached():
    missed = vs_trl.time_to(_steps([0.5, None, 0.62, 0.55]), target=0.8)
    assert missed["step"] is None and missed["seconds"] == 8.0
    assert (missed["best_accuracy"], missed["best_step"], missed["num_steps"]) == (0.62, 3, 4)
    row = vs_trl.accuracy_table(
        {"tandem": missed | {"before": 0.4}, "trl": missed | {"before": 0.4}, "target": 0.8}
    )
    assert "not reached in 4 steps, 8 s (best 62.0%, step 3)" in row


def test_the_time_ratio_is_a_bound_when_only_one_side_reaches_the_target():
    reached = vs_trl.time_to(_steps([0.5, 0.81]), target=0.8)  # 4 s
    missed = vs_trl.time_to(_steps([0.5, 0.6, 0.7, 0.79]), target=0.8)  # 8 s, never
    assert vs_trl.time_ratio(reached, missed) == "**< 0.50x**"
    assert vs_trl.time_ratio(missed, reached) == "> 2.00x"
    assert vs_trl.time_ratio(reached, reached) == "**1.00x**"
    assert vs_trl.time_ratio(missed, missed) == "-"


def test_trl_gets_the_recipes_workload_and_compute_dtype(tmp_path):
    args = vs_trl.trl_workload(vs_trl.THROUGHPUT, [], tmp_path, num_steps=6)
    options = dict(zip(args[::2], args[1::2], strict=True))
    cfg = vs_trl.load_config(vs_trl.THROUGHPUT, [])
    assert options["--steps"] == "6"
    assert options["--prompts-per-step"] == str(cfg.run.prompts_per_step)
    assert options["--group-size"] == str(cfg.algorithm.group_size)
    assert options["--max-new-tokens"] == str(cfg.rollout.max_new_tokens)
    assert options["--dtype"] == cfg.model.dtype == "bfloat16"


def test_a_dtype_override_reaches_trl_as_it_reaches_tandem(tmp_path):
    args = vs_trl.trl_workload(vs_trl.ACCURACY, ["model.dtype=float32"], tmp_path, num_steps=6)
    assert args[args.index("--dtype") + 1] == "float32"


def test_the_throughput_table_sets_each_tandem_run_beside_trl():
    def side(seconds: float) -> dict:
        return {"seconds_per_step": seconds, "generated_tokens_per_step": 100.0,
                "generate_tokens_per_s": 10.0, "step_tokens_per_s": 10.0,
                "train_tokens_per_s": 10.0, "peak_mib": 1.0, "reward": 0.0, "wall_s": 1.0}  # fmt: skip

    table = vs_trl.throughput_table(
        {"tandem": side(8.0), "tandem_k1": side(5.0), "trl": side(20.0)}
    )
    assert "| seconds per step | 8.00 | 5.00 | 20.00 | 0.40x | 0.25x |" in table
    assert table.endswith("| **steps per hour, Tandem / TRL** | | | | **2.50x** | **4.00x** |")


def test_new_records_returns_each_complete_line_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    new_records = vs_trl.NewRecords(path)
    assert new_records() == []  # the run has not written yet
    path.write_text('{"step": 0}\n{"step": 1}\n{"st')
    assert [r["step"] for r in new_records()] == [0, 1]
    assert new_records() == []  # the half-written line waits
    with path.open("a") as f:
        f.write('ep": 2}\n')
    assert new_records() == [{"step": 2}]
