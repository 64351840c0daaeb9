"""Where actors' output goes: a file per actor under the run directory, unless `run.verbose`.

vLLM's engine start-up, transformers' loading bars and Ray's worker chatter would otherwise
interleave with the driver's progress line. Each actor, and the processes it starts (which
inherit its descriptors), appends to runs/NAME/logs/ROLE.log instead; with `run.verbose`
Ray streams it all to the console as it does by default.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rl.config import Config


def actor_log_file(cfg: Config, role: str) -> str | None:
    """The log file of actor `role` (e.g. "rollout-0", "trainer-1"); None when verbose."""
    if cfg.run.verbose:
        return None
    return str(cfg.run.directory() / "logs" / f"{role}.log")


def redirect_output(log_file: str) -> None:
    """In an actor's process: append what it and its children write to fds 1 and 2 to
    `log_file` (created with its directory)."""
    path = Path(log_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
