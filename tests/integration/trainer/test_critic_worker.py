"""The PPO critic on real Ray actors and real gloo FSDP2 groups, on the tiny checkpoint of
tests/helpers/models.py: initial values, fitting returns, value clipping, 1 rank == 2 ranks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group

from rl.cluster.reservation import Placement, PlacementPlan
from rl.cluster.trainer_ranks import CriticRanks
from rl.config import Config
from rl.types import Batch

pytestmark = pytest.mark.integration

VOCAB = 64  # the tiny checkpoint's vocabulary


def _config(model_dir: Path, num_workers: int, value_clip: float, passes: int = 1) -> Config:
    """`num_workers` critic ranks, lr 1e-3; `passes` epochs and mini-batches per train_step."""
    return Config.model_validate(
        {
            "model": {"path": str(model_dir)},
            "trainer": {
                "num_workers": 2,
                "micro_batch_size": 2,
                "num_mini_batches": passes,
                "num_epochs": passes,
            },
            "critic": {"num_workers": num_workers, "lr": 1e-3, "value_clip": value_clip},
            # Actors log to Ray, not to a run directory under the working directory.
            "run": {"verbose": True},
        }
    )


def _make_batch(num_rows: int, seq_len: int, seed: int) -> Batch:
    """Right-padded random sequences with returns near 1 on the response tokens.

    old_values are 0, the values of the zero-initialised head: what generation recorded.
    """
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (num_rows,), generator=gen)
    prompt_lens = torch.randint(2, seq_len // 2, (num_rows,), generator=gen)
    steps = torch.arange(seq_len)
    attention_mask = (steps < lengths[:, None]).long()
    input_ids = torch.randint(1, VOCAB, (num_rows, seq_len), generator=gen) * attention_mask
    targets = steps[1:]
    loss_mask = ((targets >= prompt_lens[:, None]) & (targets < lengths[:, None])).float()
    zeros = torch.zeros_like(loss_mask)
    returns = (1.0 + 0.1 * torch.randn(loss_mask.shape, generator=gen)) * loss_mask
    return Batch(
        input_ids, attention_mask, loss_mask, zeros, zeros, zeros, returns=returns, old_values=zeros
    )


@pytest.fixture(scope="module")
def placement():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    group = placement_group([{"CPU": 1.0}, {"CPU": 1.0}], strategy="PACK")
    ray.get(group.ready())
    try:
        # No critic bundles in the plan: critic rank r goes to bundle r.
        plan = PlacementPlan(mode="colocate", num_devices=2, roles={}, node_blocks=[[0, 1]])
        yield Placement(placement_groups=[group], plan=plan, use_gpu=False, gpu_ids=[])
    finally:
        remove_placement_group(group)
        ray.shutdown()


@pytest.fixture(scope="module")
def critic(tiny_model_dir: Path, placement: Placement):
    """2 ranks, 2 epochs of 2 mini-batches, no value clipping (nothing holds values back)."""
    # Five critic ranks share the two bundles over the module: a quarter CPU each fits.
    cfg = _config(tiny_model_dir, 2, value_clip=0.0, passes=2)
    group = CriticRanks(cfg, placement, num_roles_sharing=4)
    yield group
    group.close()


@pytest.fixture(scope="module")
def clipped_pair(tiny_model_dir: Path, placement: Placement):
    """(1-rank, 2-rank) critics from the same checkpoint, with a small value clip.

    One optimizer step per train_step, so each step's one forward sees the values as they were
    when the step began.
    """
    pair = tuple(
        CriticRanks(_config(tiny_model_dir, n, value_clip=0.01), placement, num_roles_sharing=4)
        for n in (1, 2)
    )
    yield pair
    for group in pair:
        group.close()


def test_initial_values_are_zero_with_batch_shape(critic: CriticRanks) -> None:
    """Runs before the critic fixture is trained (tests run in file order)."""
    batch = _make_batch(num_rows=5, seq_len=12, seed=0)
    values = critic.compute_values(batch)
    assert values.shape == (5, 11) and values.dtype == torch.float32
    assert torch.equal(values, torch.zeros(5, 11))


def test_value_loss_falls_on_fixed_returns(critic: CriticRanks) -> None:
    batch = _make_batch(num_rows=8, seq_len=12, seed=1)
    history = []
    for _ in range(5):
        history.append(critic.train_step(batch))
        critic.release_memory()  # time-sliced devices (a no-op on CPU): the next step takes it back
    losses = [m["critic/value_loss"] for m in history]
    assert losses[-1] < 0.5 * losses[0], losses
    assert history[0]["critic/value_clip_frac"] == 0.0  # no clipping configured
    assert history[-1]["critic/values_mean"] > 0.5  # on the way to the returns (about 1)
    for metrics in history:
        assert metrics["critic/lr"] == 1e-3 and metrics["critic/grad_norm"] > 0
        assert all(math.isfinite(v) for v in metrics.values())

    values = critic.compute_values(batch)
    mask = batch.loss_mask
    assert torch.equal(values * mask, values)  # 0 outside the loss mask
    assert (values[mask.bool()] > 0).all()


def test_one_rank_equals_two_ranks(clipped_pair: tuple[CriticRanks, CriticRanks]) -> None:
    """9 rows at micro-batch 2: one rank runs 5 micro-batches, two ranks 3 each (one dummy)."""
    batch = _make_batch(num_rows=9, seq_len=12, seed=2)
    for step in range(2):
        one, two = (critic.train_step(batch) for critic in clipped_pair)
        for key in ("value_loss", "value_clip_frac", "values_mean", "grad_norm"):
            assert two[f"critic/{key}"] == pytest.approx(one[f"critic/{key}"], rel=1e-5), key
        assert two["critic/explained_variance"] == pytest.approx(
            one["critic/explained_variance"], abs=1e-6
        )
        if step == 0:  # values start at 0: the loss is 0.5 * mean(R^2) over response tokens
            mask = batch.loss_mask
            expected = 0.5 * (batch.returns.square() * mask).sum() / mask.sum()
            assert one["critic/value_loss"] == pytest.approx(expected.item(), rel=1e-5)
            assert one["critic/values_mean"] == 0.0
    values_one, values_two = (critic.compute_values(batch) for critic in clipped_pair)
    assert values_one.abs().max() > 1e-3  # it moved
    torch.testing.assert_close(values_two, values_one, rtol=0, atol=1e-5)


def test_value_clipping_reports_clipped_tokens(
    clipped_pair: tuple[CriticRanks, CriticRanks],
) -> None:
    critic = clipped_pair[1]
    batch = _make_batch(num_rows=6, seq_len=12, seed=3)
    batch.old_values = critic.compute_values(batch)  # as at generation
    first = critic.train_step(batch)  # one forward per step: values == old_values there
    assert first["critic/value_clip_frac"] == 0.0
    second = critic.train_step(batch)  # moved further than 0.01 from old_values
    assert second["critic/value_clip_frac"] > 0.0
