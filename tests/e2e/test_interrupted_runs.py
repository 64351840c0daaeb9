"""Runs that are killed, preempted or fed bad checkpoints, through the real `rl` command.

The reference is one uninterrupted 6-step run, overlapped (max_staleness 1) with partial
rollouts stopped at abort points, so every checkpoint holds groups in flight: scored ones
waiting for their step, partial ones with their prefix. A run killed with SIGKILL and resumed
with `--resume auto` (from its step-3 checkpoint), and a run stopped with SIGTERM and
resumed, must log exactly the reference's metrics at every step,
except measurements of the machine (`rl.observe.metrics.is_measurement`): deterministic
overlap (two runs agree) and exact resume.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from rl.checkpoint.store import list_checkpoints, verify
from rl.sync.shared_memory import remove_stale_slots
from rollout.engines.vllm_shm import remove_dead_engines_segments
from tests.helpers.repo import REPO
from tests.helpers.resumed_steps import computed
from tests.helpers.tiny_runs import tiny_run_tree, with_tiny_base
from tests.helpers.waiting import HANG_GUARD_S, wait_until_delivered

pytestmark = pytest.mark.e2e

NUM_STEPS = 6


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory, tiny_base: Path) -> Path:
    """A tiny overlapped GRPO recipe, from the session's tiny SFT base."""
    root = with_tiny_base(tmp_path_factory.mktemp("resume"), tiny_base)
    tree = tiny_run_tree(
        root,
        root / "runs",
        "reference",
        checkpoint={"every": 3},
        run={"num_steps": NUM_STEPS, "eval_every": 2, "export_hf": False},
        scheduler={"max_staleness": 1, "partial_rollout": "abort", "abort_every": 2},
    )
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _command(recipe: Path, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "rl.cli", "train", str(recipe), f"run.name={name}", *extra]


def _run(recipe: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        _command(recipe, name, *extra), cwd=REPO, capture_output=True, text=True, timeout=900
    )


def _start(recipe: Path, name: str, *extra: str) -> subprocess.Popen:
    # Its own session, so that a kill reaches the Ray processes it started, as a
    # preempted machine's would.
    return subprocess.Popen(
        _command(recipe, name, *extra),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _run_dir(recipe: Path, name: str) -> Path:
    return recipe.parent / "runs" / name


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_for_step(process: subprocess.Popen, run_dir: Path, step: int) -> None:
    deadline = time.monotonic() + 600
    while not any(r["step"] >= step for r in _records(run_dir)):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"step {step} never came"
        time.sleep(0.1)


def _assert_same_run(run_dir: Path, reference: list[dict]) -> None:
    records = [computed(r) for r in _records(run_dir)]
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    for got, want in zip(records, reference, strict=True):
        differ = {k: (want.get(k), got.get(k)) for k in got.keys() | want.keys()}
        differ = {k: pair for k, pair in differ.items() if pair[0] != pair[1]}
        assert not differ, f"step {got['step']} differs (reference, resumed): {differ}"


@pytest.fixture(scope="module")
def reference(recipe: Path) -> list[dict]:
    result = _run(recipe, "reference")
    assert result.returncode == 0, result.stderr[-4000:]
    records = _records(_run_dir(recipe, "reference"))
    assert [r["step"] for r in records] == list(range(NUM_STEPS + 1))
    return [computed(r) for r in records]


def test_a_killed_run_resumed_from_its_checkpoint_logs_the_same_metrics_bit_for_bit(
    recipe: Path, reference: list[dict]
) -> None:
    run_dir = _run_dir(recipe, "killed")
    # Killed as step 4's record appears: step 5 trains while step 6's groups generate. (The
    # moment decides only what is half written: a resume starts from the state at its
    # checkpoint's sync, which the scheduler's unit tests resume from at every sync.)
    process = _start(recipe, "killed")
    _wait_for_step(process, run_dir, 4)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_000003"]

    result = _run(recipe, "killed", "--resume", "auto")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "resumed from" in result.stdout and "step_000003 at step 3" in result.stdout
    _assert_same_run(run_dir, reference)
    final = run_dir / "checkpoints" / "step_000006"
    assert verify(final)["step"] == NUM_STEPS


def test_sigterm_checkpoints_the_step_exits_zero_and_the_run_resumes_exactly(
    recipe: Path, reference: list[dict]
) -> None:
    run_dir = _run_dir(recipe, "preempted")
    process = _start(recipe, "preempted")
    _wait_for_step(process, run_dir, 1)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-4000:]
    assert "SIGTERM: finishing the current step" in stderr
    stopped_at = _records(run_dir)[-1]["step"]
    assert stopped_at < NUM_STEPS
    checkpoint = run_dir / "checkpoints" / f"step_{stopped_at:06d}"
    assert f"stopped by SIGTERM after step {stopped_at}: checkpoint {checkpoint}" in stdout
    verify(checkpoint)

    result = _run(recipe, "preempted", "--resume", "auto")
    assert result.returncode == 0, result.stderr[-4000:]
    _assert_same_run(run_dir, reference)


def _session_processes(session_id: int) -> list[str]:
    """The live processes of session `session_id` (what a run started with it), by name."""
    found = []
    for process in psutil.process_iter(["name", "status"]):
        try:
            if os.getsid(process.pid) == session_id and process.status() != "zombie":
                found.append(process.name())
        except (ProcessLookupError, psutil.Error):
            pass
    return found


def test_a_second_signal_exits_at_once_leaving_no_process_and_every_checkpoint_whole(
    recipe: Path,
) -> None:
    run_dir = _run_dir(recipe, "impatient")
    process = _start(recipe, "impatient", "checkpoint.every=1")
    try:
        _wait_for_step(process, run_dir, 2)
        # To the driver alone, as a user's Ctrl-C twice or a scheduler's signals reach it.
        process.send_signal(signal.SIGTERM)
        # The kernel merges a signal into one still pending: the second goes once the first
        # has been delivered, however long a busy machine takes to schedule the driver.
        wait_until_delivered(process.pid, signal.SIGTERM)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 128 + signal.SIGTERM, stderr[-3000:]
        assert "second SIGTERM: exiting now" in stderr
        # Killed at once, but a process is gone only once the kernel has freed its memory
        # (GiBs for an engine): a hang guard, not a guess at how long that takes.
        deadline = time.monotonic() + HANG_GUARD_S
        while (left := _session_processes(process.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"processes outlived the driver: {left}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        # A killed run cannot remove its shared memory; the next run's start removes a dead
        # owner's segments, as this does for the run this test killed.
        remove_stale_slots()
        remove_dead_engines_segments()
    checkpoints = list_checkpoints(run_dir / "checkpoints")
    assert checkpoints, "no checkpoint was written before the signals"
    for checkpoint in checkpoints:
        verify(checkpoint)


def test_bad_resume_points_fail_before_any_work_naming_the_problem(
    recipe: Path, reference: list[dict]
) -> None:
    checkpoint = _run_dir(recipe, "reference") / "checkpoints" / f"step_{NUM_STEPS:06d}"
    missing = _run(recipe, "reference", "--resume", str(checkpoint.parent / "step_999999"))
    assert missing.returncode == 2
    assert "step_999999 does not exist" in missing.stderr

    changed = _run(recipe, "reference", "trainer.lr=0.5", "--resume", str(checkpoint))
    assert changed.returncode == 2
    assert "trainer.lr: 0.01 -> 0.5" in changed.stderr

    shard = next((checkpoint / "policy").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    corrupt = _run(recipe, "reference", "--resume", str(checkpoint))
    assert corrupt.returncode == 2
    assert f"{shard} does not match its sha256 checksum" in corrupt.stderr
