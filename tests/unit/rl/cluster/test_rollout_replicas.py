"""How a poll's outcome reaches the scheduler: a dead worker is lost, an engine's error fails
the run naming the worker."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from ray.exceptions import ActorDiedError

from rl.cluster.rollout_replicas import RolloutFailed, _relay
from rl.run.scheduler.ports import WorkerLost


def _relayed(outcome: BaseException | dict) -> Future:
    polled, future = Future(), Future()
    if isinstance(outcome, BaseException):
        polled.set_exception(outcome)
    else:
        polled.set_result(outcome)
    _relay(polled, future, index=3)
    return future


def test_an_engine_error_fails_the_poll_naming_the_worker_and_the_cause() -> None:
    with pytest.raises(RolloutFailed, match="rollout worker 3 failed: ValueError: too long"):
        _relayed(ValueError("too long")).result(timeout=1)


def test_a_dead_actor_is_a_lost_worker_and_a_result_passes_through() -> None:
    with pytest.raises(WorkerLost):
        _relayed(ActorDiedError()).result(timeout=1)
    assert _relayed({1: []}).result(timeout=1) == {1: []}
