"""An agent function's episode, call by call: what each request to the rollout worker's
OpenAI-compatible endpoint (rollout.endpoint) does to the episode's one token sequence.

The first call's messages (or prompt) become the sample's prompt. A later call extends the
sequence when its history is the episode's so far, token for token: the messages of the
previous call, then the reply it got, as served (rl.agents.openai_api normalises what SDKs add
on the way back), then new messages (tool results, a user's turn), which are appended as an
observation is (rl.agents.trajectory.add_observation: rendered by the chat template after a
check that the template is append-only, outside the loss mask). The reply's tokens are the
policy's sampled tokens, verbatim; its text is decoded from them, never encoded again.

A call whose history is not the episode's (a framework that trims, re-templates or reorders
the conversation) is a prefix break, counted in `agent/prefix_breaks`: the sequence so far
becomes one of the episode's segments (`Episode.segments`, each trained as a sample of its own
with the episode's advantage, rl.run.experience) and the call's history, rendered afresh, the
prompt of a new one; with `agent.prefix_break: end` the call is refused instead. A call after
`agent.max_turns` turns, or one whose history leaves no room in `rollout.max_new_tokens`, gets
finish_reason "length": a finish reason, not an error. Each call is recorded in the episode (`Episode.calls`), so an agent run again from
its start (after a pause or a resume) is answered from the record until it reaches the call
that was in flight; a re-run agent that asks something else is a `ReplayMismatch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from rl.agents.openai_api import (
    BadRequest,
    ChatRequest,
    CompletionRequest,
    normalize_message,
    reply_message,
    template_messages,
)
from rl.agents.tool_calls import ToolCall, ToolCallError, parse_tool_calls
from rl.agents.trajectory import (
    TemplateMismatch,
    add_observation,
    decode,
    encode_messages,
    end_turn,
    insert_tokens,
)
from rl.types import Episode, Sample

Request = ChatRequest | CompletionRequest


class ReplayMismatch(RuntimeError):
    """An agent run again from its start asked what it had not asked the first time: it
    depends on something besides its example, its seed and the replies (a clock, the
    network), so its episode cannot be resumed."""


@dataclass(frozen=True)
class Limits:
    """An episode's bounds: assistant turns, tokens after a sequence's prompt, and prompt plus
    those (what the engine takes); and whether a prefix break starts a new segment."""

    max_turns: int
    max_new_tokens: int
    max_model_len: int
    segments: bool = True


@dataclass(frozen=True)
class Plan:
    """What a call needs: its answer as recorded (`served`: a re-run agent's call, or a
    refused one, finish_reason "length"), or (`served` None) generation of a turn, up to
    `max_new_tokens` response tokens in all, then `end_call`."""

    served: dict[str, Any] | None = None
    max_new_tokens: int = 0


def start_episodes(example: dict, group_id: int, n: int) -> list[Sample]:
    """The `n` fresh samples of a group of an agent function's episodes: each holds only
    `example`, its first call makes the prompt."""
    return [
        Sample([], group_id, k, loss_mask=[], episode=Episode(None, [], None, example=example))
        for k in range(n)
    ]


def _episode(sample: Sample) -> Episode:
    episode = sample.episode
    assert episode is not None and episode.env is None, "not an agent function's episode"
    return episode


def _refused(episode: Episode, request: Request) -> Plan:
    episode.refused_calls += 1
    if isinstance(request, CompletionRequest):
        empty: dict[str, Any] = {"text": ""}
    else:
        empty = {"role": "assistant", "content": ""}
    return Plan(served={"reply": empty, "finish_reason": "length"})


def begin_call(
    tokenizer: PreTrainedTokenizerBase, sample: Sample, request: Request, limits: Limits
) -> Plan:
    """Take call `request` into `sample`'s episode (the module's docstring): its observation
    appended, the call recorded; what it needs. BadRequest for a call that cannot be served
    (HTTP 400), ReplayMismatch for a re-run agent that strays."""
    episode = _episode(sample)
    record = request.record()
    if episode.served < len(episode.calls):
        call = episode.calls[episode.served]
        if call["request"] != record:
            episode.replay_mismatches += 1
            raise ReplayMismatch(
                f"call {episode.served + 1} of the agent run again differs from the first run's"
            )
        if call["reply"] is not None:
            episode.served += 1
            return Plan(served=call)
        # The turn in flight at the pause goes on, to the length it was given at its start.
        return Plan(max_new_tokens=call["max_new_tokens"])
    if sample.finish_reason == "length" or episode.max_turns_reached:
        return _refused(episode, request)  # the episode's budget is spent
    if episode.num_turns >= limits.max_turns:
        episode.max_turns_reached = True
        return _refused(episode, request)
    if episode.calls and isinstance(request, CompletionRequest) != (
        "prompt" in episode.calls[0]["request"]
    ):
        raise BadRequest("an episode's calls are all chat completions or all completions")
    if not episode.calls:
        _first(tokenizer, sample, request, limits)
    elif not _extend(tokenizer, sample, request, limits):
        if sample.finish_reason == "length" or not limits.segments:
            return _refused(episode, request)
        _new_segment(tokenizer, sample, request, limits)
    cap = limits.max_new_tokens
    if request.max_tokens is not None:
        cap = min(cap, len(sample.response_ids) + request.max_tokens)
    episode.calls.append(
        {"request": record, "reply": None, "finish_reason": None, "max_new_tokens": cap}
    )
    return Plan(max_new_tokens=cap)


def _first(
    tokenizer: PreTrainedTokenizerBase, sample: Sample, request: Request, limits: Limits
) -> None:
    episode = _episode(sample)
    if isinstance(request, ChatRequest):
        messages = template_messages(request.messages)
        prompt = encode_messages(tokenizer, messages, request.tools)
        episode.messages, episode.tools = messages, request.tools
    else:
        prompt = tokenizer(request.prompt, add_special_tokens=False)["input_ids"]
    room = limits.max_model_len - limits.max_new_tokens
    if len(prompt) > room:
        raise BadRequest(
            f"the prompt is {len(prompt)} tokens; the engine takes {room} "
            "(rollout.max_model_len - rollout.max_new_tokens)"
        )
    sample.prompt_ids = prompt


def _new_segment(
    tokenizer: PreTrainedTokenizerBase, sample: Sample, request: Request, limits: Limits
) -> None:
    """After a prefix break: the sequence so far becomes a segment (a sample of its own), and
    the call's whole history, rendered afresh, the prompt of the next. Only prompt tokens are
    rendered again; what the policy sampled stays in the segment it was sampled in."""
    episode = _episode(sample)
    assert sample.loss_mask is not None and len(sample.loss_mask) == len(sample.response_ids)
    episode.segments.append(
        Sample(
            list(sample.prompt_ids),
            sample.group_id,
            sample.index,
            response_ids=sample.response_ids,
            logprobs=sample.logprobs,
            token_versions=sample.token_versions,
            finish_reason="stop",
            loss_mask=sample.loss_mask,
            routed_experts=sample.routed_experts,
        )
    )
    sample.response_ids, sample.logprobs, sample.token_versions, sample.loss_mask = [], [], [], []
    sample.routed_experts = None  # the next sequence's positions are recorded afresh
    episode.turn_start = 0
    _first(tokenizer, sample, request, limits)


def _extend(
    tokenizer: PreTrainedTokenizerBase, sample: Sample, request: Request, limits: Limits
) -> bool:
    """Append what `request` adds to the episode's sequence; False, nothing appended, when its
    history is not the episode's (a prefix break) or leaves no room (the episode is over)."""
    episode = _episode(sample)
    previous = episode.calls[-1]
    budget = limits.max_new_tokens - 1  # room for at least one sampled token after it
    if isinstance(request, CompletionRequest):
        held = decode(tokenizer, sample.prompt_ids + sample.response_ids)
        if not (request.prompt.startswith(held) and len(request.prompt) > len(held)):
            episode.prefix_breaks += 1
            return False
        ids = tokenizer(request.prompt[len(held) :], add_special_tokens=False)["input_ids"]
        if len(sample.response_ids) + len(ids) > budget:
            sample.finish_reason = "length"
            return False
        insert_tokens(sample, ids)
        return True
    history = previous["request"]["messages"] + [normalize_message(previous["reply"], "reply")]
    new = request.messages[len(history) :]
    if request.tools != episode.tools or request.messages[: len(history)] != history or not new:
        episode.prefix_breaks += 1
        return False
    try:
        added = add_observation(tokenizer, sample, template_messages(new), budget)
    except TemplateMismatch:
        episode.template_mismatches += 1
        return False
    if added is None:
        sample.finish_reason = "length"
        return False
    return True


def end_call(
    tokenizer: PreTrainedTokenizerBase, sample: Sample, limits: Limits, call_format: str
) -> dict[str, Any]:
    """Close the turn the engine generated for the episode's call in flight; the call's
    record, now with its reply (an assistant message, or {"text"} for a completion), finish
    reason and token counts."""
    episode = _episode(sample)
    call = episode.calls[episode.served]
    assert call["reply"] is None, "a call answered twice"
    before = len(sample.prompt_ids) + episode.turn_start
    sampled = sample.response_ids[episode.turn_start :]
    text = end_turn(tokenizer, sample)
    if "prompt" in call["request"]:
        # The sampled tokens' whole text, special tokens included: appended to the next
        # prompt, it extends the sequence token for token.
        reply: dict[str, Any] = {"text": decode(tokenizer, sampled)}
    else:
        calls = parse_tool_calls(text, episode.tools, call_format) if episode.tools else []
        if calls:  # counted as a native episode counts its turns' calls (agent/* metrics)
            episode.turns_with_calls += 1
            episode.turns_well_formed += all(isinstance(c, ToolCall) for c in calls)
            episode.num_calls += len(calls)
            episode.errors.update(c.kind for c in calls if isinstance(c, ToolCallError))
        reply = reply_message(text, calls, call_format, f"call_{episode.served}")
    if sample.finish_reason == "length":
        finish = "length"
        if len(sample.response_ids) < limits.max_new_tokens:
            sample.finish_reason = ""  # the call's own max_tokens: the episode goes on
    else:
        finish = "tool_calls" if reply.get("tool_calls") else "stop"
        sample.finish_reason = ""
    call["reply"], call["finish_reason"] = reply, finish
    call["usage"] = {"prompt_tokens": before, "completion_tokens": len(sampled)}
    episode.served += 1
    return call


def final_answer(sample: Sample) -> str:
    """The text of the last reply: what the task scores unless the agent returns its own."""
    calls = [c for c in _episode(sample).calls if c["reply"] is not None]
    if not calls:
        return ""
    reply = calls[-1]["reply"]
    return reply.get("text") or reply.get("content") or ""
