"""What a released trainer rank leaves on its device: nothing of its training state.

This machine has no second device to move to and back, so the move goes to "meta" (storage-
less): whatever is still on the CPU afterwards would have stayed on the GPU. The round trip's
exactness on a GPU is bench/gpu_strategies.py's release check.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from trainer.offload import DeviceResidency, move_training_state

META = torch.device("meta")


@pytest.fixture
def one_rank() -> Iterator[None]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _trained_fsdp_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """Two FSDP2 layers under an FSDP2 root, after an AdamW step, gradients kept."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 4))
    model.register_buffer("scale", torch.ones(4))
    mesh = init_device_mesh("cpu", (1,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 8)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def test_moving_the_training_state_leaves_no_parameter_gradient_or_moment_behind(
    one_rank: None,
) -> None:
    model, optimizer = _trained_fsdp_model()
    params = list(model.parameters())
    move_training_state([model], optimizer, META)
    # The optimizer still steps the module's own parameters: they were moved in place.
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in params]
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    for param in params:
        assert _local(param).device == META
        assert _local(param.grad).device == META
        state = optimizer.state[param]
        assert _local(state["exp_avg"]).device == META
        assert _local(state["exp_avg_sq"]).device == META
        assert state["step"].device.type == "cpu"  # AdamW's non-capturable step reads it there
    assert model.scale.device == META


def test_a_cpu_rank_keeps_its_state_where_it_is(one_rank: None) -> None:
    model, optimizer = _trained_fsdp_model()
    before = [_local(p).clone() for p in model.parameters()]
    residency = DeviceResidency(torch.device("cpu"), [model], optimizer, offloaded_by_fsdp=False)
    residency.release()
    assert not residency.released
    residency.ensure_on_device()
    for param, old in zip(model.parameters(), before, strict=True):
        assert _local(param).device.type == "cpu"
        torch.testing.assert_close(_local(param), old, rtol=0, atol=0)
