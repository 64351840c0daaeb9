"""A rollout engine in plain PyTorch for tiny models on CPU (`rollout.engine: torch`).

vLLM's scheduler, sampler and output processing cost a fixed time an engine step whatever the
model, which is most of a step for a ~1M-parameter model (docs/benchmarks.md). This engine
runs the HF model itself over a KV cache: each `start` call's samples form one cohort, left
padded and prefilled together, then decoded one token per step; rows that finish leave the
cache. It keeps VLLMEngine's contract: the same seeds per sample, behaviour log-probs after
temperature and top-p, EOS kept in the response, partial samples on abort, weights replaced in
place bucket by bucket. It runs on CPU, without tensor parallelism.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from kernels.attention import ATTENTION
from rl.config import LoraConfig, RolloutConfig
from rl.expert_routing import ExpertRouting, record_dtype
from rl.observe.memory import peak_rss_bytes, reset_peak_rss, rss_bytes, take_peak_memory_bytes
from rl.sync.plan import WeightSyncPlan, plan_from_json
from rl.sync.transport import Channel, ChannelSpec, open_channel
from rl.types import Sample, SamplingParams
from rollout.engines.contract import check_scorable, check_startable, decode_responses

logger = logging.getLogger(__name__)


@dataclass
class _Cohort:
    """Samples decoded together over one KV cache; row i of every tensor is samples[i]."""

    samples: list[Sample]
    params: SamplingParams
    generators: list[torch.Generator] | None  # one per sample when seeded
    stop_lengths: list[int]  # per sample: the response length it stops at (params.stop_length)
    cache: DynamicCache | None = None  # None until prefilled
    attention_mask: torch.Tensor | None = None  # [B, cached positions], 0 on left padding
    next_positions: torch.Tensor | None = None  # [B] position id of the next token
    next_tokens: torch.Tensor | None = None  # [B] the last sampled tokens, fed next
    # Recording routing: per sample, its record in pieces ([positions, layers, k] each; the
    # record it came with first), joined into the sample when it leaves the cohort.
    routing: list[list[torch.Tensor]] | None = None

    def keep(self, rows: list[int]) -> None:
        """Drop every row not in `rows` (finished samples) from the cohort and its cache."""
        index = torch.tensor(rows, dtype=torch.long)
        self.samples = [self.samples[i] for i in rows]
        if self.routing is not None:
            self.routing = [self.routing[i] for i in rows]
        if self.generators is not None:
            self.generators = [self.generators[i] for i in rows]
        self.stop_lengths = [self.stop_lengths[i] for i in rows]
        self.cache.batch_select_indices(index)
        self.attention_mask = self.attention_mask[index]
        self.next_positions = self.next_positions[index]
        self.next_tokens = self.next_tokens[index]


@dataclass
class _Update:
    plan: WeightSyncPlan
    channel: Channel
    params: dict[str, torch.nn.Parameter]  # by HF name, each tied name included
    version: int | None = None  # set between the first bucket and finish
    base_rss: int = 0
    load_s: float = 0.0


class TorchEngine:
    """One HF model in this process, generating for many samples at once.

    `version` is the policy version of the weights it serves (0 = the checkpoint at
    `model_path`); `startup_seconds` is how long construction took.
    """

    def __init__(
        self,
        model_path: str,
        cfg: RolloutConfig,
        dtype: str,
        seed: int,
        lora: LoraConfig | None = None,
        record_routing: bool = False,
    ) -> None:
        start = time.perf_counter()
        if cfg.tensor_parallel_size != 1:
            raise ValueError(
                f"rollout.engine=torch runs one process per engine: set "
                f"rollout.tensor_parallel_size=1 (got {cfg.tensor_parallel_size})"
            )
        # Ray sets OMP_NUM_THREADS from the actor's CPUs; torch would otherwise use every core.
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        self._cfg = cfg
        self._model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=getattr(torch, dtype), attn_implementation=ATTENTION
        )
        if lora is not None and lora.enabled:
            # The trainer's adapters under the trainer's names, which a weight sync copies
            # into; B is zero until the first one, so version 0 is the base.
            from peft import get_peft_model

            self._model = get_peft_model(self._model, lora.peft_config())
        self._model.eval().requires_grad_(False)
        self._routing = None
        if record_routing:
            self._routing = ExpertRouting(self._model)
            if not self._routing.num_layers:
                raise ValueError(
                    f"model.routing_replay: {model_path} has no mixture-of-experts layers"
                )
            self._record_dtype = record_dtype(self._routing.num_experts)
        self._tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._eos = torch.tensor(sorted(_eos_ids(self._model, self._tokenizer)))
        self._generator = torch.Generator().manual_seed(seed)  # for unseeded sampling
        self._cohorts: list[_Cohort] = []
        self._update: _Update | None = None
        self.version = 0
        self.startup_seconds = time.perf_counter() - start
        logger.info("torch engine for %s ready in %.1f s", model_path, self.startup_seconds)

    @property
    def num_running(self) -> int:
        return sum(len(cohort.samples) for cohort in self._cohorts)

    def start(self, samples: list[Sample], params: SamplingParams) -> None:
        """Queue `samples` (fresh, or partial ones to resume) for the next step, which prefills
        each with its prompt plus the response so far. Seeds as VLLMEngine.start."""
        self._check_serving()
        check_startable(samples, params, self._cfg.max_model_len)
        if not samples:
            return
        for sample in samples:
            sample.finish_reason = ""
        generators = None
        if params.seed is not None:
            generators = [torch.Generator().manual_seed(params.seed_of(s)) for s in samples]
        stop_lengths = [params.stop_length(s) for s in samples]
        cohort = _Cohort(list(samples), params, generators, stop_lengths)
        if self._routing is not None:
            cohort.routing = [
                [] if s.routed_experts is None else [s.routed_experts] for s in samples
            ]
        self._cohorts.append(cohort)

    @torch.inference_mode()
    def step(self) -> list[Sample]:
        """One token for every running sample (each new cohort prefilled first); returns
        those that finished in this step."""
        finished: list[Sample] = []
        for cohort in self._cohorts:
            logits = self._forward(cohort)
            tokens, logprobs = _sample(logits, cohort.params, cohort.generators, self._generator)
            stopped = torch.isin(tokens, self._eos).tolist()
            rows = []
            for i, (sample, token, logprob) in enumerate(
                zip(cohort.samples, tokens.tolist(), logprobs.tolist(), strict=True)
            ):
                sample.response_ids.append(token)
                sample.logprobs.append(logprob)
                sample.token_versions.append(self.version)
                if stopped[i]:
                    sample.finish_reason = "stop"
                elif len(sample.response_ids) >= cohort.stop_lengths[i]:
                    sample.finish_reason = cohort.params.length_finish(sample)
                else:
                    rows.append(i)
                    continue
                finished.append(sample)
                if cohort.routing is not None:
                    _close_record(sample, cohort.routing[i])
            cohort.next_tokens = tokens
            if len(rows) < len(cohort.samples):
                cohort.keep(rows)
        self._cohorts = [cohort for cohort in self._cohorts if cohort.samples]
        decode_responses(self._tokenizer, finished)
        return finished

    def abort(self) -> list[Sample]:
        """Stop every running sample where it is (finish_reason "abort"); returns them."""
        aborted = [sample for cohort in self._cohorts for sample in cohort.samples]
        for cohort in self._cohorts:
            for sample, pieces in zip(cohort.samples, cohort.routing or [], strict=False):
                _close_record(sample, pieces)
        self._cohorts.clear()
        for sample in aborted:
            sample.finish_reason = "abort"
        decode_responses(self._tokenizer, aborted)
        return aborted

    def generate(self, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        """Generate `samples` to the end (see `start`); returns them, in order."""
        self.start(samples, params)
        while self.num_running:
            self.step()
        return samples

    @torch.inference_mode()
    def score(self, sequences: list[list[int]], num_prompt_tokens: list[int]) -> list[list[float]]:
        """Log-probs at temperature 1 of sequences[i][num_prompt_tokens[i]:], each given its prefix."""
        self._check_serving()
        self._check_idle("scoring")
        check_scorable(sequences, num_prompt_tokens, self._cfg.max_model_len)
        ids, mask = _left_padded(sequences)
        logits = self._model(
            input_ids=ids, attention_mask=mask, position_ids=_positions(mask)
        ).logits.float()
        logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        width = ids.shape[1]
        # Row i's token t sits at column width - len(seq) + t; its log-prob at that column - 1.
        return [
            logprobs[i, width - len(seq) + start - 1 : width - 1].tolist()
            for i, (seq, start) in enumerate(zip(sequences, num_prompt_tokens, strict=True))
        ]

    def open_weight_receiver(
        self, plan_json: str, channel_spec: ChannelSpec, first_member: int
    ) -> None:
        """Join the weight-sync channel `channel_spec` as member `first_member`."""
        plan = plan_from_json(plan_json)
        if plan.tp_size != 1:
            raise ValueError(f"transfer plan is for TP={plan.tp_size}, the torch engine runs TP=1")
        # Tied weights appear under each of their names; copying into either updates both.
        params = dict(self._model.named_parameters(remove_duplicate=False))
        channel = open_channel(plan, channel_spec, member=first_member)
        # Re-opened mid-update (the group re-formed after a member was lost), the engine still
        # holds a partly applied update and must not serve until a whole one lands.
        partly_applied = None if self._update is None else self._update.version
        self._update = _Update(plan, channel, params, version=partly_applied)

    @torch.no_grad()
    def apply_weight_bucket(self, bucket: int, version: int) -> int:
        """Copy bucket `bucket` of `version` into the model's parameters (buckets in order from
        0); returns the bytes read. Until `finish_weight_update` the engine refuses to serve."""
        self._check_idle("a weight update")
        update = self._update
        assert update is not None, "open_weight_receiver first"
        if bucket == 0:
            update.base_rss, update.load_s = rss_bytes(), 0.0
            reset_peak_rss()
        update.version = version
        start = time.perf_counter()
        for name, tensor in update.channel.read(bucket):
            if name not in update.params:
                raise ValueError(f"weight update names {name!r}, which this model does not have")
            update.params[name].copy_(tensor)
        update.load_s += time.perf_counter() - start
        return update.plan.bucket_bytes_to_rank(bucket, 0)

    def finish_weight_update(self, version: int) -> dict[str, float]:
        """Serve `version`; returns the update's peak extra resident bytes and copy seconds."""
        update = self._update
        if update is None or update.version != version:
            raise RuntimeError(f"finish_weight_update({version}) without its buckets")
        update.version = None
        self.version = version
        return {
            "peak_extra_bytes": float(max(peak_rss_bytes() - update.base_rss, 0)),
            "load_s": update.load_s,
        }

    def release_memory(self) -> bool:
        """Nothing to hand over: the engine runs on CPU (see VLLMEngine.release_memory)."""
        return False

    def reclaim_weights(self) -> None:
        """Nothing was released."""

    def reclaim_memory(self) -> None:
        """Nothing was released."""

    def take_peak_memory_bytes(self) -> int:
        return take_peak_memory_bytes()

    def close(self) -> None:
        """Nothing to stop: the model lives in this process."""

    def _forward(self, cohort: _Cohort) -> torch.Tensor:
        """The next-token logits of each row of `cohort`: [B, vocab] float."""
        if cohort.cache is None:
            return self._prefill(cohort)
        ids = cohort.next_tokens[:, None]
        mask = torch.cat([cohort.attention_mask, torch.ones_like(ids)], dim=1)
        positions = cohort.next_positions[:, None]
        cohort.next_positions = cohort.next_positions + 1
        cohort.attention_mask = mask
        logits = self._logits(ids, mask, positions, cohort.cache)
        if cohort.routing is not None:  # each row ran one position: the token it sampled last
            for pieces, experts in zip(cohort.routing, self._recorded(), strict=True):
                pieces.append(experts[None])
        return logits

    def _prefill(self, cohort: _Cohort) -> torch.Tensor:
        """`_forward` of a new cohort: each distinct prompt (plus response so far) runs once,
        and its cache rows are copied to every sample that holds it: a GRPO group's samples
        share their prompt, so the prefill costs one row per group, not one per sample."""
        rows: dict[tuple[int, ...], int] = {}  # distinct sequence -> its row in the prefill
        index = [
            rows.setdefault(tuple(s.prompt_ids + s.response_ids), len(rows)) for s in cohort.samples
        ]
        ids, mask = _left_padded([list(sequence) for sequence in rows])
        positions = _positions(mask)
        cohort.cache = DynamicCache(config=self._model.config)
        logits = self._logits(ids, mask, positions, cohort.cache)
        if cohort.routing is not None:
            # Row r ran its sequence's positions 0 .. n-1 in its last n columns; a sample keeps
            # the rows of the positions its record does not hold yet (a resumed sample's
            # earlier positions stay as the version that ran them first recorded them).
            recorded = self._recorded()
            experts = recorded.reshape(*ids.shape, *recorded.shape[1:])
            width = ids.shape[1]
            for sample, pieces, row in zip(cohort.samples, cohort.routing, index, strict=True):
                n = len(sample.prompt_ids) + len(sample.response_ids)
                held = sum(len(piece) for piece in pieces)
                pieces.append(experts[row, width - n + held :])
        index = torch.tensor(index, dtype=torch.long)
        cohort.cache.batch_select_indices(index)
        cohort.attention_mask = mask[index]
        cohort.next_positions = positions[index, -1] + 1
        return logits[index]

    def _logits(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        """The model's next-token logits [B, vocab] (float) after `ids`, extending `cache`."""
        output = self._model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return output.logits[:, -1].float()

    def _recorded(self) -> torch.Tensor:
        """The experts the last forward routed each of its positions to: [N, layers, k]."""
        return self._routing.recorded().to(self._record_dtype)

    def _check_idle(self, what: str) -> None:
        if self._cohorts:
            raise RuntimeError(
                f"{self.num_running} samples are being generated: finish or abort them "
                f"before {what}"
            )

    def _check_serving(self) -> None:
        if self._update is not None and self._update.version is not None:
            raise RuntimeError(
                f"this rollout engine holds a partly applied weight update (version "
                f"{self._update.version} over {self.version}); it serves again after a "
                "complete sync"
            )


def _close_record(sample: Sample, pieces: list[torch.Tensor]) -> None:
    """Join a sample's routing record, as it leaves a cohort."""
    if pieces:
        sample.routed_experts = torch.cat(pieces)


def _eos_ids(model: torch.nn.Module, tokenizer: object) -> set[int]:
    """The tokens that end a response: the tokenizer's EOS and the generation config's (as
    vLLM stops on both)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    extra = model.generation_config.eos_token_id
    ids.update([extra] if isinstance(extra, int) else extra or [])
    if not ids:
        raise ValueError(f"{model.name_or_path} names no EOS token: set eos_token_id")
    return ids


def _left_padded(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequences right-aligned in one [B, longest] tensor of ids, and its attention mask."""
    width = max(len(seq) for seq in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, width - len(seq) :] = torch.tensor(seq)
        mask[i, width - len(seq) :] = 1
    return ids, mask


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 on each row's first real token: [B, T]."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def _sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generators: list[torch.Generator] | None,
    shared: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits` [B, V] and its log-prob after temperature and top-p (as
    vLLM's processed log-probs; greedy at temperature 0, with raw log-probs): [B], [B]."""
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    scaled = logits / params.temperature
    if params.top_p < 1:
        scaled = _top_p(scaled, params.top_p)
    logprobs = torch.log_softmax(scaled, -1)
    probs = logprobs.exp()
    if generators is None:
        tokens = torch.multinomial(probs, 1, generator=shared)[:, 0]
    else:
        tokens = torch.cat(
            [
                torch.multinomial(row, 1, generator=g)
                for row, g in zip(probs, generators, strict=True)
            ]
        )
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """`logits` [B, V] with every token outside each row's nucleus at -inf: the smallest set of
    most likely tokens whose probability reaches top_p (the most likely always stays)."""
    ordered, order = logits.sort(dim=-1, descending=True)
    probs = ordered.softmax(-1)
    before = probs.cumsum(-1) - probs  # the mass of the tokens likelier than each
    ordered = ordered.masked_fill(before >= top_p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
