"""Generated train/test splits on disk and a resumable, seeded prompt stream over them.

Splits live in `data.dir/<task>-<hash>/{train,test}.jsonl`, where the hash covers every
parameter that changes their content, so differently configured runs never share files and
identically configured runs (or processes) reuse them.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from collections.abc import Sequence
from pathlib import Path

import datasets

from rl.config import DataConfig
from rl.tasks import Task, get_task

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
    return Path(cfg.dir) / f"{task.name}-{digest}"


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
        "make the task larger (data.num_digits / data.num_operands)"
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


def load_split(cfg: DataConfig, split: str) -> datasets.Dataset:
    """The `split` ("train" or "test") of `cfg`'s task as a Dataset.

    From `data.train_files`/`data.test_files` when given, else generated (and cached).
    """
    if split not in SPLITS:
        raise ValueError(f"unknown data split {split!r}; valid: {', '.join(SPLITS)}")
    files = [Path(f) for f in (cfg.train_files if split == "train" else cfg.test_files)]
    if files:
        check_data_files(cfg)
        builder = "parquet" if files[0].suffix == ".parquet" else "json"
        data_files, cache_dir = [str(f) for f in files], files[0].parent / ".hf_cache"
        path = ", ".join(data_files)
    else:
        path = prepare_splits(cfg)[split]
        builder, data_files, cache_dir = "json", str(path), path.parent / ".hf_cache"
    try:
        dataset = datasets.load_dataset(
            builder, data_files=data_files, split="train", cache_dir=str(cache_dir)
        )
    except Exception as e:  # datasets wraps parse errors in several exception types
        raise ValueError(f"cannot read {split} split at {path}: {e}") from e
    missing = {"prompt", "answer"} - set(dataset.column_names)
    if missing:
        raise ValueError(f"{split} split at {path} lacks columns {sorted(missing)}")
    return dataset


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
