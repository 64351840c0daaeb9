"""Whole-run checkpoints: the trainer's and critic's shards plus the driver's state.

The driver's state is what it needs to continue exactly: the step, the scheduler's groups in
flight (rl.checkpoint.in_flight: scored ones waiting for their step, partial ones with their
prefix) and admission's counts, where the prompt stream stands after the last group drawn,
the adaptive KL coefficient, and run counters. With them goes a copy of the base model's files but its
weights (config, tokenizer), so that `rl export` needs nothing else, and the sha256 of each
of its weight files, which a resume checks model.path against (`rl.checkpoint.base_weights`).
Written atomically through `rl.checkpoint.store.CheckpointWriter`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from rl.checkpoint import base_weights
from rl.checkpoint.export import MODEL_FILES_DIR, copy_model_files
from rl.checkpoint.resume import DRIVER_STATE
from rl.checkpoint.store import CheckpointError, CheckpointWriter, checkpoint_root
from rl.cluster.trainer_ranks import CriticRanks, PolicyRanks
from rl.config import Config


@dataclass
class DriverState:
    step: int
    prompt_stream: dict  # PromptStream.state_dict() after the last group drawn
    kl_coef: float
    accuracy_before: float | None  # None: the run started with evaluation off
    num_nonfinite_in_a_row: int = 0
    # The scheduler's state at step `step`'s sync (rl.checkpoint.in_flight; None: the start).
    in_flight: dict | None = None


class RunCheckpoints:
    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        trainers: PolicyRanks,
        critic: CriticRanks | None,
        base_hashes: dict[str, str],
    ) -> None:
        """`base_hashes`: `base_weights.weight_hashes` of the model.path the roles loaded."""
        self.cfg = cfg
        self.writer = CheckpointWriter(checkpoint_root(run_dir), cfg.checkpoint.keep_last)
        self.trainers, self.critic = trainers, critic
        self.base_hashes = base_hashes

    def save(self, state: DriverState) -> Path:
        """Write a checkpoint of step `state.step`; on any failure the partial one is
        deleted and the earlier ones are untouched."""
        tmp = self.writer.begin(state.step)
        try:
            self.trainers.save_checkpoint(tmp / "policy")
            if self.critic is not None:
                self.critic.save_checkpoint(tmp / "critic")
            copy_model_files(Path(self.cfg.model.path), tmp / MODEL_FILES_DIR)
            base_weights.record(self.base_hashes, tmp)
            record = {**asdict(state), "config": self.cfg.model_dump(mode="json")}
            (tmp / DRIVER_STATE).write_text(json.dumps(record, indent=1))
            return self.writer.commit(tmp, state.step)
        except BaseException:
            self.writer.abort(tmp)
            raise

    def restore(self, path: Path) -> DriverState:
        """Load the trainer (and critic) shards of `path`; returns the driver's state."""
        self.trainers.load_checkpoint(path / "policy")
        if self.critic is not None:
            self.critic.load_checkpoint(path / "critic")
        record = json.loads((path / DRIVER_STATE).read_text())
        del record["config"]
        try:
            return DriverState(**record)
        except TypeError as e:
            raise CheckpointError(
                f"{path / DRIVER_STATE} is not a driver state this version reads ({e}); "
                "resume from a checkpoint it wrote, or start the run afresh"
            ) from None
