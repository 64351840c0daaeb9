"""CriticWorker: the Ray actor shell around one `ValueTrainer` rank, and group creation."""

from __future__ import annotations

import ray
import torch
from ray.actor import ActorHandle

from rl.actor_logs import redirect_output
from rl.config import Config
from rl.types import Batch
from trainer.critic import ValueTrainer
from trainer.worker import rendezvous_address, start_rank_group


@ray.remote
class CriticWorker:
    """One critic FSDP2 rank. Created cheaply, then `init_trainer` joins the critic's group.

    The critic ranks form a torch.distributed group of their own (each actor is its own
    process, so its default group serves only the critic), with rank 0 hosting the rendezvous
    on its node, as `trainer.worker.TrainWorker` does.
    """

    def __init__(self, cfg: Config, rank: int, world_size: int) -> None:
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.trainer: ValueTrainer | None = None

    def get_master_addr_port(self) -> tuple[str, int]:
        return rendezvous_address()

    def log_to(self, log_file: str) -> None:
        redirect_output(log_file)

    def init_trainer(self, master_addr: str, master_port: int) -> None:
        """Build the ValueTrainer; blocks until all critic ranks have joined."""
        self.trainer = ValueTrainer(self.cfg, self.rank, self.world_size, master_addr, master_port)

    def compute_values(self, batch: Batch) -> torch.Tensor:
        """The values [B, T-1] of `batch`, the same on every rank (collective)."""
        return self.trainer.compute_values(batch)

    def train_step(self, batch: Batch) -> dict[str, float]:
        return self.trainer.train_step(batch)

    def release_memory(self) -> None:
        self.trainer.release_memory()

    def save_checkpoint(self, directory: str) -> None:
        self.trainer.save_checkpoint(directory)

    def load_checkpoint(self, directory: str) -> None:
        self.trainer.load_checkpoint(directory)

    def close(self) -> None:
        self.trainer.close()


def create_critic_group(cfg: Config, rank_options: list[dict] | None = None) -> list[ActorHandle]:
    """Start the `cfg.critic_world_size()` CriticWorker ranks (see `start_rank_group`)."""
    world_size = cfg.critic_world_size()
    if world_size < 1:
        raise ValueError(
            f"critic.num_workers={cfg.critic.num_workers} (0 = trainer.num_workers="
            f"{cfg.trainer.num_workers}) gives {world_size} critic ranks"
        )
    return start_rank_group(CriticWorker, cfg, world_size, rank_options, "critic")
