"""A `judge` reward term: a generative judge's verdicts, parsed into scores in [0, 1].

`JudgeTerm` turns a batch of samples into judge inputs (the template filled for each sample,
pair or group, by `judge.mode`), takes what it can from its cache, sends the rest to its
judge at once (a local engine's actor, rl.rewards.judge_worker, or an endpoint,
rl.rewards.judge_remote), and parses the verdicts (rl.rewards.judge_parsers).

Groups: pairwise and listwise judging compare the responses of one group, a run of
consecutive samples with the same prompt (how the scheduler hands a GRPO group to the
scorer). Pairwise, each pair (i, j), i before j, is judged once with i as response A and j as
B; the parsed score s is A's share of the comparison and 1 - s is B's, and a response scores
the mean of its shares over its pairs (a lone response 0.5). Listwise, the judge sees the
group's responses numbered from 1 in order and its verdict scores them all.

A failed judgement (a verdict that does not parse, a request that failed, an input too long
for a local judge) scores 0: its sample pointwise, both shares of its pair, its whole group
listwise. It is counted, and with reward.on_error=fail raises instead.
"""

from __future__ import annotations

import logging
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from rl.config.tree import JudgeConfig
from rl.rewards.judge_parsers import VERDICT_PARSERS, VerdictError, check_parser
from rl.rewards.judge_template import Template, load_template

logger = logging.getLogger(__name__)

RAW_QUOTE_CHARS = 500  # of a judge's text, quoted in a parse error
Reply = tuple[str | None, str]  # (the judge's text, or None and why it failed)


class JudgeBackend(Protocol):
    """What a judge term sends its inputs to."""

    def submit(self, texts: list[str]) -> Callable[[], tuple[list[Reply], int, int]]:
        """Start judging `texts`; returns a call that waits for (one Reply per text, failures
        retried, actor deaths survived)."""
        ...

    def close(self) -> None: ...


@dataclass
class JudgeOutcome:
    """One batch's scores (one per sample) and what went wrong."""

    scores: list[float]
    failures: list[str] = field(default_factory=list)  # one message per failed judgement
    parse_errors: int = 0
    request_errors: int = 0
    retried_errors: int = 0
    actor_deaths: int = 0
    cache_hits: int = 0
    judgements: int = 0
    unparsed: set[str] = field(default_factory=set)  # inputs whose verdict did not parse


@dataclass
class _Judgement:
    text: str  # the rendered input
    owners: list[int]  # the samples it scores, in the order its parsed scores come


def judge_key(index: int) -> str:
    """The config key of term `index`'s judge, as errors name it."""
    return f"reward.terms[{index}].judge"


def check_judge(index: int, judge: JudgeConfig, will_exist: Collection[str] = ()) -> Template:
    """Validate term `index`'s judge without starting it; returns its parsed template.
    ValueError naming the key: template, parser, a local model directory (unless its absolute
    path is in `will_exist`: a base the run builds first) and engine, or the endpoint, its
    model name and the API key's environment variable."""
    key = judge_key(index)
    template = load_template(judge.template, judge.template_file, judge.mode, key)
    check_parser(judge, key)
    if judge.url:
        if not re.match(r"https?://[^/]", judge.url):
            raise ValueError(f"{key}.url={judge.url!r}: not an http:// or https:// URL")
        if not judge.model:
            raise ValueError(f"{key}.model: name the model the endpoint at {judge.url} serves")
        if judge.api_key_env and not os.environ.get(judge.api_key_env):
            raise ValueError(
                f"{key}.api_key_env={judge.api_key_env!r}: that environment variable is not set "
                "(or empty); export the API key in it"
            )
        return template
    if judge.api_key_env:
        raise ValueError(f"{key}.api_key_env: a local judge (no url) takes no API key")
    from rollout.engines.registry import ENGINES

    if judge.engine not in ENGINES:
        raise ValueError(
            f"{key}.engine={judge.engine!r} is not one of {', '.join(ENGINES.names())}"
        )
    if not judge.model:
        raise ValueError(f"{key}: set model (a local HF directory) or url (an endpoint)")
    path = os.path.abspath(judge.model)
    if path not in will_exist and not (Path(path) / "config.json").is_file():
        raise ValueError(
            f"{key}.model={judge.model!r} is not an HF checkpoint directory (no config.json there)"
        )
    if judge.max_new_tokens >= judge.max_model_len:
        raise ValueError(
            f"{key}.max_new_tokens={judge.max_new_tokens} leaves no room for the input in "
            f"max_model_len={judge.max_model_len}"
        )
    return template


def group_runs(prompts: list[str]) -> list[list[int]]:
    """The groups of a batch: runs of consecutive samples with the same prompt."""
    groups: list[list[int]] = []
    for k, prompt in enumerate(prompts):
        if groups and prompts[groups[-1][0]] == prompt:
            groups[-1].append(k)
        else:
            groups.append([k])
    return groups


def render_responses(responses: list[str]) -> str:
    """A group's responses as a listwise template's {responses} shows them."""
    return "\n\n".join(f"Response {i}:\n{text}" for i, text in enumerate(responses, 1))


class JudgeTerm:
    """Term `index` of reward.terms (named `name`), judged by `backend`."""

    def __init__(
        self, index: int, name: str, judge: JudgeConfig, backend: JudgeBackend, on_error: str
    ) -> None:
        self.index, self.name, self.judge = index, name, judge
        key = judge_key(index)
        self.template = load_template(judge.template, judge.template_file, judge.mode, key)
        self.backend = backend
        self._fail = on_error == "fail"
        self._parse = VERDICT_PARSERS.get(judge.parser)
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._logged_failure = False

    def judgements(
        self, prompts: list[str], responses: list[str], examples: list[dict]
    ) -> list[_Judgement]:
        """The inputs a batch needs, by mode (see the module's docstring)."""
        judge, render = self.judge, self.template.render
        if judge.mode == "pointwise":
            return [
                _Judgement(
                    render({"prompt": p, "answer": str(e.get("answer", "")), "response": r}), [k]
                )
                for k, (p, r, e) in enumerate(zip(prompts, responses, examples, strict=True))
            ]
        made = []
        for group in group_runs(prompts):
            common = {
                "prompt": prompts[group[0]],
                "answer": str(examples[group[0]].get("answer", "")),
            }
            if judge.mode == "pairwise":
                for a_at, a in enumerate(group):
                    for b in group[a_at + 1 :]:
                        values = {**common, "response_a": responses[a], "response_b": responses[b]}
                        made.append(_Judgement(render(values), [a, b]))
            else:
                values = {
                    **common,
                    "responses": render_responses([responses[k] for k in group]),
                    "num_responses": str(len(group)),
                }
                made.append(_Judgement(render(values), list(group)))
        return made

    def start(
        self, prompts: list[str], responses: list[str], examples: list[dict]
    ) -> Callable[[], JudgeOutcome]:
        """Send what the cache lacks; returns a call that waits and scores the batch."""
        judgements = self.judgements(prompts, responses, examples)
        # Taken now: verdicts that this batch adds may evict them before it is scored.
        replies: dict[str, Reply] = {}
        for judgement in judgements:
            if judgement.text in self._cache:
                self._cache.move_to_end(judgement.text)
                replies[judgement.text] = (self._cache[judgement.text], "")
        missing = list(dict.fromkeys(j.text for j in judgements if j.text not in replies))
        wait = self.backend.submit(missing) if missing else None

        def finish() -> JudgeOutcome:
            outcome = JudgeOutcome([0.0] * len(responses), judgements=len(judgements))
            outcome.cache_hits = len(judgements) - len(missing)
            if wait is not None:
                answers, outcome.retried_errors, outcome.actor_deaths = wait()
                replies.update(zip(missing, answers, strict=True))
            self._score(judgements, replies, outcome)
            for text in missing:
                verdict = replies[text][0]
                if verdict is not None and text not in outcome.unparsed:
                    self._remember(text, verdict)
            return outcome

        return finish

    def _score(
        self, judgements: list[_Judgement], replies: dict[str, Reply], outcome: JudgeOutcome
    ) -> None:
        pairwise = self.judge.mode == "pairwise"
        shares = [[] for _ in outcome.scores]  # pairwise: each sample's shares
        for judgement in judgements:
            values = self._verdict(judgement, replies, outcome)
            if pairwise:
                a, b = judgement.owners
                share = values[0] if values is not None else None
                shares[a].append(0.0 if share is None else share)
                shares[b].append(0.0 if share is None else 1.0 - share)
            elif values is not None:
                for sample, value in zip(judgement.owners, values, strict=True):
                    outcome.scores[sample] = value
        if pairwise:
            outcome.scores = [sum(s) / len(s) if s else 0.5 for s in shares]

    def _verdict(
        self, judgement: _Judgement, replies: dict[str, Reply], outcome: JudgeOutcome
    ) -> list[float] | None:
        """The parsed scores of one judgement, or None (counted, or raised) when it failed."""
        text, error = replies[judgement.text]
        if text is None:
            outcome.request_errors += 1
            return self._failed(f"reward term {self.name!r}: the judge failed: {error}", outcome)
        try:
            values = self.parse(text, len(judgement.owners))
        except VerdictError as exc:
            outcome.parse_errors += 1
            outcome.unparsed.add(judgement.text)
            message = (
                f"reward term {self.name!r} ({self.template.source}): the judge's verdict does "
                f"not parse with parser {self.judge.parser!r}: {exc}; the judge wrote: "
                f"{text[:RAW_QUOTE_CHARS]!r}{' ...' if len(text) > RAW_QUOTE_CHARS else ''}"
            )
            return self._failed(message, outcome)
        return values

    def parse(self, text: str, num_responses: int) -> list[float]:
        """The scores a judge's `text` gives (VerdictError when it does not parse)."""
        marker = self.judge.verdict_marker
        if marker:
            at = text.rfind(marker)
            if at < 0:
                raise VerdictError(f"no verdict_marker {marker!r} in it")
            text = text[at + len(marker) :]
        if VERDICT_PARSERS.traits(self.judge.parser).listwise:
            return self._parse(text, self.judge, num_responses)
        return self._parse(text, self.judge)

    def _failed(self, message: str, outcome: JudgeOutcome) -> None:
        if self._fail:
            raise RuntimeError(message)
        if not self._logged_failure:  # once a run: the metrics count the rest
            self._logged_failure = True
            logger.warning(
                "%s (scored 0, reward.on_error=zero; later failures of this judge are counted "
                "in the reward/<term>_parse_errors and _request_errors metrics, not logged)",
                message,
            )
        outcome.failures.append(message)
        return None

    def _remember(self, text: str, verdict: str) -> None:
        """Keep a new verdict that parsed; the least recently used goes past cache_size."""
        if self.judge.cache_size == 0:
            return
        self._cache[text] = verdict
        self._cache.move_to_end(text)
        while len(self._cache) > self.judge.cache_size:
            self._cache.popitem(last=False)

    def metrics(self, label: str, outcome: JudgeOutcome) -> dict[str, float]:
        """reward/<label>_* of one batch (docs/metrics.md)."""
        hit_rate = outcome.cache_hits / outcome.judgements if outcome.judgements else 0.0
        return {
            f"reward/{label}_parse_errors": float(outcome.parse_errors),
            f"reward/{label}_request_errors": float(outcome.request_errors),
            f"reward/{label}_retried_errors": float(outcome.retried_errors),
            f"reward/{label}_cache_hit_rate": hit_rate,
        }

    def close(self) -> None:
        self.backend.close()
