"""The metrics logger's console modes, and where actors' output goes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rl.config import Config
from rl.metrics import MetricsLogger


def _config(tmp_path: Path, **run: object) -> Config:
    return Config.model_validate(
        {
            "model": {"path": "m"},
            "run": {"output_dir": str(tmp_path), "wandb_mode": "disabled", **run},
        }
    )


def test_json_log_format_prints_each_record_and_message_as_one_json_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    cfg = _config(tmp_path, log_format="json", num_steps=2)
    logger = MetricsLogger(cfg, tmp_path)
    logger.log(1, {"reward/mean": 0.5, "actor/loss": float("nan")})
    logger.print("checkpoint written to x")
    logger.close()
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "reward/mean": 0.5, "actor/loss": None},
        {"message": "checkpoint written to x"},
    ]
    # The same record as the run's metrics.jsonl.
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == json.loads(lines[0])


def test_progress_format_prints_no_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    logger = MetricsLogger(_config(tmp_path, progress_bar=False), tmp_path)
    logger.log(1, {"reward/mean": 0.5})
    logger.close()
    assert "reward/mean" not in capsys.readouterr().out


_REDIRECTED = """
import os, sys
from rl.actor_logs import redirect_output
print("before", flush=True)
redirect_output(sys.argv[1])
print("from python")
sys.stderr.write("to stderr\\n")
sys.stdout.flush()
os.system("echo from a child process")
"""


def test_an_actors_output_and_its_childrens_go_to_its_log_file(tmp_path: Path) -> None:
    log_file = tmp_path / "logs" / "rollout-0.log"
    result = subprocess.run(
        [sys.executable, "-c", _REDIRECTED, str(log_file)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "before\n" and result.stderr == ""
    assert log_file.read_text().splitlines() == [
        "from python",
        "to stderr",
        "from a child process",
    ]
