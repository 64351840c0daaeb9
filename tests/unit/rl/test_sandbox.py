"""rl.sandbox and rl.isolation: what a worker process inherits, what it is cut off from (as
root too: CI and users' GPU containers run as root), how it stops, and that it dies with its
driver and takes what it started along."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rl.config import SandboxConfig
from rl.isolation import SANDBOX_UID
from rl.sandbox import (
    WorkerProcess,
    clean_env,
    start_worker,
    stop_workers,
)
from tests.helpers.processes import marked_pids
from tests.helpers.repo import REPO
from tests.helpers.waiting import wait_until

WORKER = "tests.helpers.sandbox_worker"
MEMORY_MB = 512


def _ask(worker: WorkerProcess, request: object) -> object:
    worker.conn.send_bytes(json.dumps(request).encode())
    return json.loads(worker.conn.recv_bytes())


@pytest.fixture
def worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[WorkerProcess]:
    """A sandboxed worker started by a driver whose HOME holds credentials."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".netrc").write_text("machine example.com login me password s3cret\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TANDEM_TEST_TOKEN", "s3cret")
    w = start_worker(WORKER, clean_env([]), MEMORY_MB, None)
    try:
        yield w
    finally:
        w.kill()


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


def test_a_worker_is_fully_isolated_and_holds_no_privilege(worker: WorkerProcess) -> None:
    assert worker.isolation.full, worker.isolation.summary()
    seen = _ask(worker, "whoami")
    assert "TANDEM_TEST_TOKEN" not in seen["env"]
    assert seen["memory_limit"] == MEMORY_MB << 20
    assert seen["cap_eff"] == "0000000000000000" and seen["no_new_privs"] == "1"
    if os.geteuid() == 0:  # root maps to the unprivileged sandbox uid, not to itself
        assert seen["uid"] == SANDBOX_UID and worker.isolation.user == f"uid {SANDBOX_UID}"
    assert seen["pid"] == 1  # its own pid namespace


def test_a_worker_cannot_read_the_drivers_environment_or_home(worker: WorkerProcess) -> None:
    home = Path(os.environ["HOME"])
    for path in (f"/proc/{os.getpid()}/environ", str(home / ".netrc")):
        assert "error" in _ask(worker, ["read", path]), path
    seen = _ask(worker, "whoami")
    assert seen["env"]["HOME"] == str(home)  # the same path, a private directory there
    assert "error" in _ask(worker, ["read", os.path.join(seen["env"]["HOME"], ".netrc")])


def test_a_worker_cannot_get_back_to_the_hosts_network(worker: WorkerProcess) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        answer = _ask(worker, ["connect", server.getsockname()[1]])
    assert "error" in answer, answer
    # The host's namespace through the driver's /proc entry, and, where a namespace file is
    # in reach, the capability setns() needs: neither is there.
    assert "error" in _ask(worker, ["setns", f"/proc/{os.getpid()}/ns/net"])
    assert "PermissionError" in _ask(worker, ["setns", "/proc/self/ns/net"])["error"]


def test_what_a_worker_writes_is_bounded_and_stays_in_its_sandbox(worker: WorkerProcess) -> None:
    tmp_mb = SandboxConfig().tmp_mb
    name = f"tandem-test-{uuid.uuid4().hex}"
    for directory in ("/dev/shm", "/tmp"):
        answer = _ask(worker, ["write", f"{directory}/{name}", tmp_mb + 1])
        assert "error" in answer, answer  # the tmpfs (and the file-size limit) end it
        assert not Path(directory, name).exists()  # the host's directory never saw it
    assert "Read-only file system" in _ask(worker, ["write", str(REPO / name), 1])["error"]
    assert not (REPO / name).exists()


def test_a_killed_worker_takes_what_it_started_along(worker: WorkerProcess) -> None:
    marker = f"tandem-test-{uuid.uuid4().hex}"
    _ask(worker, ["spawn", marker])  # in a session of its own: out of the group's reach
    assert len(marked_pids(marker)) == 1
    assert worker.kill() == -9
    wait_until(lambda: not marked_pids(marker), "the end of what the worker started")


def test_no_python_code_runs_between_fork_and_exec(monkeypatch: pytest.MonkeyPatch) -> None:
    # The driver is threaded (Ray, torch, vLLM): Python code in a forked child, such as a
    # `preexec_fn`, can deadlock on a lock another thread held at the fork. Limits are set by
    # the fresh worker instead, its session by the C code of subprocess.
    popen = subprocess.Popen
    options: dict = {}

    def spy(*args: object, **kwargs: object) -> subprocess.Popen:
        options.update(kwargs)
        return popen(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", spy)
    w = start_worker(WORKER, clean_env([]), MEMORY_MB, None)
    try:
        assert options.get("preexec_fn") is None and options["start_new_session"] is True
        assert _ask(w, "whoami")["memory_limit"] == MEMORY_MB << 20  # set in the worker
        assert os.getsid(w.process.pid) == w.process.pid
    finally:
        w.kill()


def test_stopping_lets_idle_workers_exit_and_kills_busy_ones(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "workers.log"
    idle, busy = (start_worker(WORKER, clean_env([]), 0, str(log)) for _ in range(2))
    busy.conn.send_bytes(json.dumps("hang").encode())
    stop_workers([idle, busy], grace_s=0.5)
    assert (idle.process.returncode, busy.process.returncode) == (0, -9)
    assert idle.conn.closed and busy.conn.closed


def test_a_busy_worker_exits_when_its_driver_dies() -> None:
    marker = f"tandem-test-{uuid.uuid4().hex}"
    driver = (
        "import json, os, sys\n"
        "from rl.sandbox import clean_env, start_worker\n"
        f"w = start_worker({WORKER!r}, clean_env([]), 0, None)\n"
        f"w.conn.send_bytes(json.dumps(['spawn', os.environ['MARKER']]).encode())\n"
        "w.conn.recv_bytes()\n"
        "w.conn.send_bytes(json.dumps('hang').encode())\n"
        "print(w.process.pid, flush=True)\n"
        "os._exit(0)  # no cleanup: as if the driver were killed\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", driver],
        env={**clean_env([]), "MARKER": marker},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    launcher = int(out)
    wait_until(lambda: not Path(f"/proc/{launcher}").exists() or _zombie(launcher), "its exit")
    wait_until(lambda: not marked_pids(marker), "the end of what the worker started")


_WITHOUT_NAMESPACES = """
import ctypes, json, os, sys
from rl.config import SandboxConfig
from rl.sandbox import SandboxRefused, clean_env, configure, start_worker
# As Docker's default profile leaves a root container: no CAP_SYS_ADMIN, so no unshare.
assert ctypes.CDLL(None).prctl(24, 21, 0, 0, 0) == 0  # PR_CAPBSET_DROP, CAP_SYS_ADMIN
os.execv(sys.executable, [sys.executable, "-c", sys.argv[1]])
"""

_REQUIRE = """
import json
from rl.config import SandboxConfig
from rl.sandbox import SandboxRefused, clean_env, configure, start_worker
w = start_worker("tests.helpers.sandbox_worker", clean_env([]), 0, None)
report = {"full": w.isolation.full, "missing": w.isolation.missing}
w.kill()
configure(SandboxConfig(require=True))
try:
    start_worker("tests.helpers.sandbox_worker", clean_env([]), 0, None)
    report["refused"] = None
except SandboxRefused as e:
    report["refused"] = str(e)
print(json.dumps(report))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="drops a capability only root holds")
def test_without_namespaces_the_report_says_what_is_missing_and_require_refuses() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _WITHOUT_NAMESPACES, _REQUIRE],
        env=clean_env([]),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    report = json.loads(out)
    assert report["full"] is False
    assert any(m.startswith("namespaces (unshare as root): ") for m in report["missing"])
    assert report["refused"].startswith("sandbox.require is set and this sandbox is not fully")
    assert "network NOT isolated" in report["refused"]


def test_require_starts_a_fully_isolated_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    import rl.sandbox

    monkeypatch.setattr(rl.sandbox, "_policy", SandboxConfig(require=True))
    w = start_worker(WORKER, clean_env([]), 0, None)
    try:
        assert w.isolation.full
        assert _ask(w, ["read", str(REPO / "pyproject.toml")]) == {
            "ok": (REPO / "pyproject.toml").read_text()
        }
    finally:
        w.kill()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
