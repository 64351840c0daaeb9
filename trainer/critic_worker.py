"""CriticWorker: the Ray actor shell around one `ValueTrainer` rank, and starting the critic's
ranks."""

from __future__ import annotations

import ray
import torch
from ray.actor import ActorHandle

from rl.config import Config
from rl.types import Batch, ValueLoss
from trainer.critic import ValueTrainer
from trainer.worker import RankWorker, start_ranks


@ray.remote
class CriticWorker(RankWorker):
    """One rank of the critic (PPO's value model)."""

    trainer_class = ValueTrainer

    def compute_values(self, batch: Batch) -> torch.Tensor:
        """The values [B, T-1] of `batch`, the same on every rank (collective)."""
        return self.trainer.compute_values(batch)


def start_critic_ranks(
    cfg: Config, value_loss: ValueLoss, rank_options: list[dict] | None = None
) -> list[ActorHandle]:
    """Start the `cfg.critic_world_size()` CriticWorker ranks (see `start_ranks`)."""
    world_size = cfg.critic_world_size()
    if world_size < 1:
        raise ValueError(
            f"critic.num_workers={cfg.critic.num_workers} (0 = trainer.num_workers="
            f"{cfg.trainer.num_workers}) gives {world_size} critic ranks"
        )
    return start_ranks(CriticWorker, cfg, value_loss, world_size, rank_options, "critic")
