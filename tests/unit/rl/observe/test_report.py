"""rl.observe.report: what `rl report` writes for a run directory the test fills itself."""

from __future__ import annotations

import json
from pathlib import Path

from rl.observe.report import write_report


def _write_run(run_dir: Path, records: list[dict]) -> None:
    run_dir.mkdir()
    lines = [json.dumps(record) for record in records]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _moe_step(step: int, layers: dict[int, tuple[float, float, float, float]]) -> dict:
    """A step record with, per layer, (max_load_ratio, overloaded_frac, balance_loss, z_loss)
    and the cross-layer summaries of rl.algorithms.router_losses.moe_metrics."""
    record: dict = {"step": step, "reward/mean": 0.1 * step}
    for layer, (ratio, over, balance, z) in layers.items():
        record |= {
            f"moe/layer{layer}/max_load_ratio": ratio,
            f"moe/layer{layer}/overloaded_frac": over,
            f"moe/layer{layer}/balance_loss": balance,
            f"moe/layer{layer}/z_loss": z,
            f"moe/layer{layer}/expert0_tokens": 5.0,
        }
    record["moe/max_load_ratio"] = max(v[0] for v in layers.values())
    record["moe/balance_loss"] = sum(v[2] for v in layers.values()) / len(layers)
    record["moe/z_loss"] = sum(v[3] for v in layers.values()) / len(layers)
    return record


def test_report_tables_expert_load_per_layer_over_the_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "moe-run"
    _write_run(
        run_dir,
        [
            {"step": 0, "eval/accuracy": 0.2},  # the evaluation before training: no routing
            _moe_step(1, {0: (2.5, 0.2, 1.3, 4.0), 10: (1.8, 0.1, 1.1, 3.0)}),
            _moe_step(2, {0: (3.0, 0.25, 1.2, 3.5), 10: (1.5, 0.05, 1.05, 2.5)}),
            _moe_step(3, {0: (1.25, 0.0, 1.01, 3.25), 10: (1.4, None, 1.02, 2.0)}),
        ],
    )
    summary = write_report(run_dir).read_text()

    assert "## Expert load" in summary
    rows = [line for line in summary.splitlines() if line.startswith(("| 0 |", "| 10 |"))]
    # layer | load first | last | worst | over capacity last | balance first | last | z first | last
    assert rows == [
        "| 0 | 2.5 | 1.25 | 3 | 0 | 1.3 | 1.01 | 4 | 3.25 |",
        # Layer 10's last over-capacity value is null (NaN in the logger): its last finite one.
        "| 10 | 1.8 | 1.4 | 1.8 | 0.05 | 1.1 | 1.02 | 3 | 2 |",
    ]
    assert (run_dir / "report" / "expert_load.png").stat().st_size > 0
    assert "![expert_load](expert_load.png)" in summary


def test_report_of_a_dense_run_has_no_expert_load(tmp_path: Path) -> None:
    run_dir = tmp_path / "dense-run"
    _write_run(run_dir, [{"step": 0, "eval/accuracy": 0.2}, {"step": 1, "reward/mean": 0.5}])
    summary = write_report(run_dir).read_text()
    assert "Expert load" not in summary
    assert not (run_dir / "report" / "expert_load.png").exists()
    assert (run_dir / "report" / "reward.png").exists()
