"""The policy trainer of one FSDP2 rank: log-probs, PPO/GRPO updates, weight export.

Data parallelism: every rank receives the same full `Batch` and works on its contiguous share
of rows (`rank_rows`). Every rank must issue the same sequence of FSDP forward/backward calls
(each one runs collectives), so micro-batch counts come from global sizes, and a rank that runs
out of rows runs a dummy row with zero loss weight instead of skipping a call.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import AutoTokenizer

from rl.config import Config
from rl.loss import loss_weights, policy_objective
from rl.types import Batch
from trainer.fsdp import LogProbModel, load_sharded
from trainer.hf_model import save_hf_atomic

# Metrics summed (token-weighted) over micro-batches and ranks, in this order.
_TOKEN_METRICS = ("pg_loss", "clip_frac", "entropy", "approx_kl_old", "kl_ref")


def rank_rows(num_rows: int, rank: int, world_size: int) -> slice:
    """Rows of a `num_rows` batch that `rank` owns: contiguous, sizes differ by at most one.

    The first `num_rows % world_size` ranks get one extra row, so concatenating the ranks'
    outputs in rank order restores the batch order. The driver uses this to reassemble.
    """
    base, extra = divmod(num_rows, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def _even_slices(num_rows: int, parts: int) -> list[slice]:
    """`num_rows` split into `parts` contiguous near-equal slices (as `rank_rows`)."""
    return [rank_rows(num_rows, i, parts) for i in range(parts)]


class PolicyTrainer:
    """One FSDP2 rank of the policy (and optional frozen reference). Plain class, no Ray."""

    def __init__(
        self, cfg: Config, rank: int, world_size: int, master_addr: str, master_port: int
    ) -> None:
        if cfg.rollout.temperature <= 0:
            raise ValueError(
                f"rollout.temperature={cfg.rollout.temperature}: trainer log-probs need a "
                "temperature > 0"
            )
        if cfg.trainer.micro_batch_size < 1:
            raise ValueError(f"trainer.micro_batch_size={cfg.trainer.micro_batch_size} < 1")
        if cfg.trainer.num_mini_batches < 1:
            raise ValueError(f"trainer.num_mini_batches={cfg.trainer.num_mini_batches} < 1")
        if cfg.trainer.num_epochs < 1:
            raise ValueError(f"trainer.num_epochs={cfg.trainer.num_epochs} < 1")
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        if torch.cuda.is_available():
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
            backend = "cpu:gloo,cuda:nccl"
        else:
            self.device = torch.device("cpu")
            torch.set_num_threads(cfg.trainer.num_threads)
            backend = "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
        )
        mesh = init_device_mesh(self.device.type, (world_size,))
        chunk = cfg.trainer.logprob_chunk_size
        self.policy = load_sharded(cfg.model, mesh, chunk, trainable=True)
        self.reference: LogProbModel | None = None
        if cfg.algorithm.kl_coef > 0:
            self.reference = load_sharded(cfg.model, mesh, chunk, trainable=False)
        self.optimizer = torch.optim.AdamW(
            self.policy.parameters(),
            lr=cfg.trainer.lr,
            betas=cfg.trainer.betas,
            weight_decay=cfg.trainer.weight_decay,
        )
        warmup = cfg.trainer.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
        )

    def _num_micro_batches(self, num_rows: int) -> int:
        """Forward calls for a `num_rows` batch: set by the rank with the most rows."""
        most_rows = math.ceil(num_rows / self.world_size)
        return max(1, math.ceil(most_rows / self.cfg.trainer.micro_batch_size))

    def _micro_batches(self, batch: Batch) -> Iterator[tuple[Batch, bool]]:
        """(micro-batch on device, is_real) for this rank's rows; the same count on every rank.

        A rank short of rows gets a dummy micro-batch (the batch's first row with an empty
        loss mask) so that it still takes part in every FSDP collective.
        """
        assert batch.num_sequences > 0, "empty batch"
        mine = rank_rows(batch.num_sequences, self.rank, self.world_size)
        size = self.cfg.trainer.micro_batch_size
        for i in range(self._num_micro_batches(batch.num_sequences)):
            start = mine.start + i * size
            stop = min(start + size, mine.stop)
            if start < stop:
                yield self._to_device(batch.select(slice(start, stop))), True
            else:
                row = batch.select(slice(0, 1))
                dummy = dataclasses.replace(row, loss_mask=torch.zeros_like(row.loss_mask))
                yield self._to_device(dummy), False

    def _to_device(self, batch: Batch) -> Batch:
        moved = {
            f.name: None if (t := getattr(batch, f.name)) is None else t.to(self.device)
            for f in dataclasses.fields(batch)
        }
        return Batch(**moved)

    def _forward(self, model: LogProbModel, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return model(batch.input_ids, batch.attention_mask, self.cfg.rollout.temperature)

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch, model: str = "policy") -> torch.Tensor:
        """Log-probs [B_rank, T-1] (fp32, CPU) of this rank's rows (`rank_rows`) of `batch`.

        `model` is "policy" or "reference". At temperature rollout.temperature. Collective:
        every rank must call it with the same batch.
        """
        if model == "policy":
            module = self.policy
        elif model == "reference" and self.reference is not None:
            module = self.reference
        else:
            raise ValueError(f"no {model!r} model (a reference exists when algorithm.kl_coef > 0)")
        outputs = []
        for micro, real in self._micro_batches(batch):
            logprob = self._forward(module, micro)[0]  # dummies run too: collectives
            if real:
                outputs.append(logprob.cpu())
        # The FSDP root keeps its parameters unsharded after forward (for backward); free them.
        module.reshard()
        steps = batch.input_ids.shape[1] - 1
        return torch.cat(outputs) if outputs else torch.empty(0, steps)

    def accumulate_gradients(self, batch: Batch) -> dict[str, float]:
        """Forward/backward of one mini-batch (this rank's rows), summing gradients into .grad.

        The loss is normalised by the global weight sum of the whole mini-batch, so after every
        rank has run, the sharded gradients equal those of one process on the full `batch`.
        FSDP2 reduce-scatters gradients with ReduceOp.AVG (divides by the world size) for
        fp32/bf16; we want the SUM of the ranks' partial gradients, so each rank's loss is
        scaled by world_size before backward (this works for gloo and nccl alike, whereas a
        custom divide factor needs PREMUL_SUM, which gloo lacks).

        Returns global metrics: `loss` (the objective), token-weighted means of the policy
        metrics, and `tokens` (the loss-mask count they are weighted by).
        """
        algo = self.cfg.algorithm
        mine = batch.select(rank_rows(batch.num_sequences, self.rank, self.world_size))
        denominator = loss_weights(algo, mine.loss_mask.to(self.device)).sum().reshape(1)
        dist.all_reduce(denominator)
        denominator = denominator.item() if denominator.item() > 0 else 1.0  # empty: loss is 0
        sums = torch.zeros(len(_TOKEN_METRICS) + 2, device=self.device)  # + loss, tokens
        for micro, _ in self._micro_batches(batch):
            logprob, entropy = self._forward(self.policy, micro)
            loss, metrics = policy_objective(algo, logprob, entropy, micro, denominator)
            (loss * self.world_size).backward()
            tokens = micro.loss_mask.sum()
            for i, name in enumerate(_TOKEN_METRICS):
                if name in metrics:
                    sums[i] += metrics[name] * tokens
            sums[-2] += loss.detach()
            sums[-1] += tokens
        dist.all_reduce(sums)
        tokens = sums[-1].clamp(min=1.0)
        out = {name: (sums[i] / tokens).item() for i, name in enumerate(_TOKEN_METRICS)}
        if algo.kl_coef <= 0:
            del out["kl_ref"]
        out.update(loss=sums[-2].item(), tokens=sums[-1].item())
        return out

    def _optimizer_step(self) -> tuple[float, float]:
        """Clip, step, zero grads. Returns (pre-clip global grad norm, lr used)."""
        params = [p for p in self.policy.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(grad_norm, DTensor):  # partial norms of the shards -> the global norm
            grad_norm = grad_norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, self.cfg.trainer.max_grad_norm, grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm.item(), lr

    def train_step(self, batch: Batch) -> dict[str, float]:
        """trainer.num_epochs passes over `batch`, trainer.num_mini_batches optimizer steps each.

        Mini-batches are contiguous row ranges of the batch, in order. Returns global metrics:
        actor/* are token-weighted means over the whole step (actor/loss and actor/grad_norm are
        means over optimizer steps, actor/lr the last lr used), plus timing/*.
        """
        num_mini = self.cfg.trainer.num_mini_batches
        if num_mini > batch.num_sequences:
            raise ValueError(
                f"trainer.num_mini_batches={num_mini} exceeds the {batch.num_sequences} "
                "sequences in the batch"
            )
        start = time.perf_counter()
        totals = dict.fromkeys(_TOKEN_METRICS, 0.0)
        loss_sum = grad_norm_sum = tokens = 0.0
        steps = 0
        for _ in range(self.cfg.trainer.num_epochs):
            for rows in _even_slices(batch.num_sequences, num_mini):
                metrics = self.accumulate_gradients(batch.select(rows))
                grad_norm, lr = self._optimizer_step()
                for name in totals:
                    totals[name] += metrics.get(name, 0.0) * metrics["tokens"]
                loss_sum += metrics["loss"]
                grad_norm_sum += grad_norm
                tokens += metrics["tokens"]
                steps += 1
        seconds = time.perf_counter() - start
        out = {f"actor/{name}": value / max(tokens, 1.0) for name, value in totals.items()}
        if self.cfg.algorithm.kl_coef <= 0:
            del out["actor/kl_ref"]
        real_tokens = batch.attention_mask.sum().item() * self.cfg.trainer.num_epochs
        out.update(
            {
                "actor/loss": loss_sum / steps,
                "actor/grad_norm": grad_norm_sum / steps,
                "actor/lr": lr,
                "timing/train_step_s": seconds,
                "timing/train_tokens_per_s": real_tokens / seconds,
            }
        )
        return out

    def weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full parameters in HF checkpoint names, grouped into buckets of ~bucket_bytes.

        Collective: every rank must exhaust the iterator (each parameter is all-gathered).
        Rank 0 yields lists of (name, full fp32 CPU tensor); other ranks yield empty lists at
        the same points. At most one bucket (plus one parameter) is materialised at a time.
        Tied parameters are yielded under every name: with tie_word_embeddings that includes
        `lm_head.weight`, because vLLM on CPU keeps its own lm_head copy.
        """
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        gathered: dict[int, torch.Tensor] = {}  # id(param) -> full tensor, for tied names
        for name, param in self.policy.model.named_parameters(remove_duplicate=False):
            nbytes = param.numel() * 4  # shipped as fp32
            if size and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size, gathered = [], 0, {}
            full = gathered.get(id(param))
            if full is None:
                data = param.detach()
                full = data.full_tensor() if isinstance(data, DTensor) else data
                full = full.to("cpu", torch.float32) if self.rank == 0 else full[:0]
                gathered[id(param)] = full
            if self.rank == 0:
                bucket.append((name, full))
            size += nbytes
        if size:
            yield bucket

    def export_hf(self, out_dir: str) -> None:
        """Write the policy as an HF checkpoint (safetensors, config, tokenizer) to `out_dir`.

        Collective: the full state dict is gathered to rank 0's CPU; rank 0 writes atomically.
        """
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.policy.model, options=options)
        if self.rank == 0:
            tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.path)
            save_hf_atomic(self.policy.model, tokenizer, out_dir, state_dict=state)
        dist.barrier()

    def parameter_checksum(self) -> float:
        """Sum of squares of all policy parameters (global, fp64): a cheap did-it-change probe."""
        local = sum(
            (p.to_local() if isinstance(p, DTensor) else p).detach().double().square().sum()
            for p in self.policy.parameters()
        )
        total = torch.as_tensor(local, dtype=torch.float64, device=self.device).reshape(1)
        dist.all_reduce(total)
        return total.item()

    def close(self) -> None:
        """Leave the process group (the last call on this object)."""
        dist.destroy_process_group()
