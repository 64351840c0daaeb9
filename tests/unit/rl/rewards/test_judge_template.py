"""Judge templates: plain {name} fields filled verbatim; attribute and index access,
conversions, format specs, unknown and missing fields refused naming the template."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl.rewards.judge_template import load_template, parse_template


def test_fields_are_filled_verbatim_and_doubled_braces_are_literal() -> None:
    template = parse_template(
        "Q {prompt} ({answer})\nA {response} {{not a field}}", "t", "pointwise"
    )
    assert template.fields == {"prompt", "answer", "response"}
    # A value holding braces or a field name is inserted as it is, never formatted again.
    rendered = template.render({"prompt": "1+1", "answer": "2", "response": "{answer.__class__}"})
    assert rendered == "Q 1+1 (2)\nA {answer.__class__} {not a field}"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("{response.__class__}", "is not a plain name"),
        ("{response[0]}", "is not a plain name"),
        ("{0}{response}", "is not a plain name"),
        ("{response!r}", "conversions and format specs are not allowed"),
        ("{response:>10}", "conversions and format specs are not allowed"),
        ("{response:{prompt.x}}", "conversions and format specs are not allowed"),
        ("{response} {secret}", r"unknown field \{secret\}; the pointwise fields are "
         r"\{prompt\}, \{answer\}, \{response\}"),
        ("{response} }", "Single '}' encountered"),
        ("{response} {", "Single '{' encountered"),
        ("{prompt} only", r"must show the judge \{response\}"),
    ],
)  # fmt: skip
def test_bad_templates_are_refused_naming_their_source(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=rf"^judge-src: .*{reason}"):
        parse_template(text, "judge-src", "pointwise")


def test_each_mode_takes_its_own_response_fields() -> None:
    pair = parse_template("{prompt} A={response_a} B={response_b}", "t", "pairwise")
    assert pair.render({"prompt": "p", "response_a": "x", "response_b": "y"}) == "p A=x B=y"
    with pytest.raises(ValueError, match=r"unknown field \{response\}; the pairwise fields"):
        parse_template("{response} {response_a} {response_b}", "t", "pairwise")
    with pytest.raises(ValueError, match=r"a listwise template must show the judge \{responses\}"):
        parse_template("{prompt} {num_responses}", "t", "listwise")


def test_template_comes_from_exactly_one_of_inline_and_file(tmp_path: Path) -> None:
    key = "reward.terms[1].judge"
    with pytest.raises(ValueError, match=r"reward.terms\[1\].judge: set exactly one"):
        load_template("", "", "pointwise", key)
    with pytest.raises(ValueError, match=r"reward.terms\[1\].judge: set exactly one"):
        load_template("{response}", "x.txt", "pointwise", key)
    missing = tmp_path / "missing.txt"
    with pytest.raises(ValueError, match=r"reward.terms\[1\].judge.template_file=.*: no such file"):
        load_template("", str(missing), "pointwise", key)
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("Rate {response} for {prompt}: {bad.attr}")
    with pytest.raises(ValueError, match=r"template_file=.*rubric.txt'.*\{bad.attr\} is not a"):
        load_template("", str(rubric), "pointwise", key)
    rubric.write_text("Rate {response} for {prompt}")
    template = load_template("", str(rubric), "pointwise", key)
    assert template.render({"response": "r", "prompt": "p"}) == "Rate r for p"
    assert "rubric.txt" in template.source
