"""Ulysses sequence parallelism on a real 2-rank gloo group: one training step with
trainer.sequence_parallel=2 (both ranks one group, each running half of every packed row)
equals the step with sequence_parallel=1 (two data-parallel ranks, whole rows) on the same
batch: log-probs, loss, every gradient and the updated parameters, for a Qwen2 shape (tied
embeddings, 2 heads and 1 key/value head: repeated for the exchange) and a Llama shape
(untied, 2 key/value heads: one a rank), a Qwen3-MoE shape replaying a routing record with
both router losses (the routers' calls gathered over the group), with LoRA, a token budget
and activation checkpointing, and resumed from a checkpoint with the other degree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from rl.algorithms.objective import Objective
from rl.config import Config
from rl.expert_routing import NATURAL
from rl.types import Batch
from tests.helpers.fsdp_ranks import make_batch, trainer_config
from tests.helpers.models import build_checkpoint, build_moe_checkpoint
from tests.helpers.ports import free_ports
from trainer.policy import PolicyTrainer

pytestmark = pytest.mark.integration

NUM_ROWS, SEQ_LEN = 6, 23
WIDTH = 17  # the batch's longest sample: its packed rows' width, padded to 18 for 2 ranks
LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
# label -> (model, trainer.* overrides, model.lora or None)
RUNS = {
    "qwen2_sp1": ("qwen2", {"sequence_parallel": 1}, None),
    "qwen2_sp2": ("qwen2", {"sequence_parallel": 2}, None),
    "qwen2_lora_sp1": ("qwen2", {"sequence_parallel": 1}, LORA),
    "qwen2_lora_sp2_budget_checkpointed": (
        "qwen2",
        {"sequence_parallel": 2, "micro_batch_tokens": WIDTH, "activation_checkpointing": True},
        LORA,
    ),
    "llama_sp1": ("llama", {"sequence_parallel": 1}, None),
    "llama_sp2": ("llama", {"sequence_parallel": 2}, None),
    "moe_sp1": ("moe", {"sequence_parallel": 1}, None),
    "moe_sp2_checkpointed": (
        "moe",
        {"sequence_parallel": 2, "activation_checkpointing": True},
        None,
    ),
}
# Each run with sequence parallelism and the run it must equal.
PAIRS = {
    "qwen2_sp2": "qwen2_sp1",
    "qwen2_lora_sp2_budget_checkpointed": "qwen2_lora_sp1",
    "llama_sp2": "llama_sp1",
    "moe_sp2_checkpointed": "moe_sp1",
}
ROUTER = {"router_balance_coef": 0.1, "router_z_coef": 0.01}
LR = 1e-3
RESUMED = "qwen2_sp2"  # its checkpoint is resumed with sequence_parallel=1


def _config(model_dir: Path, trainer: dict, lora: dict | None, moe: bool = False) -> Config:
    algorithm = ROUTER if moe else None
    cfg = trainer_config(model_dir, algorithm, packing=True, micro_batch_size=3, lr=LR, **trainer)
    data = cfg.model_dump()
    data["model"]["lora"] = lora or {"rank": 0}
    data["model"]["routing_replay"] = moe
    return Config.model_validate(data)


def _full(params) -> dict[str, torch.Tensor]:
    return {name: p.detach().full_tensor() for name, p in params}


def _main(
    rank: int,
    models: dict[str, Path],
    ports: list[int],
    batches: dict[str, Batch],
    out: Path,
    labels: list[str],
) -> None:
    """The runs `labels`, each a process group of its own; after the dense ones, the resume."""
    results = {}
    for label, port in zip(labels, ports, strict=False):
        arch, trainer, lora = RUNS[label]
        cfg = _config(models[arch], trainer, lora, moe=arch == "moe")
        batch = batches["moe" if arch == "moe" else "dense"]
        trainer = PolicyTrainer(cfg, Objective.from_config(cfg), rank, 2, "127.0.0.1", port)
        widths: set[int] = set()  # the positions a row has in each forward of this rank
        embed = trainer.policy.model.get_decoder().embed_tokens
        embed.register_forward_hook(lambda m, args, out, seen=widths: seen.add(args[0].shape[1]))
        result = {"logprobs": trainer.compute_logprobs(batch)}
        if lora is None:
            result["reference"] = trainer.compute_logprobs(batch, "reference")
        result["metrics"] = trainer.accumulate_gradients(batch)
        params = trainer.policy.model.named_parameters()
        result["grads"] = {name: p.grad.full_tensor() for name, p in params if p.grad is not None}
        trainer._optimizer_step(result["metrics"]["loss"])
        result["params"] = _full(trainer.policy.model.named_parameters())
        result["widths"] = widths
        if label == RESUMED:
            trainer.save_checkpoint(str(out / label))
        trainer.close()
        results[label] = result
    if RESUMED in labels:
        cfg = _config(models["qwen2"], {"sequence_parallel": 1}, None)
        resumed = PolicyTrainer(cfg, Objective.from_config(cfg), rank, 2, "127.0.0.1", ports[-1])
        resumed.load_checkpoint(str(out / RESUMED))
        results["resumed"] = {"params": _full(resumed.policy.model.named_parameters())}
        resumed.close()
    if rank == 0:
        torch.save(results, out / f"results-{labels[0]}.pt")


@pytest.fixture(scope="module")
def models(tiny_tied_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    directory = tmp_path_factory.mktemp("models")
    return {
        "qwen2": tiny_tied_model_dir,
        "llama": build_checkpoint(directory / "llama", "llama", False, num_key_value_heads=2),
        "moe": build_moe_checkpoint(directory / "moe", "qwen3_moe"),
    }


def _with_routing(batch: Batch, seed: int) -> Batch:
    """`batch` with a routing record of 2 layers of top-2 of 8 experts: distinct ids drawn
    at random, each row's second half unrecorded (routed as the router chooses)."""
    gen = torch.Generator().manual_seed(seed)
    rows, width = batch.input_ids.shape
    routing = torch.rand(rows, width, 2, 8, generator=gen).argsort(dim=-1)[..., :2]
    routing[:, width // 2 :] = NATURAL
    batch.routing = routing.to(torch.int16)
    return batch


@pytest.fixture(scope="module")
def runs(models: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    batches = {}
    for arch in ("qwen2", "moe"):
        model = AutoModelForCausalLM.from_pretrained(models[arch], dtype=torch.float32).eval()
        batches[arch] = make_batch(model, NUM_ROWS, SEQ_LEN, seed=0, min_len=3, group_size=2)
    batches = {"dense": batches["qwen2"], "moe": _with_routing(batches["moe"], seed=1)}
    assert batches["dense"].attention_mask.sum(dim=1).max() == WIDTH
    out = tmp_path_factory.mktemp("sequence_parallel")
    results = {}
    # The dense runs and the mixture's in rank processes of their own (fewer process groups
    # in one process).
    for arch in ("dense", "moe"):
        labels = [label for label in RUNS if (RUNS[label][0] == "moe") == (arch == "moe")]
        ports = free_ports(len(labels) + 1)
        mp.spawn(_main, args=(models, ports, batches, out, labels), nprocs=2)
        results |= torch.load(out / f"results-{labels[0]}.pt")
    return results


@pytest.mark.parametrize("label", list(PAIRS))
def test_a_step_with_sequence_parallelism_equals_the_step_without(runs: dict, label: str) -> None:
    result, reference = runs[label], runs[PAIRS[label]]
    for key in ("logprobs", "reference"):
        if key in reference:
            torch.testing.assert_close(result[key], reference[key], rtol=0, atol=1e-5)
    assert result["metrics"]["loss"] == pytest.approx(reference["metrics"]["loss"], abs=1e-5)
    assert result["metrics"]["tokens"] == reference["metrics"]["tokens"]
    # A mixture of experts' router metrics (expert loads, losses, replay disagreement).
    moe = {key: value for key, value in reference["metrics"].items() if key.startswith("moe/")}
    assert ("moe" in label) == bool(moe)
    for key, value in moe.items():
        assert result["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert result["grads"].keys() == reference["grads"].keys() and result["grads"]
    for name, grad in reference["grads"].items():
        torch.testing.assert_close(result["grads"][name], grad, rtol=0, atol=1e-5)
    # Adam's first step is lr x g / (|g| + eps): where |g| is near eps (1e-8) a rounding
    # difference of g moves it by a share of lr, so there parameters are held to lr.
    for name, param in reference["params"].items():
        steady = reference["grads"][name].abs() > 1e-6 if name in reference["grads"] else True
        difference = (result["params"][name] - param).abs()
        assert difference.max() <= LR and (difference * steady).max() <= 1e-5, name


def test_each_rank_of_a_group_runs_half_of_every_row(runs: dict) -> None:
    assert runs["qwen2_sp1"]["widths"] == {WIDTH}
    assert runs["qwen2_sp2"]["widths"] == {(WIDTH + 1) // 2}


def test_the_step_moved_the_parameters(runs: dict, models: dict) -> None:
    """The equality above is between trained models, not between copies of the start."""
    start = AutoModelForCausalLM.from_pretrained(models["qwen2"], dtype=torch.float32)
    trained = runs["qwen2_sp2"]["params"]
    moved = max((trained[name] - p).abs().max().item() for name, p in start.named_parameters())
    assert moved > 5e-4  # about lr


def test_a_checkpoint_of_a_sequence_parallel_run_resumes_without(runs: dict) -> None:
    for name, param in runs[RESUMED]["params"].items():
        assert torch.equal(runs["resumed"]["params"][name], param)
