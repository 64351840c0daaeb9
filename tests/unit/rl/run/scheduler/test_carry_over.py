"""The carry-over selection rule on hand-built groups (rl.run.scheduler.carry_over): clock
order, both bounds, the draws of dynamic sampling, the version each epoch samples with."""

from __future__ import annotations

from rl.run.scheduler.carry_over import CarryOver
from rl.run.scheduler.prompt_groups import Group
from rl.types import Sample


def _group(group_id: int, versions: list[int], finished_at: tuple[int, int], kept=True) -> Group:
    sample = Sample([1], group_id, 0, [7] * len(versions), [0.0] * len(versions), versions)
    return Group(group_id, 0, {}, [sample], kept=kept, finished_at=finished_at)


def _carry(**overrides) -> CarryOver:
    settings = dict(
        num_steps=10, groups_per_step=2, groups_in_flight=4, max_staleness=1,
        max_stale_share=0.5, max_token_age=3, max_groups_per_step=None,
    )  # fmt: skip
    return CarryOver(**{**settings, **overrides})


def _finish(carry: CarryOver, *groups: Group) -> None:
    for group in groups:
        carry.epoch = group.finished_at[0]
        carry.finished(group)


def test_a_step_takes_the_first_groups_on_the_token_clock_ids_breaking_ties() -> None:
    carry = _carry()
    late, early, tie_b, tie_a = (
        _group(0, [0], (2, 1)), _group(1, [0], (1, 9)), _group(3, [0], (2, 0)),
        _group(2, [0], (2, 0)),
    )  # fmt: skip
    _finish(carry, early, late, tie_b, tie_a)
    selection = carry.close_epoch([])
    # Epoch 1 before epoch 2; within epoch 2, fewer tokens first, then the lower id.
    assert [g.group_id for g in selection.batch] == [1, 2]
    assert selection.step == 1 and all(g.step == 1 for g in selection.batch)
    assert [g.group_id for g in carry.backlog] == [0, 3]


def test_too_old_groups_are_dropped_and_stale_ones_give_way_to_fresh_ones() -> None:
    carry = _carry(num_selected=4)  # step 5 next: a token of version v is 4 - v old
    too_old = _group(0, [0, 4], (1, 1))  # a token 4 versions old: past max_token_age 3
    stale = _group(1, [2, 2, 2, 4], (1, 2))  # 3 of 4 tokens 2 old (> k = 1)
    fresh_a, fresh_b = _group(2, [4], (1, 3)), _group(3, [4], (1, 4))
    _finish(carry, too_old, stale, fresh_a, fresh_b)
    selection = carry.close_epoch([])
    assert [g.group_id for g in selection.dropped] == [0]
    # First two fitting: stale and fresh_a, 3 of 5 tokens stale (> 0.5): the stale group
    # gives its place to fresh_b, the next without stale tokens.
    assert [g.group_id for g in selection.batch] == [2, 3]
    assert [g.group_id for g in carry.backlog] == [1]
    carry.check_bounds(5, selection.batch)


def test_a_group_still_generating_that_could_never_be_trained_is_dropped() -> None:
    carry = _carry(num_selected=3)
    generating_old, generating_young = _group(0, [0], (0, 0)), _group(1, [1], (0, 0))
    selection = carry.close_epoch([generating_old, generating_young])
    # No step selected: the next that could train them is step 4, where version 0 is 3
    # versions old, at the bound: both continue.
    assert selection.step is None and selection.dropped == []
    carry.num_selected = 4  # now step 5 at the earliest: version 0 would be 4 old
    selection = carry.close_epoch([generating_old, generating_young])
    assert [g.group_id for g in selection.dropped] == [0]


def test_without_dynamic_sampling_a_step_waits_for_all_its_groups() -> None:
    carry = _carry()
    _finish(carry, _group(0, [0], (1, 1)))
    assert carry.close_epoch([]).step is None


def test_with_dynamic_sampling_a_step_takes_what_it_kept_once_its_draws_are_spent() -> None:
    carry = _carry(max_groups_per_step=4)
    _finish(carry, _group(0, [0], (1, 1)), _group(1, [0], (1, 2), kept=False))
    assert carry.close_epoch([]).step is None  # 2 of 4 draws scored
    _finish(carry, _group(2, [0] * 3, (2, 3), kept=False), _group(3, [0], (2, 1), kept=False))
    selection = carry.close_epoch([])
    assert selection.step == 1
    assert [g.group_id for g in selection.batch] == [0]
    assert [g.group_id for g in selection.unkept] == [1, 2, 3]  # counted in step 1
    assert carry.num_scored == 0
    # Trained: group 0's 1 token; finished in the epoch that closed: groups 2 and 3.
    metrics = carry.metrics[1]
    assert metrics["carry/trained_mean_tokens"] == 1.0
    assert metrics["carry/finished_mean_tokens"] == (3 + 1) / 2


def test_epochs_sample_with_the_steps_selected_one_boundary_earlier_at_k_one() -> None:
    lagged, eager = _carry(), _carry(max_staleness=0)
    for carry in (lagged, eager):
        _finish(carry, _group(0, [0], (1, 1)), _group(1, [0], (1, 1)))
        carry.close_epoch([])
        assert carry.num_selected == 1
    # k = 1: the next epoch still samples with version 0 while step 1 trains; k = 0 waits.
    assert (lagged.version_due(), eager.version_due()) == (0, 1)
    lagged.close_epoch([])
    assert lagged.version_due() == 1
    # The trainer never runs ahead of a version the rollout has not been sent.
    assert lagged.may_train(1, 0) and not lagged.may_train(2, 0)
