"""The judge recipe end to end at tiny size, with a second judge behind a local
chat-completions endpoint that needs an API key: both judges score every step while the next
step generates, their metrics are logged, and the key appears in nothing the run wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.helpers.chat_server import ChatServer
from tests.helpers.cli import run_rl
from tests.helpers.metric_keys import check_metric_keys
from tests.helpers.repo import REPO

pytestmark = pytest.mark.e2e

RECIPE = "recipes/judge_addition_cpu.yaml"
KEY = "sk-tandem-e2e-9f8e7d6c5b4a"
KEY_ENV = "TANDEM_TEST_JUDGE_KEY"


def _terms(base: Path, url: str) -> str:
    """The recipe's reward terms, its judge pointed at this run's base, and a remote judge."""
    terms = yaml.safe_load((REPO / RECIPE).read_text())["reward"]["terms"]
    local = next(term for term in terms if term["name"] == "judge")
    local["judge"]["model"] = str(base)
    remote = {
        "url": url,
        "model": "judge-1",
        "api_key_env": KEY_ENV,
        "template": "{response} for {prompt}",
        "parser": "score",
        "score_range": [0, 9],
        "max_retries": 0,  # the server's one failure below is a request error
    }
    terms.append({"name": "judge", "weight": 0.1, "judge": remote})
    return yaml.safe_dump(terms, default_flow_style=True, width=1 << 16).strip()


def test_judge_recipe_scores_with_a_local_and_a_remote_judge_and_keeps_the_key_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    with ChatServer(lambda content: "7" if "+" in content else "?", KEY) as server:
        server.fail_next(500)  # answered with the request's Authorization header in its body
        result = run_rl(
            "train",
            RECIPE,
            f"model.path={tmp_path / 'base'}",
            f"data.dir={tmp_path / 'data'}",
            f"run.output_dir={tmp_path / 'runs'}",
            f"reward.terms={_terms(tmp_path / 'base', server.url)}",
            "base.hidden_size=64",
            "base.intermediate_size=128",
            "base.num_heads=2",
            "base.num_kv_heads=1",
            "base.sft_steps=10",
            "data.num_train=1000",
            "data.num_test=10",
            "rollout.engine=torch",
            "trainer.num_workers=1",
            "trainer.micro_batch_size=32",
            "run.num_steps=2",
            "run.prompts_per_step=4",
            "run.num_eval_prompts=0",
            "run.export_hf=false",
            "run.wandb_mode=disabled",
            "run.tensorboard=false",
        )
        requests = len(server.seen.bodies)
    assert result.returncode == 0, result.stderr[-4000:]
    run_dir = tmp_path / "runs" / "judge-addition"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    check_metric_keys(records)
    for record in records[1:]:
        for label in ("judge", "judge_2"):
            assert 0.0 <= record[f"reward/{label}_mean"] <= 1.0
            assert record[f"reward/{label}_parse_errors"] >= 0
        assert record["reward/model_actor_errors"] == 0  # the local judge's actor lived
    # Every remote verdict is "7" of 0-9 but the one request the server failed.
    assert sum(r["reward/judge_2_request_errors"] for r in records[1:]) == 1
    assert requests > 0
    # Its log line quotes the server's error, with the key the server echoed blanked out.
    assert "HTTP 500: 'failed for Bearer ***'" in result.stdout + result.stderr
    assert KEY not in result.stdout + result.stderr
    written = [path for path in run_dir.rglob("*") if path.is_file()]
    assert any(path.parent.name.startswith("step_") for path in written)  # a checkpoint
    assert (run_dir / "logs" / "judge-judge.log").is_file()
    for path in written:
        assert KEY.encode() not in path.read_bytes(), path
    assert KEY_ENV in (run_dir / "config.json").read_text()  # the variable's name only
