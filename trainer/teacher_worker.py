"""TeacherWorker: the Ray actor shell around one `TeacherScorer` rank, and starting the
teacher's ranks (on-policy distillation)."""

from __future__ import annotations

import ray
import torch
from ray.actor import ActorHandle

from rl.config import Config
from rl.types import Batch
from trainer.teacher import TeacherScorer
from trainer.worker import RankWorker, start_ranks


@ray.remote
class TeacherWorker(RankWorker):
    """One rank of the frozen teacher: it joins its group and scores batches, and is never
    trained or checkpointed (the run's roles call only what is below and the group's start)."""

    trainer_class = TeacherScorer

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """The teacher's log-probs [B, T-1] of `batch`, the same on every rank (collective)."""
        return self.trainer.compute_logprobs(batch)


def start_teacher_ranks(cfg: Config, rank_options: list[dict] | None = None) -> list[ActorHandle]:
    """Start the `cfg.teacher_world_size()` TeacherWorker ranks (see `start_ranks`)."""
    world_size = cfg.teacher_world_size()
    if world_size < 1:
        raise ValueError(
            f"teacher.num_workers={cfg.teacher.num_workers} (0 = trainer.num_workers="
            f"{cfg.trainer.num_workers}) gives {world_size} teacher ranks"
        )
    return start_ranks(TeacherWorker, cfg, None, world_size, rank_options, "teacher")
