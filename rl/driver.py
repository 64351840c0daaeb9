"""The single controller: builds the roles, then hands the RL loop to the scheduler.

The loop itself (rl.scheduler) reads: generate and score groups as admission allows, annotate
them (old/reference log-probs, values), train a step, sync its weights; with
scheduler.max_staleness > 0 generation of the next steps overlaps training. Held-out greedy
evaluation runs every `run.eval_every` versions, and the final policy is exported to HF.
"""

from __future__ import annotations

import time
from pathlib import Path

from transformers import AutoTokenizer

from rl.cluster import init_ray, reserve
from rl.config import Config
from rl.critic_group import CriticGroup
from rl.data import PromptStream, load_split
from rl.evaluation import evaluate
from rl.experience import StreamingScorer, TrainerSide
from rl.metrics import MetricsLogger
from rl.prompts import encode_prompt
from rl.rewards import RewardScorer
from rl.rollout_group import RolloutGroup
from rl.scheduler import Scheduler, Settings
from rl.tasks import get_task
from rl.trace import Trace
from rl.train_group import TrainGroup
from rl.types import SamplingParams
from rl.weight_sync import WeightSync
from trainer.base_model import ensure_base


def train(cfg: Config) -> dict[str, float]:
    """Run `cfg` to the end; returns the final step's metrics (with eval/accuracy_before and
    the whole run's run/busy_fraction and run/overlap_fraction)."""
    ensure_base(cfg)
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    task = get_task(cfg.data.task)
    prompts_stream = PromptStream(load_split(cfg.data, "train"), seed=cfg.run.seed)
    test_examples = list(load_split(cfg.data, "test"))[: cfg.run.num_eval_prompts]
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    init_ray()
    placement = reserve(cfg)
    plan, num_roles = placement.plan, placement.plan.num_roles_sharing
    rollout = RolloutGroup(cfg, placement, num_roles_sharing=num_roles)
    trainers = TrainGroup(cfg, placement, num_roles_sharing=num_roles)
    critic = (
        CriticGroup(cfg, placement, num_roles_sharing=num_roles) if "critic" in plan.roles else None
    )
    weight_sync = WeightSync(cfg, trainers, rollout)
    reward_bundle = plan.roles.get("reward_model", [0])[0]
    scorer = StreamingScorer(
        cfg, RewardScorer(cfg.reward, task, placement.actor_options(reward_bundle, num_roles))
    )
    trainer_side = TrainerSide(cfg, trainers, critic, weight_sync, tokenizer.pad_token_id)
    trace = Trace(plan.trace_lanes())
    logger = MetricsLogger(cfg, run_dir)
    rollout_lanes = [lane for lane in trace.lanes if lane.startswith("rollout")]

    def held_out_accuracy() -> float:
        for lane in rollout_lanes:
            trace.begin(lane, "eval")
        accuracy = evaluate(rollout, tokenizer, task, test_examples, cfg)
        for lane in rollout_lanes:
            trace.end(lane, "eval")
        return accuracy

    def on_version(version: int) -> dict[str, float]:
        due = version == cfg.run.num_steps or (
            cfg.run.eval_every and version % cfg.run.eval_every == 0
        )
        return {"eval/accuracy": held_out_accuracy()} if due else {}

    def next_prompt() -> tuple[dict, list[int]]:
        example = prompts_stream.next_batch(1)[0]
        return example, encode_prompt(tokenizer, example["prompt"])

    accuracy_before = held_out_accuracy()
    logger.print(f"held-out greedy accuracy before RL: {accuracy_before:.1%}")
    logger.log(0, {"eval/accuracy": accuracy_before})
    sampling = SamplingParams(
        n=cfg.algorithm.group_size,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
        seed=cfg.run.seed * 100_003,  # group ids are unique in a run, so every sample differs
    )
    scheduler = Scheduler(
        Settings.from_config(cfg, placement.use_gpu),
        sampling,
        rollout,
        trainer_side,
        scorer,
        next_prompt,
        trace,
        on_version,
    )
    start = time.perf_counter()
    metrics: dict[str, float] = {}
    for step, metrics in scheduler.run():
        logger.log(step, metrics)
    run_summary = trace.summary(start, time.perf_counter())
    metrics["eval/accuracy_before"] = accuracy_before
    metrics.update({key.replace("perf/", "run/"): value for key, value in run_summary.items()})
    logger.print(
        f"held-out greedy accuracy: {accuracy_before:.1%} before -> "
        f"{metrics['eval/accuracy']:.1%} after {cfg.run.num_steps} steps; the device pool was "
        f"busy {metrics.get('run/busy_fraction', 0):.0%} of the time, generation and training "
        f"overlapped {metrics['run/overlap_fraction']:.0%}"
    )
    if cfg.run.export_hf:
        with trace.span("trainer", "checkpoint"):
            export_dir = trainers.export_hf(run_dir / "hf")
        logger.print(f"final policy exported to {export_dir}")
    trace.write(run_dir / "trace.json")
    logger.close()
    trainer_side.close()
    weight_sync.close()
    scorer.close()
    placement.release()
    return metrics
