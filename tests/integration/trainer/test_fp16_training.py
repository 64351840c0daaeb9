"""fp16 compute (`model.dtype=float16`) on a real 2-rank gloo group: the loss scale is undone
before the step (policy and critic), an overflow skips the step and halves the scale, and a
checkpoint carries the scale to the resumed run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from rl.algorithms.objective import Objective
from rl.algorithms.value_loss import value_loss
from rl.config import Config
from rl.types import Batch
from tests.helpers.fsdp_ranks import make_batch, trainer_config
from tests.helpers.ports import free_ports
from trainer.critic import ValueTrainer
from trainer.policy import PolicyTrainer

pytestmark = pytest.mark.integration

CRITIC_SCALE = 2.0**8


def _config(model_dir: Path, dtype: str) -> Config:
    cfg = trainer_config(model_dir, lr=1e-2, micro_batch_size=2)
    cfg.model.dtype = dtype
    return cfg


def _grads(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {name: p.grad.full_tensor() for name, p in trainer.policy.model.named_parameters()}


def _params(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().full_tensor() for name, p in trainer.policy.model.named_parameters()}


def _rank_main(rank: int, model_dir: Path, ports: list[int], batch: Batch, out: Path) -> None:
    result = {}
    for dtype, port in zip(("float32", "float16"), ports[:2], strict=True):
        cfg = _config(model_dir, dtype)
        trainer = PolicyTrainer(cfg, Objective.from_config(cfg), rank, 2, "127.0.0.1", port)
        seen = []
        mlp = trainer.policy.model.model.layers[0].mlp
        mlp.register_forward_hook(lambda module, args, output, seen=seen: seen.append(output.dtype))
        trainer.accumulate_gradients(batch)
        result[dtype] = {"grads": _grads(trainer), "compute_dtypes": set(seen)}
        trainer.optimizer.zero_grad()
        result[dtype]["step"] = trainer.train_step(batch)
        if dtype == "float16":
            result["scale_used"] = trainer.loss_scale.scale
            # A scale fp16 cannot hold the gradients at: backward overflows to inf.
            trainer.loss_scale.scale = 2.0**100
            before = _params(trainer)
            result["overflow"] = trainer.train_step(batch)
            result["overflow_unchanged"] = all(
                torch.equal(p, before[name]) for name, p in _params(trainer).items()
            )
            trainer.save_checkpoint(str(out / "ckpt"))
        trainer.close()
    cfg = _config(model_dir, "float16")
    resumed = PolicyTrainer(cfg, Objective.from_config(cfg), rank, 2, "127.0.0.1", ports[2])
    resumed.load_checkpoint(str(out / "ckpt"))
    result["resumed_scale"] = resumed.loss_scale.scale
    resumed.close()
    critic_batch = dataclasses.replace(
        batch, returns=batch.loss_mask.clone(), old_values=torch.zeros_like(batch.loss_mask)
    )
    for dtype, port in zip(("float32", "float16"), ports[3:], strict=True):
        critic = ValueTrainer(_config(model_dir, dtype), value_loss, rank, 2, "127.0.0.1", port)
        if critic.loss_scale is not None:
            # The value head's gradient sums over every token: 2^16 overflows it in fp16 here,
            # and a first step would be skipped to halve the scale until it fits.
            critic.loss_scale.scale = CRITIC_SCALE
        critic.accumulate_gradients(critic_batch)
        grads = {name: p.grad.full_tensor() for name, p in critic.model.named_parameters()}
        critic.optimizer.zero_grad()
        result[f"critic-{dtype}"] = {"grads": grads, "step": critic.train_step(critic_batch)}
        critic.close()
    torch.save(result, out / f"rank{rank}.pt")


def test_fp16_gradients_are_unscaled_overflow_skips_and_halves_and_the_scale_resumes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    batch = make_batch(model, num_rows=6, seq_len=12, seed=6)
    ports = free_ports(5)
    mp.spawn(_rank_main, args=(tiny_model_dir, ports, batch, tmp_path), nprocs=2)
    result = torch.load(tmp_path / "rank0.pt")

    fp32, fp16 = result["float32"], result["float16"]
    assert (fp32["compute_dtypes"], fp16["compute_dtypes"]) == ({torch.float32}, {torch.float16})
    # The gradients after backward are those of the scaled loss; the step sees them unscaled.
    scale = result["scale_used"]
    assert scale == 2.0**16
    for name, grad in fp32["grads"].items():
        torch.testing.assert_close(fp16["grads"][name] / scale, grad, rtol=2e-2, atol=1e-4)
    assert fp16["step"]["actor/loss_scale"] == scale
    assert "actor/loss_scale" not in fp32["step"]
    assert fp16["step"]["actor/nonfinite_skipped"] == 0.0
    assert fp16["step"]["actor/grad_norm"] == pytest.approx(fp32["step"]["actor/grad_norm"], 2e-2)

    overflow = result["overflow"]
    assert overflow["actor/nonfinite_skipped"] == 1.0
    assert result["overflow_unchanged"]
    assert overflow["actor/loss_scale"] == 2.0**99
    assert result["resumed_scale"] == 2.0**99

    critic32, critic16 = result["critic-float32"], result["critic-float16"]
    for name, grad in critic32["grads"].items():
        torch.testing.assert_close(
            critic16["grads"][name] / CRITIC_SCALE, grad, rtol=2e-2, atol=1e-4
        )
    assert critic16["step"]["critic/loss_scale"] == CRITIC_SCALE
    assert critic16["step"]["critic/nonfinite_skipped"] == 0.0
