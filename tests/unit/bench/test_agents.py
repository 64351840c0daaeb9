"""bench/agents.py: the scripted policy writes bounded turns that end in a well-formed call,
its Qwen2 computes exactly that table, and the tables of ratios and tool costs."""

from __future__ import annotations

import pytest
import torch

from rl.agents.tool_calls import ToolCall, parse_tool_calls
from rl.agents.tools import resolve_tool
from rl.config import BaseBuildConfig
from tests.unit.bench.bench_modules import load_bench_module

agents = load_bench_module("agents")


@pytest.fixture(scope="module")
def tokenizer():
    return agents.build_tokenizer()


def sample_turn(table: torch.Tensor, start: int, eos: int, gen: torch.Generator) -> list[int]:
    token, turn = start, []
    while token != eos:
        token = int(torch.multinomial(torch.softmax(table[token], -1), 1, generator=gen))
        turn.append(token)
    return turn


def test_every_scripted_turn_is_bounded_and_ends_in_one_valid_python_call(tokenizer) -> None:
    table = agents.bigram_table(tokenizer, len(tokenizer))
    start = tokenizer.convert_tokens_to_ids("<|assistant|>")
    call = tokenizer.convert_tokens_to_ids(agents.CALL)
    schemas = [resolve_tool("python").schema]
    gen = torch.Generator().manual_seed(0)
    turns = [sample_turn(table, start, tokenizer.eos_token_id, gen) for _ in range(200)]
    lengths = [len(turn) for turn in turns]
    assert min(lengths) >= agents.MIN_WORDS + 2 and max(lengths) <= agents.MAX_WORDS + 2
    assert 20 < sum(lengths) / len(lengths) < 28  # about 16 + 7.3 words, the call, EOS
    assert len({tuple(turn) for turn in turns}) == len(turns), "episodes differ"
    for turn in turns:
        assert turn[-2:] == [call, tokenizer.eos_token_id]
        text = tokenizer.decode(turn[:-1])
        (parsed,) = parse_tool_calls(text, schemas, "hermes")
        assert isinstance(parsed, ToolCall) and parsed.name == "python"
        assert agents.SLEEP_VAR in parsed.arguments["code"]


def test_the_model_computes_the_table_from_the_current_token_alone(tokenizer) -> None:
    shape = BaseBuildConfig(
        hidden_size=512,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=64,
        tie_word_embeddings=False,
    )
    model = agents.scripted_model(tokenizer, shape).eval()
    vocab = model.config.vocab_size
    ids = torch.randint(0, len(tokenizer), (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    expected = agents.bigram_table(tokenizer, vocab)[ids]
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=1e-4)


def side(seconds: float, tokens: int, idle: float, tool_ms: float) -> dict:
    rounds = 2
    return {
        "s_per_round": seconds,
        "tokens_per_s": tokens / seconds,
        "episodes_per_s": 16 / seconds,
        "prefilled_per_round": 1000.0,
        "cache_hit_rate": 0.5,
        "idle_s_per_round": idle,
        "tool_ms_per_call": tool_ms,
        "tool_calls": 5 * 16 * rounds,
        "episodes": 16 * rounds,
    }


def test_the_tables_give_the_ratios_and_what_the_tool_latency_costs() -> None:
    results = {
        "config": {"target": 1.5, "tool_sleep_ms": 50},
        "tools": ["instant", "sleeps 50 ms"],
        "sides": {
            "agent/instant": side(10.0, 2000, 1.0, 15),
            "lockstep/instant": side(20.0, 2000, 2.0, 20),
            "lockstep_cached/instant": side(12.5, 2000, 1.5, 15),
            "endpoint/instant": side(12.5, 2000, 1.0, 0),
            "agent/sleeps 50 ms": side(10.5, 2000, 1.2, 70),
            "lockstep/sleeps 50 ms": side(21.0, 2000, 3.0, 65),
            "endpoint/sleeps 50 ms": side(10.5, 2000, 1.2, 0),
        },
        "endpoint_overhead": {
            "instant": {"endpoint_ms": 2.25, "http_sdk_ms": 4.0},
            "sleeps 50 ms": {"endpoint_ms": 2.5, "http_sdk_ms": 4.5},
        },
    }
    text = agents.table(results)
    assert (
        "| AgentLoop (prefix cache, async turns) | instant | 10.00 | 200 | 1.60 | 1,000 | 50% |"
        in text
    )
    assert (
        "| AgentLoop / lockstep without prefix cache (target >= 1.5x) | instant | 2.00x |" in text
    )
    assert "| - prefix caching alone: lockstep with / without | instant | 1.60x |" in text
    assert "| endpoint / AgentLoop, episodes/s (target >= 0.9x) | instant | 0.80x |" in text
    assert "| endpoint / AgentLoop, episodes/s (target >= 0.9x) | sleeps 50 ms | 1.00x |" in text
    assert "| ms | instant | 2.2 | 4.0 |" in text
    assert (
        "| - async turns alone: AgentLoop / lockstep with prefix cache | instant | 1.25x |" in text
    )
    assert (
        "| AgentLoop (prefix cache, async turns) | 15 / 70 | 10.00 / 10.50 | +0.50 "
        "| 1.00 / 1.20 | +0.20 | 0.25 |"
    ) in text
    assert (
        "| lockstep, no prefix cache | 20 / 65 | 20.00 / 21.00 | +1.00 | 2.00 / 3.00 | +1.00 | 0.25 |"
        in text
    )


def test_totals_sum_the_timed_rounds() -> None:
    one = {key: 1 for key in agents.SUMMED} | {
        "seconds": 10.0,
        "step_seconds": 8.0,
        "sampled_tokens": 1000,
        "episodes": 16,
        "request_prompt_tokens": 400,
        "cached_tokens": 100,
        "tool_calls": 80,
        "tool_seconds": 1.6,
    }
    total = agents.totals([one, one])
    assert total["s_per_round"] == 10.0 and total["tokens_per_s"] == 100.0
    assert total["cache_hit_rate"] == 0.25 and total["prefilled_per_round"] == 300
    assert total["idle_s_per_round"] == pytest.approx(2.0)
    assert total["tool_ms_per_call"] == pytest.approx(20.0)
