"""The driver's handles to the trainer-side roles: the policy's ranks (TrainWorker actors),
the critic's (CriticWorker actors) and the distillation teacher's (TeacherWorker actors), each
a torch.distributed group that acts as one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray
import torch
from ray.actor import ActorHandle

from rl.algorithms.objective import Objective
from rl.algorithms.value_loss import value_loss
from rl.cluster.reservation import Placement
from rl.config import Config
from rl.types import Batch
from trainer.critic_worker import start_critic_ranks
from trainer.teacher_worker import start_teacher_ranks
from trainer.worker import start_policy_ranks


def on_every_rank(workers: list[ActorHandle], method: str, batch: Batch, *args: object) -> Any:
    """Call `method(batch, *args)` on every rank of a role and return rank 0's result (the
    ranks reduce theirs: every rank returns the same). Several ranks share one copy of the
    batch in the object store; a single rank gets it in the call, which saves the store's
    round trip."""
    shared = ray.put(batch) if len(workers) > 1 else batch
    return ray.get([getattr(w, method).remote(shared, *args) for w in workers])[0]


class RoleRanks:
    """What the driver does the same way to every trainer-side role's ranks."""

    workers: list[ActorHandle]

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One rollout batch of updates; metrics are already reduced over ranks."""
        return on_every_rank(self.workers, "train_step", batch)

    def release_memory(self) -> None:
        """Every rank moves its training state off its GPU until it next computes."""
        ray.get([w.release_memory.remote() for w in self.workers])

    def save_checkpoint(self, directory: Path) -> None:
        """Every rank writes its shards of the model and optimizer into `directory`."""
        ray.get([w.save_checkpoint.remote(str(directory)) for w in self.workers])

    def load_checkpoint(self, directory: Path) -> None:
        ray.get([w.load_checkpoint.remote(str(directory)) for w in self.workers])

    def close(self) -> None:
        """Leave the process group and stop the actors (the last call on this object)."""
        ray.get([w.close.remote() for w in self.workers])
        for worker in self.workers:
            ray.kill(worker)


class PolicyRanks(RoleRanks):
    """The policy's ranks, minimising the recipe's objective (rl.algorithms.objective)."""

    def __init__(self, cfg: Config, placement: Placement, num_roles_sharing: int) -> None:
        self.cfg = cfg
        bundles = placement.plan.roles["trainer"]
        self.workers = start_policy_ranks(
            cfg,
            Objective.from_config(cfg),
            [placement.actor_options(index, num_roles_sharing) for index in bundles],
        )
        self.device_name: str = ray.get(self.workers[0].device_name.remote())  # for MFU

    def compute_logprobs(self, batch: Batch, model: str = "policy") -> torch.Tensor:
        """Log-probs [B, T-1] of `batch` under the policy or the frozen reference."""
        return on_every_rank(self.workers, "compute_logprobs", batch, model)

    def accumulate_chunk(self, batch: Batch, key: int) -> None:
        """scheduler.streaming: forward/backward of one chunk of the step's groups (`key`: its
        first group id), its gradients added to the step's in any order, exactly
        (PolicyTrainer.accumulate_chunk)."""
        on_every_rank(self.workers, "accumulate_chunk", batch, key)

    def step_accumulated(self) -> dict[str, float]:
        """The optimizer step over the groups accumulated since the last one; metrics as
        train_step's."""
        return ray.get([w.step_accumulated.remote() for w in self.workers])[0]

    def export_hf(self, out_dir: Path) -> Path:
        ray.get([w.export_hf.remote(str(out_dir)) for w in self.workers])
        return out_dir


class CriticRanks(RoleRanks):
    """The critic's ranks (PPO), colocated with the trainer: rank r shares the bundle the plan
    gives it."""

    def __init__(self, cfg: Config, placement: Placement, num_roles_sharing: int) -> None:
        # The plan names the critic's bundles when it was made for PPO; else rank r -> bundle r.
        bundles = placement.plan.roles.get("critic") or list(range(cfg.critic_world_size()))
        if max(bundles) >= placement.plan.num_devices:
            raise ValueError(
                f"{len(bundles)} critic ranks (critic.num_workers={cfg.critic.num_workers}) need "
                f"bundles {bundles}, but only {placement.plan.num_devices} devices are reserved"
            )
        self.workers = start_critic_ranks(
            cfg,
            value_loss,
            [placement.actor_options(index, num_roles_sharing) for index in bundles],
        )

    def compute_values(self, batch: Batch) -> torch.Tensor:
        """Values [B, T-1] (fp32, CPU) of `batch`, 0 outside its loss_mask."""
        return on_every_rank(self.workers, "compute_values", batch)


class TeacherRanks:
    """The distillation teacher's ranks: a frozen model in a group of its own, on the bundles
    the plan gives the role (the trainer's, or its own under split placement). It only scores:
    nothing of it is trained or checkpointed, and it ends with the run's placement groups."""

    def __init__(self, cfg: Config, placement: Placement, num_roles_sharing: int) -> None:
        bundles = placement.plan.roles["teacher"]
        self.workers = start_teacher_ranks(
            cfg, [placement.actor_options(index, num_roles_sharing) for index in bundles]
        )

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """The teacher's log-probs [B, T-1] (fp32, CPU) of `batch`, 0 at padding."""
        return on_every_rank(self.workers, "compute_logprobs", batch)

    def release_memory(self) -> None:
        """Every rank moves its shards off its GPU until it next scores."""
        ray.get([w.release_memory.remote() for w in self.workers])
