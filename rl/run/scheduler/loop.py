"""The scheduler: generation overlapped with training on one device pool, staleness bounded.

One loop in the driver, over futures. Prompt groups start on the rollout workers as admission
control allows (rl.run.scheduler.admission: a step's samples are at most `max_staleness` versions old) and
stream back one group at a time; each finished group is scored, and the trainer computes its
proximal/reference log-probs and values while the long tail still generates. A step trains
once all its groups are in; then the new weights are synced, after generations in flight
have finished under the old weights (partial_rollout="finish") or been aborted, to resume under
the new ones with their prefix kept ("abort"). With max_staleness = 0 this is the synchronous
loop: generate, score, train, sync.

A rollout worker lost mid-generation is replaced on the rollout's weights; its groups start
again from what the driver holds: fresh samples (same seeds), aborted ones from their prefix.

The workers are reached through three small ports, so tests drive the same loop with fakes;
they and the loop's `Settings` are in rl.run.scheduler.ports; a group and its step metrics are
in rl.run.scheduler.prompt_groups.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch

from rl.algorithms.dapo import dynamic_sampling_keep
from rl.observe.trace import Trace
from rl.run.scheduler.admission import Admission
from rl.run.scheduler.device_turns import DeviceTurns
from rl.run.scheduler.ports import RolloutPort, ScorerPort, Settings, TrainerPort, WorkerLost
from rl.run.scheduler.prompt_groups import Group, step_metrics
from rl.types import Sample, SamplingParams


class Scheduler:
    def __init__(
        self,
        settings: Settings,
        sampling: SamplingParams,
        rollout: RolloutPort,
        trainer: TrainerPort,
        scorer: ScorerPort,
        next_group: Callable[[int], tuple[dict, list[Sample]]],
        trace: Trace,
        on_version: Callable[[int], dict[str, float]] = lambda version: {},
        start_version: int = 0,
        first_group_id: int = 0,
        trained_group_ids: frozenset[int] = frozenset(),
    ) -> None:
        """`next_group(group_id)` gives the example of the next group and its fresh samples
        (settings.group_size of them, rl.run.groups);
        `on_version(v)` runs once the rollout serves version v, with nothing generating
        (held-out evaluation), and returns metrics for step v.

        A resumed run starts at `start_version` (trainer and rollout both serve it) with
        group ids from `first_group_id`, which seed the groups' sampling: the groups a
        checkpoint had not trained are drawn again, and sampled again identically. Groups in
        `trained_group_ids` (from `first_group_id` on, but trained by a checkpointed step:
        with dynamic sampling a replacement group can start after the next step's first) have
        their prompts drawn and passed over, so no prompt is trained twice."""
        self.settings = settings
        self.sampling = sampling
        self.rollout, self.trainer, self.scorer = rollout, trainer, scorer
        self.next_group = next_group
        self.trace = trace
        self.on_version = on_version
        self.admission = Admission(
            settings.num_steps,
            settings.groups_per_step,
            settings.max_staleness,
            settings.max_groups_per_step,
            first_step=start_version + 1,
        )
        self.trainer_version = start_version  # the trainer's weights: steps trained
        self.rollout_version = start_version  # the weights the rollout workers serve
        self._num_groups = first_group_id
        # Ids of the groups that trained steps consumed (kept or dropped), for checkpoints.
        self._trained_ids = set(trained_group_ids)
        self._pending: dict[Future, tuple] = {}  # future -> (kind, *payload)
        # Per rollout worker: group id -> group generating there; and workers being polled.
        self._generating: list[dict[int, Group]] = [{} for _ in range(rollout.num_workers)]
        self._polled: set[int] = set()
        self._finished: dict[int, list[Group]] = {}  # step -> scored groups, kept or not
        # step -> (metrics, number of samples) of each scoring call for its groups
        self._reward_metrics: dict[int, list[tuple[dict[str, float], int]]] = {}
        self._kept: dict[int, list[Group]] = {}  # step -> scored groups kept for training
        self._partial: list[Group] = []  # groups with samples aborted by a sync
        self._interrupted = False
        self.turns = DeviceTurns(settings.release_memory, rollout, trainer)
        # Rollout workers lost while generating and not replaced yet, and the groups that
        # wait meanwhile (none start: a fresh worker must first get the rollout's weights).
        self._lost: set[int] = set()
        self._held: list[Group] = []
        self._num_lost, self._lost_in_step = 0, 0  # in the run; generating, this step
        self._step_metrics: dict[int, dict[str, float]] = {}
        self._last_step_end = time.perf_counter()

    def run(self) -> Iterator[tuple[int, dict[str, float]]]:
        """Train every step; yields (step, metrics) as each step's weights reach the rollout."""
        while self.rollout_version < self.settings.num_steps:
            self._replace_lost()
            yield from self._sync_if_due()
            # The trainer first: it sets the pace, and starting generation costs the driver
            # prompt encoding and submit calls.
            self._feed_trainer()
            if not self._sync_pending() and not self._lost:
                self._admit()
            if self.rollout_version == self.settings.num_steps:
                break
            assert self._pending, "scheduler stalled: nothing in flight and nothing to start"
            done, _ = wait(list(self._pending), return_when=FIRST_COMPLETED)
            for future in done:
                self._complete(future)

    # -- generation ---------------------------------------------------------------------

    def _admit(self) -> None:
        if self.settings.release_memory and self._trainer_busy():
            return  # time-sliced devices: the trainer has them
        groups = []
        while (step := self.admission.next_step(self.rollout_version)) is not None:
            while self._num_groups in self._trained_ids:  # trained before a resume
                self.next_group(self._num_groups)
                self._num_groups += 1
            group_id, self._num_groups = self._num_groups, self._num_groups + 1
            example, samples = self.next_group(group_id)
            self.admission.start(step, self.rollout_version)
            groups.append(Group(group_id, step, example, samples))
        self._generate(groups)

    def _generate(self, groups: list[Group]) -> None:
        """Start `groups` in one submission: the samples not finished yet (fresh, or aborted
        with a prefix to resume), or hold them while a lost worker awaits its replacement."""
        if not groups:
            return
        if self._lost:
            self._held.extend(groups)
            return
        batches = {
            group.group_id: [s for s in group.samples if not s.finish_reason or s.is_partial]
            for group in groups
        }
        self.turns.to_rollout()
        placed = self.rollout.submit(batches, self.sampling)
        for group in groups:
            worker = placed[group.group_id]
            self._generating[worker][group.group_id] = group
            self.trace.begin(f"rollout-{worker}", "generate", group.step)
        self._poll()

    def _poll(self) -> None:
        """One outstanding poll per worker with groups in flight: finished groups come back
        together when they finish together, one by one along the long tail."""
        for worker, groups in enumerate(self._generating):
            if groups and worker not in self._polled:
                self._polled.add(worker)
                self._pending[self.rollout.poll(worker)] = ("generate", worker)

    def _generated(self, worker: int, finished: dict[int, list[Sample]]) -> None:
        self._polled.discard(worker)
        to_score: dict[int, list[Group]] = {}
        for group_id, samples in finished.items():
            group = self._generating[worker].pop(group_id)
            self.trace.end(f"rollout-{worker}", "generate")
            for sample in samples:  # an agent's tool calls, on the trace's "tools" lane
                if sample.episode is not None:
                    for start, end in sample.episode.tool_spans:
                        self.trace.add_wall("tools", "tool", start, end, group.step)
                    sample.episode.tool_spans.clear()
            by_index = {sample.index: sample for sample in samples}
            group.samples = [by_index.get(s.index, s) for s in group.samples]
            if not any(sample.is_partial for sample in group.samples):
                to_score.setdefault(group.step, []).append(group)
            elif self._interrupted:  # resumed under the new weights, after the sync
                self._partial.append(group)
            else:
                self._generate([group])
        # One scoring call per step, so each step's reward metrics are exactly its own.
        for step, groups in to_score.items():
            self.trace.begin("reward", "reward", step)
            future = self.scorer.score([(group.samples, group.example) for group in groups])
            self._pending[future] = ("score", groups)
        self._poll()

    def _scored(
        self, groups: list[Group], result: tuple[list[list[float]], dict[str, float]]
    ) -> None:
        self.trace.end("reward", "reward")
        scores, metrics = result
        step = groups[0].step
        num_samples = sum(len(group.samples) for group in groups)
        self._reward_metrics.setdefault(step, []).append((metrics, num_samples))
        for group, group_scores in zip(groups, scores, strict=True):
            group.scores = group_scores
            keep = True
            if self.settings.dynamic_sampling:
                tensor = torch.tensor(group.scores)
                keep = bool(dynamic_sampling_keep(tensor, self.settings.group_size)[0])
            self.admission.finish(group.step, keep)
            self._finished.setdefault(group.step, []).append(group)
            if keep:
                self._kept.setdefault(group.step, []).append(group)

    def first_untrained_group(self) -> int:
        """The lowest group id not yet trained on: a checkpoint of the trainer's weights
        resumes by drawing the prompts again from this group on (generating, scoring,
        waiting for their step, or not started yet)."""
        scoring = [payload[0] for kind, *payload in self._pending.values() if kind == "score"]
        waiting = [
            *(group for groups in self._generating for group in groups.values()),
            *(group for groups in scoring for group in groups),
            *(group for groups in self._finished.values() for group in groups),
            *self._partial,
            *self._held,
        ]
        return min((group.group_id for group in waiting), default=self._num_groups)

    def trained_from(self, first_group_id: int) -> list[int]:
        """The ids from `first_group_id` on of groups already trained (a checkpoint's
        `trained_group_ids`); older ones are forgotten."""
        self._trained_ids = {i for i in self._trained_ids if i >= first_group_id}
        return sorted(self._trained_ids)

    def _is_generating(self) -> bool:
        return any(self._generating)

    def devices_to_trainer(self) -> None:
        """For the driver's trainer work between steps (a checkpoint, the final export): on
        time-sliced devices the engines let go of their memory first, and the next generation
        takes it back. Time-sliced runs generate nothing between steps: a step trains once its
        groups are in, and no sync interrupts a generation."""
        assert not (self.turns.enabled and self._is_generating()), "generating between steps"
        self.turns.to_trainer()

    # -- lost rollout workers -----------------------------------------------------------

    def _worker_lost(self, worker: int) -> None:
        """`worker` died: its groups wait, as the driver holds them (tokens generated there
        are gone), until a replacement serves the rollout's weights."""
        self._polled.discard(worker)
        lost, self._generating[worker] = self._generating[worker], {}
        for _ in lost:
            self.trace.end(f"rollout-{worker}", "generate")
        self._count_lost(1, f"rollout worker {worker} died generating")
        self._lost_in_step += 1
        self._lost.add(worker)
        self._held.extend(lost.values())

    def _count_lost(self, num_lost: int, what: str) -> None:
        self._num_lost += num_lost
        if self._num_lost > (cap := self.settings.max_rollout_restarts):
            raise RuntimeError(
                f"{what}: {self._num_lost} rollout workers lost in this run, more than "
                f"faults.max_rollout_restarts = {cap}"
            )

    def _replace_lost(self) -> None:
        """Replace lost workers now if the trainer holds the rollout's weights (idle, no step
        trained since the last sync), then start the held groups. Once a step has trained the
        trainer holds newer weights: the sync replaces them instead (`_sync_if_due`)."""
        if not self._lost or self._trainer_busy() or self._sync_pending():
            return
        self._replace(self.rollout_version)
        held, self._held = self._held, []
        self._generate(held)

    def _replace(self, version: int) -> None:
        for worker in sorted(self._lost):
            with self.trace.span(f"rollout-{worker}", "sync", version):
                self.trainer.replace_rollout_worker(worker, version)
        self._lost.clear()

    # -- training -----------------------------------------------------------------------

    def _trainer_busy(self) -> bool:
        return any(kind in ("annotate", "train") for kind, *_ in self._pending.values())

    def _feed_trainer(self) -> None:
        if self._trainer_busy():
            return
        step = self.trainer_version + 1
        if step > self.settings.num_steps:
            return
        kept = self._kept.get(step, [])
        if self.settings.release_memory and self._is_generating():
            return  # time-sliced devices: the engines have them
        if self.trainer.needs_annotation:
            # Only at version step - 1 (now): these are the proximal policy's log-probs.
            todo = [group for group in kept if not group.annotated]
            if todo:
                self.trace.begin("trainer", "logprobs", step)
                samples = [sample for group in todo for sample in group.samples]
                self.turns.to_trainer()
                self._pending[self.trainer.annotate(samples)] = ("annotate", todo)
                return
        if self._sync_pending() or not self.admission.is_complete(step):
            return
        samples = [sample for group in kept for sample in group.samples]
        scores = [score for group in kept for score in group.scores]
        self.turns.to_trainer()
        self.trace.begin("trainer", "train", step)
        self._pending[self.trainer.train(step, samples, scores)] = ("train", step)

    def _annotated(self, groups: list[Group], samples: list[Sample]) -> None:
        self.trace.end("trainer", "logprobs")
        for group in groups:
            group.samples, samples = samples[: len(group.samples)], samples[len(group.samples) :]
            group.annotated = True

    def _trained(self, step: int, metrics: dict[str, float]) -> None:
        self.trace.end("trainer", "train")
        assert step == self.trainer_version + 1
        self.trainer_version = step
        self.admission.retire(step)
        finished = self._finished.pop(step, [])
        kept = self._kept.pop(step, [])
        self._trained_ids.update(group.group_id for group in finished)
        reward_metrics = self._reward_metrics.pop(step, [])
        self._step_metrics[step] = {
            **step_metrics(step, finished, kept, reward_metrics),
            **metrics,
        }

    # -- weight sync --------------------------------------------------------------------

    def _sync_pending(self) -> bool:
        return self.trainer_version > self.rollout_version and not self._trainer_busy()

    def _sync_if_due(self) -> Iterator[tuple[int, dict[str, float]]]:
        if not self._sync_pending():
            return
        if self._is_generating():
            if self.settings.partial_rollout == "abort" and not self._interrupted:
                self.rollout.interrupt()
                self._interrupted = True
            return
        version = self.trainer_version
        lanes = ["trainer", *(f"rollout-{i}" for i in range(self.rollout.num_workers))]
        for lane in lanes:
            self.trace.begin(lane, "sync", version)
        sync_start = time.perf_counter()
        if self._lost:  # fresh engines on the base weights: the push brings them to `version`
            self._replace(0)
        self.turns.for_push()
        metrics = self.trainer.push(version)
        self.turns.to_rollout()
        # Lost during the push (weight_sync/workers_replaced) or generating since the last
        # step (rollout/workers_replaced): both count against max_rollout_restarts.
        lost_in_sync = int(metrics.get("weight_sync/workers_replaced", 0))
        self._count_lost(lost_in_sync, f"rollout workers died receiving version {version}")
        metrics["rollout/workers_replaced"], self._lost_in_step = float(self._lost_in_step), 0
        metrics["time/sync_s"] = time.perf_counter() - sync_start
        metrics["rollout/version"] = float(version)
        for lane in lanes:
            self.trace.end(lane, "sync")
        self.rollout_version, self._interrupted = version, False
        metrics.update(self.on_version(version))
        waiting, self._partial, self._held = [*self._partial, *self._held], [], []
        self._generate(waiting)
        now = time.perf_counter()
        metrics.update(self._step_metrics.pop(version))
        metrics.update(self.trace.summary(self._last_step_end, now))
        if metrics.get("perf/busy_s_generate"):  # this step's tokens over its generating time
            metrics["perf/gen_tokens_per_s"] = (
                metrics["rollout/tokens"] / metrics["perf/busy_s_generate"]
            )
        metrics["time/step_s"] = now - self._last_step_end
        self._last_step_end = now
        yield version, metrics

    def _complete(self, future: Future) -> None:
        kind, *payload = self._pending.pop(future)
        try:
            result = future.result()
        except WorkerLost:
            if kind != "generate":
                raise
            self._worker_lost(*payload)
            return
        if kind == "generate":
            self._generated(*payload, result)
        elif kind == "score":
            self._scored(*payload, result)
        elif kind == "annotate":
            self._annotated(*payload, result)
        else:
            self._trained(*payload, result)
