"""Weight sync of mixtures of experts on real components: a 2-rank FSDP2 trainer group (gloo),
holding each layer's experts fused (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj`
[E, H, I]) and sharded by expert, streams them into vLLM's fused-MoE layers at TP 1 and TP 2,
for Qwen3-MoE and Qwen2-MoE (a shared expert and its sigmoid gate), over shared memory and over
the gloo transport (where each TP rank receives only its regions' bytes).

After a large update the engine's log-probs equal those of transformers' own forward of the
updated weights (the trainer's HF export, loaded with `from_pretrained`) to fp32 rounding."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from rl.cluster.reservation import Placement, reserve
from rl.cluster.rollout_replicas import RolloutReplicas
from rl.cluster.trainer_ranks import PolicyRanks
from rl.config import Config
from rl.config.safetensors_files import checkpoint_tensors
from rl.sync.weight_sync import WeightSync
from rl.types import Batch
from tests.helpers.models import build_moe_checkpoint

pytestmark = pytest.mark.integration

# name: (arch, TP, transport, LoRA rank: 0 = off, engine). Qwen2-MoE's shared expert and its
# gate, reached by vLLM's layer by a second path, at TP 2 only: TP 1 adds no case to it.
SETUPS = {
    "qwen3_moe-tp1": ("qwen3_moe", 1, "auto", 0, "vllm"),
    "qwen3_moe-tp2-gloo": ("qwen3_moe", 2, "distributed", 0, "vllm"),
    "qwen2_moe-tp2": ("qwen2_moe", 2, "auto", 0, "vllm"),
    # LoRA's default targets: the attention's linears and (peft's own mapping of gate/up/down)
    # the fused experts. vLLM on CPU serves no LoRA on a mixture of experts (with LoRA on, its
    # MoE layers run Triton kernels): the PyTorch engine serves the adapters.
    "qwen3_moe-torch-lora": ("qwen3_moe", 1, "auto", 8, "torch"),
}
# build_moe_checkpoint's vocabulary is 64 tokens.
SEQUENCES = torch.randint(4, 64, (4, 24), generator=torch.Generator().manual_seed(1)).tolist()
TOLERANCE = 1e-4  # fp32 on both sides: rounding alone


@dataclass
class Setup:
    name: str
    cfg: Config
    placement: Placement
    rollout: RolloutReplicas
    trainers: PolicyRanks
    sync: WeightSync
    model_dir: Path


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module", params=list(SETUPS))
def setup(request: pytest.FixtureRequest, ray_cluster: None, tmp_path_factory):
    arch, tp, transport, lora_rank, engine = SETUPS[request.param]
    model_dir = build_moe_checkpoint(tmp_path_factory.mktemp("moe") / arch, arch)
    cfg = Config.model_validate(
        {
            "model": {"path": str(model_dir), "dtype": "float32", "lora": {"rank": lora_rank}},
            "rollout": {
                "engine": engine,
                "num_workers": 1,
                "tensor_parallel_size": tp,
                "kv_cache_gb": 0.0625,
                "max_model_len": 64,
                # Smaller than one layer's experts: each layer's experts travel in a bucket
                # of their own.
                "weight_bucket_mb": 0.02,
                "weight_transport": transport,
            },
            "trainer": {"num_workers": 2, "lr": 1e-2},
            "run": {"verbose": True},
        }
    )
    placement = reserve(cfg)
    sharing = placement.plan.num_roles_sharing
    rollout = RolloutReplicas(cfg, placement, sharing)
    trainers = PolicyRanks(cfg, placement, sharing)
    sync = WeightSync(cfg, trainers, rollout)
    try:
        yield Setup(request.param, cfg, placement, rollout, trainers, sync, model_dir)
    finally:
        sync.close()
        rollout.close()
        for actor in rollout.workers + trainers.workers:
            ray.kill(actor)
        placement.release()


def _batch() -> Batch:
    ids = torch.tensor(SEQUENCES)
    ones = torch.ones(ids.shape[0], ids.shape[1] - 1)
    return Batch(ids, torch.ones_like(ids), ones, ones, ones, ones)


def _large_update(setup: Setup) -> None:
    """Three AdamW steps at lr 1e-2 on random advantages: every trained weight moves."""
    batch = _batch()
    batch.old_logprobs = batch.behaviour_logprobs = setup.trainers.compute_logprobs(batch)
    batch.advantages = torch.randn(
        batch.num_sequences, 1, generator=torch.Generator().manual_seed(0)
    )
    batch.advantages = batch.advantages * batch.loss_mask
    for _ in range(3):
        setup.trainers.train_step(batch)


@torch.no_grad()
def _hf_logprobs(model_dir: Path) -> torch.Tensor:
    """transformers' own log-probs (T = 1) of SEQUENCES' tokens after the first, [4, 23]."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(SEQUENCES)
    logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)


def _gap(setup: Setup, reference: torch.Tensor) -> float:
    """The largest |log-prob gap| between the engine and `reference` over SEQUENCES."""
    worker = setup.rollout.workers[0]
    scored = ray.get(worker.score.remote(SEQUENCES, [1] * len(SEQUENCES)))
    return max((torch.tensor(s) - reference[i]).abs().max().item() for i, s in enumerate(scored))


def test_engine_logprobs_equal_transformers_on_the_updated_experts(setup: Setup) -> None:
    base = _hf_logprobs(setup.model_dir)
    assert _gap(setup, base) < TOLERANCE
    _large_update(setup)
    exported = Path(tempfile.mkdtemp(dir=setup.model_dir.parent)) / "updated"
    setup.trainers.export_hf(exported)
    # As save_pretrained writes a mixture of experts: a tensor per expert and projection.
    on_disk = checkpoint_tensors(exported)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in on_disk
    assert not any(name.endswith(("gate_up_proj", "experts.down_proj")) for name in on_disk)
    updated = _hf_logprobs(exported)
    assert (updated - base).abs().max() > 1e-2  # the update moved the model
    assert _gap(setup, updated) > 1e-2  # the engine serves the old weights until the sync

    setup.sync.push(1 + max(setup.rollout.versions()))
    assert _gap(setup, updated) < TOLERANCE

    names = {spec.name for spec in setup.sync.plan.tensors}
    if setup.cfg.model.lora.enabled:  # the adapters only, the experts' among them
        experts = "base_model.model.model.layers.0.mlp.experts."
        assert {
            f"{experts}base_layer.lora_A.default.weight",  # gate_up_proj's
            f"{experts}lora_B.default.weight",  # down_proj's
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
        } <= names
        assert all(".lora_A." in name or ".lora_B." in name for name in names)
        return
    assert "model.layers.0.mlp.experts.gate_up_proj" in names  # the trainer's fused tensors
    assert "model.layers.0.mlp.gate.weight" in names  # the router
    if setup.name.startswith("qwen2_moe"):
        assert {
            "model.layers.0.mlp.shared_expert.gate_proj.weight",
            "model.layers.0.mlp.shared_expert_gate.weight",
        } <= names
    plan = setup.sync.plan
    sent = setup.sync.metrics["weight_sync/mb_per_rollout_rank"] * (1 << 20)
    assert sent == plan.bytes_to_rank(0)
    if setup.cfg.rollout.tensor_parallel_size == 2:
        # The fused experts go whole to each rank (vLLM's loader cuts its slice of every
        # expert), the attention in halves.
        experts = [spec for spec in plan.tensors if len(spec.shape) == 3]
        assert len(experts) == 4 and all(
            plan.region(spec, 1).numel == spec.num_rows * spec.num_cols for spec in experts
        )
        assert sent < plan.total_bytes
