"""A reward model: an HF sequence-classification checkpoint (num_labels=1) scoring texts.

Plain class, no Ray; `rl.rewards.model_worker.RewardModelWorker` serves it as an actor.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer


class RewardModel:
    """Scores (prompt, response) texts: the head's logit at the last real token of each."""

    def __init__(self, path: str, batch_size: int, device: str | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"reward.model_batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        # bf16 matmuls are slow on CPU; on a GPU the checkpoint's own dtype serves.
        dtype = torch.float32 if self.device.type == "cpu" else "auto"
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"reward model {path!r} has num_labels={self.model.config.num_labels}; "
                "a reward model has one output (num_labels=1)"
            )
        if self.tokenizer.pad_token is None:
            pad_id = self.model.config.pad_token_id
            if pad_id is None and self.tokenizer.eos_token is None:
                raise ValueError(f"reward model {path!r}: its tokenizer has no pad or eos token")
            if pad_id is None:
                self.tokenizer.pad_token = self.tokenizer.eos_token
            else:
                self.tokenizer.pad_token = self.tokenizer.convert_ids_to_tokens(pad_id)
        # The head pools the rightmost token that is not config.pad_token_id, so that id must
        # be the one padding is made of (with pad = eos, a text ending in eos loses that token).
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side = "right"
        # Cut from the left when too long: the end of the response is what the head reads.
        self.tokenizer.truncation_side = "left"
        self.max_length = getattr(self.model.config, "max_position_embeddings", None)
        self.model.to(self.device).eval()

    @torch.no_grad()
    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        """One float per pair: the model's logit for `prompt + response`."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        texts = [p + r for p, r in zip(prompts, responses, strict=True)]
        # Batches of similar lengths waste less compute on padding.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        scores = [0.0] * len(texts)
        for start in range(0, len(order), self.batch_size):
            ids = order[start : start + self.batch_size]
            enc = self.tokenizer(
                [texts[i] for i in ids],
                padding=True,
                truncation=self.max_length is not None,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            logits = self.model(**enc).logits[:, 0].float().cpu()
            for i, value in zip(ids, logits.tolist(), strict=True):
                scores[i] = value
        return scores
