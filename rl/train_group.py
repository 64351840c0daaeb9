"""The driver's view of the trainer group: W TrainWorker actors that act as one."""

from __future__ import annotations

from pathlib import Path

import ray
import torch

from rl.cluster import Placement
from rl.config import Config
from rl.types import Batch
from trainer.worker import create_train_group


class TrainGroup:
    def __init__(self, cfg: Config, placement: Placement, num_roles_sharing: int) -> None:
        self.cfg = cfg
        bundles = placement.plan.roles["trainer"]
        self.workers = create_train_group(
            cfg, [placement.actor_options(index, num_roles_sharing) for index in bundles]
        )
        self.device_name: str = ray.get(self.workers[0].device_name.remote())  # for MFU

    def compute_logprobs(self, batch: Batch, model: str = "policy") -> torch.Tensor:
        """Log-probs [B, T-1] of `batch` under the policy or the frozen reference."""
        batch_ref = ray.put(batch)
        # Every rank returns the whole batch's (they all-reduce their rows); take one.
        return ray.get([w.compute_logprobs.remote(batch_ref, model) for w in self.workers])[0]

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One rollout batch of updates; metrics are already reduced over ranks."""
        batch_ref = ray.put(batch)
        return ray.get([w.train_step.remote(batch_ref) for w in self.workers])[0]

    def save_checkpoint(self, directory: Path) -> None:
        """Every rank writes its shards of the policy and optimizer into `directory`."""
        ray.get([w.save_checkpoint.remote(str(directory)) for w in self.workers])

    def load_checkpoint(self, directory: Path) -> None:
        ray.get([w.load_checkpoint.remote(str(directory)) for w in self.workers])

    def export_hf(self, out_dir: Path) -> Path:
        ray.get([w.export_hf.remote(str(out_dir)) for w in self.workers])
        return out_dir
