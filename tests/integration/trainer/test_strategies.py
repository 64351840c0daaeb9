"""Every way of sharding and batching the trainer trains the same model: ZeRO-3, ZeRO-2,
hybrid sharding on 2x1 and 1x2 meshes and no sharding, padded, packed or shared-prompt
micro-batches of a fixed count or a token budget, with or without the rows of zero advantage,
on a real 2-rank gloo group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from rl.algorithms.objective import Objective
from rl.sync.shared_memory import channel_prefix, remove_slots
from rl.types import Batch
from tests.helpers.fsdp_ranks import make_batch, sync_between_ranks, trainer_config
from tests.helpers.ports import free_ports
from trainer.policy import PolicyTrainer
from trainer.ranks import micro_batches

pytestmark = pytest.mark.integration

NUM_ROWS, SEQ_LEN, NUM_STEPS = 10, 16, 3

# label -> trainer.* overrides. "one_batch" is the reference: each rank's rows in one forward.
STRATEGIES = {
    "one_batch": {"micro_batch_size": NUM_ROWS},
    "zero3": {},
    "zero2": {"sharding": "zero2"},
    "hybrid_2x1": {"sharding": "hybrid", "shard_group_size": 1},
    "hybrid_1x2": {"sharding": "hybrid", "shard_group_size": 2},
    "none": {"sharding": "none"},
    "packed": {"packing": True, "micro_batch_size": 5},
    "token_budget": {"micro_batch_tokens": 40},
    "token_budget_packed": {"micro_batch_tokens": 40, "packing": True},
    # Rows 0-3 of a rank in one micro-batch: two pairs share their prompts.
    "shared_prompts": {"share_prompts": True, "micro_batch_size": 4},
    # Rows of zero advantage have a gradient of 0 only in a loss without KL or entropy terms.
    "one_batch_policy_loss_only": {"micro_batch_size": NUM_ROWS},
    "skip_zero_advantage_rows": {"skip_zero_advantage_rows": True},
}
POLICY_LOSS_ONLY = {"kl_coef": 0.0, "entropy_coef": 0.0}
# label -> algorithm.* overrides, and the label each strategy must match.
ALGORITHMS = dict.fromkeys(
    ["one_batch_policy_loss_only", "skip_zero_advantage_rows"], POLICY_LOSS_ONLY
)
REFERENCES = {"skip_zero_advantage_rows": "one_batch_policy_loss_only"}
# Rows whose advantage is 0 (their GRPO group scored alike), by batch: all of the last one, so
# that its step moves the parameters by AdamW's momentum alone.
ZERO_ADVANTAGE_ROWS = [[0, 1, 6, 7], [], list(range(NUM_ROWS))]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().full_tensor()


def _layout(trainer: PolicyTrainer, batch: Batch) -> dict:
    """The mesh the parameters are sharded over, and whether a decoder layer holds its shards
    (not the gathered parameters) between forward and backward."""
    first = next(trainer.policy.parameters())
    _, inputs, _ = next(micro_batches(batch, trainer.rank, 2, trainer.cfg.trainer, trainer.device))
    logprob = trainer.policy(inputs, 1.0)[0]
    weight = trainer.policy.model.model.layers[0].mlp.up_proj.weight
    layout = {"mesh": tuple(first.device_mesh.shape), "resharded": isinstance(weight, DTensor)}
    (0 * logprob.sum()).backward()
    trainer.optimizer.zero_grad(set_to_none=True)
    return layout


def _strategies_main(
    rank: int,
    model_dir: Path,
    channels: list[tuple[int, int, str]],
    batches: list[Batch],
    out: Path,
) -> None:
    """For each strategy in turn, in one process group of its own: log-probs, the first
    mini-batch's gradients, NUM_STEPS train steps, the parameters and a weight sync."""
    results = {}
    for (label, overrides), (port, resume_port, prefix) in zip(
        STRATEGIES.items(), channels, strict=True
    ):
        trainer_overrides = {"lr": 1e-3, "micro_batch_size": 2, **overrides}
        cfg = trainer_config(model_dir, ALGORITHMS.get(label), **trainer_overrides)
        trainer = PolicyTrainer(cfg, Objective.from_config(cfg), rank, 2, "127.0.0.1", port)
        result = {"logprobs": trainer.compute_logprobs(batches[0]), **_layout(trainer, batches[0])}
        result["metrics"] = trainer.accumulate_gradients(batches[0])
        params = trainer.policy.model.named_parameters()
        result["grads"] = {name: _full(p.grad) for name, p in params}
        trainer.optimizer.zero_grad(set_to_none=True)
        result["steps"] = [trainer.train_step(batch) for batch in batches]
        result["checksum"] = trainer.parameter_checksum()
        result["synced"], result["params"] = sync_between_ranks(trainer, rank, prefix)
        trainer.save_checkpoint(str(out / label / "checkpoint"))
        trainer.export_hf(str(out / label / "hf"))
        trainer.close()
        # A fresh trainer of the same strategy resumes the checkpoint.
        resumed = PolicyTrainer(cfg, Objective.from_config(cfg), rank, 2, "127.0.0.1", resume_port)
        resumed.load_checkpoint(str(out / label / "checkpoint"))
        result["resumed_checksum"] = resumed.parameter_checksum()
        resumed.close()
        results[label] = result
    torch.save(results, out / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def batches(tiny_model_dir: Path) -> list[Batch]:
    """One per train step. Lengths vary 4x within a batch, so that packing puts several
    samples in a row; pairs of rows share a prompt, as GRPO groups do."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    out = [
        make_batch(model, NUM_ROWS, SEQ_LEN, seed, SEQ_LEN // 4, group_size=2)
        for seed in range(NUM_STEPS)
    ]
    for batch, rows in zip(out, ZERO_ADVANTAGE_ROWS, strict=True):
        batch.advantages[rows] = 0.0
    return out


@pytest.fixture(scope="module")
def strategies(
    tiny_model_dir: Path, batches: list[Batch], tmp_path_factory: pytest.TempPathFactory
) -> dict:
    """Rank 0's results per strategy label."""
    out = tmp_path_factory.mktemp("strategies")
    # Per strategy: its group's port, its resumed group's, and its weight-sync channel (this
    # process's: removed here however the ranks end).
    ports = free_ports(2 * len(STRATEGIES))
    channels = [(*ports[2 * i : 2 * i + 2], channel_prefix()) for i in range(len(STRATEGIES))]
    try:
        mp.spawn(_strategies_main, args=(tiny_model_dir, channels, batches, out), nprocs=2)
    finally:
        for _, _, prefix in channels:
            remove_slots(prefix)
    results = torch.load(out / "rank0.pt")
    for label, result in results.items():
        exported = AutoModelForCausalLM.from_pretrained(out / label / "hf", dtype=torch.float32)
        result["exported"] = dict(exported.named_parameters())
    return results


@pytest.mark.parametrize(
    "label", [label for label in STRATEGIES if label not in {"one_batch", *REFERENCES.values()}]
)
def test_the_strategy_gives_the_logprobs_gradients_and_parameters_of_one_batch(
    strategies: dict, label: str
) -> None:
    reference, result = strategies[REFERENCES.get(label, "one_batch")], strategies[label]
    torch.testing.assert_close(result["logprobs"], reference["logprobs"], rtol=1e-5, atol=1e-6)
    assert result["metrics"]["loss"] == pytest.approx(reference["metrics"]["loss"], rel=1e-5)
    for name, grad in reference["grads"].items():
        torch.testing.assert_close(result["grads"][name], grad, rtol=1e-4, atol=1e-7)
    for got, expected in zip(result["steps"], reference["steps"], strict=True):
        assert got["actor/loss"] == pytest.approx(expected["actor/loss"], rel=1e-4, abs=1e-7)
        assert got["actor/grad_norm"] == pytest.approx(expected["actor/grad_norm"], rel=1e-4)
    # Adam moves a parameter by about lr a step whatever its gradient's size, so one whose
    # gradient is rounding noise can differ by up to 2 lr: bounded by a few such elements.
    for name, param in reference["params"].items():
        torch.testing.assert_close(result["params"][name], param, rtol=1e-4, atol=1e-5)
    assert result["checksum"] == pytest.approx(reference["checksum"], rel=1e-6)


def test_skipping_zero_advantage_rows_leaves_them_out_of_forward_and_backward(
    strategies: dict, batches: list[Batch]
) -> None:
    """The equality above is of steps that computed fewer rows: those zeroed, and those with
    nothing to train (an empty loss mask). An all-zero batch still runs one row, for the
    gradients AdamW's step needs."""
    result = strategies["skip_zero_advantage_rows"]
    assert result["metrics"]["skipped_rows"] == len(ZERO_ADVANTAGE_ROWS[0])
    assert (
        result["metrics"]["trained_tokens"]
        < strategies["one_batch_policy_loss_only"]["metrics"]["trained_tokens"]
    )
    fractions = [step["actor/skipped_row_frac"] for step in result["steps"]]
    empty = [(batch.loss_mask.sum(dim=1) == 0).nonzero().flatten().tolist() for batch in batches]
    expected = [
        len(set(z) | set(e)) / NUM_ROWS for z, e in zip(ZERO_ADVANTAGE_ROWS, empty, strict=True)
    ]
    expected[-1] = (NUM_ROWS - 1) / NUM_ROWS
    assert fractions == pytest.approx(expected)
    assert expected[1] < 1 and expected[0] >= 0.4


def test_each_strategy_shards_over_its_own_mesh(strategies: dict) -> None:
    layouts = {label: (r["mesh"], r["resharded"]) for label, r in strategies.items()}
    assert layouts["zero3"] == ((2,), True)
    assert layouts["zero2"] == ((2,), False)
    assert layouts["hybrid_2x1"] == ((2, 1), True)
    assert layouts["hybrid_1x2"] == ((1, 2), True)
    assert layouts["none"] == ((2, 1), False)


def test_the_steps_moved_the_parameters(strategies: dict, tiny_model_dir: Path) -> None:
    """The comparison above is between trained models, not between copies of the start."""
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    moved = max(
        (strategies["zero3"]["params"][name] - p).abs().max().item()
        for name, p in start.named_parameters()
    )
    assert moved > 100 * 1e-5


@pytest.mark.parametrize("label", list(STRATEGIES))
def test_checkpoint_and_export_hold_the_trained_parameters_whatever_the_mesh(
    strategies: dict, label: str
) -> None:
    result = strategies[label]
    assert result["resumed_checksum"] == pytest.approx(result["checksum"], rel=1e-12)
    for name, param in result["params"].items():
        assert torch.equal(result["exported"][name].detach(), param), name


@pytest.mark.parametrize("label", list(STRATEGIES))
def test_the_weight_sync_sends_the_full_parameters_whatever_the_mesh(
    strategies: dict, label: str
) -> None:
    result = strategies[label]
    assert sorted(result["synced"]) == sorted(result["params"])
    for name, tensor in result["synced"].items():
        assert torch.equal(tensor, result["params"][name]), name
