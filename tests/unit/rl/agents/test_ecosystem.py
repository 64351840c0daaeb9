"""`verifiers:<env>` names, their examples and their checks (rl.agents.ecosystem), without
importing verifiers: what the driver does with them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl.agents.agent_pool import VERIFIERS_AGENT, agent_function
from rl.agents.ecosystem import (
    VERIFIERS_FIELD,
    VerifiersEnv,
    check_pairing,
    distinct_prompts,
    example_fields,
    verifiers_env,
)
from rl.data.tasks import get_task

pytest.importorskip("verifiers")

LOCAL = "tests/integration/rollout/verifiers_envs/tandem_echo"


def test_an_installed_environment_is_named_by_its_id_and_a_local_one_by_its_folder() -> None:
    assert verifiers_env("verifiers:gsm8k") == VerifiersEnv("verifiers:gsm8k", "gsm8k")
    local = verifiers_env(f"verifiers:{LOCAL}")
    assert local.env_id == "tandem_echo"
    assert local.python_path == [str(Path(LOCAL).resolve().parent)]
    assert verifiers_env("openai:a.py:run") is None and verifiers_env("calculator") is None


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("verifiers:", "name the environment"),
        ("verifiers:no/such/folder", "not a local environment"),
        ("verifiers:recipes/agents", "not a local environment"),  # no __init__.py
    ],
)
def test_a_name_that_cannot_be_an_environment_fails_naming_the_key(name, error) -> None:
    with pytest.raises(ValueError, match=f"agent.environment='{name}'.*{error}"):
        verifiers_env(name)


def test_its_episodes_run_the_built_in_agent_function() -> None:
    assert agent_function("verifiers:gsm8k") == (VERIFIERS_AGENT, "run")
    assert Path(VERIFIERS_AGENT).is_file()


def test_an_example_carries_the_task_its_prompt_text_and_its_answer() -> None:
    env = verifiers_env("verifiers:gsm8k")
    task = {"prompt": [{"role": "user", "content": "2+2?"}], "answer": 4, "idx": 0}
    example = example_fields(env, {"split": "test"}, task)
    assert example["prompt"] == "2+2?" and example["answer"] == "4"
    spec = {"env": "gsm8k", "config": {"split": "test"}, "task": task}
    assert json.loads(example[VERIFIERS_FIELD]) == spec
    assert example_fields(env, {}, {"prompt": None})["answer"] == ""


def test_prompts_that_read_alike_are_told_apart_by_position() -> None:
    env = verifiers_env("verifiers:wordle")
    examples = [{"prompt": p} for p in ("Play.", "Play.", "Other", "")]
    prompts = [e["prompt"] for e in distinct_prompts(env, examples)]
    assert prompts == [
        "Play.\n[wordle task 0]",
        "Play.\n[wordle task 1]",
        "Other",
        "[wordle task 3]",
    ]


def test_the_environment_and_its_tasks_are_named_together() -> None:
    name = "verifiers:gsm8k"
    check_pairing(name, name, has_files=False)
    check_pairing(name, "addition", has_files=True)  # the user's rows
    with pytest.raises(ValueError, match="set data.task='verifiers:gsm8k'"):
        check_pairing(name, "addition", has_files=False)
    with pytest.raises(ValueError, match="set agent.environment='verifiers:gsm8k'"):
        check_pairing("", name, has_files=False)
    with pytest.raises(ValueError, match="set agent.environment='verifiers:gsm8k'"):
        check_pairing("verifiers:other", name, has_files=False)


def test_its_tasks_score_nothing_alone_and_resolve_their_folder_only_when_asked() -> None:
    task = get_task("verifiers:no/such/folder")  # a reward worker, elsewhere, builds it
    assert task.score("anything", {}) == 0.0
    with pytest.raises(ValueError, match="data.task="):
        task.env()


def test_a_sandbox_reads_the_id_without_the_filesystem() -> None:
    from rl.agents.ecosystem import env_id_of

    assert env_id_of("verifiers:gsm8k") == "gsm8k"
    assert env_id_of("verifiers:some/where/tandem_sum/") == "tandem_sum"
    assert env_id_of("verifiers:some/where/tandem_sum.py") == "tandem_sum"
