"""The reward-model actor: a thin Ray shell around one `RewardModel`.

Resources and placement come from the caller (`RewardModelWorker.options(num_cpus=...,
num_gpus=..., scheduling_strategy=...)`).
"""

from __future__ import annotations

import ray
from ray.actor import ActorHandle

from rl.rewards.model import RewardModel


def wait_ready(actor: ActorHandle, what: str, timeout_s: float) -> None:
    """Return once `actor` (a reward model's or a judge's, whose `ready` returns when its model
    is loaded) is ready; RuntimeError naming `what` after `timeout_s`."""
    try:
        ray.get(actor.ready.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise RuntimeError(
            f"{what} did not start within {timeout_s:.0f} s (are its resources free? cluster "
            f"has {ray.available_resources()})"
        ) from e


@ray.remote
class RewardModelWorker:
    """One reward model scoring batches of (prompt, response) texts."""

    def __init__(self, path: str, batch_size: int) -> None:
        self._model = RewardModel(path, batch_size)

    def ready(self) -> str:
        """Returns once the model is loaded: the device it runs on."""
        return str(self._model.device)

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        """One float per (prompt, response): see `RewardModel.score`."""
        return self._model.score(prompts, responses)
