"""Environments from the ecosystem run by Tandem, offline, with the real packages: their
episodes run by each source's built-in agent function in real agent sandboxes through
ApiAgentLoop's endpoint, on the PyTorch engine serving a tiny Qwen2.

- verifiers (v1 API): the tasks made by a sandboxed row worker (rl.agents.ecosystem.load_rows);
  the environment, verifiers_envs/tandem_echo, has two turns per episode (the second a user
  turn it sends) and a rubric of two weighted rewards;
- OpenEnv (openenv-core): the episodes made by the task (rl.data.tasks.openenv_env), each
  played against a server of the environment's own (rl.agents.openenv_agent) through
  OpenEnv's client; the environment, openenv_envs/tandem_spell, asks for a word twice and
  rewards each step.

Each environment's rewards are computed again here from the replies the endpoint served."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rl.agents.ecosystem import OPENENV, VERIFIERS_FIELD, ecosystem_env, load_rows
from rl.config import AgentConfig, DataConfig
from rl.data.tasks import get_task
from rl.types import Episode, Sample, SamplingParams
from rollout.api_agent_loop import ApiAgentLoop
from rollout.engine_loop import GenerationLoop
from tests.helpers.agent_engines import ROLLOUT, TEMPERATURE, Engines
from tests.helpers.processes import child_pids
from tests.helpers.waiting import wait_until

pytest.importorskip("verifiers")
pytest.importorskip("openenv")
pytestmark = pytest.mark.integration

ENVIRONMENT = f"verifiers:{Path(__file__).with_name('verifiers_envs') / 'tandem_echo'}"
OPENENV_ENV = f"openenv:{Path(__file__).with_name('openenv_envs') / 'tandem_spell'}"
# The words of both environments' tasks; tandem_spell's reset picks WORD_LIST[seed % 6].
WORD_LIST = ("apple", "river", "stone", "cloud", "ember", "maple")
WORDS = set(WORD_LIST)
NUM_TASKS = 2
GROUP = 2


def rubric(replies: list[str], word: str) -> float:
    """tandem_echo's rubric, written again: half the share of the word's distinct letters in
    the first reply, plus 1 when the last reply holds the word."""
    first = len(set(word) & set(replies[0].lower())) / len(set(word))
    return 0.5 * first + float(word in replies[-1].lower())


@pytest.fixture(scope="module", autouse=True)
def no_workers_left() -> Iterator[None]:
    yield
    wait_until(
        lambda: (
            not child_pids(b"rl.agents.agent_worker")
            and not child_pids(b"rl.agents.verifiers_agent")
        ),
        "the agent and row workers exiting",
    )


def run_episodes(
    engines: Engines, model_dir: Path, samples: list[Sample], cfg: AgentConfig, budget: int
) -> list[Sample]:
    """`samples`' episodes, run by `cfg.environment`'s agent function through the endpoint,
    each with `budget` tokens after its first prompt."""
    params = SamplingParams(budget, n=GROUP, temperature=TEMPERATURE, seed=5)

    async def run() -> list[Sample]:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        engine = engines.shared("torch", "untied")
        loop = ApiAgentLoop(GenerationLoop(engine), tokenizer, cfg, ROLLOUT.max_model_len)
        await loop.open()
        try:
            return await loop.generate(samples, params)
        finally:
            await loop.close()

    return asyncio.run(run())


def group_samples(examples: list[dict]) -> list[Sample]:
    return [
        Sample([], group, k, loss_mask=[], episode=Episode(None, [], None, example=example))
        for group, example in enumerate(examples)
        for k in range(GROUP)
    ]


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return load_rows(ecosystem_env(ENVIRONMENT), {}, count=10, seed=3)


def test_the_environments_tasks_come_from_a_sandboxed_worker_as_json_rows(
    rows: list[dict],
) -> None:
    assert len(rows) == len(WORDS)  # a finite taskset gives what it has
    tasks = [json.loads(row[VERIFIERS_FIELD]) for row in rows]
    assert {task["task"]["word"] for task in tasks} == WORDS
    assert [task["task"]["idx"] for task in tasks] != sorted(t["task"]["idx"] for t in tasks)
    for row, task in zip(rows, tasks, strict=True):
        assert task["env"] == "tandem_echo" and row["prompt"] == task["task"]["prompt"]
        assert row["prompt"] == f"Say the word {task['task']['word']}."


def test_episodes_run_the_environments_turns_and_its_rubric_gives_their_reward(
    engines: Engines, model_dir: Path, rows: list[dict]
) -> None:
    samples = group_samples(rows[:NUM_TASKS])
    cfg = AgentConfig(environment=ENVIRONMENT, max_turns=4, env_workers=1, env_timeout_s=120)
    for sample in run_episodes(engines, model_dir, samples, cfg, budget=64):
        episode = sample.episode
        word = json.loads(episode.example[VERIFIERS_FIELD])["task"]["word"]
        assert episode.env_failures == 0 and episode.prefix_breaks == 0
        # The environment's protocol: the model answers, the environment asks once more.
        assert len(episode.calls) == 2 and sample.finish_reason == "stop"
        second = episode.calls[1]["request"]["messages"]
        assert second[-1] == {"role": "user", "content": f"Say it once more: {word}"}
        replies = [call["reply"]["content"] or "" for call in episode.calls]
        assert episode.reward == pytest.approx(rubric(replies, word))


def spelled(replies: list[str], word: str) -> float:
    """tandem_spell's rewards, written again, for the replies it took as actions (a reply that
    is blank or a JSON object is no `message`: the episode ends there)."""
    reward = 0.0
    for turn, reply in enumerate(replies):
        if turn == 0:
            reward += 0.5 * len(set(word) & set(reply.lower())) / len(set(word))
        else:
            reward += float(word in reply.lower())
    return reward


def takes_as_message(reply: str) -> bool:
    try:
        return bool(reply.strip()) and not isinstance(json.loads(reply), dict)
    except ValueError:
        return True


def test_openenv_episodes_play_a_server_of_their_own_and_sum_its_step_rewards(
    engines: Engines, model_dir: Path
) -> None:
    task = get_task(OPENENV_ENV)
    data = DataConfig(task=OPENENV_ENV, num_train=NUM_TASKS, num_test=0)
    task.check(data)
    examples = task.generate(data, NUM_TASKS, random.Random(11))
    cfg = AgentConfig(environment=OPENENV_ENV, max_turns=4, env_workers=1, env_timeout_s=120)
    samples = run_episodes(engines, model_dir, group_samples(examples), cfg, budget=400)
    whole = 0  # episodes the environment ended itself
    for sample in samples:
        episode = sample.episode
        seed = json.loads(episode.example[OPENENV.field])["reset"]["seed"]
        word = WORD_LIST[seed % len(WORD_LIST)]  # the reset's seed reached the environment
        assert episode.env_failures == 0 and episode.prefix_breaks == 0
        first = json.loads(episode.calls[0]["request"]["messages"][0]["content"])
        assert first["observation"] == {"prompt": f"Say the word {word}."}
        assert first["action_schema"]["required"] == ["message"]
        # The replies the environment took as actions: up to the first that is no message or
        # that the endpoint cut (finish reason "length" ends the episode).
        acted = []
        for call in episode.calls:
            reply = call["reply"]["content"] or ""
            if call["finish_reason"] == "length" or not takes_as_message(reply):
                break
            acted.append(reply)
        if len(acted) == 2:  # then the environment was done after the second
            whole += 1
            assert len(episode.calls) == 2 and sample.finish_reason == "stop"
            second = episode.calls[1]["request"]["messages"][-1]["content"]
            assert json.loads(second) == {"observation": {"prompt": f"Say it once more: {word}"}}
        assert len(episode.calls) == min(len(acted) + 1, 2)  # the first non-action ends it
        assert episode.reward == pytest.approx(spelled(acted, word))
    assert whole > 0, "no episode ran the environment to its end"
