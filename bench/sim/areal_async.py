"""AReaL's asynchronous policy (inclusionAI/AReaL) on the simulated split cluster, a second
baseline beside verl's (sim.verl_async).

What it does, from its code (inclusionAI/AReaL at commit 4aef98d8):
- **Admission** (areal/infra/staleness_manager.py `get_capacity`): a rollout (one prompt
  and its `n_samples` responses) starts while fewer than `max_concurrent_rollouts` run and
  `accepted + running < (max_head_offpolicyness + version + 1) x consumer_batch_size`,
  where `accepted` counts every rollout ever finished and `version` is the number of weight
  updates so far. So a rollout started under version v is among the first
  (max_head_offpolicyness + v + 1) batches.
- **The trainer** (areal/trainer/rl_trainer.py `train`) takes a batch of
  `consumer_batch_size` finished rollouts, the earliest created first
  (areal/infra/workflow_executor.py `wait_results` sorts what has finished by creation
  time), recomputes their log-probs under its current weights (decoupled PPO's proximal
  policy: `should_compute_prox_logp` with `use_decoupled_loss`), trains on them, then
  updates the weights: generation pauses, every request in flight is aborted
  (`pause_generation`), the weights move, and the aborted requests resume with what they
  generated as their new prompt, under the new version (areal/infra/remote_inf_engine.py
  `agenerate`: `req.input_ids += gen_result.output_tokens`). Admission goes on while the
  trainer computes.

Not modelled: rejection of rollouts (dynamic filtering), evaluation and checkpoints, and the
half-second polling with which an aborted request notices that generation resumed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sim.async_policies import Group, SplitCluster
from sim.cluster import Placement, Result, Workload
from sim.costs import CostModel


@dataclass(frozen=True)
class ArealSchedule:
    """AReaL's rollout settings. `max_head_offpolicyness` 4, recomputed log-probs and the
    decoupled loss are its boba recipe's (examples/math/boba_grpo.yaml: rollout and actor
    sections); `max_concurrent_rollouts` None is AReaL's default, the consumer batch size
    (areal/api/cli_args.py, InferenceEngineConfig)."""

    max_head_offpolicyness: int = 4
    max_concurrent_rollouts: int | None = None
    recompute_logprob: bool = True

    def label(self) -> str:
        return f"AReaL offpolicyness {self.max_head_offpolicyness}"


@dataclass
class Admission:
    """AReaL's staleness manager: how many rollouts may start now (pure logic, no clock)."""

    consumer_batch_size: int
    max_head_offpolicyness: int
    max_concurrent_rollouts: int
    accepted: int = 0  # finished, ever
    running: int = 0  # started and not finished, interrupted ones included

    def capacity(self, version: int) -> int:
        concurrency = self.max_concurrent_rollouts - self.running
        batches = self.max_head_offpolicyness + version + 1
        staleness = batches * self.consumer_batch_size - (self.accepted + self.running)
        return min(concurrency, staleness)


def simulate(
    cost: CostModel, placement: Placement, workload: Workload, schedule: ArealSchedule
) -> Result:
    """AReaL's policy over `workload` on `placement`'s simulated GPUs (split only: AReaL's
    asynchronous mode runs inference servers and trainer on their own GPUs). A step trains
    `workload.groups_per_step` rollouts (its consumer batch) and updates the weights once."""
    batch = workload.groups_per_step
    cluster = SplitCluster(cost, placement, workload)
    admission = Admission(
        batch, schedule.max_head_offpolicyness, schedule.max_concurrent_rollouts or batch
    )
    ready: list[Group] = []  # finished, not yet trained
    taken: list[Group] = []  # the batch the trainer is on
    while cluster.version < workload.num_steps:
        for _ in range(admission.capacity(cluster.version)):
            cluster.start(cluster.new_group())
            admission.running += 1
        if not cluster.training and not taken and len(ready) >= batch:
            ready.sort(key=lambda group: group.group_id)  # the earliest created first
            taken, ready = ready[:batch], ready[batch:]
            if schedule.recompute_logprob:
                cluster.annotate(taken)
            else:
                cluster.train(taken)
        finished, interrupted, ended = cluster.wait()
        assert not interrupted, "only a weight update interrupts"
        admission.running -= len(finished)
        admission.accepted += len(finished)
        ready += finished
        if ended == "annotate":
            cluster.train(taken)
        elif ended == "train":
            taken = []
            finished, interrupted = cluster.interrupt()
            admission.running -= len(finished)
            admission.accepted += len(finished)
            ready += finished
            cluster.push()
            for group in interrupted:
                cluster.start(group)
    return cluster.result()


def split_trainer_cost(fitted: dict[str, CostModel]) -> CostModel:
    """The split trainer of `sim.verl.trainer_costs` with a log-prob pass priced too: that
    fit sets only the split update's speed, which verl's fully-async run measured; AReaL's
    recomputed log-probs keep the ratio to the update that verl measured colocated."""
    colocated, split = fitted["colocate"].eff, fitted["split"].eff
    annotate_mfu = colocated.annotate_mfu * split.train_mfu / colocated.train_mfu
    return dataclasses.replace(
        fitted["split"], eff=dataclasses.replace(split, annotate_mfu=annotate_mfu)
    )
