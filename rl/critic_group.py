"""The driver's view of the critic: W CriticWorker actors (PPO's value model) that act as one."""

from __future__ import annotations

from pathlib import Path

import ray
import torch

from rl.cluster import Placement
from rl.config import Config
from rl.train_group import on_every_rank
from rl.types import Batch
from trainer.critic_worker import create_critic_group


class CriticGroup:
    """Critic ranks colocated with the trainer: rank r shares the bundle the plan gives it."""

    def __init__(self, cfg: Config, placement: Placement, num_roles_sharing: int) -> None:
        # The plan names the critic's bundles when it was made for PPO; else rank r -> bundle r.
        bundles = placement.plan.roles.get("critic") or list(range(cfg.critic_world_size()))
        if max(bundles) >= placement.plan.num_devices:
            raise ValueError(
                f"{len(bundles)} critic ranks (critic.num_workers={cfg.critic.num_workers}) need "
                f"bundles {bundles}, but only {placement.plan.num_devices} devices are reserved"
            )
        self.workers = create_critic_group(
            cfg, [placement.actor_options(index, num_roles_sharing) for index in bundles]
        )

    def compute_values(self, batch: Batch) -> torch.Tensor:
        """Values [B, T-1] (fp32, CPU) of `batch`, 0 outside its loss_mask."""
        return on_every_rank(self.workers, "compute_values", batch)

    def train_step(self, batch: Batch) -> dict[str, float]:
        """Fit the values to batch.returns; critic/* metrics, already reduced over ranks."""
        return on_every_rank(self.workers, "train_step", batch)

    def release_memory(self) -> None:
        """Every rank moves its training state off its GPU until it next computes."""
        ray.get([w.release_memory.remote() for w in self.workers])

    def save_checkpoint(self, directory: Path) -> None:
        """Every rank writes its shards of the critic and optimizer into `directory`."""
        ray.get([w.save_checkpoint.remote(str(directory)) for w in self.workers])

    def load_checkpoint(self, directory: Path) -> None:
        ray.get([w.load_checkpoint.remote(str(directory)) for w in self.workers])

    def close(self) -> None:
        """Leave the process group and stop the actors (the last call on this object)."""
        ray.get([w.close.remote() for w in self.workers])
        for worker in self.workers:
            ray.kill(worker)
