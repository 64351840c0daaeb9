"""In-process vLLM rollout engine: sampling with behaviour log-probs, scoring, in-place weights.

A plain class (no Ray): the `RolloutWorker` actor is a thin shell around it. vLLM reads much
of its configuration from the environment when it is imported, so `vllm` is imported inside
`VLLMEngine.__init__`, after `_configure_environment` has run.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import TYPE_CHECKING

import torch

from rl.config import RolloutConfig
from rl.types import Sample, SamplingParams

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
    # generation ran 6x slower on a shared 2-core machine (measured).
    num_threads = int(os.environ.setdefault("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(num_threads)
    return num_threads


class VLLMEngine:
    """One vLLM engine in this process.

    `version` is the policy version of the weights it serves (0 = the checkpoint at
    `model_path`); `startup_seconds` is how long construction took.
    """

    def __init__(self, model_path: str, cfg: RolloutConfig, dtype: str, seed: int) -> None:
        start = time.perf_counter()
        num_threads = _configure_environment()
        import vllm
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            if cfg.kv_cache_gb <= 0:
                raise ValueError(f"rollout.kv_cache_gb={cfg.kv_cache_gb} must be positive")
            memory = {"kv_cache_memory_bytes": math.ceil(cfg.kv_cache_gb * (1 << 30))}
        else:
            memory = {"gpu_memory_utilization": cfg.gpu_memory_utilization}
        if cfg.tensor_parallel_size > 1:
            # One process per TP rank; the weight receiver reads shared memory in each.
            memory["distributed_executor_backend"] = "mp"
            if current_platform.is_cpu():
                _bind_tp_ranks_to_cpus(cfg.tensor_parallel_size)
        self._cfg = cfg
        self._vllm_sampling_params = vllm.SamplingParams
        self._llm = vllm.LLM(
            model=model_path,
            dtype=dtype,
            seed=seed,
            max_model_len=cfg.max_model_len,
            tensor_parallel_size=cfg.tensor_parallel_size,
            # Behaviour log-probs after temperature (and top-p), as the trainer computes
            # log_softmax(logits / T); the default "raw_logprobs" ignores temperature.
            logprobs_mode="processed_logprobs",
            # On CPU, torch.compile costs far more startup than it saves for small models.
            enforce_eager=current_platform.is_cpu(),
            # A partly prefilled seeded request makes vLLM rewind its generator's offset,
            # which CPU generators do not support ("CPU Generator does not use offset").
            enable_chunked_prefill=not current_platform.is_cpu(),
            disable_log_stats=True,
            worker_extension_cls="rollout.weight_receiver.WeightReceiver",
            **memory,
        )
        self._tokenizer = self._llm.get_tokenizer()
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

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        group_ids: list[int],
        policy_version: int,
    ) -> list[Sample]:
        """`params.n` samples per prompt, flat and ordered prompt by prompt.

        Prompt i samples with seeds params.seed + group_ids[i] * n + k (k < n), so a seeded
        batch reproduces however prompts are spread over workers. Each sample's `logprobs`
        are the behaviour log-probs of its response tokens: log softmax(logits / temperature),
        renormalised over the nucleus when top_p < 1 (greedy: temperature 1).
        """
        self._check_serving()
        if len(group_ids) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(group_ids)} group ids")
        if not prompts:
            return []  # vLLM reads an empty prompt list as one empty prompt
        longest = max((len(p) for p in prompts), default=0)
        if longest + params.max_new_tokens > self._cfg.max_model_len:
            raise ValueError(
                f"prompt of {longest} tokens + rollout.max_new_tokens={params.max_new_tokens} "
                f"exceeds rollout.max_model_len={self._cfg.max_model_len}"
            )
        outputs = self._llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            [self._sampling_params(params, group_id) for group_id in group_ids],
            use_tqdm=False,
        )
        samples = []
        for prompt, group_id, output in zip(prompts, group_ids, outputs, strict=True):
            for completion in output.outputs:
                response = list(completion.token_ids)
                samples.append(
                    Sample(
                        prompt_ids=list(prompt),
                        response_ids=response,
                        logprobs=[
                            position[token].logprob
                            for position, token in zip(completion.logprobs, response, strict=True)
                        ],
                        finish_reason=completion.finish_reason,
                        policy_version=policy_version,
                        group_id=group_id,
                    )
                )
        # One batched decode is much cheaper than vLLM's per-token incremental detokenizer.
        texts = self._tokenizer.batch_decode(
            [s.response_ids for s in samples], skip_special_tokens=True
        )
        for sample, text in zip(samples, texts, strict=True):
            sample.response_text = text
        return samples

    def _sampling_params(self, params: SamplingParams, group_id: int) -> vllm.SamplingParams:
        seed = None if params.seed is None else params.seed + group_id * params.n
        return self._vllm_sampling_params(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_new_tokens,
            seed=seed,
            logprobs=0,
            detokenize=False,
        )

    def score(self, sequences: list[list[int]], num_prompt_tokens: list[int]) -> list[list[float]]:
        """Log-probs at temperature 1 of sequences[i][num_prompt_tokens[i]:], each given its prefix.

        Returns one list per sequence, of length len(sequences[i]) - num_prompt_tokens[i].
        """
        self._check_serving()
        if len(num_prompt_tokens) != len(sequences):
            raise ValueError(
                f"{len(sequences)} sequences but {len(num_prompt_tokens)} prompt lengths"
            )
        for seq, start in zip(sequences, num_prompt_tokens, strict=True):
            if not 1 <= start <= len(seq):
                raise ValueError(f"num_prompt_tokens={start} outside [1, {len(seq)}]")
            if len(seq) >= self._cfg.max_model_len:
                raise ValueError(
                    f"sequence of {len(seq)} tokens needs rollout.max_model_len > {len(seq)}"
                )
        # Prompt log-probs come from the raw logits, whatever the logprobs mode.
        params = self._vllm_sampling_params(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outputs = self._llm.generate(
            [{"prompt_token_ids": seq} for seq in sequences], params, use_tqdm=False
        )
        return [
            [output.prompt_logprobs[t][seq[t]].logprob for t in range(start, len(seq))]
            for seq, start, output in zip(sequences, num_prompt_tokens, outputs, strict=True)
        ]

    def open_weight_sync(self, plan_json: str, channel_spec: dict, first_member: int) -> None:
        """Join the weight-sync channel `channel_spec` (`rl.weight_transport.open_channel`) for
        the transfer plan `plan_json`; TP rank t is channel member first_member + t."""
        self._llm.collective_rpc("tandem_open_sync", args=(plan_json, channel_spec, first_member))

    def apply_weight_bucket(self, bucket: int, version: int) -> int:
        """Load bucket `bucket` of `version` (buckets in order from 0); returns bytes read by
        the busiest TP rank. Until `finish_weight_update` the engine refuses to serve."""
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
        ranks = self._llm.collective_rpc("tandem_finish_sync")
        stats = {key: max(rank[key] for rank in ranks) for key in ranks[0]}
        # KV blocks cached under the old weights would be reused for matching prefixes.
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache: requests still running")
        self.version, self._updating_to = version, None
        return stats

    def _check_serving(self) -> None:
        if self._updating_to is not None:
            raise RuntimeError(
                f"this rollout engine holds a partly applied weight update (version "
                f"{self._updating_to} over {self.version}); it serves again after a complete "
                "sync"
            )


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
