"""Weight sync between two processes on one GPU over CUDA IPC, against the device's copy bound
and against staging through host memory: part 3 of bench/gpu_suite.py, which runs `measure`
(Qwen2.5-7B's tensors in bf16 on CUDA; a tiny shape with --tiny) and prints `table`.

The sender plays a trainer rank holding the whole model (one GPU: one rank), the receiver a
rollout engine with its own copy of the weights, in a process of its own (spawned), as vLLM's
engine is. Two ways over CUDA IPC, each timed over `rounds` syncs after a warm-up:

- packed buckets: the sender copies its tensors into one of two bucket buffers (`bucket_mb`)
  that the receiver opened once by IPC handle, and the receiver copies them out into its
  weights while the sender fills the other buffer (as rl.sync's shared-memory transport
  pipelines its slots). Two device copies per byte; bounded memory whatever the model.
- the tensors themselves: the receiver opened the sender's parameters by IPC handle once (they
  live as long as the trainer) and copies each straight into its weights when told a version
  is ready (vLLM's "ipc" weight-transfer engine does this). One device copy per byte.
- the product's own transport, `rl.sync.gathered` (rollout.weight_transport=gathered): its
  trainer end (one rank: nothing to all-gather) writes each bucket of the transfer plan into
  its slots, which its rollout end opened from the CUDA IPC handles the trainer end exported;
  the receiver copies the tensors it reads into its weights, as vLLM's loaders do. This is
  the GPU code path of weight sync itself, run here without vLLM.

Bounds, in the sender's process: one device-to-device copy of all the bytes (what the second
way can at best reach), and device -> pinned host -> device of the same bytes, and of the fp32
bytes today's path moves (rl.sync stages fp32 rows through host shared memory). Each sync ends
with the receiver's weights compared to the sender's (checksums in float64): equal, or the
script fails. On CPU the buffers are shared memory, the pinned-host
bound is left out, and the times mean nothing; it checks the protocol.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from rl.sync.gathered import GatheredSpec, SlotExport
from rl.sync.plan import AttentionShape, TensorSpec, WeightSyncPlan, plan_weight_sync

# (hidden, intermediate, layers, heads, kv heads, vocab): untied embeddings, q/k/v biases.
SHAPES = {
    "7b": (3584, 18944, 28, 28, 4, 152064),  # Qwen2.5-7B
    "tiny": (64, 128, 2, 4, 2, 256),
}


def model_tensors(shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of a Qwen2 model's parameters."""
    hidden, inter, layers, heads, kv_heads, vocab = shape
    kv = hidden // heads * kv_heads
    tensors = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.q_proj.bias": (hidden,),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    return tensors | {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}


def plan_buckets(numels: dict[str, int], bucket_numel: int) -> list[list[str]]:
    """Tensors in model order, grouped greedily into buckets of at most `bucket_numel`
    elements; a tensor larger than that gets a bucket of its own (and sets the buffer size)."""
    buckets: list[list[str]] = [[]]
    filled = 0
    for name, numel in numels.items():
        if buckets[-1] and filled + numel > bucket_numel:
            buckets.append([])
            filled = 0
        buckets[-1].append(name)
        filled += numel
    return buckets


@dataclass
class Setup:
    """What the receiver gets once, through the spawn queue (CUDA tensors travel as IPC
    handles, CPU tensors as shared memory)."""

    shapes: dict[str, tuple[int, ...]]
    buckets: list[list[str]]
    slots: list[torch.Tensor]  # the two packed-bucket buffers
    params: dict[str, torch.Tensor]  # the sender's own tensors
    plan: WeightSyncPlan  # the gathered transport's
    export: SlotExport  # where its rollout end finds the trainer end's slots


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def checksum(tensors: dict[str, torch.Tensor]) -> float:
    return sum(t.double().sum().item() for t in tensors.values())


def receiver(inbox: mp.Queue, outbox: mp.Queue) -> None:
    """The rollout engine's side: on ("packed",) take each bucket from its slot as the sender
    announces it; on ("direct",) copy every tensor from the sender's; then reply "done". On
    ("checksum",) reply with its weights' checksum and zero them, so the next sync must bring
    every byte again."""
    setup: Setup = inbox.get()
    device = setup.slots[0].device
    dtype = setup.slots[0].dtype
    weights = {n: torch.zeros(s, dtype=dtype, device=device) for n, s in setup.shapes.items()}
    # The rollout end, as an engine's TP rank opens it (member W + 0).
    reader = GatheredSpec().with_exports([setup.export]).open(setup.plan, member=1)
    outbox.put("ready")
    while (message := inbox.get())[0] != "stop":
        if message[0] == "checksum":
            outbox.put(checksum(weights))
            for tensor in weights.values():
                tensor.zero_()
            _sync(device)
            continue
        if message[0] == "gathered":
            for bucket in range(len(setup.plan.buckets)):
                assert inbox.get() == ("bucket", bucket)
                for name, tensor in reader.read(bucket):
                    weights[name].copy_(tensor)
                _sync(device)
                outbox.put(("free", bucket))
        elif message[0] == "packed":
            for bucket, names in enumerate(setup.buckets):
                assert inbox.get() == ("bucket", bucket)
                slot, offset = setup.slots[bucket % 2], 0
                for name in names:
                    numel = weights[name].numel()
                    weights[name].view(-1).copy_(slot[offset : offset + numel])
                    offset += numel
                _sync(device)
                outbox.put(("free", bucket))  # the sender may fill this slot again
        else:
            for name, tensor in setup.params.items():
                weights[name].copy_(tensor)
            _sync(device)
        outbox.put("done")


def send_packed(setup: Setup, inbox: mp.Queue, outbox: mp.Queue) -> None:
    """One sync by packed buckets, through two slots."""
    device = setup.slots[0].device
    inbox.put(("packed",))
    for bucket, names in enumerate(setup.buckets):
        if bucket >= 2:  # this slot held bucket - 2: the receiver must have taken it
            assert outbox.get() == ("free", bucket - 2)
        slot, offset = setup.slots[bucket % 2], 0
        for name in names:
            flat = setup.params[name].view(-1)
            slot[offset : offset + flat.numel()].copy_(flat)
            offset += flat.numel()
        _sync(device)
        inbox.put(("bucket", bucket))
    for bucket in range(max(len(setup.buckets) - 2, 0), len(setup.buckets)):
        assert outbox.get() == ("free", bucket)
    assert outbox.get() == "done"


def send_gathered(setup: Setup, writer: object, inbox: mp.Queue, outbox: mp.Queue) -> None:
    """One sync through the gathered transport's trainer end (`writer`), bucket by bucket
    as WeightSync drives it: bucket i + 1 written once bucket i - 1 was taken."""
    inbox.put(("gathered",))
    buckets = setup.plan.buckets
    for bucket, specs in enumerate(buckets):
        if bucket >= 2:
            assert outbox.get() == ("free", bucket - 2)
        writer.write(bucket, {spec.name: setup.params[spec.name] for spec in specs}, None)
        inbox.put(("bucket", bucket))
    for bucket in range(max(len(buckets) - 2, 0), len(buckets)):
        assert outbox.get() == ("free", bucket)
    assert outbox.get() == "done"


def gathered_plan(
    shapes: dict[str, tuple[int, ...]], shape: tuple[int, ...], bucket_mb: float
) -> WeightSyncPlan:
    """The transfer plan WeightSync makes for one trainer rank and an engine of TP 1, bf16."""
    hidden, _, _, heads, kv_heads, vocab = shape
    return plan_weight_sync(
        [TensorSpec(name, tuple(s)) for name, s in shapes.items()],
        AttentionShape(heads, kv_heads, hidden // heads, vocab),
        world_size=1,
        tp_size=1,
        bucket_bytes=int(bucket_mb * (1 << 20)),
        wire_dtype="bfloat16",
    )


def send_direct(setup: Setup, inbox: mp.Queue, outbox: mp.Queue) -> None:
    """One sync by the sender's own tensors (their handles opened once at set-up)."""
    _sync(setup.slots[0].device)  # the version is complete before the receiver reads it
    inbox.put(("direct",))
    assert outbox.get() == "done"


def timed(fn, rounds: int, check=lambda: None) -> float:
    """Median seconds of `rounds` calls of `fn` after one warm-up; `check` runs after each,
    untimed."""
    times = []
    for i in range(rounds + 1):
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
        check()
        if i:
            times.append(seconds)
    return statistics.median(times)


def copy_bound(numel: int, device: torch.device, dtype: torch.dtype, rounds: int) -> float:
    src = torch.ones(numel, dtype=dtype, device=device)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)
        _sync(device)

    return timed(copy, rounds)


def host_staging_bound(numel: int, device: torch.device, dtype: torch.dtype, rounds: int) -> float:
    """Device -> pinned host -> device of `numel` elements, in buckets of up to 256 MiB."""
    chunk = (256 << 20) // dtype.itemsize
    src = torch.ones(min(numel, chunk), dtype=dtype, device=device)
    dst = torch.empty_like(src)
    host = torch.empty(src.numel(), dtype=dtype, pin_memory=True)

    def stage() -> None:
        for start in range(0, numel, chunk):
            n = min(chunk, numel - start)
            host[:n].copy_(src[:n])
            dst[:n].copy_(host[:n])
        _sync(device)

    return timed(stage, rounds)


def measure(shape: tuple[int, ...], bucket_mb: float, rounds: int, device: torch.device) -> dict:
    dtype = torch.bfloat16
    shapes = model_tensors(shape)
    gen = torch.Generator(device=device).manual_seed(0)
    params = {
        n: torch.randn(s, generator=gen, device=device, dtype=dtype) for n, s in shapes.items()
    }
    numels = {name: tensor.numel() for name, tensor in params.items()}
    bucket_numel = max(int(bucket_mb * (1 << 20)) // dtype.itemsize, max(numels.values()))
    buckets = plan_buckets(numels, bucket_numel)
    slots = [torch.empty(bucket_numel, dtype=dtype, device=device) for _ in range(2)]
    if device.type == "cpu":  # shared with the receiver, as CUDA memory is by IPC
        for tensor in [*slots, *params.values()]:
            tensor.share_memory_()
    plan = gathered_plan(shapes, shape, bucket_mb)
    spec = GatheredSpec()
    writer = spec.open(plan, member=0)
    setup = Setup(shapes, buckets, slots, params, plan, writer.export())
    expected = checksum(params)
    context = mp.get_context("spawn")
    inbox, outbox = context.Queue(), context.Queue()
    process = context.Process(target=receiver, args=(inbox, outbox), daemon=True)
    process.start()
    try:
        inbox.put(setup)
        assert outbox.get(timeout=300) == "ready"
        results = {}
        senders = {
            "packed": send_packed,
            "direct": send_direct,
            "gathered": lambda setup, inbox, outbox: send_gathered(setup, writer, inbox, outbox),
        }
        for label, send in senders.items():

            def check(label=label) -> None:
                inbox.put(("checksum",))
                got = outbox.get()
                assert got == expected, f"{label}: the receiver holds {got}, not {expected}"

            results[label] = timed(lambda send=send: send(setup, inbox, outbox), rounds, check)
        inbox.put(("stop",))
        process.join(timeout=60)
    finally:
        if process.is_alive():
            process.kill()
        spec.with_exports([setup.export]).remove()  # the trainer end's slot files, on CPU
    total = sum(numels.values())
    results["copy"] = copy_bound(total, device, dtype, rounds)
    if device.type == "cuda":
        results["host"] = host_staging_bound(total, device, dtype, rounds)
        results["host_fp32"] = host_staging_bound(total, device, torch.float32, rounds)
    return {
        "bytes": total * dtype.itemsize,
        "buckets": len(buckets),
        "gathered_buckets": len(plan.buckets),
        "seconds": results,
    }


def table(r: dict) -> str:
    gb = r["bytes"] / 1e9
    copy = r["seconds"]["copy"]
    rows = [
        ("CUDA IPC, packed buckets (2 copies a byte)", "packed"),
        ("CUDA IPC, the sender's tensors (1 copy a byte)", "direct"),
        ("rl.sync.gathered, the product's transport (2 copies a byte)", "gathered"),
        ("bound: one device-to-device copy", "copy"),
        ("bound: device -> pinned host -> device, bf16", "host"),
        ("bound: the same in fp32 (today's path moves fp32 rows)", "host_fp32"),
    ]
    lines = ["| path | seconds | GB/s (bf16 bytes) | x copy bound |", "|---|---:|---:|---:|"]
    for label, key in rows:
        if key in r["seconds"]:
            s = r["seconds"][key]
            lines.append(f"| {label} | {s:.3g} | {gb / s:,.1f} | {s / copy:.2f} |")
    return "\n".join(lines)
