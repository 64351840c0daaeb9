"""The GPU suite: one job on one H100 or H200 (sized for under 8 minutes) that prints, as
markdown, what issue 50 measures on a lent GPU.

    PYTHONPATH=. python3 bench/gpu_suite.py                 # CUDA: every part
    PYTHONPATH=. python3 bench/gpu_suite.py --parts head,sync
    .venv/bin/python bench/gpu_suite.py --tiny              # every part at tiny shapes on CPU

Parts, in the order they run (each prints its table when done, so a run cut short keeps them):
1. head: the fused LM head (`kernels.logprobs`: the Triton forward and the chunked cuBLAS
   backward on CUDA, at the GPU recipes' chunks of 4096 rows x 8192 columns), forward and
   backward of log-prob and entropy for N tokens at Qwen2.5-0.5B's and 7B's heads in bf16,
   against cuBLAS doing only the unfused head's three matmuls (logits, grad of hidden, grad of
   weight); after a correctness check against fp64 (bench/gpu_kernels.py's, whose `main`
   sweeps chunk shapes and other paths).
2. sync: the gathered weight-sync transport (`rl.sync.gathered`) between two processes on one
   GPU, against one device-to-device copy of the same bytes (bench/gpu_weight_sync.py).
3. lora: a LoRA train step (rank 32 on every linear module) at the 1.5B shape, 8K sequences.
4. trainer: `PolicyTrainer.train_step` at Qwen2.5-0.5B's and 1.5B's shapes (random weights
   from the config, no hub), one rank of FSDP2, bf16 compute over fp32 master weights,
   activation checkpointing, samples of a quarter to all of 2K or 8K tokens packed into
   rows, with and without trainer.compile (the compiled rows last: they pay the compile).
5. attention: packed rows' attention (`kernels.attention.packed_attention`: variable-length
   flash attention on CUDA in bf16) at Qwen2.5-7B's heads over rows of several samples,
   forward and backward, against each sample's own fp32 SDPA (correctness) and against SDPA
   with the [width, width] packed-row mask transformers would build (time, peak memory).

Train steps report s/step, trained tokens/s, MFU (rl.observe.flops: 6N plus attention FLOPs
per trained token, against the device's dense bf16 peak; LoRA counted the same way), peak
memory (`memory/trainer_peak_mb`), the log-prob pass over the same batch, and how often one
step made the host wait for the GPU (CUDA's sync debug mode; the lines that did go to stderr).

--tiny runs every part on CPU at tiny shapes in seconds, as a check of the script (make
test runs it): the times mean nothing, MFU is against the best fp32 matmul rate measured on
the machine, and torch.compile traces with Dynamo but runs the graphs eagerly, in one row
(Inductor's CPU compile takes minutes). It needs no vLLM and no network.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import gc
import math
import socket
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import gpu_kernels
import gpu_weight_sync
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rl.algorithms.objective import Objective
from rl.cluster.memory_plan import ModelShape
from rl.config import Config
from rl.observe.flops import peak_flops, train_flops
from rl.types import Batch
from trainer.policy import PolicyTrainer
from trainer.ranks import to_device

SHAPES = {
    # Qwen2.5-0.5B's and Qwen2.5-1.5B's configs.
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True),
    "tiny-wide": dict(vocab_size=640, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True),
}  # fmt: skip
PARTS = ("head", "sync", "lora", "trainer", "attention")
LORA_RANK = 32


class Sizes:
    """What the parts run at: the GPU sizes, or with --tiny the stand-ins for each."""

    def __init__(self, tiny: bool) -> None:
        self.tiny = tiny
        # LM heads (d, V): Qwen2.5-0.5B's and Qwen2.5-7B's.
        self.heads = {"0.5b": (896, 151936), "7b": (3584, 152064)}
        self.head_tokens = 16384
        self.models = {"0.5b": "0.5b", "1.5b": "1.5b"}  # label -> SHAPES key
        self.seq_lens = {"2K": 2048, "8K": 8192}  # label -> longest sample
        self.step_tokens = 32768  # real tokens per train step, about
        self.micro_batch_tokens = 16384  # packed positions per micro-batch
        self.sync_shape, self.bucket_mb = "7b", 1024.0
        # Packed rows for the attention part: (rows, sample lengths of a row)
        self.attention_rows = (2, [16384, 8192, 4096, 2048, 2048])
        self.iters, self.warmup, self.steps = 3, 1, 2
        if tiny:
            self.heads = {"0.5b": (64, 512), "7b": (96, 1000)}
            self.head_tokens = 256
            self.models = {"0.5b": "tiny", "1.5b": "tiny-wide"}
            self.seq_lens = {"2K": 32, "8K": 64}
            self.step_tokens, self.micro_batch_tokens = 256, 128
            self.sync_shape, self.bucket_mb = "tiny", 0.02
            self.attention_rows = (2, [16, 8, 5, 3])
            self.iters, self.warmup, self.steps = 1, 0, 1


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_model(shape: dict, directory: Path) -> Path:
    """A Qwen2 checkpoint of `shape` with random weights (initialised on the GPU when there is
    one: seconds at 1.5B), saved in bf16 as Qwen publishes it."""
    config = Qwen2Config(**shape, max_position_embeddings=32768)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(directory)
    return directory


def packed_batch(seq_len: int, step_tokens: int, vocab: int, seed: int) -> Batch:
    """Samples of seq_len / 4 to seq_len tokens (their first eighth the prompt) until they hold
    step_tokens, random GRPO-like advantages; old and behaviour log-probs 0 (their values
    change neither memory nor speed)."""
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < step_tokens:
        lengths.append(int(torch.randint(seq_len // 4, seq_len + 1, (1,), generator=gen)))
    steps = torch.arange(seq_len)
    attention_mask = (steps < torch.tensor(lengths)[:, None]).long()
    input_ids = torch.randint(1, vocab, (len(lengths), seq_len), generator=gen) * attention_mask
    loss_mask = ((steps[1:] >= seq_len // 8) & (attention_mask[:, 1:] == 1)).float()
    zeros = torch.zeros_like(loss_mask)
    advantages = torch.randn(len(lengths), 1, generator=gen) * loss_mask
    return Batch(input_ids, attention_mask, loss_mask, zeros, zeros, advantages)


def cpu_peak_flops() -> float:
    """The best fp32 matmul rate of five on this CPU: the peak a --tiny MFU is taken against."""
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    seconds = min(gpu_kernels.elapsed_ms(lambda: a @ b, 4, "cpu") for _ in range(5)) / 1e3
    return 2 * 512**3 / seconds


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"


@contextlib.contextmanager
def host_waits() -> Iterator[collections.Counter[str]]:
    """file:line -> how often the block made the host wait for the GPU (CUDA's sync debug mode
    warns at each such call), filled when the block ends; stays empty on CPU, where nothing
    is queued to wait for."""
    waits: collections.Counter[str] = collections.Counter()
    if not torch.cuda.is_available():
        yield waits
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield waits
        finally:
            torch.cuda.set_sync_debug_mode("default")
    waits.update(
        f"{Path(warning.filename).name}:{warning.lineno}"
        for warning in caught
        if "synchronizing" in str(warning.message)
    )


def head_part(sizes: Sizes, device: str) -> str:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lines = []
    if device == "cuda":
        lines += [gpu_kernels.check("cuda", 1000, 256, 4099, 4000, torch.bfloat16), ""]
    else:  # the Triton path needs CUDA (its interpreter is far too slow for seconds)
        lines += [gpu_kernels.check("cpu", 70, 72, 300, 290, dtype, backends=("torch",)), ""]
    n = sizes.head_tokens
    lines += [
        f"{dtype}, N={n} tokens, forward + backward of log-prob and entropy, mean of "
        f"{sizes.iters} after a warm-up; {device_name()}",
        "",
        "| head (d x V) | fused ms | 3 matmuls ms | fused / matmuls | fused peak GiB above "
        "inputs | matmuls TFLOP/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, (d, v) in sizes.heads.items():
        fused = gpu_kernels.dispatched("auto", chunk_size=4096, vocab_chunk_size=8192)
        inputs = gpu_kernels.make_inputs(n, d, v, v, dtype, device)
        fused_ms, gib = gpu_kernels.measure(fused, inputs, v, sizes.iters)
        del inputs
        matmuls_ms = gpu_kernels.measure_cublas(n, d, v, sizes.iters, device, dtype)
        tflops = 6 * n * d * v / (matmuls_ms * 1e-3) / 1e12
        lines.append(
            f"| {name}: {d} x {v} | {fused_ms:.2f} | {matmuls_ms:.2f} "
            f"| {fused_ms / matmuls_ms:.2f} | {gib:.2f} | {tflops:.3g} |"
        )
    return "\n".join(lines)


def attention_part(sizes: Sizes, device: str) -> str:
    """Packed rows' attention at Qwen2.5-7B's heads (28 query, 4 key/value, 128 wide)."""
    from kernels.attention import Segments, packed_attention

    num_rows, row = sizes.attention_rows
    width, heads, kv_heads, dim = sum(row), 28, 4, 128
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = heads // kv_heads, True
    gen = torch.Generator(device).manual_seed(0)
    q, k, v = (
        torch.randn(num_rows, h, width, dim, generator=gen, device=device, dtype=dtype)
        for h in (heads, kv_heads, kv_heads)
    )
    upstream = torch.randn(num_rows, width, heads, dim, generator=gen, device=device, dtype=dtype)
    segments = to_device(Segments.of_rows([row] * num_rows, width), torch.device(device))
    positions = torch.arange(width, device=device)
    sample = torch.repeat_interleave(
        torch.arange(len(row), device=device), torch.tensor(row, device=device)
    )
    mask = (sample[:, None] == sample[None, :]) & (positions[None, :] <= positions[:, None])
    mask = mask.expand(num_rows, 1, width, width)

    def run(attend: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, list, float, float]:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        begin = time.perf_counter()
        out = attend(*leaves)
        (out.float() * upstream).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - begin
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else math.nan
        return out.detach(), [t.grad for t in leaves], seconds, peak

    def packed(q, k, v):
        return packed_attention(module, q, k, v, None, segments=segments)[0]

    def masked(q, k, v):
        groups = heads // kv_heads
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2)

    def per_sample(q, k, v):  # the oracle: each sample alone, fp32
        groups, outs, start = heads // kv_heads, [], 0
        for n in row:
            part = [t[:, :, start : start + n].float() for t in (q, k, v)]
            part[1:] = [t.repeat_interleave(groups, dim=1) for t in part[1:]]
            outs.append(torch.nn.functional.scaled_dot_product_attention(*part, is_causal=True))
            start += n
        return torch.cat(outs, dim=2).transpose(1, 2)

    for attend in (packed, masked):  # warm-up
        run(attend)
    expected, expected_grads, _, _ = run(per_sample)
    lines = [
        f"{dtype}, {num_rows} rows of {width:,} positions, samples {row} each, 28 query and "
        f"4 key/value heads of 128; forward + backward; {device_name()}",
        "",
        "| attention | ms | peak GiB | max abs error of the output, of the grads vs fp32 |",
        "|---|---:|---:|---|",
    ]
    for name, attend in (("packed_attention", packed), ("SDPA with the packed mask", masked)):
        out, grads, seconds, peak = run(attend)
        error = (out.float() - expected).abs().max().item()
        grad_error = max(
            (g.float() - e.float()).abs().max().item()
            for g, e in zip(grads, expected_grads, strict=True)
        )
        lines.append(
            f"| {name} | {1e3 * seconds:.1f} | {peak:.2f} | {error:.2e}, {grad_error:.2e} |"
        )
    return "\n".join(lines)


def sync_part(sizes: Sizes, device: str) -> str:
    r = gpu_weight_sync.measure(
        gpu_weight_sync.SHAPES[sizes.sync_shape], sizes.bucket_mb, sizes.iters, torch.device(device)
    )
    seconds = r["seconds"]
    share = seconds["copy"] / seconds["gathered"]
    return "\n".join(
        [
            f"{r['bytes'] / 1e9:.3f} GB of bf16 weights ({sizes.sync_shape}), "
            f"{r['gathered_buckets']} buckets of up to {sizes.bucket_mb} MiB, median of "
            f"{sizes.iters} syncs after a warm-up, the receiver's weights checked after each; "
            f"{device_name()}",
            "",
            gpu_weight_sync.table(r),
            "",
            f"gathered transport: {share:.1%} of the device-to-device copy's bandwidth",
        ]
    )


def trainer_config(
    model_dir: Path, sizes: Sizes, compiled: bool = False, lora_rank: int = 0
) -> Config:
    lora = {"rank": lora_rank, "alpha": 2.0 * lora_rank} if lora_rank else {}
    return Config.model_validate(
        {
            "model": {"path": str(model_dir), "dtype": "bfloat16", "lora": lora},
            "rollout": {"max_model_len": max(sizes.seq_lens.values())},
            "trainer": {
                "num_workers": 1,
                "lr": 1e-6,
                "packing": True,
                "micro_batch_tokens": sizes.micro_batch_tokens,
                "logprob_chunk_size": 4096,
                "activation_checkpointing": True,
                "compile": compiled,
            },
            "algorithm": {"kl_coef": 0.0},
        }
    )


TRAIN_HEADER = [
    "| model | compile | samples of up to | samples | tokens/step | s/step | tokens/s | MFU "
    "| peak GiB | log-probs s | host waits/step |",
    "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
]


def train_rows(
    label: str, model_dir: Path, cfg: Config, sizes: Sizes, seq_labels: list[str], peak: float
) -> Iterator[str]:
    """One PolicyTrainer on `cfg`; per sequence length, a table row of its steps (and the lines
    that made the host wait under it)."""
    shape = ModelShape.read(model_dir)
    trainer = PolicyTrainer(cfg, Objective.from_config(cfg), 0, 1, "127.0.0.1", free_port())
    try:
        for seq_label in seq_labels:
            seq_len = sizes.seq_lens[seq_label]
            batch = packed_batch(seq_len, sizes.step_tokens, shape.vocab_size, seed=seq_len)
            for _ in range(sizes.warmup):
                trainer.train_step(batch)
            seconds, peaks = [], []
            with host_waits() as waits:
                for _ in range(sizes.steps):
                    gpu_kernels.synchronize(trainer.device)
                    start = time.perf_counter()
                    metrics = trainer.train_step(batch)
                    gpu_kernels.synchronize(trainer.device)
                    seconds.append(time.perf_counter() - start)
                    peaks.append(metrics["memory/trainer_peak_mb"] / 1024)
                    assert math.isfinite(metrics["actor/loss"]), f"{label}: loss {metrics}"
            start = time.perf_counter()
            trainer.compute_logprobs(batch)
            logprob_s = time.perf_counter() - start
            lengths = batch.attention_mask.sum(dim=1).tolist()
            step_s = statistics.mean(seconds)
            mfu = train_flops(shape, lengths) / step_s / peak
            reads = "n/a (CPU)"
            if torch.cuda.is_available():
                reads = f"{sum(waits.values()) / sizes.steps:g}"
            yield (
                f"| {label} | {'yes' if cfg.trainer.compile else 'no'} | {seq_label} "
                f"| {len(lengths)} | {sum(lengths):,} | {step_s:.4g} | {sum(lengths) / step_s:,.0f} "
                f"| {mfu:.1%} | {max(peaks):.2f} | {logprob_s:.4g} | {reads} |"
            )
            if waits:  # over all the timed steps
                where = ", ".join(f"{place} x{n}" for place, n in waits.most_common(8))
                print(f"  host waits ({label}, {seq_label}): {where}", file=sys.stderr)
    finally:
        trainer.close()
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def trainer_intro(sizes: Sizes, peak: float) -> str:
    return (
        f"{device_name()}; one FSDP2 rank, bf16 over fp32 master weights, activation "
        f"checkpointing, packed micro-batches of {sizes.micro_batch_tokens:,} positions, about "
        f"{sizes.step_tokens:,} tokens a step; mean of {sizes.steps} steps after "
        f"{sizes.warmup} warm-up; MFU against {peak / 1e12:.3g} TFLOP/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on any machine")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"some of {', '.join(PARTS)}")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}; valid: {', '.join(PARTS)}")
    sizes = Sizes(args.tiny)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.tiny and device != "cuda":
        sys.exit("bench/gpu_suite.py needs CUDA; without it run --tiny")
    if args.tiny:
        # Dynamo traces the layers; the traced graphs run as they are.
        torch.compile = functools.partial(torch.compile, backend="eager")
    peak = peak_flops(device_name()) if device == "cuda" else cpu_peak_flops()
    assert peak, f"no dense bf16 peak known for {device_name()} (rl.observe.flops.PEAK_TFLOPS)"
    start = time.perf_counter()

    def section(title: str, run: Callable[[], str | None]) -> None:
        print(f"\n### {title}\n", flush=True)
        text = run()
        if text is not None:
            print(text, flush=True)
        print(f"[{title}: {time.perf_counter() - start:.0f} s into the suite]", file=sys.stderr)

    with tempfile.TemporaryDirectory() as tmp:
        model_dirs: dict[str, Path] = {}

        def model_dir(label: str) -> Path:
            if label not in model_dirs:
                key = sizes.models[label]
                model_dirs[label] = build_model(SHAPES[key], Path(tmp) / key)
            return model_dirs[label]

        def train_table(runs: list[tuple[str, Config, list[str]]]) -> None:
            """Per (model label, config, sequence lengths), a trainer and its rows."""
            print(trainer_intro(sizes, peak) + "\n\n" + "\n".join(TRAIN_HEADER), flush=True)
            for label, cfg, seq_labels in runs:
                for row in train_rows(label, model_dir(label), cfg, sizes, seq_labels, peak):
                    print(row, flush=True)

        if "head" in parts:
            section(
                "1. The fused LM head against the three matmuls", lambda: head_part(sizes, device)
            )
        if "sync" in parts:
            section(
                "2. The gathered transport between two processes", lambda: sync_part(sizes, device)
            )
        if "lora" in parts:
            lora = trainer_config(model_dir("1.5b"), sizes, lora_rank=LORA_RANK)
            section(
                f"3. A LoRA step (rank {LORA_RANK}, every linear module)",
                lambda: train_table([("1.5b", lora, ["8K"])]),
            )
        if "trainer" in parts:
            runs = [
                (label, trainer_config(model_dir(label), sizes, compiled), list(sizes.seq_lens))
                for compiled in (False, True)
                for label in sizes.models
            ]
            if sizes.tiny:  # Dynamo's tracing takes most of --tiny's time: one compiled row
                runs = runs[: len(sizes.models) + 1]
                runs[-1] = (*runs[-1][:2], runs[-1][2][:1])
            section("4. Trainer steps", lambda: train_table(runs))
        if "attention" in parts:
            section("5. Packed rows' attention", lambda: attention_part(sizes, device))


if __name__ == "__main__":
    main()
