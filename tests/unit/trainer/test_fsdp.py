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
