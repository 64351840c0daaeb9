"""The driver's side of weight sync: plan the transfer once, then stream each update.

Per bucket, every trainer rank sends its own FSDP2 rows and every rollout worker (each of its
TP ranks) loads the regions it needs, over the transport of `rl.sync.transport` (shared
memory on one node, where the next bucket is written while the current one is read; a gloo
group across nodes). A rollout worker lost mid-update is dropped from it, replaced by a fresh
engine and sent the whole current version (over a gloo group, which the loss breaks, the group
is re-formed first and every worker left behind gets the version); one lost while generating
is replaced the same way (`replace`), when the scheduler finds the trainer idle: with the
trainer's weights if it has not trained since the last push, or else (overlapped runs,
SchedulerConfig.keeps_pushed_weights) with the copy of that push each trainer rank keeps.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator

import ray
from ray.exceptions import RayActorError, RayTaskError

from rl.cluster.rollout_replicas import RolloutReplicas
from rl.cluster.trainer_ranks import PolicyRanks
from rl.config import Config
from rl.sync import shared_memory
from rl.sync.plan import WeightSyncPlan, plan_to_json, plan_weight_sync
from rl.sync.selection import choose_transport
from rl.sync.transport import TRANSPORTS, ChannelSpec, SyncSite

_MB = float(1 << 20)


def _remove(specs: list[ChannelSpec]) -> None:
    """Delete what the channels of `specs` leave behind their processes."""
    for spec in specs:
        spec.remove()


class WeightSync:
    """One sync channel from the trainer group to the rollout workers."""

    def __init__(self, cfg: Config, trainers: PolicyRanks, rollout: RolloutReplicas) -> None:
        self._trainers, self._rollout = trainers.workers, rollout
        self._keeps_pushed = cfg.scheduler.keeps_pushed_weights
        self.pushed_version = 0  # the rollout's checkpoint until the first push
        tensors, shape = ray.get(self._trainers[0].weight_sync_spec.remote())
        # Weights travel in the engines' dtype, which their loaders would cast them to anyway.
        self.plan: WeightSyncPlan = plan_weight_sync(
            tensors,
            shape,
            world_size=len(self._trainers),
            tp_size=cfg.rollout.tensor_parallel_size,
            bucket_bytes=int(cfg.rollout.weight_bucket_mb * (1 << 20)),
            wire_dtype=cfg.model.dtype,
        )
        # What a sync of the whole model moves: with LoRA a sync sends far less.
        num_params = ray.get(self._trainers[0].num_model_params.remote())
        self.full_model_bytes = self.plan.bytes_per_element * num_params
        nodes = set(ray.get([w.node_id.remote() for w in self._trainers]))
        nodes |= set(ray.get([w.node_id.remote() for w in rollout.workers]))
        self.num_nodes = len(nodes)
        # A driver killed outright (SIGKILL, OOM) never deletes its slot files: delete those of
        # exited drivers before measuring the space, and before creating this run's.
        shared_memory.remove_stale_slots()
        self.transport = choose_transport(
            cfg.rollout.weight_transport,
            self.num_nodes,
            shm_free=shared_memory.free_bytes(),
            shm_needed=shared_memory.slots_bytes_needed(self.plan.slot_numel, cfg.model.dtype),
            on_gpu=ray.get(self._trainers[0].device_name.remote()) != "cpu",
            colocated=cfg.scheduler.placement == "colocate",
        )
        self._plan_json = plan_to_json(self.plan)
        self._traits = TRANSPORTS.traits(self.transport)
        self._prefix = shared_memory.channel_prefix()  # this process owns the channel's files
        self._cleanup: weakref.finalize | None = None
        self._readers_spec: ChannelSpec | None = None  # what the rollout ranks open
        self._made: list[ChannelSpec] = []  # every spec opened: each removes what it left
        self._connect()
        self.failed: list[int] = []  # rollout workers lost during the last `stream`
        self.metrics: dict[str, float] = {}  # of the last `stream`

    def _connect(self, indices: list[int] | None = None) -> None:
        """Open the channel for everyone, or (indices) only for those rollout workers. A
        transport whose members join together (a gloo group) is always re-formed by all."""
        workers = self._rollout.workers
        first_member = [len(self._trainers) + i * self.plan.tp_size for i in range(len(workers))]
        if self._readers_spec is None or indices is None or self._traits.joined_together:
            addr, port = ray.get(self._trainers[0].get_master_addr_port.remote())
            spec = TRANSPORTS.get(self.transport)(SyncSite(self._prefix, addr, port, len(workers)))
            self._readers_spec = spec
            self._made.append(spec)
        spec = self._readers_spec
        if self._cleanup is None:
            # /dev/shm outlives processes: delete what the channel leaves however the driver exits.
            self._cleanup = weakref.finalize(self, _remove, self._made)
        if self._traits.joined_together:
            # Joining blocks until every member has joined: start them all, then wait.
            ray.get(
                [w.open_weight_sender.remote(self._plan_json, spec) for w in self._trainers]
                + [
                    worker.open_weight_receiver.remote(self._plan_json, spec, first_member[i])
                    for i, worker in enumerate(workers)
                ]
            )
            return
        if indices is None:
            opening = self._trainers
            if self._traits.creator_first:  # rank 0 creates the channel the others map
                ray.get(opening[0].open_weight_sender.remote(self._plan_json, spec))
                opening = opening[1:]
            exports = ray.get([w.open_weight_sender.remote(self._plan_json, spec) for w in opening])
            if self._traits.exports_slots:  # the readers open what the ranks just made
                self._readers_spec = spec = spec.with_exports(exports)
                self._made.append(spec)
            indices = list(range(len(workers)))
        ray.get(
            [
                workers[i].open_weight_receiver.remote(self._plan_json, spec, first_member[i])
                for i in indices
            ]
        )

    def stream(
        self, version: int, indices: list[int] | None = None, pushed: bool = False
    ) -> Iterator[int]:
        """Send `version` to rollout workers `indices` (default all): the trainer's weights,
        or (`pushed`) the ranks' copies of the last push. Yields each bucket index
        once every live receiver has applied it (the last one, and closed the update). Workers
        that die are dropped and listed in `self.failed`; the others serve `version` when the
        stream ends, except over a transport whose members joined together (a gloo group):
        there a lost member breaks the group, so the stream stops at that bucket and `repair`
        re-forms the group and sends the version again."""
        indices = list(range(len(self._rollout.workers))) if indices is None else indices
        receivers = {i: self._rollout.workers[i] for i in indices}
        self.failed = []
        start = time.perf_counter()
        num_buckets = len(self.plan.buckets)
        pipelined = self._traits.pipelined
        writes = self._write(0, indices, pushed)
        write_stats: list[dict[str, float]] = []
        finished: list[dict[str, float]] = []
        num_bytes = write_s = 0.0
        for bucket in range(num_buckets):
            last = bucket + 1 == num_buckets  # the receivers then also close the update
            if pipelined:  # bucket is in its slot before anyone reads it
                write_stats = ray.get(writes)
                write_s += max(stat["seconds"] for stat in write_stats)
            applying = {
                i: r.apply_weight_bucket.remote(bucket, version, last) for i, r in receivers.items()
            }
            if pipelined and not last:
                # Written while this bucket loads: its slot held bucket - 1, which every
                # receiver applied before this bucket started.
                writes = self._write(bucket + 1, indices, pushed)
            applied = self._gather(receivers, applying)
            if not pipelined:  # the sends complete as the receivers take them
                write_stats = self._settle(writes)
                if self.failed and self._traits.joined_together:
                    break  # the group lost a member: nothing more can cross it
                write_s += max(stat["seconds"] for stat in write_stats)
                if not last:
                    writes = self._write(bucket + 1, indices, pushed)
            num_bytes += max((bucket_bytes for bucket_bytes, _ in applied), default=0)
            if last:
                finished = [closed for _, closed in applied]
            yield bucket
        self.metrics = {
            "weight_sync/seconds": time.perf_counter() - start,
            "weight_sync/trainer_write_s": write_s,
            "weight_sync/buckets": float(num_buckets),
            "weight_sync/mb_per_rollout_rank": num_bytes / _MB,
            "weight_sync/mb_full_model": self.full_model_bytes / _MB,
            "weight_sync/trainer_peak_extra_mb": max(
                (s["peak_extra_bytes"] for s in write_stats), default=0.0
            )
            / _MB,
            "weight_sync/rollout_peak_extra_mb": max(
                (f["peak_extra_bytes"] for f in finished), default=0.0
            )
            / _MB,
            "weight_sync/rollout_load_s": max((f["load_s"] for f in finished), default=0.0),
        }

    def _write(self, bucket: int, indices: list[int], pushed: bool) -> list[ray.ObjectRef]:
        """Every trainer rank sends its rows of `bucket` to rollout workers `indices`."""
        return [w.write_weight_bucket.remote(bucket, indices, pushed) for w in self._trainers]

    def _settle(self, writes: list[ray.ObjectRef]) -> list[dict[str, float]]:
        """The trainer ranks' write stats. After a receiver of a joined group was lost, their
        sends to it may fail (the peer is gone): that failure is the loss, already counted,
        and the driver goes on to re-form the group. Any other failure is the trainer's."""
        stats = []
        for ref in writes:
            try:
                stats.append(ray.get(ref))
            except RayTaskError:
                if not (self.failed and self._traits.joined_together):
                    raise
        return stats

    def _gather(self, receivers: dict, refs: dict[int, ray.ObjectRef]) -> list:
        """Results of `refs`; a receiver whose actor died is dropped from `receivers`."""
        results = []
        for index, ref in refs.items():
            try:
                results.append(ray.get(ref))
            except RayActorError:
                del receivers[index]
                self.failed.append(index)
        return results

    def repair(self, version: int) -> None:
        """Replace the workers lost in the last `stream` and bring every worker to `version`:
        the replacements, and (over a joined group, whose stream stopped at the loss) the
        survivors it left part-way."""
        lost = self.failed
        for index in lost:
            self._rollout.restart(index)
        self._connect(None if self._traits.joined_together else lost)
        behind = [i for i, served in enumerate(self._rollout.versions()) if served != version]
        self._send_whole(behind, version)

    def replace(self, indices: list[int], version: int) -> None:
        """Replace rollout workers `indices` (dead or not) by fresh engines serving `version`
        (nothing else may run on the trainer ranks meanwhile): the last one pushed, from the
        ranks' copies where they keep them, else the one the ranks hold. Version 0 is the
        checkpoint a fresh engine loads: nothing is sent."""
        assert not (self._keeps_pushed and version not in (0, self.pushed_version)), (
            f"replaced at version {version}, last pushed {self.pushed_version}"
        )
        for index in indices:
            self._rollout.restart(index)
        self._connect(indices)
        self._send_whole(indices if version else [], version, pushed=self._keeps_pushed)

    def _send_whole(self, indices: list[int], version: int, pushed: bool = False) -> None:
        if not indices:
            return
        for _ in self.stream(version, indices, pushed):
            pass
        if self.failed:
            raise RuntimeError(f"rollout workers {self.failed} died again receiving {version}")

    def push(self, version: int) -> dict[str, float]:
        """Every rollout worker serves `version` on return (lost ones are replaced)."""
        self.pushed_version = version  # from the first bucket on, the ranks' copies hold it
        for _ in self.stream(version):
            pass
        metrics = dict(self.metrics)
        metrics["weight_sync/workers_replaced"] = float(len(self.failed))
        if self.failed:
            self.repair(version)
        return metrics

    def close(self) -> None:
        """Delete what the channel leaves behind its processes."""
        if self._cleanup is not None:
            self._cleanup()
