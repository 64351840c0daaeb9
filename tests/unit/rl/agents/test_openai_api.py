"""rl.agents.openai_api: what the endpoint serves of the chat-completions format, and that a
reply an SDK sends back compares equal to the reply it was served."""

import json

import pytest
from openai.types.chat import ChatCompletionMessage

from rl.agents.openai_api import (
    BadRequest,
    normalize_message,
    parse_chat_request,
    parse_completion_request,
    reply_message,
    template_messages,
)
from rl.agents.tool_calls import parse_tool_calls
from tests.helpers.chat_templates import WEATHER_TOOL

USER = {"role": "user", "content": "Weather in Paris?"}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _reply(text: str, call_id: str) -> dict:
    return reply_message(text, parse_tool_calls(text, [WEATHER_TOOL]), "hermes", call_id)


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ({"messages": [USER], "n": 2}, "n=2"),
        ({"messages": [USER], "stream": True}, "stream"),
        ({"messages": [USER], "tool_choice": "required", "tools": [WEATHER_TOOL]}, "tool_choice"),
        ({"messages": []}, "non-empty"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role 'robot'"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "image_url"),
        ({"messages": [USER], "max_tokens": 0}, "max_tokens"),
        ({"messages": [USER], "tools": [{"name": "bare"}]}, "tools[0]"),
        ([USER], "not an object"),
    ],
)
def test_a_request_asking_what_is_not_served_is_refused_saying_what(body, said) -> None:
    with pytest.raises(BadRequest, match=said.replace("(", r"\(").replace("[", r"\[")):
        parse_chat_request(body)


def test_sampling_settings_of_a_request_are_ignored_and_text_parts_joined() -> None:
    request = parse_chat_request(
        {
            "model": "gpt-anything",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
            "temperature": 0.0,
            "top_p": 0.5,
            "seed": 3,
            "max_completion_tokens": 7,
            "tools": [WEATHER_TOOL],
            "tool_choice": "auto",
        }
    )
    assert request.messages == [{"role": "user", "content": "ab"}]
    assert request.tools == [WEATHER_TOOL]
    assert request.max_tokens == 7


def test_tool_choice_none_renders_no_tools() -> None:
    request = parse_chat_request(
        {"messages": [USER], "tools": [WEATHER_TOOL], "tool_choice": "none"}
    )
    assert request.tools is None


def test_a_turn_with_a_well_formed_call_replies_with_tool_calls_and_the_rest_as_content() -> None:
    reply = _reply(f"Checking.\n{CALL_TEXT}", "call_0")
    assert reply["content"] == "Checking."
    [call] = reply["tool_calls"]
    assert call["id"] == "call_0_0" and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert _reply(CALL_TEXT, "c")["content"] is None


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}',  # never closed
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',  # unknown tool
        '<tool_call>{"name": "get_weather", "arguments": {"town": 1}}</tool_call>',  # bad args
    ],
)
def test_a_turn_whose_calls_cannot_all_be_run_stays_text(text: str) -> None:
    assert _reply(text, "c") == {"role": "assistant", "content": text}


def test_without_calls_a_call_like_text_stays_text() -> None:
    assert reply_message(CALL_TEXT, [], "hermes", "c") == {
        "role": "assistant",
        "content": CALL_TEXT,
    }


@pytest.mark.parametrize("exclude_none", [False, True])
def test_a_reply_round_tripped_through_the_sdk_compares_equal_to_the_one_served(
    exclude_none,
) -> None:
    """The SDK's own message type, dumped as agents append it to their history, adds fields
    (refusal, annotations, audio, function_call) the normalised form drops."""
    served = _reply(f"Checking.\n{CALL_TEXT}", "call_1")
    sent_back = ChatCompletionMessage.model_validate(served).model_dump(exclude_none=exclude_none)
    assert normalize_message(sent_back, "m") == normalize_message(served, "reply")


def test_template_messages_carry_tool_calls_with_arguments_as_objects() -> None:
    served = _reply(CALL_TEXT, "call_1")
    messages = [
        normalize_message({"role": "developer", "content": "Be brief."}, "m0"),
        normalize_message(served, "m1"),
        normalize_message({"role": "tool", "tool_call_id": "call_1_0", "content": "sunny"}, "m2"),
    ]
    assert template_messages(messages) == [
        {"role": "system", "content": "Be brief."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "id": "call_1_0",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1_0"},
    ]


def test_a_completion_request_takes_one_prompt_string() -> None:
    assert parse_completion_request({"prompt": ["abc"], "max_tokens": 3}).record() == {
        "prompt": "abc",
        "max_tokens": 3,
    }
    with pytest.raises(BadRequest, match="one non-empty string"):
        parse_completion_request({"prompt": ["a", "b"]})
