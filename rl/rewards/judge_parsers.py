"""Verdict parsers: a judge's text -> scores in [0, 1], registered with their traits.

A pointwise parser reads one score from a verdict (pointwise and pairwise judging); a listwise
one reads a score for each of a group's `n` responses. A verdict that does not parse raises
`VerdictError` with the reason; the judge term adds the template and the judge's raw text.

- `score`: the first number in the verdict, which must lie in `score_range` [low, high];
  it scores (x - low) / (high - low).
- `choice`: the label of `choices` that occurs first in the verdict as a whole word (case
  ignored; of labels starting at the same place, the longest); it scores the label's value.
- `scores` (listwise): the first n numbers, the i-th the score of response i, each in
  `score_range` and scored as `score` does.
- `ranking` (listwise): the first n integers, a permutation of 1..n listing the responses
  from best to worst; the response ranked r-th (from 0) scores (n - 1 - r) / (n - 1), so the
  best 1 and the worst 0 (a lone response 1).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from rl.config.registry import Registry
from rl.config.tree import JudgeConfig

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_INTEGER = re.compile(r"(?<![\d.])\d+(?![\d.])")


class VerdictError(ValueError):
    """A verdict that does not parse: what was expected and not found."""


@dataclass(frozen=True)
class ParserTraits:
    listwise: bool = False  # scores a group's n responses from one verdict
    uses_range: bool = False  # reads judge.score_range
    uses_choices: bool = False  # reads judge.choices


# Pointwise: (verdict, judge) -> [score]; listwise: (verdict, judge, n) -> n scores.
VerdictParser = Callable[..., list[float]]
VERDICT_PARSERS: Registry[VerdictParser, ParserTraits] = Registry("verdict parser", ParserTraits)


def _in_range(value: float, judge: JudgeConfig) -> float:
    low, high = judge.score_range
    if not low <= value <= high:
        raise VerdictError(f"{value:g} is outside score_range [{low:g}, {high:g}]")
    return (value - low) / (high - low)


@VERDICT_PARSERS.register("score", uses_range=True)
def parse_score(verdict: str, judge: JudgeConfig) -> list[float]:
    match = _NUMBER.search(verdict)
    if match is None:
        raise VerdictError("no number in the verdict")
    return [_in_range(float(match.group()), judge)]


@VERDICT_PARSERS.register("choice", uses_choices=True)
def parse_choice(verdict: str, judge: JudgeConfig) -> list[float]:
    found: tuple[int, int, str] | None = None  # (start, -length, label): earliest, then longest
    lowered = verdict.lower()
    for label in judge.choices:
        match = re.search(rf"(?<!\w){re.escape(label.lower())}(?!\w)", lowered)
        if match is not None:
            candidate = (match.start(), -len(label), label)
            found = candidate if found is None else min(found, candidate)
    if found is None:
        raise VerdictError(f"none of the choices {', '.join(map(repr, judge.choices))} in it")
    return [judge.choices[found[2]]]


@VERDICT_PARSERS.register("scores", listwise=True, uses_range=True)
def parse_scores(verdict: str, judge: JudgeConfig, n: int) -> list[float]:
    numbers = [float(m.group()) for m in _NUMBER.finditer(verdict)][:n]
    if len(numbers) < n:
        raise VerdictError(f"{len(numbers)} numbers for {n} responses")
    return [_in_range(value, judge) for value in numbers]


@VERDICT_PARSERS.register("ranking", listwise=True)
def parse_ranking(verdict: str, judge: JudgeConfig, n: int) -> list[float]:
    ranks = [int(m.group()) for m in _INTEGER.finditer(verdict)][:n]
    if sorted(ranks) != list(range(1, n + 1)):
        raise VerdictError(
            f"its first {n} integers {ranks} are not a ranking of responses 1 to {n}"
        )
    if n == 1:
        return [1.0]
    scores = [0.0] * n
    for place, response in enumerate(ranks):
        scores[response - 1] = (n - 1 - place) / (n - 1)
    return scores


def check_parser(judge: JudgeConfig, key: str) -> None:
    """ValueError naming `key` (the judge's config key) when its parser does not fit its mode
    or lacks what it reads."""
    if judge.parser not in VERDICT_PARSERS:
        raise ValueError(
            f"{key}.parser={judge.parser!r} is not one of {', '.join(VERDICT_PARSERS.names())}"
        )
    traits = VERDICT_PARSERS.traits(judge.parser)
    if traits.listwise != (judge.mode == "listwise"):
        valid = VERDICT_PARSERS.names(lambda t: t.listwise == (judge.mode == "listwise"))
        raise ValueError(
            f"{key}.parser={judge.parser!r} does not fit mode {judge.mode!r}; use one of "
            f"{', '.join(valid)}"
        )
    low, high = judge.score_range
    if traits.uses_range and not low < high:
        raise ValueError(f"{key}.score_range=[{low:g}, {high:g}]: low must be below high")
    if traits.uses_choices:
        if not judge.choices:
            raise ValueError(f"{key}.choices is empty: the choice parser needs label: score pairs")
        for label, value in judge.choices.items():
            if not label.strip():
                raise ValueError(f"{key}.choices: a label is empty")
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{key}.choices[{label!r}]={value:g}: a score is in [0, 1]")
