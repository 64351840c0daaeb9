"""AgentLoop's episodes, each ended on its own: a turn that the chat template cannot extend
(`TemplateMismatch`) ends that episode, counted in agent/template_mismatches, the cause logged
once; the group's other episodes and the run go on.

The policy is scripted (the loop is pure logic around the engine): each sample's turns are
fixed token ids, ended as a model of that family may end them. The chat templates are real,
verbatim (tests/helpers/chat_templates.py), in locally built tokenizers: Qwen2.5's with a
turn stopped on `<|endoftext|>`, Llama-3's that trims what the model wrote, Qwen3's that
drops earlier reasoning once a user message follows.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from concurrent.futures import Future

import pytest

import rl.agents.episode as episode_module
from rl.agents.environment import Environment, EnvStep
from rl.agents.episode import episode_metrics, start_group
from rl.agents.tool_pool import ToolResult
from rl.config import AgentConfig
from rl.types import Sample, SamplingParams
from rollout.agent_loop import AgentLoop
from tests.helpers.chat_templates import (
    WEATHER_TOOL,
    llama3_tokenizer,
    qwen3_tokenizer,
    qwen_tokenizer,
)

PROMPT = "What is the weather in Paris today?"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
RESULT = '{"temperature": 21, "sky": "sunny"}'
PARAMS = SamplingParams(max_new_tokens=1024)
AGENT = AgentConfig(max_turns=4)


@pytest.fixture(autouse=True)
def fresh_log_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """What this test logs once does not depend on what earlier tests logged."""
    monkeypatch.setattr(episode_module, "_LOGGED", set())


class AskAgain(Environment):
    """Shows tool results; asks "Are you sure?" (a user message) after the first answer and
    ends the episode after the second."""

    def reset(self, example: dict) -> list[dict]:
        self.answers = 0
        return [{"role": "user", "content": PROMPT}]

    def step(self, turn: str, tool_messages: list[dict]) -> EnvStep:
        if tool_messages:
            return EnvStep(tool_messages)
        self.answers += 1
        if self.answers == 1:
            return EnvStep([{"role": "user", "content": "Are you sure?"}])
        return EnvStep(done=True)


class ScriptedTurns:
    """`generate` as AgentLoop asks it of rollout.engine_loop.GenerationLoop: each sample's
    next turn is the next entry of its script (token ids, as a policy sampled them)."""

    engine = None

    def __init__(self, scripts: list[list[list[int]]]) -> None:
        self.scripts = scripts

    async def generate(self, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        await asyncio.sleep(0)  # the other episodes step meanwhile
        for sample in samples:
            ids = self.scripts[sample.index][sample.episode.num_turns]
            sample.response_ids += ids
            sample.logprobs += [-0.5] * len(ids)
            sample.token_versions += [0] * len(ids)
            sample.finish_reason = "stop"
        return samples

    def interrupt(self) -> int:
        return 0


class SunnyTools:
    """A ToolPool's `submit`: every call answers RESULT at once."""

    def submit(self, name: str, arguments: dict) -> Future:
        done: Future = Future()
        done.set_result(ToolResult(RESULT, None, 0.0))
        return done


def turn(tokenizer, text: str, end: str) -> list[int]:
    """`text` as the policy sampled it, then the special token `end` it stopped on."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [
        tokenizer.convert_tokens_to_ids(end)
    ]


def play(tokenizer, scripts: list[list[list[int]]]) -> list[Sample]:
    """One group, a sample per script, through AgentLoop as a rollout worker runs it."""
    samples = start_group(AskAgain, tokenizer, {}, [WEATHER_TOOL], len(scripts), group_id=0)
    loop = AgentLoop(ScriptedTurns(scripts), tokenizer, AGENT, SunnyTools())
    return asyncio.run(asyncio.wait_for(loop.generate(samples, PARAMS), 30))


def assert_rendered_whole(tokenizer, sample: Sample) -> None:
    """A finished episode's tokens say what the template renders for its conversation, up
    to its last end-of-turn (what follows it is the next message's, rendered after it)."""
    more = [{"role": "user", "content": "Thanks."}]
    text = tokenizer.apply_chat_template(
        sample.episode.messages + more, tools=[WEATHER_TOOL], tokenize=False
    )
    held = tokenizer.decode(sample.prompt_ids + sample.response_ids, skip_special_tokens=False)
    assert text.startswith(held) and "Thanks." not in held


def assert_ended_after(sample: Sample, script: list[list[int]], turns: int) -> None:
    """The episode ended after `turns` turns of `script`, its last turn appended as sampled
    and nothing after it."""
    assert sample.episode.num_turns == turns
    assert sample.episode.template_mismatches == 1
    assert sample.response_ids[-len(script[turns - 1]) :] == script[turns - 1]
    assert sample.loss_mask == sample.sampled_mask
    assert sample.loss_mask[-len(script[turns - 1]) :] == [1] * len(script[turns - 1])
    assert len(sample.loss_mask) == len(sample.response_ids)


def test_a_qwen25_turn_stopped_on_endoftext_ends_only_its_episode():
    tokenizer = qwen_tokenizer()
    good = [
        turn(tokenizer, CALL, "<|im_end|>"),
        turn(tokenizer, "It is sunny.", "<|im_end|>"),
        turn(tokenizer, "Yes.", "<|im_end|>"),
    ]
    # Qwen2.5-Instruct stops on <|endoftext|> too; its template writes <|im_end|> there.
    bad = [turn(tokenizer, CALL, "<|endoftext|>")]
    samples = play(tokenizer, [good, bad])
    assert samples[0].episode.num_turns == 3 and samples[0].episode.template_mismatches == 0
    assert_rendered_whole(tokenizer, samples[0])
    assert samples[1].response_ids == bad[0]  # nothing appended after the turn
    assert_ended_after(samples[1], bad, turns=1)
    assert samples[1].response_text == CALL
    assert episode_metrics(samples)["agent/template_mismatches"] == 1.0


def test_a_llama3_turn_with_whitespace_its_template_trims_ends_only_its_episode():
    tokenizer = llama3_tokenizer()
    good = [turn(tokenizer, "It is sunny.", "<|eot_id|>"), turn(tokenizer, "Yes.", "<|eot_id|>")]
    bad = [turn(tokenizer, " It is sunny.\n", "<|eot_id|>")]
    samples = play(tokenizer, [good, bad, good])
    for sample in (samples[0], samples[2]):
        assert sample.episode.num_turns == 2 and sample.episode.template_mismatches == 0
        assert_rendered_whole(tokenizer, sample)
    assert samples[1].response_ids == bad[0]
    assert_ended_after(samples[1], bad, turns=1)
    assert episode_metrics(samples)["agent/template_mismatches"] == 1.0


def test_qwen3_reasoning_dropped_once_a_user_message_follows_ends_only_its_episode():
    tokenizer = qwen3_tokenizer()
    good = [turn(tokenizer, "It is sunny.", "<|im_end|>"), turn(tokenizer, "Yes.", "<|im_end|>")]
    reasoning = [
        # Tool results keep the reasoning of the turns since the last user message ...
        turn(tokenizer, f"<think>\nAsk the tool.\n</think>\n\n{CALL}", "<|im_end|>"),
        # ... a user message does not: the template renders both turns without it.
        turn(tokenizer, "<think>\nThe tool says sunny.\n</think>\n\nIt is sunny.", "<|im_end|>"),
        turn(tokenizer, "Yes.", "<|im_end|>"),
    ]
    samples = play(tokenizer, [good, reasoning])
    assert samples[0].episode.num_turns == 2 and samples[0].episode.template_mismatches == 0
    assert_rendered_whole(tokenizer, samples[0])
    assert_ended_after(samples[1], reasoning, turns=2)
    assert samples[1].episode.messages[-1]["role"] == "assistant"
    assert [m["role"] for m in samples[1].episode.messages] == [
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
    assert episode_metrics(samples)["agent/template_mismatches"] == 1.0


def test_the_cause_is_logged_once_for_many_episodes(caplog: pytest.LogCaptureFixture):
    tokenizer = qwen_tokenizer(name="local/stops-on-endoftext")
    bad = [turn(tokenizer, CALL, "<|endoftext|>")]
    with caplog.at_level(logging.WARNING):
        first = play(tokenizer, [copy.deepcopy(bad) for _ in range(3)])
        second = play(tokenizer, [copy.deepcopy(bad) for _ in range(2)])
    assert sum(s.episode.template_mismatches for s in first + second) == 5
    logged = [r.getMessage() for r in caplog.records if "local/stops-on-endoftext" in r.message]
    assert len(logged) == 1
    assert "is not append-only" in logged[0] and "<|endoftext|>" in logged[0]
    assert "agent/template_mismatches" in logged[0]
