"""In-process vLLM rollout engine: sampling with behaviour log-probs, scoring, in-place weights.

A plain class (no Ray): the `RolloutWorker` actor is a thin shell around it. vLLM reads much
of its configuration from the environment when it is imported, so `vllm` is imported inside
`VLLMEngine.__init__`, after `_configure_environment` has run.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from rl.config import LoraConfig, RolloutConfig
from rl.observe.memory import take_peak_memory_bytes
from rl.sync.transport import ChannelSpec
from rl.types import Sample, SamplingParams
from rollout.engines import vllm_shm
from rollout.engines.contract import check_scorable, check_startable, decode_responses
from rollout.engines.vllm_support import check_vllm
from rollout.weight_receiver import adapter_names

if TYPE_CHECKING:
    import vllm

logger = logging.getLogger(__name__)


def _configure_environment() -> int:
    """Set what vLLM reads at import time; returns the intra-op thread count to use."""
    # The engine core runs in this process (an actor already is one process per engine);
    # collective_rpc then hands tensors over by reference instead of serialising them.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # The KV cache is sized exactly by `kv_cache_memory_bytes`; this legacy variable only
    # takes whole GiB and, when set, silently overrides it.
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    # vLLM logs at INFO on every weight sync, which buries the driver's progress bar.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # Ray sets OMP_NUM_THREADS from the actor's CPUs (floor, at least 1). Set torch's count
    # before vLLM starts: left at its all-cores default, vLLM lowers it only later, and
    # generation runs several times slower on a shared 2-core machine.
    num_threads = int(os.environ.setdefault("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(num_threads)
    return num_threads


# The adapter ranks vLLM's engine can be built for (its LoRAConfig.max_lora_rank choices);
# an adapter of any rank up to the one chosen is served.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_args(lora: LoraConfig | None) -> dict:
    """vLLM's LoRA arguments for `lora`'s adapters: one adapter (the current policy version's)
    at a time, built for the smallest rank vLLM allows that holds `lora.rank`."""
    if lora is None or not lora.enabled:
        return {}
    rank = next(r for r in VLLM_LORA_RANKS if r >= lora.rank)  # checks cap lora.rank at 512
    return {"enable_lora": True, "max_loras": 1, "max_cpu_loras": 1, "max_lora_rank": rank}


def engine_args(
    model_path: str,
    cfg: RolloutConfig,
    dtype: str,
    seed: int,
    lora: LoraConfig | None = None,
    record_routing: bool = False,
) -> dict:
    """The keyword arguments of the `vllm.LLM` that a VLLMEngine serves (bench/
    bare_components.py builds the bare engine from them too). Call after
    `_configure_environment`: importing vLLM before it would fix the wrong settings."""
    from vllm.platforms import current_platform

    if record_routing and current_platform.is_cpu():
        raise ValueError(
            "model.routing_replay with rollout.engine=vllm: vLLM returns the routed experts "
            "only from its Model Runner V2, which needs Triton, and vLLM on CPU has none (vLLM "
            "0.32 refuses: 'AuxOutput Connector requires Model Runner V2', then 'Model Runner "
            "V2 requires Triton'); on CPU set rollout.engine=torch"
        )
    if current_platform.is_cpu():
        assert cfg.kv_cache_gb > 0, "recipe checks refuse rollout.kv_cache_gb <= 0"
        memory = {"kv_cache_memory_bytes": math.ceil(cfg.kv_cache_gb * (1 << 30))}
    else:
        memory = {"gpu_memory_utilization": cfg.gpu_memory_utilization}
    if cfg.tensor_parallel_size > 1:
        # One process per TP rank; the weight receiver reads shared memory in each.
        memory["distributed_executor_backend"] = "mp"
        if current_platform.is_cpu():
            _bind_tp_ranks_to_cpus(cfg.tensor_parallel_size)
    return dict(
        model=model_path,
        dtype=dtype,
        seed=seed,
        max_model_len=cfg.max_model_len,
        tensor_parallel_size=cfg.tensor_parallel_size,
        # Behaviour log-probs after temperature (and top-p), as the trainer computes
        # log_softmax(logits / T); the default "raw_logprobs" ignores temperature.
        logprobs_mode="processed_logprobs",
        # On CPU, by default: compiling costs more start-up than it saves in a short run.
        enforce_eager=current_platform.is_cpu() if cfg.compile is None else not cfg.compile,
        # A partly prefilled seeded request makes vLLM rewind its generator's offset,
        # which CPU generators do not support ("CPU Generator does not use offset").
        enable_chunked_prefill=not current_platform.is_cpu(),
        disable_log_stats=True,
        worker_extension_cls="rollout.weight_receiver.WeightReceiver",
        # vLLM's sleep mode frees accelerator memory; on CPU there is nothing to hand over.
        enable_sleep_mode=not current_platform.is_cpu(),
        # Each request's output carries the experts every position it ran was routed to.
        enable_return_routed_experts=record_routing,
        **memory,
        **lora_args(lora),
    )


class VLLMEngine:
    """One vLLM engine in this process.

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
        num_threads = _configure_environment()
        import vllm

        check_vllm(vllm)
        vllm_shm.remove_dead_engines_segments()
        args = engine_args(model_path, cfg, dtype, seed, lora, record_routing)
        self._record_routing = record_routing
        # With LoRA: the adapter's settings for the receivers, and the adapter every request
        # runs with (none at version 0, whose adapters are zero: the base).
        self._lora = lora.peft_dict() if lora is not None and lora.enabled else None
        self._lora_request = None
        self._cfg = cfg
        self._can_sleep = args["enable_sleep_mode"]
        self._sleeping: set[str] = set()  # vLLM's memory tags released: "weights", "kv_cache"
        self._vllm_sampling_params = vllm.SamplingParams
        self._llm = vllm.LLM(**args)
        vllm_shm.record_segments()
        self._tokenizer = self._llm.get_tokenizer()
        self._final_only = vllm.sampling_params.RequestOutputKind.FINAL_ONLY
        self._request_ids = itertools.count()
        # request id -> its samples (a fresh group's n, in index order, or one resumed sample)
        # and the params they were started with
        self._running: dict[str, tuple[list[Sample], SamplingParams]] = {}
        self.version = 0
        # Set while an update is partly applied: the engine then refuses to serve.
        self._updating_to: int | None = None
        self.startup_seconds = time.perf_counter() - start
        logger.info(
            "vLLM engine for %s ready in %.1f s (%d threads)",
            model_path,
            self.startup_seconds,
            num_threads,
        )

    @property
    def num_running(self) -> int:
        """Samples being generated (started and neither finished nor aborted)."""
        return sum(not s.finish_reason for request, _ in self._running.values() for s in request)

    def start(self, samples: list[Sample], params: SamplingParams) -> None:
        """Queue `samples` (fresh, or partial ones to resume) under the version being served.

        Each sample is one vLLM request whose prompt is its prompt plus the response so far,
        for the tokens `params.max_new_tokens` still allows. Sample k of group g samples with
        seed params.seed + g * params.n + k (offset by the prefix length when resuming), so a
        seeded batch reproduces however prompts are spread over workers. `step` extends the
        samples in place.
        """
        self._check_serving()
        check_startable(samples, params, self._cfg.max_model_len)
        for request in _requests(samples, params.n):
            request_id = str(next(self._request_ids))
            first = request[0]
            self._llm.llm_engine.add_request(
                request_id,
                {"prompt_token_ids": first.prompt_ids + first.response_ids},
                self._sampling_params(params, first, len(request)),
                lora_request=self._lora_request,
            )
            for sample in request:
                sample.finish_reason = ""
            self._running[request_id] = request, params

    def step(self) -> list[Sample]:
        """One engine step: the samples that finished in it are returned, their tokens (with
        log-probs and this version) appended."""
        finished = []
        for output in self._llm.llm_engine.step():
            # A request's one output is its final one: a group's n samples come back together.
            request, params = self._running.pop(output.request_id)
            for completion in output.outputs:
                sample = request[completion.index]
                self._append(sample, completion.token_ids, completion.logprobs)
                if self._record_routing:
                    extend_record(sample, completion.routed_experts)
                sample.finish_reason = _finish_reason(completion.finish_reason, sample, params)
                sample.request_prompt_tokens += len(output.prompt_token_ids)
                cached = output.num_cached_tokens or 0
                sample.cached_prompt_tokens = (sample.cached_prompt_tokens or 0) + cached
                finished.append(sample)
        decode_responses(self._tokenizer, finished)
        return finished

    def abort(self) -> list[Sample]:
        """Stop every running request; returns every sample `step` has not handed back: the
        unfinished ones where they stopped (finish_reason "abort"), and the ones that finished
        in a group still running (vLLM holds those back until the whole group ends)."""
        self._take_held_outputs()
        self._llm.llm_engine.abort_request(list(self._running))
        stopped = [s for request, _ in self._running.values() for s in request]
        self._running.clear()
        for sample in stopped:
            sample.finish_reason = sample.finish_reason or "abort"
        decode_responses(self._tokenizer, stopped)
        return stopped

    def _take_held_outputs(self) -> None:
        """Append to the running samples what vLLM holds for them and drops on an abort.

        Requests ask for their final output only: per-step deltas cost generation time
        (bench/bare_components.py), for tokens that matter only when a
        request is aborted. Until then vLLM's output processor holds each running sample's
        tokens and log-probs, and a group's finished samples in its parent request.
        """
        processor = self._llm.llm_engine.output_processor
        for request_id, (request, params) in self._running.items():
            parent = None
            for internal_id in processor.external_req_ids.get(request_id, ()):
                state = processor.request_states[internal_id]
                sample = request[state.request_index]
                self._append(
                    sample, state.detokenizer.output_token_ids, state.logprobs_processor.logprobs
                )
                if self._record_routing and state.routed_experts_chunks:
                    extend_record(sample, np.concatenate(state.routed_experts_chunks))
                parent = state.parent_req
            for completion in parent.output_aggregator if parent is not None else ():
                if completion is not None:
                    sample = request[completion.index]
                    self._append(sample, completion.token_ids, completion.logprobs)
                    if self._record_routing:
                        extend_record(sample, completion.routed_experts)
                    sample.finish_reason = _finish_reason(completion.finish_reason, sample, params)

    def _append(self, sample: Sample, token_ids: list[int], logprobs: list[dict]) -> None:
        """Extend `sample` by `token_ids`, sampled under this version, with their log-probs
        (vLLM's per-position {token: Logprob})."""
        new_ids = list(token_ids)
        sample.response_ids += new_ids
        sample.logprobs += [
            position[token].logprob for position, token in zip(logprobs, new_ids, strict=True)
        ]
        sample.token_versions += [self.version] * len(new_ids)

    def generate(self, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        """Generate `samples` to the end (see `start`); returns them, in order."""
        self.start(samples, params)
        while self.num_running:
            self.step()
        return samples

    def _sampling_params(
        self, params: SamplingParams, sample: Sample, n: int
    ) -> vllm.SamplingParams:
        """For `sample` alone, or (n > 1) for it and the n - 1 fresh samples after it: vLLM
        seeds a group's sample k with seed + k, as `start` promises."""
        seed = params.seed_of(sample)
        return self._vllm_sampling_params(
            n=n,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.stop_length(sample) - len(sample.response_ids),
            seed=seed,
            logprobs=0,
            detokenize=False,
            output_kind=self._final_only,  # see _take_held_outputs
            **self._routing_params(sample),
        )

    def _routing_params(self, sample: Sample) -> dict[str, int]:
        """Recording routing: return it from the first position the sample's record lacks (a
        resumed sample's holds its first positions already)."""
        if not self._record_routing:
            return {}
        held = 0 if sample.routed_experts is None else len(sample.routed_experts)
        return {"routed_experts_prompt_start": held}

    def score(self, sequences: list[list[int]], num_prompt_tokens: list[int]) -> list[list[float]]:
        """Log-probs at temperature 1 of sequences[i][num_prompt_tokens[i]:], each given its prefix.

        Returns one list per sequence, of length len(sequences[i]) - num_prompt_tokens[i].
        """
        self._check_serving()
        # LLM.generate steps the whole engine and would swallow running samples' tokens.
        self._check_idle("scoring")
        check_scorable(sequences, num_prompt_tokens, self._cfg.max_model_len)
        # Prompt log-probs come from the raw logits, whatever the logprobs mode.
        params = self._vllm_sampling_params(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outputs = self._llm.generate(
            [{"prompt_token_ids": seq} for seq in sequences],
            params,
            use_tqdm=False,
            lora_request=self._lora_request,
        )
        return [
            [output.prompt_logprobs[t][seq[t]].logprob for t in range(start, len(seq))]
            for seq, start, output in zip(sequences, num_prompt_tokens, outputs, strict=True)
        ]

    def open_weight_receiver(
        self, plan_json: str, channel_spec: ChannelSpec, first_member: int
    ) -> None:
        """Join the weight-sync channel `channel_spec` (`rl.sync.transport.open_channel`) for
        the transfer plan `plan_json`; TP rank t is channel member first_member + t."""
        self._llm.collective_rpc(
            "tandem_open_receiver", args=(plan_json, channel_spec, first_member, self._lora)
        )

    def apply_weight_bucket(self, bucket: int, version: int) -> int:
        """Load bucket `bucket` of `version` (buckets in order from 0); returns bytes read by
        the busiest TP rank. Until `finish_weight_update` the engine refuses to serve."""
        self._check_idle("a weight update")
        self.reclaim_weights()
        self._updating_to = version
        return max(self._llm.collective_rpc("tandem_apply_bucket", args=(bucket,)))

    def finish_weight_update(self, version: int) -> dict[str, float]:
        """Close an update: load what was held back, drop stale prefix KV, serve `version`.

        Returns, over TP ranks, the most `peak_extra_bytes` of resident memory the update took
        and the most `load_s` spent in vLLM's loading and processing.
        """
        if self._updating_to != version:
            raise RuntimeError(
                f"finish_weight_update({version}) without its buckets (updating to "
                f"{self._updating_to})"
            )
        ranks = self._llm.collective_rpc("tandem_finish_sync", args=(version,))
        stats = {key: max(rank[key] for rank in ranks) for key in ranks[0]}
        if self._lora is not None:  # the receivers hold this version's adapter under its id
            from vllm.lora.request import LoRARequest

            self._lora_request = LoRARequest(**adapter_names(version))
        # KV blocks cached under the old weights would be reused for matching prefixes.
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache: requests still running")
        self.version, self._updating_to = version, None
        return stats

    def release_memory(self) -> bool:
        """Hand the weights' and KV cache's device memory to a colocated trainer (weights go
        to host memory, the KV cache is dropped); returns whether anything was released."""
        self._check_idle("releasing memory")
        if self._can_sleep and not self._sleeping:
            self._llm.sleep(level=1)
            self._sleeping = {"weights", "kv_cache"}
        return bool(self._sleeping)

    def reclaim_weights(self) -> None:
        """Take the weights' memory back but not the KV cache's: a weight update loads while
        the colocated trainer still holds its state, which leaves before the cache returns."""
        if "weights" in self._sleeping:
            self._llm.wake_up(tags=["weights"])
            self._sleeping.discard("weights")

    def reclaim_memory(self) -> None:
        """Take all the memory back (before generating)."""
        if self._sleeping:
            self._llm.wake_up(tags=sorted(self._sleeping))
            self._sleeping.clear()

    def take_peak_memory_bytes(self) -> int:
        """The largest TP rank's peak memory since the previous call (`rl.observe.memory`'s
        take_peak_memory_bytes in each rank's process: resident, or allocated CUDA memory).
        The ranks are where the weights and KV cache live: with TP > 1 they are processes of
        their own, which this one's memory would miss."""
        return max(self._llm.collective_rpc(_take_peak_memory_bytes))

    def close(self) -> None:
        """Shut vLLM down: its TP worker processes exit, and the shared memory its executor
        and workers made for their queues is unlinked. vLLM unlinks those segments when it
        shuts down or its objects are collected, which a process Ray kills never does: they
        would stay in /dev/shm (`rollout.engines.vllm_shm` removes them after such a death)."""
        self._llm.llm_engine.engine_core.shutdown()
        vllm_shm.forget_segments()

    def _check_idle(self, what: str) -> None:
        if self._running:
            raise RuntimeError(
                f"{len(self._running)} samples are being generated: finish or abort them "
                f"before {what}"
            )

    def _check_serving(self) -> None:
        if self._sleeping:
            raise RuntimeError("this rollout engine released its memory: reclaim it first")
        if self._updating_to is not None:
            raise RuntimeError(
                f"this rollout engine holds a partly applied weight update (version "
                f"{self._updating_to} over {self.version}); it serves again after a complete "
                "sync"
            )


def _take_peak_memory_bytes(worker: object) -> int:
    """Run by collective_rpc in each TP rank's process; `worker` is vLLM's worker there."""
    return take_peak_memory_bytes()


def extend_record(sample: Sample, rows: np.ndarray | None) -> None:
    """Append the routing rows vLLM returned for `sample`'s request ([positions, layers, k]
    from the request's routed_experts_prompt_start on, up to its last token, which it never
    ran) to the sample's record (rl.types.Sample.routed_experts)."""
    assert rows is not None, "vLLM returned no routed experts for a request that asked for them"
    # vLLM returns the narrowest dtype that holds every expert id: uint8 up to 256 experts.
    dtype = torch.uint8 if rows.dtype == np.uint8 else torch.int16
    new = torch.from_numpy(np.ascontiguousarray(rows)).to(dtype)
    record = new if sample.routed_experts is None else torch.cat([sample.routed_experts, new])
    expected = len(sample.prompt_ids) + len(sample.response_ids) - 1
    assert len(record) == expected, (
        f"routing record of {len(record)} positions for a sample of {expected + 1} tokens"
    )
    sample.routed_experts = record


def _finish_reason(vllm_reason: str, sample: Sample, params: SamplingParams) -> str:
    """Ours for vLLM's: a request stopped by its max_tokens reached max_new_tokens ("length")
    or a `stop_every` point (then partial: "abort")."""
    return params.length_finish(sample) if vllm_reason == "length" else vllm_reason


def _requests(samples: list[Sample], n: int) -> list[list[Sample]]:
    """The vLLM requests for `samples`: a fresh group's n samples (indices 0..n-1 in order)
    share one request, which vLLM fans out after one prefill (faster than n requests); a resumed sample, or a group given in part, is a request of its own."""
    requests: list[list[Sample]] = []
    position = 0
    while position < len(samples):
        group = samples[position : position + n]
        whole = (
            n > 1
            and len(group) == n
            and all(s.group_id == group[0].group_id for s in group)
            and [s.index for s in group] == list(range(n))
            and not any(s.response_ids for s in group)
        )
        requests.append(group if whole else [samples[position]])
        position += n if whole else 1
    return requests


def _bind_tp_ranks_to_cpus(tp_size: int) -> None:
    """One disjoint set of this process's CPUs per TP rank ("0|1" for two ranks on two CPUs),
    unless VLLM_CPU_OMP_THREADS_BIND is already set."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp_size:
        raise ValueError(
            f"rollout.tensor_parallel_size={tp_size} needs at least {tp_size} CPUs, this "
            f"process may use {len(cpus)}"
        )
    groups = [
        cpus[len(cpus) * i // tp_size : len(cpus) * (i + 1) // tp_size] for i in range(tp_size)
    ]
    binding = "|".join(",".join(map(str, group)) for group in groups)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", binding)
