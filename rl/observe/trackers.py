"""Experiment trackers a run's step metrics go to besides metrics.jsonl: wandb and
tensorboard, both under the run directory.

wandb's `auto` mode logs online when this machine has credentials (WANDB_API_KEY, or the
netrc entry `wandb login` writes) and offline otherwise, so a run never fails or waits on a
login prompt; `wandb sync` uploads an offline run later. A WANDB_MODE in the environment
wins over `auto`, as wandb users expect.
"""

from __future__ import annotations

import netrc
import os
import uuid
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from rl.config import Config


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...

    def where(self) -> str:
        """A line telling the user where the run's curves are."""


def has_wandb_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def resolve_wandb_mode(configured: str) -> str:
    """run.wandb_mode as wandb.init takes it: `auto` becomes online, offline or WANDB_MODE."""
    if configured != "auto":
        return configured
    return os.environ.get("WANDB_MODE") or ("online" if has_wandb_credentials() else "offline")


class WandbTracker:
    def __init__(self, cfg: Config, run_dir: Path, mode: str, resumed: bool) -> None:
        """A new wandb run, or (`resumed`) the run the interrupted one logged to, by the id
        it kept in the run directory. wandb keeps a run's steps increasing: the steps the
        interrupted run logged after its checkpoint keep their first values there, where
        metrics.jsonl and tensorboard take the resumed ones."""
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if resumed and id_file.exists() else None
        if run_id is None:
            run_id = uuid.uuid4().hex[:12]  # wandb's run ids: lower-case letters and digits
            id_file.write_text(run_id)
        self._run = wandb.init(
            project=cfg.run.wandb_project,
            name=cfg.run.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            mode=mode,
            config=cfg.model_dump(),
        )
        self._mode = mode

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()

    def where(self) -> str:
        if self._mode == "online":
            return f"wandb: {self._run.url}"
        offline_dir = Path(self._run.dir).parent
        return f"wandb (offline): {offline_dir}; upload it with `wandb sync {offline_dir}`"


class TensorboardTracker:
    def __init__(self, run_dir: Path, resume_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = run_dir / "tensorboard"
        # A resumed run hides what the interrupted one logged after its checkpoint, as
        # metrics.jsonl drops those records.
        purge_step = resume_step + 1 if resume_step is not None else None
        self._writer = SummaryWriter(str(self.log_dir), purge_step=purge_step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def where(self) -> str:
        return f"tensorboard: `tensorboard --logdir {self.log_dir}`"


def open_trackers(cfg: Config, run_dir: Path, resume_step: int | None) -> list[Tracker]:
    """The trackers `cfg.run` asks for, started."""
    trackers: list[Tracker] = []
    mode = resolve_wandb_mode(cfg.run.wandb_mode)
    if mode != "disabled":
        trackers.append(WandbTracker(cfg, run_dir, mode, resumed=resume_step is not None))
    if cfg.run.tensorboard:
        trackers.append(TensorboardTracker(run_dir, resume_step))
    return trackers
