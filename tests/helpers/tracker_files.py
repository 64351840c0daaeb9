"""What a run's trackers wrote, read back from their files: the step metrics of a wandb
offline run and of a tensorboard log directory, as {step: {key: value}}."""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

_BLOCK = 32768  # wandb's run file: LevelDB-style records in 32 KiB blocks after a header
_HEADER = 7  # b":W&B", a 2-byte magic and a version byte
_FULL, _LAST = 1, 4


def _wandb_records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    records, pending, pos = [], b"", _HEADER
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # the rest of the block is padding
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (_FULL, _LAST):
            records.append(pending)
            pending = b""
    return records


def _wandb_run_records(run_file: Path, timeout_s: float = 60.0) -> list:
    """The records of a finished run's file. wandb's service writes the file after
    `run.finish()` returns and may not have flushed it yet: the file is whole once its
    last record is the run's exit record."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    deadline = time.monotonic() + timeout_s
    while True:
        records = []
        try:
            for raw in _wandb_records(run_file):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(raw)
                records.append(record)
        except DecodeError:  # a record cut where the flushed part ends
            records = []
        if records and records[-1].WhichOneof("record_type") == "exit":
            return records
        assert time.monotonic() < deadline, f"{run_file} has no exit record after {timeout_s} s"
        time.sleep(0.2)


def wandb_history(run_dir: Path) -> dict[int, dict[str, float]]:
    """The logged history of the one offline wandb run under `run_dir`/wandb."""
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history: dict[int, dict[str, float]] = {}
    for record in _wandb_run_records(run_file):
        if record.WhichOneof("record_type") != "history":
            continue
        # A key arrives as `key` or as the parts of `nested_key`, by wandb version.
        items = {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in record.history.item
        }
        step = int(items.pop("_step"))
        history[step] = {k: v for k, v in items.items() if not k.startswith("_")}
    return history


def tensorboard_scalars(log_dir: Path) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    scalars: dict[int, dict[str, float]] = {}
    for key in events.Tags()["scalars"]:
        for event in events.Scalars(key):
            scalars.setdefault(event.step, {})[key] = event.value
    return scalars


def same_metrics(records: list[dict], logged: dict[int, dict[str, float]], rel: float) -> None:
    """Assert `logged` holds every metric of the metrics.jsonl `records` (null: NaN), to
    relative tolerance `rel` (tensorboard stores float32)."""
    assert sorted(logged) == [r["step"] for r in records]
    for record in records:
        expected = {k: v for k, v in record.items() if k != "step"}
        got = logged[record["step"]]
        assert sorted(got) == sorted(expected), record["step"]
        for key, value in expected.items():
            if value is None:
                assert math.isnan(got[key]), (record["step"], key, got[key])
            else:
                assert math.isclose(got[key], value, rel_tol=rel, abs_tol=1e-6), (key, got[key])
