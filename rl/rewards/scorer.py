"""Reward combination: every configured term scores each response; the reward is their
weighted sum.

Function terms (verifiers, `task`, users' functions) run in a `FunctionPool` of worker
processes, each (term, sample) within `reward.timeout_s`; reward models run on their own
`RewardModelWorker` actors at the same time.
"""

from __future__ import annotations

import os

import ray
import torch
from ray.actor import ActorHandle

from rl.config import RewardConfig
from rl.rewards.model_worker import RewardModelWorker
from rl.rewards.pool import Failure, FunctionPool
from rl.rewards.terms import FunctionTerm, check_reward_terms, parse_term, term_label
from rl.tasks import Task

MODEL_STARTUP_TIMEOUT_S = 600.0


class RewardScorer:
    """The weighted sum of `cfg.terms`. Builds every term in the constructor (validating names,
    importing users' files, starting worker processes and reward-model actors), so that bad
    input fails before any training work. `close()` stops the processes and actors.

    `model_options` are Ray `.options(...)` for the reward-model actors (resources, placement).
    """

    def __init__(self, cfg: RewardConfig, task: Task, model_options: dict | None = None) -> None:
        check_reward_terms(cfg)
        self.cfg = cfg
        self.labels: list[str] = []
        for term in cfg.terms:
            base = label = term_label(term.name)
            k = 2
            while label in self.labels:  # the same verifier twice, or two files' `reward`
                label, k = f"{base}_{k}", k + 1
            self.labels.append(label)
        self._weights = torch.tensor([term.weight for term in cfg.terms], dtype=torch.float64)
        self._functions: list[tuple[int, FunctionTerm]] = []
        self._models: list[tuple[int, ActorHandle]] = []
        self._pool: FunctionPool | None = None
        try:
            for index, term in enumerate(cfg.terms):
                kind, arg = parse_term(term.name)
                if kind == "model":
                    # Absolute: an actor's working directory need not be the driver's.
                    actor = RewardModelWorker.options(**(model_options or {})).remote(
                        os.path.abspath(arg), cfg.model_batch_size
                    )
                    self._models.append((index, actor))
                else:
                    self._functions.append((index, FunctionTerm.from_name(term.name, task)))
            if self._functions:
                terms = [term for _, term in self._functions]
                self._pool = FunctionPool(terms, cfg.num_processes, cfg.timeout_s)
            self._wait_for_models()
        except BaseException:
            self.close()
            raise

    def _wait_for_models(self) -> None:
        for index, actor in self._models:
            try:
                ray.get(actor.ready.remote(), timeout=MODEL_STARTUP_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError as e:
                raise RuntimeError(
                    f"reward term {self.cfg.terms[index].name!r}: the reward-model actor did not "
                    f"start within {MODEL_STARTUP_TIMEOUT_S:.0f} s (are its resources free? "
                    f"cluster has {ray.available_resources()})"
                ) from e

    def score(
        self, prompts: list[str], responses: list[str], examples: list[dict]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """(rewards [B] float32, metrics): the weighted sum of all terms for each response.

        Metrics: `reward/<label>_mean` per term (unweighted), and `reward/errors` and
        `reward/timeouts`, the function calls of this batch that raised or ran out of time and
        scored 0 (with reward.on_error="fail" the first one raises RuntimeError instead).
        """
        n = len(responses)
        if len(prompts) != n or len(examples) != n:
            raise ValueError(
                f"{len(prompts)} prompts, {n} responses and {len(examples)} examples differ"
            )
        # Started first: the reward models score while the pool runs the functions.
        model_refs = [(i, actor.score.remote(prompts, responses)) for i, actor in self._models]
        scores = torch.zeros(len(self.cfg.terms), n, dtype=torch.float64)
        counts = {"error": 0, "timeout": 0}
        if self._pool is not None and n:
            # Term-major: item k is term k // n on sample k % n.
            items = [
                (j, response, example)
                for j in range(len(self._functions))
                for response, example in zip(responses, examples, strict=True)
            ]
            fail = self.cfg.on_error == "fail"
            for k, result in enumerate(self._pool.run(items, fail_fast=fail)):
                j, sample = divmod(k, n)
                index = self._functions[j][0]
                if isinstance(result, Failure):
                    if fail:
                        raise RuntimeError(
                            f"reward term {self.cfg.terms[index].name!r} failed on sample "
                            f"{sample} ({result.kind}): {result.cause}"
                        )
                    counts[result.kind] += 1
                elif result is not None:
                    scores[index, sample] = result
        for index, ref in model_refs:
            scores[index] = torch.tensor(ray.get(ref), dtype=torch.float64)
        rewards = (self._weights @ scores).float()
        means = scores.mean(dim=1).tolist() if n else [0.0] * len(self.labels)
        metrics = {f"reward/{label}_mean": m for label, m in zip(self.labels, means, strict=True)}
        metrics["reward/errors"] = float(counts["error"])
        metrics["reward/timeouts"] = float(counts["timeout"])
        return rewards, metrics

    def close(self) -> None:
        """Stop the worker processes and the reward-model actors."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        for _, actor in self._models:
            ray.kill(actor)
        self._models = []

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
