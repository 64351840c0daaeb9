"""The receiving side of weight sync, inside each vLLM worker process (one per TP rank).

`WeightReceiver` is a vLLM worker extension (`worker_extension_cls`): its methods are mixed
into vLLM's worker class and called through `collective_rpc`, so with tensor parallelism each
rank's process takes its own region of every tensor from the weight-sync channel (shared
memory, or a gloo group across hosts: `rl.sync.transport`). Only bucket indices cross the
RPC (vLLM serialises RPC arguments to worker processes).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import tqdm

from rl.observe.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from rl.sync.plan import WeightSyncPlan, plan_from_json
from rl.sync.transport import Channel, ChannelSpec, open_channel

NamedTensors = list[tuple[str, torch.Tensor]]

# vLLM imports this module in each worker process before it loads the weights, behind a tqdm
# bar. tqdm's first bar makes a lock shared across processes, a named semaphore in
# /dev/shm (sem.mp-*) that only the process's orderly exit unlinks, and a worker of an
# engine Ray kills never gets that exit. A lock of this process does the bar's job.
tqdm.tqdm.set_lock(threading.RLock())


class WeightAssembler:
    """Holds weight-sync tensors back until vLLM can load each of its layers whole.

    vLLM reloads a layer once all of its elements have arrived; a bucket that splits one
    fused layer (q/k/v into qkv_proj, gate/up into gate_up_proj, a mixture of experts'
    gate_up_proj and down_proj into its fused-MoE layer, or a weight from its bias) would
    leave the rest of that layer uninitialised. Tensors are keyed by HF name.

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

    def own_held(self) -> None:
        """Replace every tensor held back by a private copy (held tensors may be views of a
        buffer that is reused)."""
        for received in self._pending.values():
            for name, tensor in received.items():
                received[name] = tensor.clone()
        for name, tensor in self._unmapped.items():
            self._unmapped[name] = tensor.clone()

    def reset(self) -> None:
        """Forget every tensor held back."""
        self._pending.clear()
        self._unmapped.clear()

    def drain(self) -> NamedTensors:
        """End of an update: return what is left; raise if a layer arrived only in part."""
        incomplete = {
            layer: sorted(self._members[layer] - received.keys())
            for layer, received in self._pending.items()
        }
        leftover = list(self._unmapped.items())
        self.reset()
        if incomplete:
            raise ValueError(f"weight update ended with layers missing tensors: {incomplete}")
        return leftover


# A vLLM fused-MoE layer's parameters -> the fused expert tensors, as transformers holds them
# in memory and the trainer sends them ([E, 2I, H] gate rows then up rows; [E, H, I]), that
# vLLM's expert loader takes whole under the layer's `layer_name`.
FUSED_EXPERTS = {"w13_weight": "gate_up_proj", "w2_weight": "down_proj"}


def fused_expert_layers(model: torch.nn.Module) -> dict[str, tuple[str, torch.nn.Module]]:
    """HF name of each fused expert tensor -> (qualified name, module) of the vLLM fused-MoE
    layer it loads into (a module holding w13_weight and w2_weight, named by `layer_name`)."""
    layers = {}
    for qualname, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if FUSED_EXPERTS.keys() <= params.keys() and hasattr(module, "layer_name"):
            for source in FUSED_EXPERTS.values():
                layers[f"{module.layer_name}.{source}"] = (qualname, module)
    return layers


def weight_layers(model: torch.nn.Module) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """HF name -> vLLM layer, and tied HF name groups, read off a loaded vLLM model. A fused
    MoE layer is loaded from the trainer's fused expert tensors (`fused_expert_layers`).

    A module reached by several paths (Qwen2-MoE's shared expert and its gate, which vLLM's
    MoE layer holds too) is one layer, loaded once under its first name; tied names are
    parameters shared by distinct layers (an embedding and its LM head)."""
    packed: dict[str, list[str]] = getattr(model, "packed_modules_mapping", {})
    layer_of = {name: layer for name, (layer, _) in fused_expert_layers(model).items()}
    expert_layers = set(layer_of.values())
    first_path: dict[int, str] = {}
    for qualname, module in model.named_modules(remove_duplicate=False):
        first_path.setdefault(id(module), qualname)
    names_of_param: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        layer, _, leaf = name.rpartition(".")
        if layer in expert_layers:  # loaded from the fused expert tensors alone
            continue
        if first_path[id(model.get_submodule(layer))] != layer:
            continue
        parent, _, last = layer.rpartition(".")
        prefix = f"{parent}." if parent else ""
        for source in packed.get(last, [last]):
            layer_of[f"{prefix}{source}.{leaf}"] = layer
        names_of_param.setdefault(id(param), []).append(name)
    aliases = {
        name: tuple(group) for group in names_of_param.values() if len(group) > 1 for name in group
    }
    return layer_of, aliases


def adapter_names(version: int) -> dict[str, object]:
    """The vLLM `LoRARequest` fields of policy `version`'s adapter: its id (>= 1) and name,
    and an absolute path that holds nothing (an adapter that was not loaded from tensors
    fails there at once, instead of vLLM looking its name up on a model hub)."""
    return {
        "lora_name": f"tandem-policy-v{version}",
        "lora_int_id": version + 1,
        "lora_path": f"/tandem-in-memory/policy-v{version}",
    }


def adapter_keys_model(hf_config: object, lora: dict) -> torch.nn.Module:
    """The served model (`hf_config`) with `lora`'s adapters (peft's settings), on meta: what
    peft's `get_peft_model_state_dict` reads to key the trainer's adapter tensors (peft's
    parameter names) as PEFT's adapter file keys them, which vLLM's LoRA loader reads."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return get_peft_model(model, LoraConfig(**lora), low_cpu_mem_usage=True)


@dataclass
class _Channel:
    plan: WeightSyncPlan
    tp_rank: int
    channel: Channel
    assembler: WeightAssembler
    lora: dict | None = None  # LoRA: the adapter's PEFT settings; only adapters travel
    adapter_keys: torch.nn.Module | None = None  # LoRA: `adapter_keys_model`
    adapter: dict[str, torch.Tensor] | None = None  # LoRA: this update's tensors so far
    # CPU: fused expert tensor's HF name -> its vLLM fused-MoE layer, whose kernel is rebuilt
    # at each reload (`_tandem_load`).
    expert_layers: dict[str, torch.nn.Module] = field(default_factory=dict)
    updating: bool = False  # between bucket 0 and finish
    base_rss: int = 0  # resident bytes when the current update began
    load_s: float = 0.0  # seconds in vLLM's loading and processing this update


class WeightReceiver:
    """vLLM worker extension: apply weight-sync buckets, all TP ranks alike.

    Methods run on the vLLM worker (`self` is the worker; `self.model_runner.model` the model).
    An update is one of vLLM's layerwise reloads spread over the buckets: bucket 0 puts every
    layer in reload state, each layer is loaded and re-processed (on CPU: repacked for oneDNN)
    as soon as its tensors are in, and finish processes what is left. One reload per update,
    not per bucket: setting up and finishing a reload walks every module.
    """

    def tandem_open_receiver(
        self, plan_json: str, channel_spec: ChannelSpec, first_member: int, lora: dict | None
    ) -> None:
        """Join the weight-sync channel `channel_spec` for the transfer plan `plan_json`; this
        engine's TP ranks are members first_member + tp_rank. With `lora` (PEFT adapter
        settings) an update is an adapter: its tensors, whole on every rank (vLLM slices
        them), replace the served adapter at finish; the base is never touched."""
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )
        from vllm.platforms import current_platform

        plan = plan_from_json(plan_json)
        tp_size = get_tensor_model_parallel_world_size()
        if plan.tp_size != tp_size:
            raise ValueError(
                f"transfer plan is for TP={plan.tp_size}, this engine runs TP={tp_size}"
            )
        # A bucket leaves most layers alone: vLLM would warn about each, in every process.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(
            logging.ERROR
        )
        tp_rank = get_tensor_model_parallel_rank()
        # A channel re-opened mid-update (the group re-formed after a member was lost) keeps
        # the news that layers are part-loaded, for the next update's bucket 0 to close them.
        previous = getattr(self, "_tandem_channel", None)
        model = self.model_runner.model
        expert_layers = {}
        if current_platform.is_cpu():
            expert_layers = {name: layer for name, (_, layer) in fused_expert_layers(model).items()}
        self._tandem_channel = _Channel(
            plan=plan,
            tp_rank=tp_rank,
            channel=open_channel(plan, channel_spec, member=first_member + tp_rank),
            assembler=WeightAssembler(*weight_layers(model)),
            lora=lora,
            adapter_keys=None
            if lora is None
            else adapter_keys_model(self.vllm_config.model_config.hf_config, lora),
            updating=previous is not None and previous.updating,
            expert_layers=expert_layers,
        )

    def tandem_apply_bucket(self, bucket: int) -> int:
        """Receive `bucket` and load every layer it completes (vLLM's loaders copy out this
        rank's region); returns the bytes this rank loads.

        On a GPU the copies out of the slot are queued on the device: they finish before
        this returns, since the trainer may rewrite the slot once every engine has returned."""
        num_bytes = self._tandem_apply(bucket)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return num_bytes

    def _tandem_apply(self, bucket: int) -> int:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        channel, model = self._tandem_channel, self.model_runner.model
        if channel.lora is not None:
            if bucket == 0:
                channel.base_rss, channel.adapter = rss_bytes(), {}
                reset_peak_rss()
            # Copies: vLLM scales an adapter's B in place, and the slot is rewritten soon.
            channel.adapter |= {name: t.clone() for name, t in channel.channel.read(bucket)}
            channel.updating = True
            return channel.plan.bucket_bytes_to_rank(bucket, channel.tp_rank)
        if bucket == 0:
            channel.base_rss = rss_bytes()
            reset_peak_rss()
            channel.load_s = 0.0
            channel.assembler.reset()
            with self._tandem_context():
                if channel.updating:
                    # An interrupted update left layers part-loaded: close them, so that
                    # stale buffered tensors cannot complete a layer of this update.
                    finalize_layerwise_reload(model, self.vllm_config.model_config)
                initialize_layerwise_reload(model)
            channel.updating = True
        ready = channel.assembler.add(channel.channel.read(bucket))
        # What waits for a later bucket must outlive a shared slot, which is rewritten soon.
        channel.assembler.own_held()
        self._tandem_load(ready)
        return channel.plan.bucket_bytes_to_rank(bucket, channel.tp_rank)

    def tandem_finish_sync(self, version: int) -> dict[str, float]:
        """Load what was held back and finish the reload (LoRA: serve the received adapter as
        `version`'s). Returns the update's peak extra resident bytes and the seconds spent in
        vLLM's loading and processing."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        channel = self._tandem_channel
        if channel.lora is not None:
            start = time.perf_counter()
            self._tandem_swap_adapter(version)
            channel.updating, channel.adapter = False, None
            return {
                "peak_extra_bytes": float(max(peak_rss_bytes() - channel.base_rss, 0)),
                "load_s": time.perf_counter() - start,
            }
        self._tandem_load(channel.assembler.drain())
        start = time.perf_counter()
        with self._tandem_context():
            finalize_layerwise_reload(self.model_runner.model, self.vllm_config.model_config)
        # As vLLM's own reload_weights does: drop state derived from the old weights.
        self.model_runner.reset_lora_state()
        self.model_runner.reset_encoder_cache()
        self.model_runner.reset_mm_cache()
        channel.updating = False
        channel.load_s += time.perf_counter() - start
        return {
            "peak_extra_bytes": float(max(peak_rss_bytes() - channel.base_rss, 0)),
            "load_s": channel.load_s,
        }

    def _tandem_swap_adapter(self, version: int) -> None:
        """Replace the served adapter by this update's, as vLLM's LoRA manager loads one from
        a PEFT directory (`WorkerLoRAManager._load_adapter`, `add_adapter`), from the tensors
        received instead of files."""
        from peft import get_peft_model_state_dict
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        channel, runner = self._tandem_channel, self.model_runner
        manager = runner.lora_manager
        helper = PEFTHelper.from_dict(dict(channel.lora))
        helper.validate_legal(manager.lora_config)
        model = manager._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        tensors = get_peft_model_state_dict(channel.adapter_keys, state_dict=channel.adapter)
        adapter = LoRAModel.from_lora_tensors(
            lora_model_id=adapter_names(version)["lora_int_id"],
            tensors=tensors,
            peft_helper=helper,
            device="cpu",
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        # peft keeps only its adapters, from_lora_tensors only what it can place: nothing
        # received may be left out, to be served as zeros.
        loaded = 2 * len(adapter.loras)
        if loaded != len(channel.adapter):
            raise ValueError(
                f"the adapter has {len(channel.adapter)} tensors but vLLM placed {loaded}"
            )
        runner.reset_lora_state()  # the previous version's adapter goes
        manager._adapter_manager.add_adapter(adapter)
        manager._adapter_manager.activate_adapter(adapter.id)

    def _tandem_context(self) -> contextlib.AbstractContextManager:
        from vllm.config import set_current_vllm_config

        stack = contextlib.ExitStack()
        stack.enter_context(set_current_vllm_config(self.vllm_config))
        stack.enter_context(torch.no_grad())
        return stack

    def _tandem_load(self, named_tensors: NamedTensors) -> None:
        if named_tensors:
            start = time.perf_counter()
            # vLLM's CPU experts repack w13/w2 into their grouped-GEMM layout when the layer's
            # kernel is built, and a reload (which keeps the kernel) copies the new, unpacked
            # weights into the packed storage: the layer would compute with garbage. Without
            # its kernel, the layer's processing builds it again and repacks the new weights.
            for name, _ in named_tensors:
                layer = self._tandem_channel.expert_layers.get(name)
                if layer is not None:
                    layer.quant_method.moe_kernel = None
            with self._tandem_context():
                self.model_runner.model.load_weights(named_tensors)
            self._tandem_channel.load_s += time.perf_counter() - start
