"""A multi-turn episode as one token sequence, built only by appending.

The sequence is the prompt's tokens, then for each turn the tokens the policy sampled,
verbatim, then the observation's tokens (the tool results and whatever text the chat template
puts around them, up to the next generation prompt). Sampled tokens are never decoded and
re-encoded: BPE merges differently across a turn boundary, or the policy may simply have
sampled a non-canonical split, and re-encoding would train on tokens it never sampled.

Only the observations are rendered by the chat template, and only after checking that the
template is append-only for this history: rendering the whole conversation must start with
the text of the tokens already held. Templates that re-render earlier turns (stripping the
reasoning of earlier assistant turns, trimming whitespace the model sampled) fail that check
with an error naming the template, rather than leaving a sequence the model never saw.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from rl.types import Sample

NOT_SAMPLED = -1  # the version of a token the policy did not sample
# Characters of context shown either side of where a template changed the held text.
_CONTEXT_CHARS = 40
_CONTEXT_TOKENS = 4


def _template_name(tokenizer: PreTrainedTokenizerBase) -> str:
    return tokenizer.name_or_path or type(tokenizer).__name__


def render(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
) -> str:
    """The chat template's text for `messages` (and the tools the template lists)."""
    if tokenizer.chat_template is None:
        raise ValueError(f"tokenizer {_template_name(tokenizer)} has no chat template")
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    # The template writes the special tokens itself (as rl.data.prompts does).
    return tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]


def _decode(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def observation_ids(
    tokenizer: PreTrainedTokenizerBase,
    held_ids: list[int],
    messages: list[dict[str, Any]],
    new_messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The tokens to append to `held_ids` (the prompt and turns so far, which `messages`
    render) for `new_messages` (the observation), up to the next generation prompt.

    The rule at the end of a turn: the policy's sampled tokens end with its end-of-turn token
    (Qwen's `<|im_end|>`), while the template renders the assistant turn as
    `<|im_start|>assistant\\n{content}<|im_end|>\\n` - the end-of-turn and then more template
    text. So the observation is everything the full rendering (with `new_messages` and the
    generation prompt) has after the text of the held tokens:
    `\\n<|im_start|>user\\n<tool_response>...<|im_end|>\\n<|im_start|>assistant\\n` - the
    template's `\\n` after the sampled `<|im_end|>` included, the `<|im_end|>` not repeated.
    The same rule covers a turn that stopped without an end-of-turn token (a stop string):
    the template's `<|im_end|>` is then the observation's first token, inserted, not sampled.

    The held tokens are compared as text (decoded) with the rendering: as tokens they need not
    match its encoding, since the sampled ones are kept as the policy chose them. The
    observation text is encoded alone; it starts right after the end-of-turn special token,
    where encoding the whole rendering would also start a new piece, so the tokens are the
    same. (Comparing as text needs a tokenizer that decodes back the text it encoded, as
    byte-level BPE does: Qwen's, Llama-3's; one that does not fails the check, loudly.)
    A rendering that does not start with the held text (the template is not append-only
    for this history, or `messages` do not say what the held tokens say) raises ValueError.
    """
    held_text = _decode(tokenizer, held_ids)
    full_text = render(tokenizer, messages + new_messages, tools, add_generation_prompt=True)
    if not full_text.startswith(held_text):
        raise ValueError(_not_append_only(tokenizer, held_ids, held_text, full_text))
    return _encode(tokenizer, full_text[len(held_text) :])


def _not_append_only(
    tokenizer: PreTrainedTokenizerBase, held_ids: list[int], held_text: str, full_text: str
) -> str:
    """The error for a rendering that changes the held text: where, and what it says there."""
    pos = len(os.path.commonprefix([held_text, full_text]))
    # The held token that the differing character decodes from: the first prefix of the held
    # tokens whose text reaches past `pos` (decoded lengths grow with the prefix).
    token = bisect.bisect_right(
        range(len(held_ids)), pos, key=lambda k: len(_decode(tokenizer, held_ids[: k + 1]))
    )
    near = held_ids[max(0, token - _CONTEXT_TOKENS) : token + _CONTEXT_TOKENS]
    lo, hi = max(0, pos - _CONTEXT_CHARS), pos + _CONTEXT_CHARS
    return (
        f"chat template of {_template_name(tokenizer)} is not append-only for this "
        f"conversation: rendering it with the new messages does not start with the tokens "
        f"already held (an earlier turn re-rendered, or a turn ended on a token the template "
        f"does not write there), "
        f"first at character {pos} (held token {token}). Held: {held_text[lo:hi]!r}; template "
        f"renders: {full_text[lo:hi]!r}; held tokens around it: "
        f"{tokenizer.convert_ids_to_tokens(near)}. Training on a re-rendered sequence would "
        "train on tokens the policy never saw: use a template that renders earlier turns "
        "unchanged (e.g. one that keeps earlier reasoning)."
    )


@dataclass
class Trajectory:
    """One episode: `prompt_ids`, then `response_ids` (every later token, sampled or not),
    with per response token: `loss_mask` (1 on tokens the policy sampled, 0 on observation and
    template tokens), the behaviour `logprobs` and `token_versions` of sampled tokens (0.0 and
    NOT_SAMPLED on the others). Loss, KL, entropy and the critic's values cover the mask only.

    `messages` is the conversation as the chat template sees it (assistant turns as their
    decoded text) and `tools` the function schemas it lists; both render the observations.
    Turns alternate: `add_turn` after the prompt or an observation, `add_observation` after a
    turn. `finish_reason` is the last turn's (see rl.types.Sample).
    """

    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    finish_reason: str = ""

    @classmethod
    def start(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> Trajectory:
        """The prompt: `messages` rendered with the generation prompt."""
        if not messages:
            raise ValueError("a trajectory starts from at least one message")
        prompt = _encode(tokenizer, render(tokenizer, messages, tools, add_generation_prompt=True))
        return cls(prompt_ids=prompt, messages=list(messages), tools=tools)

    @property
    def ids(self) -> list[int]:
        """The whole sequence, prompt and response."""
        return self.prompt_ids + self.response_ids

    @property
    def awaits_turn(self) -> bool:
        """Whether the sequence ends at a generation prompt (the policy's turn to sample)."""
        return self.messages[-1]["role"] != "assistant"

    def add_turn(
        self,
        tokenizer: PreTrainedTokenizerBase,
        sampled_ids: list[int],
        logprobs: list[float],
        versions: list[int],
        finish_reason: str,
    ) -> str:
        """Append the policy's sampled tokens verbatim, with their behaviour log-probs and
        versions; returns the assistant's text (what the tool calls are parsed from).

        The message kept for the template is the decoded text without a final special token:
        that is the sampled end-of-turn, which the template writes itself after the content.
        Any special token counts, not only EOS: Gemma's end-of-turn is not its EOS, and kept
        in the content it would be rendered twice. One the template does not write there
        (Qwen's `<|endoftext|>` for `<|im_end|>`) fails the next observation's check.
        """
        if not self.awaits_turn:
            raise ValueError("a turn follows the prompt or an observation, not another turn")
        if not sampled_ids or not len(sampled_ids) == len(logprobs) == len(versions):
            raise ValueError(
                f"a turn needs one log-prob and one version per sampled token: "
                f"{len(sampled_ids)} tokens, {len(logprobs)} log-probs, {len(versions)} versions"
            )
        ends_turn = sampled_ids[-1] in tokenizer.all_special_ids
        text = _decode(tokenizer, sampled_ids[:-1] if ends_turn else sampled_ids)
        self.messages.append({"role": "assistant", "content": text})
        self.response_ids += sampled_ids
        self.loss_mask += [1] * len(sampled_ids)
        self.logprobs += logprobs
        self.token_versions += versions
        self.finish_reason = finish_reason
        return text

    def add_observation(
        self, tokenizer: PreTrainedTokenizerBase, new_messages: list[dict[str, Any]]
    ) -> list[int]:
        """Append the tokens of `new_messages` (tool results, a user's reply) and the next
        generation prompt, as `observation_ids` renders them; returns those tokens."""
        if self.awaits_turn:
            raise ValueError("an observation follows a turn of the policy")
        if not new_messages:
            raise ValueError("an observation needs at least one message")
        ids = observation_ids(tokenizer, self.ids, self.messages, new_messages, self.tools)
        self.messages += new_messages
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.token_versions += [NOT_SAMPLED] * len(ids)
        return ids

    def to_sample(self, group_id: int, index: int) -> tuple[Sample, list[int]]:
        """The trainer's record of this episode, and its loss mask (one per response token).

        `rl.types.Sample` has no loss mask yet, and `rl.run.batching.build_batch` trains on
        every response token: until it has one, the mask comes alongside and must be applied.
        Observation tokens take log-prob 0.0 and the version of the sampled token before them,
        so `Sample.policy_version` (the oldest version) stays that of the sampled tokens.
        `response_text` is the last assistant message, the answer a reward reads.
        """
        if not self.response_ids:
            raise ValueError("a trajectory without a turn has nothing to train on")
        versions = []
        for version, sampled in zip(self.token_versions, self.loss_mask, strict=True):
            versions.append(version if sampled else versions[-1])
        last_turn = next(m for m in reversed(self.messages) if m["role"] == "assistant")
        sample = Sample(
            prompt_ids=list(self.prompt_ids),
            group_id=group_id,
            index=index,
            response_ids=list(self.response_ids),
            logprobs=list(self.logprobs),
            token_versions=versions,
            finish_reason=self.finish_reason,
            response_text=last_turn["content"],
        )
        return sample, list(self.loss_mask)
