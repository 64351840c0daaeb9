"""The Ray side of placement: join or start a cluster, reserve the plan's placement group.

`rl.placement` decides which bundles each role uses (colocate or split); here they are
reserved as one placement group and each actor asks for its share of its bundle. On CPU a
"device" is one CPU; on GPU, one GPU plus a CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl.config import Config
from rl.placement import PlacementPlan, plan_placement


@dataclass
class Placement:
    group: PlacementGroup
    plan: PlacementPlan
    use_gpu: bool

    def actor_options(self, bundle_index: int, num_roles_sharing: int) -> dict:
        """`.options(...)` for an actor that shares bundle `bundle_index` with other roles."""
        share = 1.0 / num_roles_sharing
        options = {
            "num_cpus": share,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=bundle_index
            ),
        }
        if self.use_gpu:
            options["num_gpus"] = share
        return options

    def release(self) -> None:
        remove_placement_group(self.group)


def init_ray() -> bool:
    """Join the cluster named by RAY_ADDRESS (`ray job submit` sets it) or start a local one.
    Returns whether this call connected, so the caller knows whose connection to close."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    ray.init(
        address=address or None,
        log_to_driver=True,
        include_dashboard=False if not address else None,
    )
    return True


def reserve(cfg: Config, timeout_s: float = 120.0) -> Placement:
    """Reserve the bundles of `plan_placement(cfg)`."""
    use_gpu = bool(ray.cluster_resources().get("GPU", 0))
    plan = plan_placement(cfg)
    num_devices = plan.num_devices
    bundle = {"CPU": 1.0, "GPU": 1.0} if use_gpu else {"CPU": 1.0}
    group = placement_group([dict(bundle) for _ in range(num_devices)], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        available = ray.available_resources()
        remove_placement_group(group)
        raise RuntimeError(
            f"could not reserve {num_devices} x {bundle} for the placement\n"
            f"{plan.describe()}\ncluster has {available}"
        )
    return Placement(group=group, plan=plan, use_gpu=use_gpu)
