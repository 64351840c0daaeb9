"""A streamed step (scheduler.streaming) on a real 2-rank gloo group: the gradients of a step's
chunks, accumulated one chunk per call with the loss divided at the end, give the optimizer
step that train_step takes on the whole batch, and the same bits in whatever order the chunks
come."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rl.algorithms.objective import Objective
from rl.config import Config
from tests.helpers.ports import free_ports
from tests.integration.trainer.test_nonfinite_step import NUM_ROWS, _local, _make_batch
from trainer.policy import PolicyTrainer

pytestmark = pytest.mark.integration

CHUNKS = [[0, 1], [2, 3, 4], [5]]  # uneven, so no chunk stands for the batch's average
# Two loss aggregations (denominators in tokens and in sequences), and LoRA adapters.
VARIANTS = {
    "token-mean": ("token-mean", 0),
    "seq-mean-token-mean": ("seq-mean-token-mean", 0),
    "lora": ("token-mean", 4),
}


def _config(model_dir: Path, loss_agg: str, lora_rank: int) -> Config:
    return Config.model_validate(
        {
            "model": {"path": str(model_dir), "lora": {"rank": lora_rank}},
            "rollout": {"temperature": 0.8},
            "trainer": {"num_workers": 2, "micro_batch_size": 2, "lr": 1e-2},
            # A step of 3 prompts x 2 samples: the nominal sequences a streamed step scales by.
            "run": {"prompts_per_step": 3},
            "algorithm": {"entropy_coef": 0.01, "loss_agg": loss_agg, "group_size": 2},
        }
    )


def _trained(rank: int, cfg: Config, port: int, order: list[int] | None) -> dict:
    """This rank's shards of the gradients the optimizer stepped with and of the parameters
    after, and the metrics, of one step on `_make_batch(0)`: whole (`order` None), or
    streamed chunk by chunk in `order` (indices into CHUNKS, each chunk's key)."""
    trainer = PolicyTrainer(cfg, Objective.from_config(cfg), rank, 2, "127.0.0.1", port)
    grads, optimizer_step = {}, trainer._optimizer_step

    def record_grads(loss: float):
        grads.update(
            {
                name: _local(p.grad)
                for name, p in trainer.policy.named_parameters()
                if p.grad is not None  # LoRA: the frozen base has none
            }
        )
        return optimizer_step(loss)

    trainer._optimizer_step = record_grads
    batch = _make_batch(seed=0)
    if order is not None:
        for chunk in order:
            trainer.accumulate_chunk(batch.select(torch.tensor(CHUNKS[chunk])), key=chunk)
        metrics = trainer.step_accumulated()
    else:
        metrics = trainer.train_step(batch)
    params = {name: _local(p) for name, p in trainer.policy.named_parameters()}
    grads_left = any(p.grad is not None for p in trainer.policy.parameters())
    trainer.close()
    return {"params": params, "grads": grads, "metrics": metrics, "grads_left": grads_left}


def _rank_main(rank: int, model_dir: Path, ports: list[int], out: Path) -> None:
    result, port = {}, iter(ports)
    for variant, (loss_agg, lora_rank) in VARIANTS.items():
        cfg = _config(model_dir, loss_agg, lora_rank)
        result[variant] = {
            "whole": _trained(rank, cfg, next(port), order=None),
            "streamed": _trained(rank, cfg, next(port), order=[0, 1, 2]),
            "reordered": _trained(rank, cfg, next(port), order=[2, 0, 1]),
        }
    torch.save(result, out / f"rank{rank}.pt")


def test_a_streamed_step_equals_the_whole_batchs_and_is_the_same_bits_in_any_chunk_order(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    assert sorted(row for rows in CHUNKS for row in rows) == list(range(NUM_ROWS))
    ports = free_ports(3 * len(VARIANTS))
    mp.spawn(_rank_main, args=(tiny_model_dir, ports, tmp_path), nprocs=2)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        for variant in VARIANTS:
            whole, streamed, again = (
                result[variant][run] for run in ("whole", "streamed", "reordered")
            )
            assert not streamed["grads_left"] and not whole["grads_left"]
            assert streamed["grads"].keys() == whole["grads"].keys()
            for name, grad in whole["grads"].items():
                # Equal in exact arithmetic (the same sum, divided last): the fixed point's
                # and fp32's rounding apart.
                torch.testing.assert_close(streamed["grads"][name], grad, rtol=1e-5, atol=1e-8)
                assert torch.equal(again["grads"][name], streamed["grads"][name]), name
                assert torch.equal(again["params"][name], streamed["params"][name]), name
            for key in ("actor/loss", "actor/pg_loss", "actor/entropy", "actor/grad_norm"):
                assert streamed["metrics"][key] == pytest.approx(whole["metrics"][key], rel=1e-5)
                assert again["metrics"][key] == streamed["metrics"][key]
            assert streamed["metrics"]["actor/nonfinite_skipped"] == 0.0
            assert math.isfinite(streamed["metrics"]["timing/train_tokens_per_s"])
            # An Adam step with a gradient moves every parameter: no no-op passes the above.
            assert whole["metrics"]["actor/grad_norm"] > 0 and whole["metrics"]["actor/lr"] > 0
