"""Prompt text -> token ids, the same way for SFT, rollout and evaluation."""

from __future__ import annotations

import logging

from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)
_warned_no_template: set[str] = set()


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Token ids of `prompt` as a user turn followed by the assistant's generation prompt.

    Rendering to text and then encoding without special tokens is what `apply_chat_template`
    does internally, but does not depend on its return type, which changed across versions.
    A tokenizer without a chat template gets the raw prompt (with its usual special tokens).
    """
    if tokenizer.chat_template is None:
        name = tokenizer.name_or_path or type(tokenizer).__name__
        if name not in _warned_no_template:
            _warned_no_template.add(name)
            logger.warning("tokenizer %s has no chat template: encoding raw prompt text", name)
        return tokenizer.encode(prompt)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)
