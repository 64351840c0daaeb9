"""A new run never writes into another run's directory, and one live process writes each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rl.config import Config, ModelConfig, RunConfig
from rl.run.directory import RunInUse, RunLock, fresh_run_config


def _config(output_dir: Path, name: str = "demo") -> Config:
    return Config(model=ModelConfig(path="m"), run=RunConfig(name=name, output_dir=str(output_dir)))


def test_a_new_run_moves_past_directories_that_hold_earlier_runs(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    assert fresh_run_config(cfg, resuming=False).run.name == "demo"  # nothing there yet
    (tmp_path / "demo").mkdir()
    assert fresh_run_config(cfg, resuming=False).run.name == "demo"  # empty: nothing to lose
    (tmp_path / "demo" / ".lock").touch()
    assert fresh_run_config(cfg, resuming=False).run.name == "demo"  # a lock is no result
    (tmp_path / "demo" / "metrics.jsonl").write_text("{}\n")
    assert fresh_run_config(cfg, resuming=False).run.name == "demo-2"
    (tmp_path / "demo-2").mkdir()
    (tmp_path / "demo-2" / "trace.json").write_text("{}")
    moved = fresh_run_config(cfg, resuming=False)
    assert moved.run.name == "demo-3" and moved.run.directory() == tmp_path / "demo-3"
    assert moved.model == cfg.model
    # Continuing a run means its own directory.
    assert fresh_run_config(cfg, resuming=True).run.name == "demo"


# Holds the lock until the test kills it (stdin never closes first), not for a guessed time
# that a slow test could outlast.
_HOLD = """
import sys
from pathlib import Path
from rl.run.directory import RunLock
with RunLock(Path(sys.argv[1])):
    print("locked", flush=True)
    sys.stdin.read()
"""


def test_a_second_process_on_a_live_runs_directory_is_refused_until_the_first_dies(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "demo"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(run_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(
            RunInUse, match=rf"{run_dir} is being written by a live run \(pid {holder.pid}\)"
        ):
            with RunLock(run_dir):
                pass
    finally:
        holder.kill()  # dies without releasing anything itself
        holder.wait()
        holder.stdin.close()
        holder.stdout.close()
    with RunLock(run_dir):  # the kernel dropped the dead process's lock
        assert (run_dir / ".lock").stat().st_mode & 0o777 == 0o600
