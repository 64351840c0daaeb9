"""Weight sync of a Qwen2.5-0.5B-shaped model (random weights, fp32) on CPU: a 2-rank FSDP2
trainer group into one vLLM engine with TP = 1 and TP = 2, against the memcpy lower bound.

    .venv/bin/python bench/weight_sync.py [--syncs 3] [--bucket-mb 64] [--demo-steps 20]
        [--dtypes float32,bfloat16] [--transports shared_memory,distributed,gathered] [--quick]

Each measurement runs in a child process that starts Ray, the trainer group and the engine:
  time    per TP size and transport (shared_memory, distributed): the end-to-end seconds of a
          sync (trainer writes, vLLM's reload, prefix-cache reset, version bump), median over
          --syncs after a warm-up sync;
  memory  the same again with glibc returning every freed block of 1 MiB or more
          at once (MALLOC_MMAP_THRESHOLD_), so that peak resident memory tracks live
          allocations, not the allocator's cache: each process's peak extra bytes in a sync;
  floor   vLLM's own reload of the whole model from memory in one call (no transport);
  demo    the CPU demo recipe for --demo-steps steps: sync time as a fraction of a step;
  overlap on shared memory, each timed sync alternates with one whose next bucket is written
          only once the current one is loaded everywhere: the overlap's gain.
The memcpy bound is one torch copy of the bytes the rollout ranks load (all ranks together),
timed in this process in the same run. Each of --dtypes is a run's `model.dtype`, the
dtype weights travel in. --quick times the syncs only (no memory, floor or demo).
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / ".cache" / "bench" / "qwen2.5-0.5b-random"
# Qwen2.5-0.5B: 24 layers, hidden 896, 14 heads / 2 kv heads, MLP 4864, tied embeddings.
QWEN25_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151_936,
}


def build_model() -> Path:
    """The random 0.5B-shaped checkpoint (built once; the tiny tokenizer is enough to run)."""
    if (MODEL_DIR / "config.json").exists():
        return MODEL_DIR
    sys.path.insert(0, str(REPO))
    from tests.helpers.models import build_checkpoint

    return build_checkpoint(MODEL_DIR, "qwen2", True, **QWEN25_05B)


def _child(tp_size: int, transport: str, num_syncs: int, bucket_mb: float, dtype: str) -> dict:
    import ray

    from rl.cluster.reservation import reserve
    from rl.cluster.rollout_replicas import RolloutReplicas
    from rl.cluster.trainer_ranks import PolicyRanks
    from rl.config import Config
    from rl.sync.weight_sync import WeightSync

    cfg = Config.model_validate(
        {
            "model": {"path": str(MODEL_DIR), "dtype": dtype},
            "rollout": {
                "num_workers": 1,
                "tensor_parallel_size": tp_size,
                "kv_cache_gb": 0.25,
                "max_model_len": 128,
                "weight_bucket_mb": bucket_mb,
                "weight_transport": transport,
            },
            "trainer": {"num_workers": 2},
        }
    )
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    placement = reserve(cfg)
    sharing = placement.plan.num_roles_sharing
    rollout = RolloutReplicas(cfg, placement, sharing)
    trainers = PolicyRanks(cfg, placement, sharing)
    sync = WeightSync(cfg, trainers, rollout)
    runs = [sync.push(1)]  # a warm-up
    serial = []
    for version in range(2, 2 * num_syncs + 2, 2):
        runs.append(sync.push(version))
        if sync.transport == "shared_memory":  # the same sync without the overlap, in turn
            serial.append(_serial_sync(trainers, rollout, len(sync.plan.buckets), version + 1))
    sync.close()
    ray.shutdown()
    plan = sync.plan
    return {
        "seconds": [run["weight_sync/seconds"] for run in runs[1:]],
        "serial_seconds": serial,
        "write_s": [run["weight_sync/trainer_write_s"] for run in runs[1:]],
        "load_s": [run["weight_sync/rollout_load_s"] for run in runs[1:]],
        "trainer_peak_mb": max(run["weight_sync/trainer_peak_extra_mb"] for run in runs[1:]),
        "rollout_peak_mb": max(run["weight_sync/rollout_peak_extra_mb"] for run in runs[1:]),
        "first_rollout_peak_mb": runs[0]["weight_sync/rollout_peak_extra_mb"],
        "bytes_per_rank": plan.bytes_to_rank(0),
        "bytes_loaded": sum(plan.bytes_to_rank(t) for t in range(tp_size)),
        "bytes_full": plan.total_bytes,
        "num_buckets": len(plan.buckets),
        "largest_bucket_mb": plan.slot_numel * plan.bytes_per_element / (1 << 20),
    }


def _serial_sync(trainers, rollout, num_buckets: int, version: int) -> float:
    """Seconds of a shared-memory sync whose next write starts only once the current bucket
    is loaded everywhere (no overlap): what `WeightSync.stream` did before it wrote bucket
    i + 1 while bucket i loads."""
    import ray

    start = time.perf_counter()
    for bucket in range(num_buckets):
        ray.get([w.write_weight_bucket.remote(bucket) for w in trainers.workers])
        last = bucket + 1 == num_buckets
        ray.get([r.apply_weight_bucket.remote(bucket, version, last) for r in rollout.workers])
    return time.perf_counter() - start


def _run_child(args: argparse.Namespace, *child: str, memory: bool = False) -> dict:
    env = dict(os.environ)
    if memory:
        env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    command = [sys.executable, __file__, "--syncs", str(args.syncs)]
    command += ["--bucket-mb", str(args.bucket_mb), *child]
    out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{child} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _reload_floor(num_repeats: int = 3) -> dict:
    """vLLM's own in-place reload of the whole model from tensors already in memory, in one
    call, with the thread count a rollout actor gets here: what any transport pays on top."""
    os.environ["OMP_NUM_THREADS"] = "1"
    from safetensors.torch import load_file

    from rl.config import RolloutConfig
    from rollout.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(
        str(MODEL_DIR), RolloutConfig(kv_cache_gb=0.25, max_model_len=128), "float32", 0
    )
    state = load_file(MODEL_DIR / "model.safetensors")
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied, as a sync sends it
    named = list(state.items())
    seconds = []
    for _ in range(num_repeats):
        start = time.perf_counter()
        engine._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named})
        seconds.append(time.perf_counter() - start)
    return {"seconds": seconds}


def _demo_sync_fraction(num_steps: int) -> dict:
    """Median weight-sync seconds over median step seconds of the CPU demo recipe."""
    run_name = "bench-weight-sync"
    command = [
        str(REPO / ".venv" / "bin" / "rl"),
        "train",
        "recipes/grpo_addition_cpu.yaml",
        f"run.num_steps={num_steps}",
        "run.eval_every=0",
        "run.export_hf=false",
        f"run.name={run_name}",
        f"run.output_dir={REPO / 'runs'}",
    ]
    shutil.rmtree(REPO / "runs" / run_name, ignore_errors=True)  # the benchmark's own run
    subprocess.run(command, cwd=REPO, check=True, capture_output=True)
    metrics_file = REPO / "runs" / run_name / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    steps = [m for m in steps if "time/sync_s" in m]
    return {
        "sync_s": statistics.median(m["time/sync_s"] for m in steps),
        "step_s": statistics.median(m["time/step_s"] for m in steps),
        "num_steps": len(steps),
    }


def memcpy_seconds(num_bytes: int, repeats: int = 3) -> float:
    """Fastest of `repeats` torch copies of `num_bytes` between two warmed-up buffers."""
    import torch

    src = torch.ones(num_bytes // 4)  # fp32: the copy's speed does not depend on the dtype
    dst = torch.zeros_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--demo-steps", type=int, default=20)
    parser.add_argument("--child", type=int)
    parser.add_argument("--transport", default="shared_memory")
    parser.add_argument("--floor", action="store_true")
    parser.add_argument("--dtype", default="float32")  # a child's
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--transports", default="shared_memory,distributed")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.floor:
        print(json.dumps(_reload_floor()))
        return
    if args.child:
        child = _child(args.child, args.transport, args.syncs, args.bucket_mb, args.dtype)
        print(json.dumps(child))
        return
    build_model()
    print(
        "| dtype | TP | transport | MiB per rollout rank (sliced / full) | sync s (median) | trainer "
        "write s | vLLM load + process s | memcpy bound s | ratio to bound | peak extra MiB "
        "trainer / rollout (largest bucket) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    mib = 1 << 20
    overlap = []  # (TP, pipelined s, serial s) of the shared-memory rows
    for dtype, tp_size, transport in itertools.product(
        args.dtypes.split(","), (1, 2), args.transports.split(",")
    ):
        child = ("--child", str(tp_size), "--transport", transport, "--dtype", dtype)
        timed = _run_child(args, *child)
        seconds = statistics.median(timed["seconds"])
        bound = memcpy_seconds(timed["bytes_loaded"])
        peaks = "not measured (--quick)"
        if not args.quick:
            memory = _run_child(args, *child, memory=True)
            peaks = (
                f"{memory['trainer_peak_mb']:.0f} / {memory['rollout_peak_mb']:.0f} "
                f"({timed['largest_bucket_mb']:.0f})"
            )
        print(
            f"| {dtype} | {tp_size} | {transport} | {timed['bytes_per_rank'] / mib:.0f} / "
            f"{timed['bytes_full'] / mib:.0f} | {seconds:.2f} | "
            f"{statistics.median(timed['write_s']):.2f} | "
            f"{statistics.median(timed['load_s']):.2f} | {bound:.2f} | "
            f"{seconds / bound:.1f}x | {peaks} |",
            flush=True,
        )
        print(f"<!-- {dtype} TP={tp_size} {transport}: {json.dumps(timed)} -->")
        if timed["serial_seconds"]:
            serial = statistics.median(timed["serial_seconds"])
            overlap.append((dtype, tp_size, seconds, serial))
    print("\n| dtype | TP | shared memory, bucket i + 1 written while i loads: sync s | one "
          "after the other: sync s | pipelined / serial |")  # fmt: skip
    print("|---|---|---|---|---|")
    for dtype, tp_size, pipelined, serial in overlap:
        print(
            f"| {dtype} | {tp_size} | {pipelined:.2f} | {serial:.2f} | {pipelined / serial:.2f} |"
        )
    if args.quick:
        return
    floor = statistics.median(_run_child(args, "--floor")["seconds"])
    print(f"\nvLLM's own reload of the whole model from memory (TP=1, one call): {floor:.2f} s")
    demo = _demo_sync_fraction(args.demo_steps)
    print(
        f"demo recipe ({demo['num_steps']} steps): sync {demo['sync_s']:.3f} s of a "
        f"{demo['step_s']:.2f} s step ({demo['sync_s'] / demo['step_s']:.1%})"
    )


if __name__ == "__main__":
    main()
