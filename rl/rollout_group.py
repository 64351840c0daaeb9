"""The driver's view of the rollout workers: create them, spread samples over them, gather."""

from __future__ import annotations

from concurrent.futures import Future

import ray
from ray.actor import ActorHandle

from rl.cluster import Placement
from rl.config import Config
from rl.types import Sample, SamplingParams, fresh_samples
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
        self._in_flight: list[list[tuple[Future, int]]] = [[] for _ in self.workers]
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

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def submit(
        self, batches: dict[int, list[Sample]], params: SamplingParams
    ) -> dict[int, tuple[int, Future]]:
        """Start each batch of samples (fresh or partial; keys unique among those in flight)
        on the worker with the fewest samples in flight. Returns, per key, the worker's index
        and a future of the batch's samples, finished or aborted by `interrupt`."""
        for calls in self._in_flight:
            calls[:] = [(future, n) for future, n in calls if not future.done()]
        load = [sum(n for _, n in calls) for calls in self._in_flight]
        per_worker: list[dict[int, list[Sample]]] = [{} for _ in self.workers]
        for key, samples in batches.items():
            index = min(range(len(self.workers)), key=lambda i: (load[i], i))
            per_worker[index][key] = samples
            load[index] += len(samples)
        handles = {}
        for index, worker_batches in enumerate(per_worker):
            if not worker_batches:
                continue
            worker = self.workers[index]
            worker.start.remote(worker_batches, params)
            for key, samples in worker_batches.items():
                future = worker.collect.remote(key).future()
                self._in_flight[index].append((future, len(samples)))
                handles[key] = (index, future)
        return handles

    def interrupt(self) -> int:
        """Abort everything being generated (the futures then return partial samples)."""
        return sum(ray.get([worker.interrupt.remote() for worker in self.workers]))

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Sample]:
        """params.n samples per prompt, ordered prompt by prompt; group_id = prompt index.

        Blocking, the prompts spread evenly over the workers (held-out evaluation, tests)."""
        samples = fresh_samples(prompts, params.n, list(range(len(prompts))))
        num_workers = len(self.workers)
        bounds = [len(samples) * i // num_workers for i in range(num_workers + 1)]
        futures = [
            worker.generate.remote(samples[start:end], params)
            for worker, start, end in zip(self.workers, bounds, bounds[1:], strict=False)
            if end > start
        ]
        return [sample for chunk in ray.get(futures) for sample in chunk]

    def versions(self) -> list[int]:
        """The policy version each worker currently serves."""
        return ray.get([worker.version.remote() for worker in self.workers])
