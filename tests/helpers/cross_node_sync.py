"""A weight sync across the nodes of a running Ray cluster, whose rollout worker is killed in
the middle of it, run as its own process (a Ray client must see the cluster's auth settings
when it imports Ray): `python -m tests.helpers.cross_node_sync HEAD MODEL_DIR` prints one JSON
line of what happened, for tests/e2e/test_ray_cluster.py to judge."""

from __future__ import annotations

import json
import sys
import time

import ray
import torch

from rl.cluster.reservation import reserve
from rl.cluster.rollout_replicas import RolloutReplicas
from rl.cluster.trainer_ranks import PolicyRanks
from rl.config import Config
from rl.sync.weight_sync import WeightSync
from rl.types import Batch


def main(head: str, model_dir: str) -> dict:
    cfg = Config.model_validate(
        {
            "model": {"path": model_dir},
            "rollout": {
                "num_workers": 1,
                "kv_cache_gb": 0.0625,
                "max_model_len": 64,
                "weight_bucket_mb": 0.02,  # many buckets: the loss lands mid-stream
            },
            "trainer": {"num_workers": 2, "lr": 1e-2},
            # The 2-rank trainer fits only the 2-CPU node, the rollout worker the head.
            "scheduler": {"placement": "split", "rollout_devices": 1, "devices_per_node": 2},
            "run": {"verbose": True},
        }
    )
    sequences = torch.randint(4, 250, (4, 24), generator=torch.Generator().manual_seed(1))
    ones = torch.ones(4, 23)
    batch = Batch(sequences, torch.ones_like(sequences), ones, ones, ones, ones)
    ray.init(address=head, log_to_driver=False)
    placement = reserve(cfg)
    rollout = RolloutReplicas(cfg, placement, placement.plan.num_roles_sharing)
    trainers = PolicyRanks(cfg, placement, placement.plan.num_roles_sharing)
    sync = WeightSync(cfg, trainers, rollout)
    batch.old_logprobs = batch.behaviour_logprobs = trainers.compute_logprobs(batch)
    batch.advantages = torch.randn(4, 1, generator=torch.Generator().manual_seed(0)) * ones
    trainers.train_step(batch)

    start = time.monotonic()
    victim = rollout.workers[0]
    streamed = 0
    for bucket in sync.stream(1):
        streamed += 1
        if bucket == 1:
            ray.kill(victim, no_restart=True)
    failed = list(sync.failed)
    sync.repair(1)
    seconds = time.monotonic() - start
    trainer = trainers.compute_logprobs(batch)
    scored = ray.get(rollout.workers[0].score.remote(sequences.tolist(), [1] * 4))
    gap = max((torch.tensor(s) - trainer[i]).abs().max().item() for i, s in enumerate(scored))
    return {
        "transport": sync.transport,
        "num_nodes": sync.num_nodes,
        "num_buckets": len(sync.plan.buckets),
        "streamed": streamed,
        "failed": failed,
        "replaced": rollout.workers[0] != victim,
        "versions": rollout.versions(),
        "gap": gap,
        "seconds": seconds,
    }


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])), flush=True)
