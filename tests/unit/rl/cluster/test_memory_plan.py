"""The dry run's memory estimate: parameter counts of real HF architectures, and whether a
plan fits the devices it is told about, with a fix named when it does not; with sequence
parallelism, each rank's share and the longest sample a plan fits."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from rl.cluster.memory_plan import (
    GIB,
    ModelShape,
    PlanDoesNotFit,
    check_fits,
    largest_bucket_bytes,
    longest_sample,
    memory_report,
    teacher_rank,
    trainer_rank,
)
from rl.config import Config

# Qwen2.5-0.5B and -7B as their config.json describe them.
QWEN_05B = {
    "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}  # fmt: skip
QWEN_7B = {
    "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "tie_word_embeddings": False,
}  # fmt: skip
# Small real architectures, for counts against the models transformers and peft build.
QWEN2_TIED = Qwen2Config(
    vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
)  # fmt: skip
LLAMA_HEAD_DIM = LlamaConfig(
    vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=3, num_key_value_heads=1, head_dim=48,
)  # fmt: skip
# Qwen3-30B-A3B as its config.json describes it (Qwen publishes 30.5B parameters).
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "attention_bias": False, "tie_word_embeddings": False,
}  # fmt: skip
# Small mixtures of experts, for counts against the models transformers builds. The Qwen2-MoE
# has experts only in layer 1 of 4: layer 3 is in mlp_only_layers, layers 0 and 2 fall
# between every decoder_sparse_step-th.
MOE_CONFIGS = {
    "qwen3-moe": Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_experts=8, num_experts_per_tok=2,
    ),
    "qwen3-moe-attention-bias-tied": Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=1, attention_bias=True, tie_word_embeddings=True,
    ),
    "qwen2-moe-shared-expert-sparse-step": Qwen2MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=80, moe_intermediate_size=32,
        shared_expert_intermediate_size=112, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, num_experts=6, num_experts_per_tok=2, decoder_sparse_step=2,
        mlp_only_layers=[3],
    ),
    "qwen2-moe-no-qkv-bias": Qwen2MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=80, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, qkv_bias=False,
    ),
    "mixtral": MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2,
    ),
}  # fmt: skip


def _shape(tmp_path: Path, config: dict) -> ModelShape:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return ModelShape.read(tmp_path)


@pytest.mark.parametrize(
    "config",
    [
        QWEN2_TIED,
        Qwen2Config(
            vocab_size=384,
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=False,
        ),
        LLAMA_HEAD_DIM,
        LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            attention_bias=True,
        ),
    ],  # fmt: skip
    ids=["qwen2-tied", "qwen2-untied", "llama-head-dim", "llama-attention-bias"],
)
def test_parameter_count_matches_the_model_transformers_builds(config, tmp_path: Path) -> None:
    config.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert ModelShape.read(tmp_path).num_params == sum(p.numel() for p in model.parameters())


def test_qwen3_dense_parameter_count_includes_its_query_and_key_norms(tmp_path: Path) -> None:
    config = Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert ModelShape.read(tmp_path).num_params == sum(p.numel() for p in model.parameters())


def _active_params_of(model: torch.nn.Module) -> int:
    """A token's parameters in the HF model: all of them, less the routed experts it is not
    sent to (each sparse layer's fused expert tensors hold E experts; a token uses top-k)."""
    active = sum(p.numel() for p in model.parameters())
    for module in model.modules():
        if hasattr(module, "gate_up_proj") and hasattr(module, "down_proj"):
            num_experts = module.gate_up_proj.shape[0]
            per_expert = (module.gate_up_proj.numel() + module.down_proj.numel()) // num_experts
            active -= (num_experts - model.config.num_experts_per_tok) * per_expert
    return active


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_moe_total_and_active_parameters_match_the_model_transformers_builds(
    name: str, tmp_path: Path
) -> None:
    config = MOE_CONFIGS[name]
    config.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    shape = ModelShape.read(tmp_path)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert shape.num_active_params == _active_params_of(model)
    assert shape.num_active_params < shape.num_params


@pytest.mark.parametrize("architecture", ["qwen3_moe", "qwen2_moe"])
def test_the_mixtures_rl_build_base_makes_are_counted_as_transformers_builds_them(
    architecture: str, tmp_path: Path
) -> None:
    from rl.config import BaseBuildConfig
    from trainer.hf_model import new_model, train_tokenizer

    cfg = BaseBuildConfig(
        architecture=architecture, vocab_size=64, hidden_size=64, num_layers=2, num_heads=2,
        num_kv_heads=1, intermediate_size=96, num_experts=4, experts_per_token=2,
        moe_intermediate_size=32,
    )  # fmt: skip
    corpus = [f"{a}+{b}={a + b}" for a in range(30) for b in range(30)]
    model = new_model(cfg, train_tokenizer(corpus, 64), seed=0)
    model.config.save_pretrained(tmp_path)
    shape = ModelShape.read(tmp_path)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert shape.num_active_params == _active_params_of(model)


def test_mixtral_8x7b_has_its_published_total_and_active_parameters(tmp_path: Path) -> None:
    config = {
        "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
    }  # fmt: skip
    shape = _shape(tmp_path, config)
    # By hand: q and o (4096 x 4096), k and v (4096 x 1024), two norms, the router (8 x 4096),
    # and 8 experts (or the token's 2) of three 4096 x 14336 matrices; the embedding and head.
    common = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 2 * 4096 + 8 * 4096
    root = 2 * 32000 * 4096 + 4096
    assert shape.num_params == 32 * (common + 8 * 3 * 4096 * 14336) + root
    assert shape.num_active_params == 32 * (common + 2 * 3 * 4096 * 14336) + root
    # Mistral AI's announcement: 46.7B total, 12.9B used per token.
    assert (round(shape.num_params / 1e8), round(shape.num_active_params / 1e8)) == (467, 129)


def test_qwen3_30b_a3b_counts_every_expert_in_memory_and_gathers_a_layer_of_them(
    tmp_path: Path,
) -> None:
    shape = _shape(tmp_path, QWEN3_30B_A3B)
    # By hand, one layer: q and o (2048 x 4096), k and v (2048 x 512), q and k norms (128), two
    # norms, the router (128 x 2048) and 128 experts of three 2048 x 768 matrices.
    common = 2 * 2048 * 4096 + 2 * 2048 * 512 + 2 * 128 + 2 * 2048 + 128 * 2048
    layer = common + 128 * 3 * 2048 * 768
    root = 2 * 151936 * 2048 + 2048
    total = 48 * layer + root
    active = 48 * (common + 8 * 3 * 2048 * 768) + root
    assert (shape.num_params, shape.num_active_params) == (total, active)
    assert round(total / 1e8) == 305  # Qwen's model card: 30.5B
    parts = trainer_rank(_gpu_config(trainer={"activation_checkpointing": True}), shape).parts
    # Every expert's fp32 weights, gradients and AdamW moments, sharded over 8 ranks.
    assert parts["params"] + parts["grads"] + parts["optimizer"] == 16 * total / 8
    # zero3 gathers the root and two layers, each with all its experts, in bf16.
    assert parts["gathered"] == 2 * (root + 2 * layer)
    # A token's sparse layer saves the router's 128 logits and, for each of its 8 experts, its
    # copy of the token and output (2048 each) and gate, up, activation, product (768 each).
    per_layer = 5 * 2048 + 2 * 512 + 128 + 8 * (2 * 2048 + 4 * 768)
    assert parts["activations"] == 2 * 8 * 1536 * (48 * 2048 + per_layer)
    # A layer's fused expert tensors (gate/up and down of 128 experts) are one load unit,
    # larger than the 151936 x 2048 embedding: a weight sync's bucket holds them whole.
    assert largest_bucket_bytes(_gpu_config(), shape) == 2 * 128 * 3 * 768 * 2048
    # Over a group of 4 (4 key/value heads: none repeated), a rank runs a quarter of the
    # group's 8 x 1536 positions and keeps the other three quarters' router logits too (128
    # a position, in each of the 48 layers).
    sp4 = {"activation_checkpointing": True, "sequence_parallel": 4, "packing": True}
    parts = trainer_rank(_gpu_config(trainer=sp4), shape).parts
    gathered = 3 * 2 * 1536 * 128 * 48
    assert parts["activations"] == 2 * (2 * 1536 * (48 * 2048 + per_layer) + gathered)


def test_the_dry_run_says_total_and_active_parameters_of_a_mixture(tmp_path: Path) -> None:
    _shape(tmp_path, QWEN3_30B_A3B)
    cfg = _gpu_config(
        model={"path": str(tmp_path)},
        trainer={"activation_checkpointing": True},
        rollout={"num_workers": 4, "tensor_parallel_size": 2},
    )
    report = memory_report(cfg, device_memory_gb=141)
    # The counts of the test above, 30,532,122,624 and 3,353,032,704, in billions.
    assert report.startswith(
        "model: 30.532B total / 3.353B active parameters (128 experts, 8 a token)"
    )


def test_an_unknown_mixture_of_experts_is_refused_not_counted_as_dense(tmp_path: Path) -> None:
    config = {**QWEN_7B, "model_type": "deepseek_v3", "n_routed_experts": 256}
    with pytest.raises(ValueError, match="model_type 'deepseek_v3', which the memory estimate"):
        _shape(tmp_path, config)


def test_qwen2_5_0_5b_has_its_published_parameter_count(tmp_path: Path) -> None:
    assert _shape(tmp_path, QWEN_05B).num_params == 494_032_768


def _gpu_config(**sections: dict) -> Config:
    tree = {
        "model": {"path": "m", "dtype": "bfloat16"},
        "rollout": {"num_workers": 8, "gpu_memory_utilization": 0.4, "max_model_len": 1536},
        "trainer": {"num_workers": 8, "micro_batch_size": 8, "logprob_chunk_size": 4096},
        "algorithm": {"group_size": 8},
        "run": {"prompts_per_step": 128},
    }
    for section, values in sections.items():
        tree[section] = {**tree.get(section, {}), **values}
    return Config.model_validate(tree)


def test_activation_checkpointing_keeps_one_layer_of_activations(tmp_path: Path) -> None:
    shape = _shape(tmp_path, QWEN_05B)
    plain = trainer_rank(_gpu_config(), shape).parts["activations"]
    checkpointed = trainer_rank(
        _gpu_config(trainer={"activation_checkpointing": True}), shape
    ).parts["activations"]
    # Every layer's activations against each layer's input plus one layer's activations.
    per_layer = 5 * 896 + 2 * 128 + 4 * 4864
    assert plain == 2 * 8 * 1536 * 24 * per_layer
    assert checkpointed == 2 * 8 * 1536 * (24 * 896 + per_layer)


def test_sharding_over_more_ranks_divides_the_training_state(tmp_path: Path) -> None:
    shape = _shape(tmp_path, QWEN_7B)
    eight = trainer_rank(_gpu_config(), shape).parts
    sixteen = trainer_rank(_gpu_config(trainer={"num_workers": 16}), shape).parts
    # fp32 master weights, gradients and Adam's two moments: 16 bytes a parameter.
    assert eight["params"] + eight["grads"] + eight["optimizer"] == 16 * shape.num_params / 8
    assert sixteen["optimizer"] == eight["optimizer"] / 2
    assert sixteen["activations"] == eight["activations"]


def test_each_sharding_strategy_holds_its_own_share_of_the_state(tmp_path: Path) -> None:
    shape = _shape(tmp_path, QWEN_7B)
    state = {}
    for sharding, extra in (
        ("zero3", {}),
        ("zero2", {}),
        ("hybrid", {"shard_group_size": 4}),
        ("none", {}),
    ):
        parts = trainer_rank(_gpu_config(trainer={"sharding": sharding, **extra}), shape).parts
        state[sharding] = (parts["optimizer"], parts["gathered"])
    optimizer = 8 * shape.num_params
    assert [state[s][0] for s in ("zero3", "zero2", "hybrid", "none")] == [
        optimizer / 8,
        optimizer / 8,
        optimizer / 4,
        optimizer,
    ]
    # zero2 and none keep every layer gathered from forward to backward, in bf16
    assert state["zero2"][1] == state["none"][1] == 2 * shape.num_params
    assert state["zero3"][1] == state["hybrid"][1] < state["zero2"][1] / 4


def test_a_token_budget_sizes_the_activations(tmp_path: Path) -> None:
    shape = _shape(tmp_path, QWEN_05B)
    fixed = trainer_rank(_gpu_config(), shape).parts["activations"]
    budget = trainer_rank(_gpu_config(trainer={"micro_batch_tokens": 4 * 1536}), shape)
    assert budget.parts["activations"] == fixed / 2  # 4 x 1536 tokens against 8 x 1536


def test_a_plan_that_fits_says_how_much_it_needs(tmp_path: Path) -> None:
    report = check_fits(_gpu_config(), _shape(tmp_path, QWEN_05B), 80 * GIB, on_gpu=True)
    assert "trainer rank: params 0.23" in report
    assert "vLLM reserves rollout.gpu_memory_utilization=0.4 of each device: 32.00 GiB" in report
    assert report.splitlines()[-1].startswith("fits, a device shared by a trainer rank and vLLM")


def test_too_many_activations_are_refused_with_activation_checkpointing_as_the_fix(
    tmp_path: Path,
) -> None:
    shape = _shape(tmp_path, QWEN_7B)
    with pytest.raises(PlanDoesNotFit, match="set trainer.activation_checkpointing=true"):
        check_fits(_gpu_config(), shape, 80 * GIB, on_gpu=True)
    cfg = _gpu_config(trainer={"activation_checkpointing": True})
    assert "fits" in check_fits(cfg, shape, 80 * GIB, on_gpu=True).splitlines()[-1]
    # A smaller device leaves too little beside vLLM's share (engines of TP 2 to hold the
    # weights): the training state is the issue.
    cfg = _gpu_config(
        trainer={"activation_checkpointing": True},
        rollout={"num_workers": 4, "tensor_parallel_size": 2},
    )
    with pytest.raises(PlanDoesNotFit, match=r"of 32\.00 GiB; shard .*trainer\.num_workers"):
        check_fits(cfg, shape, 32 * GIB, on_gpu=True)


def test_gpus_hold_the_weight_transports_buffers_of_the_largest_load_unit(
    tmp_path: Path,
) -> None:
    shape = _shape(tmp_path, QWEN_7B)
    # Qwen2.5-7B's untied LM head, 152064 x 3584 in bf16, travels alone in a bucket.
    bucket = 2 * 152064 * 3584
    assert largest_bucket_bytes(_gpu_config(), shape) == bucket
    # Colocated: the gathered transport's two slots, the all-gather's output and this rank's
    # eighth of it, on every trainer GPU.
    cfg = _gpu_config(trainer={"activation_checkpointing": True})
    report = check_fits(cfg, shape, 80 * GIB, on_gpu=True)
    trainer = next(line for line in report.splitlines() if "trainer rank:" in line)
    assert f"weight-sync buffers {(3 + 1 / 8) * bucket / GIB:.2f}" in trainer
    # GPUs of their own (NCCL): a bucket of pieces on a trainer rank; the received pieces
    # and the bucket they are laid out in on an engine rank, beside vLLM's reserve.
    split = {"placement": "split", "rollout_devices": 8, "trainer_devices": 8}
    cfg = _gpu_config(trainer={"activation_checkpointing": True}, scheduler=split)
    lines = check_fits(cfg, shape, 80 * GIB, on_gpu=True).splitlines()
    trainer = next(line for line in lines if "trainer rank:" in line)
    assert f"weight-sync buffers {bucket / GIB:.2f}" in trainer
    rollout = next(line for line in lines if "rollout TP rank:" in line)
    assert f"weight-sync buffers {2 * bucket / GIB:.2f}" in rollout
    # vLLM's reserve plus them beyond a rollout device: refused, naming what to lower.
    cfg = _gpu_config(rollout={"gpu_memory_utilization": 0.99}, scheduler=split)
    with pytest.raises(PlanDoesNotFit, match="lower rollout.gpu_memory_utilization"):
        check_fits(cfg, shape, 80 * GIB, on_gpu=True)


def test_rollout_weights_beyond_the_vllm_reserve_are_refused(tmp_path: Path) -> None:
    cfg = _gpu_config(rollout={"gpu_memory_utilization": 0.1})
    with pytest.raises(PlanDoesNotFit, match="rollout.tensor_parallel_size"):
        check_fits(cfg, _shape(tmp_path, QWEN_7B), 80 * GIB, on_gpu=True)


def test_on_cpu_every_rank_shares_host_memory(tmp_path: Path) -> None:
    cfg = Config.model_validate(
        {
            "model": {"path": "m"},
            "rollout": {"kv_cache_gb": 2.0},
            "trainer": {"num_workers": 2, "micro_batch_size": 4},
        }
    )
    shape = _shape(tmp_path, QWEN_05B)
    report = check_fits(cfg, shape, 24 * GIB, on_gpu=False)
    assert "host memory, shared by every rank" in report.splitlines()[-1]
    with pytest.raises(PlanDoesNotFit, match="host memory"):
        check_fits(cfg, shape, 4 * GIB, on_gpu=False)


@pytest.mark.parametrize(
    ("config", "targets"),
    [
        (
            QWEN2_TIED,
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
        (
            LLAMA_HEAD_DIM,
            ["q_proj", "v_proj", "down_proj"],
        ),
    ],  # fmt: skip
    ids=["qwen2-all-linears", "llama-head-dim-three"],
)
def test_lora_adapter_count_matches_the_adapters_peft_adds(
    config, targets: list[str], tmp_path: Path
) -> None:
    from peft import LoraConfig, get_peft_model

    config.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=8, target_modules=targets))
    trainable, _ = peft_model.get_nb_trainable_parameters()
    assert ModelShape.read(tmp_path).num_adapter_params(8, targets) == trainable


@pytest.mark.parametrize("name", ["qwen2-moe-shared-expert-sparse-step", "mixtral"])
def test_lora_on_a_mixture_counts_adapters_on_the_linear_modules_each_layer_has(
    name: str, tmp_path: Path
) -> None:
    # gate/up/down_proj are linear modules in Qwen2-MoE's dense layers and shared experts
    # only: peft gives Mixtral's and these routed experts (fused tensors) no adapter.
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    MOE_CONFIGS[name].save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_config(MOE_CONFIGS[name], dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=8, target_modules=targets))
    trainable, _ = peft_model.get_nb_trainable_parameters()
    assert ModelShape.read(tmp_path).num_adapter_params(8, targets) == trainable


def test_lora_holds_the_frozen_base_once_and_trains_only_the_adapters(tmp_path: Path) -> None:
    shape = _shape(tmp_path, QWEN_7B)
    full = trainer_rank(_gpu_config(algorithm={"kl_coef": 0.01}), shape).parts
    lora = trainer_rank(
        _gpu_config(algorithm={"kl_coef": 0.01}, model={"lora": {"rank": 16}}), shape
    ).parts
    n = shape.num_params
    adapters = shape.num_adapter_params(
        16, Config.model_validate({"model": {"path": "m"}}).model.lora.target_modules
    )
    assert lora["params"] == 4 * (n + adapters) / 8
    assert lora["grads"] == 4 * adapters / 8
    assert lora["optimizer"] == 8 * adapters / 8
    assert full["reference"] == 4 * n / 8 and "reference" not in lora  # the base is the reference
    # The 7B plan a 32 GiB device cannot train in full fits with LoRA.
    sizes = {"rollout": {"num_workers": 4, "tensor_parallel_size": 2}}
    cfg = _gpu_config(trainer={"activation_checkpointing": True}, **sizes)
    with pytest.raises(PlanDoesNotFit):
        check_fits(cfg, shape, 32 * GIB, on_gpu=True)
    cfg = _gpu_config(
        trainer={"activation_checkpointing": True}, model={"lora": {"rank": 16}}, **sizes
    )
    assert check_fits(cfg, shape, 32 * GIB, on_gpu=True).splitlines()[-1].startswith("fits")
    other = _gpu_config(model={"lora": {"rank": 16, "target_modules": ["qkv_proj"]}})
    with pytest.raises(ValueError, match="names 'qkv_proj'.* linear modules are"):
        trainer_rank(other, shape)


def _needed_gib(report: str) -> float:
    return float(re.search(r"([\d.]+) GiB needed", report.splitlines()[-1])[1])


def test_a_distillation_teacher_holds_its_shard_beside_the_trainers_state(tmp_path: Path) -> None:
    student = _shape(tmp_path, QWEN_05B)
    (tmp_path / "teacher").mkdir()
    teacher = _shape(tmp_path / "teacher", QWEN_7B)
    distill = {"teacher": {"path": "t"}, "algorithm": {"group_size": 8, "distill_coef": 1.0}}
    cfg = _gpu_config(**distill)
    rank = teacher_rank(cfg, teacher)
    # Qwen2.5-7B's published 7.62B parameters in fp32, sharded over the 8 teacher ranks.
    assert rank.parts["params"] == 4 * 7_615_616_512 / 8
    alone = check_fits(_gpu_config(), student, 80 * GIB, on_gpu=True)
    beside = check_fits(cfg, student, 80 * GIB, on_gpu=True, teacher_shape=teacher)
    assert "teacher rank: params 3.55" in beside
    resident = (rank.total - rank.parts["activations"]) / GIB
    assert _needed_gib(beside) == pytest.approx(_needed_gib(alone) + resident, abs=0.011)


def test_a_teacher_on_devices_of_its_own_must_fit_one(tmp_path: Path) -> None:
    student = _shape(tmp_path, QWEN_05B)
    (tmp_path / "teacher").mkdir()
    teacher = _shape(tmp_path / "teacher", QWEN_7B)
    cfg = _gpu_config(
        teacher={"path": "t", "num_workers": 1, "devices": 1},
        algorithm={"group_size": 8, "distill_coef": 1.0},
        scheduler={"placement": "split"},
    )
    with pytest.raises(PlanDoesNotFit, match="a teacher rank exceeds a device of its own"):
        check_fits(cfg, student, 24 * GIB, on_gpu=True, teacher_shape=teacher)
    cfg.teacher.num_workers = cfg.teacher.devices = 4  # 7.6 GB of weights each
    check_fits(cfg, student, 24 * GIB, on_gpu=True, teacher_shape=teacher)


# Sequence parallelism. Qwen2.5-0.5B: 14 query heads and 2 key/value heads of 64, hidden 896,
# MLP 4864, 24 layers, vocabulary 151936. Over 7 ranks its key/value heads are repeated to
# lcm(2, 7) = 14 so that each rank gets whole heads.


def test_sequence_parallelism_gives_a_rank_its_share_of_the_positions_and_of_the_heads(
    tmp_path: Path,
) -> None:
    shape = _shape(tmp_path, QWEN_05B)
    packed = {"num_workers": 14, "packing": True, "micro_batch_tokens": 2048}
    one = trainer_rank(_gpu_config(trainer={**packed, "sequence_parallel": 1}), shape).parts
    seven = trainer_rank(_gpu_config(trainer={**packed, "sequence_parallel": 7}), shape).parts
    n = 494_032_768
    state = {"params": 4 * n / 14, "grads": 4 * n / 14, "optimizer": 8 * n / 14}
    # Without: a micro-batch of 2048 positions (rows of the 1536-token samples) on each rank.
    assert one == {
        **state,
        "gathered": one["gathered"],
        "activations": 2 * 2048 * 24 * (5 * 896 + 2 * 2 * 64 + 4 * 4864),
        "log-prob workspace": 4 * 2048 * 8192 * 3 + 4 * (2048 + 8192) * 896,
    }
    # With 7: the group's micro-batch holds 7 x 2048 positions in rows padded to 1540 (a
    # multiple of 7); a rank runs 2048 of them, its attention 2 of 14 heads over whole rows.
    assert seven == {
        **state,
        "gathered": one["gathered"],
        "activations": 2 * 2048 * 24 * (5 * 896 + 2 * 14 * 64 + 4 * 4864),
        "all-to-all buffers": 2 * 2048 * (14 + 2 * 14) * 64 * 2,
        # and the group's log-probs and entropies gathered, fp32
        "log-prob workspace": 4 * 2048 * 8192 * 3 + 4 * (2048 + 8192) * 896 + 2 * 4 * 7 * 2048,
    }
    with pytest.raises(PlanDoesNotFit, match=r"sequence_parallel=4 .* the model has 14"):
        trainer_rank(_gpu_config(trainer={**packed, "sequence_parallel": 4}), shape)


def test_the_critic_and_the_teacher_run_their_share_of_the_positions_too(
    tmp_path: Path,
) -> None:
    shape = _shape(tmp_path, QWEN_05B)
    sections = {"algorithm": {"advantage": "gae", "distill_coef": 1.0}, "teacher": {"path": "t"}}
    packed = {"num_workers": 14, "packing": True, "micro_batch_tokens": 2048}
    one, seven = (
        _gpu_config(trainer={**packed, "sequence_parallel": sp}, **sections) for sp in (1, 7)
    )
    critic = trainer_rank(seven, shape, "critic rank").parts
    # As the policy's (above): 2048 positions a rank, 2 of 14 heads, key/value heads repeated.
    assert critic["activations"] == 2 * 2048 * 24 * (5 * 896 + 2 * 14 * 64 + 4 * 4864)
    assert critic["all-to-all buffers"] == 2 * 2048 * (14 + 2 * 14) * 64 * 2
    # The teacher's forward keeps the hidden state and one layer's intermediates of each of
    # its 2048 positions (its own budget at degree 1; a seventh of its group's at 7).
    per_token = 896 + 5 * 896 + 4 * 4864
    teacher_one = teacher_rank(one, shape).parts
    teacher_seven = teacher_rank(seven, shape).parts
    assert teacher_one["activations"] == 2 * 2048 * (per_token + 2 * 2 * 64)
    assert teacher_seven["activations"] == 2 * 2048 * (per_token + 2 * 14 * 64)
    assert teacher_seven["all-to-all buffers"] == critic["all-to-all buffers"]


def test_a_sample_longer_than_the_token_budget_is_a_micro_batch_of_its_own(
    tmp_path: Path,
) -> None:
    shape = _shape(tmp_path, QWEN_05B)
    trainer = {"packing": True, "micro_batch_tokens": 1024, "activation_checkpointing": True}
    cfg = _gpu_config(trainer={**trainer, "sequence_parallel": 2}, rollout={"max_model_len": 5001})
    parts = trainer_rank(cfg, shape).parts
    # One row of 5002 positions (5001 padded to a multiple of 2): 2501 a rank.
    assert parts["activations"] == 2 * 2501 * (24 * 896 + 5 * 896 + 2 * 2 * 64 + 4 * 4864)
    assert "attention mask" not in parts  # packed rows attend without one


def test_on_cpu_short_half_precision_rows_hold_their_attention_scores(tmp_path: Path) -> None:
    shape = _shape(tmp_path, QWEN_05B)
    trainer = {"packing": True, "micro_batch_size": 2, "sequence_parallel": 2}
    short = _gpu_config(trainer=trainer, rollout={"max_model_len": 192})
    parts = trainer_rank(short, shape, on_gpu=False).parts
    # kernels.attention's explicit product: 2 rows x 7 heads x 192 x 192 scores a layer, saved
    # as fp32 softmax and its bf16 copy.
    assert parts["attention scores"] == 2 * 7 * 192 * 192 * (4 + 2) * 24
    long = _gpu_config(trainer=trainer, rollout={"max_model_len": 194})
    long = trainer_rank(long, shape, on_gpu=False)
    assert "attention scores" not in long.parts  # SDPA beyond 192 keys
    assert "attention scores" not in trainer_rank(short, shape).parts  # and on GPUs
    # Shared-prompt rows carry a mask: bool, and each layer's negation of it.
    shared = {**trainer, "share_prompts": True, "sequence_parallel": 1}
    shared = _gpu_config(trainer=shared, rollout={"max_model_len": 192})
    assert trainer_rank(shared, shape, on_gpu=False).parts["attention mask"] == 2 * 192 * 192 * 25


def test_a_rollout_engine_must_hold_one_sequence_of_max_model_len(tmp_path: Path) -> None:
    shape = _shape(tmp_path, QWEN_05B)
    cfg = Config.model_validate(
        {
            "model": {"path": "m", "dtype": "bfloat16"},
            "rollout": {"kv_cache_gb": 0.01, "max_model_len": 1536},
            "trainer": {"num_workers": 2, "micro_batch_size": 4},
        }
    )
    # A token's keys and values: 2 x 24 layers x 2 heads x 64 in bf16 = 12,288 bytes.
    held = int(0.01 * GIB // 12_288)
    with pytest.raises(
        PlanDoesNotFit, match=rf"(?s)holds at most {held:,} tokens.*raise rollout.kv_cache_gb"
    ):
        check_fits(cfg, shape, 64 * GIB, on_gpu=False)
    cfg.rollout.kv_cache_gb = 1.0
    report = check_fits(cfg, shape, 64 * GIB, on_gpu=False)
    assert f"holds at most {GIB // 12_288:,} tokens: {GIB // 12_288 // 1536} sequences" in report


def _longest_by_hand(shape: ModelShape, sp: int, device: float) -> int:
    """The longest sample of the plan `_long_sample_config` (one sample a micro-batch,
    checkpointed, on trainer GPUs of their own) by its parts written out for Qwen2.5-7B: hidden
    3584, MLP 18944, 28 layers, 28 heads and 4 key/value heads of 128, untied 152064 x 3584
    embedding and head. A row of W positions (a multiple of sp) costs a rank C + a W: its
    samples attend without a mask."""
    n, h, vocab = shape.num_params, 3584, 152064
    kv = math.lcm(4, sp)
    constant = (
        16 * n / 8  # fp32 parameters, gradients, AdamW's moments over 8 ranks
        + 2 * (shape.num_root_params + 2 * shape.num_layer_params)  # gathered in bf16
        + 4 * 8192 * 3
        + 4 * 8192 * h  # log-prob chunk (1 x 8192 columns), weight gradient
        + 2 * vocab * h  # the sync's bucket: the LM head
    )
    per_token = (
        2 * (28 * h + 5 * h + 2 * kv * 128 + 4 * 18944)  # checkpointed activations
        + (2 * (28 + 2 * kv) * 128 * 2 if sp > 1 else 0)  # all-to-all buffers
        + 4 * h  # the log-prob kernel's hidden gradient
    )
    linear = per_token / sp + (8 if sp > 1 else 0)  # + the gathered log-probs and entropies
    width = int((device - constant) / linear) // sp * sp
    while constant + linear * (width + sp) <= device:
        width += sp
    while constant + linear * width > device:
        width -= sp
    return width


def _long_sample_config(sp: int, path: str = "m") -> Config:
    return _gpu_config(
        model={"path": path},
        trainer={
            "packing": True,
            "micro_batch_size": 1,
            "activation_checkpointing": True,
            "logprob_chunk_size": 1,
            "sequence_parallel": sp,
        },
        rollout={"gpu_memory_utilization": 0.9},
        scheduler={"placement": "split", "rollout_devices": 8, "trainer_devices": 8},
    )


@pytest.mark.parametrize("sp", [1, 2, 4])
def test_the_longest_sample_is_the_longest_whose_per_rank_plan_fits(
    tmp_path: Path, sp: int
) -> None:
    shape = _shape(tmp_path, QWEN_7B)
    expected = _longest_by_hand(shape, sp, 80 * GIB)
    assert longest_sample(_long_sample_config(sp), shape, 80 * GIB, True, sp) == expected


def test_the_dry_run_says_the_longest_sample_without_and_with_sequence_parallelism(
    tmp_path: Path,
) -> None:
    shape = _shape(tmp_path, QWEN_7B)
    one, two = (_longest_by_hand(shape, sp, 80 * GIB) for sp in (1, 2))
    # The constant part (the sharded state, the gathered layers) keeps the gain below 2x.
    assert 1.5 * one < two < 2 * one
    report = memory_report(_long_sample_config(2, str(tmp_path)), device_memory_gb=80)
    assert report.splitlines()[-1].startswith(
        f"longest sample the plan fits (rollout.max_model_len): {one:,} tokens with "
        f"trainer.sequence_parallel=1, {two:,} tokens with trainer.sequence_parallel=2"
    )


def test_the_long_sample_recipe_fits_80_gib_gpus_with_its_sequence_parallelism_only(
    tmp_path: Path,
) -> None:
    from rl.config.recipe import load_config

    shape = _shape(tmp_path, QWEN_7B)
    recipe = Path(__file__).resolve().parents[4] / "recipes/gpu/dapo_qwen2.5_7b_long.yaml"
    cfg = load_config(recipe)
    assert (cfg.trainer.sequence_parallel, cfg.rollout.max_model_len) == (4, 131072)
    assert check_fits(cfg, shape, 80 * GIB, on_gpu=True).splitlines()[-1].startswith("fits")
    cfg.trainer.sequence_parallel = 1
    with pytest.raises(PlanDoesNotFit, match="does not fit"):
        check_fits(cfg, shape, 80 * GIB, on_gpu=True)


@pytest.mark.parametrize(
    ("width", "bytes_per_element"),
    # SDPA beyond 192 keys: an additive bf16 mask; the explicit product: 7 heads' fp32 and
    # bf16 scores, and the mask negated
    [(200, 2), (64, 7 * (4 + 2) + 1)],
    ids=["sdpa-mask-copy", "explicit-scores"],
)
def test_the_attention_bytes_counted_are_what_tandems_attention_saves_for_backward(
    width: int, bytes_per_element: int
) -> None:
    """Measured: the [width, width] tensors a bf16 CPU attention call over 2 packed rows saves
    for its backward, beyond the boolean mask, against the plan's per layer and mask element
    (`test_on_cpu_short_half_precision_rows_hold_their_attention_scores`)."""
    from kernels.attention import attention

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 1, True
    q, k, v = (
        torch.randn(2, 7, width, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    mask = torch.ones(2, 1, width, width, dtype=torch.bool).tril()
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if tensor.shape[-2:] == (width, width) and storage.data_ptr() != mask.data_ptr():
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        attention(module, q, k, v, mask)
    assert sum(saved.values()) == 2 * width * width * bytes_per_element
