"""Which weight transport a run gets. Importing this module imports every transport, so
`TRANSPORTS` (rl.sync.transport) names them all."""

from __future__ import annotations

# Imported for their registration in TRANSPORTS.
from rl.sync import distributed, gathered, shared_memory  # noqa: F401
from rl.sync.transport import TRANSPORTS


def choose_transport(
    setting: str, num_nodes: int, shm_free: int, shm_needed: int, on_gpu: bool, colocated: bool
) -> str:
    """The transport for `rollout.weight_transport=setting` when the trainer and rollout
    workers span `num_nodes` nodes, run on GPUs (`on_gpu`) or CPUs, share their devices
    (`colocated`), and /dev/shm has `shm_free` of the `shm_needed` bytes the shared-memory
    transport would take. On GPUs the weights never leave the devices: the gathered
    transport where trainer and engines share them on one node, else the distributed one
    (NCCL). On CPUs shared memory on one node where it fits, else the distributed one (gloo,
    which works over loopback on one node too). A too-small /dev/shm (a container's default)
    would otherwise kill the first sync with SIGBUS, once its pages run out."""
    space = (
        f"/dev/shm has {shm_free / 2**20:.1f} MiB free of the {shm_needed / 2**20:.1f} MiB "
        "the shared-memory transport needs (two slots of the largest bucket, and a margin)"
    )
    if setting == "auto":
        if num_nodes > 1:
            return "distributed"
        if on_gpu:
            return "gathered" if colocated else "distributed"
        if shm_free < shm_needed:
            print(
                f"weight sync: {space}: using the distributed (gloo) transport",
                flush=True,
            )
            return "distributed"
        return "shared_memory"
    if TRANSPORTS.traits(setting).single_host and num_nodes > 1:
        raise ValueError(
            f"rollout.weight_transport={setting}, but the trainer and rollout workers run "
            f"on {num_nodes} nodes: use 'distributed' (or 'auto'), or place them on one node"
        )
    if setting == "gathered" and on_gpu and not colocated:
        raise ValueError(
            "rollout.weight_transport=gathered reads each bucket on the GPU of a trainer rank, "
            "but scheduler.placement=split gives the engines GPUs of their own: use "
            "'distributed' (or 'auto'), or scheduler.placement=colocate"
        )
    if setting == "shared_memory" and shm_free < shm_needed:
        raise ValueError(
            f"rollout.weight_transport=shared_memory, but {space}: enlarge /dev/shm "
            "(docker run --shm-size), lower rollout.weight_bucket_mb, or use 'distributed' "
            "(or 'auto')"
        )
    return setting
