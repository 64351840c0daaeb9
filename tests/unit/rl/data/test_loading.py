"""Splits on disk (deterministic, disjoint, atomic), the resumable prompt stream, prompts."""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rl.config import Config, DataConfig
from rl.data import loading as data
from rl.data.loading import (
    PromptStream,
    filter_long_prompts,
    load_examples,
    load_split,
    prepare_splits,
    prompt_lengths,
    prompt_token_limit,
    split_dir,
)
from rl.data.prompts import encode_prompt


def _cfg(tmp_path: Path, **overrides) -> DataConfig:
    return DataConfig(dir=str(tmp_path), num_train=300, num_test=50, **overrides)


def _prompts(path: Path) -> list[str]:
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines()]


@pytest.mark.parametrize("task", ["addition", "countdown"])
def test_splits_are_deterministic_disjoint_and_sized(tmp_path: Path, task: str) -> None:
    a = prepare_splits(_cfg(tmp_path / "a", task=task))
    b = prepare_splits(_cfg(tmp_path / "b", task=task))
    assert a["train"].read_text() == b["train"].read_text()
    assert a["test"].read_text() == b["test"].read_text()
    train, test = _prompts(a["train"]), _prompts(a["test"])
    assert (len(train), len(test)) == (300, 50)
    assert len(set(train)) == 300 and not set(train) & set(test)
    other_seed = prepare_splits(_cfg(tmp_path / "a", task=task, seed=5))
    assert other_seed["train"].parent != a["train"].parent
    assert other_seed["test"].read_text() != a["test"].read_text()


def test_split_dir_keys_only_relevant_params(tmp_path: Path) -> None:
    base = _cfg(tmp_path)
    assert split_dir(base) == split_dir(_cfg(tmp_path, num_operands=4))  # countdown-only field
    assert split_dir(base) != split_dir(_cfg(tmp_path, num_digits=2))
    assert split_dir(base) != split_dir(_cfg(tmp_path, zero_pad=False))
    countdown = _cfg(tmp_path, task="countdown")
    assert split_dir(countdown) == split_dir(_cfg(tmp_path, task="countdown", zero_pad=False))
    assert split_dir(base).name.startswith("addition-")


def test_existing_splits_are_reused_and_writes_leave_no_temp_files(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    paths = prepare_splits(cfg)
    paths["train"].write_text('{"prompt": "1+1", "answer": "2"}\n')
    assert prepare_splits(cfg) == paths
    assert paths["train"].read_text() == '{"prompt": "1+1", "answer": "2"}\n'
    assert sorted(p.name for p in split_dir(cfg).iterdir()) == ["test.jsonl", "train.jsonl"]


def test_failed_write_leaves_no_partial_file(tmp_path: Path, monkeypatch) -> None:
    real_dumps = json.dumps

    def boom(obj: object, **kwargs) -> str:
        if kwargs:  # the split-dir hash, not a row
            return real_dumps(obj, **kwargs)
        raise RuntimeError("disk full")

    monkeypatch.setattr(data.json, "dumps", boom)
    cfg = _cfg(tmp_path)
    with pytest.raises(RuntimeError, match="disk full"):
        prepare_splits(cfg)
    assert list(split_dir(cfg).iterdir()) == []


def test_too_few_distinct_prompts_is_a_clear_error(tmp_path: Path) -> None:
    # 1-digit addition has only 81 distinct prompts.
    with pytest.raises(ValueError, match="distinct prompts"):
        prepare_splits(_cfg(tmp_path, num_digits=1))


def test_load_split(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    test = load_split(cfg, "test")
    assert len(test) == 50 and set(test.column_names) == {"prompt", "answer"}
    assert test[0]["prompt"] == _prompts(prepare_splits(cfg)["test"])[0]
    with pytest.raises(ValueError, match="'valid'.*train, test"):
        load_split(cfg, "valid")


def test_load_split_rejects_bad_files(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    paths = prepare_splits(cfg)
    paths["train"].write_text("not json\n")
    with pytest.raises(ValueError, match="train split at .*train.jsonl"):
        load_split(cfg, "train")
    paths["test"].write_text('{"question": "1+1"}\n')
    with pytest.raises(ValueError, match=r"test split .* lacks columns \['answer', 'prompt'\]"):
        load_split(cfg, "test")


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_load_split_reads_user_files_instead_of_generating(tmp_path: Path, suffix: str) -> None:
    import datasets

    rows = {
        "train": [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)],
        "test": [{"prompt": "t", "answer": "1"}],
    }
    files = {}
    for split, split_rows in rows.items():
        files[split] = tmp_path / f"{split}{suffix}"
        if suffix == ".parquet":
            datasets.Dataset.from_list(split_rows).to_parquet(str(files[split]))
        else:
            files[split].write_text("".join(json.dumps(r) + "\n" for r in split_rows))
    cfg = DataConfig(
        task="math",
        dir=str(tmp_path / "generated"),
        train_files=[str(files["train"])],
        test_files=[str(files["test"])],
    )
    assert [r["prompt"] for r in load_split(cfg, "train")] == [f"q{i}" for i in range(5)]
    assert list(load_split(cfg, "test")) == rows["test"]
    assert not (tmp_path / "generated").exists()  # nothing generated


def test_data_file_errors_name_the_key_or_file(tmp_path: Path) -> None:
    existing = tmp_path / "train.jsonl"
    existing.write_text('{"prompt": "p", "answer": "a"}\n')
    with pytest.raises(ValueError, match="go together"):
        data.check_data_files(DataConfig(train_files=[str(existing)]))
    with pytest.raises(ValueError, match="data file not found: .*nope.jsonl"):
        data.check_data_files(
            DataConfig(train_files=[str(existing)], test_files=[str(tmp_path / "nope.jsonl")])
        )
    csv = tmp_path / "test.csv"
    csv.write_text("prompt,answer\n")
    with pytest.raises(ValueError, match="expected .jsonl, .json or .parquet"):
        data.check_data_files(DataConfig(train_files=[str(existing)], test_files=[str(csv)]))


def test_prompt_stream_epochs_cover_the_data_in_seeded_order() -> None:
    rows = [{"prompt": str(i)} for i in range(10)]
    stream = PromptStream(rows, seed=3)
    first, second = stream.next_batch(10), stream.next_batch(10)
    assert sorted(r["prompt"] for r in first) == sorted(r["prompt"] for r in rows)
    assert first != second and first != rows
    assert PromptStream(rows, seed=3).next_batch(20) == first + second
    assert PromptStream(rows, seed=4).next_batch(10) != first


def test_prompt_stream_resumes_exactly() -> None:
    rows = [{"prompt": str(i)} for i in range(7)]
    stream = PromptStream(rows, seed=0)
    stream.next_batch(5)
    stream.next_batch(5)  # crosses into epoch 1
    state = json.loads(json.dumps(stream.state_dict()))  # survives a checkpoint round trip
    expected = [stream.next_batch(3) for _ in range(4)]
    resumed = PromptStream(rows, seed=0)
    resumed.load_state_dict(state)
    assert [resumed.next_batch(3) for _ in range(4)] == expected
    with pytest.raises(ValueError, match="does not fit"):
        PromptStream(rows, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="non-empty"):
        PromptStream([], seed=0)


def test_prompt_stream_over_a_dataset(tmp_path: Path) -> None:
    dataset = load_split(_cfg(tmp_path), "test")
    batch = PromptStream(dataset, seed=0).next_batch(60)
    assert len(batch) == 60 and isinstance(batch[0], dict) and "answer" in batch[0]


def test_encode_prompt_uses_the_chat_template(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = encode_prompt(tok, "12+34")
    assert tok.decode(ids) == "<|user|>12+34<|assistant|>"
    templated = tok.apply_chat_template(
        [{"role": "user", "content": "12+34"}], tokenize=True, add_generation_prompt=True
    )
    assert ids == list(templated["input_ids"])


def test_encode_prompt_without_template_falls_back_to_raw_text(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = None
    with caplog.at_level(logging.WARNING, logger="rl.data.prompts"):
        ids = encode_prompt(tok, "12+34")
    assert ids == tok.encode("12+34") and tok.decode(ids) == "12+34"
    assert "no chat template" in caplog.text


GOOD = '{"prompt": "1+1", "answer": "2"}'


def _user_files(tmp_path: Path, train: list[str], test: list[str], **overrides) -> DataConfig:
    """A config reading jsonl files whose lines are `train` / `test` (one file each)."""
    files = {}
    for split, lines in (("train", train), ("test", test)):
        files[split] = tmp_path / f"{split}.jsonl"
        files[split].write_text("".join(line + "\n" for line in lines))
    return DataConfig(
        dir=str(tmp_path / "generated"),
        train_files=[str(files["train"])],
        test_files=[str(files["test"])],
        **overrides,
    )


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        ('{"answer": "2"}', "'prompt' is missing"),
        ('{"prompt": null, "answer": "2"}', "'prompt' is null"),
        ('{"prompt": "1+1"}', "'answer' is missing"),
        ('{"prompt": "1+1", "answer": null}', "'answer' is null"),
        ('{"prompt": "", "answer": "2"}', "'prompt' is empty"),
        ('{"prompt": " \\n\\t", "answer": "2"}', "'prompt' is empty"),
    ],
)
def test_bad_row_error_names_the_file_and_line(tmp_path: Path, bad: str, problem: str) -> None:
    # The blank line is skipped by the reader but still counts as a line of the user's file.
    cfg = _user_files(tmp_path, [GOOD, "", GOOD, bad, GOOD], [GOOD])
    with pytest.raises(ValueError) as err:
        load_examples(cfg, "train")
    assert str(err.value) == (
        f"data file {tmp_path / 'train.jsonl'} line 4: {problem}; fix the row or set "
        "data.bad_rows=skip to skip such rows"
    )
    assert len(load_examples(cfg, "test").dataset) == 1  # the test file is fine


def test_bad_row_in_a_later_file_names_that_file(tmp_path: Path) -> None:
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(f"{GOOD}\n{GOOD}\n")
    second.write_text(f'{GOOD}\n{{"prompt": "  ", "answer": "1"}}\n{{"answer": "1"}}\n')
    cfg = DataConfig(train_files=[str(first), str(second)], test_files=[str(first)])
    with pytest.raises(ValueError, match=rf"^data file {second} line 2: 'prompt' is empty \(2 "):
        load_examples(cfg, "train")


def test_bad_row_in_parquet_names_the_row_index(tmp_path: Path) -> None:
    import datasets

    rows = [{"prompt": "1+1", "answer": "2"}, {"prompt": None, "answer": "3"}]
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    cfg = DataConfig(train_files=[str(path)], test_files=[str(path)])
    with pytest.raises(ValueError, match=rf"^data file {path} row index 1: 'prompt' is missing"):
        load_examples(cfg, "train")
    skipped = load_examples(cfg.model_copy(update={"bad_rows": "skip"}), "test")
    assert list(skipped.dataset) == rows[:1] and skipped.skipped_rows == 1


def test_skip_mode_drops_exactly_the_bad_rows_and_counts_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    row = lambda p, a: json.dumps({"prompt": p, "answer": a})  # noqa: E731
    first.write_text("\n".join([row("q0", "0"), row("", "1"), row("q2", "2")]) + "\n")
    second.write_text("\n".join([row(None, "3"), row("q4", None), row("q5", "5")]) + "\n")
    cfg = DataConfig(
        train_files=[str(first), str(second)], test_files=[str(first)], bad_rows="skip"
    )
    with caplog.at_level(logging.WARNING, logger="rl.data.loading"):
        examples = load_examples(cfg, "train")
    assert [r["prompt"] for r in examples.dataset] == ["q0", "q2", "q5"]
    assert examples.skipped_rows == 3
    assert examples.source == f"{first}, {second}"
    assert f"data file {first}: skipped 1 bad rows" in caplog.text
    assert f"data file {second}: skipped 2 bad rows" in caplog.text
    assert "line 1: 'prompt' is null" in caplog.text
    assert [r["prompt"] for r in load_split(cfg, "train")] == ["q0", "q2", "q5"]


def test_a_split_with_no_usable_rows_is_an_error(tmp_path: Path) -> None:
    cfg = _user_files(tmp_path, ['{"prompt": "", "answer": "1"}'], [GOOD], bad_rows="skip")
    with pytest.raises(ValueError, match="train split at .* no rows left after skipping 1 bad"):
        load_examples(cfg, "train")
    cfg = _user_files(tmp_path, [], [GOOD])
    with pytest.raises(ValueError, match="train split at .*train.jsonl is empty"):
        load_examples(cfg, "train")


def test_file_level_type_errors_name_the_files(tmp_path: Path) -> None:
    cfg = _user_files(tmp_path, ['{"prompt": 12, "answer": "1"}'], [GOOD])
    with pytest.raises(ValueError, match="train.jsonl: 'prompt' must be text"):
        load_examples(cfg, "train")
    other = tmp_path / "other.jsonl"
    other.write_text('{"prompt": "1+1", "answer": 2}\n')
    cfg = DataConfig(train_files=[cfg.test_files[0], str(other)], test_files=[str(other)])
    with pytest.raises(ValueError, match=r"data files .*test.jsonl, .*other.jsonl differ"):
        load_examples(cfg, "train")


def test_generated_splits_pass_the_same_checks(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    examples = load_examples(cfg, "train")
    assert examples.skipped_rows == 0 and len(examples.dataset) == 300
    assert examples.source == str(prepare_splits(cfg)["train"])


def _config(max_model_len: int = 100, max_new_tokens: int = 20, max_prompt_tokens: int = 0):
    return Config(
        model={"path": "unused"},
        rollout={"max_model_len": max_model_len, "max_new_tokens": max_new_tokens},
        data={"max_prompt_tokens": max_prompt_tokens},
    )


def test_prompt_token_limit_resolution_and_errors() -> None:
    assert prompt_token_limit(_config()) == 80
    assert prompt_token_limit(_config(max_prompt_tokens=30)) == 30
    assert prompt_token_limit(_config(max_prompt_tokens=80)) == 80
    with pytest.raises(ValueError, match=r"data.max_prompt_tokens=81 exceeds .* = 80"):
        prompt_token_limit(_config(max_prompt_tokens=81))
    with pytest.raises(ValueError, match=r"data.max_prompt_tokens=-1"):
        prompt_token_limit(_config(max_prompt_tokens=-1))
    with pytest.raises(ValueError, match=r"data.max_prompt_tokens resolves to .* = 0 tokens"):
        prompt_token_limit(_config(max_new_tokens=100))


def _by_length(prompts: list[str]) -> list[int]:
    return [len(p) for p in prompts]


def test_filter_long_prompts_drops_and_counts() -> None:
    import datasets

    dataset = datasets.Dataset.from_list(
        [{"prompt": "x" * n, "answer": str(n)} for n in (1, 5, 3, 6, 4)]
    )
    kept, dropped = filter_long_prompts(dataset, _by_length, 4, "train.jsonl")
    assert [r["answer"] for r in kept] == ["1", "3", "4"] and dropped == 2
    assert filter_long_prompts(dataset, _by_length, 6, "train.jsonl") == (dataset, 0)
    with pytest.raises(ValueError, match=r"all 5 prompts of /d/train.jsonl are longer than 0 "):
        filter_long_prompts(dataset, _by_length, 0, "/d/train.jsonl")


@pytest.mark.parametrize("template", [True, False])
def test_prompt_lengths_match_encode_prompt(tiny_model_dir: Path, template: bool) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    if not template:
        tok.chat_template = None
    prompts = ["1+2", "123+456=", "", "9" * 40, "7+7 " * 10]
    assert prompt_lengths(tok, prompts) == [len(encode_prompt(tok, p)) for p in prompts]


def test_filter_long_prompts_with_the_tokenizer(tiny_model_dir: Path, tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = _user_files(
        tmp_path, [GOOD, json.dumps({"prompt": "1+" * 50, "answer": "?"}), GOOD], [GOOD]
    )
    examples = load_examples(cfg, "train")
    limit = len(encode_prompt(tok, "1+1"))
    kept, dropped = filter_long_prompts(
        examples.dataset, partial(prompt_lengths, tok), limit, examples.source
    )
    assert [r["prompt"] for r in kept] == ["1+1", "1+1"] and dropped == 1
    with pytest.raises(ValueError, match=rf"prompts of {examples.source} are longer than 3 "):
        filter_long_prompts(examples.dataset, partial(prompt_lengths, tok), 3, examples.source)
