"""On-policy distillation's teacher on one FSDP2 rank: a frozen causal LM that scores the
student's sampled tokens, forward only.

It is the frozen reference's counterpart (`trainer.policy.PolicyTrainer.compute_logprobs`)
in a process group of its own, so that it can be another model than the policy (larger, or
differently trained) and be placed apart from it: the same sharded load, each rank reading
only its rows of the checkpoint, the same micro-batches over the ranks (`trainer.ranks`) and
the same fused log-prob kernel, which never holds the [tokens, vocab] logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rl.config import Config, ModelConfig
from rl.types import Batch
from trainer.fsdp import load_sharded, reshard, storage_device
from trainer.ranks import gather_rows, init_rank, micro_batches
from trainer.sequence_parallel import join

HOST = torch.device("cpu")


class TeacherScorer:
    """One rank of the teacher. Plain class, no Ray; `trainer.teacher_worker` is its actor."""

    def __init__(
        self,
        cfg: Config,
        loss: None,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
    ) -> None:
        """`loss` is None: the teacher trains on nothing (the signature is every role's)."""
        assert cfg.teacher.enabled, "a teacher rank without teacher.path"
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.device, mesh = init_rank(rank, world_size, master_addr, master_port, cfg.trainer)
        sp = join(self.device.type, world_size, cfg.trainer.sequence_parallel)
        # Under sequence parallelism a group's ranks hold the same log-probs; the first counts them.
        self.counts_rows = sp is None or sp.counts_rows
        # The policy's compute dtype and the trainer's sharding, micro-batching, sequence
        # parallelism and kernel settings; no LoRA, nothing frozen by pattern: the whole model
        # is frozen.
        model = ModelConfig(path=cfg.teacher.path, dtype=cfg.model.dtype)
        self.model = load_sharded(model, cfg.trainer, mesh, trainable=False, sequence_parallel=sp)
        # Under FSDP2's CPU offload the shards live in host memory already and stay there.
        self._moves_shards = (
            self.device.type == "cuda" and storage_device(cfg.trainer, mesh) != "cpu"
        )
        self.released = False

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """The teacher's log-probs [B, T-1] (fp32, CPU) of `batch`'s tokens, 0 at padding; the
        same on every rank. At rollout.temperature: the softmax the student sampled from is
        its logits / T, and the teacher's is read at the same temperature (as the reference's).

        Collective: every rank must call it with the same batch; each computes its own rows.
        """
        self._ensure_on_device()
        pieces = []
        temperature = self.cfg.rollout.temperature
        for _, inputs, rows in micro_batches(
            batch, self.rank, self.world_size, self.cfg.trainer, self.device
        ):
            logprob = self.model(inputs, temperature)[0]  # dummies run too: collectives
            if rows is not None and self.counts_rows:
                pieces.append((rows, logprob))
        reshard(self.model)  # no backward follows to free the gathered parameters
        return gather_rows(pieces, batch, self.device)

    def release_memory(self) -> None:
        """Hand this rank's GPU memory to a colocated rollout engine until the next scoring
        (time-sliced devices); the teacher has no gradients or optimizer state, only its
        shards. On CPU there is nothing to hand over."""
        if self.device.type != "cuda":
            return
        if self._moves_shards and not self.released:
            self.model.to(HOST)
            torch.cuda.synchronize(self.device)  # the copies read device memory being freed
        self.released = True
        torch.cuda.empty_cache()

    def _ensure_on_device(self) -> None:
        if self.released and self._moves_shards:
            self.model.to(self.device)
        self.released = False

    def close(self) -> None:
        """Leave the process group (the last call on this object)."""
        dist.destroy_process_group()
