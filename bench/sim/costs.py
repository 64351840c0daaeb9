"""What each kind of work costs on a GPU cluster: the simulation's cost model.

Every figure is a hardware datasheet value, a model's shape from its config.json, or a
published measurement; docs/scale.md cites each and says what the model leaves out. The
formulas, where `params` is the parameters a token's matrix multiplies use (a mixture of
experts' active parameters: its top-k experts, router, attention and embeddings) and every
byte counts all of them (every expert):

- decode, one step of an engine of `tp` GPUs running `batch` samples whose contexts add up
  to `context` tokens (vLLM's continuous batching: every running sample gains one token a
  step). A step reads the weights and every running sample's KV cache from HBM, or, at a
  large batch, is bound by its matrix multiplies:
      overhead + overhead per sample x batch
      + max((weight bytes + kv bytes x context) / (tp x HBM bandwidth x efficiency),
            2 x params x batch / (tp x peak x decode MFU))
- prefill of S tokens after a prefix of C (a prompt, or a resumed sample's prefix):
      (2 x params x S + 2 x layers x hidden x S x (2C + S)) / (tp x peak x prefill MFU)
- training on a sample of S tokens, forward and backward (causal attention's work counted
  as done, half of a full S x S):
      (6 x params x S + 6 x layers x hidden x S^2) / (GPUs x peak x train MFU)
  and an annotation (log-probs of old/reference policy) a third of that work, at its own MFU.
  With Ulysses sequence parallelism over N ranks (`sequence_parallel`) each rank of a group
  computes 1/N of its group's samples, so a rank's share of a step's FLOPs is the same; it
  adds the all-to-alls (`all_to_all_bytes`), sent over NVLink within a node and the network
  beyond, not overlapped with compute (each sits between a projection and attention);
- a weight sync: the bytes each engine GPU receives over its link, plus a fixed latency
  (vLLM's load_weights and the protocol's calls);
- moving memory to and from the host (time-sliced GPUs): bytes over PCIe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float  # dense
    nvlink_bytes_per_s: float  # per GPU, one direction
    network_bytes_per_s: float  # per GPU across nodes (one 400 Gb/s NIC per GPU)
    pcie_bytes_per_s: float  # host <-> device, one direction
    gpus_per_node: int = 8


# NVIDIA's datasheets (SXM parts); the H20's as published by resellers (docs/scale.md).
H100 = Gpu("H100", 80e9, 3.35e12, 989e12, 450e9, 50e9, 55e9)
H200 = Gpu("H200", 141e9, 4.8e12, 989e12, 450e9, 50e9, 55e9)
H20 = Gpu("H20", 96e9, 4.0e12, 148e12, 450e9, 50e9, 55e9)  # verl's fully-async runs
GPUS = {gpu.name: gpu for gpu in (H100, H200, H20)}


@dataclass(frozen=True)
class Model:
    """A decoder's shape, from its config.json. A mixture of experts holds `params` (every
    expert: its memory, the bytes a sync moves) and computes with `active_params` a token."""

    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    tp: int  # the tensor parallel size its rollout engines use
    active_params: float | None = None  # a mixture of experts'; None: dense, all are active
    intermediate: int | None = None  # the MLP's width: a trainer rank's activations need it

    @property
    def heads(self) -> int:
        """Query heads: as many as span the hidden size (Llama, Qwen2.5)."""
        return self.hidden // self.head_dim

    @property
    def compute_params(self) -> float:
        """The parameters a token's matrix multiplies use, 2 FLOPs each in a forward."""
        return self.params if self.active_params is None else self.active_params

    @property
    def weight_bytes(self) -> float:
        """bf16, every expert: what a sync moves, a sleep offloads, and a decode step is taken
        to read (an upper bound: a step reads only the experts its tokens are routed to)."""
        return 2 * self.params

    @property
    def kv_bytes_per_token(self) -> int:  # keys and values, bf16, every layer
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


QWEN25_7B = Model("Qwen2.5-7B", 7.62e9, 28, 3584, 4, 128, tp=1, intermediate=18944)
QWEN25_32B = Model("Qwen2.5-32B", 32.8e9, 64, 5120, 8, 128, tp=2, intermediate=27648)
MODELS = {model.name: model for model in (QWEN25_7B, QWEN25_32B)}


@dataclass(frozen=True)
class Efficiency:
    """The fractions of the datasheet a real stack reaches, and fixed latencies. The decode
    overheads are fitted to vLLM's published H100 figures (docs/scale.md, "Cost model")."""

    decode_hbm: float = 0.8  # of HBM bandwidth, reading weights and KV cache
    decode_mfu: float = 0.5  # a large decode batch's matrix multiplies
    decode_step_s: float = 0.001  # a decode step's fixed cost: launches, scheduling
    decode_sample_s: float = 4.5e-5  # and per running sample: sampling, bookkeeping
    prefill_mfu: float = 0.5
    train_mfu: float = 0.35
    annotate_mfu: float = 0.35  # forward passes for old/reference log-probs
    sync_latency_s: float = 0.1  # a weight sync's calls, whatever its size
    gpu_memory_utilization: float = 0.9  # vLLM's default share of a GPU's memory
    activation_bytes: float = 8 * GiB  # what a colocated trainer keeps for its activations
    max_num_seqs: int = 1024  # vLLM's default on H100/H200 (engine/arg_utils.py)


@dataclass(frozen=True)
class CostModel:
    gpu: Gpu
    model: Model
    eff: Efficiency = Efficiency()
    sequence_parallel: int = 1  # trainer ranks that run each sample together (Ulysses)

    def __post_init__(self) -> None:
        if self.model.heads % self.sequence_parallel:
            raise ValueError(
                f"sequence_parallel={self.sequence_parallel} does not divide {self.model.name}'s "
                f"{self.model.heads} attention heads"
            )

    # -- rollout ------------------------------------------------------------------------

    def decode_step_s(self, batch: int, context: float) -> float:
        g, m, e = self.gpu, self.model, self.eff
        memory = (m.weight_bytes + m.kv_bytes_per_token * context) / (
            m.tp * g.hbm_bytes_per_s * e.decode_hbm
        )
        compute = 2 * m.compute_params * batch / (m.tp * g.bf16_flops * e.decode_mfu)
        return e.decode_step_s + e.decode_sample_s * batch + max(memory, compute)

    def prefill_s(self, tokens: int, prefix: int) -> float:
        g, m = self.gpu, self.model
        attention = 2 * m.layers * m.hidden * tokens * (2 * prefix + tokens)
        flops = 2 * m.compute_params * tokens + attention
        return flops / (m.tp * g.bf16_flops * self.eff.prefill_mfu)

    def kv_capacity_tokens(self, trainer_gpus_sharing: int = 0) -> int:
        """Tokens an engine's KV cache holds. On GPUs it shares with a trainer that keeps its
        state on them (`trainer_gpus_sharing` of them), that state (bf16 weights, fp32
        gradients, fp32 master and Adam: 16 bytes a parameter, sharded) comes off first."""
        g, m, e = self.gpu, self.model, self.eff
        free = m.tp * g.memory_bytes * e.gpu_memory_utilization - m.weight_bytes
        if trainer_gpus_sharing:
            free -= m.tp * (16 * m.params / trainer_gpus_sharing + e.activation_bytes)
        if free <= 0:
            raise ValueError(f"{m.name} does not fit on {m.tp} {g.name} GPUs beside its trainer")
        return int(free // m.kv_bytes_per_token)

    # -- training -----------------------------------------------------------------------

    def train_flops(self, lengths: list[int]) -> float:
        m = self.model
        return sum(6 * m.compute_params * s + 6 * m.layers * m.hidden * s * s for s in lengths)

    def train_s(self, lengths: list[int], gpus: int) -> float:
        """Forward and backward of `lengths` over `gpus`: each rank's share of the FLOPs, and
        with sequence parallelism the all-to-alls of its share of the positions."""
        compute = self.train_flops(lengths) / (gpus * self.gpu.bf16_flops * self.eff.train_mfu)
        return compute + self.all_to_all_s(self.all_to_all_bytes(sum(lengths) / gpus))

    def annotate_s(self, lengths: list[int], gpus: int) -> float:
        """A forward pass: a third of training's work, half its all-to-all bytes."""
        flops = self.train_flops(lengths) / 3
        compute = flops / (gpus * self.gpu.bf16_flops * self.eff.annotate_mfu)
        return compute + self.all_to_all_s(self.all_to_all_bytes(sum(lengths) / gpus) / 2)

    def all_to_all_bytes(self, positions: float) -> float:
        """Bytes a trainer rank sends (and as many it receives) in a forward and backward
        over `positions` of its own, under sequence parallelism over N ranks. A layer's
        forward runs 4 all-to-alls, q, k and v (positions for heads) and the attention's
        output (heads back for positions), each on a [positions, heads x head_dim] bf16
        tensor (k and v with their heads repeated to lcm(kv heads, N), so that every rank
        gets whole heads) of which it keeps 1/N; its backward runs the same 4 on the
        gradients. Activation checkpointing's recomputed forward, left out as its FLOPs are,
        would add a forward's worth. 0 without sequence parallelism."""
        m, n = self.model, self.sequence_parallel
        exchanged = 2 * m.heads + 2 * math.lcm(m.kv_heads, n)
        forward = m.layers * positions * exchanged * m.head_dim * 2 * (n - 1) / n
        return 2 * forward

    def all_to_all_s(self, num_bytes: float) -> float:
        """A rank's all-to-all bytes over its link: NVLink while a group fits in a node, else
        the network (a group across nodes waits for its slowest link)."""
        g = self.gpu
        within = self.sequence_parallel <= g.gpus_per_node
        return num_bytes / (g.nvlink_bytes_per_s if within else g.network_bytes_per_s)

    def trainer_rank_bytes(self, length: int, gpus: int) -> float:
        """A trainer rank's memory training a sample of `length` tokens with activation
        checkpointing, as `rl.cluster.memory_plan` counts it, bf16, its group of N ranks
        running the sample alone: the state (16 bytes a parameter, sharded over `gpus`), every
        layer's input for its 1/N of the positions and one layer recomputed (two norms, q, the
        attention output, an MLP's four, k and v with repeated heads), the all-to-all's sent
        and received buffers of one layer (packed rows attend without a mask:
        `kernels.attention.packed_attention`). Left out: the layers FSDP2 has gathered, the
        log-prob kernel's workspace, allocator slack."""
        m, n = self.model, self.sequence_parallel
        if m.intermediate is None or m.active_params is not None:
            raise ValueError(f"{m.name}: a trainer rank's memory is modelled for dense models")
        width = -(-length // n) * n  # padded to a multiple of N
        positions = width // n
        kv = math.lcm(m.kv_heads, n) * m.head_dim
        layer = 5 * m.hidden + 2 * kv + 4 * m.intermediate
        activations = 2 * positions * (m.layers * m.hidden + layer)
        exchange = 2 * positions * (m.heads * m.head_dim + 2 * kv) * 2 if n > 1 else 0
        return 16 * m.params / gpus + activations + exchange

    # -- weights and memory -------------------------------------------------------------

    def sync_s(self, colocated_on_one_node: bool) -> float:
        """Each engine GPU receives its 1/tp of the bf16 weights: over NVLink from a trainer
        rank on its own node (CUDA IPC after an all-gather over NVLink), else over the
        network (NCCL, each trainer rank sending its rows)."""
        g, m = self.gpu, self.model
        link = g.nvlink_bytes_per_s if colocated_on_one_node else g.network_bytes_per_s
        return m.weight_bytes / m.tp / link + self.eff.sync_latency_s

    def engine_sleep_s(self) -> float:
        """vLLM's sleep (level 1) or wake-up: an engine GPU's weights to or from the host."""
        return self.model.weight_bytes / self.model.tp / self.gpu.pcie_bytes_per_s

    def trainer_offload_s(self, gpus: int) -> float:
        """A trainer rank's state (16 bytes a parameter, sharded) to or from the host."""
        return 16 * self.model.params / gpus / self.gpu.pcie_bytes_per_s
