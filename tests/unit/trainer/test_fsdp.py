"""FSDP2 settings chosen from the recipe."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch._inductor.config
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy

from tests.helpers.fsdp_ranks import TEMPERATURE, hf_logprobs, make_batch, trainer_config
from tests.helpers.ports import free_port
from trainer.fsdp import check_cpu_compiler, load_sharded, offload_policy, sharding_mesh
from trainer.packing import padded_input


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


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A gloo group of this process alone, for FSDP2 without a second rank."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_logprob_pass_right_after_loading_runs_without_adapter_dropout(
    tiny_model_dir: Path, one_rank: None
) -> None:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    cfg = trainer_config(tiny_model_dir, num_workers=1)
    cfg.model.lora.rank, cfg.model.lora.dropout = 4, 0.1
    cfg.model.lora.target_modules = ["q_proj", "v_proj", "down_proj"]
    model = load_sharded(
        cfg.model, cfg.trainer, sharding_mesh("cpu", 1, cfg.trainer), trainable=True, seed=3
    )
    # B starts at zero, where dropout would change nothing: trained adapters (as a resume
    # loads them) make a dropped input show in the log-probs.
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.to_local().normal_(std=0.5, generator=noise)
    adapters = {n: p.full_tensor() for n, p in model.model.named_parameters() if "lora_" in n}

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    batch = make_batch(base, num_rows=4, seq_len=12, seed=0)
    generator = torch.get_rng_state()
    with torch.no_grad():  # as PolicyTrainer.compute_logprobs runs its passes
        first = model(padded_input(batch), TEMPERATURE)[0]
        second = model(padded_input(batch), TEMPERATURE)[0]
    assert torch.equal(first, second)
    # No mask was drawn: the training forwards' masks stay those of an uninterrupted run.
    assert torch.equal(torch.get_rng_state(), generator)

    # The same adapters in peft over the plain HF model, in eval mode: no dropout at all.
    reference = get_peft_model(base, cfg.model.lora.peft_config()).eval()
    assert not reference.load_state_dict(adapters, strict=False).unexpected_keys
    with torch.no_grad():
        want = hf_logprobs(reference, batch)[0] * batch.attention_mask[:, 1:]
    torch.testing.assert_close(first, want, rtol=1e-5, atol=1e-5)
