"""ApiAgentLoop with real parts: agent functions written against the plain `openai` SDK
(api_agents.py), run in real sandboxes (rl.agents.agent_worker) that reach the loop's real
HTTP endpoint over its Unix socket, and the PyTorch and vLLM engines in this process serving a
tiny Qwen2 with Qwen2.5's chat template (tests.helpers.agent_engines)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl.config import AgentConfig
from rl.types import Episode, Sample, SamplingParams
from rollout.api_agent_loop import ApiAgentLoop
from rollout.engine_loop import GenerationLoop
from tests.helpers.agent_engines import (
    PARITY_TOL,
    ROLLOUT,
    TEMPERATURE,
    Engines,
    parity_gap,
)
from tests.helpers.processes import child_pids
from tests.helpers.waiting import wait_until
from tests.integration.rollout.api_agents import TURNS

pytestmark = pytest.mark.integration

AGENTS = Path(__file__).with_name("api_agents.py")
EXAMPLE = {"prompt": "What is the weather in Paris?"}
MAX_NEW_TOKENS = 200


def _agent(function: str, **overrides) -> AgentConfig:
    return AgentConfig(
        environment=f"openai:{AGENTS}:{function}", max_turns=TURNS, env_workers=2, **overrides
    )


@pytest.fixture(scope="module", autouse=True)
def no_workers_left() -> Iterator[None]:
    yield
    wait_until(lambda: not child_pids(b"rl.agents.agent_worker"), "the agent workers exiting")


def _episodes(n: int, example: dict = EXAMPLE, group_id: int = 3) -> list[Sample]:
    return [
        Sample([], group_id, k, loss_mask=[], episode=Episode(None, [], None, example=example))
        for k in range(n)
    ]


def _params(n: int, stop_every: int = 0) -> SamplingParams:
    return SamplingParams(
        MAX_NEW_TOKENS, n=n, temperature=TEMPERATURE, seed=11, stop_every=stop_every
    )


async def _open(engine, model_dir: Path, cfg: AgentConfig) -> ApiAgentLoop:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    loop = ApiAgentLoop(GenerationLoop(engine), tokenizer, cfg, ROLLOUT.max_model_len)
    await loop.open()
    return loop


def _run(engines: Engines, model_dir: Path, cfg: AgentConfig, samples, params, engine="torch"):
    async def run() -> list[Sample]:
        loop = await _open(engines.shared(engine, "untied"), model_dir, cfg)
        try:
            return await loop.generate(samples, params)
        finally:
            await loop.close()

    return asyncio.run(run())


@pytest.mark.parametrize("engine", ["torch", "vllm"])
def test_an_sdk_agents_calls_are_one_sequence_whose_logprobs_match_transformers(
    engines: Engines, model_dir: Path, engine: str
) -> None:
    samples = _run(engines, model_dir, _agent("conversation"), _episodes(3), _params(3), engine)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for sample in samples:
        episode = sample.episode
        assert sample.finish_reason == "stop" and episode.env_failures == 0
        assert episode.num_turns == TURNS and len(episode.calls) == TURNS
        assert episode.prefix_breaks == 0 and episode.refused_calls == 0
        # The conversation the agent held, rendered by the template with each sampled turn's
        # text as content, is the text of the tokens held: nothing re-tokenized or re-rendered.
        conversation = [{"role": "user", "content": EXAMPLE["prompt"]}]
        for turn, call in enumerate(episode.calls):
            conversation.append({"role": "assistant", "content": call["reply"]["content"]})
            if turn < TURNS - 1:
                conversation.append({"role": "user", "content": f"Go on ({turn})."})
        held = tokenizer.decode(sample.prompt_ids + sample.response_ids, skip_special_tokens=False)
        rendered = tokenizer.apply_chat_template(
            conversation, tools=[episode.tools[0]], tokenize=False
        )
        assert rendered.startswith(held)
        assert sum(sample.loss_mask) == sum(c["usage"]["completion_tokens"] for c in episode.calls)
        assert parity_gap(model, sample) < PARITY_TOL
        assert sample.response_text == episode.calls[-1]["reply"]["content"]


def test_a_framework_that_trims_its_history_trains_each_segment_as_sampled(
    engines: Engines, model_dir: Path
) -> None:
    samples = _run(engines, model_dir, _agent("trims"), _episodes(2), _params(2))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for sample in samples:
        episode = sample.episode
        assert episode.prefix_breaks == TURNS - 1 and len(episode.segments) == TURNS - 1
        sequences = [*episode.segments, sample]
        sampled = sum(c["usage"]["completion_tokens"] for c in episode.calls)
        assert sum(sum(s.loss_mask) for s in sequences) == sampled  # no sampled token lost
        for sequence in sequences:
            assert parity_gap(model, sequence) < PARITY_TOL


def test_a_number_the_agent_returns_is_its_reward(engines: Engines, model_dir: Path) -> None:
    [sample] = _run(engines, model_dir, _agent("rewarded"), _episodes(1), _params(1))
    assert sample.episode.reward == 0.25 and sample.episode.env_failures == 0


def test_the_agent_reaches_its_endpoint_with_its_own_key_and_nothing_else(
    engines: Engines, model_dir: Path
) -> None:
    with socket.socket() as listener:  # a host service the agent must not reach
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        example = {**EXAMPLE, "port": listener.getsockname()[1]}
        [sample] = _run(
            engines, model_dir, _agent("reaches_out"), _episodes(1, example), _params(1)
        )
    assert sample.response_text == "host port: ConnectionRefusedError; other key: refused"


@pytest.mark.parametrize(
    ("function", "timeout"), [("raises", False), ("hangs", True), ("floods", True)]
)
def test_an_agent_that_raises_hangs_or_floods_is_stopped_and_counted(
    engines: Engines, model_dir: Path, function: str, timeout: bool
) -> None:
    cfg = _agent(function, env_timeout_s=5.0)
    samples = _run(engines, model_dir, cfg, _episodes(2), _params(2))
    for sample in samples:
        episode = sample.episode
        assert episode.env_failures == 1 and episode.env_timeouts == int(timeout)
        assert episode.num_turns >= 1 and sum(sample.loss_mask) > 0  # trains on its turns
        assert sample.finish_reason == "stop"
    if function == "floods":
        assert all(s.episode.refused_calls > 0 and s.episode.max_turns_reached for s in samples)


def test_an_agent_that_never_calls_the_policy_stops_the_run_naming_it(
    engines: Engines, model_dir: Path
) -> None:
    with pytest.raises(ValueError, match="without_calls.*no sampled turn"):
        _run(engines, model_dir, _agent("without_calls"), _episodes(1), _params(1))


def test_completions_extend_the_sequence_by_the_text_the_agent_appends(
    engines: Engines, model_dir: Path
) -> None:
    [sample] = _run(engines, model_dir, _agent("completions"), _episodes(1), _params(1))
    assert sample.episode.num_turns == 2 and sample.episode.prefix_breaks == 0


def _paused_run(engines: Engines, model_dir: Path, cfg: AgentConfig, fresh: bool):
    """Episodes generated with abort points every 4 tokens, each call of the loop on a fresh
    engine (another worker) or on the same one, until none is partial; and the pauses."""

    async def run() -> tuple[list[Sample], int]:
        samples, pauses = _episodes(2), 0
        for _ in range(200):
            engine = (
                engines.fresh("torch", "untied") if fresh else engines.shared("torch", "untied")
            )
            loop = await _open(engine, model_dir, cfg)
            try:
                samples = await loop.generate(samples, _params(2, stop_every=4))
            finally:
                await loop.close()
            partial = [s for s in samples if s.is_partial]
            if not partial:
                return samples, pauses
            pauses += len(partial)
        raise AssertionError("the episodes never finished")

    return asyncio.run(run())


def test_a_paused_episode_resumes_on_another_worker_by_replay_to_the_same_tokens(
    engines: Engines, model_dir: Path
) -> None:
    """Abort points every 4 tokens pause each turn mid-way; each time the agent is stopped,
    and the resumed episode runs its agent again from the start, answered from the record up
    to the turn in flight. Resumed on other workers, the episodes are those resumed on the
    same one, token for token: what a run resumed from a checkpoint relies on."""
    cfg = _agent("conversation")
    here, pauses = _paused_run(engines, model_dir, cfg, fresh=False)
    elsewhere, _ = _paused_run(engines, model_dir, cfg, fresh=True)
    assert pauses > 2 * TURNS
    for a, b in zip(here, elsewhere, strict=True):
        assert a.finish_reason == "stop" and a.episode.num_turns == TURNS
        assert b.response_ids == a.response_ids and b.prompt_ids == a.prompt_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-6)
        assert b.episode.calls == a.episode.calls
        assert b.episode.replay_mismatches == 0 and b.episode.env_failures == 0


def test_an_interrupt_pauses_the_episodes_and_they_resume_whole(
    engines: Engines, model_dir: Path
) -> None:
    async def run() -> list[Sample]:
        loop = await _open(engines.shared("torch", "untied"), model_dir, _agent("conversation"))
        try:
            loop.start({0: _episodes(3)}, _params(3))
            while not any(live.in_call for live in loop._live.values()):
                await asyncio.sleep(0.005)
            assert loop.interrupt() >= 1  # a call's turn was being generated
            stopped = (await loop.poll())[0]
            assert any(s.is_partial for s in stopped)
            return await loop.generate([s for s in stopped if s.is_partial], _params(3))
        finally:
            await loop.close()

    for sample in asyncio.run(run()):
        assert sample.finish_reason == "stop" and sample.episode.num_turns == TURNS
        assert sample.episode.replay_mismatches == 0


def test_rl_eval_and_generate_run_an_agent_functions_episodes(model_dir: Path) -> None:
    from rl.run.offline_eval import Evaluator

    evaluator = Evaluator(
        model_dir, MAX_NEW_TOKENS, ROLLOUT.max_model_len, 0, "torch", _agent("conversation")
    )
    try:
        [group] = evaluator.sample([EXAMPLE], n=2, temperature=TEMPERATURE)
    finally:
        evaluator.close()
    assert [s.episode.num_turns for s in group] == [TURNS, TURNS]
    assert all(s.response_text == s.episode.calls[-1]["reply"]["content"] for s in group)
