"""RewardScorer with real worker processes: weighted sums, and reward functions that raise,
hang, spin or kill their process. (Scoring speed is measured by bench/reward_scoring.py: a
wall-clock bound here would fail whenever other work shares the cores.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rl.config import RewardConfig, RewardTermConfig
from rl.data.tasks import get_task
from rl.rewards import RewardScorer
from tests.helpers.processes import child_pids

HANG_S = 1000  # how long the "sleep" reward function hangs

USER_REWARDS = f"""
import math
import os
import time


def length(response, example):
    return len(response) / 10


def secret(response, example):
    return 1.0 if "TANDEM_TEST_SECRET" in os.environ else 0.0


def hog(response, example):
    return float(len(bytearray(example["mb"] << 20)))


def noisy(response, example):
    print("NOISE from a reward function", flush=True)
    return 1.0


def huge(response, example):
    return 1e30


def flaky(response, example):
    mode = example.get("mode", "ok")
    if mode == "raise":
        raise KeyError("no such field")
    if mode == "sleep":
        time.sleep({HANG_S})
    if mode == "spin":
        while True:
            pass
    if mode == "exit":
        os._exit(3)
    if mode == "nan":
        return math.nan
    return 1.0
"""


def _worker_pids() -> set[int]:
    """Live reward worker processes that are children of this test process."""
    return child_pids(b"rl.rewards.pool_worker")


def _terms(*terms: tuple[str, float]) -> list[RewardTermConfig]:
    return [RewardTermConfig(name=name, weight=weight) for name, weight in terms]


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("user") / "user_rewards.py"
    path.write_text(USER_REWARDS)
    return path


@pytest.fixture(scope="module")
def combined(rewards_file: Path) -> Iterator[RewardScorer]:
    terms = _terms(("task", 1.0), ("arithmetic", 2.0), (f"{rewards_file}:length", 0.5))
    with RewardScorer(RewardConfig(terms=terms), get_task("addition")) as scorer:
        yield scorer


def test_weighted_sum(combined: RewardScorer) -> None:
    responses = ["0579", "057", "12345"]
    examples = [{"prompt": "123+456", "answer": "0579"}] * 3
    rewards, metrics = combined.score(["123+456"] * 3, responses, examples)
    assert rewards.dtype == torch.float32 and rewards.shape == (3,)
    # task and arithmetic: [1, 0, 0]; length: [0.4, 0.3, 0.5].
    assert rewards.tolist() == pytest.approx([3 + 0.2, 0.15, 0.25])
    assert metrics == pytest.approx(
        {
            "reward/task_mean": 1 / 3,
            "reward/arithmetic_mean": 1 / 3,
            "reward/length_mean": 0.4,
            # Fractions scored above 0: the verifiers' accuracy, any positive length.
            "reward/task_accuracy": 1 / 3,
            "reward/arithmetic_accuracy": 1 / 3,
            "reward/length_accuracy": 1.0,
            "reward/errors": 0.0,
            "reward/timeouts": 0.0,
        }
    )
    with pytest.raises(ValueError, match="3 prompts, 2 responses and 3 examples differ"):
        combined.score(["123+456"] * 3, responses[:2], examples)


def test_512_samples_get_the_weighted_sum_of_every_term_without_errors(
    combined: RewardScorer,
) -> None:
    # A batch the size of a step's, spread over the worker processes.
    n = 512
    examples = [{"prompt": f"{i}+{i}", "answer": str(2 * i)} for i in range(n)]
    responses = [e["answer"] if i % 3 else "wrong" for i, e in enumerate(examples)]
    prompts = [e["prompt"] for e in examples]
    rewards, metrics = combined.score(prompts, responses, examples)
    # task and arithmetic (weights 1 + 2) judge every third response wrong; length is 0.5 * len / 10.
    right = torch.tensor([i % 3 != 0 for i in range(n)], dtype=torch.float32)
    lengths = torch.tensor([len(r) / 10 for r in responses])
    torch.testing.assert_close(rewards, 3 * right + 0.5 * lengths)
    assert metrics["reward/errors"] == metrics["reward/timeouts"] == 0


def test_failures_score_zero_and_are_counted(rewards_file: Path) -> None:
    modes = ["ok", "raise", "ok", "sleep", "ok", "spin", "exit", "nan", "ok", "ok"]
    examples = [{"prompt": "1+1", "answer": "02", "mode": mode} for mode in modes]
    terms = _terms((f"{rewards_file}:flaky", 1.0), ("task", 10.0))
    cfg = RewardConfig(terms=terms, timeout_s=1.0, num_processes=2)
    others = _worker_pids()  # of scorers other tests keep
    with RewardScorer(cfg, get_task("addition")) as scorer:
        first_workers = _worker_pids() - others
        assert len(first_workers) == 2
        start = time.monotonic()
        rewards, metrics = scorer.score(["1+1"] * 10, ["02"] * 10, examples)
        # The hung call did not hold the batch: it returned in far less than the hang (it
        # takes about the 1 s timeout twice, plus restarting workers, even on busy cores).
        assert time.monotonic() - start < HANG_S / 2
        expected = [11.0 if mode == "ok" else 10.0 for mode in modes]
        assert rewards.tolist() == expected
        assert metrics["reward/errors"] == 3  # raise, exit, nan
        assert metrics["reward/timeouts"] == 2  # sleep, spin
        assert metrics["reward/flaky_mean"] == pytest.approx(0.5)
        assert metrics["reward/flaky_accuracy"] == pytest.approx(0.5)  # failures score 0
        # The hung workers were killed, not left running; their replacements serve on.
        workers = _worker_pids() - others
        assert len(workers) == 2 and not first_workers & workers
        good = [{"prompt": "1+1", "answer": "02"}] * 4
        rewards, metrics = scorer.score(["1+1"] * 4, ["02"] * 4, good)
        assert rewards.tolist() == [11.0] * 4 and metrics["reward/errors"] == 0
    assert _worker_pids() == others


def test_on_error_fail_names_term_and_sample(rewards_file: Path) -> None:
    name = f"{rewards_file}:flaky"
    cfg = RewardConfig(terms=_terms((name, 1.0)), on_error="fail", num_processes=1)
    examples = [{"mode": "ok"}, {"mode": "ok"}, {"mode": "raise"}, {"mode": "ok"}]
    with RewardScorer(cfg, get_task("addition")) as scorer:
        message = rf"reward term '{name}' failed on sample 2 \(error\): KeyError: 'no such field'"
        with pytest.raises(RuntimeError, match=message):
            scorer.score([""] * 4, [""] * 4, examples)
        # The next batch is not confused by results left over from the failed one.
        rewards, _ = scorer.score([""] * 2, [""] * 2, [{"mode": "ok"}] * 2)
        assert rewards.tolist() == [1.0, 1.0]


def test_bad_terms_fail_in_the_constructor(rewards_file: Path) -> None:
    others = _worker_pids()
    cfg = RewardConfig(terms=_terms((f"{rewards_file}:missing", 1.0)))
    with pytest.raises(ValueError, match="defines no 'missing'"):
        RewardScorer(cfg, get_task("addition"))
    assert _worker_pids() == others


@pytest.mark.parametrize("on_error", ["zero", "fail"])
def test_a_weighted_sum_that_overflows_is_a_failed_reward_not_an_inf(
    rewards_file: Path, on_error: str
) -> None:
    # 1e30 is finite, but weighted by 1e10 the float32 reward would be inf.
    terms = _terms((f"{rewards_file}:huge", 1e10), ("task", 1.0))
    cfg = RewardConfig(terms=terms, on_error=on_error, num_processes=1)
    examples = [{"prompt": "1+1", "answer": "02"}] * 2
    with RewardScorer(cfg, get_task("addition")) as scorer:
        if on_error == "fail":
            with pytest.raises(RuntimeError, match=r"reward of sample 0 is inf \(huge=1e\+30"):
                scorer.score(["1+1"] * 2, ["02", "03"], examples)
            return
        rewards, metrics = scorer.score(["1+1"] * 2, ["02", "03"], examples)
    assert rewards.tolist() == [0.0, 0.0]
    assert metrics["reward/errors"] == 2


def test_workers_get_a_clean_environment_a_memory_limit_and_their_own_output(
    rewards_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture,
) -> None:
    monkeypatch.setenv("TANDEM_TEST_SECRET", "s3cret")  # a credential in the driver's env
    terms = _terms((f"{rewards_file}:secret", 1.0), (f"{rewards_file}:hog", 0.0))
    terms += _terms((f"{rewards_file}:noisy", 0.0))
    log = tmp_path / "logs" / "reward-workers.log"
    cfg = RewardConfig(terms=terms, memory_mb=512, num_processes=1)
    with RewardScorer(cfg, get_task("addition"), log_file=str(log)) as scorer:
        rewards, metrics = scorer.score(["1+1"] * 2, ["02"] * 2, [{"mb": 1}, {"mb": 1024}])
    assert rewards.tolist() == [0.0, 0.0]  # the secret did not reach the workers
    assert metrics["reward/hog_accuracy"] == 0.5  # 1 MiB fit, 1 GiB was refused ...
    assert metrics["reward/errors"] == 1  # ... as an error of that sample, not an OOM kill
    assert "NOISE" not in capfd.readouterr().out  # stdout stays the driver's (JSON lines)
    assert "NOISE from a reward function" in log.read_text()
    listed = cfg.model_copy(update={"inherit_env": ["TANDEM_TEST_SECRET"]})
    with RewardScorer(listed, get_task("addition"), log_file=str(log)) as scorer:
        assert scorer.score(["1+1"], ["02"], [{"mb": 1}])[0].tolist() == [1.0]
