"""Checkpoints and `rl export` of mixture-of-experts policies (Qwen3-MoE; Qwen2-MoE with its
shared expert) on a real 2-rank gloo trainer, whose experts are fused in memory and sharded by
expert: a restored trainer takes the next step bit for bit as the one that saved, and the
export writes the experts as `save_pretrained` does (one tensor per expert and projection),
which transformers loads into the trainer's very weights and vLLM serves with the same
log-probs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rl.algorithms.objective import Objective
from rl.checkpoint.export import MODEL_FILES_DIR, copy_model_files
from rl.checkpoint.store import CheckpointWriter, checkpoint_root
from rl.config import Config
from rl.types import Batch
from tests.helpers.models import build_moe_checkpoint
from tests.helpers.ports import free_ports
from tests.helpers.repo import REPO
from trainer.policy import PolicyTrainer

pytestmark = pytest.mark.integration

ARCHS = ("qwen3_moe", "qwen2_moe")
STEP = 1
SEQUENCES = torch.randint(4, 64, (3, 20), generator=torch.Generator().manual_seed(2)).tolist()


def _batch(seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, 64, (4, 12), generator=gen)
    loss_mask = torch.zeros(4, 11)
    loss_mask[:, 4:] = 1.0
    logprobs = -torch.rand(4, 11, generator=gen) * loss_mask
    advantages = torch.randn(4, 1, generator=gen) * loss_mask
    return Batch(
        input_ids, torch.ones_like(input_ids), loss_mask, logprobs, logprobs.clone(), advantages
    )


def _params(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().full_tensor() for n, p in trainer.policy.model.named_parameters()}


def _train_save_restore(rank: int, jobs: list[tuple[Config, Path]], ports: list[int]) -> None:
    """Per model: a step, the DCP checkpoint and the trainer's own HF export of those
    weights, a second step; then fresh ranks restore the checkpoint and take the second step."""
    for i, (cfg, step_dir) in enumerate(jobs):
        port_a, port_b = ports[2 * i : 2 * i + 2]
        trainer = PolicyTrainer(cfg, Objective.from_config(cfg), rank, 2, "127.0.0.1", port_a)
        trainer.train_step(_batch(0))
        trainer.save_checkpoint(str(step_dir / "policy"))
        trainer.export_hf(str(step_dir.parent.parent / "live_hf"))
        saved = _params(trainer)
        trainer.train_step(_batch(1))
        straight = _params(trainer)
        trainer.close()
        trainer = PolicyTrainer(cfg, Objective.from_config(cfg), rank, 2, "127.0.0.1", port_b)
        trainer.load_checkpoint(str(step_dir / "policy"))
        restored = _params(trainer)
        trainer.train_step(_batch(1))
        resumed = _params(trainer)
        trainer.close()
        if rank == 0:
            result = {"saved": saved, "straight": straight, "restored": restored}
            torch.save(result | {"resumed": resumed}, step_dir.parent.parent / "result.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """arch -> a run directory holding its base (base/), a committed checkpoint
    (checkpoints/step_000001, as `rl train` writes it), live_hf and result.pt."""
    jobs, commits, out = [], [], {}
    for arch in ARCHS:
        run_dir = tmp_path_factory.mktemp(f"run-{arch}")
        base = build_moe_checkpoint(run_dir / "base", arch)
        cfg = Config.model_validate(
            {"model": {"path": str(base)}, "trainer": {"num_workers": 2, "lr": 1e-2}}
        )
        writer = CheckpointWriter(checkpoint_root(run_dir), keep_last=2)
        step_dir = writer.begin(STEP)
        copy_model_files(base, step_dir / MODEL_FILES_DIR)
        jobs.append((cfg, step_dir))
        commits.append((writer, step_dir, cfg))
        out[arch] = run_dir
    mp.spawn(_train_save_restore, args=(jobs, free_ports(2 * len(jobs))), nprocs=2)
    for writer, step_dir, cfg in commits:
        driver_state = {"step": STEP, "config": cfg.model_dump(mode="json")}
        (step_dir / "driver.json").write_text(json.dumps(driver_state))
        writer.commit(step_dir, STEP)
    return out


@pytest.fixture(scope="module")
def exported(runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """arch -> `rl export` of its checkpoint (the real CLI, in a fresh process)."""
    out = {}
    for arch, run in runs.items():
        out_dir = tmp_path_factory.mktemp(f"export-{arch}") / "hf"
        checkpoint = checkpoint_root(run) / f"step_{STEP:06d}"
        result = subprocess.run(
            [sys.executable, "-m", "rl.cli", "export", str(checkpoint), "--to", str(out_dir)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr
        out[arch] = out_dir
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_a_restored_moe_trainer_takes_the_same_step_bit_for_bit(
    runs: dict[str, Path], arch: str
) -> None:
    result = torch.load(runs[arch] / "result.pt")
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in result["saved"])
    for name, tensor in result["saved"].items():
        assert torch.equal(result["restored"][name], tensor), name
    for name, tensor in result["straight"].items():
        assert torch.equal(result["resumed"][name], tensor), name
    moved = [n for n, t in result["straight"].items() if not torch.equal(t, result["saved"][n])]
    assert "model.layers.1.mlp.experts.down_proj" in moved


@pytest.mark.parametrize("arch", ARCHS)
def test_the_export_stores_each_expert_and_transformers_loads_the_trainers_weights(
    runs: dict[str, Path], exported: dict[str, Path], arch: str
) -> None:
    on_disk = load_file(exported[arch] / "model.safetensors")
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in on_disk
    assert not any(name.endswith(("gate_up_proj", "experts.down_proj")) for name in on_disk)
    live = load_file(runs[arch] / "live_hf" / "model.safetensors")
    assert on_disk.keys() == live.keys()
    for name, tensor in on_disk.items():
        assert torch.equal(tensor, live[name]), name
    saved = torch.load(runs[arch] / "result.pt")["saved"]
    model = AutoModelForCausalLM.from_pretrained(exported[arch], dtype=torch.float32)
    params = dict(model.named_parameters())
    assert params.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(params[name], tensor), name


# Prompt log-probs of SEQUENCES under each model directory, with rollout.engines.vllm_engine's
# CPU settings (fp32, eager, a small KV cache).
_VLLM_SCRIPT = """
import gc, json, sys
import vllm
from vllm.inputs import TokensPrompt
dirs, sequences = json.loads(sys.argv[1]), json.loads(sys.argv[2])
results = []
for model_dir in dirs:
    llm = vllm.LLM(model=model_dir, dtype="float32", max_model_len=64, enforce_eager=True,
                   kv_cache_memory_bytes=64 << 20, seed=0, disable_log_stats=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences],
                        vllm.SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    results.append([[next(iter(p.values())).logprob for p in o.prompt_logprobs[1:]]
                    for o in outs])
    del llm
    gc.collect()
print("RESULT " + json.dumps(results))
"""


def test_vllm_serves_the_exported_experts_with_transformers_log_probs(
    exported: dict[str, Path],
) -> None:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # would override kv_cache_memory_bytes
    dirs = [str(exported[arch]) for arch in ARCHS]
    result = subprocess.run(
        [sys.executable, "-c", _VLLM_SCRIPT, json.dumps(dirs), json.dumps(SEQUENCES)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    served = json.loads(line.removeprefix("RESULT "))
    ids = torch.tensor(SEQUENCES)
    for arch, vllm_logprobs in zip(ARCHS, served, strict=True):
        model = AutoModelForCausalLM.from_pretrained(exported[arch], dtype=torch.float32).eval()
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1], dim=-1)
        want = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        assert (torch.tensor(vllm_logprobs) - want).abs().max() < 1e-4, arch
