"""Whole-run checkpoints: the trainer's and critic's shards plus the driver's state.

The driver's state is what it needs to continue exactly: the step, where the prompt stream
stands at the first group not yet trained (groups in flight are drawn and generated again,
with the same seeds; later groups already trained are drawn and passed over), the adaptive
KL coefficient, and run counters. With them goes a copy of the base model's files but its
weights (config, tokenizer), so that `rl export` needs nothing else, and the sha256 of each
of its weight files, which a resume checks model.path against (`rl.checkpoint.base_weights`).
Written atomically through `rl.checkpoint.store.CheckpointWriter`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rl.checkpoint import base_weights
from rl.checkpoint.export import MODEL_FILES_DIR, copy_model_files
from rl.checkpoint.resume import DRIVER_STATE
from rl.checkpoint.store import CheckpointWriter, checkpoint_root
from rl.cluster.trainer_ranks import CriticRanks, PolicyRanks
from rl.config import Config


@dataclass
class DriverState:
    step: int
    first_group_id: int  # the first group no step up to `step` trained on
    prompt_stream: dict  # PromptStream.state_dict() right before that group was drawn
    kl_coef: float
    accuracy_before: float | None  # None: the run started with evaluation off
    num_nonfinite_in_a_row: int = 0
    # Groups from first_group_id on that a step up to `step` trained (dynamic sampling can
    # start a step's replacement group after the next step's first): passed over on resume.
    trained_group_ids: list[int] = field(default_factory=list)


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
        return DriverState(**record)
