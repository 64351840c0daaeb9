"""The FSDP2 trainer on a real 2-rank gloo group: exact data-parallel gradients, Ray actors,
weight-sync buffers and HF export, on the tiny checkpoints of tests/helpers/models.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import ray
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rl.algorithms.objective import Objective, loss_weights, policy_objective
from rl.config import Config
from rl.sync.pieces import bucket_tensors
from rl.sync.plan import WeightSyncPlan, load_unit, plan_to_json, plan_weight_sync
from rl.sync.shared_memory import (
    SharedMemorySpec,
    channel_prefix,
    open_slots,
    remove_slots,
    slot_paths,
)
from rl.types import Batch
from tests.helpers.fsdp_ranks import (
    hf_logprobs,
    make_batch,
    sync_between_ranks,
    trainer_config,
)
from tests.helpers.ports import free_port
from trainer.policy import PolicyTrainer
from trainer.worker import start_policy_ranks

pytestmark = pytest.mark.integration

# ---- exact data parallelism, without Ray -------------------------------------------------

LOSS_AGGS = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def _rank_main(rank: int, cfg: Config, port: int, prefix: str, batch: Batch, out: Path) -> None:
    trainer = PolicyTrainer(cfg, Objective.from_config(cfg), rank, 2, "127.0.0.1", port)
    result = {
        "logprobs": trainer.compute_logprobs(batch),
        "ref_logprobs": trainer.compute_logprobs(batch, "reference"),
        "grads": {},
        "metrics": {},
    }
    for agg in LOSS_AGGS:
        trainer.cfg.algorithm.loss_agg = agg
        result["metrics"][agg] = trainer.accumulate_gradients(batch)
        result["grads"][agg] = {
            name: p.grad.full_tensor() for name, p in trainer.policy.model.named_parameters()
        }
        trainer.optimizer.zero_grad()
    # Still at the initial weights: the step's grad norm is that of the last aggregation.
    result["train_step"] = trainer.train_step(batch)
    result["synced"], result["full"] = sync_between_ranks(trainer, rank, prefix)
    torch.save(result, out / f"rank{rank}.pt")
    trainer.close()


def test_two_ranks_with_micro_batches_equal_one_full_batch(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """W=2, 9 rows (5 + 4: rank 1 runs a dummy micro-batch), micro_batch_size 2, chunk 7."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    batch = make_batch(model, num_rows=9, seq_len=12, seed=0)
    cfg = trainer_config(tiny_model_dir, micro_batch_size=2)
    prefix = channel_prefix()  # this process's: removed here however the ranks end
    try:
        mp.spawn(_rank_main, args=(cfg, free_port(), prefix, batch, tmp_path), nprocs=2)
    finally:
        remove_slots(prefix)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    logprobs, entropy = hf_logprobs(model, batch)
    # Padding targets are skipped by the kernel and score 0.
    expected = (logprobs * batch.attention_mask[:, 1:]).detach()
    for result in ranks:  # each rank computes its rows and all of them get the whole batch's
        torch.testing.assert_close(result["logprobs"], expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(result["ref_logprobs"], expected, rtol=1e-5, atol=1e-5)

    for agg in LOSS_AGGS:
        cfg.algorithm.loss_agg = agg
        model.zero_grad()
        max_len = cfg.rollout.max_new_tokens
        denominator = loss_weights(cfg.algorithm, batch.loss_mask, max_len)[1].item()
        loss, metrics = policy_objective(
            cfg.algorithm, logprobs, entropy, batch, max_len, denominator
        )
        loss.backward(retain_graph=True)
        for result in ranks:  # metrics are all-reduced: identical on every rank
            got = result["metrics"][agg]
            assert got["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
            for name in ("pg_loss", "clip_frac", "entropy", "kl_ref"):
                assert got[name] == pytest.approx(metrics[name].item(), rel=1e-5, abs=1e-7)
        assert 0 < ranks[0]["metrics"][agg]["clip_frac"] < 1
        grads = ranks[0]["grads"][agg]
        for name, param in model.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6)

    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert ranks[0]["train_step"]["actor/grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-5)
    assert ranks[0]["train_step"]["actor/loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)

    # Weight sync after the step: each rank wrote only its rows, the buffers hold every tensor.
    untied = list(load_file(tiny_model_dir / "model.safetensors"))
    assert sorted(ranks[0]["synced"]) == sorted(untied)
    for name, tensor in ranks[0]["synced"].items():
        assert torch.equal(tensor, ranks[0]["full"][name]), name


def _step_main(rank: int, cfg: Config, port: int, batch: Batch, out: Path, label: str) -> None:
    """Log-probs, one train step, and the parameters after it, saved as out/LABEL-rankR.pt;
    with how often the first layer's MLP started a forward during the step."""
    trainer = PolicyTrainer(cfg, Objective.from_config(cfg), rank, 2, "127.0.0.1", port)
    result = {"logprobs": trainer.compute_logprobs(batch)}
    mlp_calls = []
    # A pre-hook: the recompute stops as soon as the last saved tensor is back, inside the MLP.
    mlp = trainer.policy.model.model.layers[0].mlp
    mlp.register_forward_pre_hook(lambda *_: mlp_calls.append(1))
    result["metrics"] = trainer.train_step(batch)
    result["mlp_calls"] = len(mlp_calls)
    result["compiled_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    result["params"] = {
        name: p.detach().full_tensor() for name, p in trainer.policy.model.named_parameters()
    }
    torch.save(result, out / f"{label}-rank{rank}.pt")
    trainer.close()


def _one_step(cfg: Config, batch: Batch, out: Path, label: str) -> list[dict]:
    mp.spawn(_step_main, args=(cfg, free_port(), batch, out, label), nprocs=2)
    return [torch.load(out / f"{label}-rank{r}.pt") for r in range(2)]


def test_fused_kernel_and_naive_path_give_the_same_logprobs_and_step(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    batch = make_batch(model, num_rows=6, seq_len=12, seed=3)
    results = {}
    for impl in ("fused", "naive"):
        cfg = trainer_config(tiny_model_dir, lr=1e-2, micro_batch_size=2, logprob_impl=impl)
        results[impl] = _one_step(cfg, batch, tmp_path, impl)
    for fused, naive in zip(results["fused"], results["naive"], strict=True):
        torch.testing.assert_close(fused["logprobs"], naive["logprobs"], rtol=1e-5, atol=1e-5)
    fused, naive = results["fused"][0], results["naive"][0]
    assert fused["metrics"]["actor/loss"] == pytest.approx(naive["metrics"]["actor/loss"], rel=1e-5)
    # Adam's first step moves each parameter by about lr * sign(grad): where a gradient is
    # ~0, rounding-level differences between the paths show up as up to ~1e-2 * 1e-2.
    for name, param in fused["params"].items():
        torch.testing.assert_close(param, naive["params"][name], rtol=1e-5, atol=1e-4)


def test_activation_checkpointing_recomputes_each_layer_and_gives_the_same_step(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    batch = make_batch(model, num_rows=6, seq_len=12, seed=4)
    results = {
        checkpointed: _one_step(
            trainer_config(
                tiny_model_dir, lr=1e-2, micro_batch_size=2, activation_checkpointing=checkpointed
            ),
            batch,
            tmp_path,
            f"checkpointed-{checkpointed}",
        )
        for checkpointed in (False, True)
    }
    plain, checkpointed = results[False][0], results[True][0]
    # 3 rows per rank in micro-batches of 2: 2 forwards, each run again in backward.
    assert (plain["mlp_calls"], checkpointed["mlp_calls"]) == (2, 4)
    assert torch.equal(plain["logprobs"], checkpointed["logprobs"])
    assert checkpointed["metrics"]["actor/loss"] == plain["metrics"]["actor/loss"]
    assert checkpointed["metrics"]["actor/grad_norm"] == pytest.approx(
        plain["metrics"]["actor/grad_norm"], rel=1e-6
    )
    for name, param in plain["params"].items():
        torch.testing.assert_close(checkpointed["params"][name], param, rtol=1e-6, atol=1e-7)


def test_compiled_layers_give_the_same_logprobs_and_step_with_and_without_checkpointing(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    batch = make_batch(model, num_rows=6, seq_len=12, seed=5)
    # 3 rows per rank in micro-batches of 2: two shapes, so the dynamic-shape graph runs too.
    runs = {
        (compiled, checkpointed): _one_step(
            trainer_config(
                tiny_model_dir,
                lr=1e-2,
                micro_batch_size=2,
                compile=compiled,
                activation_checkpointing=checkpointed,
            ),
            batch,
            tmp_path,
            f"compile-{compiled}-{checkpointed}",
        )[0]
        for compiled, checkpointed in ((False, False), (True, False), (True, True))
    }
    eager = runs.pop((False, False))
    assert eager["compiled_graphs"] == 0
    for label, compiled in runs.items():
        assert compiled["compiled_graphs"] >= 2, label
        torch.testing.assert_close(compiled["logprobs"], eager["logprobs"], rtol=1e-5, atol=1e-5)
        assert compiled["metrics"]["actor/loss"] == pytest.approx(
            eager["metrics"]["actor/loss"], rel=1e-5
        )
        assert compiled["metrics"]["actor/grad_norm"] == pytest.approx(
            eager["metrics"]["actor/grad_norm"], rel=1e-5
        )
        # As for the fused kernel against the naive path: Adam's first step turns
        # rounding-level gradient differences into up to ~1e-2 * 1e-2 where a gradient is ~0.
        for name, param in eager["params"].items():
            torch.testing.assert_close(compiled["params"][name], param, rtol=1e-5, atol=1e-4)


# ---- the Ray actor group ------------------------------------------------------------------


@pytest.fixture(scope="module")
def group(tiny_tied_model_dir: Path):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg = trainer_config(tiny_tied_model_dir, lr=1e-2, micro_batch_size=3, num_mini_batches=2)
    try:
        yield start_policy_ranks(cfg, Objective.from_config(cfg))
    finally:
        ray.shutdown()


def _sync(
    group: list, bucket_bytes: int, wire: str = "float32"
) -> tuple[dict[str, torch.Tensor], WeightSyncPlan]:
    """The ranks write every bucket through the shared buffers in `wire` dtype; returns what
    a reader saw."""
    specs, shape = ray.get(group[0].weight_sync_spec.remote())
    plan = plan_weight_sync(
        specs, shape, world_size=2, tp_size=1, bucket_bytes=bucket_bytes, wire_dtype=wire
    )
    prefix = channel_prefix()
    spec = SharedMemorySpec(prefix)
    received: dict[str, torch.Tensor] = {}
    try:
        ray.get(group[0].open_weight_sender.remote(plan_to_json(plan), spec))
        ray.get(group[1].open_weight_sender.remote(plan_to_json(plan), spec))
        slots = open_slots(slot_paths(prefix), plan.slot_numel, wire)
        for bucket in range(len(plan.buckets)):
            ray.get([w.write_weight_bucket.remote(bucket) for w in group])
            for name, tensor in bucket_tensors(slots[bucket % 2], plan, bucket):
                assert name not in received
                received[name] = tensor.clone()
    finally:
        remove_slots(prefix)
    return received, plan


def _checksum(group: list) -> float:
    return ray.get([w.parameter_checksum.remote() for w in group])[0]  # collective


@pytest.mark.parametrize(("wire", "element"), [("float32", 4), ("bfloat16", 2)])
def test_sync_buffers_carry_hf_names_with_a_tied_embedding_once_in_the_wire_dtype(
    group: list, tiny_tied_model_dir: Path, wire: str, element: int
) -> None:
    bucket_bytes = 40_000
    received, plan = _sync(group, bucket_bytes, wire)
    checkpoint = load_file(tiny_tied_model_dir / "model.safetensors")
    assert "lm_head.weight" not in checkpoint  # tied: saved once, under the embedding's name
    assert sorted(received) == sorted(checkpoint)  # and sent once: vLLM ties it back
    for name, tensor in checkpoint.items():
        # The fp32 weights rounded to the wire dtype, as an engine in that dtype loads them.
        assert torch.equal(received[name], tensor.to(getattr(torch, wire))), name
    assert len(plan.buckets) > 1
    for bucket in plan.buckets:  # over budget only when one load unit alone is
        size = sum(s.num_rows * s.num_cols * element for s in bucket)
        assert size <= bucket_bytes or len({load_unit(s.name) for s in bucket}) == 1


def test_train_step_updates_parameters(group: list, tiny_tied_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_tied_model_dir, dtype=torch.float32)
    batch = make_batch(model.eval(), num_rows=16, seq_len=12, seed=1)
    before = _checksum(group)
    batch_ref = ray.put(batch)
    results = ray.get([w.train_step.remote(batch_ref) for w in group])
    after = _checksum(group)
    assert after != pytest.approx(before, rel=1e-6)
    metrics = results[0]
    for key in ("pg_loss", "clip_frac", "entropy", "kl_ref", "grad_norm", "lr", "loss"):
        assert math.isfinite(metrics[f"actor/{key}"]), key
    assert metrics["actor/lr"] == 1e-2 and metrics["actor/grad_norm"] > 0
    assert metrics["timing/train_step_s"] > 0
    for key, value in metrics.items():  # reduced over ranks: only timings may differ
        if key.startswith("actor/"):
            assert results[1][key] == pytest.approx(value, rel=1e-6), key


def test_export_hf_round_trips_and_matches_synced_weights(group: list, tmp_path: Path) -> None:
    out_dir = tmp_path / "export"
    ray.get([w.export_hf.remote(str(out_dir)) for w in group])
    exported = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    assert exported.config.tie_word_embeddings
    received, _ = _sync(group, bucket_bytes=1 << 20)
    state = exported.state_dict()
    assert sorted(state) == sorted([*received, "lm_head.weight"])
    for name, tensor in state.items():
        source = "model.embed_tokens.weight" if name == "lm_head.weight" else name
        assert torch.equal(tensor, received[source]), name

    batch = make_batch(exported, num_rows=5, seq_len=10, seed=2)
    batch_ref = ray.put(batch)
    parts = ray.get([w.compute_logprobs.remote(batch_ref) for w in group])
    assert torch.equal(parts[0], parts[1])
    with torch.no_grad():
        expected, _ = hf_logprobs(exported, batch)
    expected = expected * batch.attention_mask[:, 1:]  # padding targets score 0
    torch.testing.assert_close(parts[0], expected, rtol=1e-5, atol=1e-5)
    assert (out_dir / "tokenizer.json").exists()
