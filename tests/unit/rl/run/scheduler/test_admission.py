"""Admission control: groups start in step order, within the staleness bound and budgets."""

from __future__ import annotations

import pytest

from rl.run.scheduler.admission import Admission


def _start_all(admission: Admission, version: int) -> list[int]:
    steps = []
    while (step := admission.next_step(version)) is not None:
        admission.start(step, version)
        steps.append(step)
    return steps


@pytest.mark.parametrize("k", [0, 1, 2])
def test_groups_start_for_at_most_k_plus_one_steps_ahead_of_the_served_version(k: int) -> None:
    admission = Admission(num_steps=10, groups_per_step=2, max_staleness=k, max_groups_per_step=2)
    assert _start_all(admission, version=0) == [s for s in range(1, k + 2) for _ in range(2)]
    assert _start_all(admission, version=0) == []  # nothing more until a new version


def test_no_group_starts_past_the_last_step() -> None:
    admission = Admission(num_steps=2, groups_per_step=1, max_staleness=5, max_groups_per_step=1)
    assert _start_all(admission, version=0) == [1, 2]


def test_a_dropped_group_is_replaced_until_the_step_budget_is_spent() -> None:
    admission = Admission(num_steps=1, groups_per_step=2, max_staleness=0, max_groups_per_step=3)
    assert _start_all(admission, 0) == [1, 1]
    admission.finish(1, kept=False)
    assert _start_all(admission, 0) == [1]  # the third and last start
    admission.finish(1, kept=False)
    assert _start_all(admission, 0) == []
    assert not admission.is_complete(1)  # one still in flight
    admission.finish(1, kept=True)
    assert admission.is_complete(1)
    slots = admission.retire(1)
    assert (slots.num_started, slots.num_kept, slots.num_dropped) == (3, 1, 2)


def test_a_step_is_complete_once_it_has_its_groups() -> None:
    admission = Admission(num_steps=2, groups_per_step=2, max_staleness=1, max_groups_per_step=4)
    _start_all(admission, 0)
    admission.finish(1, kept=True)
    assert not admission.is_complete(1)
    admission.finish(1, kept=True)
    assert admission.is_complete(1)


def test_starting_beyond_the_bound_is_an_invariant_violation() -> None:
    admission = Admission(num_steps=5, groups_per_step=1, max_staleness=0, max_groups_per_step=1)
    with pytest.raises(AssertionError, match="staleness"):
        admission.start(3, rollout_version=0)
