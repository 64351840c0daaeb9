"""Prompt text -> token ids, the same way for SFT, rollout and evaluation."""

from __future__ import annotations

import logging

from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)
_warned_no_template: set[str] = set()


def padding_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id a training batch pads with: the tokenizer's pad token, else its EOS token.

    Many tokenizers (Llama-3, Mistral) define no pad token. Padding positions are masked out
    of attention and of the loss, so any id the model embeds will do; EOS is one it has.
    """
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return token_id
    raise ValueError(
        f"tokenizer {tokenizer.name_or_path or type(tokenizer).__name__} has neither a pad nor "
        "an EOS token: give it one of them (tokenizer_config.json)"
    )


# Prompts per tokenizer call: batches are several times faster than one call per prompt.
_ENCODE_BATCH = 4096


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Token ids of `prompt` as a user turn followed by the assistant's generation prompt
    (see `encode_prompts`)."""
    return encode_prompts(tokenizer, [prompt])[0]


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt as a user turn followed by the assistant's generation prompt.

    Rendering to text and then encoding without special tokens is what `apply_chat_template`
    does internally, but does not depend on its return type, which changed across versions.
    A tokenizer without a chat template gets the raw prompt (with its usual special tokens).
    """
    if tokenizer.chat_template is None:
        name = tokenizer.name_or_path or type(tokenizer).__name__
        if name not in _warned_no_template:
            _warned_no_template.add(name)
            logger.warning("tokenizer %s has no chat template: encoding raw prompt text", name)
    ids: list[list[int]] = []
    for start in range(0, len(prompts), _ENCODE_BATCH):
        batch = prompts[start : start + _ENCODE_BATCH]
        if tokenizer.chat_template is None:
            ids += tokenizer(batch, return_attention_mask=False)["input_ids"]
            continue
        texts = tokenizer.apply_chat_template(
            [[{"role": "user", "content": p}] for p in batch],
            tokenize=False,
            add_generation_prompt=True,
        )
        ids += tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return ids
