"""The metrics logger's console modes, and where actors' output goes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rl.config import Config
from rl.observe.metrics import MetricsLogger
from tests.helpers.tracker_files import same_metrics, tensorboard_scalars, wandb_history


def _config(tmp_path: Path, **run: object) -> Config:
    """No trackers unless a test asks for them."""
    return Config.model_validate(
        {
            "model": {"path": "m"},
            "run": {
                "output_dir": str(tmp_path),
                "wandb_mode": "disabled",
                "tensorboard": False,
                **run,
            },
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


def test_progress_format_off_a_terminal_prints_a_status_line_a_step(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    logger = MetricsLogger(_config(tmp_path, num_steps=4, tensorboard=True), tmp_path)
    logger.log(0, {"eval/accuracy": 0.25})
    logger.log(1, {"reward/mean": 0.5, "time/step_s": 1.5, "perf/gen_tokens_per_s": 2048.0})
    logger.print("checkpoint written to runs/x/[step_000001]")
    logger.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("tensorboard: `tensorboard --logdir ")
    assert re.fullmatch(
        r"step 1/4 · ETA \d:\d\d:\d\d · reward 0.5 · acc 25.0% · gen 2,048 tok/s · 1.50 s/step",
        lines[1],
    ), lines[1]
    assert lines[2] == "checkpoint written to runs/x/[step_000001]"  # brackets kept as text


def test_wandb_offline_run_and_tensorboard_hold_the_jsonl_metrics(tmp_path: Path) -> None:
    cfg = _config(tmp_path, wandb_mode="offline", tensorboard=True, log_format="json")
    logger = MetricsLogger(cfg, tmp_path)
    logger.log(0, {"eval/accuracy": 0.25})
    logger.log(1, {"reward/mean": 0.5, "actor/loss": float("nan")})
    logger.log(2, {"reward/mean": 0.75, "actor/loss": 1.25})
    logger.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    same_metrics(records, wandb_history(tmp_path), rel=0)
    same_metrics(records, tensorboard_scalars(tmp_path / "tensorboard"), rel=1e-6)


def test_a_resumed_run_logs_to_the_same_wandb_run_and_a_fresh_one_to_a_new_run(
    tmp_path: Path,
) -> None:
    cfg = _config(tmp_path, wandb_mode="offline", log_format="json")
    run_ids = []
    for resume_step in (None, 1, None):
        logger = MetricsLogger(cfg, tmp_path, resume_step=resume_step)
        logger.log(2, {"reward/mean": 0.5})
        logger.close()
        (run,) = {p for p in (tmp_path / "wandb").glob("offline-run-*")} - set(run_ids)
        run_ids.append(run)
    # offline-run-<time>-<run id>[-n]: one directory per start; `wandb sync` merges one id's
    ids = [run.name.split("-")[3] for run in run_ids]
    assert ids[0] == ids[1] != ids[2]


def test_resumed_tensorboard_log_hides_steps_after_the_checkpoint(tmp_path: Path) -> None:
    cfg = _config(tmp_path, tensorboard=True, log_format="json")
    first = MetricsLogger(cfg, tmp_path)
    for step in (1, 2, 3):
        first.log(step, {"reward/mean": float(step)})
    first.close()
    resumed = MetricsLogger(cfg, tmp_path, resume_step=1)
    resumed.log(2, {"reward/mean": 20.0})
    resumed.close()
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert {step: v["reward/mean"] for step, v in scalars.items()} == {1: 1.0, 2: 20.0}


def _steps(path: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["reward/mean"]) for r in map(json.loads, path.read_text().splitlines())]


@pytest.mark.parametrize(
    ("resume_step", "kept", "replaced"),
    [
        (1, [(0, 0.0), (1, 1.0)], [(2, 2.0), (3, 3.0)]),
        (-1, [], [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]),
    ],
)
def test_a_continued_run_keeps_its_timeline_and_sets_the_replaced_records_aside(
    tmp_path: Path, resume_step: int, kept: list, replaced: list
) -> None:
    """A resume after step 1, or a fault restart from the start (-1): metrics.jsonl reads as
    one timeline, and what the interrupted attempt logged past it is kept beside it."""
    cfg = _config(tmp_path, log_format="json")
    first = MetricsLogger(cfg, tmp_path)
    for step in (0, 1, 2, 3):
        first.log(step, {"reward/mean": float(step)})
    first.close()
    continued = MetricsLogger(cfg, tmp_path, resume_step=resume_step)
    continued.log(resume_step + 1, {"reward/mean": 10.0})
    continued.close()
    assert _steps(tmp_path / "metrics.jsonl") == [*kept, (resume_step + 1, 10.0)]
    assert _steps(tmp_path / "metrics.replaced.jsonl") == replaced


_REDIRECTED = """
import os, sys
from rl.observe.actor_logs import redirect_output
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
