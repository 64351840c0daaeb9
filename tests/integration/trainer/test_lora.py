"""LoRA on the FSDP2 trainer (a real 2-rank gloo group): only the adapters train, the
reference is the base, and a step equals one process's peft model stepped by plain AdamW."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from rl.algorithms.objective import Objective, loss_weights, policy_objective
from rl.config import Config
from rl.types import Batch
from tests.helpers.fsdp_ranks import hf_logprobs, make_batch, trainer_config
from tests.helpers.ports import free_port
from trainer.policy import PolicyTrainer

pytestmark = pytest.mark.integration

RANK, ALPHA, SEED = 4, 8.0, 3
TARGETS = ["q_proj", "v_proj", "down_proj"]


def _config(model_dir: Path) -> Config:
    cfg = trainer_config(model_dir, micro_batch_size=2, lr=1e-2)
    cfg.model.lora.rank, cfg.model.lora.alpha = RANK, ALPHA
    cfg.model.lora.target_modules = TARGETS
    cfg.run.seed = SEED
    return cfg


def _rank_main(rank: int, cfg: Config, port: int, batch: Batch, out: Path) -> None:
    trainer = PolicyTrainer(cfg, Objective.from_config(cfg), rank, 2, "127.0.0.1", port)
    model = trainer.policy.model
    result = {
        "logprobs": trainer.compute_logprobs(batch),
        "ref": trainer.compute_logprobs(batch, "reference"),
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        "metrics": trainer.train_step(batch),
    }
    result["params"] = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    result["logprobs_after"] = trainer.compute_logprobs(batch)
    result["ref_after"] = trainer.compute_logprobs(batch, "reference")
    trainer.export_hf(str(out / "hf"))
    torch.save(result, out / f"rank{rank}.pt")
    trainer.close()


def test_a_lora_step_on_two_ranks_trains_the_adapters_only_and_equals_one_process(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    batch = make_batch(base, num_rows=6, seq_len=12, seed=0)
    cfg = _config(tiny_model_dir)
    mp.spawn(_rank_main, args=(cfg, free_port(), batch, tmp_path), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    # One process, no FSDP: peft on the HF model, the adapters drawn from the same seed.
    torch.manual_seed(SEED)
    peft_cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS)
    policy = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), peft_cfg
    ).eval()
    names = {name for name, _ in base.named_parameters()}
    with torch.no_grad():
        base_logprobs = hf_logprobs(base, batch)[0] * batch.attention_mask[:, 1:]
    layers = base.config.num_hidden_layers
    expected_trainable = sorted(
        f"base_model.model.model.layers.{i}.{'self_attn' if t != 'down_proj' else 'mlp'}"
        f".{t}.lora_{ab}.default.weight"
        for i in range(layers)
        for t in TARGETS
        for ab in "AB"
    )
    for result in ranks:
        # B starts at zero: the policy starts as the base, which is also the reference.
        torch.testing.assert_close(result["logprobs"], base_logprobs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(result["ref"], base_logprobs, rtol=1e-5, atol=1e-5)
        assert result["trainable"] == expected_trainable

    # The step by hand: loss, clip to trainer.max_grad_norm, plain AdamW on the adapters.
    logprobs, entropy = hf_logprobs(policy, batch)
    max_len = cfg.rollout.max_new_tokens
    denominator = loss_weights(cfg.algorithm, batch.loss_mask, max_len)[1].item()
    loss, _ = policy_objective(cfg.algorithm, logprobs, entropy, batch, max_len, denominator)
    loss.backward()
    trained = [p for p in policy.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(trained, cfg.trainer.max_grad_norm)
    torch.optim.AdamW(trained, lr=cfg.trainer.lr, betas=cfg.trainer.betas, weight_decay=0.0).step()
    got = ranks[0]
    assert got["metrics"]["actor/loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
    assert got["metrics"]["actor/grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-5)
    for name, param in policy.named_parameters():
        if param.requires_grad:  # moved as one process's AdamW moved them
            torch.testing.assert_close(got["params"][name], param.detach(), rtol=1e-4, atol=1e-6)
        else:  # the base, untouched
            hf_name = name.removeprefix("base_model.model.").replace(".base_layer", "")
            assert hf_name in names, name
            assert torch.equal(got["params"][name], base.get_parameter(hf_name)), name
    with torch.no_grad():
        stepped = hf_logprobs(policy, batch)[0] * batch.attention_mask[:, 1:]
    for result in ranks:
        torch.testing.assert_close(result["logprobs_after"], stepped, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(result["ref_after"], base_logprobs, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(stepped, base_logprobs, atol=1e-4)  # the step did something

    # The export: the base with the adapters merged in, a plain HF model; and the adapters
    # alone in PEFT's format, over a fresh copy of the base.
    exported = tmp_path / "hf"
    merged = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(fresh, exported / "adapter").eval()
    with torch.no_grad():
        for model in (merged, adapted):
            got = hf_logprobs(model, batch)[0] * batch.attention_mask[:, 1:]
            torch.testing.assert_close(got, stepped, rtol=1e-5, atol=1e-5)
