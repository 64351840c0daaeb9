"""Multi-turn agents on real components: Tandem's AgentLoop against lockstep turns without
prefix reuse, and how much of a tool's latency the loop hides, side by side in one process.

    .venv/bin/python bench/agents.py [--rounds 2] [--threads 1] [--groups 2] [--group-size 8]
                                     [--turns 5] [--tool-sleep-ms 50] [--dtype float32]
                                     [--write-docs]

Workload: --groups prompts x --group-size episodes of --turns assistant turns each. Every turn
ends with one call of the built-in sandboxed `python` tool (a real rl.agents.tool_pool.ToolPool
with AgentConfig's defaults: 4 worker processes, a fork per call); a scripted Environment shows
the tool's output as the observation until the last turn. The call sleeps
$TANDEM_BENCH_TOOL_SLEEP_S seconds (0 or --tool-sleep-ms: one pool each) and prints 8 numbers.

The policy has the shape of bench/recipes/throughput_25m.yaml's random ~25M Qwen2 (8 layers,
hidden 512), served by vLLM on CPU, with weights set so that its turns are bounded and its
calls well-formed (a random model would neither stop nor call): the attention and MLP output
projections are zero and the embeddings orthogonal, so the logits at a position depend on its
token alone, through a bigram table written into lm_head; every layer is still computed at full
cost. A turn is 16 to 32 word tokens (4 choices each; from the 16th on, the call comes next
with probability 1/8), then the call (one added token holding its whole text), then EOS:
18-34 sampled tokens, about 24, different in every episode. Seeded sampling at temperature 1:
every side samples the very same tokens, so they do the same work.

Sides (the same prompts and seeds in a round, taking turns; 1 warm-up + --rounds timed):

- agent: rollout.agent_loop.AgentLoop over a GenerationLoop over a VLLMEngine (prefix caching
  on, vLLM's default), driven as the rollout worker drives it (start one batch per group, poll
  until all are back). Each episode's next turn is resumed from its prompt + history as soon
  as its tools return, while the others keep generating.
- lockstep: the naive way, a bare `vllm.LLM` with VLLMEngine's engine arguments
  (rollout.engines.vllm_engine.engine_args) but enable_prefix_caching=False: turn k of every
  live episode is sent as a fresh prompt holding its whole history (the same tokens, built by
  rl.agents.trajectory) in one `LLM.generate`; then all their tools run; then turn k + 1.
- lockstep_cached (instant tool only): the lockstep schedule on the AgentLoop's own engine,
  prefix cache on, to split the gain between prefix reuse and async turns.
- endpoint: the same episodes driven by an agent function written against the `openai` SDK
  (bench/scripted_agent.py) through rollout.api_agent_loop.ApiAgentLoop over the AgentLoop's
  own engine: each turn an HTTP call to the rollout worker's endpoint from the agent's
  sandbox, the call's code run by the agent itself (in its episode's process, not the tool
  pool's fork; the last turn's call is not run). Its per-call overhead is measured two ways:
  on the endpoint, the seconds of a call not spent generating (request parsing, rendering
  and encoding the new messages, decoding the reply, JSON), and from the agent, each call's
  seconds minus the endpoint's (HTTP through the sandbox's forwarder, the SDK, and the wait
  for the rollout worker's event loop, which serves HTTP between engine steps).

The agent and lockstep sides run with the instant tool and with the sleeping one. The prefix
cache is reset before every side's round. Prefix-cache hits are vLLM's own count
(RequestOutput.num_cached_tokens of every turn's request, over its prompt tokens). Raw
results go to .cache/bench/agents.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import time
from pathlib import Path

import torch
from docs_section import write_section
from transformers import AutoTokenizer, PreTrainedTokenizerBase, Qwen2ForCausalLM

from rl.agents.environment import Environment, EnvStep, Message
from rl.agents.episode import observe, start_group
from rl.agents.tool_pool import ToolPool, ToolResult
from rl.agents.trajectory import add_observation, end_turn
from rl.config import AgentConfig, BaseBuildConfig, RolloutConfig
from rl.types import Episode, Sample, SamplingParams
from rollout.agent_loop import AgentLoop
from rollout.api_agent_loop import ApiAgentLoop
from rollout.engine_loop import GenerationLoop
from rollout.engines.vllm_engine import VLLMEngine, _configure_environment, engine_args
from trainer.hf_model import new_model, save_hf_atomic, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / ".cache" / "bench" / "qwen2-25m-scripted-agent"
RESULTS = REPO / ".cache" / "bench" / "agents.json"
SEED = 0
SLEEP_VAR = "TANDEM_BENCH_TOOL_SLEEP_S"
TARGET = 1.5  # AgentLoop over lockstep without prefix reuse, sampled tokens/s
ENDPOINT_TARGET = 0.9  # the endpoint path over the AgentLoop, episodes/s
AGENT_FUNCTION = Path(__file__).resolve().with_name("scripted_agent.py")
# The one call every turn ends with, a single added token of the tokenizer.
CALL = (
    '<tool_call>{"name": "python", "arguments": {"code": "import os, time; '
    f"time.sleep(float(os.environ['{SLEEP_VAR}'])); print(*range(100, 108))"
    '"}}</tool_call>'
)
# A turn: MIN_WORDS..MAX_WORDS word tokens, each from the CHOICES of its position; after
# MIN_WORDS the call comes next with probability CALL_P; then EOS.
MIN_WORDS, MAX_WORDS, CHOICES, CALL_P = 16, 32, 4, 1 / 8
MARGIN = 30.0  # logit of the scripted next tokens over every other token
PROMPT_WORDS = 100
WORDS = (
    "the agent reads a file then runs a search over the index and checks each result before "
    "it writes the answer back to the user who asked about the weather report in several cities"
).split()
SHAPE = BaseBuildConfig(
    vocab_size=448,
    hidden_size=512,
    num_layers=8,
    num_heads=8,
    num_kv_heads=2,
    intermediate_size=1536,
    tie_word_embeddings=False,
)
ROLLOUT = RolloutConfig(kv_cache_gb=0.5, max_model_len=768, max_new_tokens=512, temperature=1.0)


# ---- the scripted policy ------------------------------------------------------------------


def build_tokenizer() -> PreTrainedTokenizerBase:
    """Byte-level BPE (trainer.hf_model, with its chat template) on sentences of WORDS, and
    the call as one added token."""
    rng = random.Random(SEED)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(300)]
    tokenizer = train_tokenizer(corpus, SHAPE.vocab_size)
    tokenizer.add_tokens([CALL])
    return tokenizer


def word_tokens(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Tokens that decode to a lower-case word piece (an optional leading space): text that
    concatenates back exactly and holds nothing a tool-call parser looks at."""
    return [i for i in range(len(tokenizer)) if re.fullmatch(r" ?[a-z]+", tokenizer.decode([i]))]


def bigram_table(tokenizer: PreTrainedTokenizerBase, vocab: int) -> torch.Tensor:
    """logits[current token, next token] of the scripted turns (0 where not scripted)."""
    words = word_tokens(tokenizer)
    assert len(words) >= MAX_WORDS * CHOICES, f"only {len(words)} word tokens"
    stages = [words[k * CHOICES : (k + 1) * CHOICES] for k in range(MAX_WORDS)]
    call = tokenizer.convert_tokens_to_ids(CALL)
    start = tokenizer.convert_tokens_to_ids("<|assistant|>")
    table = torch.zeros(vocab, vocab)
    table[start, stages[0]] = MARGIN - math.log(CHOICES)
    for k, stage in enumerate(stages):
        emitted = k + 1  # word tokens of the turn once a token of this stage is out
        for token in stage:
            if emitted == MAX_WORDS:
                table[token, call] = MARGIN
                continue
            go_on = 1.0 if emitted < MIN_WORDS else 1.0 - CALL_P
            table[token, stages[k + 1]] = MARGIN + math.log(go_on / CHOICES)
            if emitted >= MIN_WORDS:
                table[token, call] = MARGIN + math.log(CALL_P)
    table[call, tokenizer.eos_token_id] = MARGIN
    return table


def scripted_model(tokenizer: PreTrainedTokenizerBase, shape: BaseBuildConfig) -> Qwen2ForCausalLM:
    """A Qwen2 of `shape` whose logits at a position are bigram_table's row for its token."""
    model = new_model(shape, tokenizer, seed=SEED)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    assert vocab <= hidden, "orthogonal embeddings need vocab <= hidden size"
    generator = torch.Generator().manual_seed(SEED)
    q, _ = torch.linalg.qr(torch.randn(hidden, vocab, generator=generator))
    embeddings = q.T * math.sqrt(hidden)  # orthogonal rows of RMS 1: RMSNorm leaves them be
    with torch.no_grad():
        for layer in model.model.layers:  # computed, but adding nothing to the residual
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(embeddings)
        # lm_head @ embedding[c] = table[c]: the final hidden state is the token's embedding.
        table = bigram_table(tokenizer, vocab)
        model.lm_head.weight.copy_(table.T @ embeddings / hidden)
    return model


def build_model(path: Path) -> None:
    """The scripted Qwen2 at `path` (rebuilt when its recipe changed)."""
    spec = json.dumps(
        {
            "shape": SHAPE.model_dump(),
            "call": CALL,
            "turn": [MIN_WORDS, MAX_WORDS, CHOICES, CALL_P, MARGIN],
            "seed": SEED,
        },
        sort_keys=True,
    )
    if (path / "bench_spec.json").exists() and (path / "bench_spec.json").read_text() == spec:
        return
    tokenizer = build_tokenizer()
    model = scripted_model(tokenizer, SHAPE)
    save_hf_atomic(model, tokenizer, path, extra_files={"bench_spec.json": spec})


class ScriptedTask(Environment):
    """Shows the tool results after each turn; the episode ends after `turns` turns."""

    tools = ("python",)
    turns = 5

    def __init__(self) -> None:
        self.num_turns = 0

    def reset(self, example: dict) -> list[Message]:
        return [{"role": "user", "content": example["prompt"]}]

    def step(self, turn: str, tool_messages: list[Message]) -> EnvStep:
        self.num_turns += 1
        return EnvStep(messages=tool_messages, done=self.num_turns >= self.turns)


def round_prompts(args: argparse.Namespace, rnd: int) -> dict[int, str]:
    """Round `rnd`'s prompts of PROMPT_WORDS words each, by their unique group ids."""
    prompts = {}
    for g in range(args.groups):
        rng = random.Random(rnd * 1000 + g)
        prompts[rnd * args.groups + g] = " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS))
    return prompts


def round_samples(
    tokenizer: PreTrainedTokenizerBase, schemas: list[dict], args: argparse.Namespace, rnd: int
) -> list[list[Sample]]:
    """Round `rnd`'s groups of ScriptedTask episodes."""
    return [
        start_group(ScriptedTask, tokenizer, {"prompt": prompt}, schemas, args.group_size, group_id)
        for group_id, prompt in round_prompts(args, rnd).items()
    ]


def endpoint_samples(args: argparse.Namespace, rnd: int, sleep_s: float) -> list[list[Sample]]:
    """Round `rnd`'s groups as the agent function's episodes: the same prompts and seeds."""
    groups = []
    for group_id, prompt in round_prompts(args, rnd).items():
        example = {
            "prompt": prompt,
            "turns": args.turns,
            "sleep_s": sleep_s,
            "sleep_var": SLEEP_VAR,
        }
        groups.append(
            [
                Sample(
                    [], group_id, k, loss_mask=[], episode=Episode(None, [], None, example=example)
                )
                for k in range(args.group_size)
            ]
        )
    return groups


class TimedGeneration:
    """The endpoint's GenerationLoop, its seconds of generating counted, so that a call's
    seconds on the endpoint split into generating and the rest."""

    def __init__(self, generation: GenerationLoop) -> None:
        self._generation, self.engine = generation, generation.engine
        self.seconds = 0.0

    async def generate(self, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        start = time.perf_counter()
        try:
            return await self._generation.generate(samples, params)
        finally:
            self.seconds += time.perf_counter() - start

    def interrupt(self) -> int:
        return self._generation.interrupt()


def timed_endpoint(api: ApiAgentLoop) -> dict[str, float]:
    """Count the seconds and number of the endpoint's calls (and their generating, through
    TimedGeneration) into the returned dict."""
    timing = {"calls": 0, "serve_s": 0.0}
    serve = api.endpoint._serve

    async def timed(key: str, kind: str, body: object) -> dict:
        start = time.perf_counter()
        try:
            return await serve(key, kind, body)
        finally:
            timing["calls"] += 1
            timing["serve_s"] += time.perf_counter() - start

    api.endpoint._serve = timed
    return timing


# ---- the sides ---------------------------------------------------------------------------------


class Counts:
    """What a side's engine did in a round: its steps and the seconds they took, the prompt
    tokens of every request it served, and vLLM's prefix-cache hits among them."""

    def __init__(self) -> None:
        self.steps = self.requests = self.prompt_tokens = self.cached_tokens = 0
        self.step_seconds = 0.0

    def add(self, output: object) -> None:
        self.requests += 1
        self.prompt_tokens += len(output.prompt_token_ids)
        self.cached_tokens += output.num_cached_tokens or 0


class Hook:
    """Counts every step of `llm` (a vllm.LLM) into `counts`, with the final output of each
    request (VLLMEngine asks for final outputs only, and drops these numbers; LLM.generate
    steps the same engine)."""

    def __init__(self, llm: object) -> None:
        self.counts = Counts()
        llm_engine = llm.llm_engine
        step = llm_engine.step

        def counted_step() -> list:
            start = time.perf_counter()
            outputs = step()
            self.counts.step_seconds += time.perf_counter() - start
            self.counts.steps += 1
            for output in outputs:
                if output.finished:
                    self.counts.add(output)
            return outputs

        llm_engine.step = counted_step


def run_tool(pool: ToolPool):
    async def run(name: str, arguments: dict) -> ToolResult:
        return await asyncio.wrap_future(pool.submit(name, arguments))

    return run


async def agent_round(loop: AgentLoop, groups: list[list[Sample]], params: SamplingParams):
    """The driver's training path: one batch per group started at once, polled until all
    are back."""
    loop.start(dict(enumerate(groups)), params)
    done: dict[int, list[Sample]] = {}
    while len(done) < len(groups):
        done.update(await loop.poll())


async def between_turns(
    sample: Sample,
    tokenizer: PreTrainedTokenizerBase,
    cfg: AgentConfig,
    pool: ToolPool,
    params: SamplingParams,
) -> bool:
    """What AgentLoop._episode does after a turn; whether the episode goes on."""
    episode = sample.episode
    turn = end_turn(tokenizer, sample)
    if sample.finish_reason == "length":
        return False
    step = await observe(
        episode,
        turn,
        tokenizer,
        run_tool(pool),
        cfg.tool_call_format,
        cfg.max_tool_output_tokens,
    )
    if step.done or not step.messages:
        return False
    if episode.num_turns >= cfg.max_turns:
        episode.max_turns_reached = True
        return False
    if add_observation(tokenizer, sample, step.messages, params.max_new_tokens - 1) is None:
        sample.finish_reason = "length"
        return False
    sample.finish_reason = ""
    return True


async def all_between_turns(
    samples: list[Sample],
    tokenizer: PreTrainedTokenizerBase,
    cfg: AgentConfig,
    pool: ToolPool,
    params: SamplingParams,
) -> list[bool]:
    """`between_turns` of every sample at once: their tool calls run together."""
    return await asyncio.gather(*(between_turns(s, tokenizer, cfg, pool, params) for s in samples))


def lockstep_round(
    llm: object,
    vllm: object,
    groups: list[list[Sample]],
    params: SamplingParams,
    tokenizer: PreTrainedTokenizerBase,
    cfg: AgentConfig,
    pool: ToolPool,
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Turn k of every live episode in one LLM.generate (whole history as a fresh prompt),
    then every tool call at once, then turn k + 1. Tokens and log-probs are appended as
    VLLMEngine appends them, with its per-sample seeds."""
    live = [sample for group in groups for sample in group]
    while live:
        prompts = [{"prompt_token_ids": s.prompt_ids + s.response_ids} for s in live]
        sampling = [
            vllm.SamplingParams(
                n=1,
                temperature=params.temperature,
                top_p=params.top_p,
                max_tokens=params.max_new_tokens - len(s.response_ids),
                seed=params.seed_of(s),
                logprobs=0,
                detokenize=False,
            )
            for s in live
        ]
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        for sample, output in zip(live, outputs, strict=True):
            completion = output.outputs[0]
            new_ids = list(completion.token_ids)
            sample.response_ids += new_ids
            sample.logprobs += [
                position[token].logprob
                for position, token in zip(completion.logprobs, new_ids, strict=True)
            ]
            sample.token_versions += [0] * len(new_ids)
            sample.finish_reason = completion.finish_reason
        going_on = loop.run_until_complete(all_between_turns(live, tokenizer, cfg, pool, params))
        live = [s for s, more in zip(live, going_on, strict=True) if more]
    for group in groups:
        for sample in group:
            sample.response_text = sample.episode.answer


# ---- measuring ----------------------------------------------------------------------------

LABELS = {
    "agent": "AgentLoop (prefix cache, async turns)",
    "endpoint": "agent function through the endpoint (ApiAgentLoop)",
    "lockstep": "lockstep, no prefix cache",
    "lockstep_cached": "lockstep, prefix cache",
}


def summary(groups: list[list[Sample]], seconds: float, counts: Counts) -> dict:
    samples = [s for group in groups for s in group]
    episodes = [s.episode for s in samples]
    return {
        "seconds": seconds,
        "episodes": len(samples),
        "sampled_tokens": sum(sum(s.loss_mask) for s in samples),
        "observation_tokens": sum(len(s.loss_mask) - sum(s.loss_mask) for s in samples),
        "prompt_tokens": sum(len(s.prompt_ids) for s in samples),
        "turns": sum(e.num_turns for e in episodes),
        "tool_calls": sum(e.num_calls for e in episodes),
        "tool_errors": sum(sum(e.errors.values()) for e in episodes),
        "tool_seconds": sum(e.tool_seconds for e in episodes),
        "finish_reasons": sorted({s.finish_reason for s in samples}),
        "steps": counts.steps,
        "step_seconds": counts.step_seconds,
        "requests": counts.requests,
        "request_prompt_tokens": counts.prompt_tokens,
        "cached_tokens": counts.cached_tokens,
        "responses": [s.response_ids for s in samples],
    }


SUMMED = (
    "seconds",
    "episodes",
    "sampled_tokens",
    "turns",
    "tool_calls",
    "tool_errors",
    "tool_seconds",
    "steps",
    "step_seconds",
    "requests",
    "request_prompt_tokens",
    "cached_tokens",
)


def totals(rounds: list[dict]) -> dict:
    """Sums over the timed rounds, and the rates."""
    total = {key: sum(r[key] for r in rounds) for key in SUMMED}
    total["rounds"] = len(rounds)
    total["s_per_round"] = total["seconds"] / len(rounds)
    total["tokens_per_s"] = total["sampled_tokens"] / total["seconds"]
    total["episodes_per_s"] = total["episodes"] / total["seconds"]
    total["cache_hit_rate"] = total["cached_tokens"] / max(total["request_prompt_tokens"], 1)
    total["prefilled_per_round"] = (total["request_prompt_tokens"] - total["cached_tokens"]) / len(
        rounds
    )
    total["idle_s_per_round"] = (total["seconds"] - total["step_seconds"]) / len(rounds)
    total["tool_ms_per_call"] = 1000 * total["tool_seconds"] / max(total["tool_calls"], 1)
    return total


def table(results: dict) -> str:
    """Throughput of every side, the ratios, and the cost of the tool's latency."""
    sides, target = results["sides"], results["config"]["target"]
    instant, slow = results["tools"]
    rows = [
        "| side | tool | s/round | sampled tok/s | episodes/s | prefilled tok/round "
        "| prefix-cache hits |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, side in sides.items():
        kind, tool = name.split("/")
        rows.append(
            f"| {LABELS[kind]} | {tool} | {side['s_per_round']:.2f} "
            f"| {side['tokens_per_s']:,.0f} | {side['episodes_per_s']:.2f} "
            f"| {side['prefilled_per_round']:,.0f} | {100 * side['cache_hit_rate']:.0f}% |"
        )

    def ratio(a: str, b: str) -> float:
        return sides[a]["tokens_per_s"] / sides[b]["tokens_per_s"]

    rows += [
        "",
        "| sampled tok/s ratio | tool | ratio |",
        "|---|---|---:|",
        f"| AgentLoop / lockstep without prefix cache (target >= {target:g}x) | {instant} "
        f"| {ratio(f'agent/{instant}', f'lockstep/{instant}'):.2f}x |",
        f"| AgentLoop / lockstep without prefix cache | {slow} "
        f"| {ratio(f'agent/{slow}', f'lockstep/{slow}'):.2f}x |",
        f"| - prefix caching alone: lockstep with / without | {instant} "
        f"| {ratio(f'lockstep_cached/{instant}', f'lockstep/{instant}'):.2f}x |",
        f"| - async turns alone: AgentLoop / lockstep with prefix cache | {instant} "
        f"| {ratio(f'agent/{instant}', f'lockstep_cached/{instant}'):.2f}x |",
    ]
    for tool in (instant, slow):
        rows.append(
            f"| endpoint / AgentLoop, episodes/s (target >= {ENDPOINT_TARGET:g}x) | {tool} "
            f"| {sides[f'endpoint/{tool}']['episodes_per_s'] / sides[f'agent/{tool}']['episodes_per_s']:.2f}x |"
        )
    rows += [
        "",
        "| endpoint overhead per call | tool | on the endpoint (parse, render, encode, decode, JSON) "
        "| the rest as the agent sees it (HTTP, forwarder, SDK, the wait for an engine step) |",
        "|---|---|---:|---:|",
    ]
    for tool in (instant, slow):
        over = results["endpoint_overhead"][tool]
        rows.append(f"| ms | {tool} | {over['endpoint_ms']:.1f} | {over['http_sdk_ms']:.1f} |")
    sleep_ms = results["config"]["tool_sleep_ms"]
    fast = sides[f"agent/{instant}"]
    calls = fast["tool_calls"] / fast["episodes"]
    rows += [
        "",
        f"| side | tool call ms, instant / sleeping | s/round, instant / sleeping | difference "
        "| engine idle s/round, instant / sleeping | difference "
        f"| {sleep_ms} ms x {calls:g} calls an episode |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for kind in ("agent", "lockstep"):
        quick, sleepy = sides[f"{kind}/{instant}"], sides[f"{kind}/{slow}"]
        rows.append(
            f"| {LABELS[kind]} "
            f"| {quick['tool_ms_per_call']:.0f} / {sleepy['tool_ms_per_call']:.0f} "
            f"| {quick['s_per_round']:.2f} / {sleepy['s_per_round']:.2f} "
            f"| {sleepy['s_per_round'] - quick['s_per_round']:+.2f} "
            f"| {quick['idle_s_per_round']:.2f} / {sleepy['idle_s_per_round']:.2f} "
            f"| {sleepy['idle_s_per_round'] - quick['idle_s_per_round']:+.2f} "
            f"| {sleep_ms * calls / 1000:.2f} |"
        )
    return "\n".join(rows)


def workload(results: dict) -> str:
    c, shape, first = results["config"], results["shape"], results["sides"]["agent/instant"]
    turns = first["turns"] / first["episodes"]
    return (
        f"{c['groups']} prompts x {c['group_size']} episodes a round, {turns:g} turns an "
        f"episode, each ending in one sandboxed `python` call ({c['tool_workers']} tool "
        f"workers); prompt {shape['prompt_tokens']} tokens, "
        f"{first['sampled_tokens'] / first['turns']:.1f} sampled tokens a turn, "
        f"{shape['observation_tokens']} tokens an observation, "
        f"{shape['episode_tokens']:.0f} tokens an episode in all; the 25M-shaped scripted "
        f"Qwen2 in {c['dtype']} on vLLM (CPU, block size 128), {c['threads']} thread(s), "
        f"1 warm-up + {c['rounds']} timed rounds a side, taking turns."
    )


def shape(rounds: list[dict]) -> dict:
    """Tokens of an episode's parts, from one side's rounds."""
    first = rounds[0]
    episodes = first["episodes"]
    return {
        "prompt_tokens": first["prompt_tokens"] // episodes,
        "observation_tokens": round(
            first["observation_tokens"] / max(first["turns"] - episodes, 1)
        ),
        "episode_tokens": (
            first["prompt_tokens"] + first["sampled_tokens"] + first["observation_tokens"]
        )
        / episodes,
    }


def measure(args: argparse.Namespace, vllm: object) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    cfg = AgentConfig(environment="tool_use", max_turns=args.turns)
    params = SamplingParams(
        max_new_tokens=ROLLOUT.max_new_tokens, n=args.group_size, temperature=1.0, seed=SEED
    )
    tools = {"instant": 0.0, f"sleeps {args.tool_sleep_ms} ms": args.tool_sleep_ms / 1000}
    instant, slow = tools
    pools: dict[str, ToolPool] = {}
    api: ApiAgentLoop | None = None
    loop = asyncio.new_event_loop()
    try:
        for tool, sleep_s in tools.items():
            os.environ[SLEEP_VAR] = str(sleep_s)  # read when the pool starts its workers
            pools[tool] = ToolPool(
                ["python"],
                num_workers=cfg.tool_workers,
                timeout_s=cfg.tool_timeout_s,
                cpu_s=cfg.tool_cpu_s,
                memory_mb=cfg.tool_memory_mb,
                inherit_env=[SLEEP_VAR],
            )
        os.environ.pop(SLEEP_VAR)
        engine = VLLMEngine(str(MODEL), ROLLOUT, args.dtype, SEED)
        hooks = {"agent": Hook(engine._llm)}
        generation = GenerationLoop(engine)
        agents = {tool: AgentLoop(generation, tokenizer, cfg, pool) for tool, pool in pools.items()}
        bare = vllm.LLM(
            **engine_args(str(MODEL), ROLLOUT, args.dtype, SEED), enable_prefix_caching=False
        )
        hooks["bare"] = Hook(bare)

        def agent_side(tool: str):
            def run(groups: list[list[Sample]], counts: Counts) -> None:
                hooks["agent"].counts = counts
                loop.run_until_complete(agent_round(agents[tool], groups, params))

            return run

        api = ApiAgentLoop(
            generation,
            tokenizer,
            AgentConfig(
                environment=f"openai:{AGENT_FUNCTION}:run", max_turns=args.turns, env_workers=2
            ),
            ROLLOUT.max_model_len,
        )
        loop.run_until_complete(api.open())
        timed_generation = api.generation = TimedGeneration(generation)
        timing = timed_endpoint(api)
        overhead: dict[str, list[dict]] = {}

        def endpoint_side(tool: str):
            def run(groups: list[list[Sample]], counts: Counts) -> None:
                hooks["agent"].counts = counts
                generating, served = timed_generation.seconds, dict(timing)
                loop.run_until_complete(agent_round(api, groups, params))
                calls = timing["calls"] - served["calls"]
                client_s = sum(sum(json.loads(s.response_text)) for group in groups for s in group)
                serve_s = timing["serve_s"] - served["serve_s"]
                overhead.setdefault(tool, []).append(
                    {
                        "calls": calls,
                        "endpoint_ms": 1000
                        * (serve_s - (timed_generation.seconds - generating))
                        / calls,
                        "http_sdk_ms": 1000 * (client_s - serve_s) / calls,
                    }
                )

            return run

        def lockstep_side(tool: str, cached: bool):
            # With the prefix cache: the AgentLoop's own vllm.LLM, idle meanwhile.
            llm, hook = (engine._llm, hooks["agent"]) if cached else (bare, hooks["bare"])

            def run(groups: list[list[Sample]], counts: Counts) -> None:
                hook.counts = counts
                lockstep_round(llm, vllm, groups, params, tokenizer, cfg, pools[tool], loop)

            return run

        sides = {
            f"agent/{instant}": agent_side(instant),
            f"lockstep/{instant}": lockstep_side(instant, cached=False),
            f"lockstep_cached/{instant}": lockstep_side(instant, cached=True),
            f"endpoint/{instant}": endpoint_side(instant),
            f"agent/{slow}": agent_side(slow),
            f"lockstep/{slow}": lockstep_side(slow, cached=False),
            f"endpoint/{slow}": endpoint_side(slow),
        }
        sleeps = {f"{kind}/{tool}": tools[tool] for kind in ("agent", "endpoint") for tool in tools}
        runs: dict[str, list[dict]] = {name: [] for name in sides}
        same_tokens = True
        for rnd in range(args.rounds + 1):
            reference = None
            for name, run in sides.items():
                if name.startswith("endpoint/"):
                    groups = endpoint_samples(args, rnd, sleeps[name])
                else:
                    groups = round_samples(tokenizer, pools[instant].schemas, args, rnd)
                engine._llm.reset_prefix_cache()  # nothing from an earlier side or round
                counts = Counts()
                start = time.perf_counter()
                run(groups, counts)
                result = summary(groups, time.perf_counter() - start, counts)
                print(
                    f"  {name} round {rnd}: {result['sampled_tokens']} sampled tokens, "
                    f"{result['turns']} turns in {result['seconds']:.2f} s, "
                    f"{result['cached_tokens']}/{result['request_prompt_tokens']} prompt "
                    f"tokens cached, finish {result['finish_reasons']}",
                    flush=True,
                )
                responses = result.pop("responses")
                reference = responses if reference is None else reference
                same_tokens &= responses == reference
                if rnd:  # round 0 is the warm-up
                    runs[name].append(result)
    finally:
        for pool in pools.values():
            pool.close()
        if api is not None:
            loop.run_until_complete(api.close())
        loop.close()
    return {
        "config": {
            **vars(args),
            "tool_workers": cfg.tool_workers,
            "model": str(MODEL.relative_to(REPO)),
            "target": TARGET,
        },
        "tools": list(tools),
        "shape": shape(runs[f"agent/{instant}"]),
        "same_tokens": same_tokens,
        "sides": {name: totals(rounds) for name, rounds in runs.items()},
        "endpoint_overhead": {
            tool: {
                key: sum(r[key] * r["calls"] for r in rounds[1:])
                / sum(r["calls"] for r in rounds[1:])
                for key in ("endpoint_ms", "http_sdk_ms")
            }
            for tool, rounds in overhead.items()  # round 0 is the warm-up
        },
        "rounds": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per side")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads (1: on a shared 2-core machine, 2 threads spin-waiting for a "
        "core another job holds made vLLM's steps 3-10x slower)",
    )
    parser.add_argument("--groups", type=int, default=2, help="prompts a round")
    parser.add_argument("--group-size", type=int, default=8, help="episodes a prompt")
    parser.add_argument("--turns", type=int, default=5, help="assistant turns an episode")
    parser.add_argument("--tool-sleep-ms", type=int, default=50)
    parser.add_argument(
        "--dtype",
        default="float32",
        help="model dtype (bfloat16 only where the CPU has AVX512-BF16 or AMX: elsewhere "
        "torch emulates bf16 matmuls, 6x slower than fp32 here)",
    )
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    _configure_environment()  # what VLLMEngine sets before vLLM is imported
    import vllm

    ScriptedTask.turns = args.turns
    build_model(MODEL)
    results = measure(args, vllm)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    text = (
        f"Command: `.venv/bin/python bench/agents.py --write-docs`. {workload(results)} "
        f"Every side sampled the same tokens: {'yes' if results['same_tokens'] else 'NO'}."
        f"\n\n{table(results)}"
    )
    print(text)
    if args.write_docs:
        write_section("agents", text)


if __name__ == "__main__":
    main()
