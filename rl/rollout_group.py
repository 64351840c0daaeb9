"""The driver's view of the rollout workers: create them, spread prompts over them, gather."""

from __future__ import annotations

import ray
from ray.actor import ActorHandle

from rl.config import Config
from rl.scheduler import Placement
from rl.types import Sample, SamplingParams
from rollout.worker import RolloutWorker


class RolloutGroup:
    def __init__(self, cfg: Config, placement: Placement, num_roles_sharing: int) -> None:
        tp = cfg.rollout.tensor_parallel_size
        self._cfg = cfg
        self._options = [
            placement.actor_options(index * tp, num_roles_sharing)
            for index in range(cfg.rollout.num_workers)
        ]
        self.workers = [self._start(index) for index in range(cfg.rollout.num_workers)]
        ray.get([worker.ready.remote() for worker in self.workers])

    def _start(self, index: int) -> ActorHandle:
        cfg = self._cfg
        return RolloutWorker.options(**self._options[index]).remote(
            cfg.model.path, cfg.rollout, cfg.model.dtype, cfg.run.seed + index
        )

    def restart(self, index: int) -> ActorHandle:
        """Replace worker `index` (dead or not) by a fresh one on the checkpoint's weights
        (version 0), in the same place; returns it once its engine is up."""
        ray.kill(self.workers[index], no_restart=True)
        self.workers[index] = self._start(index)
        ray.get(self.workers[index].ready.remote())
        return self.workers[index]

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, policy_version: int
    ) -> list[Sample]:
        """params.n samples per prompt, ordered prompt by prompt; group_id = prompt index."""
        num_workers = len(self.workers)
        bounds = [len(prompts) * i // num_workers for i in range(num_workers + 1)]
        futures = [
            worker.generate.remote(
                prompts[start:end], params, list(range(start, end)), policy_version
            )
            for worker, start, end in zip(self.workers, bounds, bounds[1:], strict=False)
            if end > start
        ]
        return [sample for chunk in ray.get(futures) for sample in chunk]

    def versions(self) -> list[int]:
        """The policy version each worker currently serves."""
        return ray.get([worker.version.remote() for worker in self.workers])
