"""Multi-turn agents on real components: Tandem's AgentLoop against lockstep turns without
prefix reuse, and how much of a tool's latency the loop hides, side by side in one process.

    .venv/bin/python bench/agents.py [--rounds 2] [--threads 2] [--groups 4] [--group-size 8]
                                     [--turns 5] [--tool-sleep-ms 50] [--write-docs]

Workload: --groups prompts x --group-size episodes of --turns assistant turns each. Every turn
ends with one call of the built-in sandboxed `python` tool (a real rl.agents.tool_pool.ToolPool
of AgentConfig's default 4 workers); a scripted Environment shows the tool's output as the
observation until the last turn. The tool sleeps $TANDEM_BENCH_TOOL_SLEEP_S (0 or
--tool-sleep-ms, one pool each) and prints 8 numbers.

The policy is a Qwen2 of the 25M shape of bench/recipes/throughput_25m.yaml (8 layers, hidden
512, bf16 on vLLM), built here with weights that make its turns bounded and its calls
well-formed: the attention and MLP output projections are zero and the embeddings orthogonal,
so the logits at a position depend on its token alone (a bigram table written into lm_head),
while every layer is still computed at full cost. A turn is 16 to 32 word tokens (4
choices each; after 16, a call with probability 1/8 a token), then the tool-call token (one
added token holding the whole call), then EOS: 18-34 sampled tokens, about 25, different in
every episode. Sampling at temperature 1 with seeds, so both sides sample the same tokens.

Sides (the same prompts and seeds in a round, taking turns; 1 warm-up + --rounds timed):

- agent: rollout.agent_loop.AgentLoop over a GenerationLoop over a VLLMEngine (prefix caching
  on, vLLM's default): the driver's start + poll of one batch per group. Each episode's turn
  is resumed from its prompt + history as soon as its tools return; the others keep
  generating meanwhile.
- lockstep: the naive way, a bare `vllm.LLM` with the same engine arguments
  (rollout.engines.vllm_engine.engine_args) but enable_prefix_caching=False: every episode's
  turn k is sent as a fresh prompt holding its whole history (the same tokens, built by
  rl.agents.trajectory) in one `LLM.generate`; then all the tools run; then turn k + 1.

Each side runs with the instant tool and with the sleeping one. The prefix cache is reset
before every round. Prefix-cache hits are vLLM's own count (RequestOutput.num_cached_tokens
over every turn's request). Raw results go to .cache/bench/agents.json.
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
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from rl.agents.environment import Environment, EnvStep, Message
from rl.agents.episode import observe, start_group
from rl.agents.tool_pool import ToolPool, ToolResult
from rl.agents.trajectory import add_observation, end_turn
from rl.config import AgentConfig, BaseBuildConfig, RolloutConfig
from rl.types import Sample, SamplingParams
from rollout.agent_loop import AgentLoop
from rollout.engine_loop import GenerationLoop
from rollout.engines.vllm_engine import VLLMEngine, _configure_environment, engine_args
from trainer.hf_model import new_qwen2, save_hf_atomic, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / ".cache" / "bench" / "qwen2-25m-scripted-agent"
RESULTS = REPO / ".cache" / "bench" / "agents.json"
SEED = 0
SLEEP_VAR = "TANDEM_BENCH_TOOL_SLEEP_S"
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
    model = new_qwen2(SHAPE, tokenizer, seed=SEED)
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


def round_samples(
    tokenizer: PreTrainedTokenizerBase, schemas: list[dict], args: argparse.Namespace, rnd: int
) -> list[list[Sample]]:
    """Round `rnd`'s groups: fresh prompts of PROMPT_WORDS words each, unique group ids."""
    groups = []
    for g in range(args.groups):
        rng = random.Random(rnd * 1000 + g)
        prompt = " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS))
        group_id = rnd * args.groups + g
        groups.append(
            start_group(
                ScriptedTask, tokenizer, {"prompt": prompt}, schemas, args.group_size, group_id
            )
        )
    return groups


# ---- the two sides ------------------------------------------------------------------------


class Counts:
    """Prompt tokens of every request a side's engine served, and vLLM's prefix-cache hits."""

    def __init__(self) -> None:
        self.requests = self.prompt_tokens = self.cached_tokens = 0

    def add(self, output: object) -> None:
        self.requests += 1
        self.prompt_tokens += len(output.prompt_token_ids)
        self.cached_tokens += output.num_cached_tokens or 0


class CountingHook:
    """Hands the final output of each request `engine` serves to `counts` (VLLMEngine asks
    for final outputs only, and drops these numbers)."""

    def __init__(self, engine: VLLMEngine) -> None:
        self.counts = Counts()
        llm_engine = engine._llm.llm_engine
        step = llm_engine.step

        def counted_step() -> list:
            outputs = step()
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


def lockstep_round(
    llm: object,
    vllm: object,
    groups: list[list[Sample]],
    params: SamplingParams,
    tokenizer: PreTrainedTokenizerBase,
    cfg: AgentConfig,
    pool: ToolPool,
    loop: asyncio.AbstractEventLoop,
    counts: Counts,
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
            counts.add(output)
            completion = output.outputs[0]
            new_ids = list(completion.token_ids)
            sample.response_ids += new_ids
            sample.logprobs += [
                position[token].logprob
                for position, token in zip(completion.logprobs, new_ids, strict=True)
            ]
            sample.token_versions += [0] * len(new_ids)
            sample.finish_reason = completion.finish_reason
        going_on = loop.run_until_complete(
            asyncio.gather(*(between_turns(s, tokenizer, cfg, pool, params) for s in live))
        )
        live = [s for s, more in zip(live, going_on, strict=True) if more]
    for group in groups:
        for sample in group:
            sample.response_text = sample.episode.answer


# ---- measuring ----------------------------------------------------------------------------


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
        "finish_reasons": sorted({s.finish_reason for s in samples}),
        "requests": counts.requests,
        "request_prompt_tokens": counts.prompt_tokens,
        "cached_tokens": counts.cached_tokens,
        "responses": [s.response_ids for s in samples],
    }


def totals(rounds: list[dict]) -> dict:
    """Sums over the timed rounds, and the rates."""
    keys = ("seconds", "episodes", "sampled_tokens", "turns", "tool_calls", "tool_errors")
    keys += ("request_prompt_tokens", "cached_tokens", "requests")
    total = {key: sum(r[key] for r in rounds) for key in keys}
    total["rounds"] = len(rounds)
    total["s_per_round"] = total["seconds"] / len(rounds)
    total["tokens_per_s"] = total["sampled_tokens"] / total["seconds"]
    total["episodes_per_s"] = total["episodes"] / total["seconds"]
    total["cache_hit_rate"] = total["cached_tokens"] / max(total["request_prompt_tokens"], 1)
    total["prefilled_per_round"] = (total["request_prompt_tokens"] - total["cached_tokens"]) / len(
        rounds
    )
    return total


def table(results: dict) -> str:
    sides = results["sides"]
    rows = [
        "| side | tool | s/round | sampled tok/s | episodes/s | prefilled tok/round "
        "| prefix-cache hits |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    labels = {"agent": "AgentLoop (prefix cache, async turns)", "lockstep": "lockstep, no cache"}
    for name, side in sides.items():
        kind, tool = name.split("/")
        rows.append(
            f"| {labels[kind]} | {tool} | {side['s_per_round']:.2f} | {side['tokens_per_s']:,.0f} "
            f"| {side['episodes_per_s']:.2f} | {side['prefilled_per_round']:,.0f} "
            f"| {100 * side['cache_hit_rate']:.0f}% |"
        )
    rows += ["", "| tool | AgentLoop / lockstep, sampled tok/s | target |", "|---|---:|---:|"]
    for tool in results["tools"]:
        ratio = sides[f"agent/{tool}"]["tokens_per_s"] / sides[f"lockstep/{tool}"]["tokens_per_s"]
        rows.append(f"| {tool} | {ratio:.2f}x | >= 1.5x |")
    sleep_ms, turns = results["config"]["tool_sleep_ms"], results["config"]["turns"]
    slow, instant = f"sleeps {sleep_ms} ms", "instant"
    calls = sides[f"agent/{instant}"]["tool_calls"] / sides[f"agent/{instant}"]["episodes"]
    rows += [
        "",
        "| side | step wall, instant tool | step wall, tool sleeping "
        f"{sleep_ms} ms | difference | {sleep_ms} ms x {calls:g} calls an episode |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind in ("agent", "lockstep"):
        fast, slow_s = sides[f"{kind}/{instant}"], sides[f"{kind}/{slow}"]
        rows.append(
            f"| {labels[kind]} | {fast['s_per_round']:.2f} s | {slow_s['s_per_round']:.2f} s "
            f"| {slow_s['s_per_round'] - fast['s_per_round']:+.2f} s "
            f"| {sleep_ms * calls / 1000:.2f} s |"
        )
    del turns
    return "\n".join(rows)


def workload(results: dict) -> str:
    c, first = results["config"], results["sides"]["agent/instant"]
    per_episode = {
        key: first[key] / first["episodes"] for key in ("sampled_tokens", "turns", "tool_calls")
    }
    shape = results["shape"]
    return (
        f"{c['groups']} prompts x {c['group_size']} episodes a round, {per_episode['turns']:g} "
        f"turns an episode, each ending in one sandboxed `python` call "
        f"({c['tool_workers']} tool workers); prompt {shape['prompt_tokens']} tokens, "
        f"{per_episode['sampled_tokens'] / per_episode['turns']:.1f} sampled tokens a turn, "
        f"{shape['observation_tokens']} tokens an observation, "
        f"{shape['episode_tokens']:.0f} tokens an episode in all; the 25M-shaped scripted "
        f"Qwen2 in {c['dtype']} on vLLM (CPU, block size 128), {c['threads']} threads, "
        f"1 warm-up + {c['rounds']} timed rounds a side, taking turns."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per side")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads")
    parser.add_argument("--groups", type=int, default=4, help="prompts a round")
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
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    cfg = AgentConfig(environment="tool_use", max_turns=args.turns)
    params = SamplingParams(
        max_new_tokens=ROLLOUT.max_new_tokens, n=args.group_size, temperature=1.0, seed=SEED
    )
    tools = {"instant": 0.0, f"sleeps {args.tool_sleep_ms} ms": args.tool_sleep_ms / 1000}
    pools: dict[str, ToolPool] = {}
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
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
        schemas = pools["instant"].schemas
        engine = VLLMEngine(str(MODEL), ROLLOUT, args.dtype, SEED)
        hook = CountingHook(engine)
        generation = GenerationLoop(engine)
        agents = {tool: AgentLoop(generation, tokenizer, cfg, pool) for tool, pool in pools.items()}
        llm = vllm.LLM(
            **engine_args(str(MODEL), ROLLOUT, args.dtype, SEED), enable_prefix_caching=False
        )

        def agent_side(tool: str):
            def run(groups: list[list[Sample]], counts: Counts) -> None:
                hook.counts = counts
                loop.run_until_complete(agent_round(agents[tool], groups, params))

            return run

        def lockstep_side(tool: str):
            def run(groups: list[list[Sample]], counts: Counts) -> None:
                lockstep_round(llm, vllm, groups, params, tokenizer, cfg, pools[tool], loop, counts)

            return run

        sides = {}
        for tool in tools:
            sides[f"agent/{tool}"] = agent_side(tool)
            sides[f"lockstep/{tool}"] = lockstep_side(tool)
        runs: dict[str, list[dict]] = {name: [] for name in sides}
        same_tokens = True
        for rnd in range(args.rounds + 1):
            reference = None
            for name, run in sides.items():
                groups = round_samples(tokenizer, schemas, args, rnd)
                engine._llm.reset_prefix_cache()
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
                if reference is None:
                    reference = result["responses"]
                same_tokens &= result.pop("responses") == reference
                if rnd:  # round 0 is the warm-up
                    runs[name].append(result)
        first = runs["agent/instant"][0]
        episode_tokens = (
            first["prompt_tokens"] + first["sampled_tokens"] + first["observation_tokens"]
        ) / first["episodes"]
        observations = first["turns"] - first["episodes"]
        results = {
            "config": {
                **vars(args),
                "tool_workers": cfg.tool_workers,
                "model": str(MODEL.relative_to(REPO)),
            },
            "tools": list(tools),
            "shape": {
                "prompt_tokens": first["prompt_tokens"] // first["episodes"],
                "observation_tokens": round(first["observation_tokens"] / max(observations, 1)),
                "episode_tokens": episode_tokens,
            },
            "same_tokens": same_tokens,
            "sides": {name: totals(rounds) for name, rounds in runs.items()},
            "rounds": runs,
        }
    finally:
        for pool in pools.values():
            pool.close()
        loop.close()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    text = (
        f"Command: `.venv/bin/python bench/agents.py --write-docs`. {workload(results)} "
        f"Every side sampled the same tokens: {'yes' if same_tokens else 'NO'}.\n\n"
        f"{table(results)}"
    )
    print(text)
    if args.write_docs:
        write_section("agents", text)


if __name__ == "__main__":
    main()
