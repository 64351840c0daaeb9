"""verl's fully-async policy (volcengine/verl, recipe/fully_async_policy, PR #2981, the
version that published the calibration's numbers) on the simulated split cluster, as the
baseline Tandem's scheduler is compared with (docs/scale.md, "Calibration").

What it does, from its code (paths under recipe/fully_async_policy/ at commit 13a99859a):
- **The rollouter** (fully_async_rollouter.py) starts prompts one at a time, each a group of
  rollout.n responses, while fewer than `max_concurrent_samples` are in flight (16 a vLLM
  server: `len(server_handles) * 16`, capped at `max_required_samples`). Interrupted groups
  go first. It pauses once `staleness_samples` reaches
  `max_required_samples = required_samples x (staleness_threshold + 1) x trigger_parameter_sync_step`
  (`set_max_required_samples`); a new prompt adds one, and each sync resets it to the groups
  in flight, interrupted or finished and not yet trained (`update_param_version`). Paused,
  it stops starting groups; those in flight go on.
- **The trainer** (fully_async_trainer.py) takes `required_samples = ppo_mini_batch_size x
  require_batches` finished groups from the message queue (message_queue.py: first in, first
  out, in the order they finished), trains on them, and after `trigger_parameter_sync_step`
  such local steps syncs the weights (`_trigger_parameter_sync_after_step`).
- **A sync** (param_sync.py `sync_weights`) pauses the rollouter first: with partial
  rollout it cancels what is in flight, whose partial responses resume after the sync under
  the new weights with their prefixes (agent_loop/partial_single_turn_agent_loop.py: prompt
  plus partial response as the new prompt; the KV cache is reset); without, it waits for
  every group in flight to finish. Then the weights move and the rollouter resumes.
- **Old log-probs** are the rollout's (`use_rollout_log_probs=True`, the launch script's
  last line): the trainer computes none (ray_trainer.py `_process_batch_common`).

Not modelled: the rollouter's 10-second monitor loop (it only unpauses a full queue, and the
queue never fills before `staleness_samples` does: the count includes every queued group),
validation, and a sample pulled from the data loader while the rollouter waits for a
concurrency slot at a sync (one group).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sim import verl
from sim.async_policies import Group, SplitCluster
from sim.cluster import Placement, Result, Schedule, Workload
from sim.cluster import simulate as simulate_sync
from sim.costs import CostModel

SERVER_CONCURRENCY = 16  # groups in flight a vLLM server (fully_async_rollouter.py)


@dataclass(frozen=True)
class VerlSchedule:
    """verl's `async_training` settings and the mini-batch, in prompts. The defaults are the
    128-GPU Qwen2.5-Math-7B run's (recipe/fully_async_policy/shell/dapo_7b_math_fsdp2_64_64.sh:
    `train_prompt_mini_bsz=32`, `require_batches=4`, `trigger_parameter_sync_step=4`,
    `partial_rollout=True`; staleness 0.5 as its README's table reports)."""

    staleness_threshold: float = 0.5
    partial_rollout: bool = True
    ppo_mini_batch_size: int = 32
    require_batches: int = 4
    trigger_parameter_sync_step: int = 4

    @property
    def required_samples(self) -> int:
        return self.ppo_mini_batch_size * self.require_batches

    @property
    def max_required_samples(self) -> int:
        """Groups the rollouter may count between two syncs (`set_max_required_samples`)."""
        return int(
            self.required_samples
            * (self.staleness_threshold + 1)
            * self.trigger_parameter_sync_step
        )

    def for_groups(self, groups_per_version: int) -> VerlSchedule:
        """The same schedule for another batch: the mini-batch scaled so that a version
        still trains `groups_per_version` groups in `require_batches` x
        `trigger_parameter_sync_step` local steps (verl's README asks for
        `trigger_parameter_sync_step = train_batch_size / (require_batches x ppo_mini_batch_size)`)."""
        local_steps = self.require_batches * self.trigger_parameter_sync_step
        if groups_per_version % local_steps:
            raise ValueError(
                f"{groups_per_version} groups a step do not split into require_batches x "
                f"trigger_parameter_sync_step = {local_steps} equal mini-batches"
            )
        return dataclasses.replace(self, ppo_mini_batch_size=groups_per_version // local_steps)

    def label(self) -> str:
        partial = ", partial rollout" if self.partial_rollout else ""
        return f"verl staleness {self.staleness_threshold:g}{partial}"


# verl README's "128-card 7B Asynchronous Mode Experiment" rows.
STREAMING = VerlSchedule(staleness_threshold=0.0, partial_rollout=False)
ASYNC = VerlSchedule(staleness_threshold=0.5, partial_rollout=True)


@dataclass
class Rollouter:
    """The rollouter's admission: which group it starts next, if any (pure logic, no clock)."""

    max_required_samples: int
    max_concurrent_samples: int
    staleness_samples: int = 0
    paused: bool = False
    cancelled: deque[Group] = field(default_factory=deque)  # resumed first

    def next(self, in_flight: int, new_group: Callable[[], Group]) -> Group | None:
        """The group it starts next with `in_flight` groups running: the oldest interrupted
        one, else a new one from `new_group`, or None."""
        if self.paused:
            return None
        if self.staleness_samples >= self.max_required_samples:
            self.paused = True  # until the next sync
            return None
        if in_flight >= self.max_concurrent_samples:
            return None
        if self.cancelled:
            return self.cancelled.popleft()
        self.staleness_samples += 1
        return new_group()

    def synced(self, carried: int) -> None:
        """After a sync: `carried` groups are in flight, interrupted, or finished and not
        yet trained; they count against the new version's budget."""
        self.staleness_samples = carried
        self.paused = False


def simulate(
    cost: CostModel, placement: Placement, workload: Workload, schedule: VerlSchedule
) -> Result:
    """verl's fully-async policy over `workload` on `placement`'s simulated GPUs (split only:
    verl runs rollouter and trainer on their own GPUs). A step is a policy version: the
    trainer's `trigger_parameter_sync_step` local steps and the sync after them, which train
    `workload.groups_per_step` groups, as the synchronous step does."""
    per_version = schedule.required_samples * schedule.trigger_parameter_sync_step
    if per_version != workload.groups_per_step:
        raise ValueError(
            f"ppo_mini_batch_size x require_batches x trigger_parameter_sync_step = "
            f"{per_version} groups a version, but the workload trains "
            f"{workload.groups_per_step} a step"
        )
    cluster = SplitCluster(cost, placement, workload)
    rollouter = Rollouter(
        schedule.max_required_samples,
        min(SERVER_CONCURRENCY * len(cluster.engines), schedule.max_required_samples),
    )
    queue: deque[Group] = deque()  # finished, not yet trained: the message queue
    local_step = 0
    while cluster.version < workload.num_steps:
        while group := rollouter.next(len(cluster.in_flight), cluster.new_group):
            cluster.start(group)
        if not cluster.training and len(queue) >= schedule.required_samples:
            cluster.train([queue.popleft() for _ in range(schedule.required_samples)])
        finished, interrupted, ended = cluster.wait()
        assert not interrupted, "only a sync interrupts"
        queue.extend(finished)
        if ended is None:
            continue
        local_step += 1
        if local_step < schedule.trigger_parameter_sync_step:
            continue
        local_step = 0
        if schedule.partial_rollout:
            finished, interrupted = cluster.interrupt()
            rollouter.cancelled.extend(interrupted)
        else:
            rollouter.paused = True
            finished = cluster.drain()
        queue.extend(finished)
        cluster.push()
        rollouter.synced(len(rollouter.cancelled) + len(queue))
    return cluster.result()


@dataclass(frozen=True)
class Calibration:
    """verl's three 128-GPU configurations, simulated the way docs/scale.md calibrates: the
    median response length fitted to the synchronous generation time, the trainer's speed
    taken from verl's table (`sim.verl.trainer_costs`)."""

    median: int
    sync: Result  # colocated on 128 GPUs, Tandem's scheduler at k = 0
    streaming: Result  # verl's policy, 64:64, staleness 0
    fully_async: Result  # verl's policy, 64:64, staleness 0.5, partial rollout

    def speedup(self, name: str) -> float:
        """A configuration's steps per hour over the synchronous baseline's."""
        run = {"streaming": self.streaming, "async": self.fully_async}[name]
        return run.steps_per_hour / self.sync.steps_per_hour


def calibrate(num_steps: int = 8) -> Calibration:
    """verl's calibration runs: the synchronous baseline over 4 steps (its steady state is
    every step), the two policies over `num_steps` versions."""
    median, fitted_sync = verl.fit_median()
    cost = verl.trainer_costs(fitted_sync)
    baseline = verl.workload(median, num_steps=4, needs_annotation=True)
    sync = simulate_sync(cost["colocate"], verl.SYNC_PLACEMENT, baseline, Schedule(0))
    # verl's fully-async trainer takes the rollout's log-probs: no annotation.
    overlapped = verl.workload(median, num_steps=num_steps, needs_annotation=False)
    split = Placement.split(128, 64)
    return Calibration(
        median,
        sync,
        simulate(cost["split"], split, overlapped, STREAMING),
        simulate(cost["split"], split, overlapped, ASYNC),
    )
