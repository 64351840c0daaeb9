"""A verifiers environment (the real `verifiers` package, v1 API) run by Tandem, offline: its
tasks made by a sandboxed row worker (rl.agents.ecosystem.load_rows), its episodes run by the
built-in agent function (rl.agents.verifiers_agent.run) in real agent sandboxes through
ApiAgentLoop's endpoint, on the PyTorch engine serving a tiny Qwen2. The environment,
verifiers_envs/tandem_echo, has two turns per episode (the second a user turn it sends) and a
rubric of two weighted rewards, computed again here from the replies the endpoint served."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rl.agents.ecosystem import VERIFIERS_FIELD, load_rows, verifiers_env
from rl.config import AgentConfig
from rl.types import Episode, Sample, SamplingParams
from rollout.api_agent_loop import ApiAgentLoop
from rollout.engine_loop import GenerationLoop
from tests.helpers.agent_engines import ROLLOUT, TEMPERATURE, Engines
from tests.helpers.processes import child_pids
from tests.helpers.waiting import wait_until

pytest.importorskip("verifiers")
pytestmark = pytest.mark.integration

ENVIRONMENT = f"verifiers:{Path(__file__).with_name('verifiers_envs') / 'tandem_echo'}"
WORDS = {"apple", "river", "stone", "cloud", "ember", "maple"}  # the environment's tasks
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


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return load_rows(verifiers_env(ENVIRONMENT), {}, count=10, seed=3)


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
    samples = [
        Sample([], group, k, loss_mask=[], episode=Episode(None, [], None, example=row))
        for group, row in enumerate(rows[:NUM_TASKS])
        for k in range(GROUP)
    ]
    cfg = AgentConfig(environment=ENVIRONMENT, max_turns=4, env_workers=1, env_timeout_s=120)
    params = SamplingParams(64, n=GROUP, temperature=TEMPERATURE, seed=5)

    async def run() -> list[Sample]:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        engine = engines.shared("torch", "untied")
        loop = ApiAgentLoop(GenerationLoop(engine), tokenizer, cfg, ROLLOUT.max_model_len)
        await loop.open()
        try:
            return await loop.generate(samples, params)
        finally:
            await loop.close()

    for sample in asyncio.run(run()):
        episode = sample.episode
        word = json.loads(episode.example[VERIFIERS_FIELD])["task"]["word"]
        assert episode.env_failures == 0 and episode.prefix_breaks == 0
        # The environment's protocol: the model answers, the environment asks once more.
        assert len(episode.calls) == 2 and sample.finish_reason == "stop"
        second = episode.calls[1]["request"]["messages"]
        assert second[-1] == {"role": "user", "content": f"Say it once more: {word}"}
        replies = [call["reply"]["content"] or "" for call in episode.calls]
        assert episode.reward == pytest.approx(rubric(replies, word))
