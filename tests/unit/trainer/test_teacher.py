"""The distillation teacher's rank (a gloo group of this process alone): it scores a batch as
the plain HF model does (full logits, the naive reference), on a checkpoint other than the
policy's (wider, tied embeddings: any causal LM sharing the tokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rl.config import Config
from tests.helpers.fsdp_ranks import TEMPERATURE, hf_logprobs, make_batch
from tests.helpers.models import build_checkpoint
from tests.helpers.ports import free_port
from trainer.teacher import TeacherScorer


def test_the_teacher_scores_each_token_as_the_hf_model_does_and_zero_at_padding(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    teacher_dir = build_checkpoint(
        tmp_path / "teacher",
        "qwen2",
        tie_word_embeddings=True,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    cfg = Config.model_validate(
        {
            "model": {"path": str(tiny_model_dir)},
            "rollout": {"temperature": TEMPERATURE},
            # Micro-batches of 2 rows over 5; chunks of 7 tokens in the kernel.
            "trainer": {"num_workers": 1, "micro_batch_size": 2, "logprob_chunk_size": 7},
            "teacher": {"path": str(teacher_dir)},
            "algorithm": {"distill_coef": 1.0},
        }
    )
    threads = torch.get_num_threads()  # the rank sets trainer.num_threads for its process
    teacher = TeacherScorer(cfg, None, 0, 1, "127.0.0.1", free_port())
    try:
        model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
        batch = make_batch(model, num_rows=5, seq_len=12, seed=3)
        scored = teacher.compute_logprobs(batch)
        teacher.release_memory()  # time-sliced devices (a no-op on CPU)
        again = teacher.compute_logprobs(batch.select(slice(0, 2)))
    finally:
        teacher.close()
        torch.set_num_threads(threads)
    with torch.no_grad():
        expected, _ = hf_logprobs(model, batch)
    valid = batch.attention_mask[:, 1:].float()
    assert scored.shape == (5, 11) and scored.dtype == torch.float32
    assert (scored - expected * valid).abs().max().item() == pytest.approx(0, abs=1e-5)
    assert torch.equal(scored * (1 - valid), torch.zeros_like(scored))
    # Scored alone, two of the rows get the same log-probs as within the whole batch.
    assert torch.allclose(again, scored[:2, : again.shape[1]], atol=1e-6)
