"""FSDP2 wrapping of an HF causal LM whose forward returns per-token log-probs, never logits."""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM, PreTrainedModel

from kernels import logprobs, naive_logprobs
from rl.config import ModelConfig, TrainerConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_IGNORE = -100  # target id of padding positions


class LogProbModel(nn.Module):
    """An HF causal LM (`self.model`) whose forward yields (logprob, entropy) per target token.

    The decoder produces hidden states and the fused kernel applies the LM head chunk by chunk,
    so the [B, T, V] logits never exist. This module is the FSDP root: the root's forward
    unshards everything not in a decoder layer (embeddings, final norm, lm_head) around it.
    """

    def __init__(self, model: PreTrainedModel, cfg: TrainerConfig) -> None:
        super().__init__()
        self.model = model
        self.cfg = cfg

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, attention_mask [B, T] -> (logprob, entropy) [B, T-1] fp32.

        Position t scores input_ids[:, t+1] under softmax(logits_t / temperature); padding
        targets are skipped by the kernel and score 0.
        """
        out = self.model.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        )
        targets = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, _IGNORE)
        args = (out.last_hidden_state[:, :-1], self.model.get_output_embeddings().weight, targets)
        if self.cfg.logprob_impl == "naive":
            return naive_logprobs(*args, temperature, _IGNORE)
        return logprobs(
            *args,
            temperature,
            _IGNORE,
            chunk_size=self.cfg.logprob_chunk_size,
            vocab_chunk_size=self.cfg.logprob_vocab_chunk_size,
        )


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


def shard_with_fsdp(
    root: nn.Module,
    layers: nn.ModuleList,
    mesh: DeviceMesh,
    dtype: str,
    activation_checkpointing: bool = False,
) -> None:
    """FSDP2 `fully_shard` on each decoder layer, then on `root` (everything else).

    Parameters stay fp32 (the optimizer's master copy) and are cast to `dtype` for compute;
    gradients are reduced in fp32.
    """
    policy = MixedPrecisionPolicy(param_dtype=_DTYPES[dtype], reduce_dtype=torch.float32)
    if activation_checkpointing:
        checkpoint_activations(layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(root, mesh=mesh, mp_policy=policy)
    assert isinstance(root, FSDPModule)


def load_sharded(
    cfg: ModelConfig, trainer_cfg: TrainerConfig, mesh: DeviceMesh, trainable: bool
) -> LogProbModel:
    """Load `cfg.path` in fp32 and shard it with FSDP2 (`shard_with_fsdp`).

    Every rank loads the full checkpoint to CPU before sharding (fine for models that fit in
    host memory once per rank).
    """
    model = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=torch.float32)
    layers = decoder_layers(model, f"model.path={cfg.path!r}")
    # Dropout would make the recomputed log-probs differ from the old ones at ratio 1.
    model.eval()
    model.requires_grad_(trainable)
    if trainable:
        for name in cfg.frozen_names([name for name, _ in model.named_parameters()]):
            model.get_parameter(name).requires_grad_(False)
    wrapper = LogProbModel(model, trainer_cfg)
    # A frozen model runs under no_grad: it saves no activations to recompute.
    checkpointed = trainable and trainer_cfg.activation_checkpointing
    shard_with_fsdp(wrapper, layers, mesh, cfg.dtype, checkpointed)
    return wrapper
