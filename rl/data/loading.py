"""Train/test splits (generated on disk, or the user's files, their rows checked), the
prompt-length filter, and a resumable, seeded prompt stream over them.

Splits live in `data.dir/<task>-<hash>/{train,test}.jsonl`, where the hash covers every
parameter that changes their content, so differently configured runs never share files and
identically configured runs (or processes) reuse them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import datasets

from rl.config import Config, DataConfig
from rl.data.tasks import Task, get_task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

SPLITS = ("train", "test")
# Bump when generation changes in a way the config does not capture (invalidates caches).
FORMAT_VERSION = 1
# Rounds of generation allowed to find enough distinct prompts before giving up.
_MAX_ROUNDS = 50


def split_dir(cfg: DataConfig) -> Path:
    """Directory holding the splits for `cfg` (not created)."""
    task = get_task(cfg.task)
    params = {"version": FORMAT_VERSION, "task": task.name, "seed": cfg.seed}
    params |= {"num_train": cfg.num_train, "num_test": cfg.num_test}
    params |= {field: getattr(cfg, field) for field in task.param_fields}
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
    # A family's task name has a colon (reasoning_gym:chain_sum), which paths had better not.
    return Path(cfg.dir) / f"{task.name.replace(':', '-')}-{digest}"


def _draw_distinct(
    task: Task, cfg: DataConfig, num: int, rng: random.Random, seen: set[str]
) -> list[dict]:
    """`num` examples whose prompts are not in `seen` (which is updated)."""
    out: list[dict] = []
    for _ in range(_MAX_ROUNDS):
        for example in task.generate(cfg, num - len(out), rng):
            if example["prompt"] not in seen:
                seen.add(example["prompt"])
                out.append(example)
        if len(out) == num:
            return out
    raise ValueError(
        f"task {task.name!r} produced only {len(seen)} distinct prompts, fewer than "
        f"data.num_train + data.num_test = {cfg.num_train + cfg.num_test}: lower them or "
        "make the task larger (data.num_digits / data.num_operands / data.task_config)"
    )


def _write_jsonl_atomic(path: Path, rows: list[dict]) -> None:
    # Readers (other processes preparing the same splits) only ever see complete files.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def prepare_splits(cfg: DataConfig) -> dict[str, Path]:
    """Write train.jsonl and test.jsonl for `cfg` unless present; return {split: path}.

    Deterministic from `cfg.seed`; test prompts are drawn first and never appear in train.
    """
    directory = split_dir(cfg)
    paths = {split: directory / f"{split}.jsonl" for split in SPLITS}
    if all(p.exists() for p in paths.values()):
        return paths
    task = get_task(cfg.task)
    rng = random.Random(cfg.seed)
    seen: set[str] = set()
    test = _draw_distinct(task, cfg, cfg.num_test, rng, seen)
    train = _draw_distinct(task, cfg, cfg.num_train, rng, seen)
    directory.mkdir(parents=True, exist_ok=True)
    _write_jsonl_atomic(paths["test"], test)
    _write_jsonl_atomic(paths["train"], train)
    return paths


@dataclass(frozen=True)
class Examples:
    """One split's rows, where they came from (for messages) and how many bad rows
    data.bad_rows=skip dropped from them."""

    dataset: datasets.Dataset
    source: str
    skipped_rows: int = 0


def load_split(cfg: DataConfig, split: str) -> datasets.Dataset:
    """The `split` ("train" or "test") of `cfg`'s task as a Dataset (see `load_examples`)."""
    return load_examples(cfg, split).dataset


def load_examples(cfg: DataConfig, split: str) -> Examples:
    """The `split` ("train" or "test") of `cfg`'s task, its rows checked.

    From `data.train_files`/`data.test_files` when given, else generated (and cached). Rows
    with a missing or null prompt or answer, or a blank prompt, stop with an error naming
    the file and row, or are dropped and counted under data.bad_rows=skip.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown data split {split!r}; valid: {', '.join(SPLITS)}")
    files = [Path(f) for f in (cfg.train_files if split == "train" else cfg.test_files)]
    if files:
        check_data_files(cfg)
    else:
        files = [prepare_splits(cfg)[split]]
    source = ", ".join(str(f) for f in files)
    parts, skipped = [], 0
    for file in files:
        dataset, num_bad = _usable_rows(file, split, cfg.bad_rows)
        skipped += num_bad
        if len(dataset):
            parts.append(dataset)
    if not parts:
        after = f" left after skipping {skipped} bad rows" if skipped else ""
        raise ValueError(f"{split} split at {source} has no rows{after}")
    return Examples(_concatenate(parts, source), source, skipped)


def _usable_rows(file: Path, split: str, bad_rows: str) -> tuple[datasets.Dataset, int]:
    """`file`'s rows without the bad ones and how many those were; under
    data.bad_rows=error a bad row is an error naming it instead."""
    dataset = _read_file(file, split)
    bad = _bad_rows(dataset)
    if not bad:
        return dataset, 0
    first = _describe_bad_row(file, *bad[0])
    if bad_rows == "error":
        also = f" ({len(bad)} bad rows in this file)" if len(bad) > 1 else ""
        raise ValueError(
            f"data file {file} {first}{also}; fix the row or set data.bad_rows=skip to skip "
            "such rows"
        )
    logger.warning(
        "data file %s: skipped %d bad rows (data.bad_rows=skip), the first at %s",
        file,
        len(bad),
        first,
    )
    bad_indices = {index for index, _, _ in bad}
    return dataset.select([i for i in range(len(dataset)) if i not in bad_indices]), len(bad)


def _read_file(file: Path, split: str) -> datasets.Dataset:
    """One data file as a Dataset with prompt and answer columns (rows not yet checked)."""
    if file.stat().st_size == 0:  # the readers fail on it without saying why
        raise ValueError(f"{split} split at {file} is empty")
    builder = "parquet" if file.suffix == ".parquet" else "json"
    try:
        dataset = datasets.load_dataset(
            builder,
            data_files=str(file),
            split="train",
            cache_dir=str(file.parent / ".hf_cache"),
        )
    except Exception as e:  # datasets wraps parse errors in several exception types
        raise ValueError(f"cannot read {split} split at {file}: {e or type(e).__name__}") from e
    missing = {"prompt", "answer"} - set(dataset.column_names)
    if missing:
        raise ValueError(
            f"{split} split at {file} lacks columns {sorted(missing)}: each row needs a "
            "'prompt' and an 'answer' field (rename the fields the file has)"
        )
    prompt_type = getattr(dataset.features["prompt"], "dtype", None)
    if prompt_type not in ("string", "large_string", "null"):  # null: every prompt is null
        raise ValueError(
            f"data file {file}: 'prompt' must be text (one string per row), found "
            f"{dataset.features['prompt']}"
        )
    return dataset


def _bad_rows(dataset: datasets.Dataset) -> list[tuple[int, str, str]]:
    """(row index, field, "null" or "empty") for each row the run cannot use."""
    columns = dataset.select_columns(["prompt", "answer"])[:]
    bad = []
    for index, (prompt, answer) in enumerate(
        zip(columns["prompt"], columns["answer"], strict=True)
    ):
        if prompt is None:
            bad.append((index, "prompt", "null"))
        elif answer is None:
            bad.append((index, "answer", "null"))
        elif not prompt.strip():
            bad.append((index, "prompt", "empty"))
    return bad


def _describe_bad_row(file: Path, index: int, field: str, problem: str) -> str:
    """Where row `index` of `file` is, as its user sees it, and what is wrong with it."""
    if file.suffix == ".parquet" or _is_json_array(file):
        where = f"row index {index}"
        problem = "missing or null" if problem == "null" else problem
    else:
        number, line = _jsonl_line(file, index)
        where = f"line {number}"
        if problem == "null" and field not in json.loads(line):  # Arrow reads absent as null
            problem = "missing"
    return f"{where}: {field!r} is {problem}"


def _is_json_array(file: Path) -> bool:
    """Whether a .json file holds one JSON array of rows rather than one row per line."""
    with file.open("rb") as f:
        return f.read(4096).lstrip().startswith(b"[")


def _jsonl_line(file: Path, index: int) -> tuple[int, str]:
    """The 1-based line number and text of row `index` of a JSON-lines file (the reader
    skips blank lines, so rows and lines can differ)."""
    row = -1
    with file.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if line.strip(b" \t\r\n"):
                row += 1
                if row == index:
                    return number, line.decode()
    raise ValueError(f"data file {file} has no row {index}")  # the file changed under us


def _concatenate(parts: list[datasets.Dataset], source: str) -> datasets.Dataset:
    if len(parts) == 1:
        return parts[0]
    try:
        return datasets.concatenate_datasets(parts)
    except ValueError as e:
        raise ValueError(
            f"data files {source} differ in columns or types ({e}): give them the same fields"
        ) from e


def prompt_token_limit(cfg: Config) -> int:
    """The longest prompt, in tokens, a run keeps: data.max_prompt_tokens, where 0 means
    what the engine can take beside a full response."""
    room = cfg.rollout.max_model_len - cfg.rollout.max_new_tokens
    limit = cfg.data.max_prompt_tokens
    if limit < 0:
        raise ValueError(f"data.max_prompt_tokens={limit}: use 0 (as long as fits) or a count")
    if limit > room:
        raise ValueError(
            f"data.max_prompt_tokens={limit} exceeds rollout.max_model_len - "
            f"rollout.max_new_tokens = {room}, so such prompts leave no room for a response: "
            "lower data.max_prompt_tokens (0 = that difference) or raise rollout.max_model_len"
        )
    limit = limit or room
    if limit < 1:
        raise ValueError(
            f"data.max_prompt_tokens resolves to rollout.max_model_len - rollout.max_new_tokens "
            f"= {room} tokens, no room for any prompt: raise rollout.max_model_len or lower "
            "rollout.max_new_tokens"
        )
    return limit


def prompt_lengths(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> list[int]:
    """Token counts of `prompts` as the rollout encodes them (`encode_prompts`)."""
    from rl.data.prompts import encode_prompts  # transformers: only once a tokenizer exists

    return [len(ids) for ids in encode_prompts(tokenizer, prompts)]


def filter_long_prompts(
    dataset: datasets.Dataset,
    lengths: Callable[[list[str]], list[int]],
    max_tokens: int,
    source: str,
) -> tuple[datasets.Dataset, int]:
    """`dataset` without the rows whose prompt is over `max_tokens` tokens as measured by
    `lengths` (e.g. `partial(prompt_lengths, tokenizer)`), and how many were dropped.

    `source` names where the rows came from, for the error raised when none are left.
    """
    sizes = lengths(list(dataset["prompt"]))
    keep = [index for index, size in enumerate(sizes) if size <= max_tokens]
    if not keep and sizes:
        raise ValueError(
            f"all {len(sizes)} prompts of {source} are longer than {max_tokens} tokens, the "
            "prompt limit (data.max_prompt_tokens, or rollout.max_model_len - "
            "rollout.max_new_tokens when it is 0): raise the limit or use shorter prompts"
        )
    if len(keep) == len(sizes):
        return dataset, 0  # no copy of the index when nothing is dropped
    return dataset.select(keep), len(sizes) - len(keep)


def check_data_files(cfg: DataConfig) -> None:
    """data.train_files/test_files: both or neither, existing, one format (jsonl or parquet)."""
    if bool(cfg.train_files) != bool(cfg.test_files):
        raise ValueError(
            "data.train_files and data.test_files go together: set both (a held-out split is "
            "needed for evaluation) or neither (generated splits)"
        )
    files = [Path(f) for f in [*cfg.train_files, *cfg.test_files]]
    for file in files:
        if not file.is_file():
            raise ValueError(f"data file not found: {file}")
        if file.suffix not in (".jsonl", ".json", ".parquet"):
            raise ValueError(f"data file {file}: expected .jsonl, .json or .parquet")
    if len({f.suffix == ".parquet" for f in files}) > 1:
        raise ValueError("data.train_files/test_files mix parquet and json: use one format")


class PromptStream:
    """Endless batches of examples: each epoch is a fresh seeded shuffle of `dataset`.

    The position is (epoch, index within the epoch's order); `state_dict` captures it so a
    resumed run yields exactly the batches the interrupted one would have.
    """

    def __init__(self, dataset: Sequence[dict] | datasets.Dataset, seed: int) -> None:
        if len(dataset) == 0:
            raise ValueError("PromptStream needs a non-empty dataset")
        self.dataset = dataset
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        # String seeds are hashed stably (unlike tuples), so orders survive restarts.
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self, n: int) -> list[dict]:
        """The next `n` examples, continuing into the next epoch when this one runs out."""
        batch = []
        while len(batch) < n:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            batch.append(dict(self.dataset[self._order[self.position]]))
            self.position += 1
        return batch

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed or not 0 <= state["position"] <= len(self.dataset):
            raise ValueError(
                f"prompt stream state {state} does not fit this stream "
                f"(seed {self.seed}, {len(self.dataset)} examples)"
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._epoch_order(self.epoch)
