"""FSDP2 settings chosen from the recipe."""

from __future__ import annotations

from torch.distributed.fsdp import CPUOffloadPolicy

from trainer.fsdp import offload_policy


def test_offload_moves_the_state_to_host_memory_on_a_gpu_only() -> None:
    assert isinstance(offload_policy(True, "cuda"), CPUOffloadPolicy)
    assert not isinstance(offload_policy(False, "cuda"), CPUOffloadPolicy)
    assert not isinstance(offload_policy(True, "cpu"), CPUOffloadPolicy)
