"""`rl train` rejects bad input before anything starts: exit 2, a message naming the problem."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.helpers.repo import REPO, RUNTIME_ENV, shipped_recipes

DEMO = "recipes/grpo_addition_cpu.yaml"

# Runs the CLI in a fresh interpreter, once per argument list, and proves no actor could have
# started: neither Ray nor vLLM nor the driver was even imported. One interpreter serves a
# list: its imports cost about 2 s, a call after them milliseconds.
_PROBE = """
import contextlib, io, json, sys, traceback
from rl.cli import main
results = []
for argv in json.load(sys.stdin):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exit:  # argparse's errors and --help
            rc = 0 if exit.code is None else exit.code
        except Exception:
            traceback.print_exc()
            rc = 1
    results.append({"returncode": rc, "stdout": out.getvalue(), "stderr": err.getvalue()})
heavy = [m for m in ("ray", "vllm", "rl.run.driver") if m in sys.modules]
assert not heavy, heavy
print(json.dumps(results))
"""


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def run_cli_many(*argvs: list[str]) -> list[CliResult]:
    """`rl ARGV` for each of `argvs`, in turn in one fresh interpreter from the repository root."""
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE],
        input=json.dumps(argvs),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0, probe.stderr[-4000:]
    return [CliResult(**result) for result in json.loads(probe.stdout.splitlines()[-1])]


def run_cli(*args: str) -> CliResult:
    return run_cli_many(list(args))[0]


def test_unknown_override_key_names_key_file_and_closest_keys() -> None:
    result = run_cli("train", DEMO, "trainer.lrr=1e-3")
    assert result.returncode == 2
    assert "unknown key 'trainer.lrr'" in result.stderr
    assert DEMO in result.stderr
    assert "did you mean 'trainer.lr'" in result.stderr


def test_unknown_key_in_recipe_file_names_the_file(tmp_path: Path) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model:\n  path: x\nrollout:\n  temprature: 0.5\n")
    result = run_cli("train", str(recipe))
    assert result.returncode == 2
    assert str(recipe) in result.stderr
    assert "unknown key 'rollout.temprature'" in result.stderr
    assert "rollout.temperature" in result.stderr


def test_wrong_type_names_key_value_and_override() -> None:
    result = run_cli("train", DEMO, "run.num_steps=many")
    assert result.returncode == 2
    assert "run.num_steps" in result.stderr
    assert "'many'" in result.stderr
    assert "override run.num_steps=many" in result.stderr


def test_missing_recipe_file_is_named() -> None:
    result = run_cli("train", "recipes/does_not_exist.yaml")
    assert result.returncode == 2
    assert "recipe file not found: recipes/does_not_exist.yaml" in result.stderr


def test_missing_model_path_says_how_to_build_it() -> None:
    result = run_cli("train", DEMO, "model.path=/nonexistent/model", "base.build_if_missing=false")
    assert result.returncode == 2
    assert "model.path='/nonexistent/model' does not exist" in result.stderr
    assert f"rl build-base {DEMO}" in result.stderr


def test_frozen_pattern_matching_no_parameter_is_named(tiny_model_dir: Path) -> None:
    result = run_cli("train", DEMO, f"model.path={tiny_model_dir}", "model.frozen=[model.embed.*]")
    assert result.returncode == 2
    assert "model.frozen: 'model.embed.*' matches no parameter" in result.stderr
    assert "model.embed_tokens.weight" in result.stderr  # the names it could have meant


REJECTED = [
    "trainer.num_mini_batches=5",
    "algorithm.group_size=1",
    "algorithm.kl_estimator=k4",
    "algorithm.loss_agg=sum",
    "scheduler.rollout_devices=1",  # sizes the split placement only
    "scheduler.max_staleness=-1",
    "scheduler.devices_per_node=3",  # TP 2 groups would straddle nodes (with the next one)
    "algorithm.off_policy=is",
    "algorithm.dual_clip=0.5",
    "algorithm.kl_target=0.1",  # needs kl_in_reward and a kl_coef
    "algorithm.overlong_buffer=8",
    "data.task=math",  # needs data files
    "data.task=multiplication",
    "reward.terms=[{name: nope}]",
    "trainer.sharding=hybrid",  # without trainer.shard_group_size
    "trainer.shard_group_size=2",  # sizes hybrid sharding only
    "trainer.micro_batch_tokens=-1",
    "scheduler.num_devices=2",  # with scheduler.placement=split below
    "rollout.engine=torch",  # with rollout.tensor_parallel_size=2 below
    "rollout.engine=sglang",
    "trainer.share_prompts=true",  # with trainer.packing=true below
    "rollout.compile=true",  # with rollout.engine=torch below
]


def _rejected_argv(override: str) -> list[str]:
    """The demo recipe with `override`, and what makes it the inconsistent case."""
    needs_tp = override.startswith("scheduler.devices") or override == "rollout.engine=torch"
    tp = ["rollout.tensor_parallel_size=2"] if needs_tp else []
    split = ["scheduler.placement=split"] if override.startswith("scheduler.num_devices") else []
    packing = ["trainer.packing=true"] if override.startswith("trainer.share_prompts") else []
    engine = ["rollout.engine=torch"] if override.startswith("rollout.compile") else []
    return ["train", DEMO, override, *tp, *split, *packing, *engine]


@pytest.fixture(scope="module")
def rejected() -> dict[str, CliResult]:
    results = run_cli_many(*(_rejected_argv(override) for override in REJECTED))
    return dict(zip(REJECTED, results, strict=True))


@pytest.mark.parametrize("override", REJECTED)
def test_inconsistent_or_unregistered_values_are_rejected(
    override: str, rejected: dict[str, CliResult]
) -> None:
    result = rejected[override]
    assert result.returncode == 2
    assert override.split("=")[0] in result.stderr


RECIPES = [str(p.relative_to(REPO)) for p in shipped_recipes()]


@pytest.fixture(scope="module")
def dry_runs() -> dict[str, CliResult]:
    results = run_cli_many(*(["train", recipe, "--dry-run"] for recipe in RECIPES))
    return dict(zip(RECIPES, results, strict=True))


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_dry_runs_without_starting_anything(
    recipe: str, dry_runs: dict[str, CliResult]
) -> None:
    result = dry_runs[recipe]  # the probe fails if ray/vllm were imported
    assert result.returncode == 0, result.stderr
    assert f"{recipe}: config ok" in result.stdout
    assert "colocate:" in result.stdout and "trainer: " in result.stdout
    assert "dry run: nothing started" in result.stdout


def test_dry_run_refuses_a_plan_too_big_for_the_devices_it_is_told_of(tmp_path: Path) -> None:
    # Qwen2.5-7B's sizes are all the estimate reads: no weights needed.
    config = {
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    recipe = "recipes/gpu/ppo_qwen2.5_7b_gsm8k.yaml"
    dry_run = ["train", recipe, f"model.path={tmp_path}", "--dry-run", "--device-memory-gb"]
    fits, lora, small = run_cli_many(
        [*dry_run, "80"], [*dry_run, "80", "model.lora.rank=16"], [*dry_run, "40"]
    )
    assert fits.returncode == 0, fits.stderr
    assert "model: 7.616B parameters; devices: GPUs of 80 GiB" in fits.stdout
    assert "fits, a device shared by a trainer rank and vLLM" in fits.stdout
    # With LoRA at rank 16 on all seven linears: 28 layers x 16 x (in + out of each) adapter
    # parameters, trained (16 bytes each) over the frozen base (4 bytes each) on 8 ranks.
    assert lora.returncode == 0, lora.stderr
    assert "LoRA: 40.37M adapter parameters train (rank 16)" in lora.stdout
    assert "trainer rank: params 3.57, grads 0.02, optimizer 0.04," in lora.stdout
    assert small.returncode == 2
    assert f"error: {recipe}: the plan does not fit its devices" in small.stderr
    assert (
        "needed of 40.00 GiB; shard over more trainer ranks (trainer.num_workers)" in small.stderr
    )


def test_the_ray_runtime_env_example_ships_the_checkout_and_streams_logs() -> None:
    runtime_env = yaml.safe_load(RUNTIME_ENV.read_text())
    assert set(runtime_env) <= {"working_dir", "excludes", "env_vars", "pip", "py_modules"}
    assert runtime_env["working_dir"] == "."
    assert {".git", "runs", ".cache"} <= set(runtime_env["excludes"])
    assert runtime_env["env_vars"]["PYTHONUNBUFFERED"] == "1"


def test_log_format_and_verbose_flags_set_their_run_keys() -> None:
    result = run_cli("train", DEMO, "--dry-run", "--log-format", "json", "--verbose")
    assert result.returncode == 0, result.stderr
    assert '"log_format": "json"' in result.stdout and '"verbose": true' in result.stdout


def test_eval_of_a_non_model_or_a_missing_data_file_fails_before_vllm_starts(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    no_data = ["eval", str(tiny_model_dir), "--data", str(tmp_path / "no.jsonl")]
    not_a_model, no_task, missing = run_cli_many(
        ["eval", str(tmp_path), "--data", "x.jsonl", "--task", "addition"],
        no_data,
        [*no_data, "--task", "addition"],
    )
    assert not_a_model.returncode == 2
    assert f"{tmp_path} is neither an HF model directory" in not_a_model.stderr
    assert no_task.returncode == 2
    assert "does not record its task: give --task" in no_task.stderr
    assert missing.returncode == 2
    assert f"data file not found: {tmp_path / 'no.jsonl'}" in missing.stderr


def test_report_of_a_directory_without_a_run_names_the_missing_file(tmp_path: Path) -> None:
    result = run_cli("report", str(tmp_path))
    assert result.returncode == 2
    assert f"{tmp_path / 'metrics.jsonl'} is missing" in result.stderr


def test_dry_run_reports_missing_inputs_without_failing() -> None:
    result = run_cli(
        "train", DEMO, "--dry-run", "model.path=/nowhere", "base.build_if_missing=false"
    )
    assert result.returncode == 0
    assert "inputs NOT READY HERE" in result.stdout and "/nowhere" in result.stdout


def test_help_config_lists_every_key_with_type_default_and_description() -> None:
    result = run_cli("train", "--help-config")
    assert result.returncode == 0
    assert "trainer.lr: float = 1e-05  # AdamW learning rate" in result.stdout
    assert "model.path: str = (required)" in result.stdout


def test_a_bad_data_row_is_named_by_file_and_line_before_anything_starts(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": " ", "answer": "3"}\n')
    test.write_text('{"prompt": "2+2=", "answer": "4"}\n')
    files = [f"data.train_files=[{train}]", f"data.test_files=[{test}]"]
    result = run_cli("train", DEMO, f"model.path={tiny_model_dir}", *files)
    assert result.returncode == 2
    assert f"data file {train} line 2: 'prompt' is empty" in result.stderr
    assert "data.bad_rows=skip" in result.stderr


def test_a_missing_resume_checkpoint_is_named_before_anything_starts(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "checkpoints" / "step_000009"
    result = run_cli("train", DEMO, f"model.path={tiny_model_dir}", "--resume", str(missing))
    assert result.returncode == 2
    assert f"checkpoint {missing} does not exist" in result.stderr


def test_generate_with_an_unknown_environment_fails_before_the_engine_starts(
    tiny_model_dir: Path,
) -> None:
    result = run_cli("generate", str(tiny_model_dir), "1+1", "--environment", "nope")
    assert result.returncode == 2
    assert (
        "agent.environment 'nope' is neither a built-in environment (calculator, tool_use)"
        in result.stderr
    )


def test_agent_recipe_errors_name_the_key() -> None:
    agent = "recipes/agent_calculator_cpu.yaml"
    messages = {
        "agent.environment=nope": "agent.environment 'nope' is neither a built-in environment",
        "agent.environment=no_env.py:Env": "agent.environment 'no_env.py:Env': file 'no_env.py'",
        "agent.environment=no_env.py": "agent.environment 'no_env.py': name the object too",
        "agent.env_timeout_s=0": "agent.env_timeout_s must be >= 0.001, got 0.0",
        "agent.max_turns=0": "agent.max_turns must be >= 1, got 0",
        "agent.tool_call_format=xml": "agent.tool_call_format='xml' is not one of hermes",
        "trainer.share_prompts=true": "trainer.share_prompts does not apply to agent episodes",
    }
    results = run_cli_many(*(["train", agent, "--dry-run", override] for override in messages))
    for (override, message), result in zip(messages.items(), results, strict=True):
        assert result.returncode == 2, override
        assert message in result.stderr, result.stderr


def test_a_users_environment_is_read_not_imported_by_the_dry_run(tmp_path: Path) -> None:
    marker = tmp_path / "imported"
    env_file = tmp_path / "my_env.py"
    env_file.write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from rl.agents.environment import Environment\n"
        "class Mine(Environment):\n"
        "    tools = ('python',)\n"
    )
    agent = "recipes/agent_calculator_cpu.yaml"
    result = run_cli("train", agent, "--dry-run", f"agent.environment={env_file}:Mine")
    assert result.returncode == 0, result.stderr
    assert f"agent: environment {env_file}:Mine in 2 sandboxed workers per process" in result.stdout
    assert "tools the environment's (hermes calls)" in result.stdout
    assert not marker.exists()


def test_an_agent_function_is_read_not_imported_by_the_dry_run(tmp_path: Path) -> None:
    marker = tmp_path / "imported"
    agent_file = tmp_path / "my_agent.py"
    agent_file.write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "def run(example, base_url, api_key, model):\n"
        "    return None\n"
    )
    recipe = "recipes/agent_openai_cpu.yaml"
    ok, missing = run_cli_many(
        ["train", recipe, "--dry-run", f"agent.environment=openai:{agent_file}:run"],
        ["train", recipe, "--dry-run", f"agent.environment=openai:{agent_file}:nope"],
    )
    assert ok.returncode == 0, ok.stderr
    assert f"agent: the function openai:{agent_file}:run, calling the rollout workers'" in ok.stdout
    assert "the agent function (2 workers, 2048 MiB, reaching only its endpoint)" in ok.stdout
    assert not marker.exists()
    assert missing.returncode == 2
    assert f"agent.environment 'openai:{agent_file}:nope'" in missing.stderr


# As Docker's default profile leaves a root container: no CAP_SYS_ADMIN, so no namespaces.
_WITHOUT_CAP_SYS_ADMIN = (
    "import ctypes, os, sys\n"
    "assert ctypes.CDLL(None).prctl(24, 21, 0, 0, 0) == 0  # PR_CAPBSET_DROP, CAP_SYS_ADMIN\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'rl.cli', *sys.argv[1:]])\n"
)


def test_the_dry_run_reports_the_sandbox_users_code_gets(dry_runs: dict[str, CliResult]) -> None:
    assert (
        "sandbox for reward functions (2 workers, 4096 MiB): fully isolated: network isolated, "
        "user uid 65534, processes own pid namespace, filesystem read-only host, private HOME "
        "and /tmp (256 MiB)"
    ) in dry_runs[DEMO].stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="drops a capability only root holds")
def test_require_refuses_to_train_without_full_isolation_naming_what_is_missing(
    tmp_path: Path,
) -> None:
    def rl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", _WITHOUT_CAP_SYS_ADMIN, *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
        )

    dry = rl("train", DEMO, "--dry-run", "sandbox.require=true")
    assert dry.returncode == 0, dry.stderr
    assert "sandbox REFUSED HERE: sandbox.require is set and this sandbox is not" in dry.stdout
    run = rl("train", DEMO, "sandbox.require=true", f"run.output_dir={tmp_path}")
    assert run.returncode == 2, run.stderr
    assert "error: sandbox.require is set" in run.stderr and "network NOT isolated" in run.stderr
    assert "started a local Ray" not in run.stdout and not any(tmp_path.iterdir())


def test_a_teacher_refused_once_the_run_has_built_its_base_exits_with_the_message(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """The student base a run builds is compared with the teacher only once built, inside
    train: its ConfigError is a user's error like the ones found before (exit 2, the message),
    not a traceback."""
    import types

    from rl.cli import main
    from rl.config.recipe import ConfigError

    def train(cfg, resume_from):
        raise ConfigError(f"run {cfg.run.name}: teacher.path={cfg.teacher.path!r} differs")

    driver = types.ModuleType("rl.run.driver")
    driver.train, driver.RunAborted = train, RuntimeError
    monkeypatch.setitem(sys.modules, "rl.run.driver", driver)
    code = main(
        [
            "train",
            "recipes/distill_addition_cpu.yaml",
            f"model.path={tmp_path / 'student'}",  # built by the run (base.build_if_missing)
            f"teacher.path={tiny_model_dir}",
            f"run.output_dir={tmp_path / 'runs'}",
        ]
    )
    assert code == 2
    assert capsys.readouterr().err == (
        f"error: run distill-addition: teacher.path='{tiny_model_dir}' differs\n"
    )
