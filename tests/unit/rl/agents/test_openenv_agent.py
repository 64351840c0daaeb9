"""How an OpenEnv episode reads the model's replies as actions and shows it observations
(rl.agents.openenv_agent), on the JSON schemas OpenEnv's own models produce."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("openenv")

from openenv.core.env_server.types import Action  # noqa: E402
from pydantic import Field  # noqa: E402

from rl.agents.openenv_agent import (  # noqa: E402
    InvalidAction,
    action_fields,
    observation_message,
    parse_action,
)


class Guess(Action):
    number: int = Field(..., description="The guess")


class Move(Action):
    piece: str
    square: str


def test_an_actions_fields_leave_out_openenvs_metadata() -> None:
    fields = action_fields(Guess.model_json_schema())
    assert fields == {
        "fields": {"number": {"type": "integer", "description": "The guess"}},
        "required": ["number"],
    }


def test_a_reply_is_a_json_object_fenced_or_not() -> None:
    fields = action_fields(Move.model_json_schema())
    action = {"piece": "knight", "square": "f3"}
    assert parse_action(json.dumps(action), fields) == action
    assert parse_action(f"```json\n{json.dumps(action)}\n```", fields) == action


def test_a_single_field_action_takes_the_replys_text_as_it_is() -> None:
    fields = action_fields(Guess.model_json_schema())
    # The text, not its JSON value: the environment's model converts it, "7" to 7.
    assert parse_action(" 7 ", fields) == {"number": "7"}
    assert Guess.model_validate(parse_action(" 7 ", fields)).number == 7
    assert parse_action('"[1, 2]"', fields) == {"number": '"[1, 2]"'}


@pytest.mark.parametrize("reply", ["", "   ", "knight to f3"])
def test_a_reply_that_is_no_action_is_refused(reply: str) -> None:
    single, double = (action_fields(c.model_json_schema()) for c in (Guess, Move))
    with pytest.raises(InvalidAction):
        parse_action(reply, double)
    if not reply.strip():
        with pytest.raises(InvalidAction):
            parse_action(reply, single)


def test_the_first_observation_shows_the_actions_fields_and_later_ones_do_not() -> None:
    fields = action_fields(Guess.model_json_schema())
    first = observation_message({"hint": "1-10"}, fields)
    assert first["role"] == "user"
    assert json.loads(first["content"]) == {
        "observation": {"hint": "1-10"},
        "action_schema": fields,
    }
    later = observation_message({"hint": "higher"}, None)
    assert json.loads(later["content"]) == {"observation": {"hint": "higher"}}
