"""The reward-model actor: a thin Ray shell around one `RewardModel`.

Resources and placement come from the caller (`RewardModelWorker.options(num_cpus=...,
num_gpus=..., scheduling_strategy=...)`).
"""

from __future__ import annotations

import ray

from rl.rewards.model import RewardModel


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
