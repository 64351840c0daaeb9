"""Judges for real: a local judge on the vLLM engine writes what transformers' greedy decoding
of the same input writes; a remote judge against a local chat-completions server retries with
back-off, times out, bounds its concurrency and never shows its API key; inside RewardScorer
its verdicts become weighted, cached, counted rewards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl.config import RewardConfig, RewardTermConfig
from rl.config.tree import JudgeConfig
from rl.data.prompts import encode_prompts
from rl.data.tasks import get_task
from rl.rewards import RewardScorer
from rl.rewards.judge_local import LocalJudge
from rl.rewards.judge_remote import RemoteJudge
from tests.helpers.chat_server import ChatServer

pytestmark = pytest.mark.integration

KEY = "sk-tandem-test-0123456789"
KEY_ENV = "TANDEM_TEST_JUDGE_KEY"
KEY_NAME = "reward.terms[1].judge"


class RecordedSleep:
    """An injected sleep: records each wait, waits for none."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)


def _hf_greedy(model_dir: Path, texts: list[str], max_new_tokens: int) -> list[str]:
    """Transformers' greedy continuation of each text's user turn, decoded as the engines do."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for ids in encode_prompts(tokenizer, texts):
        with torch.no_grad():
            generated = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.eos_token_id,
            )
        out.append(tokenizer.decode(generated[0, len(ids) :], skip_special_tokens=True))
    return out


def test_local_judge_on_vllm_writes_transformers_greedy_verdicts(tiny_model_dir: Path) -> None:
    judge = JudgeConfig(
        model=str(tiny_model_dir), template="{prompt}={response}", max_new_tokens=5,
        max_model_len=64, max_concurrency=2,
    )  # fmt: skip
    texts = ["12+34=46", "7+8=15", "100+200=300", "5+5=11", "1+1=2"]
    local = LocalJudge(str(tiny_model_dir), judge, seed=0)
    try:
        replies = local.judge_texts([*texts, "9" * 80])  # the last does not fit 64 tokens
    finally:
        local.close()
    assert [text for text, _ in replies[:-1]] == _hf_greedy(tiny_model_dir, texts, 5)
    assert all(error == "" for _, error in replies[:-1])
    text, error = replies[-1]
    assert text is None and "judge.max_model_len=64 leaves 59 after max_new_tokens" in error


def test_a_sampled_verdict_depends_on_its_input_not_on_its_batch(tiny_model_dir: Path) -> None:
    judge = JudgeConfig(
        model=str(tiny_model_dir), template="{response}", engine="torch", temperature=1.0,
        max_new_tokens=6, max_model_len=64,
    )  # fmt: skip
    texts = ["12+34=46", "7+8=15", "100+200=300"]
    local = LocalJudge(str(tiny_model_dir), judge, seed=0)
    try:
        together = local.judge_texts(texts)
        alone = [local.judge_texts([text])[0] for text in reversed(texts)][::-1]
        repeated = local.judge_texts([texts[1]] * 4)
    finally:
        local.close()
    assert together == alone
    assert repeated == [together[1]] * 4
    assert len({text for text, _ in together}) == 3  # sampled: the inputs' verdicts differ


def _remote(url: str, **fields: object) -> JudgeConfig:
    return JudgeConfig(
        **{"url": url, "model": "judge-1", "api_key_env": KEY_ENV, "template": "{response}",
           "timeout_s": 5.0, **fields}
    )  # fmt: skip


def test_remote_judge_retries_with_backoff_then_gives_up_without_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    sleep = RecordedSleep()
    with ChatServer(lambda content: f"verdict on {content}", KEY) as server:
        client = RemoteJudge(_remote(server.url, backoff_s=1.0), KEY_NAME, sleep=sleep)
        try:
            server.fail_next(503, 429, 502)
            replies, retried, deaths = client.submit(["x"])()
            assert replies == [("verdict on x", "")] and (retried, deaths) == (3, 0)
            # 1 s, then the server's Retry-After (0.01 s), then 1 s doubled twice: 4 s.
            assert sleep.waits == [1.0, 0.01, 4.0]
            body = server.seen.bodies[-1]
            assert body["model"] == "judge-1" and body["messages"][0]["content"] == "x"
            assert body["max_tokens"] == 16 and body["temperature"] == 0.0
            assert set(server.seen.authorizations) == {f"Bearer {KEY}"}

            server.fail_next(503, 503, 503, 503)  # one more than max_retries
            (reply,), retried, _ = client.submit(["y"])()
            assert reply[0] is None and retried == 3
            assert reply[1].startswith(f"judge at {server.url}: HTTP 503: 'failed for Bearer ***'")
            assert reply[1].endswith("(after 4 tries)") and KEY not in reply[1]
        finally:
            client.close()


def test_remote_judge_does_not_retry_what_a_retry_cannot_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-wrong")
    sleep = RecordedSleep()
    with ChatServer(lambda content: "7", KEY) as server:
        client = RemoteJudge(_remote(server.url), KEY_NAME, sleep=sleep)
        try:
            (reply,), retried, _ = client.submit(["x"])()
        finally:
            client.close()
    assert reply == (None, f"judge at {server.url}: HTTP 401: 'bad key'")
    assert retried == 0 and sleep.waits == []


def test_remote_judge_times_out_and_bounds_its_concurrency(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    with ChatServer(lambda content: content, KEY, delay_s=0.05) as server:
        hurried = RemoteJudge(
            _remote(server.url, timeout_s=0.3, max_retries=0), KEY_NAME, sleep=RecordedSleep()
        )
        bounded = RemoteJudge(_remote(server.url, max_concurrency=3), KEY_NAME)
        try:
            server.fail_next("hang")
            (reply,), _, _ = hurried.submit(["x"])()
            assert reply == (
                None,
                f"judge at {server.url}: no answer within {KEY_NAME}.timeout_s=0.3 s (after 1 try)",
            )
            texts = [str(i) for i in range(12)]
            replies, _, _ = bounded.submit(texts)()
            assert [text for text, _ in replies] == texts
            assert server.seen.max_in_flight == 3
        finally:
            hurried.close()
            bounded.close()


def test_reward_scorer_sums_a_remote_judges_parsed_and_cached_verdicts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)

    def judge(content: str) -> str:  # "<response> for <answer>": 9 when right, else no score
        response, _, answer = content.partition(" for ")
        return "Score: 9" if response.strip() == answer else "cannot tell"

    prompts = ["12+34", "12+34", "7+8", "7+8"]
    examples = [
        {"prompt": p, "answer": a} for p, a in zip(prompts, ["46", "46", "15", "15"], strict=True)
    ]
    responses = ["46", "47", "15", "15"]
    with ChatServer(judge, KEY) as server:
        remote = _remote(server.url, template="{response} for {answer}", score_range=(0, 9))
        terms = [
            RewardTermConfig(name="task"),
            RewardTermConfig(name="judge", weight=0.5, judge=remote),
        ]
        cfg = RewardConfig(terms=terms, num_processes=1)
        with RewardScorer(cfg, get_task("addition")) as scorer:
            rewards, metrics = scorer.score(prompts, responses, examples)
            assert len(server.seen.bodies) == 3  # "15 for 15" twice: judged once
            again, cached = scorer.score(prompts, responses, examples)
            # Only the verdict that did not parse is asked for again; the rest are cached.
            assert [b["messages"][0]["content"] for b in server.seen.bodies[3:]] == ["47 for 46"]
    # task: 1, 0, 1, 1; judge: 1, 0 (its verdict has no score), 1, 1.
    assert rewards.tolist() == [1.5, 0.0, 1.5, 1.5] and again.tolist() == rewards.tolist()
    assert metrics["reward/judge_mean"] == 0.75 and metrics["reward/task_mean"] == 0.75
    assert metrics["reward/judge_parse_errors"] == 1 and metrics["reward/errors"] == 1
    assert metrics["reward/judge_cache_hit_rate"] == 0.25
    assert metrics["reward/judge_request_errors"] == metrics["reward/judge_retried_errors"] == 0
    assert "reward/model_actor_errors" not in metrics  # no actor to lose
    assert cached["reward/judge_cache_hit_rate"] == 0.75
