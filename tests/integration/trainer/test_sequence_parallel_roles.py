"""The critic and the distillation teacher under Ulysses sequence parallelism, on a real 2-rank
gloo group: with trainer.sequence_parallel=2 (both ranks one group, each running half of every
packed row) the teacher's log-probs are the plain HF model's, and the critic's values, loss,
metrics, gradients and updated parameters equal those of sequence_parallel=1 (two
data-parallel ranks, whole rows) on the same batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from rl.algorithms.value_loss import value_loss
from rl.config import Config
from rl.types import Batch
from tests.helpers.fsdp_ranks import hf_logprobs, make_batch, trainer_config
from tests.helpers.ports import free_ports
from trainer.critic import ValueTrainer
from trainer.teacher import TeacherScorer

pytestmark = pytest.mark.integration

NUM_ROWS, SEQ_LEN = 6, 23
DEGREES = (1, 2)


def _config(model_dir: Path, sequence_parallel: int) -> Config:
    cfg = trainer_config(
        model_dir,
        {"advantage": "gae", "distill_coef": 1.0},
        packing=True,
        micro_batch_size=3,
        sequence_parallel=sequence_parallel,
    )
    data = cfg.model_dump()
    data["teacher"] = {"path": str(model_dir)}
    data["critic"] = {"lr": 1e-2}
    return Config.model_validate(data)


def _critic(rank: int, cfg: Config, port: int, batch: Batch) -> dict:
    critic = ValueTrainer(cfg, value_loss, rank, 2, "127.0.0.1", port)
    # The head starts at zero, and so do the backbone's gradients: the first step moves the
    # head, the second one's gradients reach every layer.
    first = critic.train_step(batch)
    values = critic.compute_values(batch)
    sums = critic.accumulate_gradients(batch)
    named = list(critic.model.named_parameters())
    grads = {name: p.grad.full_tensor() for name, p in named if p.grad is not None}
    critic.optimizer.zero_grad(set_to_none=True)
    second = critic.train_step(batch)
    params = {name: p.detach().full_tensor() for name, p in critic.model.named_parameters()}
    critic.close()
    return {
        "metrics": [first, second],
        "values": values,
        "sums": sums,
        "grads": grads,
        "params": params,
    }


def _main(rank: int, model_dir: Path, ports: list[int], batch: Batch, out: Path) -> None:
    results, ports = {}, iter(ports)
    for degree in DEGREES:
        cfg = _config(model_dir, degree)
        teacher = TeacherScorer(cfg, None, rank, 2, "127.0.0.1", next(ports))
        results[degree] = {"teacher": teacher.compute_logprobs(batch)}
        teacher.close()
        results[degree]["critic"] = _critic(rank, cfg, next(ports), batch)
    if rank == 0:
        torch.save(results, out / "results.pt")


@pytest.fixture(scope="module")
def model(tiny_tied_model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_tied_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def batch(model) -> Batch:
    batch = make_batch(model, NUM_ROWS, SEQ_LEN, seed=0, min_len=3, group_size=2)
    gen = torch.Generator().manual_seed(1)
    batch.returns = (1.0 + torch.randn(batch.loss_mask.shape, generator=gen)) * batch.loss_mask
    batch.old_values = torch.zeros_like(batch.loss_mask)
    return batch


@pytest.fixture(scope="module")
def runs(tiny_tied_model_dir: Path, batch: Batch, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("sequence_parallel_roles")
    ports = free_ports(2 * len(DEGREES))
    mp.spawn(_main, args=(tiny_tied_model_dir, ports, batch, out), nprocs=2)
    return torch.load(out / "results.pt")


def test_the_sequence_parallel_teacher_scores_the_tokens_as_the_whole_model_does(
    runs: dict, model, batch: Batch
) -> None:
    with torch.no_grad():
        expected = hf_logprobs(model, batch)[0] * batch.attention_mask[:, 1:]
    for degree in DEGREES:
        torch.testing.assert_close(runs[degree]["teacher"], expected, rtol=0, atol=1e-5)


def test_the_sequence_parallel_critic_equals_the_critic_without(runs: dict) -> None:
    one, two = runs[1]["critic"], runs[2]["critic"]
    torch.testing.assert_close(two["values"], one["values"], rtol=0, atol=1e-5)
    assert two["values"].abs().max() > 1e-3  # the first step moved the zero head
    assert two["sums"] == pytest.approx(one["sums"], rel=1e-5, abs=1e-6)
    for got, expected in zip(two["metrics"], one["metrics"], strict=True):
        for key in ("critic/value_loss", "critic/explained_variance", "critic/grad_norm"):
            assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    assert one["grads"].keys() == two["grads"].keys()
    backbone = [name for name in one["grads"] if name.startswith("backbone.")]
    assert backbone and max(one["grads"][name].abs().max() for name in backbone) > 0
    for name, grad in one["grads"].items():
        torch.testing.assert_close(two["grads"][name], grad, rtol=0, atol=1e-5)
    for name, param in one["params"].items():
        torch.testing.assert_close(two["params"][name], param, rtol=0, atol=1e-5)
