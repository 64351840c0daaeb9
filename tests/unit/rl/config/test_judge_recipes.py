"""Recipes with a judge term: bad input fails at load, before anything starts, naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rl.cluster.placement import plan_placement
from rl.config.recipe import ConfigError, load_config
from tests.helpers.models import build_tiny_checkpoint

KEY_ENV = "TANDEM_TEST_JUDGE_KEY"


def _recipe(tmp_path: Path, judge: dict, name: str = "judge", **sections: dict) -> Path:
    tree = {
        "model": {"path": str(tmp_path / "policy")},
        "reward": {"terms": [{"name": "task"}, {"name": name, "judge": judge}]},
        **sections,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _remote(**fields: object) -> dict:
    return {"url": "http://127.0.0.1:9/v1", "model": "judge-1", "template": "{response}", **fields}


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("judge") / "judge", False)


def test_a_local_judge_loads_and_gets_a_bundle_beside_the_reward_models(
    tmp_path: Path, judge_dir: Path
) -> None:
    cfg = load_config(_recipe(tmp_path, {"model": str(judge_dir), "template": "{response}"}))
    assert cfg.reward.terms[1].judge.model == str(judge_dir)
    plan = plan_placement(cfg)
    assert plan.roles["judge"] == [0]
    assert plan.trace_lanes()["reward"] == [0]


def test_a_remote_judge_takes_no_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-test")
    cfg = load_config(_recipe(tmp_path, _remote(api_key_env=KEY_ENV)))
    assert "judge" not in plan_placement(cfg).roles


@pytest.mark.parametrize(
    ("judge", "message"),
    [
        (
            {"template_file": "no/such/rubric.txt"},
            r"reward.terms\[1\].judge.template_file='no/such/rubric.txt': no such file",
        ),
        (
            {"template": "Rate {response} against {reference}"},
            r"reward.terms\[1\].judge.template \(inline\): unknown field \{reference\}; the "
            r"pointwise fields are \{prompt\}, \{answer\}, \{response\}",
        ),
        (
            {"template": "{response.__init__.__globals__}"},
            r"reward.terms\[1\].judge.template \(inline\): field .* is not a plain name",
        ),
        ({"template": "{response}", "parser": "ranking"}, r"judge.parser='ranking' does not fit"),
        ({"template": "{response}", "engine": "tgi"}, r"judge.engine='tgi' is not one of"),
        ({"template": "{response}"}, r"judge.model=.*not an HF checkpoint directory"),
        ({"template": "{response}", "api_key_env": KEY_ENV}, "a local judge .* takes no API key"),
    ],
)
def test_bad_judges_fail_at_load_naming_the_key(tmp_path: Path, judge: dict, message: str) -> None:
    judge = {"model": str(tmp_path / "no-judge-here"), **judge}
    with pytest.raises(ConfigError, match=message):
        load_config(_recipe(tmp_path, judge))


def test_a_missing_api_key_variable_fails_at_load_without_a_key_in_sight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(ConfigError, match=rf"judge.api_key_env='{KEY_ENV}': that environment"):
        load_config(_recipe(tmp_path, _remote(api_key_env=KEY_ENV)))
    for url, message in (("ftp://host/v1", "not an http:// or https:// URL"),):
        with pytest.raises(ConfigError, match=message):
            load_config(_recipe(tmp_path, _remote(url=url)))
    with pytest.raises(ConfigError, match=r"judge.model: name the model the endpoint"):
        load_config(_recipe(tmp_path, _remote(model="")))


def test_judge_section_and_judge_name_go_together(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"reward.terms\[1\] \('task'\): a term named 'judge'"):
        load_config(_recipe(tmp_path, _remote(), name="task"))
    path = tmp_path / "bare.yaml"
    path.write_text(
        yaml.safe_dump({"model": {"path": "m"}, "reward": {"terms": [{"name": "judge"}]}})
    )
    with pytest.raises(ConfigError, match=r"reward.terms\[0\] \('judge'\): a term named 'judge'"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"reward.terms.1.judge.rubric: Extra inputs"):
        load_config(_recipe(tmp_path, _remote(rubric="x")))


def test_group_judging_needs_groups(tmp_path: Path) -> None:
    judge = _remote(mode="pairwise", parser="choice", choices={"A": 1.0, "B": 0.0},
                    template="{response_a} {response_b}")  # fmt: skip
    load_config(_recipe(tmp_path, judge))
    with pytest.raises(
        ConfigError,
        match=r"reward.terms\[1\].judge.mode='pairwise' compares .*algorithm.group_size=1",
    ):
        load_config(
            _recipe(tmp_path, judge, algorithm={"advantage": "reinforce_pp", "group_size": 1})
        )


def test_a_judge_may_be_the_base_the_recipe_builds_first(tmp_path: Path) -> None:
    policy = str(tmp_path / "policy")  # not there yet
    judge = {"model": policy, "template": "{response}"}
    with pytest.raises(ConfigError, match="not an HF checkpoint directory"):
        load_config(_recipe(tmp_path, judge))
    load_config(_recipe(tmp_path, judge, base={"build_if_missing": True}))
