"""Reward combination: every configured term scores each response; the reward is their
weighted sum.

Function terms (verifiers, `task`, users' functions) run in a `FunctionPool` of worker
processes, each (term, sample) within `reward.timeout_s`; reward models run on their own
`RewardModelWorker` actors, and judges (rl.rewards.judge) on their own `JudgeWorker` actors or
behind their endpoints, at the same time. A reward-model or judge actor that dies is replaced
and its call retried, `retries` times per call, before the run stops.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray
import torch
from ray.actor import ActorHandle

from rl.config import RewardConfig
from rl.data.tasks import Task
from rl.rewards.judge import JudgeBackend, JudgeTerm, judge_key
from rl.rewards.judge_remote import RemoteJudge
from rl.rewards.judge_worker import LocalJudgeActor
from rl.rewards.model_worker import RewardModelWorker, wait_ready
from rl.rewards.pool import Failure, FunctionPool
from rl.rewards.terms import FunctionTerm, check_reward_terms, parse_term, term_label

MODEL_STARTUP_TIMEOUT_S = 600.0


@dataclass
class _ModelTerm:
    """A `model:PATH` term: its place in `cfg.terms`, its name, the absolute path its actors
    load, and the actor scoring now (replaced when it dies)."""

    index: int
    name: str
    path: str
    actor: ActorHandle


class RewardScorer:
    """The weighted sum of `cfg.terms`. Builds every term in the constructor (validating names,
    starting the worker processes, which import users' files, and reward-model actors), so that bad
    input fails before any training work. `close()` stops the processes and actors.

    `model_options` are Ray `.options(...)` for the reward-model actors (resources, placement),
    `judge_options` for the local judges' actors. `retries`: how often one `score` call
    replaces a reward-model or judge actor that died and asks again before it raises
    (`faults.reward_model_retries` in a run). `log_file`: where the reward workers' output goes
    (None: the driver's stderr); a local judge's goes to `judge-<label>.log` beside it.
    """

    def __init__(
        self,
        cfg: RewardConfig,
        task: Task,
        model_options: dict | None = None,
        *,
        judge_options: dict | None = None,
        retries: int = 0,
        log_file: str | None = None,
    ) -> None:
        check_reward_terms(cfg)
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.cfg = cfg
        self._model_options = model_options or {}
        self._retries = retries
        self.labels: list[str] = []
        for term in cfg.terms:
            base = label = term_label(term.name)
            k = 2
            while label in self.labels:  # the same verifier twice, or two files' `reward`
                label, k = f"{base}_{k}", k + 1
            self.labels.append(label)
        self._weights = torch.tensor([term.weight for term in cfg.terms], dtype=torch.float64)
        self._functions: list[tuple[int, FunctionTerm]] = []
        self._models: list[_ModelTerm] = []
        self._judges: list[JudgeTerm] = []
        self._pool: FunctionPool | None = None
        try:
            for index, term in enumerate(cfg.terms):
                kind, arg = parse_term(term.name)
                if term.judge is not None:
                    backend = self._judge_backend(index, judge_options or {}, log_file)
                    self._judges.append(
                        JudgeTerm(index, term.name, term.judge, backend, cfg.on_error)
                    )
                elif kind == "model":
                    # Absolute: an actor's working directory need not be the driver's.
                    path = os.path.abspath(arg)
                    model = _ModelTerm(index, term.name, path, self._start_actor(path))
                    self._models.append(model)
                else:
                    self._functions.append((index, FunctionTerm.from_name(term.name, task)))
            if self._functions:
                terms = [term for _, term in self._functions]
                self._pool = FunctionPool(terms, cfg, log_file)
            self._wait_for_models()
        except BaseException:
            self.close()
            raise

    def _judge_backend(self, index: int, options: dict, log_file: str | None) -> JudgeBackend:
        """Term `index`'s judge: its endpoint's client, or its local engine's actor (started
        here, waited for with the reward models)."""
        judge = self.cfg.terms[index].judge
        assert judge is not None
        if judge.url:
            return RemoteJudge(judge, judge_key(index))
        label = self.labels[index]
        judge_log = (
            None
            if log_file is None
            else os.path.join(os.path.dirname(log_file), f"judge-{label}.log")
        )
        path = os.path.abspath(judge.model)  # an actor's working directory need not be ours
        return LocalJudgeActor(label, path, judge, options, judge_log, self._retries)

    def _start_actor(self, path: str) -> ActorHandle:
        return RewardModelWorker.options(**self._model_options).remote(
            path, self.cfg.model_batch_size
        )

    def _wait_for_models(self) -> None:
        # All actors were started first, so they load their models at the same time.
        for model in self._models:
            wait_ready(
                model.actor,
                f"reward term {model.name!r}: the reward-model actor",
                MODEL_STARTUP_TIMEOUT_S,
            )
        for judge in self._judges:
            if isinstance(judge.backend, LocalJudgeActor):
                judge.backend.wait_ready(MODEL_STARTUP_TIMEOUT_S)

    def _replace_actor(self, model: _ModelTerm) -> None:
        """A fresh actor for `model`, like the first one, loaded and ready."""
        # The old one may only look dead (unreachable): free its resources (its GPU share, its
        # placement-group bundle) for the replacement, which needs the same ones.
        ray.kill(model.actor)
        model.actor = self._start_actor(model.path)
        wait_ready(
            model.actor,
            f"reward term {model.name!r}: the reward-model actor",
            MODEL_STARTUP_TIMEOUT_S,
        )

    def _model_scores(
        self, model: _ModelTerm, ref: ray.ObjectRef, prompts: list[str], responses: list[str]
    ) -> tuple[list[float], int]:
        """`ref`'s scores, and how many times `model`'s actor died and was replaced to get
        them. Raises RuntimeError once it has died `retries + 1` times in this call."""
        deaths = 0
        while True:
            try:
                if deaths:
                    self._replace_actor(model)
                    ref = model.actor.score.remote(prompts, responses)
                return ray.get(ref), deaths
            except ray.exceptions.RayActorError as e:
                # An exception the model code raised (RayTaskError, even one wrapping another
                # actor's death) is a bug to see, not a fault that a new actor would fix.
                if isinstance(e, ray.exceptions.RayTaskError):
                    raise
                deaths += 1
                if deaths > self._retries:
                    raise RuntimeError(
                        f"reward term {model.name!r}: the reward-model actor died {deaths} "
                        f"time{'s' if deaths > 1 else ''} scoring one batch (last: {e}); the run "
                        "stops — check the reward model's memory and resources"
                    ) from e

    def score(
        self, prompts: list[str], responses: list[str], examples: list[dict]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """(rewards [B] float32, metrics): the weighted sum of all terms for each response.

        Metrics: `reward/<label>_mean` per term (unweighted), `reward/<label>_accuracy` per
        function term (the fraction of samples scored above 0), and `reward/errors` and
        `reward/timeouts`, the function calls of this batch that raised or ran out of time and
        scored 0 (errors also count the samples whose summed reward was not finite, e.g. a
        reward model's NaN or a weighted sum that overflowed, and judgements that failed; they
        score 0) (with reward.on_error="fail" the first one raises RuntimeError instead). With
        reward models or local judges, `reward/model_actor_errors`: how many times their actors
        died during this batch and were replaced (the scores are still complete; one call's
        deaths past `retries` raise RuntimeError instead). Like the other counts, a step sums
        it. Each judge adds `reward/<label>_parse_errors`, `_request_errors`, `_retried_errors`
        and `_cache_hit_rate` (rl.rewards.judge.JudgeTerm.metrics).
        """
        n = len(responses)
        if len(prompts) != n or len(examples) != n:
            raise ValueError(
                f"{len(prompts)} prompts, {n} responses and {len(examples)} examples differ"
            )
        # Started first: the reward models and judges score while the pool runs the functions.
        model_refs = [(m, m.actor.score.remote(prompts, responses)) for m in self._models]
        judged = [(j, j.start(prompts, responses, examples)) for j in self._judges]
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
        actor_errors = 0
        for model, ref in model_refs:
            values, deaths = self._model_scores(model, ref, prompts, responses)
            scores[model.index] = torch.tensor(values, dtype=torch.float64)
            actor_errors += deaths
        judge_metrics: dict[str, float] = {}
        for judge, finish in judged:
            outcome = finish()
            scores[judge.index] = torch.tensor(outcome.scores, dtype=torch.float64)
            counts["error"] += len(outcome.failures)
            actor_errors += outcome.actor_deaths
            judge_metrics.update(judge.metrics(self.labels[judge.index], outcome))
        rewards = (self._weights @ scores).float()
        # Each term's score is finite, but a weighted sum can overflow (float32 tops out near
        # 3.4e38) and a reward model can return NaN: such a reward would poison every
        # advantage of its group, so it is a failed reward like any other.
        for sample in (~torch.isfinite(rewards)).nonzero().flatten().tolist():
            terms = ", ".join(
                f"{label}={scores[i, sample].item():.6g}" for i, label in enumerate(self.labels)
            )
            if self.cfg.on_error == "fail":
                raise RuntimeError(
                    f"the reward of sample {sample} is {rewards[sample].item()} ({terms}, "
                    "weighted by reward.terms' weights)"
                )
            rewards[sample] = 0.0
            counts["error"] += 1
        means = scores.mean(dim=1).tolist() if n else [0.0] * len(self.labels)
        metrics = {f"reward/{label}_mean": m for label, m in zip(self.labels, means, strict=True)}
        metrics.update(self._accuracies(scores))
        metrics["reward/errors"] = float(counts["error"])
        metrics["reward/timeouts"] = float(counts["timeout"])
        if self._models or any(isinstance(j.backend, LocalJudgeActor) for j in self._judges):
            # Only then: runs without reward-model actors keep their metrics as they were.
            metrics["reward/model_actor_errors"] = float(actor_errors)
        metrics.update(judge_metrics)
        return rewards, metrics

    def _accuracies(self, scores: torch.Tensor) -> dict[str, float]:
        """`reward/<label>_accuracy` of each function term: the fraction of samples it scored
        above 0. Verifiers and tasks score 0 or 1, so this is how often they judged a response
        right; a reward model's scores have no such threshold."""
        n = max(scores.shape[1], 1)
        return {
            f"reward/{self.labels[index]}_accuracy": (scores[index] > 0).sum().item() / n
            for index, _ in self._functions
        }

    def close(self) -> None:
        """Stop the worker processes, the reward-model and judge actors, the judges' clients."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        for model in self._models:
            ray.kill(model.actor)
        self._models = []
        for judge in self._judges:
            judge.close()
        self._judges = []

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
