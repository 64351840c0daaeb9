"""The order in which the driver issues and awaits a stream's writes and applies, on fake
actors: the shared-memory transport writes bucket i + 1 while bucket i loads, and never into a
slot someone may still read; the gloo transport stops at a lost receiver."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from rl.sync import weight_sync
from rl.sync.transport import TRANSPORTS
from rl.sync.weight_sync import WeightSync

NUM_BUCKETS = 4


class _Ref:
    def __init__(self, name: str, value: object) -> None:
        self.name, self.value = name, value


class _Method:
    def __init__(self, log: list[str], name: str, result) -> None:
        self._log, self._name, self._result = log, name, result

    def remote(self, bucket: int, *args) -> _Ref:
        name = f"{self._name} {bucket}"
        self._log.append(f"issue {name}")
        return _Ref(name, self._result(bucket))


def _stream(transport: str, dead: dict[int, int] | None = None) -> tuple[list[str], WeightSync]:
    """Run one stream to 2 receivers over 2 trainer ranks; `dead` maps a receiver to the
    bucket whose apply finds it dead. Returns the log of issued and awaited calls."""
    log: list[str] = []
    dead = dead or {}
    stats = {"seconds": 0.0, "peak_extra_bytes": 0.0, "load_s": 0.0}

    def apply_result(index: int):
        def result(bucket: int):
            if dead.get(index) == bucket:
                return ActorDiedError()
            return (1, stats) if bucket + 1 == NUM_BUCKETS else (1, None)

        return result

    def write_result(bucket: int):
        # Over a broken gloo group the trainer's sends to the lost member fail.
        if dead and min(dead.values()) == bucket and transport == "distributed":
            return RayTaskError("write_weight_bucket", "", RuntimeError("peer gone"))
        return stats

    sync = object.__new__(WeightSync)
    sync._trainers = [
        SimpleNamespace(write_weight_bucket=_Method(log, f"write[{rank}]", write_result))
        for rank in range(2)
    ]
    sync._rollout = SimpleNamespace(
        workers=[
            SimpleNamespace(apply_weight_bucket=_Method(log, f"apply[{i}]", apply_result(i)))
            for i in range(2)
        ]
    )
    sync.plan = SimpleNamespace(buckets=[[]] * NUM_BUCKETS, total_bytes=0)
    sync.full_model_bytes = 0
    sync._traits = TRANSPORTS.traits(transport)

    def get(refs):
        if isinstance(refs, list):
            return [get(ref) for ref in refs]
        log.append(f"wait {refs.name}")
        if isinstance(refs.value, BaseException):
            raise refs.value
        return refs.value

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(weight_sync.ray, "get", get)
        for _ in sync.stream(version=1):
            pass
    return log, sync


def test_shared_memory_writes_the_next_bucket_while_this_one_loads() -> None:
    log, _ = _stream("shared_memory")
    for bucket in range(NUM_BUCKETS - 1):
        # Issued before the driver waits for anyone to finish loading `bucket`...
        assert log.index(f"issue write[0] {bucket + 1}") < log.index(f"wait apply[0] {bucket}")
        # ...and after both receivers finished the bucket that used its slot before.
        if bucket >= 1:
            for receiver in range(2):
                assert log.index(f"wait apply[{receiver}] {bucket - 1}") < log.index(
                    f"issue write[0] {bucket + 1}"
                )
        # A bucket is read only once every rank has written it.
        assert log.index(f"wait write[1] {bucket}") < log.index(f"issue apply[0] {bucket}")


def test_a_lost_receiver_on_shared_memory_is_dropped_and_the_rest_finish() -> None:
    log, sync = _stream("shared_memory", dead={1: 1})
    assert sync.failed == [1]
    assert f"wait apply[0] {NUM_BUCKETS - 1}" in log
    assert f"issue apply[1] {NUM_BUCKETS - 1}" not in log


def test_a_lost_receiver_on_a_gloo_group_stops_the_stream_at_that_bucket() -> None:
    log, sync = _stream("distributed", dead={1: 1})
    assert sync.failed == [1]
    # The trainers' failed sends to the lost member are the loss itself, not a trainer error,
    # and nothing more is sent over the broken group.
    assert "wait write[0] 1" in log and "wait write[1] 1" in log
    assert not [line for line in log if line.endswith(" 2") or line.endswith(" 3")]
    assert sync.metrics["weight_sync/buckets"] == NUM_BUCKETS
