"""The single controller: one GRPO loop that reads top to bottom.

generate -> score -> advantages -> (old/ref log-probs) -> train -> sync weights -> log,
with held-out greedy evaluation every `run.eval_every` steps and an HF export at the end.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from rl.algorithms import ADVANTAGES
from rl.batching import build_batch
from rl.config import Config
from rl.data import PromptStream, load_split, prepare_splits
from rl.evaluation import evaluate
from rl.metrics import MetricsLogger
from rl.prompts import encode_prompt
from rl.rollout_group import RolloutGroup
from rl.scheduler import colocate, init_ray
from rl.tasks import get_task
from rl.train_group import TrainGroup
from rl.types import SamplingParams
from trainer.base_model import ensure_base


def train(cfg: Config) -> dict[str, float]:
    """Run `cfg` to the end; returns the final step's metrics (with eval/accuracy_before)."""
    ensure_base(cfg)
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    task = get_task(cfg.data.task)
    prepare_splits(cfg.data)
    prompts_stream = PromptStream(load_split(cfg.data, "train"), seed=cfg.run.seed)
    test_examples = list(load_split(cfg.data, "test"))[: cfg.run.num_eval_prompts]
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)

    init_ray()
    placement = colocate(cfg)
    rollout = RolloutGroup(cfg, placement, num_roles_sharing=2)
    trainers = TrainGroup(cfg, placement, num_roles_sharing=2)
    logger = MetricsLogger(cfg, run_dir)
    sampling = SamplingParams(
        n=cfg.algorithm.group_size,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
    )
    advantage_fn = ADVANTAGES.get(cfg.algorithm.advantage)

    accuracy_before = evaluate(rollout, tokenizer, task, test_examples, cfg, version=0)
    logger.print(f"held-out greedy accuracy before RL: {accuracy_before:.1%}")
    logger.log(0, {"eval/accuracy": accuracy_before})
    metrics: dict[str, float] = {}
    for step in range(1, cfg.run.num_steps + 1):
        step_start = time.perf_counter()
        examples = prompts_stream.next_batch(cfg.run.prompts_per_step)
        prompts = [encode_prompt(tokenizer, ex["prompt"]) for ex in examples]
        sampling.seed = cfg.run.seed * 100_003 + step
        samples = rollout.generate(prompts, sampling, policy_version=step - 1)
        gen_s = time.perf_counter() - step_start

        for sample in samples:
            sample.reward = task.score(sample.response_text, examples[sample.group_id])
        rewards = torch.tensor([s.reward for s in samples])
        advantages = advantage_fn(rewards, cfg.algorithm.group_size, cfg.algorithm.normalize_std)
        batch = build_batch(samples, advantages, pad_id=tokenizer.pad_token_id)
        if cfg.algorithm.kl_coef > 0:
            batch.ref_logprobs = trainers.compute_logprobs(batch, model="reference")

        train_start = time.perf_counter()
        metrics = trainers.train_step(batch)
        sync_start = time.perf_counter()
        metrics.update(trainers.push_weights(rollout, version=step))
        sync_s = time.perf_counter() - sync_start
        metrics["rollout/version"] = min(rollout.versions())

        num_tokens = sum(len(s.response_ids) for s in samples)
        metrics.update(
            {
                "reward/mean": rewards.mean().item(),
                "reward/solved_groups": _fraction_of_groups_solved(
                    rewards, cfg.algorithm.group_size
                ),
                "response/mean_tokens": num_tokens / len(samples),
                "response/truncated": sum(s.finish_reason == "length" for s in samples)
                / len(samples),
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
        f"{metrics['eval/accuracy']:.1%} after {cfg.run.num_steps} GRPO steps"
    )
    if cfg.run.export_hf:
        export_dir = trainers.export_hf(run_dir / "hf")
        logger.print(f"final policy exported to {export_dir}")
    logger.close()
    placement.release()
    return metrics


def _fraction_of_groups_solved(rewards: torch.Tensor, group_size: int) -> float:
    """Share of prompts with at least one correct response (pass@G of the behaviour policy)."""
    return (rewards.view(-1, group_size).max(dim=1).values > 0).float().mean().item()
