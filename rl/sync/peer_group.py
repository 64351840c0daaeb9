"""A process group between the trainer ranks and the rollout TP ranks, for weight sync across
hosts or devices: gloo for host tensors, NCCL for GPU tensors. It lives outside any default
process group (FSDP2 and vLLM each have their own), on its own TCP store hosted by trainer
rank 0.

Point to point only. NCCL ignores tags and runs the messages between two ranks in the order
they were issued, so every sender must send to its peers, and every receiver receive from
its peers, in one agreed order (rl.sync.distributed: receivers by member number, buckets in
order); gloo matches by tag and needs no order.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

TIMEOUT = timedelta(minutes=10)


class PeerGroup:
    """This process's membership: rank `rank` of `world_size` (trainer ranks first), passing
    tensors on `device` (NCCL on a GPU, whose messages stay on the devices; gloo on CPU)."""

    def __init__(
        self, addr: str, port: int, rank: int, world_size: int, device: torch.device
    ) -> None:
        # Rank 0 hosts the store; every member blocks here until all have joined.
        self._store = dist.TCPStore(addr, port, world_size, is_master=rank == 0, timeout=TIMEOUT)
        prefixed = dist.PrefixStore("tandem-weight-sync", self._store)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = TIMEOUT
            self._group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        else:
            self._group = dist.ProcessGroupGloo(prefixed, rank, world_size, TIMEOUT)
        self.rank = rank

    def send(self, messages: list[tuple[int, torch.Tensor]], tag: int) -> None:
        """Send each (destination rank, contiguous tensor), in order; returns when all are
        sent (on a GPU: once this process's stream waits for them).

        A destination that died fails its own send only: every other send is still made and
        completed before the first failure is raised, so no live receiver is left waiting."""
        works, errors = [], []
        for dst, tensor in messages:
            if tensor.numel():
                try:
                    works.append(self._group.send([tensor], dst, tag))
                except RuntimeError as error:
                    errors.append(error)
        for work in works:
            try:
                work.wait()
            except RuntimeError as error:
                errors.append(error)
        if errors:
            raise errors[0]

    def recv(self, messages: list[tuple[int, torch.Tensor]], tag: int) -> None:
        """Receive into each (source rank, contiguous tensor of the message's size), in order."""
        works = [self._group.recv([t], src, tag) for src, t in messages if t.numel()]
        for work in works:
            work.wait()
