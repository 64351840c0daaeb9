"""Fake rollout workers, trainer and scorer for the scheduler's tests (rl.run.scheduler.loop ports).

They run on threads with random millisecond delays and place work on random workers, so
completions arrive in every order the real workers could produce; the rollout's workers can
die mid-generation. What they compute (tokens, response lengths, scores, losses) depends only
on the samples and the weights' version, as the real workers' seeded results do, so two runs
must agree however their timings differ.
"""

from __future__ import annotations

import copy
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from rl.run.scheduler.ports import WorkerLost
from rl.types import Sample, SamplingParams

MAX_NEW_TOKENS = 6


def token_at(sample: Sample, position: int) -> int:
    """The fake engine's deterministic token: a resumed sample must continue this sequence."""
    return sample.group_id * 1000 + sample.index * 100 + position


def response_length(sample: Sample) -> int:
    """Where the fake engine's sample ends (stop), from its ids alone."""
    return random.Random(sample.group_id * 1000 + sample.index).randint(1, MAX_NEW_TOKENS)


def score_of(sample: Sample) -> float:
    return float(random.Random(sample.group_id * 7919 + sample.index).random() < 0.5)


def _later(rng: random.Random, max_ms: float, fn) -> Future:
    future: Future = Future()

    def run() -> None:
        time.sleep(rng.uniform(0, max_ms) / 1000)
        future.set_result(fn())

    threading.Thread(target=run, daemon=True).start()
    return future


class FakeRollout:
    """Generates token by token on a thread per call; a sample stops partial at its
    `params.stop_length` short of its end, or when `interrupt` stops calls in flight.

    Samples are copied on `submit`, as Ray sends them: the driver keeps what it submitted.
    Up to `max_kills` times a worker dies while generating: its batches vanish and its poll
    raises WorkerLost until `replace`. A submission kills its worker a moment later with
    `kill_chance`; with `kill_at_sync`, a generating worker dies as a step finishes training
    and as generation is interrupted for the sync (so while the sync waits)."""

    def __init__(
        self,
        rng: random.Random,
        num_workers: int = 2,
        kill_chance: float = 0.0,
        max_kills: int = 0,
        kill_at_sync: bool = False,
    ) -> None:
        self.rng = rng
        self.num_workers = num_workers
        self.versions = [0] * num_workers
        self.num_interrupts = 0
        self.asleep = False  # the KV cache released
        self.weights_asleep = False
        # Time-sliced devices: generating, or the KV cache coming back, while the trainer's
        # state is on the devices would not fit.
        self.time_sliced = False
        self.trainer_on_device: Callable[[], bool] = lambda: False
        self.aborted_prefixes: dict[tuple[int, int], list[int]] = {}
        self.kill_chance, self.max_kills, self.kill_at_sync = kill_chance, max_kills, kill_at_sync
        self.dead = [False] * num_workers
        # Each kill: (worker, trainer version, newest version served) then.
        self.kills: list[tuple[int, int, int]] = []
        self.trainer_version: Callable[[], int] = lambda: 0
        self.scheduler_version: Callable[[], int] = lambda: 0  # the scheduler's rollout_version
        self._lock = threading.Lock()
        self._interrupted = threading.Event()
        self._done: list[dict[int, list[Sample]]] = [{} for _ in range(num_workers)]
        self._polls: dict[int, Future] = {}
        self._active = [0] * num_workers  # calls generating per worker
        self._epoch = [0] * num_workers  # a killed worker's calls belong to an older epoch

    @property
    def num_active(self) -> int:
        return sum(self._active)

    def submit(self, batches: dict[int, list[Sample]], params: SamplingParams) -> dict[int, int]:
        assert not self.asleep, "generation started on an engine that released its memory"
        assert not (self.time_sliced and self.trainer_on_device()), (
            "generation started while the trainer's state was on the devices"
        )
        placed = {}
        for key, samples in batches.items():
            worker = placed[key] = self.rng.randrange(self.num_workers)
            samples = copy.deepcopy(samples)
            for sample in samples:  # as the engine does: an aborted sample resumes
                assert sample.finish_reason in ("", "abort")
                sample.finish_reason = ""
            with self._lock:
                if self.dead[worker]:  # not found out yet: the call is lost with the worker
                    continue
                assert self.versions[worker] == self.scheduler_version(), (
                    f"work reached worker {worker} serving version {self.versions[worker]}"
                )
                self._active[worker] += 1
                epoch = self._epoch[worker]
            delays = [self.rng.uniform(0, 1.5) / 1000 for _ in range(MAX_NEW_TOKENS)]
            stops = [params.stop_length(sample) for sample in samples]
            threading.Thread(
                target=self._generate,
                args=(worker, epoch, key, samples, stops, delays),
                daemon=True,
            ).start()
            if self.rng.random() < self.kill_chance:
                threading.Timer(self.rng.uniform(0, 4) / 1000, self.kill, (worker,)).start()
        return placed

    def poll(self, worker: int) -> Future:
        """Resolves with every batch the worker finished since the last poll (at least one)."""
        future: Future = Future()
        with self._lock:
            if self.dead[worker]:
                future.set_exception(WorkerLost(worker))
                return future
            self._polls[worker] = future
            self._deliver(worker)
        return future

    def _deliver(self, worker: int) -> None:
        future = self._polls.get(worker)
        if future is not None and self._done[worker]:
            finished, self._done[worker] = self._done[worker], {}
            del self._polls[worker]
            future.set_result(finished)

    def _generate(self, worker, epoch, key, samples, stops, delays) -> None:
        for position in range(MAX_NEW_TOKENS):
            time.sleep(delays[position])
            if self._epoch[worker] != epoch:
                return  # the worker died: so did this call
            for sample, stop in zip(samples, stops, strict=True):
                if sample.finish_reason:
                    continue
                if len(sample.response_ids) >= response_length(sample):
                    sample.finish_reason = "stop"
                elif len(sample.response_ids) >= stop or self._interrupted.is_set():
                    sample.finish_reason = "abort"  # a stop_every point: resumes later
                else:
                    sample.response_ids.append(token_at(sample, len(sample.response_ids)))
                    sample.logprobs.append(-1.0 - 0.1 * self.versions[worker])
                    sample.token_versions.append(self.versions[worker])
        for sample in samples:
            if not sample.finish_reason:
                sample.finish_reason = "stop"
        with self._lock:
            if self._epoch[worker] != epoch:
                return
            for sample in samples:  # the prefixes the driver gets back
                if sample.is_partial:
                    self.aborted_prefixes[(sample.group_id, sample.index)] = [*sample.response_ids]
            self._active[worker] -= 1
            self._done[worker][key] = samples
            self._deliver(worker)

    def kill(self, worker: int) -> None:
        """The worker's process dies, if it is generating (and kills are left)."""
        with self._lock:
            if self.dead[worker] or not self._active[worker] or len(self.kills) >= self.max_kills:
                return
            self.kills.append((worker, self.trainer_version(), max(self.versions)))
            self.dead[worker] = True
            self._epoch[worker] += 1
            self._active[worker], self._done[worker] = 0, {}
            if (future := self._polls.pop(worker, None)) is not None:
                future.set_exception(WorkerLost(worker))

    def kill_generating(self) -> None:
        with self._lock:
            generating = [worker for worker, active in enumerate(self._active) if active]
        if generating:
            self.kill(generating[0])

    def replace(self, worker: int, version: int) -> None:
        with self._lock:
            assert self.dead[worker], f"worker {worker} replaced, but it was alive"
            self.dead[worker] = False
            self.versions[worker] = version

    def interrupt(self) -> int:
        self.num_interrupts += 1
        self._interrupted.set()
        if self.kill_at_sync:
            self.kill_generating()
        return 0

    def release_memory(self) -> None:
        with self._lock:
            assert self.num_active == 0, "memory released while samples were generating"
        self.asleep = self.weights_asleep = True

    def reclaim_weights(self) -> None:
        self.weights_asleep = False

    def reclaim_memory(self) -> None:
        assert not self.trainer_on_device(), "KV cache back while the trainer's state was there"
        self.asleep = self.weights_asleep = False

    def serve(self, version: int) -> None:
        assert not self.weights_asleep, "weights loaded into an engine that released them"
        with self._lock:
            assert self.num_active == 0, "weights changed while samples were generating"
            assert not any(self.dead), "weights pushed while a lost worker was not replaced"
        self._interrupted.clear()
        self.versions = [version] * self.num_workers


@dataclass
class FakeTrainer:
    rng: random.Random
    rollout: FakeRollout
    needs_annotation: bool
    keeps_pushed_weights: bool = False
    trained: dict[int, list[Sample]] = field(default_factory=dict)
    version: int = 0
    rollout_asleep_at_train: list[bool] = field(default_factory=list)
    # Whether the engines' KV caches were released at each annotate and train call.
    rollout_asleep_when_computing: list[bool] = field(default_factory=list)
    on_device: bool = True  # the training state; the first call that computes brings it back
    num_releases: int = 0
    num_checkpoints: int = 0
    replacements: list[tuple[int, int]] = field(default_factory=list)  # (worker, version)
    running: int = 0  # annotate and train calls not returned yet
    # (version, the (group, index) of each sample) per annotate call
    annotate_calls: list[tuple[int, list[tuple[int, int]]]] = field(default_factory=list)
    # Settings.streaming: per step, the (group, index) of each sample streamed, in call order;
    # and (trainer version, the chunk's group ids) per stream call.
    streamed: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    stream_calls: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    streamed_while_generating: int = 0  # stream calls made while samples were generating

    def __post_init__(self) -> None:
        self.pushed = self.version  # the version last pushed: a resumed run's rollout serves it

    def annotate(self, samples: list[Sample]) -> Future:
        version = self.version
        self._compute()
        self.annotate_calls.append((version, [(s.group_id, s.index) for s in samples]))

        def fill() -> list[Sample]:
            for sample in samples:
                sample.old_logprobs = [float(version)] * len(sample.response_ids)
            self.running -= 1
            return samples

        return _later(self.rng, 2, fill)

    def stream(self, step: int, samples: list[Sample], scores: list[float]) -> Future:
        """One chunk's annotation and gradients (Settings.streaming), recorded in call order."""
        assert step == self.version + 1
        groups = sorted({s.group_id for s in samples})
        streamed = self.streamed.setdefault(step, [])
        assert not {key[0] for key in streamed} & set(groups), "a group streamed twice"
        streamed.extend((s.group_id, s.index) for s in samples)
        self.stream_calls.append((self.version, tuple(groups)))
        self.streamed_while_generating += self.rollout.num_active > 0
        if not self.needs_annotation:
            self._compute()
            return _later(self.rng, 2, lambda: self._returned(samples))
        return self.annotate(samples)

    def _returned(self, samples: list[Sample]) -> list[Sample]:
        self.running -= 1
        return samples

    def finish(self, step: int, samples: list[Sample], scores: list[float]) -> Future:
        """The optimizer step of a streamed step: every sample it trains on was streamed, in
        whatever order (the real trainer's sum does not depend on it)."""
        assert sorted(self.streamed.get(step, [])) == [(s.group_id, s.index) for s in samples]
        return self.train(step, samples, scores)

    def train(self, step: int, samples: list[Sample], scores: list[float]) -> Future:
        assert step == self.version + 1
        assert len(scores) == len(samples)
        self.rollout_asleep_at_train.append(self.rollout.asleep)
        self._compute()
        if self.needs_annotation:
            # The proximal log-probs come from the weights right before this step.
            assert all(s.old_logprobs == [float(step - 1)] * len(s.response_ids) for s in samples)

        def step_done() -> dict[str, float]:
            self.trained[step] = samples
            self.version = step
            self.running -= 1
            if self.rollout.kill_at_sync:  # the sync is due, and must wait for the loss
                self.rollout.kill_generating()
            # Depends on every token, version and score, in the order given, as a loss does.
            loss = 0.0
            for sample, score in zip(samples, scores, strict=True):
                loss = loss * 0.5 + score + sum(sample.logprobs) * 1e-3 + sum(sample.response_ids)
            return {"train/loss": loss}

        return _later(self.rng, 3, step_done)

    def _compute(self) -> None:
        self.rollout_asleep_when_computing.append(self.rollout.asleep)
        self.on_device = True
        self.running += 1

    def release_memory(self) -> None:
        assert not self.running, "the trainer's state moved while it computed"
        self.on_device = False
        self.num_releases += 1

    def save_checkpoint(self) -> None:
        assert not self.running, "a checkpoint of a trainer still computing"
        if self.rollout.time_sliced:
            assert self.rollout.asleep, "the trainer's state came back beside the KV cache"
        self.on_device = True
        self.num_checkpoints += 1

    def push(self, version: int) -> dict[str, float]:
        assert version == self.version
        self.on_device = True  # the sender reads the weights
        self.rollout.serve(version)
        self.pushed = version
        return {"sync/s": 0.0}

    def replace_rollout_worker(self, worker: int, version: int) -> None:
        # Only an idle trainer's weights, or its copy of the last push, are a version it can
        # stream (0: the base checkpoint).
        assert not self.running, "a rollout worker replaced while the trainer was running"
        streamable = {0, self.version, *([self.pushed] if self.keeps_pushed_weights else [])}
        assert version in streamable, f"replaced at {version}, trainer at {self.version}"
        self.replacements.append((worker, version))
        self.on_device = True
        self.rollout.replace(worker, version)


class FakeScorer:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def score(self, groups: list[tuple[list[Sample], dict]]) -> Future:
        scores = [[score_of(sample) for sample in samples] for samples, _ in groups]
        flat = [score for group in scores for score in group]
        metrics = {"reward/errors": float(len(flat)), "reward/accuracy": sum(flat) / len(flat)}
        return _later(self.rng, 1, lambda: (scores, metrics))
