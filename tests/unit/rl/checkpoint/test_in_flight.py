"""Groups in flight as a checkpoint records them: exact round trips (through JSON text, as
written), agent episodes with their environment's state, and refusal of anything else."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from rl.agents.environment import Environment
from rl.checkpoint.in_flight import in_flight_from_json, in_flight_to_json
from rl.run.scheduler.prompt_groups import Group, InFlight
from rl.types import Episode, Sample


class _StatefulEnv(Environment):
    def __init__(self, state: bytes, turn: int) -> None:
        self._state, self.turn = state, turn


def _through_json(state: InFlight, env_class: type[Environment] | None = None) -> InFlight:
    text = json.dumps(in_flight_to_json(state))
    return in_flight_from_json(json.loads(text), "ckpt/driver.json (in_flight)", env_class)


def _state(sample: Sample, kept: bool | None = True) -> InFlight:
    group = Group(3, 5, {"prompt": "1+2", "answer": "3"}, [sample], [1.0], kept, {"reward/x": 0.5})
    return InFlight(next_group_id=9, admission={"5": [4, 1, 0]}, groups=[group], abort_every=37)


def test_a_scored_group_comes_back_with_every_token_logprob_and_version_exactly() -> None:
    logprobs = [-0.1, -1 / 3, -2.718281828459045e-7]  # floats JSON must not round
    sample = Sample([1, 2], 3, 0, [7, 8, 9], logprobs, [1, 1, 2], "stop", "789")
    sample.old_logprobs = [0.0, 0.0, 0.0]  # an annotation: computed again on resume
    back = _through_json(_state(sample))
    assert back.next_group_id == 9 and back.admission == {"5": [4, 1, 0]}
    assert back.abort_every == 37
    (group,) = back.groups
    assert (group.group_id, group.step, group.scores, group.kept) == (3, 5, [1.0], True)
    assert group.reward_metrics == {"reward/x": 0.5} and not group.annotated
    restored = group.samples[0]
    assert restored.logprobs == logprobs and restored.token_versions == [1, 1, 2]
    assert restored.response_ids == [7, 8, 9] and restored.old_logprobs is None


def test_a_partial_episode_comes_back_with_its_environment_state() -> None:
    env = _StatefulEnv(b"\x80\x04pickled by a sandboxed worker\x00", turn=2)
    episode = Episode(env, [{"role": "user", "content": "hi"}], None, turn_start=4, num_turns=1)
    episode.errors = Counter({"timeout": 1})
    sample = Sample([1], 3, 1, [5, 6, 7, 8, 9, 10], [-1.0] * 6, [0] * 6, "abort")
    sample.loss_mask, sample.episode = [1, 1, 0, 0, 1, 1], episode
    (group,) = _through_json(_state(sample, kept=None), _StatefulEnv).groups
    restored = group.samples[0]
    assert restored.is_partial and group.kept is None and restored.loss_mask == sample.loss_mask
    assert isinstance(restored.episode.env, _StatefulEnv)
    assert restored.episode.env._state == env._state and restored.episode.env.turn == 2
    assert restored.episode.errors == Counter({"timeout": 1})
    assert restored.episode.turn_start == 4 and restored.episode.messages == episode.messages


def test_an_agent_functions_partial_episode_comes_back_with_its_example_and_calls() -> None:
    """No environment here: the episode holds its example and the calls its agent made, which
    a resumed run's agent is answered from (rl.agents.api_calls)."""
    reply = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0_0"}]}
    calls = [
        {
            "request": {
                "messages": [{"role": "user", "content": "1+2"}],
                "tools": None,
                "max_tokens": None,
            },
            "reply": reply,
            "finish_reason": "tool_calls",
            "usage": {"prompt_tokens": 5, "completion_tokens": 2},
        },
        {
            "request": {"messages": [], "tools": None, "max_tokens": 4},
            "reply": None,
            "finish_reason": None,
        },
    ]
    episode = Episode(None, [], None, turn_start=4, num_turns=1, example={"prompt": "1+2"})
    episode.calls, episode.served, episode.refused_calls = calls, 1, 2
    episode.segments = [Sample([4], 3, 1, [6, 7], [-0.5, 0.0], [2, -1], "stop", loss_mask=[1, 0])]
    sample = Sample([1], 3, 1, [5, 6, 7, 8, 9], [-1.0] * 5, [0] * 5, "abort")
    sample.loss_mask, sample.episode = [1, 1, 0, 0], episode
    (group,) = _through_json(_state(sample, kept=None)).groups  # no env_class: none needed
    restored = group.samples[0].episode
    assert restored.env is None and restored.example == {"prompt": "1+2"}
    assert restored.calls == calls and restored.refused_calls == 2 and restored.served == 1
    [segment] = restored.segments
    assert (segment.prompt_ids, segment.response_ids, segment.logprobs) == (
        [4],
        [6, 7],
        [-0.5, 0.0],
    )
    assert segment.token_versions == [2, -1] and segment.loss_mask == [1, 0]


@pytest.mark.parametrize(
    "tamper",
    [
        lambda r: r["groups"][0]["samples"][0].update(logprobs=["-1.0"]),
        lambda r: r["groups"][0].update(step="5"),
        lambda r: r["groups"][0]["samples"][0].update(__class__="os.system"),
        lambda r: r.update(next_group_id=None),
        lambda r: r.update(abort_every=0),
        lambda r: r.pop("abort_every"),
    ],
)
def test_a_tampered_record_is_refused_naming_where(tamper) -> None:
    record = json.loads(json.dumps(in_flight_to_json(_state(Sample([1], 3, 0, [2], [-1.0], [0])))))
    tamper(record)
    with pytest.raises(ValueError, match=r"ckpt/driver.json \(in_flight\) is not a record"):
        in_flight_from_json(record, "ckpt/driver.json (in_flight)", None)


def test_the_teachers_log_probs_are_left_out_and_scored_again_on_resume() -> None:
    """A frozen teacher scores the same tokens the same way after a resume: its annotation is
    not written, as the reference's is not."""
    sample = Sample([1, 2], 3, 0, [7, 8], [-0.5, -0.25], [1, 1], "stop", "78")
    sample.teacher_logprobs = [-0.75, -1.0]
    (group,) = _through_json(_state(sample)).groups
    assert group.samples[0].teacher_logprobs is None and not group.annotated
    assert group.samples[0].logprobs == [-0.5, -0.25]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16])
def test_a_samples_routing_record_comes_back_exactly(dtype: torch.dtype) -> None:
    sample = Sample([1, 2], 3, 0, [7, 8, 9], [-0.5, -0.25, -1.0], [1, 1, 2], "abort", "789")
    record = torch.randint(0, 300 if dtype == torch.int16 else 256, (4, 3, 2), dtype=dtype)
    sample.routed_experts = record
    (group,) = _through_json(_state(sample)).groups
    restored = group.samples[0].routed_experts
    assert restored.dtype == dtype and torch.equal(restored, record)


def test_a_routing_record_of_the_wrong_size_is_refused_naming_where() -> None:
    sample = Sample([1], 3, 0, [2], [-1.0], [0])
    sample.routed_experts = torch.zeros(1, 2, 2, dtype=torch.uint8)
    record = json.loads(json.dumps(in_flight_to_json(_state(sample))))
    record["groups"][0]["samples"][0]["routed_experts"]["shape"] = [2, 2, 2]
    with pytest.raises(ValueError, match=r"ckpt/driver.json \(in_flight\): .* holds 4 bytes"):
        in_flight_from_json(record, "ckpt/driver.json (in_flight)", None)
