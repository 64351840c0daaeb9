"""The driver's signal handling (rl.run.preemption), in a child process that the signals reach."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager

from tests.helpers.waiting import main_thread_cpu_ticks, wait_until, wait_until_delivered

# The main thread spends its time in long C calls that release the GIL (matmuls of about
# 0.5 s), as a driver does in `ray.get`: Python-level handlers run only between them.
_CHILD = textwrap.dedent(
    """
    import signal
    import time
    import torch
    from rl.run.preemption import StopRequest

    torch.set_num_threads(1)
    matrix = torch.randn(4096, 4096)
    stop = StopRequest()
    with stop.installed():
        print("ready", flush=True)
        for _ in range({num_matmuls}):
            matrix @ matrix
        print("after the loop:", stop.signal_name, flush=True)
    print("handler restored:", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
    time.sleep({linger_s})  # a process on its way out, after the block
    """
)


@contextmanager
def _child(num_matmuls: int, linger_s: float = 0.0) -> Iterator[subprocess.Popen]:
    """The child, started and into its first matmul; killed if a test leaves it running."""
    code = _CHILD.format(num_matmuls=num_matmuls, linger_s=linger_s)
    process = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout.readline() == "ready\n"
        # After "ready" the main thread only multiplies: once it has used CPU time since, it
        # is inside a matmul (a tick is 10 ms, a matmul about 0.5 s or more).
        ticks = main_thread_cpu_ticks(process.pid)
        wait_until(lambda: main_thread_cpu_ticks(process.pid) >= ticks + 2, "the first matmul")
        yield process
    finally:
        process.kill()
        process.wait()


def test_two_signals_while_the_main_thread_is_in_c_code_exit_at_once() -> None:
    # Two signals inside one matmul reach a Python-level handler as one call; the loop is
    # about a minute long, so only acting on each signal ends it within the timeout.
    with _child(100) as process:
        os.kill(process.pid, signal.SIGTERM)
        # The kernel merges a signal into one still pending: the second goes once the first
        # has been delivered (a busy machine can leave the child unscheduled for a while).
        wait_until_delivered(process.pid, signal.SIGTERM)
        os.kill(process.pid, signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert "SIGTERM: finishing the current step" in stderr
    assert "second SIGTERM: exiting now" in stderr
    assert "after the loop" not in stdout


def test_one_signal_is_recorded_and_the_block_runs_on_and_a_later_one_still_exits_at_once() -> None:
    with _child(4, linger_s=60) as process:
        os.kill(process.pid, signal.SIGINT)
        assert process.stdout.readline() == "after the loop: SIGINT\n"
        assert process.stdout.readline() == "handler restored: False\n"
        # Past the block, as a driver shutting down after its checkpoint: Ctrl-C again.
        os.kill(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    assert process.returncode == 128 + signal.SIGINT, stderr
    assert "SIGINT: finishing the current step" in stderr
    assert "second SIGINT: exiting now" in stderr


def test_without_a_signal_the_block_restores_the_handler() -> None:
    with _child(1) as process:
        stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    assert "after the loop: None" in stdout
    assert "handler restored: True" in stdout
