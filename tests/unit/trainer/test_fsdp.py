"""FSDP2 settings chosen from the recipe."""

from __future__ import annotations

import pytest
import torch._inductor.config
from torch.distributed.fsdp import CPUOffloadPolicy

from trainer.fsdp import check_cpu_compiler, offload_policy


def test_offload_moves_the_state_to_host_memory_on_a_gpu_only() -> None:
    assert isinstance(offload_policy(True, "cuda"), CPUOffloadPolicy)
    assert not isinstance(offload_policy(False, "cuda"), CPUOffloadPolicy)
    assert not isinstance(offload_policy(True, "cpu"), CPUOffloadPolicy)


def test_compiling_without_a_cpu_compiler_names_the_knob_and_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    check_cpu_compiler()  # this machine has one
    monkeypatch.setattr(torch._inductor.config.cpp, "cxx", ("no-such-c++",))
    with pytest.raises(ValueError, match=r"install g\+\+ .* or set trainer.compile=false"):
        check_cpu_compiler()


def test_adapter_dropout_acts_in_the_training_forward_only(tiny_model_dir) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def adapted(dropout: float) -> torch.nn.Module:
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        torch.manual_seed(0)
        config = LoraConfig(r=4, target_modules=["q_proj", "down_proj"], lora_dropout=dropout)
        model = get_peft_model(base, config, autocast_adapter_dtype=False)
        for name, param in model.named_parameters():
            if "lora_B" in name:  # B starts at zero, where dropout would change nothing
                torch.nn.init.normal_(param, std=0.5)
        return model.eval()

    from trainer.fsdp import adapter_dropout

    ids = torch.arange(1, 17).reshape(2, 8)
    plain, dropped = adapted(0.0), adapted(0.5)
    with torch.no_grad():
        want = plain(input_ids=ids).logits
        assert torch.equal(dropped(input_ids=ids).logits, want)  # eval: no dropout
        with adapter_dropout(dropped):
            first = dropped(input_ids=ids).logits
            second = dropped(input_ids=ids).logits
            # Only the adapters' dropout: the base's modules stay in eval mode.
            assert not any(
                m.training for n, m in dropped.named_modules() if ".lora_dropout." not in n
            )
        assert not torch.equal(first, want) and not torch.equal(first, second)
        assert torch.equal(dropped(input_ids=ids).logits, want)  # off again afterwards
