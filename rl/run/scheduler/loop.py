"""The scheduler: generation overlapped with training on one device pool, staleness bounded,
and deterministic.

One loop in the driver, over futures. Prompt groups start on the rollout workers as admission
control allows (rl.run.scheduler.admission: a step's samples are at most `max_staleness`
versions old) and stream back one group at a time, each scored on its own. Once all of a
step's groups are in, the trainer annotates them (proximal/reference log-probs, values) and
trains; the step's weights are synced once nothing generates or is being scored. With
max_staleness = 0 this is the synchronous loop: generate, score, train, sync.

Deterministic: what step s trains on, and which policy version sampled each of its tokens,
follow from the configuration and the seed, never from which future finished first.
- Groups start at a sync, for every step admission allows then; between syncs only as
  replacements for the next step's dropped groups (dynamic sampling; a later step's wait for
  the next sync). So each group's id, prompt, step and first version are fixed.
- A step's groups are annotated, trained on and reported in group-id order.
- A sync waits until nothing generates and nothing is being scored. Under partial_rollout
  "finish" a sample is generated to its end under the version it started with. Under "abort"
  a sample for a later step than the next stops each time its length reaches a multiple of
  `abort_every` (SamplingParams.stop_every) and resumes under the next version: the abort
  point is fixed by its length, not by a clock. What it costs: a sync waits for the segments
  in flight to reach that point, a sample that reached it waits for the sync, and a resumed
  sample's prefix is prefilled again. So "auto" puts the point where only the long tail
  stops: at the 95th percentile of the response lengths of the step last synced
  (`abort_point`), taken at the sync, a point in the run fixed like the groups' starts.
  partial_rollout "interrupt" is the exception, kept for speed: a sync that comes due aborts
  what is generating wherever it is (RolloutPort.interrupt), so it never waits, and where
  samples stop, hence what is trained, depends on timing.
partial_rollout "carry" (rl.run.scheduler.carry_over) ties no group to a step when it starts:
generation runs in epochs whose segments all stop at abort points, and at each boundary
(nothing generating or scored) the next step takes the first groups to finish on a token
clock, within a bound on every token's age and on the share of stale tokens; the version the
next epoch samples with is pushed there, and fresh groups start there (`_boundary_if_due`).
With `streaming` the trainer does not wait for a step's last group: it annotates and
backpropagates a chunk of the step's groups (fixed by their ids) as soon as all its groups
are scored, and takes the optimizer step once all are in (`_stream`). Chunks come in the order
they complete, which timing decides; the trainer sums their gradients in fixed point, exactly,
and their metrics in id order, so the step does not depend on that order
(PolicyTrainer.accumulate_chunk).
The state at a sync (`state_dict`: the groups not trained yet, with their tokens, and
admission's counts, or under "carry" its bookkeeping) is what a checkpoint records, so a
resumed run continues exactly.
What the scheduler does not decide can still depend on timing: a reward function, tool call
or environment request that runs past its wall-clock timeout (`reward.timeout_s`,
`agent.tool_timeout_s`, `agent.env_timeout_s`) fails where a faster run's would not; each step
counts them (`reward/timeouts`, `agent/tool_errors_timeout`, `agent/env_timeouts`).

A rollout worker lost mid-generation is replaced on the rollout's weights once the trainer is
idle; its groups start again from what the driver holds: fresh samples (same seeds), partial
ones from their prefix, so the run stays exact. At k = 0 the trainer holds those weights (it
trains only once nothing generates); at k >= 1 it has usually trained on since the last sync,
and streams the copy of that sync's weights its ranks keep (TrainerPort.keeps_pushed_weights).
The next sync waits for the lost groups as for any other.

The workers are reached through three small ports, so tests drive the same loop with fakes;
they and the loop's `Settings` are in rl.run.scheduler.ports; a group, the checkpointed state
and the step metrics are in rl.run.scheduler.prompt_groups.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import torch

from rl.algorithms.dapo import dynamic_sampling_keep
from rl.observe.trace import Trace
from rl.run.scheduler.admission import Admission
from rl.run.scheduler.carry_over import CarryOver
from rl.run.scheduler.clock import WALL_CLOCK, Clock
from rl.run.scheduler.device_turns import DeviceTurns
from rl.run.scheduler.ports import RolloutPort, ScorerPort, Settings, TrainerPort, WorkerLost
from rl.run.scheduler.prompt_groups import Group, InFlight, step_metrics
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
        in_flight: InFlight | None = None,
        clock: Clock = WALL_CLOCK,
    ) -> None:
        """`next_group(group_id)` gives the example of the next group and its fresh samples
        (settings.group_size of them, rl.run.groups);
        `on_version(v)` runs once the rollout serves version v, with nothing generating
        (held-out evaluation), and returns metrics for step v.

        A resumed run starts at `start_version` (trainer and rollout both serve it) from its
        checkpoint's `in_flight` (`state_dict` at that sync): the groups it had not trained
        continue from their tokens, and new groups from its next id.

        `clock` measures the step times and waits on the ports' futures (rl.run.scheduler.clock:
        the wall clock, or a simulation's); `trace` should record on the same clock."""
        self.settings = settings
        self.clock = clock
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
        self._num_groups = 0
        self._pending: dict[Future, tuple] = {}  # future -> (kind, *payload)
        # Futures pending per kind: the loop asks after them every turn, and a cluster's
        # hundreds of polls make a scan of `_pending` cost more than the turn.
        self._kinds: Counter[str] = Counter()
        # Per rollout worker: group id -> group generating there; and workers being polled.
        self._generating: list[dict[int, Group]] = [{} for _ in range(rollout.num_workers)]
        self._polled: set[int] = set()
        self._finished: dict[int, list[Group]] = {}  # step -> scored groups, kept or not
        self._unscored: dict[int, set[int]] = {}  # step -> ids of its groups started, not scored
        self._partial: list[Group] = []  # groups stopped partial: the next version's
        self._interrupted = False  # generation aborted for the sync that is due
        # Groups may start for every step admission allows (at a sync), or else only for the
        # next step (module docstring).
        self._at_sync = True
        self.turns = DeviceTurns(settings.release_memory, rollout, trainer)
        # Streaming trains while the engines generate (the config checks refuse time-slicing).
        assert not (settings.streaming and settings.release_memory), "streaming, time-sliced"
        # Rollout workers lost while generating and not replaced yet, and the groups that
        # wait meanwhile (none start: a fresh worker must first get the rollout's weights).
        self._lost: set[int] = set()
        self._held: list[Group] = []
        self._num_lost, self._lost_in_step = 0, 0  # in the run; generating, this step
        self._step_metrics: dict[int, dict[str, float]] = {}
        # partial_rollout "abort": the stop points of groups submitted until the next sync,
        # and (auto) those the step trained last gives at the sync.
        auto = settings.abort_every == "auto"
        self._abort_every = sampling.max_new_tokens if auto else settings.abort_every
        self._next_abort_every = self._abort_every
        self._last_step_end = clock.now()
        # partial_rollout "carry" (rl.run.scheduler.carry_over): groups belong to no step
        # (step 0) until a boundary selects them.
        self.carry: CarryOver | None = None
        self._closed = True  # the boundary before the next epoch has selected its step
        if settings.partial_rollout == "carry":
            self.carry = CarryOver(
                settings.num_steps,
                settings.groups_per_step,
                settings.groups_in_flight,
                settings.max_staleness,
                settings.max_stale_share,
                settings.max_token_age,
                settings.max_groups_per_step if settings.dynamic_sampling else None,
            )
        if in_flight is not None:
            self._num_groups = in_flight.next_group_id
            self._abort_every = self._next_abort_every = in_flight.abort_every
            self.admission.load_state_dict(in_flight.admission)
            waiting = []
            for group in in_flight.groups:
                if group.step > settings.num_steps:  # a resumed run shortened
                    continue
                if group.kept is None:
                    self._partial.append(group)  # resumes first, as after that sync
                    if self.carry is None:
                        self._unscored.setdefault(group.step, set()).add(group.group_id)
                elif group.step == 0:  # carry: finished, no step selected it yet
                    waiting.append(group)
                else:
                    self._finished.setdefault(group.step, []).append(group)
            if self.carry is not None:
                assert in_flight.carry is not None, "a carry run resumed from another mode"
                self.carry.load_state_dict(in_flight.carry, waiting)

    def run(self) -> Iterator[tuple[int, dict[str, float]]]:
        """Train every step; yields (step, metrics) as each step's weights reach the rollout."""
        if self.carry is None:
            self._resume_waiting()
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
            if not self._pending:  # an epoch that started nothing: its boundary is due now
                assert self.carry is not None and not self._closed, (
                    "scheduler stalled: nothing in flight and nothing to start"
                )
                continue
            done = self.clock.wait_first(list(self._pending))
            for future in done:
                self._complete(future)

    def state_dict(self) -> InFlight:
        """The run's state at the sync `run` last yielded after (module docstring); groups
        resumed at that sync are recorded as they were before it."""
        assert not self._is_scoring(), "state taken while groups were being scored"
        waiting = [
            *(group for groups in self._generating for group in groups.values()),
            *self._partial,
            *self._held,
        ]
        scored = [group for groups in self._finished.values() for group in groups]
        if self.carry is not None:
            scored += [*self.carry.backlog, *self.carry.unkept]
        return InFlight(
            self._num_groups,
            self.admission.state_dict() if self.carry is None else {},
            sorted([*waiting, *scored], key=lambda group: group.group_id),
            self._abort_every,
            None if self.carry is None else self.carry.state_dict(),
        )

    # -- generation ---------------------------------------------------------------------

    def _admit(self) -> None:
        if self.carry is not None:
            return  # groups start at boundaries (_open_epoch)
        if self.settings.release_memory and self._trainer_busy():
            return  # time-sliced devices: the trainer has them
        last_step = None if self._at_sync else self.rollout_version + 1
        self._at_sync = False
        groups = []
        while (step := self.admission.next_step(self.rollout_version, last_step)) is not None:
            group_id, self._num_groups = self._num_groups, self._num_groups + 1
            example, samples = self.next_group(group_id)
            self.admission.start(step, self.rollout_version)
            groups.append(Group(group_id, step, example, samples))
            self._unscored.setdefault(step, set()).add(group_id)
        self._generate(groups)

    def _resume_waiting(self) -> None:
        """Start the groups that waited for this version: stopped at an abort point, or held
        for a lost worker; in group-id order, so a resumed run submits as the original did."""
        waiting, self._partial, self._held = [*self._partial, *self._held], [], []
        self._generate(sorted(waiting, key=lambda group: group.group_id))

    def _params(self, group: Group) -> SamplingParams:
        """The next step's groups finish under this version; later steps' stop at abort
        points under partial_rollout "abort"; every group does under "carry"."""
        if self.carry is not None or (
            group.step > self.rollout_version + 1 and self.settings.partial_rollout == "abort"
        ):
            return dataclasses.replace(self.sampling, stop_every=self._abort_every)
        return self.sampling

    def _generate(self, groups: list[Group]) -> None:
        """Start `groups` (one submission per sampling params): the samples not finished yet
        (fresh, or partial with a prefix to resume), or hold them while a lost worker awaits
        its replacement."""
        if not groups:
            return
        if self._lost:
            self._held.extend(groups)
            return
        self.turns.to_rollout()
        by_params: dict[int, tuple[SamplingParams, list[Group]]] = {}
        for group in groups:
            params = self._params(group)
            by_params.setdefault(params.stop_every, (params, []))[1].append(group)
        for params, submitted in by_params.values():
            batches = {
                group.group_id: [s for s in group.samples if not s.finish_reason or s.is_partial]
                for group in submitted
            }
            placed = self.rollout.submit(batches, params)
            for group in submitted:
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
                self._await(self.rollout.poll(worker), "generate", worker)

    def _generated(self, worker: int, finished: dict[int, list[Sample]]) -> None:
        self._polled.discard(worker)
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
            if any(sample.is_partial for sample in group.samples):
                self._partial.append(group)  # stopped partial: resumes after the next sync
                continue
            # One scoring call per group, so a step's reward metrics add up its groups' in
            # id order, however they finished.
            self.trace.begin("reward", "reward", group.step)
            future = self.scorer.score([(group.samples, group.example)])
            self._await(future, "score", group)
        self._poll()

    def _scored(self, group: Group, result: tuple[list[list[float]], dict[str, float]]) -> None:
        self.trace.end("reward", "reward")
        (group.scores,), group.reward_metrics = result
        group.kept = True
        if self.settings.dynamic_sampling:
            tensor = torch.tensor(group.scores)
            group.kept = bool(dynamic_sampling_keep(tensor, self.settings.group_size)[0])
        if self.carry is not None:
            generated = [
                len(sample.response_ids) - start
                for sample, start in zip(group.samples, group.segment_start, strict=True)
            ]
            group.finished_at = (self.carry.epoch, max(generated))
            self.carry.finished(group)
            return
        self.admission.finish(group.step, group.kept)
        self._unscored[group.step].discard(group.group_id)
        self._finished.setdefault(group.step, []).append(group)

    def _await(self, future: Future, kind: str, *payload: object) -> None:
        self._pending[future] = (kind, *payload)
        self._kinds[kind] += 1

    def _is_scoring(self) -> bool:
        return self._kinds["score"] > 0

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
        """Replace lost workers on the rollout's weights once the trainer is idle (module
        docstring), then start the held groups."""
        if not self._lost or self._trainer_busy():
            return
        assert self.trainer_version == self.rollout_version or self.trainer.keeps_pushed_weights, (
            "a step trained while generating, and the trainer kept no copy of the rollout's weights"
        )
        for worker in sorted(self._lost):
            with self.trace.span(f"rollout-{worker}", "sync", self.rollout_version):
                self.trainer.replace_rollout_worker(worker, self.rollout_version)
        self._lost.clear()
        held, self._held = self._held, []
        self._generate(held)

    # -- training -----------------------------------------------------------------------

    def _trainer_busy(self) -> bool:
        return self._kinds["annotate"] + self._kinds["stream"] + self._kinds["train"] > 0

    def _feed_trainer(self) -> None:
        if self._trainer_busy():
            return
        step = self.trainer_version + 1
        if step > self.settings.num_steps:
            return
        if self.settings.streaming:
            self._stream(step)
            return
        if not self._batch_ready(step):
            return
        if self.settings.release_memory and self._is_generating():
            return  # time-sliced devices: the engines have them
        if self._sync_pending() and not self.trainer.needs_annotation:
            return  # it trains after the sync; only an annotation may come first
        kept = self._kept(step)
        if self.trainer.needs_annotation and not all(group.annotated for group in kept):
            # At version step - 1 (now): these are the proximal policy's log-probs. The whole
            # step in one call, so its batches are the same in every run.
            self.trace.begin("trainer", "logprobs", step)
            samples, _ = _samples_and_scores(kept)
            self.turns.to_trainer()
            self._await(self.trainer.annotate(samples), "annotate", kept)
            return
        if self._sync_pending():
            return
        samples, scores = _samples_and_scores(kept)
        if self.carry is not None:
            self.carry.check_bounds(step, kept)
        self.turns.to_trainer()
        self.trace.begin("trainer", "train", step)
        self._await(self.trainer.train(step, samples, scores), "train", step)

    def _stream(self, step: int) -> None:
        """Settings.streaming: the step's groups go to the trainer in chunks of
        `stream_groups`, by position in id order among the groups started for the step, so a
        chunk is the same groups in every run; each chunk as soon as all its groups are
        scored, in whatever order chunks complete (the trainer sums their gradients exactly,
        in any order). Once all are in, the optimizer step, after the sync of the version
        they were annotated at. Streaming changes no weights, so it may come before that
        sync, as an annotation may. (The config checks refuse it on time-sliced devices.)"""
        ready = self._batch_ready(step)
        if self.carry is not None and not ready:
            return  # a step's groups are known once a boundary has selected them
        for chunk in self._chunks(step, ready):
            kept = [group for group in chunk if group.kept and not group.streamed]
            if kept:
                samples, scores = _samples_and_scores(kept)
                self.trace.begin("trainer", "train", step)  # its forward and backward
                self._await(self.trainer.stream(step, samples, scores), "stream", kept)
                return
        kept = self._kept(step)
        if not ready or self._sync_pending() or not all(group.streamed for group in kept):
            return
        if self.carry is not None:
            self.carry.check_bounds(step, kept)
        samples, scores = _samples_and_scores(kept)
        self.trace.begin("trainer", "train", step)
        self._await(self.trainer.finish(step, samples, scores), "train", step)

    def _chunks(self, step: int, ready: bool) -> Iterator[list[Group]]:
        """The step's chunks whose groups are all scored: consecutive runs of stream_groups
        of the groups started for it, in id order (the last one shorter once the step is
        complete). A chunk's groups never change: groups started later have larger ids."""
        size = self.settings.stream_groups
        scored = {group.group_id: group for group in self._finished.get(step, [])}
        started = sorted([*scored, *self._unscored.get(step, ())])
        for first in range(0, len(started), size):
            ids = started[first : first + size]
            if (len(ids) == size or ready) and all(i in scored for i in ids):
                yield [scored[i] for i in ids]

    def _streamed(self, groups: list[Group], samples: list[Sample]) -> None:
        self.trace.end("trainer", "train")
        _give_back(groups, samples)
        for group in groups:
            group.annotated = group.streamed = True

    def _batch_ready(self, step: int) -> bool:
        if self.carry is not None:
            return self.carry.may_train(step, self.rollout_version)
        return self.admission.is_complete(step)

    def _kept(self, step: int) -> list[Group]:
        """The groups step `step` trains on, in id order."""
        groups = [group for group in self._finished.get(step, []) if group.kept]
        return sorted(groups, key=lambda group: group.group_id)

    def _annotated(self, groups: list[Group], samples: list[Sample]) -> None:
        self.trace.end("trainer", "logprobs")
        _give_back(groups, samples)
        for group in groups:
            group.annotated = True

    def _trained(self, step: int, metrics: dict[str, float]) -> None:
        self.trace.end("trainer", "train")
        assert step == self.trainer_version + 1
        self.trainer_version = step
        if self.carry is None:
            self.admission.retire(step)
            assert not self._unscored.pop(step, None), f"step {step} trained with groups unscored"
        kept = self._kept(step)
        if self.settings.abort_every == "auto" and kept:
            lengths = [len(sample.response_ids) for group in kept for sample in group.samples]
            self._next_abort_every = abort_point(lengths, 0.5 if self.carry else 0.95)
        finished = sorted(self._finished.pop(step, []), key=lambda group: group.group_id)
        reward_calls = [(group.reward_metrics, len(group.samples)) for group in finished]
        self._step_metrics[step] = {
            **step_metrics(step, finished, kept, reward_calls),
            **(self.carry.metrics.pop(step) if self.carry is not None else {}),
            **metrics,
        }

    # -- weight sync --------------------------------------------------------------------

    def _sync_pending(self) -> bool:
        return self.trainer_version > self.rollout_version and not self._trainer_busy()

    def _sync_if_due(self) -> Iterator[tuple[int, dict[str, float]]]:
        if self.carry is not None:
            yield from self._boundary_if_due()
            return
        if not self._sync_pending() or self._is_scoring():
            return
        if self._is_generating():
            if self.settings.partial_rollout == "interrupt" and not self._interrupted:
                self.rollout.interrupt()
                self._interrupted = True
            return
        yield from self._sync()

    def _sync(self) -> Iterator[tuple[int, dict[str, float]]]:
        """Send the trainer's weights to the rollout, with nothing generating or scored."""
        version = self.trainer_version
        lanes = ["trainer", *(f"rollout-{i}" for i in range(self.rollout.num_workers))]
        for lane in lanes:
            self.trace.begin(lane, "sync", version)
        sync_start = self.clock.now()
        assert not self._lost, "a sync before the lost workers' replacement (_replace_lost)"
        self.turns.for_push()
        metrics = self.trainer.push(version)
        self.turns.to_rollout()
        # Lost during the push (weight_sync/workers_replaced) or generating since the last
        # step (rollout/workers_replaced): both count against max_rollout_restarts.
        lost_in_sync = int(metrics.get("weight_sync/workers_replaced", 0))
        self._count_lost(lost_in_sync, f"rollout workers died receiving version {version}")
        metrics["rollout/workers_replaced"], self._lost_in_step = float(self._lost_in_step), 0
        metrics["time/sync_s"] = self.clock.now() - sync_start
        metrics["rollout/version"] = float(version)
        for lane in lanes:
            self.trace.end(lane, "sync")
        self.rollout_version, self._at_sync, self._interrupted = version, True, False
        self._abort_every = self._next_abort_every
        if self.settings.partial_rollout in ("abort", "carry"):
            metrics["rollout/abort_every"] = float(self._abort_every)
        metrics.update(self.on_version(version))
        if self.carry is None:
            self._resume_waiting()
        now = self.clock.now()
        metrics.update(self._step_metrics.pop(version))
        metrics.update(self.trace.summary(self._last_step_end, now))
        if metrics.get("perf/busy_s_generate"):  # this step's tokens over its generating time
            metrics["perf/gen_tokens_per_s"] = (
                metrics["rollout/tokens"] / metrics["perf/busy_s_generate"]
            )
        metrics["time/step_s"] = now - self._last_step_end
        self._last_step_end = now
        yield version, metrics

    # -- partial_rollout "carry": epochs and their boundaries ----------------------------

    def _boundary_if_due(self) -> Iterator[tuple[int, dict[str, float]]]:
        """Once nothing generates or is being scored: select the next step's groups (once a
        boundary), send the rollout the version the next epoch samples with, as the trainer
        reaches it (one push and one yield a version), and open the next epoch."""
        if self._is_generating() or self._is_scoring() or self._lost:
            return
        if not self._closed:
            self._close_epoch()
        while self.rollout_version < self.carry.version_due():
            if self._trainer_busy() or self.trainer_version == self.rollout_version:
                return  # the version due is being trained, or about to be (_feed_trainer)
            yield from self._sync()
        if self.carry.num_selected < self.settings.num_steps:
            self._open_epoch()

    def _close_epoch(self) -> None:
        selection = self.carry.close_epoch(self._partial)
        gone = {id(group) for group in selection.dropped}
        self._partial = [group for group in self._partial if id(group) not in gone]
        if selection.step is not None:
            self._finished[selection.step] = [*selection.batch, *selection.unkept]
        self._closed = True

    def _open_epoch(self) -> None:
        """Resume the groups stopped at an abort point and start fresh ones (CarryOver.num_fresh),
        every segment from this boundary: the token clock's zero for the epoch."""
        epoch = self.carry.open_epoch()
        waiting = sorted([*self._partial, *self._held], key=lambda group: group.group_id)
        self._partial, self._held = [], []
        groups = list(waiting)
        for _ in range(self.carry.num_fresh(len(waiting) + len(self.carry.backlog), bool(waiting))):
            group_id, self._num_groups = self._num_groups, self._num_groups + 1
            example, samples = self.next_group(group_id)
            groups.append(Group(group_id, 0, example, samples, start_epoch=epoch))
        for group in groups:
            group.segment_start = [len(sample.response_ids) for sample in group.samples]
        self._closed = False
        self._generate(groups)

    def _complete(self, future: Future) -> None:
        kind, *payload = self._pending.pop(future)
        self._kinds[kind] -= 1
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
        elif kind == "stream":
            self._streamed(*payload, result)
        else:
            self._trained(*payload, result)


def _samples_and_scores(groups: list[Group]) -> tuple[list[Sample], list[float]]:
    """What the trainer port takes of `groups`: their samples and scores, group after group."""
    samples = [sample for group in groups for sample in group.samples]
    return samples, [score for group in groups for score in group.scores]


def _give_back(groups: list[Group], samples: list[Sample]) -> None:
    """Hand `groups` their samples back from a trainer call that took them all in order
    (annotated: the call's results replace what the groups held)."""
    for group in groups:
        group.samples, samples = samples[: len(group.samples)], samples[len(group.samples) :]


def abort_point(lengths: list[int], quantile: float) -> int:
    """abort_every "auto": the `quantile` (nearest rank) of a step's response lengths.

    partial_rollout "abort": the 95th. Only the longest responses reach it, so the others
    finish under the version they started with, and the few that stop are the ones a sync
    would otherwise wait for (docs/scale.md, "Abort points").
    partial_rollout "carry": the 50th. There the abort point is an epoch's length, and a
    boundary selects one step: epochs as long as a typical response give a step about one
    response's time, where the tail's would hold every step to the tail's pace (the sweep in
    docs/scale.md, "Carry-over")."""
    ordered = sorted(lengths)
    return max(1, ordered[math.ceil(quantile * len(ordered)) - 1])
