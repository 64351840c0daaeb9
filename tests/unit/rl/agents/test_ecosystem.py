"""`verifiers:<env>` and `openenv:<env>` names, their examples and their checks
(rl.agents.ecosystem, rl.data.tasks), without importing either package or an environment: what
the driver does with them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl.agents.agent_pool import agent_function
from rl.agents.ecosystem import (
    VERIFIERS,
    VERIFIERS_FIELD,
    EcosystemEnv,
    check_pairing,
    distinct_prompts,
    ecosystem_env,
    example_fields,
)
from rl.data.tasks import get_task

pytest.importorskip("verifiers")

LOCAL = "tests/integration/rollout/verifiers_envs/tandem_echo"


def test_an_installed_environment_is_named_by_its_id_and_a_local_one_by_its_folder() -> None:
    assert ecosystem_env("verifiers:gsm8k") == EcosystemEnv(VERIFIERS, "verifiers:gsm8k", "gsm8k")
    local = ecosystem_env(f"verifiers:{LOCAL}")
    assert local.env_id == "tandem_echo"
    assert local.python_path == [str(Path(LOCAL).resolve().parent)]
    assert ecosystem_env("openai:a.py:run") is None and ecosystem_env("calculator") is None


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
        ecosystem_env(name)


def test_its_episodes_run_the_built_in_agent_function() -> None:
    path, function = agent_function("verifiers:gsm8k")
    assert function == "run" and Path(path).is_file()
    assert Path(path).name == "verifiers_agent.py"


def test_an_example_carries_the_task_its_prompt_text_and_its_answer() -> None:
    env = ecosystem_env("verifiers:gsm8k")
    task = {"prompt": [{"role": "user", "content": "2+2?"}], "answer": 4, "idx": 0}
    example = example_fields(env, {"split": "test"}, task)
    assert example["prompt"] == "2+2?" and example["answer"] == "4"
    spec = {"env": "gsm8k", "config": {"split": "test"}, "task": task}
    assert json.loads(example[VERIFIERS_FIELD]) == spec
    assert example_fields(env, {}, {"prompt": None})["answer"] == ""


def test_prompts_that_read_alike_are_told_apart_by_position() -> None:
    env = ecosystem_env("verifiers:wordle")
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


OPENENV_LOCAL = "tests/integration/rollout/openenv_envs/tandem_spell"


def test_an_openenv_environment_is_a_package_and_runs_the_openenv_agent_function() -> None:
    env = ecosystem_env(f"openenv:{OPENENV_LOCAL}")
    assert env.source.package == "openenv" and env.env_id == "tandem_spell"
    assert env.python_path == [str(Path(OPENENV_LOCAL).resolve().parent)]
    path, function = agent_function(f"openenv:{OPENENV_LOCAL}")
    assert (Path(path).name, function) == ("openenv_agent.py", "run")
    # A single file is a verifiers environment's form, not an OpenEnv one's (server/app.py).
    with pytest.raises(ValueError, match="not a local environment"):
        ecosystem_env(f"openenv:{OPENENV_LOCAL}/models.py")


def test_openenv_examples_are_resets_with_seeds_from_the_split_and_the_tasks_options() -> None:
    import random

    from rl.config import DataConfig

    name = f"openenv:{OPENENV_LOCAL}"
    task = get_task(name)
    data = DataConfig(task=name, task_config={"level": 2}, num_train=4, num_test=0)
    task.check(data)
    examples = task.generate(data, 4, random.Random(7))
    draw = random.Random(7)
    seeds = [draw.randrange(2**31) for _ in range(4)]  # the split's rng, one draw each
    for example, seed in zip(examples, seeds, strict=True):
        spec = json.loads(example["openenv"])
        assert spec == {"env": "tandem_spell", "reset": {"level": 2, "seed": seed}}
        assert example["prompt"] == f"[tandem_spell episode {seed}]"
    assert task.scores_episodes and task.score("anything", examples[0]) == 0.0
    with pytest.raises(ValueError, match="data.task_config.seed"):
        task.check(DataConfig(task=name, task_config={"seed": 1}))


def test_an_openenv_environment_and_its_tasks_are_named_together() -> None:
    name = "openenv:some_env"
    check_pairing(name, name, has_files=False)
    with pytest.raises(ValueError, match="set data.task='openenv:some_env'.*'openenv' field"):
        check_pairing(name, "addition", has_files=False)
    with pytest.raises(ValueError, match="openenv environment's tasks.*agent.environment="):
        check_pairing("verifiers:gsm8k", name, has_files=False)
