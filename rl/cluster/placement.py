"""The placement plan: which bundles of the device pool each role's actors use.

Pure (no Ray), so `rl train --dry-run` can show it; `rl.cluster.reservation` reserves it with Ray.

colocate: every role shares every device and the scheduler time-slices them (or overlaps
them, with max_staleness > 0, on the same devices). split: the rollout workers get the first
`rollout_devices` bundles, and the trainer ranks, critic, distillation teacher, reward
models and local judges share the next `trainer_devices`, so generation and training never compete for a
device; a teacher given `teacher.devices` gets that many more, after the trainer's.

Across nodes each pool (colocate: the whole pool; split: the rollout's, and the trainer's) is
cut into node blocks of at most `scheduler.devices_per_node` bundles, each reserved packed on
one node. Tensor-parallel groups never straddle two (devices_per_node is a multiple of the TP
size), so an engine's ranks share a node while rollout workers and trainer ranks spread.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from rl.algorithms.advantages import needs_critic
from rl.config import Config
from rl.rewards.terms import MODEL_PREFIX


@dataclass
class PlacementPlan:
    """Which bundles of the device pool each role uses (colocated roles share bundles)."""

    mode: str  # "colocate" or "split"
    num_devices: int
    roles: dict[str, list[int]]  # role -> first bundle index of each of its actors
    node_blocks: list[list[int]]  # bundle indices reserved together on one node
    rollout_width: int = 1  # bundles per rollout worker (its tensor-parallel size)

    def locate(self, bundle: int) -> tuple[int, int]:
        """(node block, index within it) of bundle `bundle`."""
        for block_index, block in enumerate(self.node_blocks):
            if bundle in block:
                return block_index, block.index(bundle)
        raise AssertionError(f"bundle {bundle} is in no node block of {self.node_blocks}")

    @property
    def num_roles_sharing(self) -> int:
        """Most actors on one bundle: each actor asks for this fraction of its bundle."""
        per_bundle = Counter(index for bundles in self.roles.values() for index in bundles)
        return max(per_bundle.values())

    def rollout_threads(self, worker: int) -> int:
        """CPU threads for rollout worker `worker` when it has its devices' node block to
        itself while it generates (colocated, on-policy: the trainer waits meanwhile): the
        group's devices shared among the rollout workers in it."""
        firsts = self.roles["rollout"]
        block = self.locate(firsts[worker])[0]
        num_workers = sum(self.locate(first)[0] == block for first in firsts)
        return max(1, len(self.node_blocks[block]) // (num_workers * self.rollout_width))

    def rollout_bundles(self, worker: int) -> list[int]:
        """The bundles of rollout worker `worker`'s engine, one per tensor-parallel rank."""
        first = self.roles["rollout"][worker]
        return list(range(first, first + self.rollout_width))

    def devices_of(self, role: str) -> list[int]:
        """The distinct bundles `role`'s actors run on, in order."""
        return sorted(set(self.roles.get(role, [])))

    def trace_lanes(self) -> dict[str, list[int]]:
        """Lanes of the run's trace (rl.observe.trace) and the bundles each occupies: one per rollout
        worker, one for the trainer side (policy, reference, critic, teacher), and the reward
        lane, on the reward models' and local judges' bundles (function rewards run in the
        driver's processes, remote judges elsewhere)."""
        lanes = {
            f"rollout-{index}": list(range(first, first + self.rollout_width))
            for index, first in enumerate(self.roles["rollout"])
        }
        trainer_side = ("trainer", "critic", "teacher")
        lanes["trainer"] = sorted({d for role in trainer_side for d in self.devices_of(role)})
        lanes["reward"] = sorted({*self.devices_of("reward_model"), *self.devices_of("judge")})
        return lanes

    def describe(self) -> str:
        shared = "shared by every role" if self.mode == "colocate" else "rollout apart"
        lines = [f"{self.mode}: {self.num_devices} devices (bundles), {shared}"]
        for role, bundles in self.roles.items():
            lines.append(f"  {role}: {len(bundles)} actor(s) on bundles {bundles}")
        if self.rollout_width > 1:
            for worker in range(len(self.roles["rollout"])):
                bundles = self.rollout_bundles(worker)
                lines.append(
                    f"  rollout engine {worker}: tensor-parallel ranks 0-{len(bundles) - 1} on "
                    f"the devices of bundles {bundles}, rank r on the r-th (on GPUs, "
                    "CUDA_VISIBLE_DEVICES lists those GPUs' ids, printed at start)"
                )
        blocks = " ".join(str(block) for block in self.node_blocks)
        lines.append(f"  node blocks (each packed on one node): {blocks}")
        return "\n".join(lines)


def plan_placement(cfg: Config) -> PlacementPlan:
    """The layout of `cfg`, computed without Ray (for `rl train --dry-run`).

    colocate: the pool is as large as the largest role needs (each rollout worker spans
    tensor_parallel_size devices), so on 2 CPUs two trainer ranks and one rollout worker fit;
    scheduler.num_devices makes it larger.
    """
    tp = cfg.rollout.tensor_parallel_size
    num_rollout_devices = cfg.rollout.num_workers * tp
    num_teacher_ranks = cfg.teacher_world_size() if cfg.teacher.enabled else 0
    trainer_roles = {
        "trainer": cfg.trainer.num_workers,
        "critic": cfg.critic_world_size() if needs_critic(cfg) else 0,
        # On devices of its own (teacher.devices, split only), placed below.
        "teacher": 0 if cfg.teacher.devices else num_teacher_ranks,
        "reward_model": sum(term.name.startswith(MODEL_PREFIX) for term in cfg.reward.terms),
        # A local judge's engine (one with a url runs elsewhere).
        "judge": sum(t.judge is not None and not t.judge.url for t in cfg.reward.terms),
    }
    if cfg.scheduler.placement == "split":
        num_rollout_devices = cfg.scheduler.rollout_devices or num_rollout_devices
        num_trainer_devices = cfg.scheduler.trainer_devices or cfg.trainer.num_workers
        first = num_rollout_devices
    else:
        num_trainer_devices = max(
            cfg.trainer.num_workers, cfg.critic_world_size(), num_teacher_ranks
        )
        first = 0
    roles = {"rollout": _spread(cfg.rollout.num_workers, num_rollout_devices, tp, 0)}
    for role, count in trainer_roles.items():
        if count and role in ("reward_model", "judge"):
            roles[role] = [first] * count  # small models: they share the first device
        elif count:
            roles[role] = _spread(count, num_trainer_devices, 1, first)
    per_node = cfg.scheduler.devices_per_node
    if cfg.scheduler.placement == "split":
        num_devices = num_rollout_devices + num_trainer_devices
        pools = [range(num_rollout_devices), range(num_rollout_devices, num_devices)]
        if cfg.teacher.devices and num_teacher_ranks:
            roles["teacher"] = _spread(num_teacher_ranks, cfg.teacher.devices, 1, num_devices)
            pools.append(range(num_devices, num_devices + cfg.teacher.devices))
            num_devices += cfg.teacher.devices
    else:
        needed = max(num_rollout_devices, *(max(b) + 1 for b in roles.values()))
        num_devices = max(needed, cfg.scheduler.num_devices)
        pools = [range(num_devices)]
    node_blocks = [block for pool in pools for block in _chunks(pool, per_node or len(pool))]
    return PlacementPlan(cfg.scheduler.placement, num_devices, roles, node_blocks, tp)


def _spread(num_actors: int, num_devices: int, width: int, first: int) -> list[int]:
    """First bundle of each of `num_actors` actors spanning `width` bundles each, placed
    round-robin over `num_devices` bundles from `first`."""
    slots = max(num_devices // width, 1)
    return [first + (index % slots) * width for index in range(num_actors)]


def _chunks(pool: range, size: int) -> list[list[int]]:
    """`pool`'s bundles in consecutive groups of `size` (the last may be smaller)."""
    return [list(pool[start : start + size]) for start in range(0, len(pool), size)]
