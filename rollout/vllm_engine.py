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
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from rl.config import RolloutConfig
from rl.types import Sample, SamplingParams

if TYPE_CHECKING:
    import vllm

logger = logging.getLogger(__name__)

NamedTensors = list[tuple[str, torch.Tensor]]


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


class WeightAssembler:
    """Holds weight-sync tensors back until vLLM can load each of its layers whole.

    vLLM reloads a layer once all of its elements have arrived; a bucket that splits one
    fused layer (q/k/v into qkv_proj, gate/up into gate_up_proj, or a weight from its
    bias) would leave the rest of that layer uninitialised. Tensors are keyed by HF name.

    `layer_of` maps every HF name vLLM can load to its vLLM layer (module qualname);
    `aliases` maps an HF name to all names of the same tied parameter (both must be
    loaded: each tied layer keeps its own repacked copy of the shared weight). Names
    outside `layer_of` are passed through at `drain`.
    """

    def __init__(self, layer_of: dict[str, str], aliases: dict[str, tuple[str, ...]]) -> None:
        self._layer_of = layer_of
        self._aliases = aliases
        self._members: dict[str, set[str]] = {}
        for name, layer in layer_of.items():
            self._members.setdefault(layer, set()).add(name)
        self._pending: dict[str, dict[str, torch.Tensor]] = {}  # layer -> name -> tensor
        self._unmapped: dict[str, torch.Tensor] = {}

    def add(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> NamedTensors:
        """Take one bucket; return the tensors of every layer it completed."""
        touched: set[str] = set()
        for name, tensor in named_tensors:
            for alias in self._aliases.get(name, (name,)):
                layer = self._layer_of.get(alias)
                if layer is None:
                    self._unmapped[alias] = tensor
                    continue
                received = self._pending.setdefault(layer, {})
                # An alias never overrides its own name sent explicitly.
                if alias == name or alias not in received:
                    received[alias] = tensor
                touched.add(layer)
        ready: NamedTensors = []
        for layer in touched:
            if self._pending[layer].keys() == self._members[layer]:
                ready.extend(self._pending.pop(layer).items())
        return ready

    def drain(self) -> NamedTensors:
        """End of an update: return what is left; raise if a layer arrived only in part."""
        incomplete = {
            layer: sorted(self._members[layer] - received.keys())
            for layer, received in self._pending.items()
        }
        leftover = list(self._unmapped.items())
        self._pending.clear()
        self._unmapped.clear()
        if incomplete:
            raise ValueError(f"weight update ended with layers missing tensors: {incomplete}")
        return leftover


def _weight_plan(model: torch.nn.Module) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """HF name -> vLLM layer, and tied HF name groups, read off a loaded vLLM model."""
    packed: dict[str, list[str]] = getattr(model, "packed_modules_mapping", {})
    layer_of: dict[str, str] = {}
    names_of_param: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        layer, _, leaf = name.rpartition(".")
        parent, _, last = layer.rpartition(".")
        prefix = f"{parent}." if parent else ""
        for source in packed.get(last, [last]):
            layer_of[f"{prefix}{source}.{leaf}"] = layer
        names_of_param.setdefault(id(param), []).append(name)
    aliases = {
        name: tuple(group) for group in names_of_param.values() if len(group) > 1 for name in group
    }
    return layer_of, aliases


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
            if cfg.tensor_parallel_size != 1:
                # TP on CPU needs vLLM's multiprocess executor, which serialises
                # collective_rpc arguments: tensors would need another transport.
                raise ValueError(
                    f"rollout.tensor_parallel_size={cfg.tensor_parallel_size}: only 1 is "
                    "supported on CPU"
                )
            if cfg.kv_cache_gb <= 0:
                raise ValueError(f"rollout.kv_cache_gb={cfg.kv_cache_gb} must be positive")
            memory = {"kv_cache_memory_bytes": math.ceil(cfg.kv_cache_gb * (1 << 30))}
        else:
            memory = {"gpu_memory_utilization": cfg.gpu_memory_utilization}
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
            **memory,
        )
        self._tokenizer = self._llm.get_tokenizer()
        # Every bucket is a partial reload by design: vLLM would warn about each layer and
        # weight it leaves alone, on every call.
        for reload_module in ("inplace", "layerwise"):
            logging.getLogger(f"vllm.model_executor.model_loader.reload.{reload_module}").setLevel(
                logging.ERROR
            )
        self._assembler = WeightAssembler(*self._llm.apply_model(_weight_plan)[0])
        self.version = 0
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

    def load_weights(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Apply one bucket of full HF-named tensors (any subset of the model) in place.

        Tensors of a vLLM layer that is not yet complete wait for later buckets. With tied
        embeddings either name updates both the embedding and the LM head.
        """
        self._reload(self._assembler.add(named_tensors))

    def finish_weight_update(self, version: int) -> None:
        """Close an update: load what was held back, drop stale prefix KV, serve `version`."""
        self._reload(self._assembler.drain())
        # KV blocks cached under the old weights would be reused for matching prefixes.
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache: requests still running")
        self.version = version

    def _reload(self, named_tensors: NamedTensors) -> None:
        if named_tensors:
            # model.load_weights alone would miss the repacked copies vLLM keeps on CPU;
            # reload_weights re-runs each layer's post-load processing.
            self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors})
