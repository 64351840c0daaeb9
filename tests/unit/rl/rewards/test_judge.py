"""A judge term over a scripted judge: the inputs each mode sends, the scores it makes of the
verdicts (worked by hand), the cache, and failed judgements counted or raised."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from rl.config.tree import JudgeConfig
from rl.rewards.judge import JudgeTerm, group_runs

ANSWER = {"answer": "42"}


class ScriptedJudge:
    """A backend whose verdict on each input is `verdict(input)`; records what it was sent."""

    def __init__(self, verdict: Callable[[str], str | None]) -> None:
        self.verdict = verdict
        self.sent: list[list[str]] = []

    def submit(self, texts: list[str]) -> Callable[[], tuple[list, int, int]]:
        self.sent.append(list(texts))
        replies = []
        for text in texts:
            answer = self.verdict(text)
            replies.append((answer, "") if answer is not None else (None, "HTTP 503: busy"))
        return lambda: (replies, 2, 0)

    def close(self) -> None:
        pass


def _term(verdict: Callable[[str], str | None], on_error: str = "zero", **fields: object):
    judge = JudgeConfig(**{"model": "m", "template": "{prompt}|{response}|{answer}", **fields})
    backend = ScriptedJudge(verdict)
    return JudgeTerm(1, "judge", judge, backend, on_error), backend


def _judge(term: JudgeTerm, prompts: list[str], responses: list[str]):
    return term.start(prompts, responses, [ANSWER] * len(responses))()


def test_pointwise_scores_each_response_from_its_own_verdict() -> None:
    # The judge answers with the response's length, out of 0-10.
    term, backend = _term(lambda text: str(len(text.split("|")[1])))
    outcome = _judge(term, ["p", "p", "q"], ["abc", "a", "abcdefghij"])
    assert outcome.scores == [0.3, 0.1, 1.0]
    assert backend.sent == [["p|abc|42", "p|a|42", "q|abcdefghij|42"]]
    assert (outcome.parse_errors, outcome.request_errors, outcome.retried_errors) == (0, 0, 2)


def test_the_cache_serves_repeated_inputs_and_forgets_the_least_recently_used() -> None:
    term, backend = _term(lambda text: "5", cache_size=2)
    first = _judge(term, ["p", "p", "p"], ["x", "x", "y"])  # "x" twice: sent once
    assert backend.sent == [["p|x|42", "p|y|42"]]
    assert (first.cache_hits, first.judgements) == (1, 3)
    again = _judge(term, ["p", "p"], ["y", "x"])
    assert len(backend.sent) == 1 and again.scores == [0.5, 0.5] and again.cache_hits == 2
    # The cache holds y then x (x used last); a new input z evicts y, the least recent.
    _judge(term, ["p"], ["z"])
    _judge(term, ["p", "p"], ["x", "y"])
    assert backend.sent[1:] == [["p|z|42"], ["p|y|42"]]
    metrics = term.metrics("judge", again)
    assert metrics["reward/judge_cache_hit_rate"] == 1.0


def test_without_a_cache_every_batch_is_judged_again() -> None:
    term, backend = _term(lambda text: "5", cache_size=0)
    _judge(term, ["p"], ["x"])
    _judge(term, ["p"], ["x"])
    assert backend.sent == [["p|x|42"], ["p|x|42"]]


def test_pairwise_scores_each_response_by_its_mean_share_of_its_comparisons() -> None:
    # The judge prefers the longer response (A on a tie of lengths... never here).
    def longer(text: str) -> str:
        _, a, b = text.split("|")
        return "A" if len(a) > len(b) else "B"

    term, backend = _term(
        longer,
        mode="pairwise",
        parser="choice",
        choices={"A": 1.0, "B": 0.0},
        template="{prompt}|{response_a}|{response_b}",
    )
    # Group p: "aaa" beats both (1), "a" loses both (0), "aa" wins one of two (0.5);
    # group q is alone: 0.5.
    outcome = _judge(term, ["p", "p", "p", "q"], ["aaa", "a", "aa", "b"])
    assert outcome.scores == [1.0, 0.0, 0.5, 0.5]
    assert backend.sent == [["p|aaa|a", "p|aaa|aa", "p|a|aa"]]


def test_listwise_judges_each_group_once_with_its_numbered_responses() -> None:
    term, backend = _term(
        lambda text: "2 > 1" if "Response 2:\nlong" in text else "1",
        mode="listwise",
        parser="ranking",
        template="{prompt} ({num_responses}):\n{responses}",
    )
    outcome = _judge(term, ["p", "p", "q"], ["short", "long", "alone"])
    assert backend.sent == [
        ["p (2):\nResponse 1:\nshort\n\nResponse 2:\nlong", "q (1):\nResponse 1:\nalone"]
    ]
    assert outcome.scores == [0.0, 1.0, 1.0]


def test_groups_are_runs_of_one_prompt() -> None:
    assert group_runs(["a", "a", "b", "a", "a"]) == [[0, 1], [2], [3, 4]]
    assert group_runs([]) == []


def test_verdict_marker_takes_the_text_after_its_last_occurrence() -> None:
    term, _ = _term(
        lambda text: "1 of 3 steps, Score: 9. Score: 7 of 10" if "good" in text else "no marker",
        verdict_marker="Score:",
    )
    outcome = _judge(term, ["p", "p"], ["good", "bad"])
    assert outcome.scores == [0.7, 0.0]
    assert outcome.parse_errors == 1
    assert "no verdict_marker 'Score:' in it" in outcome.failures[0]


def test_a_verdict_that_does_not_parse_scores_zero_and_is_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    term, _ = _term(lambda text: "ten out of ten" if "bad" in text else "8")
    with caplog.at_level(logging.WARNING, logger="rl.rewards.judge"):
        outcome = _judge(term, ["p", "p", "p"], ["bad", "ok", "bad2"])
        _judge(term, ["p"], ["bad3"])
    assert outcome.scores == [0.0, 0.8, 0.0]
    assert outcome.parse_errors == 2 and len(outcome.failures) == 2
    message = outcome.failures[0]
    assert message == (
        "reward term 'judge' (reward.terms[1].judge.template (inline)): the judge's verdict "
        "does not parse with parser 'score': no number in the verdict; the judge wrote: "
        "'ten out of ten'"
    )
    assert len(caplog.records) == 1 and message in caplog.records[0].getMessage()
    metrics = term.metrics("judge", outcome)
    assert metrics["reward/judge_parse_errors"] == 2.0


def test_a_verdict_that_does_not_parse_fails_the_run_with_on_error_fail() -> None:
    term, _ = _term(lambda text: "x" * 600, on_error="fail")
    with pytest.raises(RuntimeError, match=r"the judge wrote: 'x{500}' \.\.\.$"):
        _judge(term, ["p"], ["r"])


def test_an_unparsed_verdict_is_not_cached_and_is_asked_again() -> None:
    verdicts = iter(["nonsense", "6"])
    term, backend = _term(lambda text: next(verdicts))
    assert _judge(term, ["p"], ["r"]).scores == [0.0]
    assert _judge(term, ["p"], ["r"]).scores == [0.6]
    assert len(backend.sent) == 2


def test_a_failed_request_scores_zero_and_counts_as_a_request_error() -> None:
    term, _ = _term(lambda text: None if "down" in text else "3")
    outcome = _judge(term, ["p", "p"], ["down", "up"])
    assert outcome.scores == [0.0, 0.3]
    assert (outcome.request_errors, outcome.parse_errors) == (1, 0)
    assert outcome.failures == ["reward term 'judge': the judge failed: HTTP 503: busy"]


def test_a_failed_pairwise_comparison_gives_both_sides_zero() -> None:
    term, _ = _term(
        lambda text: "?" if "b|c" in text else "A",
        mode="pairwise",
        parser="choice",
        choices={"A": 1.0, "B": 0.0},
        template="{prompt}|{response_a}|{response_b}",
    )
    # a beats b and c (1); b lost to a and failed against c (0); c lost to a, failed (0).
    assert _judge(term, ["p"] * 3, ["a", "b", "c"]).scores == [1.0, 0.0, 0.0]
