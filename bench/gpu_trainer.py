"""The FSDP2 trainer on a GPU: GRPO steps of a Qwen2.5-0.5B-shaped model (random weights).

    python bench/gpu_trainer.py           # CUDA machine: ~0.5B shape, 2 warm-up + 5 steps, < 8 min
    python bench/gpu_trainer.py --tiny    # a tiny shape on any machine (checks the script)

The lent GPU machine has no vLLM, so each step generates with transformers `generate` (bf16,
sampling, KV cache) on the same GPU, copies the trainer's weights into that model (the
one-rank weight sync), recomputes old log-probs, and trains one GRPO step (FSDP2 with one
rank, bf16 compute with fp32 master weights, the fused Triton log-prob kernel, activation
checkpointing). Rewards are random, so advantages are non-zero and every token trains.
It prints a markdown table for docs/benchmarks.md: seconds per phase, generated and trained
tokens/s, the trainer's model FLOPs utilisation (rl.observe.flops: 6 N FLOPs per trained token plus
attention, against the device's dense bf16 peak) and peak GPU memory.
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rl.algorithms.objective import Objective
from rl.cluster.memory_plan import ModelShape
from rl.config import Config
from rl.observe.flops import peak_flops, train_flops
from rl.types import Batch
from trainer.policy import PolicyTrainer

SHAPES = {
    # Qwen2.5-0.5B's config.
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True),
}  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_model(shape: dict, directory: Path) -> Path:
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**shape, max_position_embeddings=4096)).save_pretrained(directory)
    return directory


def _config(model_dir: Path, args: argparse.Namespace) -> Config:
    return Config.model_validate(
        {
            "model": {"path": str(model_dir), "dtype": "bfloat16"},
            "rollout": {"max_model_len": args.prompt_tokens + args.new_tokens},
            "trainer": {
                "num_workers": 1,
                "lr": 1e-6,
                "micro_batch_size": args.micro_batch_size,
                "logprob_chunk_size": 4096,
                "activation_checkpointing": True,
            },
            "algorithm": {"group_size": args.group_size, "kl_coef": 0.0},
        }
    )


def _sync(trainer: PolicyTrainer, rollout_model: torch.nn.Module) -> None:
    """The one-rank weight sync: the trainer's full parameters into the generating model."""
    with torch.no_grad():
        params = dict(rollout_model.named_parameters())
        for name, param in trainer.policy.model.named_parameters():
            params[name].copy_(param.full_tensor())


def _generate(model: torch.nn.Module, args: argparse.Namespace, vocab: int) -> torch.Tensor:
    """[prompts x group, prompt + new] sampled sequences (random prompts; EOS never stops)."""
    device = next(model.parameters()).device
    prompts = torch.randint(1, vocab, (args.prompts, args.prompt_tokens), device=device)
    prompts = prompts.repeat_interleave(args.group_size, dim=0)
    with torch.no_grad():
        return model.generate(
            input_ids=prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=True,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        ).cpu()


def _batch(sequences: torch.Tensor, args: argparse.Namespace) -> Batch:
    num_rows, length = sequences.shape
    loss_mask = torch.zeros(num_rows, length - 1)
    loss_mask[:, args.prompt_tokens - 1 :] = 1.0
    scores = torch.rand(args.prompts, args.group_size)
    scores = (scores - scores.mean(1, keepdim=True)) / (scores.std(1, keepdim=True) + 1e-6)
    zeros = torch.zeros_like(loss_mask)
    return Batch(
        sequences,
        torch.ones_like(sequences),
        loss_mask,
        zeros,
        zeros,
        scores.reshape(-1, 1) * loss_mask,
    )


def _peak_flops(args: argparse.Namespace) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    return peak_flops(torch.cuda.get_device_name()) if torch.cuda.is_available() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (any machine)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=384)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak")
    args = parser.parse_args()
    if args.tiny:
        args.prompts, args.group_size, args.prompt_tokens, args.new_tokens = 2, 4, 8, 8
        args.steps, args.warmup, args.micro_batch_size = 2, 1, 4
    shape_dict = SHAPES["tiny" if args.tiny else "0.5b"]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(shape_dict, Path(tmp) / "model")
        shape = ModelShape.read(model_dir)
        cfg = _config(model_dir, args)
        trainer = PolicyTrainer(cfg, Objective.from_config(cfg), 0, 1, "127.0.0.1", free_port())
        rollout_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        rollout_model.to(trainer.device).eval()
        rows = []
        for step in range(args.warmup + args.steps):
            times = {}
            for phase, work in (
                ("sync", lambda: _sync(trainer, rollout_model)),
                ("generate", lambda: _generate(rollout_model, args, shape.vocab_size)),
            ):
                start = time.perf_counter()
                result = work()
                if trainer.device.type == "cuda":
                    torch.cuda.synchronize()
                times[phase] = time.perf_counter() - start
            batch = _batch(result, args)
            start = time.perf_counter()
            old = trainer.compute_logprobs(batch)
            batch.old_logprobs, batch.behaviour_logprobs = old, old
            times["logprobs"] = time.perf_counter() - start
            start = time.perf_counter()
            metrics = trainer.train_step(batch)
            times["train"] = time.perf_counter() - start
            if step >= args.warmup:
                rows.append((times, batch, metrics))
        _report(rows, shape, args, trainer.device)
        trainer.close()


def _report(rows: list, shape: ModelShape, args: argparse.Namespace, device: torch.device) -> None:
    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    times = {phase: mean([t[phase] for t, _, _ in rows]) for phase in rows[0][0]}
    batch = rows[0][1]
    trained = float(batch.attention_mask.sum())
    generated = args.prompts * args.group_size * args.new_tokens
    flops = train_flops(shape, batch.attention_mask.sum(dim=1).tolist())
    peak = _peak_flops(args)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    memory = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    print(f"\n{name}, {shape.num_params / 1e6:.0f}M parameters, {args.prompts} prompts x "
          f"{args.group_size}, {args.prompt_tokens}+{args.new_tokens} tokens, {len(rows)} steps\n")  # fmt: skip
    print("| phase | s/step | tokens/s |\n|---|---|---|")
    print(
        f"| generate (transformers, bf16) | {times['generate']:.2f} | {generated / times['generate']:,.0f} |"
    )
    print(f"| old log-probs | {times['logprobs']:.2f} | {trained / times['logprobs']:,.0f} |")
    print(f"| train step | {times['train']:.2f} | {trained / times['train']:,.0f} |")
    print(f"| weight sync | {times['sync']:.3f} | |")
    mfu = f"{flops / times['train'] / peak:.1%}" if peak else "n/a (give --peak-tflops)"
    print(f"\ntrainer MFU: {mfu}; peak GPU memory {memory:.1f} GiB; "
          f"actor/loss {rows[-1][2]['actor/loss']:.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
