"""A multi-turn episode as one token sequence, built only by appending.

The sequence lives in a `rl.types.Sample` (prompt_ids, then response_ids: every later token)
whose `episode` (rl.types.Episode) holds the conversation as messages; the
functions here extend both together.

The sequence is the prompt's tokens, then for each turn the tokens the policy sampled,
verbatim, then the observation's tokens (the tool results and whatever text the chat template
puts around them, up to the next generation prompt). Sampled tokens are never decoded and
re-encoded: BPE merges differently across a turn boundary, or the policy may simply have
sampled a non-canonical split, and re-encoding would train on tokens it never sampled.

Only the observations are rendered by the chat template, and only after checking that the
template is append-only for this history: rendering the whole conversation must start with
the text of the tokens already held. Templates that re-render earlier turns (stripping the
reasoning of earlier assistant turns, trimming whitespace the model sampled), or a turn that
ended on a special token the template does not write there, fail that check with
`TemplateMismatch` naming the template, rather than leaving a sequence the model never saw
(an agent run ends that episode there: rollout.agent_loop).

Only the template's own markup becomes special tokens: the text of the messages (tool
output, an environment's messages) is encoded as plain text, so a tool that prints
`<|im_end|><|im_start|>assistant` gives the tokens of that text, not the control tokens.
"""

from __future__ import annotations

import bisect
import os
import re
from typing import Any

from transformers import PreTrainedTokenizerBase

from rl.types import NOT_SAMPLED, Sample

# Characters of context shown either side of where a template changed the held text.
_CONTEXT_CHARS = 40
_CONTEXT_TOKENS = 4
# Unicode's private-use area: stand-ins for special tokens' first characters (below).
_PRIVATE_USE = range(0xE000, 0xF900)


class TemplateMismatch(ValueError):
    """The chat template does not render this episode's history as the tokens held: the
    episode cannot go on without training on a sequence the policy never saw."""


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


def _encode(tokenizer: PreTrainedTokenizerBase, text: str, plain: bool = False) -> list[int]:
    """`text`'s tokens; `plain`: special tokens' text in it is plain text, not special tokens.
    Never the tokenizer's BOS/EOS: the template writes those itself (as rl.data.prompts)."""
    return tokenizer(
        text, add_special_tokens=False, split_special_tokens=plain, return_attention_mask=False
    )["input_ids"]


def plain_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """`text`'s tokens as a message's content becomes: special tokens' text as plain text."""
    return _encode(tokenizer, text, plain=True)


def _specials(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The texts the tokenizer matches as special tokens (those `split_special_tokens`
    splits), longest first as the tokenizer matches them."""
    texts = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    return sorted(texts, key=len, reverse=True)


def _markup_ids(
    tokenizer: PreTrainedTokenizerBase,
    history: list[dict[str, Any]],
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    text: str,
    start: int,
) -> list[int]:
    """The tokens of `text[start:]`, where `text` is what `history + messages` render (with
    the generation prompt), the template's own special tokens special and nothing else:
    special tokens' text inside `messages` (tool output, an environment's messages) is encoded
    as plain text.

    Which special-token text is the template's: render again with that text in `messages`
    broken (each occurrence's first character swapped for a private-use one); what matches a
    special token in that rendering the template wrote. The two renderings must differ only
    by the swapped characters; a template that treats a message's special-token text
    otherwise than other text raises TemplateMismatch."""
    texts = _specials(tokenizer)
    specials = re.compile("|".join(map(re.escape, texts)))
    values = [v for m in messages for k, v in m.items() if k != "role" and isinstance(v, str)]
    if not texts or not any(specials.search(v) for v in values):
        return _encode(tokenizer, text[start:])
    used = set(text).union(*values)
    spare = (chr(c) for c in _PRIVATE_USE if chr(c) not in used)
    swap = {first: next(spare) for first in {t[0] for t in texts}}

    def broken(value: str) -> str:
        # A swapped character is in no special token: each swap only removes matches.
        match = specials.search(value)
        while match is not None:
            at = match.start()
            value = value[:at] + swap[value[at]] + value[at + 1 :]
            match = specials.search(value, at + 1)
        return value

    defused = [
        {k: broken(v) if k != "role" and isinstance(v, str) else v for k, v in m.items()}
        for m in messages
    ]
    skeleton = render(tokenizer, history + defused, tools, add_generation_prompt=True)
    if skeleton.translate({ord(s): f for f, s in swap.items()}) != text:
        raise TemplateMismatch(
            f"chat template of {_template_name(tokenizer)} renders special tokens' text in a "
            "message otherwise than other text: its markup cannot be told from the message's."
        )
    ids, at = [], start
    for match in specials.finditer(skeleton, start):
        ids += _encode(tokenizer, text[at : match.start()], plain=True)
        ids.append(tokenizer.convert_tokens_to_ids(match.group()))
        at = match.end()
    return ids + _encode(tokenizer, text[at:], plain=True)


def decode(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """`ids`' text, special tokens' text included, nothing cleaned up."""
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
    Special tokens' text in `new_messages` is plain text (`_markup_ids`).
    A rendering that does not start with the held text (the template is not append-only
    for this history, or `messages` do not say what the held tokens say) raises
    TemplateMismatch.
    """
    held_text = decode(tokenizer, held_ids)
    full_text = render(tokenizer, messages + new_messages, tools, add_generation_prompt=True)
    if not full_text.startswith(held_text):
        raise TemplateMismatch(_not_append_only(tokenizer, held_ids, held_text, full_text))
    return _markup_ids(tokenizer, messages, new_messages, tools, full_text, len(held_text))


def _not_append_only(
    tokenizer: PreTrainedTokenizerBase, held_ids: list[int], held_text: str, full_text: str
) -> str:
    """The error for a rendering that changes the held text: where, and what it says there."""
    pos = len(os.path.commonprefix([held_text, full_text]))
    # The held token that the differing character decodes from: the first prefix of the held
    # tokens whose text reaches past `pos` (decoded lengths grow with the prefix).
    token = bisect.bisect_right(
        range(len(held_ids)), pos, key=lambda k: len(decode(tokenizer, held_ids[: k + 1]))
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


def encode_messages(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
) -> list[int]:
    """The prompt of an episode: `messages` rendered with the generation prompt, special
    tokens' text in them as plain text (`_markup_ids`)."""
    if not messages:
        raise ValueError("an episode starts from at least one message")
    text = render(tokenizer, messages, tools, add_generation_prompt=True)
    return _markup_ids(tokenizer, [], messages, tools, text, 0)


def end_turn(tokenizer: PreTrainedTokenizerBase, sample: Sample) -> str:
    """Close the turn the engine just generated: its tokens (everything after the episode's
    `turn_start`, appended by the engine with their log-probs and versions) are sampled, so
    they join the loss mask; returns the assistant's text (what tool calls are parsed from).

    The message kept for the template is the decoded text without a final special token:
    that is the sampled end-of-turn, which the template writes itself after the content. Any
    special token counts, not only EOS: Gemma's end-of-turn is not its EOS, and kept in the
    content it would be rendered twice. One the template does not write there (Qwen's
    `<|endoftext|>` for `<|im_end|>`) fails the next observation's check (TemplateMismatch).
    """
    episode = sample.episode
    assert episode is not None and sample.loss_mask is not None, "not an episode's sample"
    sampled = sample.response_ids[episode.turn_start :]
    if not sampled:
        raise ValueError(f"sample {sample.group_id}/{sample.index}: a turn without tokens")
    assert len(sample.loss_mask) == episode.turn_start, "a turn closed twice"
    assert len(sample.logprobs) == len(sample.token_versions) == len(sample.response_ids), (
        "the engine appended a turn without one log-prob and one version per token"
    )
    ends_turn = sampled[-1] in tokenizer.all_special_ids
    text = decode(tokenizer, sampled[:-1] if ends_turn else sampled)
    episode.messages.append({"role": "assistant", "content": text})
    sample.loss_mask += [1] * len(sampled)
    episode.turn_start = len(sample.response_ids)
    episode.num_turns += 1
    return text


def add_observation(
    tokenizer: PreTrainedTokenizerBase,
    sample: Sample,
    new_messages: list[dict[str, Any]],
    max_response_tokens: int | None = None,
) -> list[int] | None:
    """Append the tokens of `new_messages` (tool results, a user's reply) and the next
    generation prompt, as `observation_ids` renders them, outside the loss mask, with log-prob
    0.0 and version NOT_SAMPLED; returns those tokens. When they would leave the response
    longer than `max_response_tokens`, appends nothing and returns None. TemplateMismatch,
    nothing appended, where the template is not append-only for this history."""
    episode = sample.episode
    assert episode is not None and sample.loss_mask is not None, "not an episode's sample"
    if episode.messages[-1]["role"] != "assistant":
        raise ValueError("an observation follows a turn of the policy")
    if not new_messages:
        raise ValueError("an observation needs at least one message")
    held = sample.prompt_ids + sample.response_ids
    ids = observation_ids(tokenizer, held, episode.messages, new_messages, episode.tools)
    if (
        max_response_tokens is not None
        and len(sample.response_ids) + len(ids) > max_response_tokens
    ):
        return None
    episode.messages += new_messages
    insert_tokens(sample, ids)
    return ids


def insert_tokens(sample: Sample, ids: list[int]) -> None:
    """Append `ids` to an episode's sequence as tokens the policy did not sample: outside the
    loss mask, log-prob 0.0, version NOT_SAMPLED; the next turn starts after them."""
    episode = sample.episode
    assert episode is not None and sample.loss_mask is not None, "not an episode's sample"
    sample.response_ids += ids
    sample.loss_mask += [0] * len(ids)
    sample.logprobs += [0.0] * len(ids)
    sample.token_versions += [NOT_SAMPLED] * len(ids)
    episode.turn_start = len(sample.response_ids)
