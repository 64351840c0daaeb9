"""`rl eval` / `rl generate` pieces that need no engine: which agent set-up a model records,
and how an episode's transcript is printed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl.agents.environment import ToolUse
from rl.run.offline_eval import agent_of, format_samples
from rl.types import NOT_SAMPLED, Episode, Sample


def test_agent_of_reads_a_base_or_a_checkpoint_and_flags_override(tmp_path: Path) -> None:
    assert agent_of(tmp_path, None, None) is None  # records nothing: single-turn
    base = tmp_path / "base"
    base.mkdir()
    (base / "base_info.json").write_text(
        json.dumps({"agent": {"environment": "calculator", "max_turns": 3}})
    )
    agent = agent_of(base, None, None)
    assert (agent.environment, agent.max_turns) == ("calculator", 3)
    assert agent_of(base, None, 5).max_turns == 5
    assert agent_of(base, "tool_use", None).environment == "tool_use"
    user_env = tmp_path / "my_env.py"
    user_env.write_text("class Mine:\n    pass\n")  # read, not imported, here
    assert agent_of(base, f"{user_env}:Mine", None).environment == f"{user_env}:Mine"

    checkpoint = tmp_path / "step_000001"
    checkpoint.mkdir()
    config = {"agent": {"environment": "tool_use", "tools": ["python"]}}
    (checkpoint / "driver.json").write_text(json.dumps({"config": config}))
    assert agent_of(checkpoint, None, None).tools == ["python"]
    single_turn = {"config": {"agent": {"environment": ""}}}
    (checkpoint / "driver.json").write_text(json.dumps(single_turn))
    assert agent_of(checkpoint, None, None) is None


def test_agent_of_refuses_bad_records_and_flags_by_name(tmp_path: Path) -> None:
    (tmp_path / "base_info.json").write_text(
        json.dumps({"agent": {"environment": "calculator", "max_turns": "many"}})
    )
    recorded = tmp_path / "base_info.json"
    with pytest.raises(ValueError, match=f"(?s)agent set-up in {recorded}: .*max_turns"):
        agent_of(tmp_path, None, None)
    with pytest.raises(ValueError, match="agent.environment 'nope' is neither a built-in"):
        agent_of(tmp_path, "nope", None)
    with pytest.raises(ValueError, match="agent.environment 'no.py:Env': file 'no.py' not found"):
        agent_of(tmp_path, "no.py:Env", None)
    with pytest.raises(ValueError, match="--max-turns must be >= 1, got 0"):
        agent_of(tmp_path, "calculator", 0)


class _CharTokenizer:
    """Decodes token t as chr(t)."""

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


def test_an_episode_transcript_marks_sampled_and_inserted_tokens() -> None:
    ids = [ord(c) for c in "ab"] + [ord(c) for c in "<o>"] + [ord("c")]
    mask = [1, 1, 0, 0, 0, 1]
    episode = Episode(ToolUse(), [], None, num_turns=2)
    sample = Sample(
        prompt_ids=[1],
        group_id=0,
        response_ids=ids,
        logprobs=[-0.5, -0.25, 0.0, 0.0, 0.0, -1.0],
        token_versions=[0, 0, NOT_SAMPLED, NOT_SAMPLED, NOT_SAMPLED, 0],
        finish_reason="stop",
        response_text="c",
        loss_mask=mask,
        episode=episode,
    )
    lines = format_samples("p", [sample], _CharTokenizer()).splitlines()
    # The log-prob is of the sampled tokens: -0.5 - 0.25 - 1.0.
    assert lines[1] == "sample 0 (stop, 2 turns, log-prob -1.750): 'c'"
    assert lines[2:5] == ["  sampled     'ab'", "  observation '<o>'", "  sampled     'c'"]
    assert lines[5] == "  'a' -0.500  'b' -0.250  '<' obs  'o' obs  '>' obs  'c' -1.000"
