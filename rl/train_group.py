"""The driver's view of the trainer group: W TrainWorker actors that act as one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray
import torch
from ray.actor import ActorHandle

from rl.cluster import Placement
from rl.config import Config
from rl.types import Batch
from trainer.worker import create_train_group


def on_every_rank(workers: list[ActorHandle], method: str, batch: Batch, *args: object) -> Any:
    """Call `method(batch, *args)` on every rank of a group and return rank 0's result (the
    ranks reduce theirs: every rank returns the same). Several ranks share one copy of the
    batch in the object store; one rank gets it in the call (1.3 ms less a call for the 1M
    model's 80 KB batch, measured)."""
    shared = ray.put(batch) if len(workers) > 1 else batch
    return ray.get([getattr(w, method).remote(shared, *args) for w in workers])[0]


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
        return on_every_rank(self.workers, "compute_logprobs", batch, model)

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One rollout batch of updates; metrics are already reduced over ranks."""
        return on_every_rank(self.workers, "train_step", batch)

    def release_memory(self) -> None:
        """Every rank moves its training state off its GPU until it next computes."""
        ray.get([w.release_memory.remote() for w in self.workers])

    def save_checkpoint(self, directory: Path) -> None:
        """Every rank writes its shards of the policy and optimizer into `directory`."""
        ray.get([w.save_checkpoint.remote(str(directory)) for w in self.workers])

    def load_checkpoint(self, directory: Path) -> None:
        ray.get([w.load_checkpoint.remote(str(directory)) for w in self.workers])

    def export_hf(self, out_dir: Path) -> Path:
        ray.get([w.export_hf.remote(str(out_dir)) for w in self.workers])
        return out_dir
