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
        # Samples in flight per worker, and the worker of each batch in flight.
        self._num_in_flight = [0] * len(self.workers)
        self._worker_of: dict[int, int] = {}
        self._polls: list[Future] = []
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

    def submit(self, batches: dict[int, list[Sample]], params: SamplingParams) -> dict[int, int]:
        """Start each batch of samples (fresh or partial; keys unique among those in flight)
        on the worker with the fewest samples in flight, one call per worker; returns each
        key's worker. `poll(worker)` hands the batches back as they finish."""
        # Count finished batches here, on the caller's thread, not in Ray's callbacks.
        for future in [f for f in self._polls if f.done()]:
            self._polls.remove(future)
            if future.exception() is None:
                for key, samples in future.result().items():
                    self._num_in_flight[self._worker_of.pop(key)] -= len(samples)
        per_worker: list[dict[int, list[Sample]]] = [{} for _ in self.workers]
        for key, samples in batches.items():
            index = min(range(len(self.workers)), key=lambda i: (self._num_in_flight[i], i))
            per_worker[index][key] = samples
            self._num_in_flight[index] += len(samples)
            self._worker_of[key] = index
        for worker, worker_batches in zip(self.workers, per_worker, strict=True):
            if worker_batches:
                worker.start.remote(worker_batches, params)
        return {key: self._worker_of[key] for key in batches}

    def poll(self, index: int) -> Future:
        """Future of {key: samples} of the batches worker `index` finished since its last
        poll (at least one)."""
        future = self.workers[index].poll.remote().future()
        self._polls.append(future)
        return future

    def interrupt(self) -> int:
        """Abort everything being generated (the futures then return partial samples)."""
        return sum(ray.get([worker.interrupt.remote() for worker in self.workers]))

    def release_memory(self) -> None:
        """Every engine frees its device memory for a colocated trainer (no-op on CPU)."""
        ray.get([worker.release_memory.remote() for worker in self.workers])

    def reclaim_memory(self) -> None:
        ray.get([worker.reclaim_memory.remote() for worker in self.workers])

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
