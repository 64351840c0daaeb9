"""The scheduler's groups in flight (rl.run.scheduler.prompt_groups.InFlight) as a checkpoint
records them: JSON, read back through pydantic models that forbid anything else, since a
checkpoint is a user's file.

Samples keep every token, behaviour log-prob and policy version: a resumed run trains the
stale samples the original had in flight, and continues the partial ones from their prefix.
Floats survive exactly (JSON writes a float's shortest round-trip form). The trainer's
annotations are not recorded: a resumed run computes them again from the same weights. An
agent's episode goes with its sample, its environment as the object's attributes (a user's
environment's are the bytes of its pickle, which only its sandboxed workers read, as in a
live run).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from collections import Counter
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rl.agents.environment import Environment
from rl.run.scheduler.prompt_groups import Group, InFlight
from rl.types import Episode, Sample


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _EpisodeRecord(_Record):
    # The environment object's attributes, bytes as {"bytes": base64}; None for an agent
    # function's episode, which holds its example and calls instead.
    env: dict[str, Any] | None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    turn_start: int
    num_turns: int
    reward: float
    turns_with_calls: int
    turns_well_formed: int
    num_calls: int
    num_runs: int
    errors: dict[str, int]
    tool_seconds: float
    max_turns_reached: bool
    env_failures: int
    env_timeouts: int
    template_mismatches: int
    example: dict[str, Any] | None
    calls: list[dict[str, Any]]
    served: int
    refused_calls: int
    prefix_breaks: int
    replay_mismatches: int
    segments: list[_SampleRecord]


class _SampleRecord(_Record):
    prompt_ids: list[int]
    group_id: int
    index: int
    response_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]
    finish_reason: str
    response_text: str
    loss_mask: list[int] | None
    episode: _EpisodeRecord | None
    request_prompt_tokens: int
    cached_prompt_tokens: int | None
    routed_experts: _RoutingRecord | None = None


class _RoutingRecord(_Record):
    """A sample's routing record (rl.types.Sample.routed_experts): its ids' bytes in base64."""

    dtype: Literal["uint8", "int16"]
    shape: list[int] = Field(min_length=3, max_length=3)
    bytes: str


_SampleRecord.model_rebuild()  # its routing record is defined after it
_EpisodeRecord.model_rebuild()  # its segments are samples, defined after it


class _GroupRecord(_Record):
    group_id: int
    step: int
    example: dict[str, Any]
    samples: list[_SampleRecord]
    scores: list[float]
    kept: bool | None
    reward_metrics: dict[str, float]
    start_epoch: int = Field(0, ge=0)
    finished_at: list[int] | None = Field(None, min_length=2, max_length=2)


class _CarryRecord(_Record):
    epoch: int = Field(ge=0)
    num_selected: int = Field(ge=0)
    num_scored: int = Field(ge=0)
    selected_by_boundary: list[int] = Field(min_length=2, max_length=2)
    metrics: dict[str, dict[str, float]]


class _InFlightRecord(_Record):
    next_group_id: int
    admission: dict[str, list[int]]
    groups: list[_GroupRecord]
    abort_every: int = Field(ge=1)
    carry: _CarryRecord | None = None


# Sample fields a checkpoint leaves out: the trainer's annotations, computed again on resume.
_ANNOTATIONS = ("old_logprobs", "ref_logprobs", "values", "teacher_logprobs")


def in_flight_to_json(state: InFlight) -> dict:
    """`state` as JSON-able dicts; ValueError if an environment holds what JSON cannot."""
    return {
        "next_group_id": state.next_group_id,
        "admission": state.admission,
        "abort_every": state.abort_every,
        "carry": state.carry,
        "groups": [
            {
                "group_id": group.group_id,
                "step": group.step,
                "example": group.example,
                "samples": [_sample_to_json(sample) for sample in group.samples],
                "scores": group.scores,
                "kept": group.kept,
                "reward_metrics": group.reward_metrics,
                "start_epoch": group.start_epoch,
                "finished_at": None if group.finished_at is None else list(group.finished_at),
            }
            for group in state.groups
        ],
    }


def in_flight_from_json(
    record: object, where: str, env_class: type[Environment] | None
) -> InFlight:
    """The state `in_flight_to_json` wrote; ValueError naming `where` (the file and key) and
    the offending field if it is anything else. `env_class`: the run's environment (agent
    runs), whose objects the episodes' environments become again."""
    try:
        checked = _InFlightRecord.model_validate(record)
    except ValidationError as e:
        raise ValueError(f"{where} is not a record of groups in flight: {e}") from None
    groups = []
    for group in checked.groups:
        samples = [_sample_from_record(s, env_class, where) for s in group.samples]
        fields = group.model_dump(exclude={"samples"})
        if fields["finished_at"] is not None:
            fields["finished_at"] = tuple(fields["finished_at"])
        groups.append(Group(samples=samples, **fields))
    carry = None if checked.carry is None else checked.carry.model_dump()
    return InFlight(checked.next_group_id, checked.admission, groups, checked.abort_every, carry)


def _sample_to_json(sample: Sample) -> dict:
    record = {
        f.name: getattr(sample, f.name)
        for f in dataclasses.fields(sample)
        if f.name not in (*_ANNOTATIONS, "episode")
    }
    record["episode"] = None if sample.episode is None else _episode_to_json(sample.episode)
    record["routed_experts"] = _routing_to_json(sample.routed_experts)
    return record


def _routing_to_json(record: torch.Tensor | None) -> dict | None:
    if record is None:
        return None
    return {
        "dtype": str(record.dtype).removeprefix("torch."),
        "shape": list(record.shape),
        "bytes": base64.b64encode(record.contiguous().numpy().tobytes()).decode("ascii"),
    }


def _routing_from_record(record: _RoutingRecord | None, where: str) -> torch.Tensor | None:
    if record is None:
        return None
    data = base64.b64decode(record.bytes)
    dtype = getattr(torch, record.dtype)
    if len(data) != math.prod(record.shape) * dtype.itemsize:
        raise ValueError(
            f"{where}: a sample's routed_experts holds {len(data)} bytes, not the "
            f"{math.prod(record.shape) * dtype.itemsize} of {record.dtype} {record.shape}"
        )
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(record.shape)


def _episode_to_json(episode: Episode) -> dict:
    record = {
        f.name: getattr(episode, f.name)
        for f in dataclasses.fields(episode)
        if f.name not in ("env", "tool_spans")  # spans: the driver's trace has taken them
    }
    record["errors"] = dict(episode.errors)
    record["segments"] = [_sample_to_json(segment) for segment in episode.segments]
    if episode.env is None:
        record["env"] = None
        return record
    env = {}
    for name, value in vars(episode.env).items():
        if isinstance(value, bytes):
            value = {"bytes": base64.b64encode(value).decode("ascii")}
        try:
            json.dumps(value)
        except TypeError:
            raise ValueError(
                f"environment {type(episode.env).__name__} holds {name}={value!r}, which a "
                "checkpoint cannot record (JSON values or bytes only)"
            ) from None
        env[name] = value
    record["env"] = env
    return record


def _sample_from_record(
    record: _SampleRecord, env_class: type[Environment] | None, where: str
) -> Sample:
    fields = record.model_dump(exclude={"episode", "routed_experts"})
    fields["routed_experts"] = _routing_from_record(record.routed_experts, where)
    episode = None
    if record.episode is not None and record.episode.env is None:
        episode_fields = record.episode.model_dump(exclude={"env", "errors", "segments"})
        segments = [_sample_from_record(s, None, where) for s in record.episode.segments]
        episode = Episode(
            env=None, errors=Counter(record.episode.errors), segments=segments, **episode_fields
        )
    elif record.episode is not None:
        if env_class is None:
            raise ValueError(f"{where} holds an agent episode, but this run has no environment")
        episode_fields = record.episode.model_dump(exclude={"env", "errors", "segments"})
        env = env_class.__new__(env_class)
        for name, value in record.episode.env.items():
            if isinstance(value, dict) and set(value) == {"bytes"}:
                value = base64.b64decode(value["bytes"])
            setattr(env, name, value)
        episode = Episode(env=env, errors=Counter(record.episode.errors), **episode_fields)
    return Sample(episode=episode, **fields)
