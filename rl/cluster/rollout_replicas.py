"""The driver's view of the rollout workers: create them, spread samples over them, gather.

A worker whose process dies surfaces as `WorkerLost` from its poll; calls that reach every
worker (interrupt, memory) skip a dead one, so the scheduler learns of it in one place.
"""

from __future__ import annotations

import math
from concurrent.futures import Future

import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError

from rl.cluster.reservation import Placement
from rl.config import Config
from rl.observe.actor_logs import actor_log_file
from rl.run.scheduler.ports import WorkerLost
from rl.types import Sample, SamplingParams
from rollout.worker import RolloutWorker

CLOSE_TIMEOUT_S = 10.0  # how long a rollout worker may take to stop its tool pool


def engine_options(cfg: Config, placement: Placement, index: int, num_roles_sharing: int) -> dict:
    """`.options(...)` of rollout worker `index`: its share of its engine's first bundle, and
    the environment that gives its engine every bundle's device."""
    plan = placement.plan
    bundles = plan.rollout_bundles(index)
    options = placement.actor_options(bundles[0], num_roles_sharing)
    env = {}
    if placement.use_gpu and len(bundles) > 1:
        env = placement.visible_devices(bundles)
    elif cfg.scheduler.time_sliced and not placement.use_gpu and len(bundles) == 1:
        # Ray would give the engine threads for its CPU share alone (one, when it shares its
        # CPU with a trainer rank), but while it generates the trainer waits: it may use
        # every CPU of its node block.
        env = {"OMP_NUM_THREADS": str(plan.rollout_threads(index))}
    if env:
        options["runtime_env"] = {"env_vars": env}
    return options


class RolloutFailed(RuntimeError):
    """A rollout engine raised: the run cannot go on with it."""


class RolloutReplicas:
    def __init__(self, cfg: Config, placement: Placement, num_roles_sharing: int) -> None:
        self._cfg = cfg
        self._options = [
            engine_options(cfg, placement, index, num_roles_sharing)
            for index in range(cfg.rollout.num_workers)
        ]
        self.workers = [self._start(index) for index in range(cfg.rollout.num_workers)]
        # Samples in flight per worker, and the worker of each batch in flight.
        self._num_in_flight = [0] * len(self.workers)
        self._worker_of: dict[int, int] = {}
        self._polls: list[tuple[int, Future]] = []  # (worker, poll future) not counted yet
        ray.get([worker.ready.remote() for worker in self.workers])

    def _start(self, index: int) -> ActorHandle:
        cfg = self._cfg
        log_file = actor_log_file(cfg, f"rollout-{index}")
        worker = RolloutWorker.options(**self._options[index]).remote(
            cfg.model.path,
            cfg.rollout,
            cfg.model.dtype,
            cfg.run.seed + index,
            cfg.agent,
            log_file,
            cfg.model.lora,
            cfg.sandbox,
            cfg.model.routing_replay,
        )
        if log_file is not None:
            worker.log_to.remote(log_file)  # runs before `ready`: calls run in order
        return worker

    def restart(self, index: int) -> ActorHandle:
        """Replace worker `index` (dead or not) by a fresh one on the checkpoint's weights
        (version 0), in the same place; returns it once its engine is up. What the old one
        had in flight is forgotten: its batches are gone, and the caller starts them again."""
        self._close([self.workers[index]])
        ray.kill(self.workers[index], no_restart=True)
        self._num_in_flight[index] = 0
        self._worker_of = {key: i for key, i in self._worker_of.items() if i != index}
        self._polls = [(i, future) for i, future in self._polls if i != index]
        self.workers[index] = self._start(index)
        ray.get(self.workers[index].ready.remote())
        return self.workers[index]

    def close(self) -> None:
        """Let every live worker stop its tool pool (rollout.worker.RolloutWorker.close)
        before Ray kills the actors."""
        self._close(self.workers)

    @staticmethod
    def _close(workers: list[ActorHandle]) -> None:
        refs = [worker.close.remote() for worker in workers]
        for ref in refs:
            try:
                ray.get(ref, timeout=CLOSE_TIMEOUT_S)
            except (RayActorError, GetTimeoutError):
                pass  # dead, or busy past the timeout: Ray's kill is all that is left

    def describe_devices(self) -> list[str]:
        """Per engine, the GPUs its ranks use (what --dry-run can only name by bundle)."""
        return [
            f"rollout engine {index}: CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}"
            for index, options in enumerate(self._options)
            if "CUDA_VISIBLE_DEVICES" in (env := options.get("runtime_env", {}).get("env_vars", {}))
        ]

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def submit(self, batches: dict[int, list[Sample]], params: SamplingParams) -> dict[int, int]:
        """Start each batch of samples (fresh or partial; keys unique among those in flight)
        on the worker with the fewest samples in flight, one call per worker; returns each
        key's worker. `poll(worker)` hands the batches back as they finish."""
        # Count finished batches here, on the caller's thread, not in Ray's callbacks.
        for polled in [p for p in self._polls if p[1].done()]:
            self._polls.remove(polled)
            future = polled[1]
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
        poll (at least one); it raises WorkerLost if the worker's actor died."""
        future: Future = Future()
        self.workers[index].poll.remote().future().add_done_callback(
            lambda polled: _relay(polled, future, index)
        )
        self._polls.append((index, future))
        return future

    def interrupt(self) -> int:
        """Abort everything being generated (the futures then return partial samples)."""
        return sum(self._on_live_workers("interrupt"))

    def release_memory(self) -> None:
        """Every engine frees its device memory for a colocated trainer (no-op on CPU)."""
        self._on_live_workers("release_memory")

    def reclaim_weights(self) -> None:
        self._on_live_workers("reclaim_weights")

    def reclaim_memory(self) -> None:
        self._on_live_workers("reclaim_memory")

    def peak_memory_mb(self) -> float:
        """The largest worker's peak memory since the previous call, MiB (NaN when none
        answers: MetricsLogger writes it as null)."""
        return max(self._on_live_workers("peak_memory_mb"), default=math.nan)

    def _on_live_workers(self, method: str) -> list:
        """`method`'s results on every worker that answers: a dead one is skipped, as its
        poll reports it (WorkerLost) or the next weight push replaces it."""
        refs = [getattr(worker, method).remote() for worker in self.workers]
        results = []
        for ref in refs:
            try:
                results.append(ray.get(ref))
            except RayActorError:
                pass
        return results

    def generate(self, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        """Generate fresh `samples` (`rl.types.fresh_samples`, or agent episodes) to the end;
        returns them in order.

        Blocking, the samples spread evenly over the workers (held-out evaluation, tests)."""
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


def _relay(polled: Future, future: Future, index: int) -> None:
    """On Ray's thread: hand a poll's outcome on, a dead actor as WorkerLost (the scheduler
    knows no Ray types). An engine that failed is no lost worker: the run fails with an error
    naming the worker and the engine's own exception."""
    error = polled.exception()
    if isinstance(error, RayActorError):
        future.set_exception(WorkerLost(index, type(error).__name__))
    elif error is not None:
        cause = getattr(error, "cause", None) or error  # a RayTaskError wraps the engine's
        failed = RolloutFailed(f"rollout worker {index} failed: {type(cause).__name__}: {cause}")
        failed.__cause__ = error
        future.set_exception(failed)
    else:
        future.set_result(polled.result())
