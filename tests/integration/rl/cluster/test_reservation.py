"""What each tensor-parallel engine's process sees on GPUs, with fake GPUs in a local Ray.

Ray schedules an actor on one bundle and shows it only that bundle's GPU; vLLM's
multiprocessing executor puts TP rank r on cuda:r of what the engine process sees. So the
engine must see its bundles' GPUs, in rank order, and each must be the GPU that Ray gives any
other actor on that bundle (a trainer rank colocated there).
"""

from __future__ import annotations

import os

import pytest
import ray

from rl.cluster.reservation import reserve
from rl.cluster.rollout_replicas import engine_options
from rl.config import Config


@ray.remote
class _Probe:
    """Reports the GPUs a process started with some actor's options sees."""

    def visible(self) -> tuple[str | None, list[str]]:
        return os.environ.get("CUDA_VISIBLE_DEVICES"), [str(i) for i in ray.get_gpu_ids()]


@pytest.fixture
def fake_gpus():
    ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_each_tensor_parallel_engine_sees_its_bundles_gpus_in_rank_order(fake_gpus) -> None:
    cfg = Config.model_validate(
        {
            "model": {"path": "m"},
            "trainer": {"num_workers": 4},
            "rollout": {"num_workers": 2, "tensor_parallel_size": 2},
        }
    )
    placement = reserve(cfg)
    try:
        num_roles = placement.plan.num_roles_sharing
        # The GPU Ray gives an actor on each bundle, as a trainer rank there would get it.
        ranks = [
            _Probe.options(**placement.actor_options(bundle, num_roles)).remote()
            for bundle in range(4)
        ]
        rank_gpus = [gpus for _, gpus in ray.get([rank.visible.remote() for rank in ranks])]
        assert all(len(gpus) == 1 for gpus in rank_gpus)
        assert len({gpus[0] for gpus in rank_gpus}) == 4  # one GPU per bundle

        engines = [
            _Probe.options(**engine_options(cfg, placement, index, num_roles)).remote()
            for index in range(2)
        ]
        seen = [visible for visible, _ in ray.get([e.visible.remote() for e in engines])]
        for index, visible in enumerate(seen):
            bundles = placement.plan.rollout_bundles(index)
            assert visible == ",".join(rank_gpus[bundle][0] for bundle in bundles)
    finally:
        placement.release()
