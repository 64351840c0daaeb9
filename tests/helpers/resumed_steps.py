"""Whether a step computed again after an in-process resume is the step the run logged."""

from __future__ import annotations

import pytest

from rl.observe.metrics import is_measurement


def computed(record: dict) -> dict:
    """A metrics record without the measurements of the machine (timings, memory): what two
    runs of the same recipe must agree on bit for bit."""
    return {k: v for k, v in record.items() if not is_measurement(k)}


def assert_same_step(original: dict, resumed: dict) -> None:
    """The same samples, rewards and sampling statistics bit for bit (measurements of the
    machine aside). The trainer's own reductions (actor/*) may round differently in the last
    bits of fp32 between a run and its resume in one process (left to issue 33, exact
    resume): they agree to roundoff."""
    first, again = computed(original), computed(resumed)
    assert first.keys() == again.keys()
    trainer_side = {k for k in first if k.startswith("actor/")}
    assert {k: first[k] for k in first.keys() - trainer_side} == {
        k: again[k] for k in again.keys() - trainer_side
    }
    for key in trainer_side:
        assert again[key] == pytest.approx(first[key], rel=1e-5, abs=1e-8), key
