"""The demo recipe, run as `make demo` runs it, with fewer steps: base build, GRPO, export,
and `rl report` on the run; then the distillation recipe, its teacher the demo run's policy."""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl.observe.report import build_figures, read_metrics
from tests.helpers.cli import run_rl
from tests.helpers.metric_keys import check_metric_keys
from tests.helpers.tracker_files import same_metrics, tensorboard_scalars, wandb_history

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def demo_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess]:
    """The demo recipe's run under a directory of its own: (that directory, `rl train`'s
    result)."""
    tmp_path = tmp_path_factory.mktemp("demo")
    overrides = [
        f"model.path={tmp_path / 'base'}",
        f"data.dir={tmp_path / 'data'}",
        f"run.output_dir={tmp_path / 'runs'}",
        "base.sft_steps=60",
        "run.num_steps=3",
        "run.eval_every=2",
        "run.num_eval_prompts=32",
        "run.wandb_mode=offline",
    ]
    return tmp_path, run_rl("train", "recipes/grpo_addition_cpu.yaml", *overrides)


def test_demo_recipe_builds_its_base_trains_and_exports(
    demo_run: tuple[Path, subprocess.CompletedProcess],
) -> None:
    tmp_path, result = demo_run
    assert result.returncode == 0, result.stderr[-4000:]
    assert "held-out greedy accuracy before RL:" in result.stdout
    # The console shows the driver's lines only: the workers' output went to the run's logs/.
    assert "(RolloutWorker pid=" not in result.stdout + result.stderr
    assert "started a local Ray: " in result.stdout
    assert "before ->" in result.stdout and "after 3 steps" in result.stdout
    # Off a terminal, the progress display is a status line a step.
    status = re.findall(r"^step (\d)/3 · ETA \d+:\d\d:\d\d · reward [\d.e-]+", result.stdout, re.M)
    assert status == ["1", "2", "3"], result.stdout

    base_info = json.loads((tmp_path / "base" / "base_info.json").read_text())
    assert base_info["sft_steps"] <= 60
    run_dir = tmp_path / "runs" / "grpo-addition"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 2, 3]
    assert records[-1]["rollout/version"] == 3
    # The trackers hold what metrics.jsonl holds (tensorboard in float32).
    same_metrics(records, wandb_history(run_dir), rel=0)
    same_metrics(records, tensorboard_scalars(run_dir / "tensorboard"), rel=1e-6)

    exported = run_dir / "hf"
    model = AutoModelForCausalLM.from_pretrained(exported)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert tokenizer.chat_template is not None
    assert (
        model.config.num_hidden_layers
        == json.loads((run_dir / "config.json").read_text())["base"]["num_layers"]
    )

    check_metric_keys(records)
    _check_report(run_dir)
    _check_eval_and_generate(tmp_path, run_dir, base_info)


def _check_eval_and_generate(tmp_path: Path, run_dir: Path, base_info: dict) -> None:
    """`rl eval` reproduces the base's recorded held-out accuracy on either engine (vLLM and
    the PyTorch one, against the base builder's transformers greedy decoding), evaluates a run
    checkpoint, and `rl generate` prints samples with their log-probs."""
    test_file = next((tmp_path / "data").glob("addition-*/test.jsonl"))
    max_new = str(json.loads((run_dir / "config.json").read_text())["rollout"]["max_new_tokens"])
    base = run_rl(
        "eval", str(tmp_path / "base"), "--data", str(test_file), "--max-new-tokens", max_new
    )
    assert base.returncode == 0, base.stderr[-3000:]
    accuracy = float(re.search(r"greedy accuracy ([\d.]+)% over (\d+) prompts", base.stdout)[1])
    # Near-tied logits may decode differently in the two engines: within a prompt or two.
    assert abs(accuracy / 100 - base_info["greedy_accuracy"]) <= 0.01, base.stdout
    on_torch = run_rl(
        "eval",
        str(tmp_path / "base"),
        "--data",
        str(test_file),
        "--max-new-tokens",
        max_new,
        "--engine",
        "torch",
    )
    assert on_torch.returncode == 0, on_torch.stderr[-3000:]
    torch_accuracy = float(re.search(r"greedy accuracy ([\d.]+)%", on_torch.stdout)[1])
    assert abs(torch_accuracy / 100 - base_info["greedy_accuracy"]) <= 0.01, on_torch.stdout

    checkpoint = run_dir / "checkpoints" / "step_000003"
    trained = run_rl(
        "eval", str(checkpoint), "--data", str(test_file), "--k", "4", "--max-new-tokens", max_new
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert re.search(r"pass@4 [\d.]+%, pass@1 [\d.]+%", trained.stdout), trained.stdout

    generated = run_rl(
        "generate", str(run_dir / "hf"), "12+34", "--n", "2", "--max-new-tokens", max_new
    )
    assert generated.returncode == 0, generated.stderr[-3000:]
    samples = re.findall(r"sample (\d) \((stop|length), log-prob (-?[\d.]+)\)", generated.stdout)
    assert [index for index, _, _ in samples] == ["0", "1"], generated.stdout
    assert all(float(logprob) <= 0 for _, _, logprob in samples)


REPORT_IMAGES = ("reward.png", "length.png", "kl_entropy.png", "step_time.png", "timeline.png")


def _check_report(run_dir: Path) -> None:
    result = run_rl("report", str(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = (run_dir / "report" / "summary.md").read_text()
    assert "| held-out greedy accuracy |" in summary
    for name in REPORT_IMAGES:
        png = (run_dir / "report" / name).read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000, name
        assert f"]({name})" in summary, name

    figures = build_figures(run_dir, read_metrics(run_dir))
    reward = figures["reward.png"].axes[0]
    assert reward.get_xlabel() == "step"
    lines = {line.get_label(): line for line in reward.get_lines()}
    assert list(lines) == [
        "reward (mean)",
        "held-out greedy accuracy",
        "groups with a solved sample",
    ]
    assert list(lines["held-out greedy accuracy"].get_xdata()) == [0, 2, 3]
    assert list(lines["reward (mean)"].get_xdata()) == [1, 2, 3]
    length, truncated = figures["length.png"].axes
    assert [line.get_label() for line in length.get_lines()] == [
        "mean response tokens",
        "longest response",
    ]
    assert truncated.get_ylabel() == "fraction truncated"
    kl = [line.get_label() for line in figures["kl_entropy.png"].axes[0].get_lines()]
    assert kl == ["entropy", "KL to the old policy"]  # no reference: kl_coef is 0
    phases = {bars.get_label() for bars in figures["step_time.png"].axes[0].containers}
    assert {"generate", "train", "sync"} <= phases
    timeline = figures["timeline.png"].axes[0]
    assert [t.get_text() for t in timeline.get_yticklabels()][:2] == ["rollout-0", "trainer"]


def test_distill_recipe_builds_a_smaller_student_and_trains_it_from_the_demos_policy(
    demo_run: tuple[Path, subprocess.CompletedProcess],
) -> None:
    """The demo run's exported policy is the teacher; the recipe builds its own student base
    (a smaller model, the demo's tokenizer settings), checks that the two share a tokenizer,
    and trains the student on the teacher's per-token log-probs with real teacher ranks."""
    tmp_path, demo = demo_run
    assert demo.returncode == 0, demo.stderr[-4000:]
    teacher = tmp_path / "runs" / "grpo-addition" / "hf"
    student = tmp_path / "student"
    overrides = [
        f"model.path={student}",
        f"teacher.path={teacher}",
        f"data.dir={tmp_path / 'data'}",
        f"run.output_dir={tmp_path / 'runs'}",
        "base.sft_steps=25",
        "teacher.num_workers=1",
        "run.num_steps=2",
        "run.prompts_per_step=8",
        "run.num_eval_prompts=0",
        "run.wandb_mode=disabled",
        "run.tensorboard=false",
    ]
    result = run_rl("train", "recipes/distill_addition_cpu.yaml", *overrides)
    assert result.returncode == 0, result.stderr[-4000:]
    base = json.loads((student / "base_info.json").read_text())
    teacher_size = sum(t.numel() for t in load_file(teacher / "model.safetensors").values())
    assert base["num_parameters"] < teacher_size
    assert AutoTokenizer.from_pretrained(student).get_vocab() == (
        AutoTokenizer.from_pretrained(teacher).get_vocab()
    )

    run_dir = tmp_path / "runs" / "distill-addition"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in records[1:]:
        # The teacher scored every sampled token: the student's reverse KL to it, on its own
        # samples, is an estimate of a divergence between two different models.
        assert math.isfinite(record["distill/reverse_kl"]) and record["distill/reverse_kl"] != 0
        assert math.isfinite(record["actor/pg_loss"]) and record["actor/grad_norm"] > 0
    check_metric_keys(records)
    logs = sorted(path.name for path in (run_dir / "logs").iterdir())
    assert "teacher-0.log" in logs, logs
    before = load_file(student / "model.safetensors")
    after = load_file(run_dir / "hf" / "model.safetensors")
    assert any(not torch.equal(before[name], after[name]) for name in before)
