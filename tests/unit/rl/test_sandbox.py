"""rl.sandbox: what a worker process inherits, how it stops, and that it dies with its driver."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl.sandbox import clean_env, start_worker, stop_workers
from tests.helpers.repo import REPO
from tests.helpers.waiting import wait_until

WORKER = "tests.helpers.sandbox_worker"


def test_the_environment_keeps_the_base_and_the_listed_variables_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TANDEM_TEST_TOKEN", "s3cret")
    monkeypatch.setenv("TANDEM_TEST_LISTED", "yes")
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    env = clean_env(["TANDEM_TEST_LISTED", "TANDEM_TEST_UNSET"], python_path=["/tools", str(REPO)])
    assert "TANDEM_TEST_TOKEN" not in env and "TANDEM_TEST_UNSET" not in env
    assert env["TANDEM_TEST_LISTED"] == "yes"
    assert env["PATH"] == os.environ["PATH"]
    # The repo first (the workers import rl), each root once, then the driver's own.
    assert env["PYTHONPATH"] == os.pathsep.join([str(REPO), "/tools", "/somewhere"])


def test_a_worker_gets_the_environment_the_memory_limit_and_ignores_ctrl_c(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TANDEM_TEST_TOKEN", "s3cret")
    worker = start_worker(WORKER, clean_env([]), memory_mb=512, log_file=None)
    try:
        env, memory_limit, ignores_sigint = worker.conn.recv()
        assert "TANDEM_TEST_TOKEN" not in env
        assert memory_limit == (512 << 20, 512 << 20)
        assert ignores_sigint
        worker.conn.send("ping")
        assert worker.conn.recv() == "ping"
    finally:
        assert worker.kill() == -9
    assert worker.conn.closed


def test_stopping_lets_idle_workers_exit_and_kills_busy_ones(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "workers.log"
    idle, busy = (start_worker(WORKER, clean_env([]), 0, str(log)) for _ in range(2))
    for worker in (idle, busy):
        worker.conn.recv()
    busy.conn.send("hang")
    stop_workers([idle, busy], grace_s=0.5)
    assert (idle.process.returncode, busy.process.returncode) == (0, -9)


def test_a_busy_worker_exits_when_its_driver_dies() -> None:
    driver = (
        "import os, sys\n"
        "from rl.sandbox import clean_env, start_worker\n"
        f"w = start_worker({WORKER!r}, clean_env([]), 0, None)\n"
        "w.conn.recv()\n"
        "w.conn.send('hang')\n"
        "print(w.process.pid, flush=True)\n"
        "os._exit(0)  # no cleanup: as if the driver were killed\n"
    )
    env = clean_env([])
    out = subprocess.run(
        [sys.executable, "-c", driver], env=env, capture_output=True, text=True, check=True
    ).stdout
    pid = int(out)
    wait_until(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), "the worker's exit")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
