"""The placement plan: which bundles of the device pool each role's actors use.

Pure (no Ray), so `rl train --dry-run` can show it; `rl.scheduler` reserves it with Ray.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from rl.config import Config
from rl.rewards.terms import MODEL_PREFIX


@dataclass
class PlacementPlan:
    """Which bundles of the device pool each role uses (colocated roles share bundles)."""

    num_devices: int
    roles: dict[str, list[int]]  # role -> bundle index of each of its actors

    @property
    def num_roles_sharing(self) -> int:
        """Most actors on one bundle: each colocated actor asks for this fraction of it."""
        per_bundle = Counter(index for bundles in self.roles.values() for index in bundles)
        return max(per_bundle.values())

    def describe(self) -> str:
        lines = [f"colocate: {self.num_devices} devices (bundles), shared by every role"]
        for role, bundles in self.roles.items():
            lines.append(f"  {role}: {len(bundles)} actor(s) on bundles {bundles}")
        return "\n".join(lines)


def plan_placement(cfg: Config) -> PlacementPlan:
    """The colocated layout of `cfg`, computed without Ray (for `rl train --dry-run`).

    The pool is as large as the largest role needs (each rollout worker spans
    tensor_parallel_size devices), so on 2 CPUs two trainer ranks and one rollout worker fit.
    """
    tp = cfg.rollout.tensor_parallel_size
    roles = {
        "rollout": [index * tp for index in range(cfg.rollout.num_workers)],
        "trainer": list(range(cfg.trainer.num_workers)),
    }
    if cfg.algorithm.advantage == "gae":  # PPO: the critic gets its own group
        roles["critic"] = list(range(cfg.critic_world_size()))
    num_reward_models = sum(term.name.startswith(MODEL_PREFIX) for term in cfg.reward.terms)
    if num_reward_models:
        roles["reward_model"] = [0] * num_reward_models
    num_devices = max(cfg.rollout.num_workers * tp, *(len(bundles) for bundles in roles.values()))
    return PlacementPlan(num_devices=num_devices, roles=roles)
