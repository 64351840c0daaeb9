"""Trainer checkpoints on a real 2-rank gloo group: a step after a restore equals the step
without one, bit for bit; a restore onto one rank reshards; tampered metadata is refused."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from rl.algorithms.objective import Objective
from rl.config import Config
from rl.observe.metrics import is_measurement
from rl.types import Batch
from tests.helpers.ports import free_port, free_ports
from trainer.checkpoint import SafeReader
from trainer.policy import PolicyTrainer

pytestmark = pytest.mark.integration


def _config(model_dir: Path, num_workers: int) -> Config:
    return Config.model_validate(
        {
            "model": {"path": str(model_dir)},
            "trainer": {"num_workers": num_workers, "lr": 1e-2, "warmup_steps": 3},
            "algorithm": {"kl_coef": 0.1},
        }
    )


def _batch(vocab: int, seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab, (5, 10), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    loss_mask = torch.zeros(5, 9)
    loss_mask[:, 4:] = 1.0
    logprobs = -torch.rand(5, 9, generator=gen) * loss_mask
    advantages = torch.randn(5, 1, generator=gen) * loss_mask
    return Batch(
        input_ids, attention_mask, loss_mask, logprobs, logprobs.clone(), advantages, logprobs - 0.1
    )


def _params(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().full_tensor() for n, p in trainer.policy.model.named_parameters()}


def _two_steps(rank: int, cfg: Config, ports: list[int], vocab: int, out: Path) -> None:
    """Step, checkpoint, step again; then fresh ranks restore and take the second step."""
    trainer = PolicyTrainer(cfg, Objective.from_config(cfg), rank, 2, "127.0.0.1", ports[0])
    trainer.train_step(_batch(vocab, 0))
    trainer.save_checkpoint(str(out / "ckpt"))
    saved = _params(trainer)
    straight = trainer.train_step(_batch(vocab, 1)), _params(trainer)
    trainer.close()
    trainer = PolicyTrainer(cfg, Objective.from_config(cfg), rank, 2, "127.0.0.1", ports[1])
    trainer.load_checkpoint(str(out / "ckpt"))
    restored = _params(trainer)
    resumed = trainer.train_step(_batch(vocab, 1)), _params(trainer)
    trainer.close()
    if rank == 0:
        torch.save(
            {"saved": saved, "restored": restored, "straight": straight, "resumed": resumed},
            out / "result.pt",
        )


def _one_rank_restore(rank: int, cfg: Config, port: int, out: Path) -> None:
    trainer = PolicyTrainer(cfg, Objective.from_config(cfg), rank, 1, "127.0.0.1", port)
    trainer.load_checkpoint(str(out / "ckpt"))
    torch.save(_params(trainer), out / "one_rank.pt")
    trainer.close()


def test_a_restored_trainer_takes_the_same_step_bit_for_bit_and_reshards(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    vocab = AutoModelForCausalLM.from_pretrained(tiny_model_dir).config.vocab_size
    cfg = _config(tiny_model_dir, num_workers=2)
    mp.spawn(_two_steps, args=(cfg, free_ports(2), vocab, tmp_path), nprocs=2)
    result = torch.load(tmp_path / "result.pt")
    for name, tensor in result["saved"].items():
        assert torch.equal(result["restored"][name], tensor), name
    (straight_metrics, straight), (resumed_metrics, resumed) = result["straight"], result["resumed"]
    measured = {k for k in straight_metrics if is_measurement(k)}  # time, memory
    assert {k: v for k, v in straight_metrics.items() if k not in measured} == {
        k: v for k, v in resumed_metrics.items() if k not in measured
    }
    assert straight_metrics["actor/lr"] == pytest.approx(1e-2 * 2 / 3)  # warmup restored
    for name, tensor in straight.items():
        assert torch.equal(resumed[name], tensor), name
    assert any(not torch.equal(straight[n], result["saved"][n]) for n in straight)

    one_rank = _config(tiny_model_dir, num_workers=1)
    mp.spawn(_one_rank_restore, args=(one_rank, free_port(), tmp_path), nprocs=1)
    for name, tensor in torch.load(tmp_path / "one_rank.pt").items():
        assert torch.equal(tensor, result["saved"][name]), name

    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert {"rng_rank0.json", "rng_rank1.json", "schedule.json", "shapes.json"} <= set(files)
    assert not [f for f in files if f.endswith((".pt", ".pkl", ".bin"))]


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/tandem-pwned",))


def test_checkpoint_metadata_that_names_other_code_is_refused(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(ValueError, match="refused"):
        SafeReader(tmp_path).read_metadata()
    assert not Path("/tmp/tandem-pwned").exists()
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"a": io.BytesIO}))
    with pytest.raises(ValueError, match="not valid DCP metadata"):
        SafeReader(tmp_path).read_metadata()
