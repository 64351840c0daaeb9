"""Per-rank memory estimate of a plan, for `rl train --dry-run`: does it fit the devices?

Pure arithmetic over the model's HF config and the recipe (nothing is loaded), in the terms
users size runs by. A trainer rank holds its FSDP2 shard of the fp32 master parameters,
gradients and AdamW's two moments (16 bytes a parameter over W ranks; with LoRA, 4 bytes a
frozen base parameter and 16 an adapter parameter), the frozen reference's shard (4 bytes
over W; none with LoRA, whose reference is the base), the layers FSDP2 has gathered in the
compute dtype (the root's embeddings and head, the current layer and the prefetched next),
the activations a micro-batch saves for backward (packed rows attend within each sample
without a mask: `kernels.attention.packed_attention`), the fused log-prob kernel's workspace,
and on GPUs the weight transport's buffers. With sequence parallelism
(`trainer.sequence_parallel` N) a rank holds 1/N of its group's micro-batch positions
(`MicroBatch`) and the attention's heads exchanged for positions. A
rollout worker holds its tensor-parallel slice of the weights and the KV cache, which must
hold at least one sequence of rollout.max_model_len (vLLM refuses to start otherwise). A
distillation teacher's rank holds its shard of the teacher's fp32 weights, the layers it has
gathered, one layer's activations of its share of a micro-batch and the kernel's forward
workspace. A
mixture of experts counts every expert in the parameters, gradients, optimizer state and
weights (FSDP2 shards the fused expert tensors like any parameter and gathers a layer's
experts with it: there is no expert parallelism), and a token's activations for its top-k
experts only. The figures leave out allocator fragmentation and runtime overheads (CUDA
context, NCCL buffers: about 1-2 GiB a GPU), so a plan within a few percent of the limit is
not safe.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import psutil

from rl.algorithms.advantages import needs_critic
from rl.config import Config

GIB = 1 << 30
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The log-prob kernel keeps a chunk's fp32 logits, their exponentials and gradient.
_LOGPROB_WORKSPACE_COPIES = 3


class PlanDoesNotFit(ValueError):
    """The plan cannot run on its devices: it needs more memory than they have, or splits the
    model in a way it cannot take; the message says what to change."""


# Mixture-of-experts architectures whose layouts the estimate knows, and config keys that say a
# config has experts (so an unknown mixture is refused rather than counted as a dense model).
_MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok")


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama/Qwen-style decoder that memory and FLOPs depend on. A mixture of
    experts (Qwen3-MoE, Qwen2-MoE, Mixtral) has `num_sparse_layers` layers whose MLP is
    `num_experts` routed experts of `expert_intermediate_size` (the token goes to
    `experts_per_token` of them), a router, and for Qwen2-MoE a gated shared expert; its other
    layers have a dense MLP of `intermediate_size`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied_embeddings: bool
    num_attention_bias: int  # bias elements of one layer's attention projections
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's queries and keys
    num_sparse_layers: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0: none

    @classmethod
    def read(cls, model_dir: Path) -> ModelShape:
        """The shape in `model_dir/config.json`; ValueError naming the file and key."""
        path = model_dir / "config.json"
        config = json.loads(path.read_text())
        model_type = config.get("model_type")
        if model_type not in _MOE_TYPES and any(config.get(key) for key in _EXPERT_KEYS):
            raise ValueError(
                f"{path} is a mixture of experts of model_type {model_type!r}, which the memory "
                f"estimate does not know; it reads {', '.join(_MOE_TYPES)} and dense "
                "Llama/Qwen-style decoders"
            )
        try:
            num_heads = config["num_attention_heads"]
            head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
            num_kv_heads = config.get("num_key_value_heads") or num_heads
            q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
            # Qwen2 biases q, k and v (Qwen2-MoE unless its qkv_bias says not); Llama-style
            # configs say so for all four.
            if model_type in ("qwen2", "qwen2_moe"):
                num_bias = (q_dim + 2 * kv_dim) * bool(config.get("qkv_bias", True))
            else:
                num_bias = q_dim + 2 * kv_dim + config["hidden_size"]
                num_bias *= bool(config.get("attention_bias"))
            return cls(
                vocab_size=config["vocab_size"],
                hidden_size=config["hidden_size"],
                intermediate_size=config["intermediate_size"],
                num_layers=config["num_hidden_layers"],
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                tied_embeddings=bool(config.get("tie_word_embeddings", False)),
                num_attention_bias=num_bias,
                qk_norm=model_type in ("qwen3", "qwen3_moe"),
                **(_experts(config) if model_type in _MOE_TYPES else {}),
            )
        except KeyError as e:
            raise ValueError(
                f"{path} has no {e.args[0]!r}: the memory estimate needs a Llama/Qwen-style "
                "decoder config"
            ) from None

    def describe(self) -> str:
        """Its parameter count as the dry run says it: a mixture of experts' total and active."""
        if self.num_sparse_layers == 0:
            return f"{self.num_params / 1e9:.3f}B parameters"
        return (
            f"{self.num_params / 1e9:.3f}B total / {self.num_active_params / 1e9:.3f}B active "
            f"parameters ({self.num_experts} experts, {self.experts_per_token} a token)"
        )

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def exchanged_kv_heads(self, sequence_parallel: int) -> int:
        """Key/value heads attention runs with over `sequence_parallel` ranks: repeated to
        lcm(kv heads, N) so that each rank gets whole heads (`trainer.sequence_parallel`)."""
        return math.lcm(self.num_kv_heads, sequence_parallel)

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_sparse_layers

    @property
    def num_attention_params(self) -> int:
        """One layer's attention: q, k, v, o, their biases, and Qwen3's q and k norms."""
        h, q_dim = self.hidden_size, self.num_heads * self.head_dim
        qk_norm = 2 * self.head_dim if self.qk_norm else 0
        return 2 * h * q_dim + 2 * h * self.kv_dim + self.num_attention_bias + qk_norm

    @property
    def num_dense_layer_params(self) -> int:
        """A dense decoder layer: attention, gated MLP, two norms."""
        h = self.hidden_size
        return self.num_attention_params + 3 * h * self.intermediate_size + 2 * h

    def _num_sparse_layer_params(self, experts_counted: int) -> int:
        """A sparse layer with `experts_counted` of its routed experts: attention, two norms,
        the router (it scores every expert for every token), those experts' gated MLPs, and
        the shared expert with its one-output gate."""
        h = self.hidden_size
        shared = 3 * h * self.shared_expert_intermediate_size
        shared += h if self.shared_expert_intermediate_size else 0
        experts = experts_counted * 3 * h * self.expert_intermediate_size
        return self.num_attention_params + 2 * h + self.num_experts * h + experts + shared

    @property
    def num_layer_params(self) -> int:
        """The largest decoder layer, the unit FSDP2 gathers: a sparse layer with all its
        experts (FSDP2 shards the fused expert tensors like any parameter), else a dense one."""
        if self.num_sparse_layers == 0:
            return self.num_dense_layer_params
        sparse = self._num_sparse_layer_params(self.num_experts)
        return max(sparse, self.num_dense_layer_params if self.num_dense_layers else 0)

    @property
    def largest_load_unit(self) -> int:
        """Elements of the largest tensors vLLM loads as one layer, which travel in one bucket
        whatever its size: the embedding (or LM head), a layer's fused gate/up or q/k/v, or a
        sparse layer's fused expert tensors (gate/up and down of every expert)."""
        h, q_dim = self.hidden_size, self.num_heads * self.head_dim
        units = [self.vocab_size * h, h * (q_dim + 2 * self.kv_dim)]
        if self.num_dense_layers:
            units.append(2 * self.intermediate_size * h)
        if self.num_sparse_layers:
            units.append(self.num_experts * 3 * self.expert_intermediate_size * h)
            units.append(2 * self.shared_expert_intermediate_size * h)
        return max(units)

    @property
    def num_root_params(self) -> int:
        """What is not in a decoder layer: embeddings, final norm, an untied LM head."""
        embeddings = self.vocab_size * self.hidden_size
        return embeddings * (1 if self.tied_embeddings else 2) + self.hidden_size

    @property
    def num_params(self) -> int:
        """Every parameter, all experts included: what memory and a weight sync hold."""
        sparse = self.num_sparse_layers * self._num_sparse_layer_params(self.num_experts)
        return self.num_dense_layers * self.num_dense_layer_params + sparse + self.num_root_params

    @property
    def num_active_params(self) -> int:
        """The parameters a token's forward uses, counted as for a dense model (embeddings
        included): in a sparse layer only its `experts_per_token` routed experts, besides the
        router, the shared expert and attention. Equals `num_params` for a dense model."""
        sparse = self.num_sparse_layers * self._num_sparse_layer_params(self.experts_per_token)
        return self.num_dense_layers * self.num_dense_layer_params + sparse + self.num_root_params

    def _linear_sizes(self, mlp_width: int) -> dict[str, tuple[int, int]]:
        """(in, out) features of a layer's linear modules, by the names peft's
        `target_modules` match: attention's, and those of an MLP of `mlp_width` (a dense
        layer's, or a sparse layer's shared expert; 0: none, routed experts being fused
        tensors rather than linear modules)."""
        h, q_dim = self.hidden_size, self.num_heads * self.head_dim
        sizes = {
            "q_proj": (h, q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (q_dim, h),
        }
        if mlp_width:
            sizes.update(gate_proj=(h, mlp_width), up_proj=(h, mlp_width), down_proj=(mlp_width, h))
        return sizes

    def num_adapter_params(self, rank: int, target_modules: list[str]) -> int:
        """LoRA adapters of `rank` on the linear modules named in `target_modules` of every
        layer that has them: A [r, in], B [out, r]."""
        known = self._linear_sizes(self.intermediate_size)
        unknown = sorted(set(target_modules) - set(known))
        if unknown:
            raise ValueError(
                f"model.lora.target_modules names {unknown[0]!r}, which the memory estimate does "
                f"not know; a Llama/Qwen decoder layer's linear modules are {sorted(known)}"
            )

        def per_layer(mlp_width: int) -> int:
            sizes = self._linear_sizes(mlp_width)
            return sum(rank * sum(sizes[name]) for name in set(target_modules) if name in sizes)

        dense = self.num_dense_layers * per_layer(self.intermediate_size)
        return dense + self.num_sparse_layers * per_layer(self.shared_expert_intermediate_size)

    def activation_elements_per_token(self, checkpointed: bool, sequence_parallel: int = 1) -> int:
        """Elements a token's forward saves for backward over the whole decoder. Per layer:
        the two norm inputs and outputs, q, k and v (with sequence parallelism over N ranks,
        the key/value heads repeated to lcm(kv heads, N) for the exchange), the attention
        output, and a dense MLP's gate, up, activation and product; a sparse layer's MLP instead saves the router's
        logits, and for each of the token's experts its copy of the token, gate, up,
        activation, product and output (before the router's weight), and the shared expert's
        gate, up, activation, product and output (before its gate). With activation
        checkpointing only each layer's input is kept, and one layer at a time is recomputed."""
        h, shared = self.hidden_size, self.shared_expert_intermediate_size
        attention = 5 * h + 2 * self.exchanged_kv_heads(sequence_parallel) * self.head_dim
        dense = attention + 4 * self.intermediate_size
        routed = self.experts_per_token * (2 * h + 4 * self.expert_intermediate_size)
        sparse = attention + self.num_experts + routed + (4 * shared + h if shared else 0)
        if checkpointed:
            largest = max(
                dense if self.num_dense_layers else 0, sparse if self.num_sparse_layers else 0
            )
            return self.num_layers * h + largest
        return self.num_dense_layers * dense + self.num_sparse_layers * sparse


def _experts(config: dict) -> dict[str, int]:
    """A mixture of experts' sizes from its HF config. Mixtral's every layer is sparse, its
    experts `intermediate_size` wide; Qwen-MoE's layer i is sparse unless it is in
    `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step`, as transformers
    builds it, and its experts are `moe_intermediate_size` wide."""
    num_layers = config["num_hidden_layers"]
    if config["model_type"] == "mixtral":
        num_experts, width = config["num_local_experts"], config["intermediate_size"]
        sparse = num_layers
    else:
        # transformers writes Qwen3-MoE's count as num_local_experts, the Hub's configs num_experts.
        num_experts = config.get("num_experts", config.get("num_local_experts"))
        if num_experts is None:
            raise KeyError("num_experts")
        dense = set(config.get("mlp_only_layers") or ())
        step = config.get("decoder_sparse_step") or 1
        sparse = sum(
            i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
        )
        width = config["moe_intermediate_size"]
    shared = config["shared_expert_intermediate_size"] if config["model_type"] == "qwen2_moe" else 0
    return {
        "num_sparse_layers": sparse,
        "num_experts": num_experts,
        "experts_per_token": config["num_experts_per_tok"],
        "expert_intermediate_size": width,
        "shared_expert_intermediate_size": shared,
    }


# The parts a micro-batch holds only while it runs: a role that is not running keeps none.
_MICRO_BATCH_PARTS = ("activations", "attention mask", "attention scores", "all-to-all buffers")


@dataclass
class RoleMemory:
    """One rank's estimate: part name -> bytes."""

    role: str
    parts: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def resident(self) -> float:
        """What stays allocated while another role runs: all but a micro-batch's parts."""
        return self.total - sum(self.parts.get(name, 0.0) for name in _MICRO_BATCH_PARTS)

    def describe(self) -> str:
        parts = ", ".join(f"{name} {size / GIB:.2f}" for name, size in self.parts.items())
        return f"{self.role}: {parts} = {self.total / GIB:.2f} GiB"


@dataclass(frozen=True)
class MicroBatch:
    """The largest micro-batch a group of `sequence_parallel` ranks runs when no sample is
    longer than rollout.max_model_len: `positions` in rows `width` wide (the longest sample,
    padded to a multiple of the degree: `trainer.sequence_parallel.padded_width`)."""

    positions: int
    width: int
    sequence_parallel: int
    # Whether the rows carry a [rows, 1, width, width] boolean mask: shared-prompt rows
    # (trainer.share_prompts). Packed and padded rows attend without one.
    masked: bool

    @classmethod
    def largest(cls, cfg: Config, sequence_parallel: int) -> MicroBatch:
        """Rows as wide as the longest sample, as many as the group's token budget holds
        (sequence_parallel x trainer.micro_batch_tokens; a longer sample alone), or
        trainer.micro_batch_size of them. A mini-batch of shorter samples holds no more."""
        trainer, sp = cfg.trainer, sequence_parallel
        width = -(-cfg.rollout.max_model_len // sp) * sp
        if trainer.micro_batch_tokens:
            positions = max(sp * trainer.micro_batch_tokens, width)
        else:
            positions = trainer.micro_batch_size * width
        return cls(positions, width, sp, trainer.share_prompts)

    @property
    def per_rank(self) -> int:
        """The positions one rank of the group runs."""
        return self.positions // self.sequence_parallel


def trainer_rank(
    cfg: Config, shape: ModelShape, role: str = "trainer rank", on_gpu: bool = True
) -> RoleMemory:
    """A policy (or critic) rank's peak during a training step, on GPUs or (`on_gpu` False)
    on CPU, where short half-precision attention holds its scores (`kernels.attention`)."""
    trainer = cfg.trainer
    sp = trainer.sequence_parallel  # the critic's groups are as the policy's
    if shape.num_heads % sp:
        raise PlanDoesNotFit(
            f"trainer.sequence_parallel={sp} gives each rank 1/{sp} of the attention heads, "
            f"but the model has {shape.num_heads}: choose a degree that divides it"
        )
    num_ranks = cfg.trainer.num_workers if role == "trainer rank" else cfg.critic_world_size()
    # The ranks one copy of the state is sharded over (the rest replicate it).
    num_shards = {"hybrid": trainer.shard_group_size, "none": 1}.get(trainer.sharding, num_ranks)
    compute = _DTYPE_BYTES[cfg.model.dtype]
    n = shape.num_params
    # LoRA trains the policy's adapters over its frozen base (the critic trains in full).
    lora = cfg.model.lora if role == "trainer rank" and cfg.model.lora.enabled else None
    adapters = shape.num_adapter_params(lora.rank, lora.target_modules) if lora else 0
    trained = adapters or n
    # zero3 gathers a layer at a time (and prefetches the next); the others keep every layer
    # gathered from its forward until its backward.
    num_gathered = shape.num_root_params + 2 * shape.num_layer_params
    if trainer.sharding in ("zero2", "none"):
        num_gathered = n
    parts = {
        "params": 4 * (n + adapters) / num_shards,
        "grads": 4 * trained / num_shards,
        "optimizer": 8 * trained / num_shards,
        "gathered": compute * num_gathered,
    }
    # With LoRA the reference is the base, the policy with its adapters off: no second copy.
    if role == "trainer rank" and cfg.algorithm.kl_coef > 0 and lora is None:
        parts["reference"] = 4 * n / num_shards
    micro = MicroBatch.largest(cfg, sp)
    num_tokens = micro.per_rank
    elements = shape.activation_elements_per_token(trainer.activation_checkpointing, sp)
    # Layers whose saved tensors are alive at once: all, or with checkpointing the one
    # recomputed.
    layers = 1 if trainer.activation_checkpointing else shape.num_layers
    if lora:  # each adapter also saves its A's output, r a token, for B's backward
        elements += layers * lora.rank * len(set(lora.target_modules))
    parts["activations"] = compute * num_tokens * elements
    if role == "trainer rank" and sp > 1:
        # A mixture of experts' router logits of the group's other positions, gathered for
        # the router losses and kept in every sparse layer until backward.
        other = micro.positions - num_tokens
        parts["activations"] += compute * other * shape.num_experts * shape.num_sparse_layers
    parts.update(_attention_parts(micro, shape, compute, layers, on_gpu))
    if role == "trainer rank":
        rows = min(trainer.logprob_chunk_size, num_tokens)
        columns = min(trainer.logprob_vocab_chunk_size, shape.vocab_size)
        # Its backward also accumulates the micro-batch's hidden gradient and one vocabulary
        # tile's weight gradient in fp32.
        gradients = 4 * (num_tokens + columns) * shape.hidden_size
        workspace = 4 * rows * columns * _LOGPROB_WORKSPACE_COPIES + gradients
        if sp > 1:  # the group's log-probs and entropies, gathered on every rank in fp32
            workspace += 2 * 4 * micro.positions
        parts["log-prob workspace"] = workspace
    return RoleMemory(role, parts)


def _attention_parts(
    micro: MicroBatch, shape: ModelShape, compute: int, layers: int, on_gpu: bool
) -> dict[str, float]:
    """What attention holds beyond the activations, for `layers` layers' saved tensors.

    - Sequence parallelism's all-to-alls: one layer's sent and received q, k and v (heads
      repeated) and output, transient.
    - Shared-prompt rows' boolean mask, once a forward, and a copy of it each layer saves for
      its backward: SDPA's additive mask in the compute dtype, or the explicit product's
      negated boolean one.
    - On CPU, the explicit product that `kernels.attention` runs for half-precision rows of
      at most MAX_EXPLICIT_KEYS positions instead of SDPA: each layer saves its fp32 softmax
      and the copy of it in the compute dtype that multiplies the values (counted as whole
      rows': packed samples of similar lengths are gathered, which holds no more).
    """
    from kernels.attention import MAX_EXPLICIT_KEYS  # torch and transformers: not at import

    sp, heads = micro.sequence_parallel, shape.num_heads
    parts = {}
    if sp > 1:
        exchanged = heads + 2 * shape.exchanged_kv_heads(sp)
        parts["all-to-all buffers"] = 2 * micro.per_rank * exchanged * shape.head_dim * compute
    # rows x width x width: the micro-batch's positions x width
    square = micro.positions * micro.width
    explicit = not on_gpu and compute == 2 and micro.width <= MAX_EXPLICIT_KEYS
    if explicit:
        parts["attention scores"] = (4 + compute) * square * (heads // sp) * layers
    if micro.masked:
        parts["attention mask"] = square * (1 + (1 if explicit else compute) * layers)
    return parts


def teacher_rank(cfg: Config, shape: ModelShape, on_gpu: bool = True) -> RoleMemory:
    """A distillation teacher rank's peak while it scores; `shape` is the teacher's. Sharded,
    micro-batched and sequence-parallel as the trainer is, over the teacher's own ranks."""
    trainer = cfg.trainer
    num_shards = {"hybrid": trainer.shard_group_size, "none": 1}.get(
        trainer.sharding, cfg.teacher_world_size()
    )
    compute = _DTYPE_BYTES[cfg.model.dtype]
    num_gathered = shape.num_root_params + 2 * shape.num_layer_params
    if trainer.sharding in ("zero2", "none"):
        num_gathered = shape.num_params
    micro = MicroBatch.largest(cfg, trainer.sequence_parallel)
    num_tokens = micro.per_rank
    # A forward without backward keeps no layer's activations: the hidden states and the
    # current layer's intermediates (the checkpointed count holds every layer's input).
    elements = (
        shape.activation_elements_per_token(True, trainer.sequence_parallel)
        - (shape.num_layers - 1) * shape.hidden_size
    )
    rows = min(trainer.logprob_chunk_size, num_tokens)
    columns = min(trainer.logprob_vocab_chunk_size, shape.vocab_size)
    parts = {
        "params": 4 * shape.num_params / num_shards,
        "gathered": compute * num_gathered,
        "activations": compute * num_tokens * elements,
        "log-prob workspace": 4 * rows * columns * _LOGPROB_WORKSPACE_COPIES,
        **_attention_parts(micro, shape, compute, 1, on_gpu),
    }
    return RoleMemory("teacher rank", parts)


def rollout_rank(cfg: Config, shape: ModelShape) -> tuple[RoleMemory, float]:
    """(a rollout TP rank's weights and the KV cache its share of a step's sequences needs,
    the memory its engine reserves: rollout.kv_cache_gb on CPU beyond the weights; on GPU
    gpu_memory_utilization of the device, filled in by `check_fits`)."""
    rollout = cfg.rollout
    tp = rollout.tensor_parallel_size
    compute = _DTYPE_BYTES[cfg.model.dtype]
    num_sequences = math.ceil(
        cfg.run.prompts_per_step * cfg.algorithm.group_size / rollout.num_workers
    )
    parts = {
        "weights": compute * shape.num_params / tp,
        f"KV cache ({num_sequences} sequences x {rollout.max_model_len} tokens)": (
            num_sequences * rollout.max_model_len * _kv_bytes_per_token(cfg, shape)
        ),
    }
    return RoleMemory("rollout TP rank", parts), parts["weights"] + rollout.kv_cache_gb * GIB


def _kv_bytes_per_token(cfg: Config, shape: ModelShape) -> float:
    """A token's keys and values on one rollout TP rank, every layer, in model.dtype."""
    compute = _DTYPE_BYTES[cfg.model.dtype]
    return 2 * shape.num_layers * shape.kv_dim * compute / cfg.rollout.tensor_parallel_size


def engine_kv_tokens(cfg: Config, shape: ModelShape, device_bytes: float, on_gpu: bool) -> int:
    """Tokens a rollout engine's KV cache holds at most: rollout.kv_cache_gb on CPU; on GPUs
    what vLLM's reserve (rollout.gpu_memory_utilization of `device_bytes`) leaves beside the
    weights, less room vLLM keeps for its own activations, which it measures at start."""
    if on_gpu:
        weights = (
            _DTYPE_BYTES[cfg.model.dtype] * shape.num_params / cfg.rollout.tensor_parallel_size
        )
        budget = cfg.rollout.gpu_memory_utilization * device_bytes - weights
    else:
        budget = cfg.rollout.kv_cache_gb * GIB
    return max(0, int(budget // _kv_bytes_per_token(cfg, shape)))


def _check_kv_cache(
    cfg: Config, shape: ModelShape, device_bytes: float, on_gpu: bool, lines: list[str]
) -> None:
    """Adds the engine's KV budget to `lines`; PlanDoesNotFit when it cannot hold one
    sequence of rollout.max_model_len, which vLLM refuses at start."""
    tokens, length = engine_kv_tokens(cfg, shape, device_bytes, on_gpu), cfg.rollout.max_model_len
    lines.append(
        f"a rollout engine's KV cache holds at most {tokens:,} tokens: {tokens // length} "
        f"sequences of rollout.max_model_len={length:,}"
    )
    if tokens < length:
        budget = "rollout.gpu_memory_utilization" if on_gpu else "rollout.kv_cache_gb"
        raise PlanDoesNotFit(
            _verdict(lines, "a rollout engine cannot hold one sequence of rollout.max_model_len")
            + f"; raise {budget} or rollout.tensor_parallel_size, or lower rollout.max_model_len"
        )


def largest_bucket_bytes(cfg: Config, shape: ModelShape) -> float:
    """A weight sync's largest bucket in the wire dtype (model.dtype): rollout.weight_bucket_mb,
    or the largest load unit where that is larger; with LoRA only the adapters travel."""
    wire = _DTYPE_BYTES[cfg.model.dtype]
    bucket = cfg.rollout.weight_bucket_mb * (1 << 20)
    lora = cfg.model.lora
    if lora.enabled:
        return min(bucket, wire * shape.num_adapter_params(lora.rank, lora.target_modules))
    return max(bucket, wire * shape.largest_load_unit)


def sync_buffers(cfg: Config, shape: ModelShape) -> tuple[float, float]:
    """(a trainer rank's, a rollout rank's) weight-sync buffers on GPUs, which stay allocated
    between syncs. Gathered (colocated, auto or asked for): two slots of the largest bucket,
    the all-gather's output and this rank's piece of it, on every trainer GPU, which the
    engine there reads. Distributed (NCCL): at most a bucket of pieces packed on a trainer
    rank, and on an engine rank the pieces received and the bucket they are laid out in."""
    bucket = largest_bucket_bytes(cfg, shape)
    transport = cfg.rollout.weight_transport
    if cfg.scheduler.placement == "colocate" and transport in ("auto", "gathered"):
        return (3 + 1 / cfg.trainer.num_workers) * bucket, 0.0
    if transport in ("auto", "distributed"):
        return bucket, 2 * bucket
    return 0.0, 0.0


def check_fits(
    cfg: Config,
    shape: ModelShape,
    device_bytes: float,
    on_gpu: bool,
    teacher_shape: ModelShape | None = None,
) -> str:
    """The estimate, one line a role, and the verdict; PlanDoesNotFit with the fix when the
    plan needs more than `device_bytes` per GPU (on_gpu) or in host memory (CPU: every
    rank of every role shares it). `teacher_shape`: the distillation teacher's, if any."""
    trainer = trainer_rank(cfg, shape, on_gpu=on_gpu)
    critic = trainer_rank(cfg, shape, "critic rank", on_gpu) if needs_critic(cfg) else None
    teacher = None if teacher_shape is None else teacher_rank(cfg, teacher_shape, on_gpu)
    rollout, cpu_reserve = rollout_rank(cfg, shape)
    lines = [trainer.describe()]
    for role in (critic, teacher):
        if role is not None:
            lines.append(role.describe())
    rollout_line = len(lines)
    lines.append(rollout.describe())
    # The critic trains after the policy and the teacher scores before it: their states stay
    # resident, micro-batches do not add up.
    trainer_side = trainer.total + (critic.resident if critic else 0)
    own_devices = teacher is not None and cfg.teacher.devices > 0
    if teacher is not None and not own_devices:
        trainer_side += teacher.resident
    if on_gpu:
        reserve = cfg.rollout.gpu_memory_utilization * device_bytes
        lines.append(
            f"vLLM reserves rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization} "
            f"of each device: {reserve / GIB:.2f} GiB"
        )
        if rollout.parts["weights"] >= reserve:
            raise PlanDoesNotFit(
                _verdict(lines, "the rollout engine's weights alone fill what vLLM reserves")
                + "; raise rollout.gpu_memory_utilization or rollout.tensor_parallel_size"
            )
        _check_kv_cache(cfg, shape, device_bytes, on_gpu, lines)
        colocated = cfg.scheduler.placement == "colocate"
        trainer_sync, rollout_sync = sync_buffers(cfg, shape)
        if trainer_sync:
            trainer.parts["weight-sync buffers"] = trainer_sync
            lines[0] = trainer.describe()
            trainer_side += trainer_sync
        if rollout_sync:
            # Outside vLLM's reserve: the engine's own memory beside it.
            rollout.parts["weight-sync buffers"] = rollout_sync
            lines[rollout_line] = rollout.describe()
        if not colocated and reserve + rollout_sync > device_bytes:
            raise PlanDoesNotFit(
                _verdict(
                    lines, "vLLM's reserve and the weight-sync buffers exceed a rollout device"
                )
                + "; lower rollout.gpu_memory_utilization or rollout.weight_bucket_mb"
            )
        if own_devices and teacher.total > device_bytes:
            raise PlanDoesNotFit(
                _verdict(lines, "a teacher rank exceeds a device of its own")
                + "; shard the teacher over more ranks (teacher.num_workers, teacher.devices)"
            )
        needed = trainer_side + (reserve + rollout_sync if colocated else 0)
        where = "a device shared by a trainer rank and vLLM" if colocated else "a trainer device"
    else:
        _check_kv_cache(cfg, shape, device_bytes, on_gpu, lines)
        needed = trainer.total * cfg.trainer.num_workers + cpu_reserve * cfg.rollout.num_workers
        if critic is not None:
            needed += critic.resident * cfg.critic_world_size()
        if teacher is not None:
            needed += teacher.resident * cfg.teacher_world_size()
        where = "host memory, shared by every rank"
    summary = f"{where}: {needed / GIB:.2f} GiB needed of {device_bytes / GIB:.2f} GiB"
    if needed > device_bytes:
        raise PlanDoesNotFit(
            _verdict(lines, f"does not fit, {summary}") + _suggestion(cfg, trainer)
        )
    return _verdict(lines, f"fits, {summary}")


def _verdict(lines: list[str], verdict: str) -> str:
    return "\n".join(["memory estimate per rank (GiB):", *(f"  {line}" for line in lines), verdict])


def _suggestion(cfg: Config, trainer: RoleMemory) -> str:
    """What shrinks the largest part of a trainer rank."""
    largest = max(trainer.parts, key=trainer.parts.get)
    if largest == "activations" and not cfg.trainer.activation_checkpointing:
        return "; set trainer.activation_checkpointing=true, or lower trainer.micro_batch_size"
    if largest == "activations":
        return (
            "; lower trainer.micro_batch_size or rollout.max_model_len, or raise "
            "trainer.sequence_parallel"
        )
    if largest == "attention mask":
        return (
            "; set trainer.share_prompts=false (shared-prompt rows carry a mask as wide as the "
            "row, squared), or lower rollout.max_model_len or the micro-batch"
        )
    if largest in ("params", "grads", "optimizer", "reference"):
        return (
            "; shard over more trainer ranks (trainer.num_workers), or lower "
            "rollout.gpu_memory_utilization to leave the trainer more"
        )
    return "; lower trainer.logprob_chunk_size or trainer.logprob_vocab_chunk_size"


def memory_report(cfg: Config, device_memory_gb: float | None) -> str:
    """`--dry-run`'s memory section against the devices told (`device_memory_gb` per GPU),
    else the GPU this machine has, else host memory; PlanDoesNotFit when it does not fit."""
    config_file = Path(cfg.model.path) / "config.json"
    if not config_file.is_file():
        return f"memory estimate: skipped, {config_file} is not here to read the model's sizes"
    shape = ModelShape.read(config_file.parent)
    if device_memory_gb is not None:
        device_bytes, on_gpu = device_memory_gb * GIB, True
        devices = f"GPUs of {device_memory_gb:g} GiB (--device-memory-gb)"
    elif (gpu := _visible_gpu()) is not None:
        (name, device_bytes), on_gpu = gpu, True
        devices = f"GPUs like this machine's {name} ({device_bytes / GIB:.1f} GiB)"
    else:
        device_bytes, on_gpu = psutil.virtual_memory().total, False
        devices = f"CPU, host memory {device_bytes / GIB:.1f} GiB"
    header = f"model: {shape.describe()}; devices: {devices}"
    lora = cfg.model.lora
    if lora.enabled:
        adapters = shape.num_adapter_params(lora.rank, lora.target_modules)
        header += f"\nLoRA: {adapters / 1e6:.2f}M adapter parameters train (rank {lora.rank})"
    teacher_shape = None
    if cfg.teacher.enabled:
        teacher_config = Path(cfg.teacher.path) / "config.json"
        if teacher_config.is_file():
            teacher_shape = ModelShape.read(teacher_config.parent)
            header += f"\nteacher: {teacher_shape.describe()}"
        else:
            header += f"\nteacher: left out, {teacher_config} is not here to read its sizes"
    longest = _describe_longest(cfg, shape, device_bytes, on_gpu, teacher_shape)
    try:
        verdict = check_fits(cfg, shape, device_bytes, on_gpu, teacher_shape)
    except PlanDoesNotFit as exc:
        raise PlanDoesNotFit(f"{exc}\n{longest}") from None
    return f"{header}\n{verdict}\n{longest}"


def longest_sample(
    cfg: Config,
    shape: ModelShape,
    device_bytes: float,
    on_gpu: bool,
    sequence_parallel: int,
    teacher_shape: ModelShape | None = None,
) -> int:
    """The largest rollout.max_model_len at which the plan fits (`check_fits`) with
    trainer.sequence_parallel = `sequence_parallel`; 0 when none does. Doubles, then
    bisects: it takes the estimate to grow with the length, as it does beyond the
    explicit product's few hundred positions on CPU (`_attention_parts`)."""
    trainer = cfg.trainer.model_copy(update={"sequence_parallel": sequence_parallel})

    def fits(length: int) -> bool:
        rollout = cfg.rollout.model_copy(update={"max_model_len": length})
        trial = cfg.model_copy(update={"trainer": trainer, "rollout": rollout})
        try:
            check_fits(trial, shape, device_bytes, on_gpu, teacher_shape)
        except PlanDoesNotFit:
            return False
        return True

    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:  # fits(low), not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _describe_longest(
    cfg: Config,
    shape: ModelShape,
    device_bytes: float,
    on_gpu: bool,
    teacher_shape: ModelShape | None,
) -> str:
    """The longest sample the plan fits without sequence parallelism and with the degree
    configured, and the engine's own bound."""
    degrees = sorted({1, cfg.trainer.sequence_parallel})
    if shape.num_heads % cfg.trainer.sequence_parallel:
        degrees = [1]  # trainer_rank says why the configured one cannot run
    found = [
        f"{longest_sample(cfg, shape, device_bytes, on_gpu, n, teacher_shape):,} tokens with "
        f"trainer.sequence_parallel={n}"
        for n in degrees
    ]
    engine = engine_kv_tokens(cfg, shape, device_bytes, on_gpu)
    return (
        f"longest sample the plan fits (rollout.max_model_len): {', '.join(found)}; a rollout "
        f"engine's KV cache alone holds one of {engine:,}"
    )


def _visible_gpu() -> tuple[str, int] | None:
    """(name, bytes) of CUDA device 0, or None; torch is imported only where a driver is."""
    if shutil.which("nvidia-smi") is None:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    properties = torch.cuda.get_device_properties(0)
    return properties.name, properties.total_memory
