"""Two-step runs through the whole stack: real Ray, vLLM on CPU, 2-rank FSDP2 gloo groups.

GRPO (with a faulty user reward term alongside the task's) and PPO (critic, reference, KL in
the reward, recomputed proximal log-probs with truncated importance sampling) share one base.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import ray
import torch
from safetensors.torch import load_file

from rl.checkpoint.export import export_checkpoint
from rl.config import Config
from rl.run.driver import RunAborted, train
from rl.sync.shared_memory import SHM_DIR, owner_tag
from tests.helpers.models import build_checkpoint, remove_pad_token
from tests.helpers.resumed_steps import computed
from tests.helpers.tiny_runs import tiny_run_tree, with_tiny_base

pytestmark = pytest.mark.integration


# Raises on responses starting with "1" and hangs on its first call: the run must go on. It
# prints as it scores, which must land in the run's log, not the driver's output.
# Hangs on some responses, raises on others. (Each reward worker is sandboxed: no state it
# could write outlives it, so which item hangs follows from the response; runs are exact, so
# the same items hang every run.)
FAULTY_REWARD = """
import time


def flaky(response, example):
    print("flaky scores", repr(response), flush=True)
    if response and response[0] in "23456789":  # a few (most start with 0 or 1)
        time.sleep(1000)
    if response.startswith("1"):
        raise RuntimeError("boom")
    return 0.0
"""


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory: pytest.TempPathFactory, tiny_base: Path) -> Path:
    return with_tiny_base(tmp_path_factory.mktemp("driver"), tiny_base)


def _config(shared: Path, tmp_path: Path, name: str, **sections: dict) -> Config:
    return Config.model_validate(tiny_run_tree(shared, tmp_path / "runs", name, **sections))


def _run(cfg: Config) -> tuple[dict[str, float], list[dict]]:
    final = train(cfg)
    # train started Ray, so train closes it: nothing is left for atexit after the handlers go.
    assert not ray.is_initialized()
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return final, records


def test_two_grpo_steps_update_weights_and_survive_a_faulty_reward_function(
    shared_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    reward_file = tmp_path / "faulty_reward.py"
    reward_file.write_text(FAULTY_REWARD)
    reward = {
        "terms": [{"name": "task"}, {"name": f"{reward_file}:flaky", "weight": 0.5}],
        "timeout_s": 1.0,
    }
    cfg = _config(shared_dir, tmp_path, "two-steps", reward=reward)
    # This process is the driver: its channels' files, and only those (other runs may share
    # /dev/shm), must be gone when the run ends.
    own_slots = f"tandem-{owner_tag(os.getpid())}-*"
    shm_before = set(SHM_DIR.glob(own_slots))
    final, records = _run(cfg)
    assert set(SHM_DIR.glob(own_slots)) == shm_before  # sync buffers deleted
    run_dir = Path(cfg.run.output_dir) / "two-steps"
    assert [r["step"] for r in records] == [0, 1, 2]
    assert 0.0 <= records[0]["eval/accuracy"] <= 1.0
    for record in records:
        # The engine process's resident peak: torch, vLLM, the model and its KV cache (step 0:
        # since the engine started).
        assert 100 < record["memory/rollout_peak_mb"] < 32_768
    for record in records[1:]:
        for key in (
            "actor/pg_loss",
            "actor/grad_norm",
            "reward/mean",
            "time/sync_s",
            "time/step_s",
        ):
            assert record[key] is not None and math.isfinite(record[key]), key
        # Model TFLOP/s from the config, and the trainer's peak memory; no MFU on CPUs.
        assert record["perf/train_tflops"] > 0 and "perf/mfu" not in record
        assert record["memory/trainer_peak_mb"] > 100
        assert record["response/max_tokens"] >= record["response/mean_tokens"]
    assert final["rollout/version"] == 2
    # On-policy and colocated: every sample is the current version's, nothing overlaps.
    assert all(r["rollout/staleness_max"] == 0 for r in records[1:])
    assert final["run/overlap_fraction"] == 0 and final["run/busy_fraction"] > 0
    assert final["weight_sync/workers_replaced"] == 0
    assert final["weight_sync/mb_per_rollout_rank"] == final["weight_sync/mb_full_model"] > 0
    assert 0.0 <= final["eval/accuracy"] <= 1.0

    assert any(0 < r["reward/mean"] < 1 for r in records[1:]), "no reward signal to learn from"
    # Every sample was scored by the task; the faulty term's failures were counted, not fatal.
    assert sum(r["reward/errors"] for r in records[1:]) > 0
    assert sum(r["reward/timeouts"] for r in records[1:]) > 0
    before = load_file(Path(cfg.model.path) / "model.safetensors")
    after = load_file(run_dir / "hf" / "model.safetensors")
    assert before.keys() == after.keys()
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert "lm_head.weight" in changed and len(changed) > len(before) // 2
    # Not verbose: each actor wrote its output (vLLM's, transformers') to its own log file,
    # and the reward workers theirs (the user's prints) to one of their own.
    logs = {path.name: path.read_text() for path in (run_dir / "logs").iterdir()}
    assert sorted(logs) == ["reward-workers.log", "rollout-0.log", "trainer-0.log", "trainer-1.log"]
    # Trainer rank 1 may have nothing to say: it loads its shards silently, and rank 0 exports.
    assert all(text.strip() for name, text in logs.items() if name != "trainer-1.log"), logs
    assert "flaky scores" in logs["reward-workers.log"]
    assert "flaky scores" not in capfd.readouterr().out


@pytest.mark.parametrize("partial", ["finish", "carry", "streaming"])
def test_two_ppo_steps_train_the_critic_with_kl_in_reward_and_off_policy_weights(
    shared_dir: Path, tmp_path: Path, partial: str
) -> None:
    """Also under partial_rollout carry at k = 1: samples stop every 2 tokens and groups carry
    over to later steps, their values, reference and proximal log-probs computed when their
    step trains. And with the trainer streaming at k = 1: each group's values and log-probs
    as it finishes, the critic's step and the KL coefficient's adaptation at the step's end
    (GAE unwhitened: a group's advantages are its own)."""
    scheduler = {
        "finish": {},
        "carry": {"max_staleness": 1, "partial_rollout": "carry", "abort_every": 2},
        "streaming": {"max_staleness": 1, "streaming": True},
    }[partial]
    cfg = _config(
        shared_dir,
        tmp_path,
        f"ppo-{partial}",
        scheduler=scheduler,
        algorithm={
            "whiten_advantages": partial != "streaming",
            "advantage": "gae",
            "lam": 0.95,
            "kl_coef": 0.01,
            "kl_in_reward": True,
            "kl_target": 0.01,
            "recompute_old_logprobs": True,
            "off_policy": "token-tis",
        },
        critic={"lr": 1e-3},
    )
    final, records = _run(cfg)
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in records[1:]:
        for key in ("critic/value_loss", "critic/grad_norm", "kl/coef", "actor/pg_loss"):
            assert record[key] is not None and math.isfinite(record[key]), key
        assert record["memory/critic_peak_mb"] > 100
        assert record["off_policy/kept_token_frac"] == 1.0
        if partial == "finish":
            # On-policy in fp32: the trainer's proximal log-probs match vLLM's behaviour ones.
            assert record["off_policy/max_abs_logprob_gap"] < 1e-3
        elif partial == "carry":
            assert record["carry/carried_groups"] > 0 and record["carry/max_token_age"] <= 4
    assert records[2]["kl/coef"] != records[1]["kl/coef"]  # adaptive
    assert final["rollout/version"] == 2


def test_a_run_on_the_torch_engine_samples_what_its_trainer_scores(
    shared_dir: Path, tmp_path: Path
) -> None:
    """The time-to-accuracy bench's shape: the PyTorch rollout engine on one CPU generating
    a step ahead of one unsharded trainer rank on the other, whose groups share their prompt
    rows and leave out the rows of zero advantage."""
    cfg = _config(
        shared_dir,
        tmp_path,
        "torch-engine",
        rollout={"engine": "torch"},
        trainer={
            "num_workers": 1,
            "sharding": "none",
            "num_threads": 1,
            "share_prompts": True,
            "skip_zero_advantage_rows": True,
        },
        # A recomputed proximal policy at k = 1 needs a correction against it (the recipe
        # checks refuse none); decoupled PPO weighs each stale token by prox / behaviour.
        algorithm={"recompute_old_logprobs": True, "off_policy": "decoupled"},
        scheduler={"placement": "split", "max_staleness": 1},
    )
    final, records = _run(cfg)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert 0.0 <= records[0]["eval/accuracy"] <= 1.0
    # Step 1's samples come from the weights the trainer starts with: in fp32 the engine's
    # behaviour log-probs are the trainer's, computed over the shared prompt rows.
    assert records[1]["off_policy/max_abs_logprob_gap"] < 1e-3
    for record in records[1:]:
        assert record["rollout/staleness_max"] <= 1
        assert math.isfinite(record["actor/pg_loss"])
        # Groups that all scored alike are left out; some rows are always trained.
        assert 0 <= record["actor/skipped_row_frac"] < 1
    assert any(0 < r["reward/mean"] < 1 for r in records[1:]), "no reward signal to learn from"
    assert final["rollout/version"] == 2
    assert final["weight_sync/mb_per_rollout_rank"] == final["weight_sync/mb_full_model"] > 0


def test_a_model_whose_tokenizer_has_no_pad_token_trains_with_eos_padding(
    tmp_path: Path,
) -> None:
    """A Llama-3/Mistral-style checkpoint: no pad token in its tokenizer or config. The
    driver pads its batches with EOS, so the first train call after generation goes through."""
    model_dir = build_checkpoint(tmp_path / "llama", "llama", tie_word_embeddings=False)
    remove_pad_token(model_dir)
    cfg = _config(
        tmp_path,
        tmp_path,
        "no-pad",
        model={"path": str(model_dir)},
        base={"build_if_missing": False},
        rollout={"engine": "torch"},
        trainer={"num_workers": 1, "sharding": "none"},
        run={"num_steps": 1, "eval_every": 0},
    )
    final, records = _run(cfg)
    assert [r["step"] for r in records] == [0, 1]
    assert math.isfinite(records[1]["actor/pg_loss"])
    assert final["rollout/version"] == 1


def test_an_fp16_run_generates_and_trains_in_half_precision_with_a_loss_scale(
    shared_dir: Path, tmp_path: Path
) -> None:
    """model.dtype=float16 through the whole stack: vLLM generates in fp16, the trainer
    computes in fp16 over fp32 master weights and scales its loss."""
    cfg = _config(
        shared_dir,
        tmp_path,
        "fp16",
        model={"dtype": "float16"},
        algorithm={"recompute_old_logprobs": True},
    )
    final, records = _run(cfg)
    assert [r["step"] for r in records] == [0, 1, 2]
    # Dynamic loss scaling from 2^16: a step whose scaled gradients overflow fp16 is skipped
    # and halves the scale (which steps overflow depends on the base's numerics).
    scale = 2.0**16
    for record in records[1:]:
        if record["actor/nonfinite_skipped"]:
            scale /= 2
        else:
            assert math.isfinite(record["actor/pg_loss"])
            assert math.isfinite(record["actor/grad_norm"])
        assert record["actor/loss_scale"] == scale
    trained = [r for r in records[1:] if not r["actor/nonfinite_skipped"]]
    assert any(r["actor/grad_norm"] > 0 for r in trained), "no reward signal to learn from"
    # Both sides in fp16 from the same weights: the engine's log-probs are the trainer's
    # within half precision's rounding.
    assert records[1]["off_policy/max_abs_logprob_gap"] < 5e-2
    assert final["rollout/version"] == 2


@pytest.mark.parametrize(
    "max_staleness, placement",
    [(1, "colocate"), (0, "split"), (1, "split")],
)
def test_overlapped_runs_stay_within_their_staleness_bound_and_trace_every_phase(
    shared_dir: Path, tmp_path: Path, max_staleness: int, placement: str
) -> None:
    name = f"k{max_staleness}-{placement}"
    scheduler = {"max_staleness": max_staleness, "placement": placement}
    if placement == "split":
        scheduler["trainer_devices"] = 1  # rollout on bundle 0, both trainer ranks on bundle 1
    cfg = _config(shared_dir, tmp_path, name, scheduler=scheduler, run={"num_steps": 3})
    final, records = _run(cfg)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    staleness = [r["rollout/staleness_max"] for r in records[1:]]
    assert max(staleness) == max_staleness  # step 1 is on-policy; later ones use the bound
    assert final["rollout/version"] == 3
    clipped = [r["actor/clip_frac"] for r in records[1:]]
    if max_staleness:
        # Stale samples: PPO's ratio against each token's behaviour log-prob moves off 1 and
        # its clip bounds the update.
        assert max(clipped) > 0 and final["run/overlap_fraction"] > 0
    else:
        assert max(clipped) == 0 and final["run/overlap_fraction"] == 0

    trace_path = Path(cfg.run.output_dir) / name / "trace.json"
    trace = json.loads(trace_path.read_text())
    lanes = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    phases = {(lanes[e["tid"]], e["name"]) for e in trace["traceEvents"] if e["ph"] == "X"}
    for lane, phase in [
        ("rollout-0", "generate"),
        ("rollout-0", "eval"),
        ("rollout-0", "sync"),
        ("reward", "reward"),
        ("trainer", "train"),
        ("trainer", "sync"),
        ("trainer", "checkpoint"),
    ]:
        assert (lane, phase) in phases, (lane, phase)
    assert 0 < final["run/busy_fraction"] <= 1


def test_steps_with_a_nan_loss_are_skipped_and_too_many_stop_the_run_with_a_checkpoint(
    shared_dir: Path, tmp_path: Path
) -> None:
    # A reward finite in float32 (non-finite ones score 0), but REINFORCE++'s whitening over
    # the batch overflows summing it: every advantage, loss and gradient is NaN.
    reward_file = tmp_path / "huge_reward.py"
    reward_file.write_text("def huge(response, example):\n    return 3e38\n")
    cfg = _config(
        shared_dir,
        tmp_path,
        "nan",
        algorithm={"advantage": "reinforce_pp"},
        reward={"terms": [{"name": f"{reward_file}:huge"}]},
        faults={"max_nonfinite_steps": 2},
        run={"num_steps": 4},
    )
    with pytest.raises(RunAborted, match=r"2 steps in a row \(up to step 2\) had a NaN/inf loss"):
        _run(cfg)
    run_dir = Path(cfg.run.output_dir) / "nan"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["actor/nonfinite_skipped"] for r in records[1:]] == [1.0, 1.0]
    # The checkpoint holds the last good weights: the base's, since no step was taken.
    exported = export_checkpoint(run_dir / "checkpoints" / "step_000002", tmp_path / "hf")
    before = load_file(Path(cfg.model.path) / "model.safetensors")
    after = load_file(exported / "model.safetensors")
    assert all(torch.equal(before[name], after[name]) for name in before)


def _kill_a_trainer_rank_after(run_dir: Path, step: int) -> threading.Thread:
    """Kills the last of this test's TrainWorkers once step `step`'s record is logged."""

    def kill() -> None:
        metrics = run_dir / "metrics.jsonl"
        while not metrics.exists() or f'"step": {step},' not in metrics.read_text():
            time.sleep(0.05)
        ranks = [p for p in psutil.Process().children(recursive=True) if _is_train_worker(p)]
        os.kill(ranks[-1].pid, signal.SIGKILL)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def _is_train_worker(process: psutil.Process) -> bool:
    try:
        return process.cmdline()[0].startswith("ray::TrainWorker")
    except (psutil.Error, IndexError):
        return False


def test_a_killed_trainer_rank_rebuilds_every_role_from_the_last_checkpoint_exactly(
    shared_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Overlapped (max_staleness 1): killed once step 3 is logged, while step 4 trains and
    nothing newer is checkpointed than step 2. The rebuilt run logs step 3 again, bit for bit
    as the lost attempt did (its record is kept in metrics.replaced.jsonl)."""
    cfg = _config(
        shared_dir,
        tmp_path,
        "trainer-killed",
        checkpoint={"every": 2},
        run={"num_steps": 4},
        scheduler={"max_staleness": 1},
    )
    run_dir = Path(cfg.run.output_dir) / "trainer-killed"
    killer = _kill_a_trainer_rank_after(run_dir, step=3)
    final, records = _run(cfg)
    killer.join(timeout=1)
    assert not killer.is_alive()
    out = capsys.readouterr().out
    assert "an actor died (ActorDiedError); rebuilding every role from" in out
    assert "step_000002 (restart 1/2)" in out
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert final["rollout/version"] == 4
    lost = [
        json.loads(line) for line in (run_dir / "metrics.replaced.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in lost] == [3]
    assert computed(records[3]) == computed(lost[0])
