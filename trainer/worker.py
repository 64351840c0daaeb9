"""TrainWorker: the Ray actor shell around one `PolicyTrainer` rank, and group creation."""

from __future__ import annotations

import socket

import ray
import torch
from ray.actor import ActorHandle

from rl.actor_logs import actor_log_file, redirect_output
from rl.config import Config
from rl.types import Batch
from rl.weight_plan import AttentionShape, TensorSpec, plan_from_json
from trainer.policy import PolicyTrainer


@ray.remote
class TrainWorker:
    """One FSDP2 rank. Created cheaply, then `init_trainer` joins the process group.

    Two phases because rank 0's address and port must be known before any rank can join, and
    they are rank 0's own (its node, a port free there), which is what makes multi-node work.
    """

    def __init__(self, cfg: Config, rank: int, world_size: int) -> None:
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.trainer: PolicyTrainer | None = None

    def get_master_addr_port(self) -> tuple[str, int]:
        return rendezvous_address()

    def log_to(self, log_file: str) -> None:
        redirect_output(log_file)

    def init_trainer(self, master_addr: str, master_port: int) -> None:
        """Build the PolicyTrainer; blocks until all ranks have joined."""
        self.trainer = PolicyTrainer(self.cfg, self.rank, self.world_size, master_addr, master_port)

    def compute_logprobs(self, batch: Batch, model: str = "policy") -> torch.Tensor:
        """The log-probs [B, T-1] of `batch`, the same on every rank (collective)."""
        return self.trainer.compute_logprobs(batch, model)

    def train_step(self, batch: Batch) -> dict[str, float]:
        return self.trainer.train_step(batch)

    def release_memory(self) -> None:
        self.trainer.release_memory()

    def export_hf(self, out_dir: str) -> None:
        self.trainer.export_hf(out_dir)

    def save_checkpoint(self, directory: str) -> None:
        self.trainer.save_checkpoint(directory)

    def load_checkpoint(self, directory: str) -> None:
        self.trainer.load_checkpoint(directory)

    def parameter_checksum(self) -> float:
        return self.trainer.parameter_checksum()

    def weight_sync_spec(self) -> tuple[list[TensorSpec], AttentionShape]:
        return self.trainer.weight_sync_spec()

    def open_weight_sender(self, plan_json: str, channel_spec: dict) -> None:
        self.trainer.open_weight_sender(plan_from_json(plan_json), channel_spec)

    def write_weight_bucket(self, bucket: int) -> dict[str, float]:
        return self.trainer.write_weight_bucket(bucket)

    def device_name(self) -> str:
        """This rank's accelerator ("NVIDIA H200", ...), or "cpu"."""
        device = self.trainer.device
        return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


def rendezvous_address() -> tuple[str, int]:
    """This node's IP and a port free on it, for a group's rank 0 to host the rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def start_rank_group(
    actor_class: type,
    cfg: Config,
    world_size: int,
    rank_options: list[dict] | None,
    role: str,
) -> list[ActorHandle]:
    """Start `world_size` ranks of `actor_class` and wait until they form one process group.

    The actor class takes (cfg, rank, world_size) and has `get_master_addr_port()` and
    `init_trainer(addr, port)`. Rank r starts with `.options(**rank_options[r])` (its bundle
    and its share of it: `rl.cluster.Placement.actor_options`), or on one CPU anywhere when
    `rank_options` is None. Rank 0 hosts the rendezvous on its own node, so the ranks may
    span nodes. Rank r's output goes to the run's `ROLE-r.log` (rl.actor_logs) unless the run
    is verbose. Returns the handles in rank order.
    """
    options = [{"num_cpus": 1.0}] * world_size if rank_options is None else rank_options
    if len(options) != world_size:
        raise ValueError(f"{world_size} ranks but {len(options)} placements")
    workers = [
        actor_class.options(**rank).remote(cfg, index, world_size)
        for index, rank in enumerate(options)
    ]
    log_files = [actor_log_file(cfg, f"{role}-{rank}") for rank in range(world_size)]
    ray.get([w.log_to.remote(f) for w, f in zip(workers, log_files, strict=True) if f])
    addr, port = ray.get(workers[0].get_master_addr_port.remote())
    ray.get([w.init_trainer.remote(addr, port) for w in workers])
    return workers


def create_train_group(cfg: Config, rank_options: list[dict] | None = None) -> list[ActorHandle]:
    """Start the trainer.num_workers TrainWorker ranks (see `start_rank_group`)."""
    world_size = cfg.trainer.num_workers
    if world_size < 1:
        raise ValueError(f"trainer.num_workers={world_size} < 1")
    return start_rank_group(TrainWorker, cfg, world_size, rank_options, "trainer")
