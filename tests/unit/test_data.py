"""Splits on disk (deterministic, disjoint, atomic), the resumable prompt stream, prompts."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rl import data
from rl.config import DataConfig
from rl.data import PromptStream, load_split, prepare_splits, split_dir
from rl.prompts import encode_prompt


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
    with caplog.at_level(logging.WARNING, logger="rl.prompts"):
        ids = encode_prompt(tok, "12+34")
    assert ids == tok.encode("12+34") and tok.decode(ids) == "12+34"
    assert "no chat template" in caplog.text
