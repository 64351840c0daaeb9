"""The Ray actor shells around one trainer-side FSDP2 rank: `TrainWorker` (a `PolicyTrainer`
rank) and, in trainer/critic_worker.py, `CriticWorker`; both share `RankWorker`, and
`start_ranks` forms a role's ranks into one process group."""

from __future__ import annotations

import socket
from typing import Any

import ray
import torch
from ray.actor import ActorHandle

from rl.config import Config
from rl.observe.actor_logs import actor_log_file, redirect_output
from rl.sync.plan import AttentionShape, TensorSpec, plan_from_json
from rl.sync.transport import ChannelSpec
from rl.types import Batch, PolicyObjective
from trainer.policy import PolicyTrainer


class RankWorker:
    """One FSDP2 rank of a role. Created cheaply, then `init_trainer` joins the process group.

    Two phases because rank 0's address and port must be known before any rank can join, and
    they are rank 0's own (its node, a port free there), which is what makes multi-node work.
    Each role's ranks form a torch.distributed group of their own (each actor is its own
    process, so its default group serves only that role). `loss` is what the role's trainer
    minimises, built by the driver (rl.algorithms).
    """

    trainer_class: type

    def __init__(self, cfg: Config, loss: Any, rank: int, world_size: int) -> None:
        self.cfg, self.loss, self.rank, self.world_size = cfg, loss, rank, world_size
        self.trainer: Any = None

    def get_master_addr_port(self) -> tuple[str, int]:
        return rendezvous_address()

    def log_to(self, log_file: str) -> None:
        redirect_output(log_file)

    def init_trainer(self, master_addr: str, master_port: int) -> None:
        """Build this rank's trainer; blocks until all ranks have joined."""
        self.trainer = self.trainer_class(
            self.cfg, self.loss, self.rank, self.world_size, master_addr, master_port
        )

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

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


@ray.remote
class TrainWorker(RankWorker):
    """One rank of the policy (and its frozen reference)."""

    trainer_class = PolicyTrainer

    def compute_logprobs(self, batch: Batch, model: str = "policy") -> torch.Tensor:
        """The log-probs [B, T-1] of `batch`, the same on every rank (collective)."""
        return self.trainer.compute_logprobs(batch, model)

    def accumulate_chunk(self, batch: Batch, key: int) -> None:
        """scheduler.streaming: one chunk's gradients added (collective)."""
        self.trainer.accumulate_chunk(batch, key)

    def step_accumulated(self) -> dict[str, float]:
        return self.trainer.step_accumulated()

    def export_hf(self, out_dir: str) -> None:
        self.trainer.export_hf(out_dir)

    def parameter_checksum(self) -> float:
        return self.trainer.parameter_checksum()

    def weight_sync_spec(self) -> tuple[list[TensorSpec], AttentionShape]:
        return self.trainer.weight_sync_spec()

    def num_model_params(self) -> int:
        return self.trainer.num_model_params()

    def open_weight_sender(self, plan_json: str, channel_spec: ChannelSpec) -> object | None:
        return self.trainer.open_weight_sender(plan_from_json(plan_json), channel_spec)

    def write_weight_bucket(
        self, bucket: int, replicas: list[int] | None = None, pushed: bool = False
    ) -> dict[str, float]:
        return self.trainer.write_weight_bucket(bucket, replicas, pushed)

    def device_name(self) -> str:
        """This rank's accelerator ("NVIDIA H200", ...), or "cpu"."""
        device = self.trainer.device
        return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def rendezvous_address() -> tuple[str, int]:
    """This node's IP and a port free on it, for a group's rank 0 to host the rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def start_ranks(
    actor_class: type,
    cfg: Config,
    loss: Any,
    world_size: int,
    rank_options: list[dict] | None,
    role: str,
) -> list[ActorHandle]:
    """Start `world_size` ranks of `actor_class` (a `RankWorker`) and wait until they form one
    process group.

    Rank r starts with `.options(**rank_options[r])` (its bundle and its share of it:
    `rl.cluster.reservation.Placement.actor_options`), or on one CPU anywhere when
    `rank_options` is None. Rank 0 hosts the rendezvous on its own node, so the ranks may span
    nodes. Rank r's output goes to the run's `ROLE-r.log` (rl.observe.actor_logs) unless the run
    is verbose. Returns the handles in rank order.
    """
    options = [{"num_cpus": 1.0}] * world_size if rank_options is None else rank_options
    if len(options) != world_size:
        raise ValueError(f"{world_size} ranks but {len(options)} placements")
    workers = [
        actor_class.options(**rank).remote(cfg, loss, index, world_size)
        for index, rank in enumerate(options)
    ]
    log_files = [actor_log_file(cfg, f"{role}-{rank}") for rank in range(world_size)]
    ray.get([w.log_to.remote(f) for w, f in zip(workers, log_files, strict=True) if f])
    addr, port = ray.get(workers[0].get_master_addr_port.remote())
    ray.get([w.init_trainer.remote(addr, port) for w in workers])
    return workers


def start_policy_ranks(
    cfg: Config, objective: PolicyObjective, rank_options: list[dict] | None = None
) -> list[ActorHandle]:
    """Start the trainer.num_workers TrainWorker ranks (see `start_ranks`)."""
    world_size = cfg.trainer.num_workers
    if world_size < 1:
        raise ValueError(f"trainer.num_workers={world_size} < 1")
    return start_ranks(TrainWorker, cfg, objective, world_size, rank_options, "trainer")
