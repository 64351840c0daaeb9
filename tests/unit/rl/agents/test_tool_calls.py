import pytest

from rl.agents.tool_calls import (
    TOOL_CALL_FORMATS,
    ToolCall,
    ToolCallError,
    error_observation,
    parse_tool_calls,
)

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
    },
}
SEARCH = {
    "type": "function",  # the OpenAI wrapper, as chat templates also take it
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "number"},
                "sites": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["query"],
        },
    },
}
TOOLS = [WEATHER, SEARCH]


def call(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def parse(text: str) -> list[ToolCall | ToolCallError]:
    return parse_tool_calls(text, TOOLS)


def test_one_call():
    assert parse(call('{"name": "get_weather", "arguments": {"city": "Paris"}}')) == [
        ToolCall("get_weather", {"city": "Paris"})
    ]


def test_several_calls_in_order_with_text_around_them():
    text = (
        "I will look both up.\n"
        + call('{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}')
        + "\nand\n"
        + call('{"name": "search", "arguments": {"query": "Paris", "sites": ["a.org"]}}')
        + "\nDone."
    )
    assert parse(text) == [
        ToolCall("get_weather", {"city": "Paris", "days": 2}),
        ToolCall("search", {"query": "Paris", "sites": ["a.org"]}),
    ]


def test_text_without_calls_has_none():
    assert parse("It is sunny in Paris.") == []


def only_error(text: str) -> ToolCallError:
    [item] = parse(text)
    assert isinstance(item, ToolCallError), item
    return item


@pytest.mark.parametrize(
    "body, says",
    [
        ('{"name": "get_weather" "arguments": {}}', "not valid JSON"),
        ('["get_weather", {"city": "Paris"}]', "not a JSON object"),
        ('{"arguments": {"city": "Paris"}}', "has no 'name'"),
        ('{"name": "get_weather"}', "has no 'arguments'"),
        ("{}", "has no 'name' and no 'arguments'"),
        ('{"name": 3, "arguments": {}}', "name 3 is not a string"),
        ('{"name": "get_weather", "arguments": "city=Paris"}', "are not a JSON object"),
    ],
)
def test_malformed_calls(body, says):
    error = only_error(call(body))
    assert error.kind == "malformed"
    assert says in error.message


def test_unclosed_tag_is_malformed():
    error = only_error('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert error.kind == "malformed"
    assert "never closed" in error.message


def test_a_broken_call_does_not_hide_the_good_ones():
    text = call('{"name": "get_weather", "arguments": {"city": "Paris"}') + call(
        '{"name": "search", "arguments": {"query": "x"}}'
    )
    first, second = parse(text)
    assert isinstance(first, ToolCallError) and first.kind == "malformed"
    assert second == ToolCall("search", {"query": "x"})


def test_unknown_tool_names_the_tools():
    error = only_error(call('{"name": "get_wether", "arguments": {"city": "Paris"}}'))
    assert error.kind == "unknown_tool"
    assert "'get_wether'" in error.message and "get_weather, search" in error.message


@pytest.mark.parametrize(
    "arguments, says",
    [
        ("{}", "missing required arguments.city"),
        ('{"city": "Paris", "country": "FR"}', "unexpected arguments.country"),
        ('{"city": 75}', "arguments.city should be string, not integer 75"),
        ('{"city": "Paris", "days": "two"}', "arguments.days should be integer, not string 'two'"),
        ('{"city": "Paris", "days": true}', "arguments.days should be integer, not boolean True"),
        ('{"city": "Paris", "days": 1.5}', "arguments.days should be integer, not number 1.5"),
        ('{"city": "Paris", "unit": "kelvin"}', "'kelvin', not one of 'celsius', 'fahrenheit'"),
    ],
)
def test_bad_arguments(arguments, says):
    error = only_error(call(f'{{"name": "get_weather", "arguments": {arguments}}}'))
    assert error.kind == "bad_arguments"
    assert error.message.startswith("bad arguments for get_weather: ")
    assert says in error.message


def test_every_argument_problem_is_reported_with_its_path():
    error = only_error(call('{"name": "search", "arguments": {"limit": "ten", "sites": ["a", 2]}}'))
    assert error.message == (
        "bad arguments for search: missing required arguments.query; "
        "arguments.limit should be number, not string 'ten'; "
        "arguments.sites[1] should be string, not integer 2"
    )


def test_json_numbers_match_their_schema_types():
    # An integer is a number, and 2.0 is an integer: JSON has one number type.
    text = call('{"name": "search", "arguments": {"query": "x", "limit": 3}}') + call(
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2.0}}'
    )
    assert all(isinstance(item, ToolCall) for item in parse(text))


def test_a_tool_without_parameters_takes_no_arguments():
    tools = [{"name": "now", "description": "The time."}]
    assert parse_tool_calls(call('{"name": "now", "arguments": {}}'), tools) == [
        ToolCall("now", {})
    ]
    [error] = parse_tool_calls(call('{"name": "now", "arguments": {"tz": "UTC"}}'), tools)
    assert error.kind == "bad_arguments"


def test_a_schema_with_an_unknown_type_is_a_user_error():
    tools = [{"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "int"}}}}]
    with pytest.raises(ValueError, match="tool 'f': unknown JSON schema type 'int'"):
        parse_tool_calls(call('{"name": "f", "arguments": {"x": 1}}'), tools)


def test_error_observations_are_short_and_say_how_to_fix():
    malformed = only_error(call('{"name": "get_weather"}'))
    text = error_observation(malformed)
    assert text.startswith("Error: tool call '{\"name\": \"get_weather\"}' has no 'arguments'.")
    assert TOOL_CALL_FORMATS.traits("hermes").example in text
    unknown = only_error(call('{"name": "f", "arguments": {}}'))
    assert (
        error_observation(unknown) == "Error: unknown tool 'f'; the tools are: get_weather, search."
    )


def test_long_model_text_is_quoted_short():
    error = only_error(call('{"name": "get_weather", "arguments": {"city": "' + "x" * 500))
    assert len(error_observation(error)) < 400


def test_unknown_format_lists_the_formats():
    with pytest.raises(ValueError, match="unknown tool-call format 'mistral'; valid: hermes"):
        parse_tool_calls("", TOOLS, format_name="mistral")
