"""Time-sliced devices (colocate, k = 0, on GPUs): the rollout engines and the trainer take
turns holding the memory. The engines sleep while the trainer computes; the trainer's state
goes to host memory while the engines generate (`trainer.offload`). `rl.run.scheduler.loop` says
when a turn changes; this is the order of the calls in each change.
"""

from __future__ import annotations

from rl.run.scheduler.ports import RolloutPort, TrainerPort


class DeviceTurns:
    """Who holds the devices; every call is a no-op unless `enabled`."""

    def __init__(self, enabled: bool, rollout: RolloutPort, trainer: TrainerPort) -> None:
        self.enabled = enabled
        self.rollout, self.trainer = rollout, trainer
        self._engines_asleep = False

    def to_trainer(self) -> None:
        """The engines free their weights' and KV cache's memory before the trainer computes."""
        if self.enabled and not self._engines_asleep:
            self.rollout.release_memory()
            self._engines_asleep = True

    def for_push(self) -> None:
        """The engines take back their weights' memory to load new ones into, not yet the KV
        cache's: the trainer still holds its state to send."""
        if self.enabled:
            self.rollout.reclaim_weights()

    def to_rollout(self) -> None:
        """The trainer's state leaves the devices before the engines' KV caches come back.
        Released every time: any trainer call in between (a push, a lost worker's weights
        streamed) brought the state back."""
        if not self.enabled:
            return
        self.trainer.release_memory()
        if self._engines_asleep:
            self.rollout.reclaim_memory()
            self._engines_asleep = False
