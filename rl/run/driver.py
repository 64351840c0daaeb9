"""The single controller: builds the roles, then hands the RL loop to the scheduler.

The loop itself (rl.run.scheduler.loop) reads: generate and score groups as admission allows, annotate
them (old/reference log-probs, values), train a step, sync its weights; with
scheduler.max_staleness > 0 generation of the next steps overlaps training. Held-out greedy
evaluation runs every `run.eval_every` versions (never with `run.num_eval_prompts=0`),
checkpoints every `checkpoint.every` steps and at the end, and the final policy is exported
to HF.

What goes wrong is absorbed here: a SIGTERM/SIGINT stops after the current step with a
checkpoint; a trainer or critic rank that dies rebuilds every role from the last checkpoint;
steps whose loss or gradient is not finite are skipped, and too many in a row stop the run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import datasets
import ray
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from rl.agents.env_pool import close_env_pools
from rl.base.build import ensure_base
from rl.checkpoint.base_weights import check_base, weight_hashes
from rl.checkpoint.in_flight import in_flight_from_json, in_flight_to_json
from rl.checkpoint.resume import DRIVER_STATE
from rl.checkpoint.run_state import DriverState, RunCheckpoints
from rl.checkpoint.store import checkpoint_root, newest_valid
from rl.cluster.reservation import init_ray, reserve
from rl.cluster.rollout_replicas import RolloutReplicas
from rl.cluster.trainer_ranks import CriticRanks, PolicyRanks, TeacherRanks
from rl.config import Config
from rl.config.recipe import check_teacher
from rl.data.loading import (
    Examples,
    PromptStream,
    filter_long_prompts,
    load_examples,
    prompt_lengths,
    prompt_token_limit,
)
from rl.data.prompts import padding_id
from rl.data.tasks import get_task
from rl.observe.actor_logs import actor_log_file
from rl.observe.metrics import MetricsLogger
from rl.observe.trace import Trace
from rl.rewards import RewardScorer
from rl.run.directory import RunLock
from rl.run.evaluation import evaluate
from rl.run.experience import StreamingScorer, TrainerSide
from rl.run.groups import GroupStarter
from rl.run.preemption import StopRequest
from rl.run.scheduler.loop import Scheduler, Settings
from rl.run.scheduler.prompt_groups import InFlight
from rl.sandbox import configure as configure_sandbox
from rl.sandbox_report import isolation_report
from rl.sync.weight_sync import WeightSync
from rl.types import Sample, SamplingParams


class RunAborted(RuntimeError):
    """The run stopped itself; the message says why and what was saved."""


def train(cfg: Config, resume_from: Path | None = None) -> dict[str, float]:
    """Run `cfg` to the end, from checkpoint `resume_from` if given (see rl.checkpoint.resume); returns
    the last step's metrics (with the run/* totals, and eval/accuracy_before unless the run
    started with evaluation off)."""
    # Bad config or data rows stop the run here, before a base is built or Ray starts.
    limit = prompt_token_limit(cfg)
    examples = {split: load_examples(cfg.data, split) for split in ("train", "test")}
    # So does a sandbox that `sandbox.require` refuses; the isolation users' code gets is shown.
    configure_sandbox(cfg.sandbox)
    print(isolation_report(cfg), flush=True)
    ensure_base(cfg)
    # A base the run just built is the student whose tokenizer the teacher must share.
    check_teacher(cfg, f"run {cfg.run.name}")
    base_hashes = _base_hashes(cfg, resume_from)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    data = _Data.of(cfg, examples, tokenizer, limit)
    run_dir = cfg.run.directory()
    stop = StopRequest()
    num_restarts = 0
    with RunLock(run_dir), stop.installed():
        connected = init_ray(cfg.run.verbose)
        stop.install()
        # Ray is shut down inside the block: left to its atexit hook it would run after our
        # handlers are gone, and a second signal then would kill the process mid-shutdown.
        try:
            while True:
                try:
                    return _run(
                        cfg, run_dir, data, tokenizer, resume_from, stop, num_restarts, base_hashes
                    )
                except ray.exceptions.RayActorError as e:
                    num_restarts += 1
                    if num_restarts > cfg.faults.max_trainer_restarts:
                        raise RunAborted(
                            f"a trainer-side actor died {num_restarts} times "
                            f"(faults.max_trainer_restarts={cfg.faults.max_trainer_restarts}); "
                            f"last: {e}"
                        ) from e
                    resume_from, _ = newest_valid(checkpoint_root(run_dir))
                    base_hashes = _base_hashes(cfg, resume_from)
                    print(
                        f"an actor died ({type(e).__name__}); rebuilding every role from "
                        f"{resume_from or 'the start'} (restart {num_restarts}/"
                        f"{cfg.faults.max_trainer_restarts})",
                        flush=True,
                    )
        finally:
            if connected:
                ray.shutdown()


def _base_hashes(cfg: Config, resume_from: Path | None) -> dict[str, str]:
    """The hashes of model.path's weight files, which the roles are about to load (hashed
    once while they stay unchanged); CheckpointError if they are not the ones `resume_from`
    was trained from (the CLI checked already, unless the base was built since)."""
    model_dir = Path(cfg.model.path)
    if resume_from is not None:
        check_base(resume_from, model_dir)
    return weight_hashes(model_dir)


@dataclass
class _Data:
    """The run's prompts once bad rows and over-long prompts are left out, and those counts."""

    train: datasets.Dataset
    test_examples: list[dict]
    counts: dict[str, float]

    @classmethod
    def of(
        cls,
        cfg: Config,
        examples: dict[str, Examples],
        tokenizer: PreTrainedTokenizerBase,
        limit: int,
    ) -> _Data:
        splits, counts = {}, {}
        for split, loaded in examples.items():
            splits[split], num_long = filter_long_prompts(
                loaded.dataset, partial(prompt_lengths, tokenizer), limit, loaded.source
            )
            counts[f"data/{split}_skipped_rows"] = float(loaded.skipped_rows)
            counts[f"data/{split}_filtered_long_prompts"] = float(num_long)
        test_examples = list(splits["test"])[: cfg.run.num_eval_prompts]
        return cls(splits["train"], test_examples, counts)


def _run(
    cfg: Config,
    run_dir: Path,
    data: _Data,
    tokenizer: PreTrainedTokenizerBase,
    resume_from: Path | None,
    stop: StopRequest,
    num_restarts: int,
    base_hashes: dict[str, str],
) -> dict:
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    task = get_task(cfg.data.task)
    prompts_stream = PromptStream(data.train, seed=cfg.run.seed)
    test_examples = data.test_examples
    placement = reserve(cfg)
    closers = [placement.release]
    try:
        plan, num_roles = placement.plan, placement.plan.num_roles_sharing
        rollout = RolloutReplicas(cfg, placement, num_roles_sharing=num_roles)
        closers.append(rollout.close)
        for line in rollout.describe_devices():
            print(line, flush=True)
        trainers = PolicyRanks(cfg, placement, num_roles_sharing=num_roles)
        critic = None
        if "critic" in plan.roles:
            critic = CriticRanks(cfg, placement, num_roles_sharing=num_roles)
        teacher = None
        if "teacher" in plan.roles:
            teacher = TeacherRanks(cfg, placement, num_roles_sharing=num_roles)
        weight_sync = WeightSync(cfg, trainers, rollout)
        closers.append(weight_sync.close)
        print(
            f"weight sync: {weight_sync.transport} transport, trainer and rollout on "
            f"{weight_sync.num_nodes} node(s)",
            flush=True,
        )
        reward_bundle = plan.roles.get("reward_model", [0])[0]
        judge_bundle = plan.roles.get("judge", [0])[0]
        scorer = StreamingScorer(
            cfg,
            RewardScorer(
                cfg.reward,
                task,
                placement.actor_options(reward_bundle, num_roles),
                judge_options=placement.actor_options(judge_bundle, num_roles),
                retries=cfg.faults.reward_model_retries,
                log_file=actor_log_file(cfg, "reward-workers"),
            ),
        )
        closers.append(scorer.close)
        trainer_side = TrainerSide(
            cfg, trainers, critic, weight_sync, padding_id(tokenizer), teacher=teacher
        )
        closers.append(trainer_side.close)
        checkpoints = RunCheckpoints(cfg, run_dir, trainers, critic, base_hashes)
        state = None
        if resume_from is not None:
            state = checkpoints.restore(resume_from)
            prompts_stream.load_state_dict(state.prompt_stream)
            trainer_side.kl_controller.coef = state.kl_coef
            weight_sync.push(state.step)
        # A fault restart continues the run's logs (its metrics file and tracker runs) after
        # the checkpoint it restored, or from the start (-1) without one.
        resume_step = state.step if state else (-1 if num_restarts else None)
        logger = MetricsLogger(cfg, run_dir, resume_step=resume_step)
        closers.append(logger.close)
        # An agent's tool calls run on the rollout workers' CPUs: a lane without devices.
        lanes = plan.trace_lanes() | ({"tools": []} if cfg.agent.enabled else {})
        trace = Trace(lanes, on_phases=logger.show_phases)
        closers.append(close_env_pools)  # a user's environment's workers, if _Loop starts them
        loop = _Loop(cfg, rollout, tokenizer, task, test_examples, prompts_stream, trace, logger)
        scheduler = Scheduler(
            Settings.from_config(cfg, placement.use_gpu),
            loop.sampling(),
            rollout,
            trainer_side,
            scorer,
            loop.next_group,
            trace,
            loop.on_version,
            start_version=state.step if state else 0,
            in_flight=loop.in_flight(state, resume_from),
        )
        if state is None:
            kl_coef = trainer_side.kl_controller.coef
            accuracy = loop.accuracy_before(data.counts)
            state = DriverState(0, prompts_stream.state_dict(), kl_coef, accuracy)
        elif state.step:
            logger.print(f"resumed from {resume_from} at step {state.step}")
        metrics = _train_steps(cfg, scheduler, trainer_side, checkpoints, loop, state, stop)
        if cfg.run.export_hf and not stop.signal_name:
            scheduler.devices_to_trainer()
            with trace.span("trainer", "checkpoint"):
                export_dir = trainers.export_hf(run_dir / "hf")
            logger.print(f"final policy exported to {export_dir}")
        trace.write(run_dir / "trace.json")
        return metrics
    finally:
        for close in reversed(closers):
            close()


def _train_steps(
    cfg: Config,
    scheduler: Scheduler,
    trainer_side: TrainerSide,
    checkpoints: RunCheckpoints,
    loop: _Loop,
    state: DriverState,
    stop: StopRequest,
) -> dict[str, float]:
    """Train the remaining steps, checkpointing as configured; returns the last metrics."""
    logger = loop.logger
    start = time.perf_counter()
    metrics: dict[str, float] = {}
    for step, metrics in scheduler.run():
        # Asked here, not by the scheduler: its ports stay what its fakes implement.
        metrics["memory/rollout_peak_mb"] = loop.rollout.peak_memory_mb()
        logger.log(step, metrics)
        skipped = metrics.get("actor/nonfinite_skipped", 0) + metrics.get(
            "critic/nonfinite_skipped", 0
        )
        state.num_nonfinite_in_a_row = state.num_nonfinite_in_a_row + 1 if skipped else 0
        state.step, state.kl_coef = step, trainer_side.kl_controller.coef
        state.in_flight = in_flight_to_json(scheduler.state_dict())
        state.prompt_stream = loop.prompts_stream.state_dict()
        every = cfg.checkpoint.every
        last = step == cfg.run.num_steps and cfg.checkpoint.save_final
        bad = state.num_nonfinite_in_a_row >= cfg.faults.max_nonfinite_steps
        if (every and step % every == 0) or last or stop.signal_name or bad:
            scheduler.devices_to_trainer()
            with loop.trace.span("trainer", "checkpoint"):
                path = checkpoints.save(state)
            logger.print(f"checkpoint written to {path}")
        if bad:
            raise RunAborted(
                f"{state.num_nonfinite_in_a_row} steps in a row (up to step {step}) had a "
                "NaN/inf loss or gradient and were skipped (faults.max_nonfinite_steps="
                f"{cfg.faults.max_nonfinite_steps}); the last good weights are in {path}. "
                "Check the rewards for NaN, or lower trainer.lr"
            )
        if stop.signal_name:
            logger.print(
                f"stopped by {stop.signal_name} after step {step}: checkpoint {path}; continue "
                "with `rl train RECIPE --resume auto`"
            )
            break
    run_summary = loop.trace.summary(start, time.perf_counter())
    if state.accuracy_before is not None:
        metrics["eval/accuracy_before"] = state.accuracy_before
    metrics.update({key.replace("perf/", "run/"): value for key, value in run_summary.items()})
    if "eval/accuracy" in metrics and not stop.signal_name:
        # A resume may turn evaluation on (run.num_eval_prompts) after a start without it.
        before = "" if state.accuracy_before is None else f"{state.accuracy_before:.1%} before -> "
        logger.print(
            f"held-out greedy accuracy: {before}"
            f"{metrics['eval/accuracy']:.1%} after {cfg.run.num_steps} steps; the device pool "
            f"was busy {metrics.get('run/busy_fraction', 0):.0%} of the time, generation and "
            f"training overlapped {metrics.get('run/overlap_fraction', 0):.0%}"
        )
    return metrics


class _Loop:
    """The driver's callbacks into the scheduler: prompts, evaluation, sampling."""

    def __init__(
        self,
        cfg: Config,
        rollout: RolloutReplicas,
        tokenizer: PreTrainedTokenizerBase,
        task: object,
        test_examples: list[dict],
        prompts_stream: PromptStream,
        trace: Trace,
        logger: MetricsLogger,
    ) -> None:
        self.cfg, self.rollout, self.task = cfg, rollout, task
        self.groups = GroupStarter(cfg, tokenizer)
        self.test_examples = test_examples
        self.prompts_stream, self.trace, self.logger = prompts_stream, trace, logger
        self._rollout_lanes = [lane for lane in trace.lanes if lane.startswith("rollout")]

    def sampling(self) -> SamplingParams:
        return SamplingParams.for_training(self.cfg)

    def next_group(self, group_id: int) -> tuple[dict, list[Sample]]:
        example = self.prompts_stream.next_batch(1)[0]
        return example, self.groups.start(example, group_id, self.cfg.algorithm.group_size)

    def in_flight(self, state: DriverState | None, checkpoint: Path | None) -> InFlight | None:
        """The scheduler's groups in flight that `checkpoint` recorded (None: a fresh start)."""
        if state is None or state.in_flight is None:
            return None
        where = f"{checkpoint / DRIVER_STATE} (in_flight)"
        return in_flight_from_json(state.in_flight, where, self.groups.env_class)

    @property
    def evaluates(self) -> bool:
        """Whether the run evaluates held-out accuracy: run.num_eval_prompts=0 turns it off."""
        return self.cfg.run.num_eval_prompts > 0

    def held_out_accuracy(self) -> float:
        for lane in self._rollout_lanes:
            self.trace.begin(lane, "eval")
        accuracy = evaluate(self.rollout, self.groups, self.task, self.test_examples, self.cfg)
        for lane in self._rollout_lanes:
            self.trace.end(lane, "eval")
        return accuracy

    def accuracy_before(self, data_counts: dict[str, float]) -> float | None:
        """Step 0's record: held-out accuracy (None with evaluation off), the data rows skipped
        or filtered, and the rollout's peak memory since it started."""
        accuracy = None
        if self.evaluates:
            accuracy = self.held_out_accuracy()
            self.logger.print(f"held-out greedy accuracy before RL: {accuracy:.1%}")
        dropped = {key: n for key, n in data_counts.items() if n}
        if dropped:
            self.logger.print(f"data rows left out: {dropped}")
        # The rollout's peak so far (startup, this evaluation) goes here, not into step 1's.
        peak = {"memory/rollout_peak_mb": self.rollout.peak_memory_mb()}
        held_out = {} if accuracy is None else {"eval/accuracy": accuracy}
        self.logger.log(0, {**held_out, **data_counts, **peak})
        return accuracy

    def on_version(self, version: int) -> dict[str, float]:
        every = self.cfg.run.eval_every
        due = version == self.cfg.run.num_steps or (every and version % every == 0)
        return {"eval/accuracy": self.held_out_accuracy()} if due and self.evaluates else {}
