"""ToolPool with real worker processes: tools that hang, spin, hog memory, flood their output,
crash, raise or return junk each give an error observation, and the pool keeps serving."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rl.agents.builtin_tools import BUILTIN_TOOLS
from rl.agents.tool_pool import ToolPool, ToolResult
from tests.helpers.processes import child_pids, marked_pids
from tests.helpers.waiting import wait_until
from tests.unit.rl.agents import sample_tools

TIMEOUT_S = 4.0  # wall clock: above CPU_S, so that a busy loop meets its CPU limit first
CPU_S = 1
MEMORY_MB = 512
MAX_CHARS = 1000
SLACK_S = 3.0  # how late a timeout may be reported on busy shared cores
TOOLS = [
    "python",
    *(
        getattr(sample_tools, name)
        for name in (
            "nap",
            "hang",
            "spin",
            "hog",
            "flood",
            "die",
            "fail",
            "junk",
            "environment",
            "scribble",
            "background",
            "network",
        )
    ),
]
SECRET = "TANDEM_TEST_TOKEN"


def _worker_pids() -> set[int]:
    """Live tool worker processes that are children of this test process."""
    return child_pids(b"rl.agents.tool_worker")


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed and not yet reaped by init, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def pool_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ToolPool, Path]]:
    """A pool started from a driver whose HOME holds credentials."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".netrc").write_text("machine example.com login me password s3cret\n")
    monkeypatch.setenv("HOME", str(home))
    with ToolPool([sample_tools.read], num_workers=1) as pool:
        yield pool, home


@pytest.fixture(scope="module")
def pool() -> Iterator[ToolPool]:
    os.environ[SECRET] = "s3cret"  # a credential in the driver's environment
    try:
        with ToolPool(
            TOOLS,
            num_workers=4,
            timeout_s=TIMEOUT_S,
            cpu_s=CPU_S,
            memory_mb=MEMORY_MB,
            max_output_chars=MAX_CHARS,
        ) as pool:
            yield pool
    finally:
        del os.environ[SECRET]


def _call(pool: ToolPool, name: str, **arguments: object) -> ToolResult:
    return pool.submit(name, arguments).result(timeout=60)  # a hang guard, not a bound


def _marker() -> str:
    return f"hang-{uuid.uuid4().hex[:10]}"


def test_a_tool_that_hangs_times_out_and_the_pool_serves_the_next_call(pool: ToolPool) -> None:
    marker = _marker()
    result = _call(pool, "hang", marker=marker)
    assert result.error == "timeout"
    assert result.output == f"Timeout: the tool did not finish within {TIMEOUT_S:g} s"
    assert TIMEOUT_S <= result.seconds < TIMEOUT_S + SLACK_S
    # The call's process and the process it started went with the call.
    wait_until(lambda: not marked_pids(marker), "the end of the call's processes")
    assert _call(pool, "python", code="6 * 7").output == "42"


def test_a_busy_loop_meets_the_cpu_limit(pool: ToolPool) -> None:
    result = _call(pool, "spin")
    assert result.error == "timeout"
    assert result.output == f"Timeout: the tool used more than {CPU_S} s of CPU time"


def test_allocating_past_the_memory_limit_is_a_memory_error(pool: ToolPool) -> None:
    assert _call(pool, "hog", mb=1).output == str(1 << 20)
    # Python's allocation fails (MemoryError) under RLIMIT_AS: "memory", not an OOM kill.
    result = _call(pool, "hog", mb=2 * MEMORY_MB)
    assert result.error == "memory"
    assert result.output == f"MemoryError: the tool ran out of memory (memory_mb={MEMORY_MB})"


def test_a_flood_of_output_is_truncated_and_never_reaches_the_driver(
    pool: ToolPool, capfd: pytest.CaptureFixture
) -> None:
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    result = _call(pool, "flood", mb=100)
    assert result.error is None
    printed = 100 * ((1 << 20) + 1)  # each line and its newline
    marker = f"\n[truncated: {printed - MAX_CHARS} more characters]"
    assert result.output == "x" * MAX_CHARS + marker
    peak_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert peak_after - peak_before < 50 << 10  # the 100 MiB were never in this process
    out, err = capfd.readouterr()
    assert "xxxx" not in out and "xxxx" not in err


def test_a_process_that_dies_is_a_crash_and_the_pool_recovers(pool: ToolPool) -> None:
    result = _call(pool, "die", how="exit")
    assert result.error == "crash"
    assert result.output == "Crash: the tool's process exited with code 3 without returning"
    result = _call(pool, "die", how="segfault")
    assert result.error == "crash"
    assert result.output == "Crash: the tool's process was killed by SIGSEGV without returning"
    assert _call(pool, "python", code="print('still here')").output == "still here\n"


def test_a_tool_that_raises_is_an_error_with_its_output(pool: ToolPool) -> None:
    result = _call(pool, "fail")
    assert (result.output, result.error) == ("about to fail\nKeyError: 'no such thing'", "error")


@pytest.mark.parametrize(
    "kind, message",
    [
        (
            "set",
            "TypeError: the tool returned a set, not str, int, float, bool, None, list or dict",
        ),
        ("list", "TypeError: the tool returned a list that is not JSON: Object of type object "),
    ],
)
def test_junk_return_values_are_errors(pool: ToolPool, kind: str, message: str) -> None:
    result = _call(pool, "junk", kind=kind)
    assert result.error == "error"
    assert result.output.startswith(message)


def test_unknown_tools_and_bad_arguments_are_refused_before_any_worker(pool: ToolPool) -> None:
    result = _call(pool, "search", query="x")
    assert result.error == "unknown_tool"
    assert result.output.startswith("Unknown tool 'search'; the tools are: python, nap, hang")
    for arguments, problem in [
        ({"seconds": "1"}, "argument 'seconds': expected number, got string"),
        ({}, "missing argument(s) 'seconds'"),
        ({"seconds": 1, "x": 2}, "unexpected argument(s) 'x' (expected: 'seconds')"),
    ]:
        result = _call(pool, "nap", **arguments)
        assert result == ToolResult(f"Bad arguments for 'nap': {problem}", "bad_arguments", 0.0)


def test_calls_get_a_clean_environment_and_a_fresh_working_directory(pool: ToolPool) -> None:
    seen = json.loads(_call(pool, "environment").output)
    assert SECRET in os.environ and SECRET not in seen["env"]
    assert seen["env"]["HOME"] == seen["env"]["TMPDIR"] == seen["cwd"]
    first_dir, first_listing = json.loads(_call(pool, "scribble").output)
    second_dir, second_listing = json.loads(_call(pool, "scribble").output)
    assert first_listing == second_listing == []  # note.txt of the first call is gone
    assert first_dir != second_dir


def test_what_a_call_started_does_not_outlive_it(pool: ToolPool) -> None:
    marker = _marker()
    assert _call(pool, "background", marker=marker).error is None
    # It left the call's process group: the sandbox's pid namespace still ends it.
    wait_until(lambda: not marked_pids(marker), "the end of the call's background process")


def test_a_tool_cannot_read_the_drivers_home_or_processes(
    pool_home: tuple[ToolPool, Path],
) -> None:
    pool, home = pool_home
    for path in ("~/.netrc", str(home / ".netrc")):
        assert (
            _call(pool, "read", path=path).output == "FileNotFoundError: No such file or directory"
        )
    driver = f"/proc/{os.getpid()}/environ"
    assert _call(pool, "read", path=driver).output == "FileNotFoundError: No such file or directory"


def test_many_calls_run_at_once(pool: ToolPool) -> None:
    futures = [pool.submit("nap", {"seconds": 0.3}) for _ in range(8)]
    # Queued behind 8 calls on 4 workers: cancelled before any worker is free.
    cancelled = pool.submit("nap", {"seconds": 0.3})
    assert cancelled.cancel()
    spans = [json.loads(f.result(timeout=60).output) for f in futures]
    # How many calls were sleeping at once, at the busiest moment.
    overlap = max(sum(start <= t < end for start, end in spans) for t, _ in spans)
    assert 2 <= overlap <= 4  # concurrent, and no more than the 4 workers


def test_the_network_is_cut(pool: ToolPool) -> None:
    assert pool.isolation.network, pool.isolation.summary()
    with socket.create_server(("127.0.0.1", 0)) as server:
        seen = json.loads(_call(pool, "network", port=server.getsockname()[1]).output)
    assert seen["connected"] is False
    assert seen["namespace"] != os.readlink("/proc/self/ns/net")


def test_the_python_tool_returns_output_and_the_last_value(pool: ToolPool) -> None:
    result = _call(pool, "python", code="import math\nprint('hi')\nmath.sqrt(16)")
    assert (result.output, result.error) == ("hi\n4.0", None)
    assert _call(pool, "python", code="x = 1").output == ""
    result = _call(pool, "python", code="def f(:")
    assert result.error == "error" and result.output.startswith("SyntaxError: ")


def test_close_ends_the_calls_in_flight_and_leaves_no_process() -> None:
    others = _worker_pids()  # the module's pool's
    pool = ToolPool([sample_tools.hang, sample_tools.nap], num_workers=2, timeout_s=60)
    assert len(_worker_pids() - others) == 2
    marker = _marker()
    in_flight = pool.submit("hang", {"marker": marker})
    wait_until(lambda: len(marked_pids(marker)) == 2, "the hanging call and its child")
    queued = [pool.submit("nap", {"seconds": 30}) for _ in range(3)]
    pool.close()
    assert _worker_pids() <= others
    with pytest.raises(RuntimeError, match="closed during the call"):
        in_flight.result(timeout=0)
    assert sum(f.cancelled() for f in queued) >= 2  # one may have started on the idle worker
    wait_until(lambda: not marked_pids(marker), "the end of the call's processes")
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit("nap", {"seconds": 0})


_OWNER = """
import os, time
from rl.agents.tool_pool import ToolPool
from tests.unit.rl.agents import sample_tools
pool = ToolPool([sample_tools.hang, sample_tools.nap], num_workers=2, timeout_s=60)
pool.submit("hang", {"marker": os.environ["HANG_MARKER"]})  # not on its command line
print("started", flush=True)
time.sleep(600)
"""


def test_a_pool_whose_process_is_killed_leaves_no_worker() -> None:
    # A rollout worker killed by Ray never closes its pool: the workers, one busy in a call
    # and one idle, end with it, and so does what the call started.
    marker = _marker()
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "HANG_MARKER": marker},
    )
    try:
        assert owner.stdout.readline().strip() == "started"
        wait_until(lambda: len(marked_pids(marker)) == 2, "the hanging call and its child")
        workers = [int(p) for p in subprocess.check_output(["pgrep", "-P", str(owner.pid)]).split()]
        assert len(workers) == 2
    finally:
        owner.kill()
        owner.wait()
        owner.stdout.close()
    wait_until(lambda: not any(map(_alive, workers)), "the workers' exit")
    wait_until(lambda: not marked_pids(marker), "the end of the call's processes")


def test_tools_that_cannot_be_served_are_refused_when_the_pool_starts() -> None:
    with pytest.raises(ValueError, match="tool 'no_such_file.py:f': file 'no_such_file.py' not"):
        ToolPool(["no_such_file.py:f"])
    with pytest.raises(ValueError, match=r"tool 'pyton' is neither a built-in tool \(python\)"):
        ToolPool(["pyton"])
    with pytest.raises(ValueError, match="define it at the top level"):
        ToolPool([lambda: None])
    with pytest.raises(ValueError, match="tools named twice: python"):
        ToolPool(["python", BUILTIN_TOOLS.get("python")])
    with pytest.raises(ValueError, match="num_workers must be >= 1, got 0"):
        ToolPool(["python"], num_workers=0)


def test_a_users_tool_file_is_imported_and_described_only_by_the_workers(tmp_path: Path) -> None:
    marker = tmp_path / "imported_by"
    tool_file = tmp_path / "kv_tools.py"
    tool_file.write_text(
        "import os\n"
        "try:  # the sandbox's filesystem is read-only: only an import outside it writes\n"
        f"    open({str(marker)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        "except OSError:\n"
        "    pass\n"
        "def lookup(key: str, default: int = 0) -> str:\n"
        '    """Read a key from the store.\n\n'
        "    Args:\n"
        "        key: The key to read.\n"
        "        default: What to return for a missing key.\n"
        '    """\n'
        "    return {'a': 'one'}.get(key, str(default))\n"
    )
    with ToolPool([f"{tool_file}:lookup"], num_workers=2) as pool:
        assert not marker.exists()  # nothing outside the sandbox imported it
        # The JSON schema the chat template's `tools` takes, written out by hand.
        assert pool.schemas == [
            {
                "type": "function",
                "function": {
                    "name": "lookup",
                    "description": "Read a key from the store.",
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "key": {"type": "string", "description": "The key to read."},
                            "default": {
                                "type": "integer",
                                "description": "What to return for a missing key.",
                            },
                        },
                        "required": ["key"],
                    },
                    "return": {"type": "string"},
                },
            }
        ]
        assert _call(pool, "lookup", key="a").output == "one"
        assert _call(pool, "lookup", key="b", default=7).output == "7"
        assert _call(pool, "lookup", key=1).error == "bad_arguments"  # checked against it


def test_a_users_tool_without_a_schema_fails_the_pool_naming_it(tmp_path: Path) -> None:
    tool_file = tmp_path / "bare.py"
    tool_file.write_text("def lookup(key):\n    return key\n")
    with pytest.raises(RuntimeError, match="could not import the tools: ValueError: tool 'lookup'"):
        ToolPool([f"{tool_file}:lookup"], num_workers=1)
