"""Admission control: which training step each new prompt group is for, and when it may start.

Pure bookkeeping (no Ray, no clocks), so the staleness guarantee can be tested on its own.

Step s trains on `groups_per_step` groups and turns policy version s-1 into version s. A group
is tied to one step when it starts, and starts only while the rollout serves a version v with
(s - 1) - v <= max_staleness. Versions only grow, so every token of every sample trained at
step s is at most max_staleness versions old, however the group is interrupted and resumed.
Groups start in step order; with dynamic sampling a dropped group frees its slot, and a step
gets at most `max_groups_per_step` starts before it trains on what it kept.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepSlots:
    """Group counts of one step."""

    num_started: int = 0
    num_kept: int = 0  # finished and kept for training
    num_dropped: int = 0  # finished but carrying no signal (dynamic sampling)

    @property
    def num_in_flight(self) -> int:
        return self.num_started - self.num_kept - self.num_dropped


class Admission:
    def __init__(
        self,
        num_steps: int,
        groups_per_step: int,
        max_staleness: int,
        max_groups_per_step: int,
        first_step: int = 1,
    ) -> None:
        """Steps first_step..num_steps (a resumed run starts after its checkpoint's step)."""
        assert groups_per_step >= 1 and max_staleness >= 0
        assert max_groups_per_step >= groups_per_step
        self.num_steps = num_steps
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.max_groups_per_step = max_groups_per_step
        self.steps = {step: StepSlots() for step in range(first_step, num_steps + 1)}

    def next_step(self, rollout_version: int, last_step: int | None = None) -> int | None:
        """The step a group started now under `rollout_version` would be for, or None when no
        group may start (every admissible step up to `last_step` has its groups started, or
        the next step would train on samples more than max_staleness versions old)."""
        for step, slots in self.steps.items():
            if step - 1 - rollout_version > self.max_staleness:
                return None
            if last_step is not None and step > last_step:
                return None
            wanted = slots.num_kept + slots.num_in_flight < self.groups_per_step
            if wanted and slots.num_started < self.max_groups_per_step:
                return step
        return None

    def start(self, step: int, rollout_version: int) -> None:
        assert step - 1 - rollout_version <= self.max_staleness, "staleness bound broken"
        self.steps[step].num_started += 1

    def finish(self, step: int, kept: bool) -> None:
        slots = self.steps[step]
        assert slots.num_in_flight > 0, f"step {step} has no group in flight"
        if kept:
            slots.num_kept += 1
        else:
            slots.num_dropped += 1

    def is_complete(self, step: int) -> bool:
        """Whether step `step` has all the groups it will get: groups_per_step kept, or its
        start budget spent and nothing left in flight."""
        slots = self.steps[step]
        if slots.num_kept >= self.groups_per_step:
            return True
        return slots.num_started >= self.max_groups_per_step and not slots.num_in_flight

    def state_dict(self) -> dict[str, list[int]]:
        """Each step's counts (started, kept, dropped), for a checkpoint taken at a sync,
        when no group is being scored."""
        return {
            str(step): [slots.num_started, slots.num_kept, slots.num_dropped]
            for step, slots in self.steps.items()
        }

    def load_state_dict(self, state: dict[str, list[int]]) -> None:
        """Counts of a checkpoint's steps; those past num_steps (a resumed run shortened) are
        left out."""
        for step, counts in state.items():
            if int(step) <= self.num_steps:
                assert int(step) in self.steps, f"step {step} is not ahead of the checkpoint"
                self.steps[int(step)] = StepSlots(*counts)

    def retire(self, step: int) -> StepSlots:
        """Forget a step once it has trained; returns its counts."""
        assert self.is_complete(step), f"step {step} retired before it was complete"
        return self.steps.pop(step)
