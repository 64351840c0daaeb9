"""A NaN/inf loss or gradient skips the optimizer step on a real 2-rank gloo group: weights,
Adam state and the lr schedule stay bitwise as they were, and the skip is counted."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from rl.algorithms.objective import Objective
from rl.algorithms.value_loss import value_loss
from rl.config import Config
from rl.types import Batch
from tests.helpers.ports import free_ports
from trainer.critic import ValueTrainer
from trainer.micro_batching import rank_rows
from trainer.policy import PolicyTrainer

pytestmark = pytest.mark.integration

VOCAB = 64  # the tiny checkpoint's vocabulary
NUM_ROWS = 6  # rank 0 owns rows 0-2, rank 1 rows 3-5
NAN_ROW, INF_ROW = 5, 0  # one rank's rows only: the other rank must skip as well
WARMUP = 4  # the lr changes every step, so a schedule step taken by mistake shows


def _config(model_dir: Path) -> Config:
    return Config.model_validate(
        {
            "model": {"path": str(model_dir)},
            "rollout": {"temperature": 0.8},
            "trainer": {
                "num_workers": 2,
                "micro_batch_size": 2,  # 3 rows a rank: two micro-batches of 2 + 1
                "lr": 1e-2,
                "warmup_steps": WARMUP,
            },
            "critic": {"lr": 1e-2, "warmup_steps": WARMUP},
            "algorithm": {"entropy_coef": 0.01},
        }
    )


def _make_batch(seed: int, seq_len: int = 10) -> Batch:
    """Right-padded random sequences, old log-probs near a uniform policy's, random advantages,
    returns near 1 and zero old values (for the critic)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (NUM_ROWS,), generator=gen)
    prompt_lens = torch.randint(2, seq_len // 2, (NUM_ROWS,), generator=gen)
    steps = torch.arange(seq_len)
    attention_mask = (steps < lengths[:, None]).long()
    input_ids = torch.randint(1, VOCAB, (NUM_ROWS, seq_len), generator=gen) * attention_mask
    targets = steps[1:]
    mask = ((targets >= prompt_lens[:, None]) & (targets < lengths[:, None])).float()
    old = (-math.log(VOCAB) + 0.3 * torch.randn(mask.shape, generator=gen)) * mask
    advantages = torch.randn(NUM_ROWS, 1, generator=gen) * mask
    returns = (1.0 + 0.1 * torch.randn(mask.shape, generator=gen)) * mask
    zeros = torch.zeros_like(mask)
    return Batch(
        input_ids, attention_mask, mask, old, old, advantages, returns=returns, old_values=zeros
    )


def _poisoned(batch: Batch, row: int, value: float, field: str) -> Batch:
    """`batch` with `field` set to `value` on the response tokens of `row`."""
    tensor = getattr(batch, field).clone()
    tensor[row] = torch.where(batch.loss_mask[row] > 0, value, tensor[row])
    return dataclasses.replace(batch, **{field: tensor})


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _state(model: torch.nn.Module, optimizer, scheduler) -> dict:
    """This rank's shards of the parameters and Adam state, and the schedule: not collective."""
    assert all(p.grad is None for p in model.parameters()), "grads left behind"
    return {
        "params": {name: _local(p) for name, p in model.named_parameters()},
        "adam": {
            name: {key: _local(value) for key, value in optimizer.state[p].items()}
            for name, p in model.named_parameters()
        },
        "lr": optimizer.param_groups[0]["lr"],
        "schedule": scheduler.state_dict(),
    }


def _policy_run(rank: int, cfg: Config, port: int, batches: list[Batch]) -> dict:
    trainer = PolicyTrainer(cfg, Objective.from_config(cfg), rank, 2, "127.0.0.1", port)
    metrics, states = [], []
    for batch in batches:
        metrics.append(trainer.train_step(batch))
        states.append(_state(trainer.policy, trainer.optimizer, trainer.scheduler))
    # Two mini-batches, the second one poisoned: one skipped, one taken.
    trainer.cfg.trainer.num_mini_batches = 2
    mixed = trainer.train_step(_poisoned(batches[0], NAN_ROW, math.nan, "advantages"))
    trainer.close()
    return {"metrics": metrics, "states": states, "mixed": mixed}


def _critic_run(rank: int, cfg: Config, port: int, batches: list[Batch]) -> dict:
    trainer = ValueTrainer(cfg, value_loss, rank, 2, "127.0.0.1", port)
    metrics, states = [], []
    for batch in batches:
        metrics.append(trainer.train_step(batch))
        states.append(_state(trainer.model, trainer.optimizer, trainer.scheduler))
    trainer.close()
    return {"metrics": metrics, "states": states}


def _rank_main(rank: int, model_dir: Path, ports: list[int], out: Path) -> None:
    good, later = _make_batch(seed=0), _make_batch(seed=1)
    nan = _poisoned(good, NAN_ROW, math.nan, "advantages")
    inf = _poisoned(good, INF_ROW, math.inf, "advantages")  # an infinite loss
    result = {
        "poisoned": _policy_run(rank, _config(model_dir), ports[0], [good, nan, inf, later]),
        "clean": _policy_run(rank, _config(model_dir), ports[1], [good, later]),
        "critic": _critic_run(
            rank,
            _config(model_dir),
            ports[2],
            [good, _poisoned(good, NAN_ROW, math.nan, "returns"), later],
        ),
    }
    torch.save(result, out / f"rank{rank}.pt")


def _assert_equal(got: object, want: object, where: str) -> None:
    """Bitwise equality of nested dicts of tensors and numbers."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _assert_equal(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), where
    else:
        assert got == want, where


def test_nonfinite_steps_are_skipped_and_change_nothing(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    assert NAN_ROW in range(NUM_ROWS)[rank_rows(NUM_ROWS, 1, 2)]
    assert INF_ROW in range(NUM_ROWS)[rank_rows(NUM_ROWS, 0, 2)]
    ports = free_ports(3)
    mp.spawn(_rank_main, args=(tiny_model_dir, ports, tmp_path), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    for rank, result in enumerate(ranks):
        poisoned, clean = result["poisoned"], result["clean"]
        metrics, states = poisoned["metrics"], poisoned["states"]
        assert [m["actor/nonfinite_skipped"] for m in metrics] == [0.0, 1.0, 1.0, 0.0]
        # The skipped steps: nothing moved, not even Adam's step count or the lr schedule.
        _assert_equal(states[1], states[0], f"rank {rank} after NaN")
        _assert_equal(states[2], states[0], f"rank {rank} after inf")
        assert states[0]["schedule"]["last_epoch"] == 1
        moved = states[3]["params"].items()
        assert any(not torch.equal(p, states[0]["params"][name]) for name, p in moved)
        for skipped in metrics[1:3]:  # nothing taken: nothing to describe
            for key in ("actor/loss", "actor/grad_norm", "actor/pg_loss", "actor/entropy"):
                assert math.isnan(skipped[key]), key
            assert skipped["actor/lr"] == 1e-2 * 2 / WARMUP  # the next step's, still
        # After the skips, training goes on exactly as if the bad batches never came.
        _assert_equal(states[3], clean["states"][1], f"rank {rank} after the good step")
        for key, value in clean["metrics"][1].items():
            if key.startswith("actor/"):
                assert metrics[3][key] == value, key

        # One skipped, one taken mini-batch: the metrics are the taken one's.
        mixed = poisoned["mixed"]
        assert mixed["actor/nonfinite_skipped"] == 1.0
        for key in ("actor/loss", "actor/grad_norm", "actor/pg_loss"):
            assert math.isfinite(mixed[key]), key
        assert mixed["actor/grad_norm"] > 0

        critic = result["critic"]
        assert [m["critic/nonfinite_skipped"] for m in critic["metrics"]] == [0.0, 1.0, 0.0]
        _assert_equal(critic["states"][1], critic["states"][0], f"critic rank {rank}")
        assert math.isnan(critic["metrics"][1]["critic/grad_norm"])
        assert math.isfinite(critic["metrics"][2]["critic/grad_norm"])
        assert critic["metrics"][2]["critic/lr"] == 1e-2 * 2 / WARMUP

    # Global decisions and metrics: the ranks agree (timings aside).
    for run in ("poisoned", "clean", "critic"):
        for mine, theirs in zip(ranks[0][run]["metrics"], ranks[1][run]["metrics"], strict=True):
            for key, value in mine.items():
                if not key.startswith("timing/"):
                    assert value == theirs[key] or (math.isnan(value) and math.isnan(theirs[key]))
