"""Rollout routing replay on the mixture-of-experts recipe (recipes/grpo_addition_moe_cpu.yaml):
what it does to the trainer/engine log-prob gap, and what it costs a run.

    .venv/bin/python bench/moe_replay.py gap [--prompts 64] [--checkpoint DIR]
    .venv/bin/python bench/moe_replay.py runs [--steps 40] [key=value ...]

gap: the recipe's torch engine generates the recipe's first training prompts (their groups, the
driver's sampling parameters), recording the experts each position was routed to, and so does
a vLLM engine (which on CPU cannot return its routing: natural rows only); then the
trainer's forward (trainer.fsdp.LogProbModel: the fused log-prob kernel over the HF model, in
one process) scores the same samples twice, routing naturally and replaying the record, in
fp32 and in bf16 (engine and trainer both in the dtype, as model.dtype sets both). Per
setting: the mean and largest |trainer - engine| log-prob of the sampled tokens, k3 KL
(engine || trainer), and the share of (position, layer) pairs where the trainer's router
chose other experts than the engine's. --checkpoint scores an exported policy instead of the
recipe's base (for instance a trained run's export: routers far from their initial spread).

runs: the recipe for --steps steps with model.routing_replay true and false, back to back
(their order alternating over --rounds), on the same seeds; median seconds per step over
steps 3 onward, steps per hour, and the routing record's bytes per sample.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from scratch import clear_run
from transformers import AutoModelForCausalLM, AutoTokenizer

from kernels.attention import ATTENTION
from rl.algorithms.off_policy import mismatch_kl
from rl.base.build import ensure_base
from rl.config import TrainerConfig
from rl.config.recipe import load_config
from rl.data.loading import load_split
from rl.data.prompts import encode_prompts, padding_id
from rl.expert_routing import disagreement
from rl.run.batching import build_batch
from rl.types import SamplingParams, fresh_samples
from rollout.engines.registry import build_engine
from trainer.fsdp import LogProbModel
from trainer.packing import padded_input

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "grpo_addition_moe_cpu.yaml"
OUTPUT = ".cache/bench/runs"


def gap(args: argparse.Namespace) -> None:
    cfg = load_config(RECIPE, ["run.name=bench-moe-replay"])
    ensure_base(cfg)
    model_dir = args.checkpoint or cfg.model.path
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = load_split(cfg.data, "train").select(range(args.prompts))
    prompts = encode_prompts(tokenizer, [ex["prompt"] for ex in examples])
    params = SamplingParams.for_training(cfg)
    print(
        f"{model_dir}: {args.prompts} prompts x {params.n} samples, temperature "
        f"{params.temperature}, up to {params.max_new_tokens} new tokens\n"
    )
    print("| engine | dtype | routing | mean abs gap | max abs gap | k3 | routers disagree |")
    print("|---|---|---|---:|---:|---:|---:|")
    notes = []
    for engine_name, dtype in (
        ("torch", "float32"),
        ("torch", "bfloat16"),
        ("vllm", "float32"),
        ("vllm", "bfloat16"),
    ):
        # vLLM on CPU serves the model but cannot return its routing (rollout.engines.
        # vllm_engine.engine_args): its rows are the gap replay would have to close.
        engine = build_engine(
            model_dir,
            cfg.rollout.model_copy(update={"engine": engine_name}),
            dtype,
            cfg.run.seed,
            record_routing=engine_name == "torch",
        )
        samples = fresh_samples(prompts, params.n, list(range(len(prompts))))
        engine.generate(samples, params)
        engine.close()
        batch = build_batch(samples, padding_id(tokenizer))
        causal_lm = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype), attn_implementation=ATTENTION
        ).eval()
        model = LogProbModel(causal_lm, TrainerConfig())
        mask = batch.loss_mask
        record = None if batch.routing is None else batch.routing.flatten(0, 1).long()
        for replay in (False, True) if record is not None else (False,):
            inputs = padded_input(batch)
            if not replay:
                inputs.routing = None
            with torch.no_grad():
                logprob, _ = model(inputs, params.temperature)
            disagree = "n/a"
            if record is not None:
                differ, pairs = disagreement(model.routing.calls, record).tolist()
                disagree = f"{differ / pairs:.2%}"
            abs_gap = (logprob - batch.behaviour_logprobs).abs() * mask
            _, k3 = mismatch_kl(logprob, batch.behaviour_logprobs)
            tokens = mask.sum()
            print(
                f"| {engine_name} | {dtype} | {'replayed' if replay else 'natural'} | "
                f"{(abs_gap.sum() / tokens).item():.2e} | {abs_gap.max().item():.2e} | "
                f"{((k3 * mask).sum() / tokens).item():.2e} | {disagree} |"
            )
        if record is not None:
            sizes = [s.routed_experts.numel() * s.routed_experts.element_size() for s in samples]
            notes.append(
                f"routing record ({engine_name}, {dtype}): {statistics.mean(sizes):.0f} bytes a "
                f"sample on average ({samples[0].routed_experts.dtype}, "
                f"{tuple(samples[0].routed_experts.shape[1:])} per position)"
            )
    print("\n" + "\n".join(notes))


def runs(args: argparse.Namespace, extra: list[str]) -> None:
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for round_index in range(args.rounds):
        order = (True, False) if round_index % 2 == 0 else (False, True)
        for replay in order:
            name = f"bench-moe-replay-{'on' if replay else 'off'}"
            overrides = [
                f"run.output_dir={OUTPUT}",
                f"run.name={name}",
                f"run.num_steps={args.steps}",
                "run.eval_every=0",
                "run.wandb_mode=disabled",
                "run.tensorboard=false",
                "run.export_hf=false",
                f"model.routing_replay={str(replay).lower()}",
                *extra,
            ]
            run_dir = clear_run(load_config(RECIPE, overrides))
            subprocess.run(
                [sys.executable, "-m", "rl.cli", "train", str(RECIPE), *overrides],
                cwd=REPO,
                check=True,
                stdout=subprocess.DEVNULL,
            )
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
            steps = [r["time/step_s"] for r in records if r["step"] >= 3 and "time/step_s" in r]
            seconds[replay].append(statistics.median(steps))
    print(f"`bench/moe_replay.py runs --steps {args.steps} --rounds {args.rounds}`\n")
    print("| routing replay | s/step (median of rounds) | steps/hour |")
    print("|---|---:|---:|")
    for replay in (False, True):
        median = statistics.median(seconds[replay])
        print(f"| {'on' if replay else 'off'} | {median:.3f} | {3600 / median:.0f} |")
    ratio = statistics.median(seconds[False]) / statistics.median(seconds[True])
    print(f"\nsteps per hour with replay / without: {ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    one = sub.add_parser("gap")
    one.add_argument("--prompts", type=int, default=64)
    one.add_argument("--checkpoint", help="an HF directory to score instead of the base")
    two = sub.add_parser("runs")
    two.add_argument("--steps", type=int, default=40)
    two.add_argument("--rounds", type=int, default=2)
    args, extra = parser.parse_known_args()
    if args.what == "gap":
        gap(args)
    else:
        runs(args, extra)


if __name__ == "__main__":
    main()
