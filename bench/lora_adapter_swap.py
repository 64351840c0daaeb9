"""What serving a new policy version's LoRA adapter costs a vLLM engine, two ways (issue 44).

    .venv/bin/python bench/lora_adapter_swap.py [--rounds 20] [--rank 16]

On the throughput model's shape (bench/recipes/throughput_25m.yaml: a random ~25M Qwen2,
hidden 512, 8 layers) with adapters on all seven linears, in one vLLM engine on CPU built with
VLLMEngine's own arguments, from tensors already received by the engine's worker:

- tensors: Tandem's path (`WeightReceiver._tandem_swap_adapter`): peft keys the tensors,
  vLLM's `LoRAModel.from_lora_tensors` builds the adapter, and the worker's LoRA manager
  replaces the previous version's by it and activates it;
- files: vLLM's public LoRA API: the worker writes the adapter as a PEFT directory
  (adapter_model.safetensors, adapter_config.json) to a temporary directory, the engine's
  `add_lora(LoRARequest(name, id, path))` loads it from there and `remove_lora` drops the
  previous version's; vLLM activates it at the first request that names it.

Per round and way: the swap's seconds, then the extra seconds of the first one-token request
under the new adapter over the same request again (activation, where vLLM defers it). The ways
take turns; medians over --rounds after one warm-up round each. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from rl.config import BaseBuildConfig, LoraConfig, RolloutConfig
from rollout.engines.vllm_engine import _configure_environment, engine_args
from rollout.weight_receiver import adapter_keys_model, adapter_names
from trainer.hf_model import new_model, save_hf_atomic, train_tokenizer

SHAPE = BaseBuildConfig(
    vocab_size=260,
    hidden_size=512,
    num_layers=8,
    num_heads=8,
    num_kv_heads=2,
    intermediate_size=1536,
)


def _stage(wrapper: object, tensors: dict[str, torch.Tensor], lora: dict) -> None:
    """What a sync leaves in the worker before its finish: copies of the received adapter
    tensors. (A callable given to collective_rpc gets vLLM's wrapper around the worker.)"""
    worker = wrapper.worker
    channel = getattr(worker, "_tandem_channel", None)
    if channel is None:
        hf_config = worker.vllm_config.model_config.hf_config
        channel = SimpleNamespace(lora=lora, adapter_keys=adapter_keys_model(hf_config, lora))
        worker._tandem_channel = channel
    channel.adapter = {name: tensor.clone() for name, tensor in tensors.items()}


def _swap_from_tensors(wrapper: object, version: int) -> None:
    wrapper.worker._tandem_swap_adapter(version)


def _write_peft_dir(wrapper: object, directory: str) -> None:
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    channel = wrapper.worker._tandem_channel
    tensors = get_peft_model_state_dict(channel.adapter_keys, state_dict=channel.adapter)
    os.makedirs(directory)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "bias": "none", **channel.lora}
    Path(directory, "adapter_config.json").write_text(json.dumps(config))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    _configure_environment()
    from peft import get_peft_model
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    work = Path(tempfile.mkdtemp(prefix="lora-swap-"))
    try:
        tokenizer = train_tokenizer([f"{i}+{i + 1}={2 * i + 1}" for i in range(2000)], 260)
        base = new_model(SHAPE, tokenizer, seed=0)
        model_dir = save_hf_atomic(base, tokenizer, work / "model")
        lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
        peft_model = get_peft_model(base, lora.peft_config())
        noise = torch.Generator().manual_seed(0)
        tensors = {}
        for name, param in peft_model.named_parameters():
            if ".lora_" in name:  # a trained adapter: B is not zero
                tensors[name] = torch.randn(param.shape, generator=noise) * 0.02
        adapter_mib = sum(t.numel() * 4 for t in tensors.values()) / 2**20

        cfg = RolloutConfig(kv_cache_gb=0.25, max_model_len=256)
        llm = LLM(**engine_args(str(model_dir), cfg, "float32", 0, lora))
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
        prompt = {"prompt_token_ids": [1, 2, 3, 4]}
        served = {}  # way -> the one token's log-prob: both ways serve the same adapter

        def one_token(request: LoRARequest, way: str) -> float:
            start = time.perf_counter()
            out = llm.generate([prompt], params, lora_request=request, use_tqdm=False)
            seconds = time.perf_counter() - start
            served[way] = list(out[0].outputs[0].logprobs[0].values())[0].logprob
            return seconds

        version, previous = 0, None
        seconds: dict[str, list[tuple[float, float]]] = {"tensors": [], "files": []}
        for round_ in range(args.rounds + 1):
            for way in seconds:
                version += 1
                names = adapter_names(version)
                # As a sync receives them: fresh tensors (vLLM scales an adapter's B in place).
                llm.collective_rpc(_stage, args=(tensors, lora.peft_dict()))
                start = time.perf_counter()
                if way == "tensors":
                    llm.collective_rpc(_swap_from_tensors, args=(version,))
                    request = LoRARequest(**names)
                else:
                    directory = str(work / f"v{version}")
                    llm.collective_rpc(_write_peft_dir, args=(directory,))
                    request = LoRARequest(names["lora_name"], names["lora_int_id"], directory)
                    llm.llm_engine.add_lora(request)
                    if previous is not None:
                        llm.llm_engine.remove_lora(previous)
                swap = time.perf_counter() - start
                first = one_token(request, way)
                activation = first - one_token(request, way)
                previous = names["lora_int_id"]
                if round_ > 0:  # the first round warms both up
                    seconds[way].append((swap, activation))
        base_logprob = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].logprobs[0]
        base_logprob = list(base_logprob.values())[0].logprob
        assert served["tensors"] == served["files"], served
        assert served["tensors"] != base_logprob, "no adapter served"
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"adapter: rank {args.rank} on 7 linears x {SHAPE.num_layers} layers, ", end="")
    print(f"{adapter_mib:.2f} MiB fp32; medians of {args.rounds} rounds\n")
    print("| way | swap ms | first request's extra ms | sum ms |")
    print("|---|---:|---:|---:|")
    for way, rows in seconds.items():
        swap = statistics.median(s for s, _ in rows) * 1000
        activation = statistics.median(a for _, a in rows) * 1000
        print(f"| {way} | {swap:.1f} | {activation:.1f} | {swap + activation:.1f} |")


if __name__ == "__main__":
    main()
