"""The policy trainer of one FSDP2 rank: log-probs, PPO/GRPO updates, weight export.

Data parallelism, micro-batching with dummy rows and the optimizer step: see `trainer.ranks`.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl.config import Config
from rl.sync.plan import AttentionShape, TensorSpec, WeightSyncPlan
from rl.sync.transport import ChannelSpec
from rl.types import Batch, PolicyObjective
from trainer.fsdp import (
    LogProbModel,
    adapter_dropout,
    load_sharded,
    num_replicas,
    reshard,
    with_lora,
)
from trainer.hf_model import save_hf_atomic, save_lora_hf_atomic
from trainer.loss_scale import loss_multiplier, loss_scale_for
from trainer.moe import MoEMiniBatch
from trainer.offload import DeviceResidency
from trainer.rank_local_load import LORA_ADAPTERS
from trainer.ranks import (
    RoleRank,
    StepResult,
    adamw_with_warmup,
    check_batching,
    gather_rows,
    init_rank,
    mini_batch_slices,
    optimizer_step,
    peak_memory_mb,
    reset_peak_memory,
)
from trainer.sequence_parallel import join
from trainer.weight_sender import WeightSender, attention_shape, trained_tensors

# Metrics summed (token-weighted) over micro-batches and ranks, in this order.
_TOKEN_METRICS = (
    "pg_loss",
    "clip_frac",
    "entropy",
    "approx_kl_old",
    "kl_ref",
    "is_weight",
    "mismatch_k1",
    "mismatch_k3",
)
# Counts a streamed step adds up over its chunks (PolicyTrainer.step_accumulated).
_SUMMED = ("tokens", "trained_tokens", "skipped_rows", "rows")
# A streamed step's gradient sum (PolicyTrainer.accumulate_chunk), in units of
# 1/_FIXED_POINT_UNIT of the gradient of the loss summed over tokens and divided by the step's
# nominal number of sequences: per sequence, so its size does not grow with the step's, and
# room up to _FIXED_POINT_RANGE (an int64's, with headroom for the sum of a step's chunks).
_FIXED_POINT_UNIT = 2.0**32
_FIXED_POINT_RANGE = 2.0**62


def _mean_moe_metrics(metrics: list[dict[str, float]]) -> dict[str, float]:
    """A mixture of experts' moe/* metrics (trainer.moe) of several mini-batches or chunks:
    each one's mean over them."""
    names = [name for name in (metrics[0] if metrics else ()) if name.startswith("moe/")]
    return {name: sum(m[name] for m in metrics) / len(metrics) for name in names}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly) sharded tensor, as a view: writes go to the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _rows_to_train(batch: Batch) -> torch.Tensor:
    """Indices of the rows with a gradient (`trainer.skip_zero_advantage_rows`), or the first
    row when none has one: its zero gradients still step AdamW, whose moments then decay and
    move the parameters as after the full batch (a missing gradient would skip them)."""
    rows = batch.rows_with_advantage()
    return rows if len(rows) else torch.zeros(1, dtype=torch.long)


class PolicyTrainer(RoleRank):
    """One FSDP2 rank of the policy (and optional frozen reference). Plain class, no Ray."""

    def __init__(
        self,
        cfg: Config,
        objective: PolicyObjective,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
    ) -> None:
        """`objective` is the loss to minimise (the driver's `rl.algorithms.objective`)."""
        assert cfg.rollout.temperature > 0, "recipe checks refuse rollout.temperature <= 0"
        check_batching(cfg.trainer)
        assert (
            not cfg.trainer.skip_zero_advantage_rows or objective.zero_advantage_rows_are_inert
        ), "recipe checks refuse skip_zero_advantage_rows with a KL or entropy loss term"
        self.cfg, self.objective = cfg, objective
        self.rank, self.world_size = rank, world_size
        self.device, mesh = init_rank(rank, world_size, master_addr, master_port, cfg.trainer)
        self.num_replicas = num_replicas(mesh)
        sp = join(self.device.type, world_size, cfg.trainer.sequence_parallel)
        # Whether this rank reports per-row results and metrics: under sequence parallelism,
        # its group's ranks hold the same ones and the first reports them.
        self.counts_rows = sp is None or sp.counts_rows
        self.policy = load_sharded(
            cfg.model, cfg.trainer, mesh, trainable=True, seed=cfg.run.seed, sequence_parallel=sp
        )
        self.reference: LogProbModel | None = None
        # With LoRA the reference is the policy with its adapters disabled: no second model.
        if cfg.algorithm.kl_coef > 0 and not cfg.model.lora.enabled:
            self.reference = load_sharded(
                cfg.model, cfg.trainer, mesh, trainable=False, sequence_parallel=sp
            )
        self.sender: WeightSender | None = None  # set by open_weight_sender
        # Per bucket, a host copy of the rows last sent with the model's own weights
        # (SchedulerConfig.keeps_pushed_weights): the version the rollout serves.
        self.pushed_rows: dict[int, dict[str, torch.Tensor]] = {}
        self.loss_scale = loss_scale_for(cfg.model.dtype)
        self.optimizer, self.scheduler = adamw_with_warmup(
            [p for p in self.policy.parameters() if p.requires_grad],
            cfg.trainer.lr,
            cfg.trainer.betas,
            cfg.trainer.weight_decay,
            cfg.trainer.warmup_steps,
        )
        frozen = [] if self.reference is None else [self.reference]
        self.residency = DeviceResidency(
            self.device, [self.policy, *frozen], self.optimizer, cfg.trainer.offload
        )
        # scheduler.streaming (accumulate_chunk): the metrics of the chunks accumulated since
        # the last optimizer step by first group id, the seconds they took, the gradient
        # shards' fixed-point sum (8 bytes a parameter of this rank's shards, kept between
        # steps) and whether a chunk's gradient fell out of its range.
        self._accumulated: dict[int, dict[str, float]] = {}
        self._accumulated_s = 0.0
        self._fixed: dict[nn.Parameter, torch.Tensor] = {}
        self._nominal_sequences = float(cfg.run.prompts_per_step * cfg.algorithm.group_size)
        self._overflow = torch.zeros((), dtype=torch.bool, device=self.device)

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch, model: str = "policy") -> torch.Tensor:
        """Log-probs [B, T-1] (fp32, CPU) of `batch`, 0 at padding; the same on every rank.

        `model` is "policy" or "reference". At temperature rollout.temperature. Collective:
        every rank must call it with the same batch; each computes its own rows.
        """
        adapters = contextlib.nullcontext()
        if model == "policy":
            module = self.policy
        elif model == "reference" and self.reference is not None:
            module = self.reference
        elif model == "reference" and self.cfg.model.lora.enabled:
            module, adapters = self.policy, self.policy.model.disable_adapter()
        else:
            raise ValueError(f"no {model!r} model (a reference exists when algorithm.kl_coef > 0)")
        self.residency.ensure_on_device()
        pieces = []
        temperature = self.cfg.rollout.temperature
        with adapters:
            for _, inputs, rows in self._micro_batches(batch):
                logprob = module(inputs, temperature)[0]  # dummies run too: collectives
                if rows is not None and self.counts_rows:
                    pieces.append((rows, logprob))
        reshard(module)  # no backward follows to free the gathered parameters
        return gather_rows(pieces, batch, self.device)

    def accumulate_gradients(
        self, batch: Batch, denominator: float | None = None
    ) -> dict[str, float]:
        """Forward/backward of one mini-batch (this rank's rows), summing gradients into .grad.

        The loss is normalised by the global weight sum of the whole mini-batch (or by
        `denominator`: a streamed chunk's scale, its step dividing by its own at the end), so
        after every rank has run, the sharded gradients equal those of one process on the full
        `batch`.
        FSDP2 reduce-scatters gradients with ReduceOp.AVG (divides by the world size) for
        fp32/bf16; we want the SUM of the ranks' partial gradients, so each rank's loss is
        scaled by world_size before backward (this works for gloo and nccl alike, whereas a
        custom divide factor needs PREMUL_SUM, which gloo lacks).

        With trainer.skip_zero_advantage_rows, only the rows with a non-zero advantage run
        (the loss keeps the whole mini-batch's denominator, so the gradient is the same).

        Returns global metrics: `loss` (the objective), token-weighted means of the policy
        metrics over the rows run, `tokens` (the loss-mask count they are weighted by),
        `trained_tokens` (prompt and response tokens run) and `skipped_rows`.
        """
        # Every rank holds the whole mini-batch: the global denominator needs no collective.
        if denominator is None:
            denominator = self.objective.token_count(batch)
            denominator = denominator if denominator > 0 else 1.0  # empty: the loss is 0
        num_rows = batch.num_sequences
        if self.cfg.trainer.skip_zero_advantage_rows:
            batch = batch.select(_rows_to_train(batch))
        sums = torch.zeros(len(_TOKEN_METRICS) + 2, device=self.device)  # + loss, tokens
        temperature = self.cfg.rollout.temperature
        moe = None
        if self.policy.routing is not None:
            num_tokens = int(batch.attention_mask.sum())
            moe = MoEMiniBatch(
                self.policy.routing, self.objective, num_tokens, self.device, self.counts_rows
            )
        for micro, inputs, _ in self._micro_batches(batch):
            with adapter_dropout(self.policy):
                logprob, entropy = self.policy(inputs, temperature)
                loss, metrics = self.objective.loss(logprob, entropy, micro, denominator)
                if moe is not None:
                    loss = loss + moe.add(inputs)
                (loss * self.world_size * loss_multiplier(self.loss_scale)).backward()
            tokens = micro.loss_mask.sum()
            for i, name in enumerate(_TOKEN_METRICS):
                if name in metrics:
                    sums[i] += metrics[name] * tokens
            sums[-2] += loss.detach()
            sums[-1] += tokens
        if not self.counts_rows:
            sums.zero_()
        dist.all_reduce(sums)
        tokens = sums[-1].clamp(min=1.0)
        # One read from the device for every metric (each read waits for the queued work).
        *means, loss_sum, token_sum = torch.cat([sums[:-2] / tokens, sums[-2:]]).tolist()
        out = dict(zip(_TOKEN_METRICS, means, strict=True))
        if not self.objective.kl_in_loss:
            del out["kl_ref"]
        if batch.is_weights is None and self.objective.forward_correction is None:
            del out["is_weight"]
        if self.objective.forward_correction is None:
            del out["mismatch_k1"], out["mismatch_k3"]
        out.update(
            loss=loss_sum,
            tokens=token_sum,
            trained_tokens=batch.attention_mask.sum().item(),
            skipped_rows=float(num_rows - batch.num_sequences),
        )
        if moe is not None:
            out |= moe.metrics()
        return out

    def _optimizer_step(self, loss: float) -> StepResult:
        """Unscale, clip, step, zero grads; skipped when `loss` or the grad norm is NaN/inf
        (`trainer.ranks.optimizer_step`)."""
        return optimizer_step(
            self.policy,
            self.optimizer,
            self.scheduler,
            self.cfg.trainer.max_grad_norm,
            loss=loss,
            loss_scale=self.loss_scale,
        )

    def train_step(self, batch: Batch) -> dict[str, float]:
        """trainer.num_epochs passes over `batch`, trainer.num_mini_batches optimizer steps each.

        Mini-batches are contiguous row ranges of the batch, in order. An optimizer step whose
        loss or gradient norm is NaN/inf is skipped (nothing changes but the zeroed grads).
        Returns global metrics: actor/nonfinite_skipped is the number of skipped steps; with
        trainer.skip_zero_advantage_rows, actor/skipped_row_frac is the share of rows left out
        of forward and backward; the other actor/* describe the steps taken only (a skipped
        step's metrics are typically NaN and describe no update): token-weighted means over their tokens, actor/loss and
        actor/grad_norm means over them, all NaN when every step was skipped; actor/lr is the
        lr of the last step (for a skipped one, the lr the next step will use). Plus timing/*,
        and memory/trainer_peak_mb, the largest rank's peak during the step.
        """
        mini_batches = mini_batch_slices(batch.num_sequences, self.cfg.trainer.num_mini_batches)
        self.residency.ensure_on_device()
        reset_peak_memory(self.device)
        start = time.perf_counter()
        updates = []
        for _ in range(self.cfg.trainer.num_epochs):
            for rows in mini_batches:
                metrics = self.accumulate_gradients(batch.select(rows))
                updates.append((metrics, self._optimizer_step(metrics["loss"])))
        rows_run = batch.num_sequences * self.cfg.trainer.num_epochs
        return self._report(updates, rows_run, time.perf_counter() - start)

    def accumulate_chunk(self, batch: Batch, key: int) -> None:
        """scheduler.streaming: forward/backward of one chunk of the step's groups (a batch of
        its own, annotated), its loss summed over tokens and divided by the step's nominal
        number of sequences (`step_accumulated` divides by the real denominator), its gradient
        added to the step's in fixed point.

        Chunks arrive in the order they complete, which timing decides, and a float sum
        depends on its order; an integer sum does not. So each chunk's gradient (fixed by the
        chunk alone: its micro-batches never span two chunks) is rounded to a multiple of
        1/_FIXED_POINT_UNIT and added to an int64 copy of the gradient shards, and metrics
        are kept under `key` (the chunk's first group id) and summed in key order: the step is
        the same bits whatever order the chunks came in. It equals train_step's on the whole
        batch up to that rounding and fp32's (test_streamed_step)."""
        assert key not in self._accumulated, f"chunk {key} accumulated twice"
        if not self._accumulated:
            self.residency.ensure_on_device()
            reset_peak_memory(self.device)
        start = time.perf_counter()
        metrics = self.accumulate_gradients(batch, denominator=self._nominal_sequences)
        metrics.update(denominator=self.objective.token_count(batch), rows=batch.num_sequences)
        self._accumulated[key] = metrics
        with torch.no_grad():
            for param in self.policy.parameters():
                if param.grad is None:
                    continue
                grad = _local(param.grad)
                scaled = grad.double() * _FIXED_POINT_UNIT  # exact: a power of two
                # Out of range (or not finite): the step is skipped as a non-finite one.
                self._overflow |= ~(scaled.abs() < _FIXED_POINT_RANGE).all()
                fixed = self._fixed.get(param)
                if fixed is None:
                    fixed = self._fixed[param] = torch.zeros_like(grad, dtype=torch.int64)
                fixed += scaled.clamp(-_FIXED_POINT_RANGE, _FIXED_POINT_RANGE).round().long()
                grad.zero_()  # the next chunk's backward adds to 0: its gradient alone
        self._accumulated_s += time.perf_counter() - start

    def step_accumulated(self) -> dict[str, float]:
        """The optimizer step over the chunks `accumulate_chunk` took since the last step
        (at least one): the fixed-point sum divided by the step's loss denominator, then as a
        train_step of one mini-batch; returns train_step's metrics."""
        assert self._accumulated, "an optimizer step with no chunk accumulated"
        start = time.perf_counter()
        chunks = [self._accumulated[key] for key in sorted(self._accumulated)]
        self._accumulated = {}
        denominator = sum(chunk["denominator"] for chunk in chunks)
        denominator = denominator if denominator > 0 else 1.0  # empty: the loss is 0
        overflow = bool(self._overflow.item())
        rescale = self._nominal_sequences / denominator
        with torch.no_grad():
            for param, fixed in self._fixed.items():
                grad = _local(param.grad)
                if overflow:  # every rank's grad norm is then NaN: all of them skip the step
                    grad.fill_(math.nan)
                else:
                    grad.copy_(fixed.double() / _FIXED_POINT_UNIT * rescale)
                fixed.zero_()
        self._overflow.zero_()
        tokens = sum(chunk["tokens"] for chunk in chunks)
        merged = {
            name: sum(chunk[name] * chunk["tokens"] for chunk in chunks) / max(tokens, 1.0)
            for name in _TOKEN_METRICS
            if name in chunks[0]
        }
        merged |= _mean_moe_metrics(chunks)
        merged.update(
            loss=sum(chunk["loss"] for chunk in chunks) * rescale,
            **{key: sum(chunk[key] for chunk in chunks) for key in _SUMMED},
        )
        update = (merged, self._optimizer_step(merged["loss"]))
        seconds, self._accumulated_s = self._accumulated_s + time.perf_counter() - start, 0.0
        return self._report([update], int(merged["rows"]), seconds)

    def _report(
        self, updates: list[tuple[dict[str, float], StepResult]], rows_run: int, seconds: float
    ) -> dict[str, float]:
        """train_step's metrics of its (accumulated metrics, optimizer step) pairs."""
        totals = dict.fromkeys(_TOKEN_METRICS, 0.0)
        loss_sum = grad_norm_sum = tokens = 0.0
        taken = [(metrics, step) for metrics, step in updates if not step.skipped]
        for metrics, step in taken:
            for name in totals:
                totals[name] += metrics.get(name, 0.0) * metrics["tokens"]
            loss_sum += metrics["loss"]
            grad_norm_sum += step.grad_norm
            tokens += metrics["tokens"]
        out = {f"actor/{name}": value / max(tokens, 1.0) for name, value in totals.items()}
        for name in _TOKEN_METRICS:  # which metrics this config reports
            if all(name not in metrics for metrics, _ in updates):
                del out[f"actor/{name}"]
        out.update(
            {
                "actor/loss": loss_sum / max(len(taken), 1),
                "actor/grad_norm": grad_norm_sum / max(len(taken), 1),
            }
        )
        out |= _mean_moe_metrics([metrics for metrics, _ in taken])
        if not taken:  # no update to describe (MetricsLogger writes NaN as null)
            out = dict.fromkeys(out, math.nan)
        if self.cfg.trainer.skip_zero_advantage_rows:
            skipped = sum(metrics["skipped_rows"] for metrics, _ in updates)
            out["actor/skipped_row_frac"] = skipped / rows_run
        real_tokens = sum(metrics["trained_tokens"] for metrics, _ in updates)
        out.update(
            {
                "actor/nonfinite_skipped": float(len(updates) - len(taken)),
                "actor/lr": updates[-1][1].lr,
                **({} if self.loss_scale is None else {"actor/loss_scale": self.loss_scale.scale}),
                "timing/train_step_s": seconds,
                "timing/train_tokens_per_s": real_tokens / seconds,
                "memory/trainer_peak_mb": peak_memory_mb(self.device),
            }
        )
        return out

    def weight_sync_spec(self) -> tuple[list[TensorSpec], AttentionShape]:
        """What the transfer plan needs: the tensors a sync sends and the attention sizes."""
        model = self.policy.model
        return trained_tensors(model), attention_shape(model.config)

    def num_model_params(self) -> int:
        """Parameters of the policy as a plain HF model: LoRA adapters left out, tied ones
        once (what a sync of the whole model would send)."""
        return sum(
            p.numel()
            for name, p in self.policy.model.named_parameters()
            if not any(adapter in name for adapter in LORA_ADAPTERS)
        )

    def open_weight_sender(self, plan: WeightSyncPlan, channel_spec: ChannelSpec) -> object | None:
        """Join the weight-sync channel `channel_spec` for `plan`; returns what the readers
        need of this rank's end (`WeightSender.export`)."""
        self.sender = WeightSender(self.policy.model, plan, self.rank, channel_spec)
        return self.sender.export()

    def write_weight_bucket(
        self, bucket: int, replicas: list[int] | None = None, pushed: bool = False
    ) -> dict[str, float]:
        """Send this rank's rows of `bucket` to rollout engines `replicas` (None: all; see
        `WeightSender.write`): the model's own, or (`pushed`) the copy kept when they were
        last sent, while the model has trained on since. Not collective."""
        if pushed:
            return self.sender.write(bucket, self.pushed_rows[bucket], replicas)
        if bucket == 0:
            self.residency.ensure_on_device()
            reshard(self.policy)  # the sender reads the shards
        rows = self.sender.rows(bucket)
        if self.cfg.scheduler.keeps_pushed_weights:
            # In the wire dtype: what the rollout holds, at no more memory than needed.
            wire = getattr(torch, self.sender.plan.wire_dtype)
            self.pushed_rows[bucket] = {
                name: tensor.to("cpu", wire, copy=True) for name, tensor in rows.items()
            }
        return self.sender.write(bucket, rows, replicas)

    def export_hf(self, out_dir: str) -> None:
        """Write the policy as an HF checkpoint (safetensors, config, tokenizer) to `out_dir`;
        with LoRA, the base with the adapters merged in and the adapters alone
        (`save_lora_hf_atomic`).

        Collective: the full state dict is gathered to rank 0's CPU; rank 0 writes atomically.
        """
        self.residency.ensure_on_device()
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.policy.model, options=options)
        if self.rank == 0:
            tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.path)
            if self.cfg.model.lora.enabled:  # merged, and the adapters alone beside
                base = AutoModelForCausalLM.from_pretrained(
                    self.cfg.model.path, dtype=torch.float32
                )
                peft_model = with_lora(base, self.cfg.model.lora, seed=0)
                peft_model.load_state_dict(state, strict=True)
                save_lora_hf_atomic(peft_model, tokenizer, out_dir)
            else:
                save_hf_atomic(self.policy.model, tokenizer, out_dir, state_dict=state)
        dist.barrier()

    def _trained(self) -> nn.Module:
        return self.policy

    def _checkpointed(self) -> tuple:
        """The HF model inside the root, as the checkpoint names it, and its state."""
        return self.policy.model, self.optimizer, self.scheduler, self.loss_scale

    def parameter_checksum(self) -> float:
        """Sum of squares of all policy parameters (global, fp64): a cheap did-it-change probe.
        Each shard is held by `num_replicas` ranks (hybrid, none): counted once."""
        self.residency.ensure_on_device()
        local = sum(_local(p).detach().double().square().sum() for p in self.policy.parameters())
        total = torch.as_tensor(local, dtype=torch.float64, device=self.device).reshape(1)
        dist.all_reduce(total)
        return total.item() / self.num_replicas
