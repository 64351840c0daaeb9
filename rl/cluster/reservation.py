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
    except BaseException:
        for group in reserved.values():
            remove_placement_group(group)
        raise
    return Placement([reserved[i] for i in range(len(plan.node_blocks))], plan, use_gpu)
