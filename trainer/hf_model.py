"""Hugging Face building blocks: a locally trained tokenizer, a fresh decoder, atomic saves.

There is no model hub here, so the tiny "pretrained" checkpoints of the CPU recipes and the
tests are made from these pieces; real runs point `model.path` at any local HF directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from rl.config import BaseBuildConfig, LoraConfig

SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|user|>", "<|assistant|>"]
# User turn, then the assistant's answer ended by EOS; generation starts after <|assistant|>.
# For agents: the tools' names in a first user turn, and each tool result as a user turn in
# <tool_response> tags (as Qwen2.5 renders them); assistant tool calls are plain content.
CHAT_TEMPLATE = (
    "{% if tools %}<|user|>tools:{% for t in tools %} "
    "{{ t['function']['name'] if 'function' in t else t['name'] }}{% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|endoftext|>"
    "{% elif m['role'] == 'tool' %}<|user|><tool_response>{{ m['content'] }}</tool_response>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `texts`, digits always split one per token.

    Splitting digits keeps arithmetic learnable for a tiny model (as Llama and Qwen do).
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|endoftext|>",
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


# base.architecture -> the HF config and model classes `new_model` builds.
ARCHITECTURES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
}


def _architecture_sizes(cfg: BaseBuildConfig) -> dict:
    """The HF config keys of `cfg.architecture` beyond a dense decoder's."""
    if cfg.architecture == "qwen2":
        return {}
    if not 1 <= cfg.experts_per_token <= cfg.num_experts:
        raise ValueError(
            f"base.experts_per_token={cfg.experts_per_token} must be between 1 and "
            f"base.num_experts={cfg.num_experts}"
        )
    experts = {
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "decoder_sparse_step": 1,  # experts in every layer
        "mlp_only_layers": [],
    }
    if cfg.architecture == "qwen3_moe":
        # Qwen3-MoE renormalises the top-k gate weights, and sets head_dim on its own.
        return {**experts, "norm_topk_prob": True, "head_dim": cfg.hidden_size // cfg.num_heads}
    return {**experts, "shared_expert_intermediate_size": cfg.intermediate_size}


def new_model(
    cfg: BaseBuildConfig, tokenizer: PreTrainedTokenizerFast, seed: int
) -> PreTrainedModel:
    """A randomly initialised decoder of `cfg.architecture` sized by `cfg`, with its vocabulary
    padded to a multiple of 64."""
    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(
            f"base.hidden_size={cfg.hidden_size} is not divisible by base.num_heads={cfg.num_heads}"
        )
    head_dim = cfg.hidden_size // cfg.num_heads
    if head_dim < 32:
        raise ValueError(
            f"base.hidden_size / base.num_heads = {head_dim}; vLLM's CPU attention needs head_dim >= 32: "
            "raise base.hidden_size or lower base.num_heads"
        )
    config_class, model_class = ARCHITECTURES[cfg.architecture]
    config = config_class(
        vocab_size=-(-len(tokenizer) // 64) * 64,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **_architecture_sizes(cfg),
    )
    torch.manual_seed(seed)
    return model_class(config)


def write_dir_atomic(path: str | Path, write: Callable[[Path], None]) -> Path:
    """`write(directory)` into a sibling temporary directory, renamed to `path` once complete:
    a crash never leaves a half-written directory at `path`, and an existing `path` is
    replaced only then."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide the model from a server run as another user
    try:
        write(tmp)
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            path.rename(old)
        tmp.rename(path)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def save_hf_atomic(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    path: str | Path,
    state_dict: dict[str, torch.Tensor] | None = None,
    extra_files: dict[str, str] | None = None,
    write_more: Callable[[Path], None] | None = None,
) -> Path:
    """Write config, safetensors, tokenizer and generation config to `path` atomically
    (`write_dir_atomic`). `extra_files` maps file names to text written alongside (e.g. build
    metadata); `write_more(directory)` writes anything else into it."""

    def write(directory: Path) -> None:
        model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(directory)
        for name, text in (extra_files or {}).items():
            (directory / name).write_text(text)
        if write_more is not None:
            write_more(directory)

    return write_dir_atomic(path, write)


ADAPTER_DIR = "adapter"  # where an exported LoRA policy keeps its adapters alone


def adapter_file_tensors(
    model_dir: str | Path, cfg: LoraConfig, tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """A LoRA policy's adapters, `tensors` under its parameter names, keyed as PEFT's adapter
    file keys them: peft's `get_peft_model_state_dict` over the model of `model_dir`'s config
    with `cfg`'s adapters, built on meta (no weight is read). ValueError naming a tensor that
    is not one of those adapters, or an adapter that `tensors` lacks."""
    from peft import get_peft_model_state_dict

    from trainer.rank_local_load import LORA_ADAPTERS, meta_causal_lm, meta_lora

    model = meta_lora(meta_causal_lm(str(model_dir)), cfg)
    adapters = {n for n, _ in model.named_parameters() if any(a in n for a in LORA_ADAPTERS)}
    if extra := sorted(tensors.keys() - adapters):
        raise ValueError(f"{extra[0]} is not a LoRA adapter of the model of {model_dir}")
    if missing := sorted(adapters - tensors.keys()):
        raise ValueError(f"the LoRA adapter {missing[0]} is missing")
    return get_peft_model_state_dict(model, state_dict=tensors)


def write_adapter(directory: Path, tensors: dict[str, torch.Tensor], config: object) -> None:
    """LoRA adapters in PEFT's format into `directory`: adapter_model.safetensors (peft's
    names, as `get_peft_model_state_dict` gives them) and `config` (peft's LoraConfig,
    naming the base in base_model_name_or_path) as adapter_config.json."""
    from safetensors.torch import save_file

    directory.mkdir(exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, directory / "adapter_model.safetensors"
    )
    config.save_pretrained(directory)


def save_lora_hf_atomic(
    peft_model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, path: str | Path
) -> Path:
    """A LoRA policy (a peft model on CPU holding the trained adapters; merged here, so it is
    spent) as an HF model at `path`, atomically: the base with the adapters merged in, which
    transformers, vLLM and `rl eval` load like any model, and under path/adapter the adapters
    alone in PEFT's format, for `PeftModel.from_pretrained(base, path / "adapter")` or a
    vLLM `LoRARequest` over the base."""
    from peft import get_peft_model_state_dict

    adapter = get_peft_model_state_dict(peft_model)
    adapter_config = peft_model.peft_config["default"]
    merged = peft_model.merge_and_unload()
    return save_hf_atomic(
        merged,
        tokenizer,
        path,
        write_more=lambda directory: write_adapter(
            directory / ADAPTER_DIR, adapter, adapter_config
        ),
    )
