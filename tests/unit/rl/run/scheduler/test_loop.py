"""The scheduler's guarantees under many random timings, with fast fake workers.

The fakes (scheduler_fakes.py) run on threads with random millisecond delays, so completions
arrive in every order the real workers could produce. Each run checks: no trained sample is more than k
versions old (by its oldest token), no group is lost, duplicated or trained twice, a resumed
sample keeps its prefix, and the run terminates. Two runs whose timings differ train and log
the same, and a scheduler resumed from the state of any sync continues as the run did. In some runs rollout workers die at random
moments mid-generation: they are replaced on the rollout's weights before any work reaches
them again, and the run goes on, up to faults.max_rollout_restarts.
"""

from __future__ import annotations

import json
import random
import threading
import time

import numpy as np
import pytest

from rl.checkpoint.in_flight import in_flight_from_json, in_flight_to_json
from rl.observe.metrics import is_measurement
from rl.observe.trace import Trace
from rl.run.scheduler.loop import Scheduler, Settings
from rl.types import SamplingParams, fresh_samples
from tests.unit.rl.run.scheduler.fakes import (
    MAX_NEW_TOKENS,
    FakeRollout,
    FakeScorer,
    FakeTrainer,
    token_at,
)


def _run(
    seed: int,
    k: int,
    partial: str,
    dynamic: bool,
    annotate: bool,
    release_memory: bool = False,
    start_version: int = 0,
    kill_chance: float = 0.0,
    max_kills: int = 0,
    kill_at_sync: bool = False,
    max_restarts: int = 3,
    in_flight: dict | None = None,
    num_steps: int = 5,
    abort_every: int | str = 2,
    max_token_age: int = 3,
    max_stale_share: float = 0.5,
    groups_in_flight: int = 6,
    streaming: bool = False,
    stream_groups: int = 1,
):
    """A `num_steps`-step run; `seed` draws the timings and placements only. `in_flight`: resume at
    `start_version` from a state the run recorded (as JSON, as a checkpoint holds it)."""
    rng = random.Random(seed)
    settings = Settings(
        num_steps=num_steps,
        groups_per_step=3,
        group_size=2,
        max_staleness=k,
        partial_rollout=partial,
        abort_every=abort_every,
        dynamic_sampling=dynamic,
        max_groups_per_step=6 if dynamic else 3,
        release_memory=release_memory,
        max_rollout_restarts=max_restarts,
        max_token_age=max_token_age,
        max_stale_share=max_stale_share,
        groups_in_flight=groups_in_flight,
        streaming=streaming,
        stream_groups=stream_groups,
    )
    rollout = FakeRollout(rng, 2, kill_chance, max_kills, kill_at_sync)
    rollout.versions = [start_version] * rollout.num_workers
    # As the trainer side does (SchedulerConfig.keeps_pushed_weights): overlapped, it keeps a
    # copy of its last push.
    trainer = FakeTrainer(
        rng, rollout, needs_annotation=annotate, keeps_pushed_weights=k >= 1, version=start_version
    )
    rollout.trainer_version = lambda: trainer.version
    rollout.time_sliced = release_memory
    rollout.trainer_on_device = lambda: trainer.on_device

    drawn: list[int] = []  # group ids in the order their prompts were drawn

    def next_group(group_id: int):
        drawn.append(group_id)
        return {"prompt": str(group_id)}, fresh_samples(
            [[group_id % 50 + 1]], settings.group_size, [group_id]
        )

    trace = Trace({"rollout-0": [0], "rollout-1": [0], "trainer": [0], "reward": []})
    scheduler = Scheduler(
        settings,
        SamplingParams(n=2, max_new_tokens=MAX_NEW_TOKENS),
        rollout,
        trainer,
        FakeScorer(rng),
        next_group,
        trace,
        on_version=lambda version: {"eval/version": float(version)},
        start_version=start_version,
        in_flight=None if in_flight is None else in_flight_from_json(in_flight, "test", None),
    )
    rollout.scheduler_version = lambda: scheduler.rollout_version
    logged: list[tuple[int, dict]] = []
    states: dict[int, dict] = {}
    errors: list[Exception] = []

    def run() -> None:
        try:
            for step, metrics in scheduler.run():
                # What a checkpoint taken now records, through JSON as it is written.
                state = json.loads(json.dumps(in_flight_to_json(scheduler.state_dict())))
                states[step] = state
                logged.append((step, metrics))
                scheduler.devices_to_trainer()  # as the driver does before a checkpoint
                trainer.save_checkpoint()
        except Exception as error:  # raised on the test's thread
            errors.append(error)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(timeout=60)
    assert not runner.is_alive(), "the scheduler did not terminate"
    if errors:
        raise errors[0]
    scheduler.drawn = drawn
    scheduler.states = states
    return scheduler, rollout, trainer, logged


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("partial", ["finish", "abort", "interrupt"])
def test_random_timings_keep_staleness_bounded_and_every_group_trained_once(
    k: int, partial: str
) -> None:
    for seed in range(12):
        dynamic, annotate = seed % 2 == 1, seed % 3 != 0
        # Rollout workers die in some runs: at random moments, or as syncs come due.
        kills = [{}, {}, {"kill_chance": 0.2}, {"kill_at_sync": True}][seed % 4]
        scheduler, rollout, trainer, logged = _run(
            seed, k, partial, dynamic, annotate, max_kills=3 if kills else 0, **kills
        )
        assert [step for step, _ in logged] == [1, 2, 3, 4, 5]
        # Every worker lost was replaced once, and counted in its step's metrics.
        assert len(trainer.replacements) == len(rollout.kills) <= 3
        assert sum(m["rollout/workers_replaced"] for _, m in logged) == len(rollout.kills)
        assert all(m["eval/version"] == step for step, m in logged)
        seen: set[tuple[int, int]] = set()
        for step, samples in trainer.trained.items():
            for sample in samples:
                assert step - 1 - sample.policy_version <= k
                assert sample.token_versions == sorted(sample.token_versions)
                key = (sample.group_id, sample.index)
                assert key not in seen, f"sample {key} trained twice"
                seen.add(key)
                expected = [token_at(sample, p) for p in range(len(sample.response_ids))]
                assert sample.response_ids == expected, "a resumed sample lost its prefix"
                prefix = rollout.aborted_prefixes.get(key)
                if prefix is not None:
                    assert sample.response_ids[: len(prefix)] == prefix
        for step, metrics in logged:
            kept = int(metrics["rollout/kept_groups"])
            assert len(trainer.trained.get(step, [])) == kept * 2
            assert metrics["rollout/staleness_max"] <= k
            if not dynamic:
                assert kept == 3 and metrics["rollout/generated_groups"] == 3
            # Counts add up over scoring calls: every scored sample of the step, once.
            assert metrics["reward/errors"] == metrics["rollout/generated_groups"] * 2
        # No group lost or duplicated: every group started went to exactly one step.
        started = sum(int(m["rollout/generated_groups"]) for _, m in logged)
        assert started == scheduler._num_groups
        if partial == "finish":  # every sample generated under the version it started with
            assert not rollout.aborted_prefixes
        if partial != "interrupt":  # the syncs waited for the generation in flight
            assert rollout.num_interrupts == 0


def _overlap(scheduler: Scheduler) -> float:
    return scheduler.trace.summary(0.0, time.perf_counter()).get("perf/overlap_fraction", 0.0)


def _outcome(scheduler: Scheduler, trainer: FakeTrainer, logged: list, after: int = 0) -> dict:
    """What a run computed after step `after`, timings aside: every step's metrics, the
    samples trained (tokens, log-probs, versions, in order) and the annotate calls."""
    return {
        "metrics": [
            (step, {k: v for k, v in m.items() if not is_measurement(k)})
            for step, m in logged
            if step > after
        ],
        "trained": {
            step: [(s.group_id, s.index, s.response_ids, s.logprobs, s.token_versions) for s in ss]
            for step, ss in trainer.trained.items()
            if step > after
        },
        "annotated": [call for call in trainer.annotate_calls if call[0] >= after],
        "drawn": scheduler.drawn,
    }


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("partial", ["finish", "abort"])
def test_runs_whose_timings_differ_train_and_log_the_same(k: int, partial: str) -> None:
    for dynamic, annotate in [(False, True), (True, False), (True, True)]:
        outcomes = []
        for seed in (1, 2, 3):
            scheduler, _, trainer, logged = _run(seed, k, partial, dynamic, annotate)
            outcomes.append(_outcome(scheduler, trainer, logged))
        assert outcomes[0] == outcomes[1] == outcomes[2]
        if annotate:  # each step annotated once, whole, at the version before it
            assert [version for version, _ in outcomes[0]["annotated"]] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("partial", ["finish", "abort"])
def test_a_scheduler_resumed_at_any_sync_continues_exactly(k: int, partial: str) -> None:
    dynamic = partial == "abort"
    scheduler, _, trainer, logged = _run(1, k, partial, dynamic, annotate=True)
    for step in range(1, 5):
        resumed = _run(
            seed=10 + step,
            k=k,
            partial=partial,
            dynamic=dynamic,
            annotate=True,
            start_version=step,
            in_flight=scheduler.states[step],
        )
        resumed_outcome = _outcome(resumed[0], resumed[2], resumed[3])
        original = _outcome(scheduler, trainer, logged, after=step)
        assert resumed_outcome["metrics"] == original["metrics"]
        assert resumed_outcome["trained"] == original["trained"]
        assert resumed_outcome["annotated"] == original["annotated"]
        # The resumed run draws prompts from where the original stood at that sync.
        first_new = scheduler.states[step]["next_group_id"]
        assert resumed[0].drawn == [g for g in scheduler.drawn if g >= first_new]


def _auto_points_replay(k: int, partial: str, dynamic: bool, percentile: int) -> list:
    """Three runs at abort_every auto train the same; the point in force after each step's
    sync is numpy's nearest-rank `percentile` of that step's lengths. Returns the runs."""
    runs = [
        _run(seed, k, partial, dynamic=dynamic, annotate=False, abort_every="auto")
        for seed in (1, 2, 3)
    ]
    outcomes = [_outcome(scheduler, trainer, logged) for scheduler, _, trainer, logged in runs]
    assert outcomes[0] == outcomes[1] == outcomes[2]
    scheduler, _, trainer, logged = runs[0]
    for step, metrics in logged:
        lengths = [len(sample.response_ids) for sample in trainer.trained[step]]
        expected = int(np.percentile(lengths, percentile, method="inverted_cdf"))
        assert scheduler.states[step]["abort_every"] == metrics["rollout/abort_every"] == expected
    return runs


def test_auto_abort_points_are_the_last_synced_steps_95th_percentile_and_runs_replay() -> None:
    aborted = 0
    for k in (1, 2):
        runs = _auto_points_replay(k, "abort", dynamic=True, percentile=95)
        scheduler, rollout, trainer, logged = runs[0]
        aborted += sum(len(r[1].aborted_prefixes) for r in runs)
        # A run resumed at a sync stops its samples where the original did.
        resumed = _run(
            seed=9, k=k, partial="abort", dynamic=True, annotate=False, abort_every="auto",
            start_version=2, in_flight=scheduler.states[2],
        )  # fmt: skip
        original = _outcome(scheduler, trainer, runs[0][3], after=2)
        assert _outcome(resumed[0], resumed[2], resumed[3])["trained"] == original["trained"]
    assert aborted > 0, "no sample reached an auto abort point: the path went untested"


def test_a_resumed_run_may_stop_before_the_steps_its_checkpoint_had_in_flight() -> None:
    # At step 2 with k = 2, groups of steps 3 and 4 are in flight; resumed with num_steps 3
    # (run length is a change a resume may make), step 3 trains the groups the checkpoint
    # held for it and step 4's are left out. (Later groups differ from the longer run's: the
    # ids step 4 took there go to step 3's replacements.)
    scheduler, _, original, _ = _run(1, k=2, partial="abort", dynamic=True, annotate=True)
    state = scheduler.states[2]
    assert any(group["step"] == 4 for group in state["groups"])
    _, _, trainer, logged = _run(
        seed=7,
        k=2,
        partial="abort",
        dynamic=True,
        annotate=True,
        start_version=2,
        in_flight=state,
        num_steps=3,
    )
    assert [step for step, _ in logged] == [3] and list(trainer.trained) == [3]
    held = {g["group_id"] for g in state["groups"] if g["step"] == 3}
    held &= {sample.group_id for sample in original.trained[3]}
    assert held and held <= {sample.group_id for sample in trainer.trained[3]}


def test_on_policy_never_trains_while_generating() -> None:
    scheduler, _, _, logged = _run(seed=3, k=0, partial="finish", dynamic=False, annotate=False)
    assert all(m["rollout/staleness_max"] == 0 for _, m in logged)
    assert _overlap(scheduler) == 0.0


def test_staleness_one_generates_the_next_step_while_training() -> None:
    runs = [_run(seed, k=1, partial="finish", dynamic=False, annotate=False) for seed in range(4)]
    assert max(_overlap(scheduler) for scheduler, *_ in runs) > 0.0


@pytest.mark.parametrize("partial", ["abort", "interrupt"])
def test_partial_samples_resume_with_newer_tokens(partial: str) -> None:
    resumed = 0
    for seed in range(20):
        _, rollout, trainer, _ = _run(seed, k=2, partial=partial, dynamic=False, annotate=False)
        for samples in trainer.trained.values():
            resumed += sum(len(set(s.token_versions)) > 1 for s in samples)
    assert resumed > 0, "no sample stopped partial: the path went untested"


def test_time_sliced_engines_and_trainer_take_turns_holding_the_devices() -> None:
    # The fakes assert the rest at every call: no generation, and no KV cache back, while the
    # trainer's state is on the devices; weights loaded only once the engines have them back.
    for seed in range(6):
        _, rollout, trainer, logged = _run(
            seed, k=0, partial="finish", dynamic=seed % 2 == 1, annotate=True, release_memory=True
        )
        assert len(logged) == 5
        assert trainer.rollout_asleep_at_train == [True] * 5
        assert all(trainer.rollout_asleep_when_computing)
        assert len(trainer.rollout_asleep_when_computing) >= 10  # annotate and train each step
        assert trainer.num_releases >= 5  # after every push
        # The run ends on a checkpoint (one after every step here): the devices are the trainer's.
        assert trainer.num_checkpoints == 5
        assert rollout.asleep and trainer.on_device


def test_time_sliced_devices_go_back_to_the_engines_after_a_lost_worker_is_replaced() -> None:
    replaced = 0
    for seed in range(8):
        _, rollout, trainer, logged = _run(
            seed,
            k=0,
            partial="finish",
            dynamic=False,
            annotate=True,
            release_memory=True,
            kill_chance=0.3,
            max_kills=2,
        )
        assert len(logged) == 5
        assert all(trainer.rollout_asleep_when_computing)
        replaced += len(trainer.replacements)
    assert replaced > 0, "no worker was lost: the replacement path went untested"


def test_workers_lost_while_a_step_trains_are_replaced_on_the_rollouts_version_exactly() -> None:
    # Killed as a step finishes training (the trainer then holds newer weights than the
    # rollout) or at random moments: the replacement streams the trainer's copy of the last
    # push, the lost groups generate again under the version they started with, and the run
    # trains and logs what a run without losses did.
    def outcome(run: tuple) -> dict:
        result = _outcome(run[0], run[2], run[3])
        for _, metrics in result["metrics"]:
            metrics.pop("rollout/workers_replaced")
        return result

    lost_after_training = 0
    for k, partial in [(1, "finish"), (2, "finish"), (1, "abort"), (2, "abort")]:
        expected = outcome(_run(1, k, partial, dynamic=True, annotate=True))
        for seed in range(12):
            kills = {"kill_at_sync": True} if seed % 2 else {"kill_chance": 0.3}
            run = _run(seed, k, partial, dynamic=True, annotate=True, max_kills=3, **kills)
            assert outcome(run) == expected, (k, partial, seed)
            rollout, trainer = run[1], run[2]
            assert [version for _, version in trainer.replacements] == [
                served for *_, served in rollout.kills
            ]
            lost_after_training += sum(trained > served for _, trained, served in rollout.kills)
    assert lost_after_training > 0, "no worker died after a step trained: the copy went unused"


def test_a_worker_lost_while_the_trainer_is_idle_is_replaced_on_the_rollout_weights() -> None:
    # On-policy nothing trains while generating: every replacement streams the version the
    # rollout serves, since the trainer holds just that one.
    for seed in range(4):
        _, rollout, trainer, logged = _run(
            seed, k=0, partial="finish", dynamic=False, annotate=False, kill_chance=0.3, max_kills=3
        )
        assert len(logged) == 5 and rollout.kills
        lost = [(worker, served) for worker, _, served in rollout.kills]
        assert sorted(trainer.replacements) == sorted(lost)


def test_losing_more_rollout_workers_than_the_cap_fails_the_run() -> None:
    with pytest.raises(RuntimeError, match=r"rollout worker \d died generating: 2 rollout .*= 1"):
        _run(
            seed=0,
            k=1,
            partial="finish",
            dynamic=False,
            annotate=False,
            kill_chance=1.0,
            max_kills=10,
            max_restarts=1,
        )


# -- partial_rollout "carry" (rl.run.scheduler.carry_over) ----------------------------------


def _token_ages(samples, step: int) -> list[int]:
    return [step - 1 - v for sample in samples for v in sample.token_versions if v >= 0]


@pytest.mark.parametrize("k", [0, 1])
def test_carry_trains_the_same_groups_and_tokens_under_any_timing_within_both_bounds(
    k: int,
) -> None:
    for dynamic, annotate, kills in [
        (False, True, {}),
        (True, False, {}),
        (False, False, {"kill_chance": 0.2}),
        (True, True, {"kill_at_sync": True}),
    ]:
        runs = [
            _run(seed, k, "carry", dynamic, annotate, max_kills=3 if kills else 0, **kills)
            for seed in (1, 2, 3)
        ]
        outcomes = [_outcome(scheduler, trainer, logged) for scheduler, _, trainer, logged in runs]
        if kills:  # how many workers died, and in which step, is the timing's
            for outcome in outcomes:
                for _, metrics in outcome["metrics"]:
                    del metrics["rollout/workers_replaced"]
        assert outcomes[0] == outcomes[1] == outcomes[2]
        scheduler, rollout, trainer, logged = runs[0]
        assert [step for step, _ in logged] == [1, 2, 3, 4, 5]
        seen: set[tuple[int, int]] = set()
        carried = 0
        for step, samples in trainer.trained.items():
            # groups_per_step x group_size, whatever finished first; with dynamic sampling
            # fewer once 6 groups (its draws) were scored since the last step took its own.
            if dynamic:
                assert len(samples) <= 3 * 2
            else:
                assert len(samples) == 3 * 2
            ages = _token_ages(samples, step)
            # Both bounds, on every trained token: the age, and the share older than k.
            assert max(ages) <= 3
            assert sum(age > k for age in ages) <= 0.5 * len(ages)
            for sample in samples:
                key = (sample.group_id, sample.index)
                assert key not in seen, f"sample {key} trained twice"
                seen.add(key)
                expected = [token_at(sample, p) for p in range(len(sample.response_ids))]
                assert sample.response_ids == expected, "a resumed sample lost its prefix"
                assert sample.token_versions == sorted(sample.token_versions)
                carried += len(set(sample.token_versions)) > 1
        assert carried, "no trained sample spanned two versions: carry-over went untested"
        for step, metrics in logged:
            assert metrics["carry/max_token_age"] == max(_token_ages(trainer.trained[step], step))
        assert rollout.num_interrupts == 0


def test_carry_steps_take_the_groups_that_finish_first_on_the_token_clock() -> None:
    """One epoch, every group fresh: a step takes the groups whose longest sample is
    shortest (ids breaking ties), read off the fake engine's lengths, however they
    arrived."""
    from rl.types import Sample
    from tests.unit.rl.run.scheduler.fakes import response_length

    scheduler, _, trainer, _ = _run(
        4, 1, "carry", False, False, abort_every=MAX_NEW_TOKENS, groups_in_flight=6, num_steps=1
    )
    # Groups 0-5 started together; each ran to its end within the first epoch.
    longest = {
        group: max(response_length(Sample([1], group, index)) for index in range(2))
        for group in range(6)
    }
    first = sorted(longest, key=lambda group: (longest[group], group))[:3]
    assert sorted({sample.group_id for sample in trainer.trained[1]}) == sorted(first)


@pytest.mark.parametrize("k", [0, 1])
def test_carry_resumed_at_any_sync_continues_exactly(k: int) -> None:
    scheduler, _, trainer, logged = _run(1, k, "carry", dynamic=True, annotate=True)
    for step in range(1, 5):
        resumed = _run(
            seed=10 + step, k=k, partial="carry", dynamic=True, annotate=True,
            start_version=step, in_flight=scheduler.states[step],
        )  # fmt: skip
        resumed_outcome = _outcome(resumed[0], resumed[2], resumed[3])
        original = _outcome(scheduler, trainer, logged, after=step)
        assert resumed_outcome["metrics"] == original["metrics"]
        assert resumed_outcome["trained"] == original["trained"]
        first_new = scheduler.states[step]["next_group_id"]
        assert resumed[0].drawn == [g for g in scheduler.drawn if g >= first_new]


def test_carry_auto_abort_points_are_the_last_pushed_steps_median_and_runs_replay() -> None:
    runs = _auto_points_replay(1, "carry", dynamic=False, percentile=50)
    assert runs[0][1].aborted_prefixes, "no sample reached an auto abort point"


STREAMED_MODES = [(0, "finish"), (1, "finish"), (2, "abort"), (1, "carry")]


def _chunks(step_groups: list[int], size: int) -> list[tuple[int, ...]]:
    return [tuple(step_groups[i : i + size]) for i in range(0, len(step_groups), size)]


@pytest.mark.parametrize("k, partial", STREAMED_MODES)
@pytest.mark.parametrize("chunk", [1, 2])
def test_streaming_trains_each_chunk_as_it_completes_and_the_step_as_a_whole_step_would(
    k: int, partial: str, chunk: int
) -> None:
    """Streamed, a step's groups reach the trainer in chunks of `chunk` consecutive groups (by
    id, among those started for the step), each chunk once, as soon as all its groups are
    scored, at the version before the step; what is trained and logged is the unstreamed
    run's. And the trainer does start while the step still generates."""
    started_early = 0
    for dynamic, annotate in [(False, True), (True, False), (True, True)]:
        whole = _run(1, k, partial, dynamic, annotate)
        expected = _outcome(whole[0], whole[2], whole[3])
        for seed in (1, 2, 3):
            scheduler, rollout, trainer, logged = _run(
                seed, k, partial, dynamic, annotate, streaming=True, stream_groups=chunk
            )
            outcome = _outcome(scheduler, trainer, logged)
            assert outcome["metrics"] == expected["metrics"]
            assert outcome["trained"] == expected["trained"]
            for step, samples in trainer.trained.items():
                groups = [sample.group_id for sample in samples[::2]]
                calls = [ids for version, ids in trainer.stream_calls if version == step - 1]
                assert sorted(group for ids in calls for group in ids) == groups
                if not dynamic:  # every group started for the step is kept: chunks by id
                    assert sorted(calls) == _chunks(groups, chunk)
            started_early += trainer.streamed_while_generating
    if partial != "carry":  # carry trains a step at a boundary, with nothing generating
        assert started_early, "no chunk was streamed while its step's others generated"


@pytest.mark.parametrize("k, partial", STREAMED_MODES)
def test_a_streamed_run_resumed_at_any_sync_continues_exactly(k: int, partial: str) -> None:
    """Chunks streamed before a checkpoint are streamed again after the resume (gradients are
    not checkpointed), the same groups at the same version."""
    scheduler, _, trainer, logged = _run(
        1, k, partial, dynamic=True, annotate=True, streaming=True, stream_groups=2
    )
    for step in range(1, 5):
        resumed = _run(
            seed=10 + step, k=k, partial=partial, dynamic=True, annotate=True,
            start_version=step, in_flight=scheduler.states[step], streaming=True,
            stream_groups=2,
        )  # fmt: skip
        resumed_outcome = _outcome(resumed[0], resumed[2], resumed[3])
        original = _outcome(scheduler, trainer, logged, after=step)
        assert resumed_outcome["metrics"] == original["metrics"]
        assert resumed_outcome["trained"] == original["trained"]
        after = [call for call in trainer.stream_calls if call[0] >= step]
        assert sorted(resumed[2].stream_calls) == sorted(after)
