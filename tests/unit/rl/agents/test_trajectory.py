import pytest

from rl.agents.tool_calls import ToolCall, ToolCallError, error_observation, parse_tool_calls
from rl.agents.trajectory import NOT_SAMPLED, Trajectory
from tests.helpers.chat_templates import QWEN25_TEMPLATE, qwen_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
PROMPT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris today?"},
]
TURN_1 = (
    "Let me check the weather in Paris.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
RESULT_1 = '{"temperature": 21, "sky": "sunny"}'
TURN_2 = '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n</tool_call>'
TURN_3 = "It is sunny and 21 degrees in Paris."
ERROR_2 = (
    "Error: bad arguments for get_weather: missing required arguments.city; "
    "unexpected arguments.town."
)
# The conversation the three-turn episode below plays, written out for the expected rendering.
CONVERSATION = PROMPT + [
    {"role": "assistant", "content": TURN_1},
    {"role": "tool", "content": RESULT_1},
    {"role": "assistant", "content": TURN_2},
    {"role": "tool", "content": ERROR_2},
    {"role": "assistant", "content": TURN_3},
]


@pytest.fixture(scope="module")
def tokenizer():
    return qwen_tokenizer()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def im_end(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("<|im_end|>")


def sampled_split(tokenizer, text: str, at: int) -> list[int]:
    """`text` then <|im_end|> as a policy might sample it: split at `at` into two pieces
    encoded apart, which is not how encoding the whole text splits it."""
    ids = encode(tokenizer, text[:at]) + encode(tokenizer, text[at:]) + [im_end(tokenizer)]
    assert ids[:-1] != encode(tokenizer, text), "the split should not be the canonical one"
    return ids


def play(tokenizer, turns: list[tuple[list[int], int]], observe) -> Trajectory:
    """A trajectory of `turns` (sampled ids, version), each but the last followed by the
    observation `observe(assistant text)` returns."""
    trajectory = Trajectory.start(tokenizer, PROMPT, TOOLS)
    for i, (ids, version) in enumerate(turns):
        logprobs = [-0.5 - 0.01 * k for k in range(len(ids))]
        text = trajectory.add_turn(tokenizer, ids, logprobs, [version] * len(ids), "stop")
        if i < len(turns) - 1:
            trajectory.add_observation(tokenizer, observe(text))
    return trajectory


def weather_observation(text: str) -> list[dict]:
    """The environment's reply to the tool calls in `text`: a result or an error each."""
    messages = []
    for item in parse_tool_calls(text, TOOLS):
        if isinstance(item, ToolCallError):
            messages.append({"role": "tool", "content": error_observation(item)})
        else:
            assert item == ToolCall("get_weather", {"city": "Paris"})
            messages.append({"role": "tool", "content": RESULT_1})
    return messages


@pytest.fixture(scope="module")
def three_turns(tokenizer):
    turns = [
        sampled_split(tokenizer, TURN_1, TURN_1.index("ther in")),  # "wea" + "ther"
        sampled_split(tokenizer, TURN_2, TURN_2.index("own")),  # "t" + "own"
        sampled_split(tokenizer, TURN_3, TURN_3.index("ny")),  # "sun" + "ny"
    ]
    versions = [3, 3, 4]  # a weight sync landed between turns 2 and 3
    trajectory = play(tokenizer, list(zip(turns, versions, strict=True)), weather_observation)
    return trajectory, turns


def expected_pieces(tokenizer) -> list[list[int]]:
    """Independently of the code under test: CONVERSATION rendered as text by the template
    and encoded at once, cut at the assistant turns' contents (each with its <|im_end|>) into
    the prompt, the observations and the template's tail (canonical tokens; no token may
    straddle a cut)."""
    text = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    cuts, at = [0], 0
    for message in CONVERSATION[len(PROMPT) :]:
        if message["role"] == "assistant":
            start = text.index(message["content"] + "<|im_end|>", at)
            at = start + len(message["content"] + "<|im_end|>")
            cuts += [start, at]
    cuts.append(len(text))
    pieces = []
    for lo, hi in zip(cuts[0::2], cuts[1::2], strict=True):
        piece = [
            i
            for i, (s, e) in zip(encoding["input_ids"], encoding["offset_mapping"], strict=True)
            if lo <= s < hi
        ]
        assert all(e <= hi for s, e in encoding["offset_mapping"] if lo <= s < hi), (
            "a token straddles a cut"
        )
        pieces.append(piece)
    return pieces


def test_sampled_tokens_are_kept_verbatim_and_observations_rendered_by_the_template(
    tokenizer, three_turns
):
    trajectory, turns = three_turns
    prompt, obs_1, obs_2, after_last = expected_pieces(tokenizer)
    # The template's "\n" after the last <|im_end|> was never appended: nothing followed it.
    assert after_last == encode(tokenizer, "\n")
    assert trajectory.prompt_ids == prompt
    assert trajectory.response_ids == turns[0] + obs_1 + turns[1] + obs_2 + turns[2]
    # Spelled out: the observation starts after the sampled <|im_end|> with the template's
    # "\n", and ends with the next generation prompt.
    assert tokenizer.decode(obs_1) == (
        f"\n<|im_start|>user\n<tool_response>\n{RESULT_1}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tokenizer.decode(obs_2) == (
        f"\n<|im_start|>user\n<tool_response>\n{ERROR_2}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_the_messages_hold_the_sampled_text_without_the_end_of_turn(three_turns):
    trajectory, _ = three_turns
    assert trajectory.messages == CONVERSATION


def test_only_sampled_tokens_carry_loss_logprobs_and_versions(tokenizer, three_turns):
    trajectory, turns = three_turns
    _, obs_1, obs_2, _ = expected_pieces(tokenizer)
    pieces = [(turns[0], 3), (obs_1, None), (turns[1], 3), (obs_2, None), (turns[2], 4)]
    mask, versions = [], []
    for ids, version in pieces:
        mask += [int(version is not None)] * len(ids)
        versions += [NOT_SAMPLED if version is None else version] * len(ids)
    assert trajectory.loss_mask == mask
    assert trajectory.token_versions == versions
    # The behaviour log-probs of each turn as given (all < 0 here), 0.0 where not sampled.
    assert [lp < 0 for lp in trajectory.logprobs] == [bool(m) for m in mask]
    assert all(lp == 0.0 for lp, m in zip(trajectory.logprobs, mask, strict=True) if not m)


def test_to_sample_gives_the_trainer_the_sequence_and_its_mask(three_turns):
    trajectory, _ = three_turns
    sample, mask = trajectory.to_sample(group_id=7, index=1)
    assert (sample.group_id, sample.index) == (7, 1)
    assert sample.prompt_ids + sample.response_ids == trajectory.ids
    assert mask == trajectory.loss_mask
    assert sample.logprobs == trajectory.logprobs
    assert sample.finish_reason == "stop"
    assert sample.response_text == TURN_3
    # Observation tokens take the version before them, so the oldest is a sampled token's.
    assert NOT_SAMPLED not in sample.token_versions
    assert sample.policy_version == 3
    assert sample.token_versions == sorted(sample.token_versions)


def test_a_turn_stopped_without_end_of_turn_gets_the_templates(tokenizer):
    # A stop string ends the turn: no <|im_end|> sampled, so the template's is inserted.
    trajectory = Trajectory.start(tokenizer, PROMPT, TOOLS)
    sampled = encode(tokenizer, TURN_1)
    trajectory.add_turn(tokenizer, sampled, [-1.0] * len(sampled), [0] * len(sampled), "stop")
    obs = trajectory.add_observation(tokenizer, [{"role": "tool", "content": RESULT_1}])
    assert obs[0] == im_end(tokenizer)
    assert trajectory.loss_mask[len(sampled)] == 0
    assert tokenizer.decode(trajectory.ids) == tokenizer.apply_chat_template(
        trajectory.messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )


def test_a_turn_ended_on_another_special_token_is_refused(tokenizer):
    trajectory = Trajectory.start(tokenizer, PROMPT, TOOLS)
    sampled = encode(tokenizer, TURN_1) + [tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    trajectory.add_turn(tokenizer, sampled, [-1.0] * len(sampled), [0] * len(sampled), "stop")
    with pytest.raises(
        ValueError, match=r"Held: .*<\|endoftext\|>'; template renders: .*<\|im_end\|>"
    ):
        trajectory.add_observation(tokenizer, [{"role": "tool", "content": RESULT_1}])


# Qwen3-style: earlier assistant turns lose their reasoning once a message follows them.
STRIPS_REASONING = QWEN25_TEMPLATE.replace(
    "'\\n' + message.content + '<|im_end|>'",
    "'\\n' + (message.content if loop.last else message.content.split('</think>')[-1].lstrip())"
    " + '<|im_end|>'",
)
# Llama-3-style: every message's content is trimmed.
TRIMS = QWEN25_TEMPLATE.replace(
    "'\\n' + message.content + '<|im_end|>'", "'\\n' + message.content | trim + '<|im_end|>'"
)


@pytest.mark.parametrize(
    "name, template, text, held, rendered",
    [
        (
            "local/strips-reasoning",
            STRIPS_REASONING,
            "<think>Paris is in France.</think>\nIt is sunny.",
            "<think>Paris",
            "It is sunny",
        ),
        ("local/trims", TRIMS, "It is sunny.  ", "sunny.  <|im_end|>", "sunny.<|im_end|>\\n"),
    ],
)
def test_a_template_that_rerenders_the_history_is_refused_by_name(
    name, template, text, held, rendered
):
    assert template != QWEN25_TEMPLATE, "the variant's replacement should apply"
    tokenizer = qwen_tokenizer(template, name=name)
    trajectory = Trajectory.start(tokenizer, PROMPT)
    sampled = encode(tokenizer, text) + [im_end(tokenizer)]
    trajectory.add_turn(tokenizer, sampled, [-1.0] * len(sampled), [0] * len(sampled), "stop")
    with pytest.raises(ValueError) as raised:
        trajectory.add_observation(tokenizer, [{"role": "user", "content": "And tomorrow?"}])
    message = str(raised.value)
    assert f"chat template of {name} is not append-only" in message
    assert "first at character" in message and "held tokens around it" in message
    held_part, rendered_part = message.split("Held: ")[1].split("; template renders: ")
    assert held in held_part and rendered in rendered_part
    assert len(trajectory.response_ids) == len(sampled), "nothing appended after the error"


def test_turns_and_observations_alternate(tokenizer):
    trajectory = Trajectory.start(tokenizer, PROMPT, TOOLS)
    with pytest.raises(ValueError, match="an observation follows a turn"):
        trajectory.add_observation(tokenizer, [{"role": "tool", "content": RESULT_1}])
    ids = encode(tokenizer, TURN_3) + [im_end(tokenizer)]
    with pytest.raises(ValueError, match="one log-prob and one version per sampled token"):
        trajectory.add_turn(tokenizer, ids, [-1.0], [0] * len(ids), "stop")
    trajectory.add_turn(tokenizer, ids, [-1.0] * len(ids), [0] * len(ids), "stop")
    with pytest.raises(ValueError, match="not another turn"):
        trajectory.add_turn(tokenizer, ids, [-1.0] * len(ids), [0] * len(ids), "stop")
    with pytest.raises(ValueError, match="at least one message"):
        trajectory.add_observation(tokenizer, [])
