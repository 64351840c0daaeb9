"""A rollout worker killed mid-generation, through the whole stack: real Ray, vLLM on CPU, a
2-rank FSDP2 gloo trainer. The driver replaces it on the current weights, regenerates the
prompts it held, and the run completes.

The kill is deterministic: a SIGKILL to the worker's process right after the driver started
step 2's groups on it (RolloutReplicas.submit, wrapped), before any of them can come back.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import ray

from rl.cluster.rollout_replicas import RolloutReplicas
from rl.config import Config
from rl.run.driver import train
from rl.types import Sample, SamplingParams
from tests.helpers.tiny_runs import tiny_run_tree

pytestmark = pytest.mark.integration


def _config(shared: Path, tmp_path: Path, name: str) -> Config:
    # As tests/integration/rl/run/test_driver.py: a small SFT base built (base.build_if_missing) so
    # that rewards vary; two rollout workers, so one generates on while the other is lost; the
    # trainer recomputes the proximal log-probs, so a replacement on the wrong weights shows.
    tree = tiny_run_tree(
        shared,
        tmp_path / "runs",
        name,
        rollout={"num_workers": 2},
        algorithm={"recompute_old_logprobs": True},
        run={"num_steps": 3},
    )
    return Config.model_validate(tree)


def test_a_rollout_worker_killed_mid_generation_is_replaced_and_the_run_completes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _config(tmp_path / "shared", tmp_path, "rollout-fault")
    served: list[list[int]] = []  # the versions the workers serve at each submission
    killed: list[int] = []
    submit = RolloutReplicas.submit

    def submit_then_kill(
        group: RolloutReplicas, batches: dict[int, list[Sample]], params: SamplingParams
    ) -> dict[int, int]:
        served.append(group.versions())
        placed = submit(group, batches, params)
        if len(served) == 2:  # on-policy: the 2nd submission is step 2's groups
            victim = placed[min(placed)]
            pid = ray.get(group.workers[victim].__ray_call__.remote(lambda _: os.getpid()))
            os.kill(pid, signal.SIGKILL)
            killed.append(victim)
        return placed

    monkeypatch.setattr(RolloutReplicas, "submit", submit_then_kill)
    final = train(cfg)
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    assert len(killed) == 1
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert [r["rollout/workers_replaced"] for r in records[1:]] == [0, 1, 0]
    assert all(r["weight_sync/workers_replaced"] == 0 for r in records[1:])
    # Step 1, step 2, step 2's lost groups on the replacement (which was sent version 1
    # before they started), step 3.
    assert served == [[0, 0], [1, 1], [1, 1], [2, 2]]
    # Every group of step 2 was generated once more, none lost, all on-policy.
    assert all(r["rollout/generated_groups"] == 8 for r in records[1:])
    assert all(r["rollout/staleness_max"] == 0 for r in records[1:])
    # On-policy in fp32, the replacement's behaviour log-probs are the trainer's: it got the
    # weights of version 1, not just the label.
    gaps = [r["off_policy/max_abs_logprob_gap"] for r in records[1:]]
    assert max(gaps) < 1e-3, f"behaviour log-probs off the trainer's: {gaps}"
    assert final["rollout/version"] == 3
    assert 0.0 <= final["eval/accuracy"] <= 1.0
