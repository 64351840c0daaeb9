"""A user's environment (`agent.environment: path/to/file.py:ClassName`) runs only in
sandboxed workers; its state travels with the episode; each way it can fail is an
EnvFailure that leaves the pool serving."""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import rl.agents.episode as episode_module
from rl.agents.env_pool import EnvFailure, close_env_pools, sandboxed_environment
from rl.agents.environment import EnvStep
from rl.agents.episode import observe, start_group
from rl.agents.resolve import get_environment
from rl.config import AgentConfig
from rl.types import Episode
from tests.helpers.chat_templates import qwen_tokenizer
from tests.helpers.processes import child_pids, marked_pids
from tests.helpers.waiting import wait_until

SAMPLE_ENVS = Path(__file__).with_name("sample_envs.py")
TIMEOUT_S = 2.0
SLACK_S = 3.0  # how late a timeout may be reported on busy shared cores
SECRET = "TANDEM_TEST_TOKEN"


def _cfg(name: str = "Countdown", **kw: object) -> AgentConfig:
    return AgentConfig(environment=f"{SAMPLE_ENVS}:{name}", env_timeout_s=TIMEOUT_S, **kw)


def _workers() -> set[int]:
    return child_pids(b"rl.agents.env_worker")


@pytest.fixture
def pools() -> Iterator[None]:
    """This test's pools are closed after it, and none of their workers is left."""
    before = _workers()
    try:
        yield
    finally:
        close_env_pools()
        wait_until(lambda: not (_workers() - before), "the environment workers' exit")


def test_a_users_environment_runs_in_its_workers_and_its_state_moves_with_pickle(
    pools: None,
) -> None:
    os.environ[SECRET] = "s3cret"  # a credential in the driver's environment
    try:
        env_class = get_environment(_cfg())
    finally:
        del os.environ[SECRET]
    assert env_class.tools == ("python",)  # read by a worker, which imported the class
    env = env_class()
    assert env.reset({"turns": 3}) == [{"role": "user", "content": "count to 3 (secret: none)"}]
    assert env.step("a", []) == EnvStep([{"role": "user", "content": "turn 1 done"}], 1.0, False)
    # The episode moves to another process: its pools are gone, the state goes with it.
    moved = pickle.loads(pickle.dumps(env))
    close_env_pools()
    assert moved.step("b", []) == EnvStep([{"role": "user", "content": "turn 2 done"}], 2.0, False)
    assert moved.step("c", []).done
    # The original copy is where it was: the state is a value, not a shared object.
    assert env.step("b", []).reward == 2.0
    assert env_class().demonstration({"turns": 1})[-1] == {"role": "assistant", "content": "1 2 3"}


def test_the_driver_only_reads_the_file_its_workers_import_it(tmp_path: Path, pools: None) -> None:
    marker = tmp_path / "imported_by"
    env_file = tmp_path / "my_env.py"
    env_file.write_text(
        "import os\n"
        "from rl.agents.environment import Environment\n"
        "try:  # the sandbox's filesystem is read-only: only an import outside it writes\n"
        f"    open({str(marker)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        "except OSError:\n"
        "    pass\n"
        "class Mine(Environment):\n"
        "    def reset(self, example):\n"
        "        return [{'role': 'user', 'content': example['prompt']}]\n"
    )
    env_class = get_environment(
        AgentConfig(environment=f"{env_file}:Mine", env_workers=2, env_timeout_s=TIMEOUT_S)
    )
    assert env_class().reset({"prompt": "hi"}) == [{"role": "user", "content": "hi"}]
    assert not marker.exists()  # nothing outside the sandbox imported it


@pytest.mark.parametrize(
    ("turn", "kind", "message"),
    [
        ("raise", "error", "KeyError: 'no such key'"),
        ("junk", "error", "step's reward nan is not a finite number"),
        (
            "wrong messages",
            "error",
            "step returned \"[{'role': 'user', 'content': 7}]\", not a list",
        ),
        ("die", "crash", "its worker died or sent junk"),
        ("hang", "timeout", f"no reply within agent.env_timeout_s={TIMEOUT_S:g} s"),
    ],
)
def test_a_failing_step_is_an_env_failure_and_the_pool_serves_the_next(
    turn: str, kind: str, message: str, pools: None
) -> None:
    cfg = _cfg(env_workers=1)  # one worker: the next request needs it alive (or replaced)
    env = get_environment(cfg)()
    env.reset({"turns": 2})
    workers = _workers()
    started = time.monotonic()
    with pytest.raises(EnvFailure, match=re.escape(message)) as failure:
        env.step(turn, [])
    assert failure.value.kind == kind
    if kind == "timeout":
        assert TIMEOUT_S <= time.monotonic() - started < TIMEOUT_S + SLACK_S
    replaced = _workers() != workers
    assert replaced == (kind != "error")  # a worker that hung or died is not reused
    fresh = get_environment(cfg)()
    fresh.reset({"turns": 1})
    assert fresh.step("a", []).done


def test_a_groups_resets_run_at_once_in_the_environment_workers(pools: None) -> None:
    n, reset_s = 4, 1.0
    env_class = get_environment(_cfg("SlowReset", env_workers=n))  # n workers, started here
    tokenizer = qwen_tokenizer()
    started = time.monotonic()
    samples = start_group(env_class, tokenizer, {"turns": 1, "reset_s": reset_s}, None, n, 0)
    took = time.monotonic() - started
    # One after another they take n * reset_s; at once about reset_s (plus each request's
    # round trip, which busy shared cores may slow).
    assert took < n * reset_s / 2, f"{n} resets of {reset_s} s took {took:.2f} s"
    assert [s.index for s in samples] == list(range(n))
    for sample in samples:  # each episode has its own state, reset in a worker
        assert sample.episode.env.step("a", []).done


def test_an_environment_that_cannot_be_loaded_fails_naming_it(pools: None) -> None:
    with pytest.raises(ValueError, match="is not a subclass of rl.agents.environment.Environment"):
        sandboxed_environment(_cfg("NotAnEnvironment"))
    with pytest.raises(ValueError, match="defines no 'Missing'"):
        sandboxed_environment(_cfg("Missing"))


def test_an_episode_whose_environment_fails_ends_and_is_counted(pools: None) -> None:
    env = get_environment(_cfg())()
    messages = env.reset({"turns": 2})
    episode = Episode(env, messages, None)

    async def no_tool(name: str, arguments: dict) -> None:
        raise AssertionError("no tool call in these turns")

    step = asyncio.run(observe(episode, "a", None, no_tool, "hermes", 10))
    assert (step.reward, step.done, episode.reward, episode.env_failures) == (1.0, False, 1.0, 0)
    step = asyncio.run(observe(episode, "raise", None, no_tool, "hermes", 10))
    assert (step.done, step.messages, episode.reward, episode.env_failures) == (True, [], 1.0, 1)


def test_a_worker_that_cannot_be_restarted_ends_episodes_not_the_run(
    tmp_path: Path, pools: None, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(episode_module, "_LOGGED", set())  # logged once: in this test
    env_file = tmp_path / "flaky_env.py"
    flaky = (
        "import os\n"
        "from rl.agents.environment import Environment, EnvStep\n"
        "class Flaky(Environment):\n"
        "    def reset(self, example):\n"
        "        return [{'role': 'user', 'content': 'hi'}]\n"
        "    def step(self, turn, tool_messages):\n"
        "        if turn == 'die':\n"
        "            os._exit(3)\n"
        "        return EnvStep([{'role': 'user', 'content': 'again'}])\n"
    )
    env_file.write_text(flaky)
    cfg = AgentConfig(environment=f"{env_file}:Flaky", env_workers=1, env_timeout_s=TIMEOUT_S)
    env = get_environment(cfg)()
    messages = env.reset({})

    async def no_tool(name: str, arguments: dict) -> None:
        raise AssertionError("no tool call in these turns")

    def step(turn: str) -> tuple[EnvStep, Episode]:
        episode = Episode(pickle.loads(pickle.dumps(env)), list(messages), None)
        return asyncio.run(observe(episode, turn, None, no_tool, "hermes", 10)), episode

    # The pool's only worker dies, and the file no longer loads: no worker can replace it.
    env_file.write_text("raise RuntimeError('this environment cannot start now')\n" + flaky)
    with caplog.at_level(logging.WARNING):
        assert step("die")[1].env_failures == 1
        for _ in range(2):  # each request tries to start a worker again, and fails alone
            result, episode = step("a")
            assert result.done and episode.env_failures == 1
    failures = [r.getMessage() for r in caplog.records if "environment failed" in r.message]
    assert len(failures) == 2  # once per kind: the crash, then the pool's state
    assert "(unavailable)" in failures[1] and "this environment cannot start now" in failures[1]
    env_file.write_text(flaky)  # the cause gone, the next request starts a worker: served
    result, episode = step("a")
    assert (result.messages, result.done, episode.env_failures) == (
        [{"role": "user", "content": "again"}],
        False,
        0,
    )


def test_a_step_that_forks_and_hangs_leaves_no_process_after_its_timeout(pools: None) -> None:
    env = get_environment(_cfg())()
    env.reset({"turns": 3})
    marker = f"tandem-test-{uuid.uuid4().hex}"
    with pytest.raises(EnvFailure, match="no reply within agent.env_timeout_s"):
        # The sleeper leaves the worker's session, as a daemon would.
        env.step(f"fork and hang {marker}", [])
    wait_until(lambda: not marked_pids(marker), "the end of the step's processes")
