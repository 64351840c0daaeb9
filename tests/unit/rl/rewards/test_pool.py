"""FunctionPool against hostile reward files: what its workers send is never unpickled, and
they reach no network."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from rl.config import RewardConfig
from rl.data.tasks import get_task
from rl.rewards.pool import FunctionPool
from rl.rewards.terms import FunctionTerm

# At import, a reward file writes a pickle to its worker's connection (the descriptor is its
# command line's last argument), framed as multiprocessing frames a message: a driver that
# unpickles its workers' replies runs `touch MARKER`.
_PICKLE_AT_IMPORT = """
import os, pickle, struct, sys

class Payload:
    def __reduce__(self):
        return (os.system, ({command!r},))

data = pickle.dumps(Payload())
os.write(int(sys.argv[-1]), struct.pack("!i", len(data)) + data)

def fn(response, example):
    return 1.0
"""

_CONNECTS = """
import socket

def fn(response, example):
    try:
        socket.create_connection(("127.0.0.1", int(response)), timeout=2).close()
        return 1.0
    except OSError:
        return 0.0
"""


def _term(path: Path) -> FunctionTerm:
    return FunctionTerm.from_name(f"{path}:fn", get_task("addition"))


def test_a_pickle_a_reward_file_sends_is_never_run_and_fails_its_worker(tmp_path: Path) -> None:
    marker = tmp_path / "driver_ran_the_pickle"
    reward = tmp_path / "reward.py"
    reward.write_text(_PICKLE_AT_IMPORT.format(command=f"touch {marker}"))
    with pytest.raises(RuntimeError, match="a reward worker process sent what is not a reply"):
        FunctionPool([_term(reward)], RewardConfig(num_processes=1))
    assert not marker.exists()


def test_a_reward_function_reaches_no_network(tmp_path: Path) -> None:
    reward = tmp_path / "reward.py"
    reward.write_text(_CONNECTS)
    pool = FunctionPool([_term(reward)], RewardConfig(num_processes=1))
    try:
        assert pool.isolation.network, pool.isolation.summary()
        with socket.create_server(("127.0.0.1", 0)) as server:
            port = server.getsockname()[1]
            assert pool.run([(0, str(port), {"prompt": "1+1", "answer": "2"})]) == [0.0]
    finally:
        pool.close()
