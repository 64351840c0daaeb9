"""FSDP2 wrapping of an HF causal LM whose forward returns per-token log-probs, never logits."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from transformers import PreTrainedModel

from kernels import logprobs, naive_logprobs
from rl.config import LoraConfig, ModelConfig, TrainerConfig
from rl.expert_routing import ExpertRouting, moe_routers
from trainer.packing import IGNORE, ModelInput
from trainer.rank_local_load import (
    LORA_ADAPTERS,
    init_lora_adapters,
    materialize,
    meta_causal_lm,
    meta_lora,
)
from trainer.sequence_parallel import (
    SequenceParallel,
    chunk_of,
    gather_router_calls,
    prepare_model,
    run_decoder,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LogProbModel(nn.Module):
    """An HF causal LM (`self.model`) whose forward yields (logprob, entropy) per target token.

    The decoder produces hidden states and the fused kernel applies the LM head chunk by chunk,
    so the [B, T, V] logits never exist. This module is the FSDP root: the root's forward
    unshards everything not in a decoder layer (embeddings, final norm, lm_head) around it.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        cfg: TrainerConfig,
        sequence_parallel: SequenceParallel | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.cfg = cfg
        # A mixture of experts: hooks on its routers replay the inputs' recorded experts and
        # keep each layer's last router call (logits, natural and used experts).
        self.routing = ExpertRouting(model) if moe_routers(model) else None
        # trainer.sequence_parallel > 1: this rank's group (`prepare_model` switched the
        # model's attention to the sequence-parallel one).
        self.sequence_parallel = sequence_parallel

    def forward(self, inputs: ModelInput, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprob, entropy) [B, T-1] fp32 of the micro-batch `inputs` was built from.

        Position t scores input_ids[:, t+1] under softmax(logits_t / temperature); padding
        targets are skipped by the kernel and score 0. A mixture of experts routes each
        position to `inputs.routing`'s experts where it has them, and its router calls are
        the whole micro-batch's under sequence parallelism too.

        Under sequence parallelism the decoder and the kernel run on this rank's chunk of
        every packed row (`trainer.sequence_parallel`), and every rank of the group returns
        the whole micro-batch's results.
        """
        sp = self.sequence_parallel
        if self.routing is not None:
            routing = inputs.routing
            if routing is not None and sp is not None:  # the record of this rank's positions
                routing = chunk_of(routing, sp.rank, sp.size)
            self.routing.replay = None if routing is None else routing.flatten(0, 1).long()
        score = functools.partial(self._score, temperature=temperature)
        logprob, entropy = run_decoder(self.model.get_decoder(), inputs, sp, score)
        if self.routing is not None and sp is not None:
            rows = inputs.input_ids.shape[0]
            self.routing.calls = gather_router_calls(self.routing.calls, rows, sp)
        return logprob, entropy

    def _score(
        self, hidden: torch.Tensor, targets: torch.Tensor, *, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprob, entropy) of `targets` from the decoder's outputs `hidden` at the
        positions that score them (their shape and a hidden size), 0 at IGNORE."""
        args = (hidden, self.model.get_output_embeddings().weight, targets)
        if self.cfg.logprob_impl == "naive":
            logprob, entropy = naive_logprobs(*args, temperature, IGNORE)
        else:
            logprob, entropy = logprobs(
                *args,
                temperature,
                IGNORE,
                chunk_size=self.cfg.logprob_chunk_size,
                vocab_chunk_size=self.cfg.logprob_vocab_chunk_size,
            )
        return logprob, entropy


def decoder_layers(model: PreTrainedModel, source: str) -> nn.ModuleList:
    """The decoder's layer list (Llama/Qwen-style), each an FSDP unit; `source` names the
    checkpoint (e.g. "model.path='...'") in the error when there is none."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{source}: expected a decoder with a `layers` ModuleList (Llama/Qwen-style), "
            f"got {type(model).__name__}"
        )
    return layers


def checkpoint_activations(layers: nn.ModuleList) -> None:
    """Make each layer recompute its forward during backward, keeping only its inputs.

    The layer's own forward is wrapped on the instance (not in a wrapper module), so parameter
    names, checkpoints and weight sync see the same model. Under FSDP2 the recompute runs
    after the layer's pre-backward unshard, as torchtitan's per-layer checkpointing does.
    """
    for layer in layers:

        def checkpointed(*args: object, _forward=layer.forward, **kwargs: object) -> object:
            return torch.utils.checkpoint.checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = checkpointed


def check_cpu_compiler() -> None:
    """ValueError when Inductor finds no C++ compiler for its CPU kernels, which it would
    otherwise report at the first forward, deep in a traceback."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as exc:
        raise ValueError(
            f"trainer.compile=true on CPU needs a C++ compiler for torch.compile's kernels, "
            f"and none was found on this node ({exc}): install g++ (or point $CXX at one), or "
            "set trainer.compile=false"
        ) from None


def compile_layers(layers: nn.ModuleList) -> None:
    """torch.compile each layer's forward, on the instance as `checkpoint_activations` wraps
    it: parameter names stay those of the checkpoint, and FSDP2's hooks on the layer run
    outside the compiled code.

    Shapes are specialised on the first micro-batch; the first micro-batch of another shape
    recompiles with its batch and length dimensions symbolic, and that graph serves every
    later shape and layer (dynamic=True from the start also makes the hidden sizes symbolic,
    and its kernels run slower on CPU).
    """
    for layer in layers:
        layer.forward = torch.compile(layer.forward)


# Whether a decoder layer frees its gathered parameters after forward (gathering them again for
# backward) or keeps them until backward: ZeRO-3 trades the second all-gather for memory.
_RESHARD_AFTER_FORWARD = {"zero3": True, "zero2": False, "hybrid": True, "none": False}


def sharding_mesh(device_type: str, world_size: int, cfg: TrainerConfig) -> DeviceMesh:
    """The device mesh `cfg.sharding` shards over (a collective: every rank builds it).

    zero3 and zero2 shard over all ranks (1-D). hybrid is a 2-D mesh (replicate, shard):
    parameters are sharded within groups of `cfg.shard_group_size` consecutive ranks (a node)
    and replicated across groups, so gradients reduce-scatter within a group and all-reduce
    across groups. none is the same 2-D mesh with groups of one: every rank holds the whole
    model, as DDP does.

    With sequence parallelism (`trainer.sequence_parallel`) the mesh is the same, every rank
    of every group in it (dp x sp, as torchtitan shards over dp_shard x cp): a group's ranks
    hold the same parameters and each one's gradient is its own positions' share, which the
    reduce over every rank adds up, and their shards divide the state by N more.
    """
    if cfg.sharding in ("zero3", "zero2"):
        return init_device_mesh(device_type, (world_size,))
    shard = cfg.shard_group_size if cfg.sharding == "hybrid" else 1
    assert world_size % shard == 0, "checked by rl.config.recipe.check_consistency"
    return init_device_mesh(
        device_type, (world_size // shard, shard), mesh_dim_names=("replicate", "shard")
    )


def num_replicas(mesh: DeviceMesh) -> int:
    """How many ranks hold each shard: the replicate dimension of a 2-D mesh, else 1."""
    return mesh.size(0) if mesh.ndim == 2 else 1


def offload_policy(offload: bool, device_type: str) -> OffloadPolicy:
    """FSDP2's CPU offload when asked for on a GPU; on CPU the state is in host memory already,
    and `OffloadPolicy()` is FSDP2's no-offload default."""
    return CPUOffloadPolicy() if offload and device_type == "cuda" else OffloadPolicy()


def storage_device(cfg: TrainerConfig, mesh: DeviceMesh) -> str:
    """Where FSDP2 keeps a rank's shards: host memory under CPU offload, else the mesh's device."""
    offloaded = isinstance(offload_policy(cfg.offload, mesh.device_type), CPUOffloadPolicy)
    return "cpu" if offloaded else mesh.device_type


def shard_with_fsdp(
    root: nn.Module,
    layers: nn.ModuleList,
    mesh: DeviceMesh,
    dtype: str,
    cfg: TrainerConfig,
    activation_checkpointing: bool = False,
) -> None:
    """FSDP2 `fully_shard` on each decoder layer, then on `root` (everything else).

    Parameters stay fp32 (the optimizer's master copy) and are cast to `dtype` for compute;
    gradients are reduced in fp32. With `cfg.offload` on a GPU, the sharded parameters,
    gradients and optimizer state live in CPU memory and are copied to the GPU per layer
    (on CPU they are in CPU memory already). With `cfg.compile`, each layer's forward is
    compiled (`compile_layers`), activation checkpointing included.
    """
    policy = MixedPrecisionPolicy(param_dtype=_DTYPES[dtype], reduce_dtype=torch.float32)
    offload = offload_policy(cfg.offload, mesh.device_type)
    if activation_checkpointing:
        checkpoint_activations(layers)
    if cfg.compile:
        if mesh.device_type == "cpu":
            check_cpu_compiler()
        compile_layers(layers)
    reshard = _RESHARD_AFTER_FORWARD[cfg.sharding]
    for layer in layers:
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=policy,
            offload_policy=offload,
            reshard_after_forward=reshard,
        )
    fully_shard(root, mesh=mesh, mp_policy=policy, offload_policy=offload)
    assert isinstance(root, FSDPModule)


def reshard(model: nn.Module) -> None:
    """Free every gathered parameter of `model`'s FSDP modules: after a forward without
    backward, the root (and under zero2 or none every layer) still holds them."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def with_lora(model: PreTrainedModel, cfg: LoraConfig, seed: int) -> nn.Module:
    """`model` with peft LoRA adapters on `cfg.target_modules`: only they train (peft freezes
    the rest), and the base with the adapters disabled is the frozen reference. Each adapter's
    B starts at zero, so the policy starts as the base. The layers stay the model's own
    modules (peft replaces the targeted linears inside them), so `decoder_layers` found before
    still names the FSDP units. The A matrices are drawn from `seed`: every rank draws the
    same ones, and FSDP2 keeps each rank's shard of them."""
    from peft import get_peft_model

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return get_peft_model(model, cfg.peft_config())


@contextlib.contextmanager
def adapter_dropout(model: nn.Module) -> Iterator[None]:
    """LoRA's dropout on for a training forward and its backward: peft's `lora_dropout`
    modules in training mode, the rest of the model left in eval mode (its log-probs must
    equal the engines'). The masks come from the rank's torch generator, which checkpoints
    save and resumes restore."""
    dropouts = [
        module
        for name, module in model.named_modules()
        if ".lora_dropout." in name and isinstance(module, nn.Dropout)
    ]
    for module in dropouts:
        module.train()
    try:
        yield
    finally:
        for module in dropouts:
            module.eval()


def load_sharded(
    cfg: ModelConfig,
    trainer_cfg: TrainerConfig,
    mesh: DeviceMesh,
    trainable: bool,
    seed: int = 0,
    sequence_parallel: SequenceParallel | None = None,
) -> LogProbModel:
    """`cfg.path` in fp32, sharded with FSDP2 (`shard_with_fsdp`), each rank reading only its
    own rows of the checkpoint (`trainer.rank_local_load`); trainable with `cfg.lora` on: its
    adapters only, drawn from `seed` as `with_lora` draws them. With `sequence_parallel`, run
    by this rank's group (ValueError when the model cannot be: `prepare_model`); the
    parameters are sharded over `mesh` all the same, every rank of every group."""
    model = meta_causal_lm(cfg.path)
    layers = decoder_layers(model, f"model.path={cfg.path!r}")
    if sequence_parallel is not None:
        prepare_model(model, sequence_parallel.size, f"model.path={cfg.path!r}")
    model.requires_grad_(trainable)
    if trainable:
        for name in cfg.frozen_names([name for name, _ in model.named_parameters()]):
            model.get_parameter(name).requires_grad_(False)
    lora = trainable and cfg.lora.enabled
    wrapper = LogProbModel(
        meta_lora(model, cfg.lora) if lora else model, trainer_cfg, sequence_parallel
    )
    # Eval mode, the adapters peft just added included (new modules start in training mode):
    # dropout would make a log-prob pass noisy and draw from the generator. A training
    # forward turns the adapters' dropout on for itself alone (`adapter_dropout`).
    wrapper.eval()
    # A frozen model runs under no_grad: it saves no activations to recompute.
    checkpointed = trainable and trainer_cfg.activation_checkpointing
    shard_with_fsdp(wrapper, layers, mesh, cfg.dtype, trainer_cfg, checkpointed)
    materialize(wrapper, model, cfg.path, storage_device(trainer_cfg, mesh), skip=LORA_ADAPTERS)
    if lora:
        init_lora_adapters(wrapper.model, cfg.path, cfg.lora, seed)
    return wrapper
