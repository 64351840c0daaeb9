"""Verdict parsers against hand-worked verdicts, and the parser checks of a judge's config."""

from __future__ import annotations

import pytest

from rl.config.tree import JudgeConfig
from rl.rewards.judge_parsers import VERDICT_PARSERS, VerdictError, check_parser

YES_NO = {"yes": 1.0, "no": 0.0}


def _judge(**fields: object) -> JudgeConfig:
    return JudgeConfig(**{"model": "m", "template": "{response}", **fields})


def test_registered_parsers_and_their_traits() -> None:
    assert VERDICT_PARSERS.names() == ["choice", "ranking", "score", "scores"]
    assert VERDICT_PARSERS.names(lambda t: t.listwise) == ["ranking", "scores"]
    assert VERDICT_PARSERS.names(lambda t: t.uses_range) == ["score", "scores"]
    assert VERDICT_PARSERS.names(lambda t: t.uses_choices) == ["choice"]


@pytest.mark.parametrize(
    ("verdict", "score_range", "expected"),
    [
        ("Score: 7/10", (0, 10), 0.7),  # the first number
        ("8.5", (0, 10), 0.85),
        ("  3 of 1-5", (1, 5), 0.5),  # (3 - 1) / (5 - 1)
        ("-2", (-5, 5), 0.3),  # (-2 + 5) / 10
        ("0579", (0, 9999), 579 / 9999),
        ("10", (0, 10), 1.0),
    ],
)
def test_score_reads_the_first_number_in_range(
    verdict: str, score_range: tuple[float, float], expected: float
) -> None:
    scores = VERDICT_PARSERS.get("score")(verdict, _judge(score_range=score_range))
    assert scores == [pytest.approx(expected)]


@pytest.mark.parametrize(
    ("verdict", "reason"), [("11", "11 is outside score_range"), ("none", "no number")]
)
def test_score_refuses_what_is_not_a_number_in_range(verdict: str, reason: str) -> None:
    with pytest.raises(VerdictError, match=reason):
        VERDICT_PARSERS.get("score")(verdict, _judge())


@pytest.mark.parametrize(
    ("verdict", "choices", "expected"),
    [
        ("Yes, it is right.", YES_NO, 1.0),
        ("I'd say NO.", YES_NO, 0.0),
        ("no, not yes", YES_NO, 0.0),  # the earliest label
        ("it is incorrect", {"correct": 1.0, "incorrect": 0.0}, 0.0),  # whole words only
        ("correct", {"correct": 1.0, "incorrect": 0.0}, 1.0),
        ("good enough", {"good": 0.75, "good enough": 0.5}, 0.5),  # same start: the longest
        ("B", {"A": 1.0, "B": 0.0, "tie": 0.5}, 0.0),
    ],
)
def test_choice_takes_the_earliest_whole_word_label(
    verdict: str, choices: dict[str, float], expected: float
) -> None:
    assert VERDICT_PARSERS.get("choice")(verdict, _judge(parser="choice", choices=choices)) == [
        expected
    ]


def test_choice_refuses_a_verdict_without_a_label() -> None:
    with pytest.raises(VerdictError, match="none of the choices 'yes', 'no'"):
        VERDICT_PARSERS.get("choice")("yesterday, maybe", _judge(parser="choice", choices=YES_NO))


def test_scores_reads_one_number_per_response_in_order() -> None:
    judge = _judge(mode="listwise", parser="scores", template="{responses}")
    parse = VERDICT_PARSERS.get("scores")
    assert parse("1: 7\n2: 3\n3: 10", judge, 3) == [0.1, 0.7, 0.2]  # the numbering counts too
    assert parse("7, 3, 10", judge, 3) == [0.7, 0.3, 1.0]
    with pytest.raises(VerdictError, match="2 numbers for 3 responses"):
        parse("7, 3", judge, 3)


def test_ranking_scores_best_one_worst_zero() -> None:
    judge = _judge(mode="listwise", parser="ranking", template="{responses}")
    parse = VERDICT_PARSERS.get("ranking")
    # Response 2 best, then 3, then 1.
    assert parse("2 > 3 > 1", judge, 3) == [0.0, 1.0, 0.5]
    assert parse("Ranking: 4, 1, 3, 2", judge, 4) == [2 / 3, 0.0, 1 / 3, 1.0]
    assert parse("1", judge, 1) == [1.0]
    with pytest.raises(VerdictError, match=r"\[1, 1, 2\] are not a ranking of responses 1 to 3"):
        parse("1, 1, 2", judge, 3)
    with pytest.raises(VerdictError, match="not a ranking"):
        parse("2.5 > 1 > 3", judge, 3)  # 2.5 is no response


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"parser": "vote"}, "parser='vote' is not one of choice, ranking, score, scores"),
        ({"parser": "ranking"}, "does not fit mode 'pointwise'; use one of choice, score"),
        ({"mode": "listwise", "template": "{responses}"}, "use one of ranking, scores"),
        ({"score_range": (5, 5)}, r"score_range=\[5, 5\]: low must be below high"),
        ({"parser": "choice"}, "choices is empty"),
        ({"parser": "choice", "choices": {"yes": 2.0}}, r"choices\['yes'\]=2: a score is in"),
    ],
)
def test_check_parser_names_the_key(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=rf"^reward.terms\[1\].judge.*{message}"):
        check_parser(_judge(**fields), "reward.terms[1].judge")
