"""The Ray side of placement: join or start a cluster, reserve the plan's placement groups.

`rl.cluster.placement` decides which bundles each role uses (colocate or split) and which bundles
share a node; here each node block is reserved as one placement group packed on one node
(STRICT_PACK), and each actor asks for its share of its bundle. On CPU a "device" is one CPU;
on GPU, one GPU plus a CPU.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl.cluster.placement import PlacementPlan, plan_placement
from rl.config import Config


@dataclass
class Placement:
    placement_groups: list[PlacementGroup]  # one per node block of the plan
    plan: PlacementPlan
    use_gpu: bool
    gpu_ids: list[str]  # per bundle of the plan, the GPU Ray reserved for it (empty on CPU)

    def actor_options(self, bundle_index: int, num_roles_sharing: int) -> dict:
        """`.options(...)` for an actor that shares bundle `bundle_index` with other roles."""
        share = 1.0 / num_roles_sharing
        block, local_index = self.plan.locate(bundle_index)
        options = {
            "num_cpus": share,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.placement_groups[block],
                placement_group_bundle_index=local_index,
            ),
        }
        if self.use_gpu:
            options["num_gpus"] = share
        return options

    def visible_devices(self, bundles: list[int]) -> dict[str, str]:
        """Environment variables for an actor that drives the GPUs of several `bundles` (a
        tensor-parallel engine whose rank r uses cuda:r): Ray would show it only the GPU of
        the one bundle it is scheduled on, so it is told to leave CUDA_VISIBLE_DEVICES alone,
        which then lists the bundles' GPUs in rank order."""
        assert self.use_gpu
        return {
            "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
            "CUDA_VISIBLE_DEVICES": ",".join(self.gpu_ids[bundle] for bundle in bundles),
        }

    def release(self) -> None:
        for group in self.placement_groups:
            remove_placement_group(group)


def init_ray(verbose: bool) -> bool:
    """Join the cluster named by RAY_ADDRESS (`ray job submit` and `rl train --address` set
    it) or start a local one, never a stray `ray start` cluster found on this machine. Unless
    `verbose`, Ray's own INFO lines and the workers' output stay off the console (actors
    write to the run's logs/, rl.observe.actor_logs). Returns whether this call connected, so the
    caller knows whose connection to close."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    ray.init(
        address=address or "local",
        log_to_driver=verbose,
        logging_level=logging.INFO if verbose else logging.WARNING,
        include_dashboard=False if not address else None,
    )
    where = f"joined the Ray cluster at {address}" if address else "started a local Ray"
    resources = ray.cluster_resources()
    print(
        f"{where}: {resources.get('CPU', 0):g} CPUs, {resources.get('GPU', 0):g} GPUs, "
        f"{len(ray.nodes())} node(s)",
        flush=True,
    )
    return True


def reserve(cfg: Config, timeout_s: float = 120.0) -> Placement:
    """Reserve the node blocks of `plan_placement(cfg)`, largest first, each ready before the
    next: a small group taken first could fill the one node a larger group fits on."""
    use_gpu = bool(ray.cluster_resources().get("GPU", 0))
    plan = plan_placement(cfg)
    bundle = {"CPU": 1.0, "GPU": 1.0} if use_gpu else {"CPU": 1.0}
    device = "GPU" if use_gpu else "CPU"
    largest_node = max(node["Resources"].get(device, 0) for node in ray.nodes() if node["Alive"])
    reserved: dict[int, PlacementGroup] = {}
    try:
        for index in sorted(range(len(plan.node_blocks)), key=lambda i: -len(plan.node_blocks[i])):
            bundles = plan.node_blocks[index]
            where = f"bundles {bundles} of the plan on one node"
            if len(bundles) > largest_node:
                raise RuntimeError(
                    f"{where} need {len(bundles)} {device}s, but the largest node has "
                    f"{largest_node:g}; set scheduler.devices_per_node to at most that\n"
                    f"{plan.describe()}"
                )
            group = placement_group([dict(bundle) for _ in bundles], strategy="STRICT_PACK")
            reserved[index] = group
            ready, _ = ray.wait([group.ready()], timeout=timeout_s)
            if not ready:
                raise RuntimeError(
                    f"could not reserve {len(bundles)} x {bundle} for {where} within "
                    f"{timeout_s:g} s\n{plan.describe()}\ncluster has {ray.available_resources()}"
                )
        groups = [reserved[i] for i in range(len(plan.node_blocks))]
        gpu_ids = _gpu_ids(groups, plan) if use_gpu else []
    except BaseException:
        for group in reserved.values():
            remove_placement_group(group)
        raise
    return Placement(groups, plan, use_gpu, gpu_ids)


@ray.remote(num_cpus=0)
def _gpu_id() -> str:
    (gpu,) = ray.get_gpu_ids()
    return str(gpu)


def _gpu_ids(groups: list[PlacementGroup], plan: PlacementPlan) -> list[str]:
    """The GPU id of every bundle of the plan, asked of a task on each before any actor holds
    a share of it: a bundle's GPU is fixed when the group is reserved, so every actor
    scheduled on the bundle later gets the same one."""
    refs = []
    for bundle in range(plan.num_devices):
        block, local_index = plan.locate(bundle)
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=groups[block], placement_group_bundle_index=local_index
        )
        refs.append(_gpu_id.options(num_gpus=0.01, scheduling_strategy=strategy).remote())
    return ray.get(refs)
