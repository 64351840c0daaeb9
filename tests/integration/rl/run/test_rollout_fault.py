"""A rollout worker killed mid-generation, through the whole stack: real Ray, vLLM on CPU, a
2-rank FSDP2 gloo trainer. The driver replaces it on the weights the rollout serves and
generates the groups it held again: overlapped, while the trainer has moved on, the run logs
what an uninterrupted one does; agent episodes start again whole.

The kill is deterministic: a SIGKILL to the worker's process right after the driver's second
submission placed groups on it (RolloutReplicas.submit, wrapped), before any can come back.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import psutil
import pytest
import ray

from rl.checkpoint.resume import find_resume_point
from rl.cluster.rollout_replicas import RolloutReplicas
from rl.config import Config
from rl.run.driver import train
from rl.types import Sample, SamplingParams
from tests.helpers.processes import child_pids
from tests.helpers.resumed_steps import assert_same_step, computed
from tests.helpers.tiny_runs import tiny_run_tree, with_tiny_base
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.integration


def _config(shared: Path, tmp_path: Path, name: str, **sections: dict) -> Config:
    # As tests/integration/rl/run/test_driver.py: a small SFT base built (base.build_if_missing) so
    # that rewards vary; two rollout workers, so one generates on while the other is lost; the
    # trainer recomputes the proximal log-probs (unless `sections` say otherwise), so a
    # replacement on the wrong weights shows.
    sections = {
        **sections,
        "algorithm": {"recompute_old_logprobs": True, **sections.get("algorithm", {})},
        "rollout": {"num_workers": 2, **sections.get("rollout", {})},
        "run": {"num_steps": 3, **sections.get("run", {})},
    }
    return Config.model_validate(tiny_run_tree(shared, tmp_path / "runs", name, **sections))


def _kill_at_the_second_submission(monkeypatch: pytest.MonkeyPatch) -> tuple[list, list, dict]:
    """Make the driver's 2nd submission (on-policy: step 2's groups; at max_staleness 1 step
    3's, while step 2 trains) SIGKILL the worker it placed the first group on. (the versions the workers served at each submission, the
    killed worker's index, {process: its sandbox module} of the sandbox workers the killed
    worker had started)."""
    served: list[list[int]] = []
    killed: list[int] = []
    orphans: dict[psutil.Process, str] = {}
    submit = RolloutReplicas.submit

    def submit_then_kill(
        group: RolloutReplicas, batches: dict[int, list[Sample]], params: SamplingParams
    ) -> dict[int, int]:
        served.append(group.versions())
        placed = submit(group, batches, params)
        if len(served) == 2:
            victim = placed[min(placed)]
            pid = ray.get(group.workers[victim].__ray_call__.remote(lambda _: os.getpid()))
            children = psutil.Process(pid).children(recursive=True)
            orphans.update({p: m for p in children if (m := _sandbox(p)) is not None})
            os.kill(pid, signal.SIGKILL)
            killed.append(victim)
        return placed

    monkeypatch.setattr(RolloutReplicas, "submit", submit_then_kill)
    return served, killed, orphans


def _records(cfg: Config) -> list[dict]:
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_only_rollout_worker_killed_while_a_step_trains_is_replaced_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_base: Path
) -> None:
    """Overlapped (max_staleness 1), one rollout worker: it dies just as step 3's groups start
    on it, while step 2 trains (no annotation: training starts at the sync, before the
    submission). The replacement gets version 1 from the trainer ranks' copy of that push,
    although they hold version 2 by then, and the run logs what an uninterrupted one does."""
    sections = {
        "rollout": {"num_workers": 1},
        "scheduler": {"max_staleness": 1},
        "algorithm": {"recompute_old_logprobs": False},
    }
    shared = with_tiny_base(tmp_path / "shared", tiny_base)
    reference = _config(shared, tmp_path, "uninterrupted", **sections)
    train(reference)
    cfg = _config(shared, tmp_path, "rollout-lost-while-training", **sections)
    served, killed, _ = _kill_at_the_second_submission(monkeypatch)
    train(cfg)

    assert killed == [0]
    # Steps 1 and 2 at version 0, step 3 at 1 (killed), step 3 again on the replacement at 1.
    assert served == [[0], [1], [1]]
    records = _records(cfg)
    assert sum(r.get("rollout/workers_replaced", 0) for r in records) == 1

    # The loss is counted where it happened; everything else is as if it never did.
    def without_loss(records: list[dict]) -> list[dict]:
        return [computed(r) | {"rollout/workers_replaced": 0.0} for r in records]

    assert without_loss(records) == without_loss(_records(reference))


def test_agent_episodes_of_a_killed_rollout_worker_start_again_whole_and_resume_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_base: Path
) -> None:
    """Three-turn episodes of a user's environment (again_env.py, in sandboxed workers) and the
    python tool's pool: the killed worker's episodes start again from the driver's copies, and
    its sandboxes' processes, orphaned, exit by themselves. Resumed from its step-2
    checkpoint, the run generates and scores step 3's episodes again exactly."""
    agent = {
        "environment": f"{Path(__file__).with_name('again_env.py')}:Again",
        "tools": ["python"],
    }
    cfg = _config(
        with_tiny_base(tmp_path / "shared", tiny_base),
        tmp_path,
        "agent-fault",
        agent={**agent, "max_turns": 3, "tool_workers": 1, "env_workers": 1},
        # Room for three turns however long the model writes them: an episode out of room
        # ends early ("length"), which would hide one cut short by the loss.
        rollout={"max_new_tokens": 160, "max_model_len": 768},
        checkpoint={"every": 2},
    )
    _, killed, orphans = _kill_at_the_second_submission(monkeypatch)
    train(cfg)
    records = _records(cfg)
    assert not child_pids(b"rl.agents.env_worker")  # the driver's own (for reset) stopped

    assert len(killed) == 1
    assert [r["rollout/workers_replaced"] for r in records[1:]] == [0, 1, 0]
    assert all(r["rollout/generated_groups"] == 8 for r in records[1:])
    # Whole episodes up to the step that lost its worker and the one that started them again:
    # three turns each, none cut short or resumed by a worker that lost it. (On some CPUs the
    # policy trained twice writes past its room at step 3, and an episode out of room ends
    # early: that says nothing of the loss.)
    lost = records[1:3]
    assert all(r["response/truncated"] == 0 for r in lost)
    assert all(r["agent/turns_mean"] == r["agent/turns_max"] == 3 for r in lost)
    assert all(r["agent/env_failures"] == 0 for r in records[1:])
    assert all(r["rollout/staleness_max"] == 0 for r in records[1:])
    # The killed worker had started its tool and environment workers; none outlives it.
    assert set(orphans.values()) == {"rl.agents.tool_worker", "rl.agents.env_worker"}
    wait_until(lambda: not any(map(_alive, orphans)), "the orphaned sandboxes' exit")

    monkeypatch.undo()
    checkpoint = Path(cfg.run.output_dir) / cfg.run.name / "checkpoints" / "step_000002"
    train(cfg, resume_from=find_resume_point(cfg, str(checkpoint)))
    resumed = _records(cfg)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert_same_step(records[3], resumed[3])


def _sandbox(process: psutil.Process) -> str | None:
    """The sandbox worker module `process` runs, if it is one."""
    try:
        cmdline = process.cmdline()
    except psutil.Error:
        return None
    return next((arg for arg in cmdline if arg.startswith("rl.agents.")), None)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
