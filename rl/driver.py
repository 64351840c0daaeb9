"""The single controller: one RL loop (GRPO family or PPO) that reads top to bottom.

generate + score -> (old/ref log-probs, values) -> advantages -> train -> sync weights -> log,
with held-out greedy evaluation every `run.eval_every` steps and an HF export at the end.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from rl.batching import build_batch
from rl.config import Config
from rl.critic_group import CriticGroup
from rl.data import PromptStream, load_split
from rl.evaluation import evaluate
from rl.experience import KLController, annotate_batch, collect_rollouts
from rl.metrics import MetricsLogger
from rl.rewards import RewardScorer
from rl.rollout_group import RolloutGroup
from rl.scheduler import colocate, init_ray
from rl.tasks import get_task
from rl.train_group import TrainGroup
from rl.types import SamplingParams
from rl.weight_sync import WeightSync
from trainer.base_model import ensure_base


def train(cfg: Config) -> dict[str, float]:
    """Run `cfg` to the end; returns the final step's metrics (with eval/accuracy_before)."""
    ensure_base(cfg)
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    task = get_task(cfg.data.task)
    prompts_stream = PromptStream(load_split(cfg.data, "train"), seed=cfg.run.seed)
    test_examples = list(load_split(cfg.data, "test"))[: cfg.run.num_eval_prompts]
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    init_ray()
    placement = colocate(cfg)
    num_roles = placement.plan.num_roles_sharing
    rollout = RolloutGroup(cfg, placement, num_roles_sharing=num_roles)
    trainers = TrainGroup(cfg, placement, num_roles_sharing=num_roles)
    has_critic = "critic" in placement.plan.roles
    critic = CriticGroup(cfg, placement, num_roles_sharing=num_roles) if has_critic else None
    weight_sync = WeightSync(cfg, trainers, rollout)
    # Reward models share bundle 0 like every colocated role.
    scorer = RewardScorer(cfg.reward, task, placement.actor_options(0, num_roles))
    logger = MetricsLogger(cfg, run_dir)
    sampling = SamplingParams(
        n=cfg.algorithm.group_size,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
    )
    kl_controller = KLController(cfg.algorithm)

    accuracy_before = evaluate(rollout, tokenizer, task, test_examples, cfg, version=0)
    logger.print(f"held-out greedy accuracy before RL: {accuracy_before:.1%}")
    logger.log(0, {"eval/accuracy": accuracy_before})
    metrics: dict[str, float] = {}
    for step in range(1, cfg.run.num_steps + 1):
        step_start = time.perf_counter()
        sampling.seed = cfg.run.seed * 100_003 + step
        rollouts = collect_rollouts(
            cfg, rollout, scorer, prompts_stream, tokenizer, sampling, version=step - 1
        )
        metrics = dict(rollouts.metrics)
        gen_s = time.perf_counter() - step_start

        train_start = time.perf_counter()
        if rollouts.samples:  # dynamic sampling found no informative group: nothing to learn
            batch = build_batch(rollouts.samples, pad_id=tokenizer.pad_token_id)
            scores = torch.tensor(rollouts.scores)
            metrics.update(annotate_batch(cfg, batch, scores, trainers, critic, kl_controller))
            metrics.update(trainers.train_step(batch))
            if critic is not None:
                metrics.update(critic.train_step(batch))
        sync_start = time.perf_counter()
        metrics.update(weight_sync.push(version=step))
        sync_s = time.perf_counter() - sync_start
        metrics["rollout/version"] = min(rollout.versions())

        num_tokens = sum(len(s.response_ids) for s in rollouts.samples)
        metrics.update(
            {
                "perf/gen_tokens_per_s": num_tokens / gen_s,
                "time/generate_s": gen_s,
                "time/train_s": sync_start - train_start,
                "time/sync_s": sync_s,
            }
        )
        if step == cfg.run.num_steps or (cfg.run.eval_every and step % cfg.run.eval_every == 0):
            metrics["eval/accuracy"] = evaluate(rollout, tokenizer, task, test_examples, cfg, step)
        metrics["time/step_s"] = time.perf_counter() - step_start
        logger.log(step, metrics)

    metrics["eval/accuracy_before"] = accuracy_before
    logger.print(
        f"held-out greedy accuracy: {accuracy_before:.1%} before -> "
        f"{metrics['eval/accuracy']:.1%} after {cfg.run.num_steps} steps"
    )
    if cfg.run.export_hf:
        export_dir = trainers.export_hf(run_dir / "hf")
        logger.print(f"final policy exported to {export_dir}")
    logger.close()
    weight_sync.close()
    scorer.close()
    placement.release()
    return metrics
