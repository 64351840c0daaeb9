"""A trainer rank's device memory handed to a colocated rollout engine while it generates.

In colocate mode on GPUs the trainer and the engine take turns on the same devices. The engine
sleeps while the trainer trains (`rollout.engines.vllm_engine.VLLMEngine.release_memory`); this is the
other half: after a weight push the rank moves its sharded parameters, gradients and
optimizer state to host memory and empties CUDA's cache, so the engine's KV cache can take
that memory, and moves them back before it next computes anything (as verl offloads its FSDP
actor between phases).

With trainer.offload (FSDP2's CPU offload policy) that state lives in host memory already and
stays there: only the cache is emptied. On CPU there is nothing to hand over.
"""

from __future__ import annotations

import torch
from torch import nn

HOST = torch.device("cpu")


@torch.no_grad()
def move_training_state(
    modules: list[nn.Module], optimizer: torch.optim.Optimizer, device: torch.device
) -> None:
    """Move `modules`' parameters, gradients and buffers and `optimizer`'s per-parameter
    tensors (AdamW's moments) to `device`.

    An FSDP2 module moves its sharded parameters in place (`FSDPModule._apply` swaps their
    contents and re-registers the shards), so the optimizer still holds the same parameter
    objects. Only state shaped like its parameter moves: AdamW's step counters stay on the host,
    where its non-capturable step reads them.
    """
    for module in modules:
        module.to(device)
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape:
                    state[key] = value.to(device, non_blocking=True)


class DeviceResidency:
    """Where a rank's training state is: on its device, or released to host memory.

    `release` hands the device memory back; `ensure_on_device` (called first by everything
    that computes or reads the state) brings it back, so no caller has to remember the order.
    """

    def __init__(
        self,
        device: torch.device,
        modules: list[nn.Module],
        optimizer: torch.optim.Optimizer,
        offloaded_by_fsdp: bool,
    ) -> None:
        self.device, self.modules, self.optimizer = device, modules, optimizer
        # Under FSDP2's CPU offload the state is on the host already and must stay there.
        self._moves_state = device.type == "cuda" and not offloaded_by_fsdp
        self.released = False

    def release(self) -> None:
        """Move the state to host memory and return CUDA's cached blocks to the driver."""
        if self.device.type != "cuda":
            return
        if self._moves_state and not self.released:
            move_training_state(self.modules, self.optimizer, HOST)
            torch.cuda.synchronize(self.device)  # the copies read device memory being freed
        self.released = True
        torch.cuda.empty_cache()

    def ensure_on_device(self) -> None:
        if not self.released:
            return
        if self._moves_state:
            move_training_state(self.modules, self.optimizer, self.device)
        self.released = False
