"""rl.agents.api_calls: an agent function's calls become one token sequence when each call's
history is the episode's so far; the engine's part (sampling a turn) is played here by
appending chosen tokens, as the engine appends them.

The expected sequences come from the chat template itself: the text of every token held must
be what Qwen2.5's template renders for the conversation with the sampled turns as content."""

import json

import pytest
import torch
from openai.types.chat import ChatCompletionMessage

from rl.agents.api_calls import Limits, ReplayMismatch, begin_call, end_call, final_answer
from rl.agents.openai_api import BadRequest, parse_chat_request, parse_completion_request
from rl.types import NOT_SAMPLED, Episode, Sample
from tests.helpers.chat_templates import WEATHER_TOOL, qwen_tokenizer

TOOLS = [WEATHER_TOOL]
USER = {"role": "user", "content": "What is the weather in Paris?"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
RESULT = '{"sky": "sunny"}'
ANSWER = "It is sunny."
LIMITS = Limits(max_turns=4, max_new_tokens=400, max_model_len=4096)
VERSION = 3


@pytest.fixture(scope="module")
def tokenizer():
    return qwen_tokenizer()


def _sample() -> Sample:
    return Sample([], 5, 1, loss_mask=[], episode=Episode(None, [], None, example={"q": 1}))


def _sample_turn(tokenizer, sample: Sample, ids: list[int], finish: str = "stop") -> None:
    """What the engine does for a turn: its tokens appended with log-probs and versions."""
    sample.response_ids += ids
    sample.logprobs += [-0.5] * len(ids)
    sample.token_versions += [VERSION] * len(ids)
    sample.finish_reason = finish


def _turn_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [
        tokenizer.convert_tokens_to_ids("<|im_end|>")
    ]


def _chat(messages, **extra) -> object:
    return parse_chat_request({"messages": messages, "tools": TOOLS, **extra})


def _served(tokenizer, sample, request, text: str) -> dict:
    plan = begin_call(tokenizer, sample, request, LIMITS)
    assert plan.served is None
    _sample_turn(tokenizer, sample, _turn_ids(tokenizer, text))
    return end_call(tokenizer, sample, LIMITS, "hermes")


def _sdk_history(reply: dict) -> dict:
    """The reply as an agent appends it to its history with the openai SDK."""
    return ChatCompletionMessage.model_validate(reply).model_dump(exclude_none=True)


def test_calls_that_extend_the_history_make_one_sequence_the_template_renders(tokenizer) -> None:
    sample = _sample()
    first = _served(tokenizer, sample, _chat([USER]), CALL)
    assert first["finish_reason"] == "tool_calls"
    tool = {
        "role": "tool",
        "tool_call_id": first["reply"]["tool_calls"][0]["id"],
        "content": RESULT,
    }
    messages = [USER, _sdk_history(first["reply"]), tool]
    second = _served(tokenizer, sample, _chat(messages), ANSWER)
    assert second["reply"] == {"role": "assistant", "content": ANSWER}
    assert second["finish_reason"] == "stop"
    conversation = [
        USER,
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": RESULT},
        {"role": "assistant", "content": ANSWER},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tools=TOOLS, tokenize=False)
    held = tokenizer.decode(sample.prompt_ids + sample.response_ids, skip_special_tokens=False)
    assert rendered == held + "\n"  # the template's newline after the last <|im_end|>
    # The sampled turns are in the loss mask with their log-probs and version; nothing else.
    turn_1, turn_2 = _turn_ids(tokenizer, CALL), _turn_ids(tokenizer, ANSWER)
    observation = len(sample.response_ids) - len(turn_1) - len(turn_2)
    assert sample.loss_mask == [1] * len(turn_1) + [0] * observation + [1] * len(turn_2)
    assert (
        sample.token_versions[len(turn_1) : len(turn_1) + observation]
        == [NOT_SAMPLED] * observation
    )
    assert sample.episode.num_turns == 2 and sample.episode.prefix_breaks == 0
    # Counted as a native episode's turns are: one turn with one well-formed call.
    assert (sample.episode.turns_with_calls, sample.episode.turns_well_formed) == (1, 1)
    assert sample.episode.num_calls == 1 and not sample.episode.errors
    assert final_answer(sample) == ANSWER
    assert second["usage"] == {
        "prompt_tokens": len(sample.prompt_ids) + len(turn_1) + observation,
        "completion_tokens": len(turn_2),
    }


def test_sampled_tokens_are_kept_verbatim_even_where_they_are_not_the_canonical_encoding(
    tokenizer,
) -> None:
    sample = _sample()
    plan = begin_call(tokenizer, sample, _chat([USER]), LIMITS)
    assert plan.served is None
    # "sunny" sampled one character at a time: encoding the text again would merge them.
    ids = [tokenizer.convert_tokens_to_ids(c) for c in "sunny"]
    assert ids != tokenizer("sunny", add_special_tokens=False)["input_ids"]
    _sample_turn(tokenizer, sample, ids + [tokenizer.convert_tokens_to_ids("<|im_end|>")])
    call = end_call(tokenizer, sample, LIMITS, "hermes")
    assert call["reply"]["content"] == "sunny"
    follow = [USER, _sdk_history(call["reply"]), {"role": "user", "content": "And tomorrow?"}]
    assert begin_call(tokenizer, sample, _chat(follow), LIMITS).served is None
    assert sample.response_ids[: len(ids)] == ids


BREAKS = [
    lambda reply: [USER, {"role": "user", "content": "trimmed"}],  # history cut
    lambda reply: [
        {**USER, "content": "reworded"},
        _sdk_history(reply),
        {"role": "user", "content": "x"},
    ],
    lambda reply: [
        USER,
        {"role": "assistant", "content": "rewritten"},
        {"role": "user", "content": "x"},
    ],
    lambda reply: [USER, _sdk_history(reply)],  # nothing new: the same turn asked again
]
END = Limits(max_turns=4, max_new_tokens=400, max_model_len=4096, segments=False)


@pytest.mark.parametrize("history", BREAKS)
def test_a_prefix_break_closes_a_segment_and_renders_the_new_history_as_a_prompt(
    tokenizer, history
) -> None:
    sample = _sample()
    first = _served(tokenizer, sample, _chat([USER]), ANSWER)
    held = (list(sample.prompt_ids), list(sample.response_ids), list(sample.logprobs))
    messages = history(first["reply"])
    plan = begin_call(tokenizer, sample, _chat(messages), LIMITS)
    assert plan.served is None and sample.episode.prefix_breaks == 1
    [segment] = sample.episode.segments
    assert (segment.prompt_ids, segment.response_ids, segment.logprobs) == held
    assert segment.loss_mask == [1] * len(held[1]) and segment.episode is None
    # The new sequence's prompt is the template's rendering of the call's whole history.
    rendered = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in messages],
        tools=TOOLS,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert tokenizer.decode(sample.prompt_ids, skip_special_tokens=False) == rendered
    assert sample.response_ids == [] and sample.loss_mask == []
    _sample_turn(tokenizer, sample, _turn_ids(tokenizer, ANSWER))
    assert end_call(tokenizer, sample, LIMITS, "hermes")["reply"]["content"] == ANSWER
    assert sample.episode.num_turns == 2


@pytest.mark.parametrize("history", BREAKS)
def test_with_prefix_break_end_a_break_is_refused_and_counted(tokenizer, history) -> None:
    sample = _sample()
    first = _served(tokenizer, sample, _chat([USER]), ANSWER)
    held = list(sample.response_ids)
    plan = begin_call(tokenizer, sample, _chat(history(first["reply"])), END)
    assert plan.served["finish_reason"] == "length"
    assert sample.episode.prefix_breaks == 1 and sample.episode.refused_calls == 1
    assert sample.response_ids == held and len(sample.episode.calls) == 1
    assert not sample.episode.segments


def test_other_tools_than_the_episodes_are_a_prefix_break(tokenizer) -> None:
    sample = _sample()
    first = _served(tokenizer, sample, _chat([USER]), ANSWER)
    messages = [USER, _sdk_history(first["reply"]), {"role": "user", "content": "x"}]
    plan = begin_call(tokenizer, sample, parse_chat_request({"messages": messages}), LIMITS)
    assert plan.served is None and sample.episode.prefix_breaks == 1
    assert len(sample.episode.segments) == 1 and sample.episode.tools is None


def test_a_call_past_max_turns_gets_finish_reason_length_without_generating(tokenizer) -> None:
    limits = Limits(max_turns=1, max_new_tokens=400, max_model_len=4096)
    sample = _sample()
    plan = begin_call(tokenizer, sample, _chat([USER]), limits)
    _sample_turn(tokenizer, sample, _turn_ids(tokenizer, ANSWER))
    first = end_call(tokenizer, sample, limits, "hermes")
    messages = [USER, _sdk_history(first["reply"]), {"role": "user", "content": "more"}]
    for _ in range(3):  # a flood of calls: each refused, none generated
        plan = begin_call(tokenizer, sample, _chat(messages), limits)
        assert plan.served == {
            "reply": {"role": "assistant", "content": ""},
            "finish_reason": "length",
        }
    assert sample.episode.max_turns_reached and sample.episode.refused_calls == 3


def test_a_history_leaving_no_room_ends_the_episode_with_length(tokenizer) -> None:
    sample = _sample()
    first = _served(tokenizer, sample, _chat([USER]), ANSWER)
    limits = Limits(max_turns=4, max_new_tokens=len(sample.response_ids) + 5, max_model_len=4096)
    messages = [USER, _sdk_history(first["reply"]), {"role": "user", "content": "x " * 50}]
    plan = begin_call(tokenizer, sample, _chat(messages), limits)
    assert plan.served["finish_reason"] == "length"
    assert sample.finish_reason == "length"


def test_a_turn_cut_by_the_calls_max_tokens_does_not_end_the_episode(tokenizer) -> None:
    sample = _sample()
    plan = begin_call(tokenizer, sample, _chat([USER], max_tokens=3), LIMITS)
    assert plan.max_new_tokens == 3
    _sample_turn(
        tokenizer, sample, tokenizer("It is", add_special_tokens=False)["input_ids"][:3], "length"
    )
    call = end_call(tokenizer, sample, LIMITS, "hermes")
    assert call["finish_reason"] == "length" and sample.finish_reason == ""


def test_a_prompt_longer_than_the_engine_takes_is_a_bad_request(tokenizer) -> None:
    limits = Limits(max_turns=4, max_new_tokens=400, max_model_len=410)
    with pytest.raises(BadRequest, match="rollout.max_model_len"):
        begin_call(tokenizer, _sample(), _chat([USER]), limits)


def test_an_agent_run_again_is_answered_from_the_record_until_the_call_in_flight(tokenizer) -> None:
    sample = _sample()
    first = _served(tokenizer, sample, _chat([USER]), CALL)
    tool = {"role": "tool", "tool_call_id": "call_0_0", "content": RESULT}
    second_request = _chat([USER, _sdk_history(first["reply"]), tool])
    assert begin_call(tokenizer, sample, second_request, LIMITS).served is None
    _sample_turn(
        tokenizer, sample, tokenizer("It is", add_special_tokens=False)["input_ids"], "abort"
    )
    held = list(sample.response_ids)
    # Paused mid-turn; the agent runs again from its start.
    sample.episode.served = 0
    replayed = begin_call(tokenizer, sample, _chat([USER]), LIMITS)
    assert replayed.served == first
    plan = begin_call(tokenizer, sample, second_request, LIMITS)
    assert plan.served is None and sample.response_ids == held  # nothing appended again
    assert plan.max_new_tokens == LIMITS.max_new_tokens
    _sample_turn(tokenizer, sample, _turn_ids(tokenizer, " sunny."))
    assert end_call(tokenizer, sample, LIMITS, "hermes")["reply"]["content"] == "It is sunny."


def test_a_turn_paused_mid_way_keeps_the_cap_its_calls_max_tokens_gave_it(tokenizer) -> None:
    sample = _sample()
    first = begin_call(tokenizer, sample, _chat([USER], max_tokens=6), LIMITS)
    assert first.max_new_tokens == 6
    _sample_turn(
        tokenizer, sample, tokenizer("It is", add_special_tokens=False)["input_ids"][:4], "abort"
    )
    sample.episode.served = 0  # run again: the same call, now 4 tokens into its turn
    assert begin_call(tokenizer, sample, _chat([USER], max_tokens=6), LIMITS).max_new_tokens == 6


def test_an_agent_run_again_that_asks_something_else_is_a_replay_mismatch(tokenizer) -> None:
    sample = _sample()
    _served(tokenizer, sample, _chat([USER]), ANSWER)
    sample.episode.served = 0
    with pytest.raises(ReplayMismatch):
        begin_call(tokenizer, sample, _chat([{**USER, "content": "Weather in Rome?"}]), LIMITS)
    assert sample.episode.replay_mismatches == 1


def test_completions_extend_when_the_prompt_starts_with_the_text_held(tokenizer) -> None:
    sample = _sample()
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    plan = begin_call(tokenizer, sample, parse_completion_request({"prompt": prompt}), LIMITS)
    assert plan.served is None
    assert sample.prompt_ids == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    _sample_turn(tokenizer, sample, _turn_ids(tokenizer, "Hello"))
    call = end_call(tokenizer, sample, LIMITS, "hermes")
    assert call["reply"] == {"text": "Hello<|im_end|>"}
    more = (
        prompt
        + call["reply"]["text"]
        + "\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        begin_call(tokenizer, sample, parse_completion_request({"prompt": more}), LIMITS).served
        is None
    )
    held = tokenizer.decode(sample.prompt_ids + sample.response_ids, skip_special_tokens=False)
    assert held == more
    _sample_turn(tokenizer, sample, _turn_ids(tokenizer, "Bye"))
    end_call(tokenizer, sample, LIMITS, "hermes")
    mixed = parse_chat_request({"messages": [USER]})
    with pytest.raises(BadRequest, match="all chat completions or all completions"):
        begin_call(tokenizer, sample, mixed, LIMITS)
    assert json.dumps(sample.episode.calls)  # the record is JSON, for checkpoints


def test_a_prefix_break_hands_the_routing_record_to_the_segment_it_closes(tokenizer) -> None:
    """A mixture of experts' record (rl.types.Sample.routed_experts) belongs to the sequence
    whose positions it holds: the closed segment keeps it, the new sequence starts without."""
    sample = _sample()
    first = _served(tokenizer, sample, _chat([USER]), ANSWER)
    positions = len(sample.prompt_ids) + len(sample.response_ids) - 1
    record = torch.randint(0, 8, (positions, 2, 2), dtype=torch.uint8)
    sample.routed_experts = record
    begin_call(tokenizer, sample, _chat(BREAKS[0](first["reply"])), LIMITS)
    [segment] = sample.episode.segments
    assert segment.routed_experts is record and sample.routed_experts is None
