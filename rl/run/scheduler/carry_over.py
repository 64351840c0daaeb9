"""partial_rollout "carry": a group is not tied to a step when it starts; each step trains the
first groups to finish on a clock counted in generated tokens, and a long group carries over
to a later step. Pure bookkeeping (no Ray, no clocks): which groups a step trains on, which
version samples each epoch, how many fresh groups start; rl.run.scheduler.loop does the work.

Generation runs in epochs. An epoch ends at a boundary, where nothing generates and nothing is
being scored: every sample in flight has stopped at an abort point (its response length a
multiple of `abort_every`, as under "abort") or finished. Every segment of an epoch starts at
its opening boundary, so a group's place on the token clock is (the epoch it finished in, the
tokens its samples generated in that epoch, at most), ties by group id: the order groups would
finish in if every sample gained a token per decode step, which is what continuous batching
does. That place follows from token counts alone, so what a step trains does not depend on
which worker answered first.

At each boundary (`close_epoch`):
1. The groups finished and kept but not trained yet (the backlog) go in clock order. The next
   step takes the first `groups_per_step` of them that fit both bounds (under dynamic
   sampling, once `max_groups_per_step` groups were scored since the last step, the kept
   ones it has):
   - no trained token is more than `max_token_age` versions old (a group past it can only get
     older: it is dropped, counted in carry/dropped_groups);
   - at most `max_stale_share` of the step's trained tokens are more than `max_staleness`
     versions old: while the first groups break it, the last of them with stale tokens gives
     its place to the next group without any, and waits for a later step.
   A group still generating whose oldest token would be past `max_token_age` at the next
   step is dropped too: it could never be trained.
2. The next epoch samples with the version of the steps selected up to `lag` boundaries ago:
   lag 0 (max_staleness 0) waits for the step just selected to train; lag 1 trains it while
   the next epoch generates.
3. Fresh groups start until `groups_in_flight` are live (generating, or finished and waiting
   for a step); if no step could be selected and nothing generates, `groups_per_step` more,
   so that the run always moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rl.run.scheduler.prompt_groups import Group
from rl.types import NOT_SAMPLED


def token_ages(group: Group, step: int) -> list[int]:
    """The versions each sampled token of `group` would be behind if step `step` trained it."""
    return [
        step - 1 - version
        for sample in group.samples
        for version in sample.token_versions
        if version != NOT_SAMPLED
    ]


@dataclass
class Selection:
    """What a boundary decided: the step that takes `batch` (None: no step this time), the
    groups dynamic sampling dropped since the last step was selected (counted in that step's
    metrics) and the groups dropped for their age."""

    step: int | None
    batch: list[Group]
    unkept: list[Group]
    dropped: list[Group]


@dataclass
class CarryOver:
    num_steps: int
    groups_per_step: int
    groups_in_flight: int
    max_staleness: int  # tokens older than this are stale
    max_stale_share: float
    max_token_age: int
    # Dynamic sampling (None: off): once this many groups were scored since the last step was
    # selected (kept or not), the next step takes the kept ones it has, as a step-tied one
    # does when its redraws are spent.
    max_groups_per_step: int | None
    epoch: int = 0  # epochs opened so far
    num_selected: int = 0  # steps given their groups so far
    # Per boundary, the steps selected by then: the versions epochs sample with follow it.
    selected_by_boundary: list[int] = field(default_factory=lambda: [0, 0])
    backlog: list[Group] = field(default_factory=list)  # finished, kept, not selected
    num_scored: int = 0  # groups scored since the last step was selected
    unkept: list[Group] = field(default_factory=list)  # finished, not kept, not counted yet
    # What each selected step's groups looked like when selected (the bias streaming has),
    # until the step trains: rl/observe's metric names, "carry/...".
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)

    @property
    def lag(self) -> int:
        return min(self.max_staleness, 1)

    def finished(self, group: Group) -> None:
        """A group finished and scored in the current epoch (its `finished_at` and `kept`
        set)."""
        assert group.finished_at is not None and group.finished_at[0] == self.epoch
        (self.backlog if group.kept else self.unkept).append(group)
        self.num_scored += 1

    def close_epoch(self, in_flight: list[Group]) -> Selection:
        """The boundary after the current epoch: select the next step's groups (module
        docstring) and drop the groups too old to ever be trained. `in_flight`: the groups
        stopped partial, which continue in the next epoch unless dropped."""
        dropped: list[Group] = []
        step = self.num_selected + 1
        batch: list[Group] | None = None
        if step <= self.num_steps:
            fits = []  # (group, its stale tokens, its tokens), in clock order
            for group in sorted(self.backlog, key=lambda g: (g.finished_at, g.group_id)):
                ages = token_ages(group, step)
                if max(ages, default=0) > self.max_token_age:
                    dropped.append(group)
                else:
                    fits.append((group, sum(age > self.max_staleness for age in ages), len(ages)))
            cap = self.max_groups_per_step
            batch = self._within_share(fits, cap is not None and self.num_scored >= cap)
        chosen = {id(group) for group in [*(batch or []), *dropped]}
        self.backlog = [group for group in self.backlog if id(group) not in chosen]
        unkept: list[Group] = []
        selected = batch is not None
        if batch is None:
            batch = []
        else:
            self.num_selected, self.num_scored = step, 0
            unkept, self.unkept = self.unkept, []
            for group in [*batch, *unkept]:
                group.step = step
            self.metrics[step] = self._metrics(step, [*batch, *unkept], dropped, in_flight)
        # The next step a group still generating could join; past the age bound there, never.
        later = self.num_selected + 1
        for group in in_flight:
            if max(token_ages(group, later), default=0) > self.max_token_age:
                dropped.append(group)
        self.selected_by_boundary = [*self.selected_by_boundary[1:], self.num_selected]
        return Selection(step if selected else None, batch, unkept, dropped)

    def _within_share(self, fits: list[tuple[Group, int, int]], spent: bool) -> list[Group] | None:
        """The first groups_per_step of `fits` ((group, stale tokens, tokens) in clock
        order); while more than max_stale_share of their tokens are stale, the last group
        with stale tokens gives its place to the next group without any. None if there are
        not enough groups, unless the step's draws are `spent`: then as many as there are
        (fewer, if no fresh group is left to take a stale one's place), within the share."""
        size = min(self.groups_per_step, len(fits)) if spent else self.groups_per_step
        if len(fits) < size:
            return None
        batch, rest = fits[:size], [fit for fit in fits[size:] if not fit[1]]
        while sum(fit[1] for fit in batch) > self.max_stale_share * sum(fit[2] for fit in batch):
            if not rest and not spent:
                return None
            batch.remove([fit for fit in batch if fit[1]][-1])
            if rest:
                batch.append(rest.pop(0))
        return [group for group, _, _ in batch]

    def _metrics(
        self, step: int, counted: list[Group], dropped: list[Group], in_flight: list[Group]
    ) -> dict[str, float]:
        """Streaming favours short responses: the mean length of the samples trained against
        that of every sample finished in the epoch that just closed, how many trained groups
        were carried over from an earlier epoch, and the age of the trained tokens.
        `counted`: the step's groups, kept (its batch) or not."""
        batch = [group for group in counted if group.kept]
        trained = [len(s.response_ids) for group in batch for s in group.samples]
        closed = [
            len(s.response_ids)
            for group in [*counted, *self.backlog, *dropped]  # all finished
            if group.finished_at[0] == self.epoch
            for s in group.samples
        ]
        ages = [age for group in batch for age in token_ages(group, step)]
        return {
            "carry/trained_mean_tokens": sum(trained) / max(len(trained), 1),
            "carry/finished_mean_tokens": sum(closed) / max(len(closed), 1),
            "carry/carried_groups": sum(g.finished_at[0] > g.start_epoch for g in batch)
            / max(len(batch), 1),
            "carry/stale_token_share": sum(age > self.max_staleness for age in ages)
            / max(len(ages), 1),
            "carry/max_token_age": float(max(ages, default=0)),
            "carry/backlog_groups": float(len(self.backlog)),
            "carry/generating_groups": float(len(in_flight)),
            "carry/dropped_groups": float(len(dropped)),
        }

    def check_bounds(self, step: int, groups: list[Group]) -> None:
        """Both bounds, on every token step `step` is about to train."""
        ages = [age for group in groups for age in token_ages(group, step)]
        assert max(ages, default=0) <= self.max_token_age, f"step {step}: a token too old"
        stale = sum(age > self.max_staleness for age in ages)
        assert stale <= self.max_stale_share * len(ages), f"step {step}: too many stale tokens"

    def version_due(self) -> int:
        """The version the next epoch samples with; once every step is selected, the last."""
        if self.num_selected == self.num_steps:
            return self.num_steps
        return self.selected_by_boundary[-1 - self.lag]

    def may_train(self, step: int, rollout_version: int) -> bool:
        """Whether the trainer may train `step` now: its groups are selected, and the version
        before it has reached the rollout. Every version is due at some boundary (the steps
        selected grow by at most one a boundary) and a push sends the trainer's weights as
        they are, so the trainer must not move past one it has not pushed."""
        return step <= self.num_selected and step - 1 <= rollout_version

    def num_fresh(self, num_live: int, generating: bool) -> int:
        """Fresh groups the next epoch starts; `num_live` groups are in flight or in the
        backlog, and `generating` whether any of them continues. 0 once every step is
        selected: nothing more will be trained."""
        if self.num_selected == self.num_steps:
            return 0
        fresh = max(0, self.groups_in_flight - num_live)
        selected = self.selected_by_boundary[-1] > self.selected_by_boundary[-2]
        if not selected and not generating and not fresh:
            fresh = self.groups_per_step  # module docstring, 3.
        return fresh

    def open_epoch(self) -> int:
        self.epoch += 1
        return self.epoch

    def state_dict(self) -> dict:
        """At a boundary; the backlog and the unkept groups are the checkpoint's groups of
        step 0 (kept or not)."""
        return {
            "epoch": self.epoch,
            "num_selected": self.num_selected,
            "num_scored": self.num_scored,
            "selected_by_boundary": self.selected_by_boundary,
            "metrics": {str(step): metrics for step, metrics in self.metrics.items()},
        }

    def load_state_dict(self, state: dict, waiting: list[Group]) -> None:
        """`waiting`: the checkpoint's finished groups no step has selected yet."""
        self.epoch = int(state["epoch"])
        self.num_selected = int(state["num_selected"])
        self.num_scored = int(state["num_scored"])
        self.selected_by_boundary = [int(n) for n in state["selected_by_boundary"]]
        self.metrics = {int(step): dict(m) for step, m in state["metrics"].items()}
        self.backlog = [group for group in waiting if group.kept]
        self.unkept = [group for group in waiting if not group.kept]
