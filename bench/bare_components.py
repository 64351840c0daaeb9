"""Tandem's overhead over the bare components it is built from, side by side in one run.

    .venv/bin/python bench/bare_components.py [--quick] [--rounds 3] [--threads 2]
                                              [--only rollout|trainer] [key=value ...]

On the throughput workload (bench/recipes/throughput_25m.yaml: a random ~25M Qwen2, 32 train
prompts x 8 samples, up to 128 new tokens at temperature 1 ending at a sampled EOS):

- rollout: bare `vllm.LLM.generate`, built with VLLMEngine's own engine arguments
  (rollout.engines.vllm_engine.engine_args) and asked for what Tandem asks (per-request seeds, one
  behaviour log-prob per token, no detokenisation), against the driver's RolloutReplicas of one
  RolloutWorker Ray actor, used two ways: the blocking `generate` (evaluation), and `submit`
  of one batch per prompt group then `poll` until all are back (training). Response tokens/s;
  both engines live at once and the three sides take turns each round.
- trainer at W = 1: a plain PyTorch loop (HF model, full logits, AdamW, the GRPO clipped
  surrogate with token-mean aggregation, grad clip, one step per batch) against the driver's
  PolicyRanks of one TrainWorker rank (FSDP2 on gloo, the fused log-prob kernel) and its
  train_step, on the same padded batch of prompt + random-length responses. Trained tokens/s
  (prompt + response, no padding).

Every side gets --threads intra-op threads (trainer.num_threads, Ray's num_cpus). Overhead is
the extra time per token, bare tokens/s / Tandem tokens/s - 1; the targets are 10% (rollout)
and 15% (trainer). 1 warm-up + --rounds timed rounds per side; --quick: 8 prompts, 32 new
tokens, 1 timed round unless --rounds says otherwise. Prints a markdown table; raw results go
to .cache/bench/bare_components.json. Overrides (key=value) patch the recipe.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time
from pathlib import Path

import ray
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from kernels.attention import ATTENTION
from rl.base.build import ensure_base
from rl.cluster.placement import plan_placement
from rl.cluster.rollout_replicas import RolloutReplicas
from rl.cluster.trainer_ranks import PolicyRanks
from rl.config import Config
from rl.config.recipe import load_config
from rl.data.loading import load_examples
from rl.data.prompts import encode_prompts
from rl.run.batching import build_batch
from rl.types import Batch, Sample, SamplingParams, fresh_samples
from rollout.engines.vllm_engine import _configure_environment, engine_args

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "bench" / "recipes" / "throughput_25m.yaml"
RESULTS = REPO / ".cache" / "bench" / "bare_components.json"
TARGETS = {"rollout": 10.0, "trainer": 15.0}  # most overhead the issue allows, %


def timed_rounds(sides: dict, rounds: int) -> dict[str, dict]:
    """Run each side's round function (returning its token count) once to warm up, then
    `rounds` times, the sides taking turns so that the machine's drift hits them alike."""
    runs = {name: {"seconds": [], "tokens": []} for name in sides}
    for round_index in range(rounds + 1):
        for name, run_round in sides.items():
            start = time.perf_counter()
            tokens = run_round()
            seconds = time.perf_counter() - start
            print(f"  {name} round {round_index}: {tokens} tokens in {seconds:.2f} s", flush=True)
            if round_index:  # round 0 is the warm-up
                runs[name]["seconds"].append(seconds)
                runs[name]["tokens"].append(tokens)
    for run in runs.values():
        run["tokens_per_s"] = sum(run["tokens"]) / sum(run["seconds"])
    return runs


# ---- rollout -----------------------------------------------------------------------------


def sampling(cfg: Config) -> SamplingParams:
    """What the driver asks of the rollout in training."""
    return SamplingParams.for_training(cfg)


def bare_engine(cfg: Config, prompts: list[list[int]], params: SamplingParams):
    """The bare engine and a round on it: `LLM.generate` of every prompt's n samples, with the
    vLLM sampling parameters VLLMEngine sends (its _sampling_params): prompt g is seeded
    seed + g * n as Tandem seeds group g, so both sides draw the same tokens."""
    _configure_environment()  # what VLLMEngine sets before vLLM is imported
    import vllm

    start = time.perf_counter()
    llm = vllm.LLM(**engine_args(cfg.model.path, cfg.rollout, cfg.model.dtype, cfg.run.seed))
    startup_s = time.perf_counter() - start
    request = {
        "n": params.n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_tokens": params.max_new_tokens,
        "logprobs": 0,
        "detokenize": False,
    }
    per_prompt = [
        vllm.SamplingParams(**request, seed=params.seed + group * params.n)
        for group in range(len(prompts))
    ]
    inputs = [{"prompt_token_ids": prompt} for prompt in prompts]
    responses: list[list[int]] = []

    def run_round() -> int:
        outputs = llm.generate(inputs, per_prompt, use_tqdm=False)
        responses[:] = [list(c.token_ids) for output in outputs for c in output.outputs]
        return sum(map(len, responses))

    return run_round, responses, startup_s


class WholeMachine:
    """The rl.cluster.reservation.Placement the groups below are built on: every actor gets all
    `num_cpus` CPUs. (A real colocated run gives each actor a share of a 1-CPU bundle, so Ray
    would give it one OpenMP thread where the bare side gets `num_cpus`.) Its plan is one
    node block of `num_cpus` bundles: RolloutReplicas sizes a time-sliced engine's threads from
    it, and the recipe's own pool (as many bundles as trainer ranks) would give one thread at
    W = 1, where the bare engine gets `num_cpus` (the 60% "overhead" of an earlier run)."""

    use_gpu = False

    def __init__(self, cfg: Config, num_cpus: int) -> None:
        plan = plan_placement(cfg)
        bundles = list(range(max(num_cpus, plan.num_devices)))
        self.plan = dataclasses.replace(plan, num_devices=len(bundles), node_blocks=[bundles])
        self._num_cpus = num_cpus

    def actor_options(self, bundle_index: int, num_roles_sharing: int) -> dict:
        return {"num_cpus": self._num_cpus}


def tandem_rounds(rollout: RolloutReplicas, prompts: list[list[int]], params: SamplingParams):
    """Round functions on the driver's RolloutReplicas: the blocking `generate` (evaluation), and
    the training path, one `submit`ted batch per prompt group, then `poll`s until every batch
    is back (as the scheduler does)."""
    responses: dict[str, list[list[int]]] = {"generate": [], "streamed": []}

    def keep(name: str, samples: list[Sample]) -> int:
        responses[name][:] = [s.response_ids for s in samples]
        return sum(map(len, responses[name]))

    def generate() -> int:
        samples = fresh_samples(prompts, params.n, list(range(len(prompts))))
        return keep("generate", rollout.generate(samples, params))

    def streamed() -> int:
        samples = fresh_samples(prompts, params.n, list(range(len(prompts))))
        batches = {g: samples[g * params.n : (g + 1) * params.n] for g in range(len(prompts))}
        rollout.submit(batches, params)
        done: dict[int, list[Sample]] = {}
        while len(done) < len(batches):
            done.update(rollout.poll(0).result())
        return keep("streamed", [s for g in sorted(done) for s in done[g]])

    return generate, streamed, responses


def measure_rollout(cfg: Config, prompts: list[list[int]], rounds: int, threads: int) -> dict:
    params = sampling(cfg)
    start = time.perf_counter()
    rollout = RolloutReplicas(cfg, WholeMachine(cfg, threads), num_roles_sharing=1)
    tandem_startup_s = time.perf_counter() - start
    bare, bare_responses, bare_startup_s = bare_engine(cfg, prompts, params)
    generate, streamed, tandem_responses = tandem_rounds(rollout, prompts, params)
    runs = timed_rounds(
        {"bare": bare, "tandem_generate": generate, "tandem_streamed": streamed}, rounds
    )
    ray.kill(rollout.workers[0])
    return {
        "runs": runs,
        "startup_s": {"bare": bare_startup_s, "tandem": tandem_startup_s},
        # Seeded alike, the sides should sample the very same tokens: the same work.
        "same_tokens": {n: r == bare_responses for n, r in tandem_responses.items()},
    }


# ---- trainer -----------------------------------------------------------------------------


def training_batch(cfg: Config, prompts: list[list[int]], pad_id: int, vocab: int) -> Batch:
    """n samples per prompt, each a response of a random length 1..max_new_tokens (fixed seed)
    of random non-special tokens, padded by the driver's own build_batch. Behaviour log-probs
    are log(1/vocab): a randomly initialised model is close to uniform. GRPO-like advantages,
    one per sequence."""
    gen = torch.Generator().manual_seed(0)
    samples = fresh_samples(prompts, cfg.algorithm.group_size, list(range(len(prompts))))
    max_new = cfg.rollout.max_new_tokens
    for sample in samples:
        length = int(torch.randint(1, max_new + 1, (1,), generator=gen))
        sample.response_ids = torch.randint(2, vocab, (length,), generator=gen).tolist()
        sample.logprobs = [-math.log(vocab)] * length
    batch = build_batch(samples, pad_id)
    batch.advantages = torch.randn(len(samples), 1, generator=gen) * batch.loss_mask
    return batch


def bare_trainer(cfg: Config, batch: Batch, threads: int):
    """A plain single-process step: HF forward to full logits (under bf16 autocast when
    model.dtype is bfloat16), fp32 log-probs at the rollout temperature, PPO clip against the
    detached current log-probs, token mean over the whole batch, micro-batches of
    trainer.micro_batch_size, grad clip, one AdamW step. It runs Tandem's attention
    (kernels.attention) so that the ratio measures the framework, not the attention kernel."""
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(
        cfg.model.path, dtype=torch.float32, attn_implementation=ATTENTION
    ).eval()
    t, algo = cfg.trainer, cfg.algorithm
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay
    )
    num_tokens = batch.loss_mask.sum()
    # model.dtype=bfloat16 is bf16 compute over fp32 weights, as Tandem's FSDP2 policy.
    bf16 = cfg.model.dtype == "bfloat16"
    compute = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)

    def step() -> int:
        for start in range(0, batch.num_sequences, t.micro_batch_size):
            micro = batch.select(slice(start, start + t.micro_batch_size))
            with compute:
                output = model(input_ids=micro.input_ids, attention_mask=micro.attention_mask)
            logits = output.logits[:, :-1].float()
            logp = torch.log_softmax(logits / cfg.rollout.temperature, dim=-1)
            logp = logp.gather(-1, micro.input_ids[:, 1:, None]).squeeze(-1)
            ratio = torch.exp(logp - logp.detach())
            clipped = ratio.clamp(1 - algo.clip_low, 1 + algo.clip_high)
            pg = torch.max(-micro.advantages * ratio, -micro.advantages * clipped)
            ((pg * micro.loss_mask).sum() / num_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return int(batch.attention_mask.sum())

    return step


def tandem_trainer(cfg: Config, batch: Batch, threads: int):
    """The driver's PolicyRanks of one rank and its train_step; also keeps the rank's own
    tokens/s of each step, to tell Ray's share of the overhead from the rank's."""
    trainers = PolicyRanks(cfg, WholeMachine(cfg, threads), num_roles_sharing=1)
    inside: list[float] = []

    def step() -> int:
        inside.append(trainers.train_step(batch)["timing/train_tokens_per_s"])
        return int(batch.attention_mask.sum())

    return trainers.workers[0], step, inside


def measure_trainer(
    cfg: Config, prompts: list[list[int]], pad_id: int, rounds: int, threads: int
) -> dict:
    vocab = AutoConfig.from_pretrained(cfg.model.path).vocab_size
    batch = training_batch(cfg, prompts, pad_id, vocab)
    worker, tandem, inside = tandem_trainer(cfg, batch, threads)
    runs = timed_rounds({"bare": bare_trainer(cfg, batch, threads), "tandem": tandem}, rounds)
    ray.kill(worker)
    return {
        "runs": runs,
        "sequences": batch.num_sequences,
        "real_tokens": int(batch.attention_mask.sum()),
        "padded_tokens": batch.input_ids.numel(),
        "tandem_inside_rank_tokens_per_s": statistics.median(inside[1:]),
    }


# ---- report ------------------------------------------------------------------------------


def table(results: dict) -> str:
    rows = [
        "| comparison | bare tokens/s | Tandem tokens/s | Tandem / bare | overhead | target |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    pairs = [
        ("rollout", "bare", "tandem_generate", "rollout: LLM.generate vs RolloutReplicas.generate"),
        ("rollout", "bare", "tandem_streamed", "rollout: LLM.generate vs submit + poll"),
        ("trainer", "bare", "tandem", "trainer W=1: PyTorch loop vs PolicyRanks.train_step"),
    ]
    for part, bare, tandem, label in pairs:
        if part not in results:
            continue
        runs = results[part]["runs"]
        bare_tps, tandem_tps = runs[bare]["tokens_per_s"], runs[tandem]["tokens_per_s"]
        overhead = 100 * (bare_tps / tandem_tps - 1)
        rows.append(
            f"| {label} | {bare_tps:,.0f} | {tandem_tps:,.0f} | {tandem_tps / bare_tps:.3f} "
            f"| {overhead:+.1f}% | <= {TARGETS[part]:g}% |"
        )
    return "\n".join(rows)


def notes(results: dict) -> str:
    """What the table does not say: whether the work was the same, and where time went."""
    lines = []
    if "rollout" in results:
        rollout = results["rollout"]
        same = ", ".join(f"{n}: {'yes' if v else 'NO'}" for n, v in rollout["same_tokens"].items())
        startup = rollout["startup_s"]
        lines.append(
            f"- rollout: same tokens as bare ({same}); engine start-up "
            f"{startup['bare']:.1f} s bare, {startup['tandem']:.1f} s Tandem"
        )
    if "trainer" in results:
        trainer = results["trainer"]
        lines.append(
            f"- trainer: {trainer['sequences']} sequences, {trainer['real_tokens']} tokens "
            f"({trainer['padded_tokens']} with padding); inside the rank Tandem trained "
            f"{trainer['tandem_inside_rank_tokens_per_s']:,.0f} tokens/s (the rest is Ray)"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 prompts, 32 tokens, 1 round")
    parser.add_argument("--rounds", type=int, help="timed rounds per side (3; --quick: 1)")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads per side")
    parser.add_argument("--only", choices=("rollout", "trainer"))
    parser.add_argument("overrides", nargs="*", help="recipe key=value overrides")
    args = parser.parse_args()
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    overrides = ["run.name=bench-bare-components"]
    if args.quick:
        overrides += ["run.prompts_per_step=8", "rollout.max_new_tokens=32"]
    # W = 1 with as many threads as the bare loop gets.
    overrides += ["trainer.num_workers=1", f"trainer.num_threads={args.threads}"]
    cfg = load_config(RECIPE, [*overrides, *args.overrides])
    os.chdir(REPO)  # the recipe's paths are relative to the repo root
    ensure_base(cfg)
    # Every side, Ray's actors included (they inherit it), runs this many OpenMP threads.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    examples = load_examples(cfg.data, "train").dataset
    prompts = encode_prompts(tokenizer, examples[: cfg.run.prompts_per_step]["prompt"])
    # A cluster of our own, never one found on this machine (`ray start`, another run).
    ray.init(address="local", num_cpus=args.threads, include_dashboard=False, log_to_driver=False)
    results: dict = {
        "config": {"quick": args.quick, "rounds": args.rounds, "threads": args.threads}
    }
    try:
        # The trainer first: the bare vLLM engine lives in this process, and vLLM's CPU
        # worker turns torch.set_num_threads into a no-op for good once it has started.
        if args.only in (None, "trainer"):
            print("trainer:", flush=True)
            results["trainer"] = measure_trainer(
                cfg, prompts, tokenizer.pad_token_id, args.rounds, args.threads
            )
        if args.only in (None, "rollout"):
            print("rollout:", flush=True)
            results["rollout"] = measure_rollout(cfg, prompts, args.rounds, args.threads)
    finally:
        ray.shutdown()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(table(results))
    print(notes(results))
    print(f"raw results: {RESULTS}")


if __name__ == "__main__":
    main()
