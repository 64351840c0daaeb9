"""The local judge's actor, a thin Ray shell around one `LocalJudge`, and the driver's handle
to it (`LocalJudgeActor`: starts it, replaces it when it dies).

Resources and placement come from the caller (`options`: num_cpus, num_gpus and the
scheduling strategy of the plan's `judge` role, rl.cluster.placement).
"""

from __future__ import annotations

from collections.abc import Callable

import ray
from ray.actor import ActorHandle

from rl.config.tree import JudgeConfig
from rl.observe.actor_logs import redirect_output
from rl.rewards.judge_local import LocalJudge, Reply
from rl.rewards.model_worker import wait_ready

SEED = 0  # every verdict is seeded by its input too (rl.rewards.judge_local)


@ray.remote
class JudgeWorker:
    """One local judge writing verdicts for batches of rendered inputs."""

    def __init__(self, path: str, judge: JudgeConfig, seed: int, log_file: str | None) -> None:
        if log_file is not None:  # before the engine starts: its output goes there too
            redirect_output(log_file)
        self._judge = LocalJudge(path, judge, seed)

    def ready(self) -> float:
        """Returns once the engine has started: the seconds its start took."""
        return self._judge.engine.startup_seconds

    def judge(self, texts: list[str]) -> list[Reply]:
        """One (verdict, error) per input: see `LocalJudge.judge_texts`."""
        return self._judge.judge_texts(texts)


class LocalJudgeActor:
    """The driver's handle to term `name`'s judge actor. An actor that dies while judging is
    replaced and asked again, `retries` times a call, before the run stops."""

    def __init__(
        self,
        name: str,
        path: str,
        judge: JudgeConfig,
        options: dict,
        log_file: str | None,
        retries: int,
    ) -> None:
        self._name, self._retries = name, retries
        self._args = (path, judge, SEED, log_file)
        self._options = options
        self.actor = self._start()

    def _start(self) -> ActorHandle:
        return JudgeWorker.options(**self._options).remote(*self._args)

    def wait_ready(self, timeout_s: float) -> None:
        wait_ready(self.actor, f"reward term {self._name!r}: the judge's actor", timeout_s)

    def submit(self, texts: list[str]) -> Callable[[], tuple[list[Reply], int, int]]:
        ref = self.actor.judge.remote(texts)

        def wait() -> tuple[list[Reply], int, int]:
            nonlocal ref
            deaths = 0
            while True:
                try:
                    return ray.get(ref), 0, deaths
                except ray.exceptions.RayActorError as e:
                    if isinstance(e, ray.exceptions.RayTaskError):  # the judge's own error
                        raise
                    deaths += 1
                    if deaths > self._retries:
                        raise RuntimeError(
                            f"reward term {self._name!r}: the judge's actor died {deaths} "
                            f"time{'s' if deaths > 1 else ''} judging one batch (last: {e}); "
                            "the run stops — check the judge's memory and resources"
                        ) from e
                    # It may only look dead: free its bundle share for the replacement.
                    ray.kill(self.actor)
                    self.actor = self._start()
                    ref = self.actor.judge.remote(texts)

        return wait

    def close(self) -> None:
        ray.kill(self.actor)
