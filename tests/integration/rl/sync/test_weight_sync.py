"""Weight sync on real components: a 2-rank FSDP2 trainer group (gloo) streams its shards through
shared memory into vLLM engines with TP = 1 and TP = 2, and into the PyTorch engine, for Qwen2
and Llama, tied and untied.
After a large update the engines' log-probs equal the trainer's; a receiver killed mid-transfer
is replaced and served the whole current version; a half-applied update is never served."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray
import torch
from ray.actor import ActorHandle

from rl.cluster.reservation import Placement, reserve
from rl.cluster.rollout_replicas import RolloutReplicas
from rl.cluster.trainer_ranks import PolicyRanks
from rl.config import Config
from rl.shm_owners import SHM_DIR
from rl.sync.weight_sync import WeightSync
from rl.types import Batch, Sample, SamplingParams, fresh_samples
from tests.helpers.models import build_checkpoint

pytestmark = pytest.mark.integration

MEDIUM = {  # 16M parameters, so buckets of MiBs dwarf the allocator's noise
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "vocab_size": 4096,
}
# name: (arch, tied, TP, replicas, bucket MiB, frozen patterns, model sizes, transport, engine)
SETUPS = {
    "qwen2-tied-tp2": ("qwen2", True, 2, 2, 0.02, [], {}, "auto", "vllm"),
    "qwen2-medium-untied-tp1": (
        "qwen2",
        False,
        1,
        2,
        2.0,
        ["model.embed_tokens.*"],
        MEDIUM,
        "auto",
        "vllm",
    ),
    "llama-tied-tp1": ("llama", True, 1, 1, 0.02, [], {}, "auto", "vllm"),
    # The cross-host transport, on one host: each rank receives only its regions' bytes.
    "llama-untied-tp2-gloo": ("llama", False, 2, 2, 0.02, [], {}, "distributed", "vllm"),
    "qwen2-medium-untied-tp1-gloo": (
        "qwen2",
        False,
        1,
        1,
        2.0,
        [],
        MEDIUM,
        "distributed",
        "vllm",
    ),
    # A compiled model reads the weights a sync writes in place, like an eager one.
    "qwen2-untied-tp1-compiled": ("qwen2", False, 1, 1, 0.02, [], {}, "auto", "vllm"),
    "qwen2-tied-torch": ("qwen2", True, 1, 2, 0.02, [], {}, "auto", "torch"),
    # LoRA adapters (model.lora): only they travel, under the trainer's peft names.
    "qwen2-untied-torch-lora": ("qwen2", False, 1, 1, 0.02, [], {}, "auto", "torch"),
    "qwen2-untied-tp1-lora": ("qwen2", False, 1, 1, 0.02, [], {}, "auto", "vllm"),
    "qwen2-tied-tp2-lora": ("qwen2", True, 2, 1, 0.02, [], {}, "auto", "vllm"),
    "llama-untied-torch-gloo": ("llama", False, 1, 1, 0.02, [], {}, "distributed", "torch"),
    # Each bucket all-gathered by the trainer ranks into their own slots, in bf16 (the wire
    # dtype of a bf16 run) read by the engines there: the GPU transport's protocol on CPU.
    "qwen2-untied-tp1-gathered-bf16": ("qwen2", False, 1, 2, 0.02, [], {}, "gathered", "vllm"),
}
BF16 = {"qwen2-untied-tp1-gathered-bf16"}  # setups whose model.dtype is bfloat16
COMPILED = {"qwen2-untied-tp1-compiled"}  # setups whose engines run rollout.compile=true
LORA_RANK = {
    "qwen2-untied-torch-lora": 8,
    "qwen2-untied-tp1-lora": 8,
    "qwen2-tied-tp2-lora": 4,
}  # setups with model.lora (else rank 0: off)
SEQUENCES = torch.randint(4, 250, (4, 24), generator=torch.Generator().manual_seed(1)).tolist()


@dataclass
class Setup:
    name: str  # a key of SETUPS
    cfg: Config
    placement: Placement
    rollout: RolloutReplicas
    trainers: PolicyRanks
    sync: WeightSync


@pytest.fixture(scope="module")
def ray_cluster():
    # Make resident memory track live allocations: glibc otherwise keeps freed blocks of
    # 1 MiB and more mapped, and a sync's peak would measure the allocator, not the sync.
    # Ray's workers inherit the environment of the local cluster started here.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    # Logical CPUs: up to 4 bundles (2 replicas x TP 2) time-share this machine's cores.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        del os.environ["MALLOC_MMAP_THRESHOLD_"]


@pytest.fixture(scope="module", params=list(SETUPS))
def setup(request: pytest.FixtureRequest, ray_cluster: None):
    arch, tied, tp, replicas, bucket_mb, frozen, sizes, transport, engine = SETUPS[request.param]
    model_dir = build_checkpoint(Path(tempfile.mkdtemp()) / request.param, arch, tied, **sizes)
    cfg = Config.model_validate(
        {
            "model": {
                "path": str(model_dir),
                "dtype": "bfloat16" if request.param in BF16 else "float32",
                "frozen": frozen,
                "lora": {"rank": LORA_RANK.get(request.param, 0)},
            },
            "rollout": {
                "engine": engine,
                "num_workers": replicas,
                "tensor_parallel_size": tp,
                "kv_cache_gb": 0.0625,
                "max_model_len": 64,
                "weight_bucket_mb": bucket_mb,
                "weight_transport": transport,
                "compile": True if request.param in COMPILED else None,
            },
            "trainer": {"num_workers": 2, "lr": 1e-2},
            # Actors log to Ray, not to a run directory under the working directory.
            "run": {"verbose": True},
        }
    )
    placement = reserve(cfg)
    sharing = placement.plan.num_roles_sharing
    rollout = RolloutReplicas(cfg, placement, sharing)
    trainers = PolicyRanks(cfg, placement, sharing)
    sync = WeightSync(cfg, trainers, rollout)
    try:
        yield Setup(request.param, cfg, placement, rollout, trainers, sync)
    finally:
        sync.close()
        rollout.close()  # vLLM's worker processes and shared memory go with their engine
        for actor in rollout.workers + trainers.workers:
            ray.kill(actor)
        placement.release()


def _batch() -> Batch:
    ids = torch.tensor(SEQUENCES)
    ones = torch.ones(ids.shape[0], ids.shape[1] - 1)
    return Batch(ids, torch.ones_like(ids), ones, ones, ones, ones)


def _large_update(setup: Setup) -> None:
    """Three AdamW steps at lr 1e-2 on random advantages: every trained weight moves."""
    batch = _batch()
    batch.old_logprobs = batch.behaviour_logprobs = setup.trainers.compute_logprobs(batch)
    batch.advantages = torch.randn(
        batch.num_sequences, 1, generator=torch.Generator().manual_seed(0)
    )
    batch.advantages = batch.advantages * batch.loss_mask
    for _ in range(3):
        setup.trainers.train_step(batch)


def _gaps(setup: Setup, workers: list | None = None) -> list[float]:
    """Per rollout worker: the largest |log-prob gap| to the trainer over SEQUENCES (T = 1)."""
    trainer = setup.trainers.compute_logprobs(_batch())
    gaps = []
    for worker in workers or setup.rollout.workers:
        scored = ray.get(worker.score.remote(SEQUENCES, [1] * len(SEQUENCES)))
        gaps.append(
            max((torch.tensor(s) - trainer[i]).abs().max().item() for i, s in enumerate(scored))
        )
    return gaps


def _tolerance(setup: Setup) -> float:
    """The largest log-prob gap of an engine serving the trainer's weights. In fp32 both
    sides agree to rounding; in bf16 vLLM's kernels and the trainer's round differently, the
    more so as the large updates sharpen the model, yet an engine a version behind is an
    order of magnitude further off (docs/benchmarks.md)."""
    return 0.1 if setup.cfg.model.dtype == "bfloat16" else 1e-4


def test_rollout_logprobs_equal_the_trainers_after_a_large_update(setup: Setup) -> None:
    assert max(_gaps(setup)) < _tolerance(setup)
    _large_update(setup)
    assert min(_gaps(setup)) > max(1e-2, 10 * _tolerance(setup))  # it sees stale weights
    version = 1 + max(setup.rollout.versions())
    # The time-sliced handover's calls around a push (rl.run.scheduler.loop), through every actor: on
    # CPU nothing moves, but each call must reach its engine or rank.
    setup.rollout.release_memory()
    setup.rollout.reclaim_weights()
    metrics = setup.sync.push(version)
    setup.trainers.release_memory()
    setup.rollout.reclaim_memory()
    assert max(_gaps(setup)) < _tolerance(setup)
    assert setup.sync.transport == SETUPS[setup.name][7].replace("auto", "shared_memory")
    assert setup.rollout.versions() == [version] * len(setup.rollout.workers)
    # Each engine's largest TP rank (its own process with TP 2), the sync's peak included.
    peak_mb = setup.rollout.peak_memory_mb()
    assert 100 < peak_mb < 32_768
    assert peak_mb >= metrics["weight_sync/rollout_peak_extra_mb"]

    plan = setup.sync.plan
    if setup.cfg.model.lora.enabled:  # the adapters only: A and B of each targeted linear
        names = {spec.name for spec in plan.tensors}
        layers, targets = 2, len(setup.cfg.model.lora.target_modules)  # build_checkpoint: 2 layers
        assert len(names) == layers * targets * 2
        assert all(".lora_A.default.weight" in n or ".lora_B.default.weight" in n for n in names)
        # Whole to every TP rank: vLLM slices an adapter itself.
        assert metrics["weight_sync/mb_per_rollout_rank"] * (1 << 20) == plan.total_bytes
        # The next versions replace the served adapter: parity after each sync.
        for later in (version + 1, version + 2):
            _large_update(setup)
            setup.sync.push(later)
            assert setup.rollout.versions() == [later] * len(setup.rollout.workers)
            assert max(_gaps(setup)) < _tolerance(setup)
        return
    assert metrics["weight_sync/buckets"] == len(plan.buckets) > 2
    sent = metrics["weight_sync/mb_per_rollout_rank"] * (1 << 20)
    assert sent == plan.bytes_to_rank(0)
    if setup.cfg.rollout.tensor_parallel_size == 2:  # each rank reads about half the model
        assert sent < 0.75 * plan.total_bytes
    else:
        assert sent == plan.total_bytes
    names = {spec.name for spec in plan.tensors}
    tied = SETUPS[setup.name][1]
    assert ("lm_head.weight" in names) != tied  # a tied one travels once, as the embedding
    if setup.cfg.model.frozen:
        assert "model.embed_tokens.weight" not in names  # frozen: never re-sent
        assert "model.layers.0.input_layernorm.weight" in names  # the rest is
    else:
        assert "model.embed_tokens.weight" in names


# The medium model: its buckets of MiBs dwarf the allocator's noise.
@pytest.mark.parametrize(
    "setup", ["qwen2-medium-untied-tp1", "qwen2-medium-untied-tp1-gloo"], indirect=True
)
def test_peak_memory_of_a_sync_stays_within_two_buckets(setup: Setup) -> None:
    """Each process's resident memory over one sync grows by at most 2 buckets, after the
    first sync, which also sets up the transport's reused buffers (shared memory: two
    slots per host; distributed: packing and receiving buffers)."""
    setup.sync.push(1 + max(setup.rollout.versions()))  # the shared buffers are mapped
    _large_update(setup)
    metrics = setup.sync.push(1 + max(setup.rollout.versions()))
    largest_bucket = max(
        4 * sum(s.num_rows * s.num_cols for s in bucket) for bucket in setup.sync.plan.buckets
    ) / (1 << 20)
    margin_mb = 4.0
    assert metrics["weight_sync/mb_full_model"] > 4 * largest_bucket  # buckets << model
    # The trainer writes views of its shards into buffers it mapped at the first sync.
    assert metrics["weight_sync/trainer_peak_extra_mb"] <= 2 * largest_bucket + margin_mb
    # vLLM re-materialises and re-processes each layer it loads: the measurement sees it.
    peak = metrics["weight_sync/rollout_peak_extra_mb"]
    assert largest_bucket <= peak <= 2 * largest_bucket + margin_mb, (peak, largest_bucket)


@pytest.mark.parametrize(
    "setup", ["qwen2-tied-tp2", "qwen2-untied-tp1-gathered-bf16"], indirect=True
)
def test_a_receiver_killed_mid_transfer_is_replaced_and_gets_the_whole_version(
    setup: Setup,
) -> None:
    _large_update(setup)
    version = 1 + max(setup.rollout.versions())
    victim = setup.rollout.workers[1]
    # The shared memory the victim's vLLM (TP 2: its executor and two worker processes) made.
    tp2 = setup.cfg.rollout.tensor_parallel_size == 2
    pid = ray.get(victim.__ray_call__.remote(lambda _: os.getpid()))
    records = list(SHM_DIR.glob(f"tandem-vllm-*-{pid}-*.json"))
    # An engine without tensor parallelism maps none here, and so records none.
    segments = [name for record in records for name in json.loads(record.read_text())]
    assert len(records) == (1 if tp2 else 0) and bool(segments) == tp2
    assert all((SHM_DIR / name).exists() for name in segments)
    for bucket in setup.sync.stream(version):
        if bucket == 1:
            ray.kill(victim, no_restart=True)
    assert setup.sync.failed == [1]
    survivor = setup.rollout.workers[0]
    assert ray.get(survivor.version.remote()) == version  # the others carried on
    assert max(_gaps(setup, [survivor])) < _tolerance(setup)

    setup.sync.repair(version)
    assert setup.rollout.workers[1] is not victim
    # The replacement, starting on the same host, removed what the killed engine left.
    assert not any(record.exists() for record in records)
    assert not any((SHM_DIR / name).exists() for name in segments)
    assert setup.rollout.versions() == [version, version]
    assert max(_gaps(setup)) < _tolerance(setup)

    _large_update(setup)  # the trainer carries on: the next sync reaches both
    setup.sync.push(version + 1)
    assert max(_gaps(setup)) < _tolerance(setup)


@pytest.mark.parametrize("setup", ["llama-untied-tp2-gloo"], indirect=True)
def test_a_receiver_lost_mid_transfer_over_gloo_is_replaced_and_the_group_re_formed(
    setup: Setup,
) -> None:
    """A gloo group breaks with a lost member: the stream stops there, the survivor is left
    part-way (and refuses to serve), and repair re-forms the group and brings both workers to
    the version, with no wait for gloo's timeout."""
    _large_update(setup)
    served = setup.rollout.versions()
    version = 1 + max(served)
    victim, survivor = setup.rollout.workers[1], setup.rollout.workers[0]
    start = time.monotonic()
    streamed = []
    for bucket in setup.sync.stream(version):
        streamed.append(bucket)
        if bucket == 1:
            ray.kill(victim, no_restart=True)
    assert setup.sync.failed == [1]
    assert len(streamed) < len(setup.sync.plan.buckets)  # stopped at the loss
    assert ray.get(survivor.version.remote()) == served[0]  # part-way: not the new version
    with pytest.raises(ray.exceptions.RayTaskError, match="partly applied weight update"):
        params = SamplingParams(n=1, max_new_tokens=2, temperature=1.0)
        ray.get(survivor.generate.remote(fresh_samples([SEQUENCES[0][:4]], 1, [0]), params))

    setup.sync.repair(version)
    # A hang guard, far below gloo's 10-minute timeout and far above this repair's work.
    assert time.monotonic() - start < 300
    assert setup.rollout.workers[1] is not victim
    assert setup.rollout.versions() == [version, version]
    assert max(_gaps(setup)) < _tolerance(setup)

    _large_update(setup)  # the re-formed group carries the next sync to both
    setup.sync.push(version + 1)
    assert setup.rollout.versions() == [version + 1, version + 1]
    assert max(_gaps(setup)) < _tolerance(setup)

    # A worker lost while generating is replaced alone: the trainers send only to it (a send
    # to the other member, which takes no part, would never complete).
    setup.sync.replace([0], version + 1)
    assert setup.rollout.versions() == [version + 1, version + 1]
    assert max(_gaps(setup)) < _tolerance(setup)


@pytest.mark.parametrize("setup", ["qwen2-tied-tp2", "qwen2-tied-torch"], indirect=True)
def test_a_partly_applied_update_is_never_served(setup: Setup) -> None:
    _large_update(setup)
    worker = setup.rollout.workers[0]
    served = ray.get(worker.version.remote())
    version = served + 1
    # The trainer wrote bucket 0; the update stops after the worker applied it.
    ray.get([w.write_weight_bucket.remote(0) for w in setup.trainers.workers])
    ray.get(worker.apply_weight_bucket.remote(0, version, False))
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=4)
    with pytest.raises(ray.exceptions.RayTaskError, match="partly applied weight update"):
        ray.get(worker.generate.remote(fresh_samples([[5, 6, 7]], 1, [0]), params))
    with pytest.raises(ray.exceptions.RayTaskError, match="partly applied"):
        ray.get(worker.score.remote(SEQUENCES, [1] * len(SEQUENCES)))
    assert ray.get(worker.version.remote()) == served

    setup.sync.push(version)  # the next sync succeeds and the worker serves again
    assert max(_gaps(setup)) < _tolerance(setup)
    samples = ray.get(worker.generate.remote(fresh_samples([[5, 6, 7]], 1, [0]), params))
    assert samples[0].token_versions == [version] * len(samples[0].response_ids)


STOP_EVERY = 4


def _stopped_at_an_abort_point(worker: ActorHandle, params: SamplingParams) -> list[Sample]:
    """32 fresh samples generated on `worker` with abort points every STOP_EVERY tokens: those
    still running at their STOP_EVERY-th token come back partial there."""
    batch = fresh_samples([[5, 6, 7]] * 32, 1, list(range(32)))
    stopping = dataclasses.replace(params, stop_every=STOP_EVERY)
    return ray.get(worker.generate.remote(batch, stopping), timeout=60)


def _interrupted_after_two_steps(
    worker: ActorHandle, version: int, params: SamplingParams
) -> list[Sample]:
    """32 fresh samples started on `worker` and interrupted once the engine has taken two
    steps, whatever the machine's speed: a pacer sample started with them, 2 tokens short of
    `params.max_new_tokens`, finishes at the second step (a step samples a token for every
    running sample), and the interrupt goes out as soon as its batch comes back. The other
    samples then have about 2 of their up to 56 tokens."""
    batch = fresh_samples([[5, 6, 7]] * 32, 1, list(range(32)))
    done = params.max_new_tokens - 2
    pacer = Sample([5, 6, 7], group_id=100, response_ids=[8] * done, logprobs=[-1.0] * done)
    pacer.token_versions, pacer.finish_reason = [version] * done, "abort"  # a partial sample
    # One call, so both are in the engine's first step; straight to the worker, so both are
    # on the same engine (RolloutReplicas.submit spreads batches over workers).
    ray.get(worker.start.remote({0: batch, 1: [pacer]}, params))
    finished = ray.get(worker.poll.remote(), timeout=60)
    assert 1 in finished, "the long batch finished before the pacer"
    ray.get(worker.interrupt.remote())
    while 0 not in finished:
        finished |= ray.get(worker.poll.remote(), timeout=60)
    assert finished[1][0].finish_reason in ("stop", "length")  # the pacer was not aborted
    return finished[0]


@pytest.mark.parametrize(
    "setup, how",
    [
        ("llama-tied-tp1", "abort point"),
        ("qwen2-tied-torch", "abort point"),
        ("llama-tied-tp1", "interrupt"),
    ],
    indirect=["setup"],
)
def test_an_aborted_generation_resumes_under_new_weights_with_its_prefix(
    setup: Setup, how: str
) -> None:
    """A partial rollout: stopped at an abort point, or interrupted as a sync comes due;
    resumed under the new weights, its prefix stays, each token records the version that
    sampled it, and each token's behaviour log-prob is that version's."""
    worker = setup.rollout.workers[0]
    version = ray.get(worker.version.remote())
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=56, seed=5)
    if how == "abort point":
        samples = _stopped_at_an_abort_point(worker, params)
        partial = [s for s in samples if s.is_partial]
        assert partial and all(len(s.response_ids) == STOP_EVERY for s in partial)
        assert all(s.finish_reason == "stop" for s in samples if len(s.response_ids) < STOP_EVERY)
    else:
        # A try misses only if the interrupt's round trip outlasts the rest of the generation.
        for _ in range(3):
            samples = _interrupted_after_two_steps(worker, version, params)
            partial = [s for s in samples if s.is_partial and s.response_ids]
            if partial:
                break
        assert partial, "no generation was caught mid-way"
    prefixes = [list(s.response_ids) for s in partial]

    _large_update(setup)
    setup.sync.push(version + 1)
    worker_index = setup.rollout.submit({0: partial}, params)[0]
    resumed = setup.rollout.poll(worker_index).result(timeout=60)[0]
    scored = ray.get(
        worker.score.remote([s.prompt_ids + s.response_ids for s in resumed], [3] * len(resumed))
    )
    for sample, prefix, new_logprobs in zip(resumed, prefixes, scored, strict=True):
        n = len(prefix)
        assert sample.finish_reason in ("stop", "length") and sample.response_ids[:n] == prefix
        assert len(sample.response_ids) > n
        assert sample.token_versions == [version] * n + [version + 1] * (
            len(sample.response_ids) - n
        )
        # The resumed tokens' behaviour log-probs are the new weights' (T = 1) ...
        assert (
            torch.tensor(sample.logprobs[n:]) - torch.tensor(new_logprobs[n:])
        ).abs().max() < 1e-4
    # ... and the prefix's are the old ones', which the large update moved.
    assert (
        max(
            (torch.tensor(s.logprobs[: len(p)]) - torch.tensor(new[: len(p)])).abs().max().item()
            for s, p, new in zip(resumed, prefixes, scored, strict=True)
        )
        > 1e-2
    )
