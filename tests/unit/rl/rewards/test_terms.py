"""Verifiers on hand-written cases; term names, users' files and their error messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl.config import RewardConfig, RewardTermConfig
from rl.data.tasks import get_task
from rl.rewards import VERIFIERS, RewardScorer, check_reward_terms
from rl.rewards.terms import FunctionTerm, load_user_function, parse_term, term_label


def _cfg(*names: str, **fields: object) -> RewardConfig:
    return RewardConfig(terms=[RewardTermConfig(name=n) for n in names], **fields)


def test_registry_names() -> None:
    assert VERIFIERS.names() == ["arithmetic", "countdown", "math"]


@pytest.mark.parametrize(
    ("response", "expected"),
    [("2+3*4", 1.0), ("(2+3)*4 - 6 = 14", 0.0), ("2+3*4 = 14", 1.0), ("4*4-2", 0.0),
     ("2*3+4", 0.0), ("14", 0.0), ("import os", 0.0), ("", 0.0)],
)  # fmt: skip
def test_countdown(response: str, expected: float) -> None:
    example = {"prompt": "2 3 4 -> 14", "answer": "2+3*4", "numbers": [2, 3, 4], "target": 14}
    assert VERIFIERS.get("countdown")(response, example) == expected


@pytest.mark.parametrize(
    ("response", "expected"), [("0579", 1.0), (" 0579\n", 1.0), ("579", 0.0), ("0578", 0.0)]
)
def test_arithmetic(response: str, expected: float) -> None:
    assert (
        VERIFIERS.get("arithmetic")(response, {"prompt": "123+456", "answer": "0579"}) == expected
    )


@pytest.mark.parametrize(
    ("gold", "response", "expected"),
    [
        ("0.5", "So the answer is $\\boxed{1/2}$.", 1.0),
        ("0.5", "\\boxed{\\frac{1}{2}}", 1.0),
        ("\\frac{1}{2}", "The answer is 0.5", 1.0),
        ("x^2+1", "$\\boxed{1+x^2}$", 1.0),
        ("\\sqrt{2}", "\\boxed{\\sqrt 2}", 1.0),
        ("0.5", "\\boxed{1/3}", 0.0),
        ("42", "I think it is 41.", 0.0),
        ("42", "no idea", 0.0),
    ],
)
def test_math(gold: str, response: str, expected: float) -> None:
    assert VERIFIERS.get("math")(response, {"answer": gold}) == expected


def test_math_unreadable_gold_raises() -> None:
    with pytest.raises(ValueError, match="could not parse the gold answer"):
        VERIFIERS.get("math")("1", {"answer": ""})


def test_parse_and_label() -> None:
    assert parse_term("task") == ("task", "")
    assert parse_term("math") == ("verifier", "math")
    assert parse_term("dir/my-reward.py:score_fn") == ("file", "dir/my-reward.py:score_fn")
    assert parse_term("model:/ckpt/rm") == ("model", "/ckpt/rm")
    assert term_label("dir/my-reward.py:score_fn") == "score_fn"
    assert term_label("model:/ckpt/rm-v1.2/") == "model_rm_v1_2"
    assert term_label("countdown") == "countdown"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("nope", r"reward term 'nope': unknown verifier 'nope'; valid: 'task', a verifier "
                 r"\(arithmetic, countdown, math\)"),
        ("reward.py", "name the object too"),
        ("reward.py:not-a-name", "is not a Python name"),
        ("model:", "no checkpoint path"),
    ],
)  # fmt: skip
def test_bad_names(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_reward_terms(_cfg(name))


def test_user_function_relative_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "my_reward.py").write_text(
        "def length(response, example):\n    return len(response) / example['scale']\n"
    )
    monkeypatch.chdir(tmp_path)
    check_reward_terms(_cfg("sub/my_reward.py:length", "task"))
    fn = load_user_function("t", "sub/my_reward.py", "length")
    assert fn("abcd", {"scale": 2}) == 2.0
    # Loaded by absolute path, so a worker process with another working directory finds it.
    term = FunctionTerm.from_name("sub/my_reward.py:length", get_task("addition"))
    assert Path(term.path).is_absolute()
    assert term.load()("abc", {"scale": 1}) == 3.0


def test_user_function_errors_found_by_reading_the_file(tmp_path: Path) -> None:
    good = tmp_path / "reward.py"
    good.write_text("THRESHOLD = 3\n\ndef fn(response, example):\n    return 1.0\n")
    syntax = tmp_path / "syntax.py"
    syntax.write_text("def fn(response, example)\n    return 1.0\n")
    cases = [
        (f"{tmp_path}/missing.py:fn", r"file '.*missing\.py' not found"),
        (f"{good}:other", r"reward\.py' defines no 'other'"),
        (f"{syntax}:fn", r"syntax\.py' does not parse"),
    ]
    for name, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            check_reward_terms(_cfg("task", name))
        assert f"reward term {name!r}" in str(info.value)
    check_reward_terms(_cfg(f"{good}:fn"))


# Each would take the driver down if the driver imported it: the check only reads it.
HOSTILE = {
    "exits": "import os\nos._exit(3)\ndef fn(response, example):\n    return 1.0\n",
    "spins": "while True:\n    pass\ndef fn(response, example):\n    return 1.0\n",
    "marks": "open(__file__ + '.ran', 'w').close()\ndef fn(response, example):\n    return 1.0\n",
}


def test_checking_reward_terms_never_runs_the_users_code(tmp_path: Path) -> None:
    for name, code in HOSTILE.items():
        path = tmp_path / f"{name}.py"
        path.write_text(code)
        check_reward_terms(_cfg(f"{path}:fn"))  # returns: nothing was imported
    assert not (tmp_path / "marks.py.ran").exists()


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ("import not_a_module_anywhere\ndef fn(r, e):\n    return 1.0\n", "ModuleNotFoundError"),
        ("fn = 3\n", r"'fn' in '.*bad\.py' is not callable \(it is a int\)"),
        (
            "import os\nos._exit(3)\ndef fn(r, e):\n    return 1.0\n",
            r"exited \(exit code 3\) while starting",
        ),
    ],
)
def test_a_file_that_fails_to_load_fails_in_its_worker_naming_the_cause(
    tmp_path: Path, code: str, message: str
) -> None:
    path = tmp_path / "bad.py"
    path.write_text(code)
    with pytest.raises(RuntimeError, match=message):
        RewardScorer(_cfg(f"{path}:fn", num_processes=1), get_task("addition"))


def test_model_and_field_checks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not an HF checkpoint directory"):
        check_reward_terms(_cfg(f"model:{tmp_path}"))
    (tmp_path / "config.json").write_text("{}")
    check_reward_terms(_cfg(f"model:{tmp_path}"))  # nothing is loaded or started
    with pytest.raises(ValueError, match="reward.terms is empty"):
        check_reward_terms(RewardConfig(terms=[]))
    with pytest.raises(ValueError, match="reward.num_processes must be >= 1"):
        check_reward_terms(_cfg("task", num_processes=0))
    with pytest.raises(ValueError, match="reward.timeout_s must be > 0"):
        check_reward_terms(_cfg("task", timeout_s=0))
