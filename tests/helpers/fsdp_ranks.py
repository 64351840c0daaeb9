"""What the FSDP2 trainer tests share: a config over the tiny checkpoints, random batches with
a naive HF reference, and a weight sync between the ranks of one process group."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from rl.config import Config
from rl.sync.pieces import bucket_tensors
from rl.sync.plan import plan_weight_sync
from rl.sync.shared_memory import SharedMemorySpec, open_slots, remove_slots, slot_paths
from rl.types import Batch
from trainer.policy import PolicyTrainer

TEMPERATURE = 0.8


def trainer_config(model_dir: Path, algorithm: dict | None = None, **trainer: object) -> Config:
    """A 2-rank trainer with KL and entropy terms in the loss, unless `algorithm` says else."""
    return Config.model_validate(
        {
            "model": {"path": str(model_dir)},
            "rollout": {"temperature": TEMPERATURE},
            "trainer": {"num_workers": 2, "logprob_chunk_size": 7, **trainer},
            "algorithm": {"kl_coef": 0.1, "entropy_coef": 0.01, **(algorithm or {})},
            # Actors log to Ray, not to a run directory under the working directory.
            "run": {"verbose": True},
        }
    )


def hf_logprobs(model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive reference: full logits from the plain HF model -> (logprob, entropy) [B, T-1]."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits[:, :-1].float() / TEMPERATURE, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1), entropy


def make_batch(
    model, num_rows: int, seq_len: int, seed: int, min_len: int = 0, group_size: int = 1
) -> Batch:
    """Right-padded random sequences of min_len (default seq_len // 2) to seq_len tokens;
    old/ref log-probs near the model's so that some clip. Consecutive groups of `group_size`
    rows share their first row's prompt, as GRPO's groups do."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    lengths = torch.randint(min_len or seq_len // 2, seq_len + 1, (num_rows,), generator=gen)
    prompt_lens = torch.randint(2, seq_len // 2, (num_rows,), generator=gen)
    steps = torch.arange(seq_len)
    attention_mask = (steps < lengths[:, None]).long()
    input_ids = torch.randint(1, vocab, (num_rows, seq_len), generator=gen)
    for row in range(num_rows):
        first = row - row % group_size
        prompt_lens[row] = prompt_lens[first]
        input_ids[row, : prompt_lens[first]] = input_ids[first, : prompt_lens[first]]
    input_ids *= attention_mask
    targets = steps[1:]
    loss_mask = ((targets >= prompt_lens[:, None]) & (targets < lengths[:, None])).float()
    batch = Batch(input_ids, attention_mask, loss_mask, loss_mask, loss_mask, loss_mask)
    with torch.no_grad():
        logprobs, _ = hf_logprobs(model, batch)
    noise = torch.randn(2, num_rows, seq_len - 1, generator=gen)
    batch.old_logprobs = (logprobs + 0.3 * noise[0]) * loss_mask
    batch.ref_logprobs = (logprobs + 0.2 * noise[1]) * loss_mask
    batch.advantages = torch.randn(num_rows, 1, generator=gen) * loss_mask
    return batch


def sync_between_ranks(
    trainer: PolicyTrainer, rank: int, prefix: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Both ranks write their shards bucket by bucket through the channel `prefix` (a new one:
    rank 0 creates its files); rank 0 reads the tensors back.
    Returns (what rank 0 read, the full parameters) on rank 0, empty dicts on rank 1."""
    specs, shape = trainer.weight_sync_spec()
    plan = plan_weight_sync(
        specs, shape, world_size=2, tp_size=1, bucket_bytes=1 << 14, wire_dtype="float32"
    )
    spec = SharedMemorySpec(prefix)
    try:
        if rank == 0:  # rank 0 creates the buffers
            trainer.open_weight_sender(plan, spec)
        dist.barrier()
        if rank == 1:
            trainer.open_weight_sender(plan, spec)
        full = {n: p.detach().full_tensor() for n, p in trainer.policy.model.named_parameters()}
        slots = open_slots(slot_paths(prefix), plan.slot_numel, "float32")
        synced = {}
        for bucket in range(len(plan.buckets)):
            trainer.write_weight_bucket(bucket)
            dist.barrier()
            if rank == 0:
                synced |= {n: t.clone() for n, t in bucket_tensors(slots[bucket % 2], plan, bucket)}
            dist.barrier()  # read before the slot is reused
    finally:
        remove_slots(prefix)
    return (synced, full) if rank == 0 else ({}, {})
