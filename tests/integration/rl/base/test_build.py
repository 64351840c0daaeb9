"""build_base writes a loadable HF checkpoint with a chat template; ensure_base guards it."""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl.base.build import (
    BASE_INFO,
    VALIDATE_EVERY,
    answer_row,
    ensure_base,
    greedy_accuracy,
    sft,
)
from rl.config import BaseBuildConfig, Config
from rl.data.loading import PromptStream
from rl.data.prompts import encode_prompt
from rl.data.tasks import get_task
from trainer.hf_model import new_model

pytestmark = pytest.mark.integration


_TINY_BASE = {
    "hidden_size": 64,
    "num_heads": 2,
    "num_kv_heads": 1,
    "num_layers": 1,
    "intermediate_size": 64,
    "sft_batch_size": 8,
}


def _tiny_config(tmp_path: Path, build_if_missing: bool) -> Config:
    return Config(
        model={"path": str(tmp_path / "base")},
        data={"dir": str(tmp_path / "data"), "num_train": 200, "num_test": 16},
        base={"build_if_missing": build_if_missing, "sft_steps": 3, **_TINY_BASE},
        rollout={"max_new_tokens": 6},
    )


def test_ensure_base_refuses_to_guess(tmp_path: Path) -> None:
    cfg = _tiny_config(tmp_path, build_if_missing=False)
    with pytest.raises(ValueError, match=r"model.path .*base.*rl build-base.*build_if_missing"):
        ensure_base(cfg)
    assert not (tmp_path / "base").exists()


def test_ensure_base_builds_a_loadable_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _tiny_config(tmp_path, build_if_missing=True)
    ensure_base(cfg)
    path = Path(cfg.model.path)
    info = json.loads((path / BASE_INFO).read_text())
    assert info["task"] == "addition" and info["sft_steps"] == 3 and info["num_test"] == 16
    assert 0.0 <= info["sft_val_accuracy"] <= 1.0  # validated once, at the last step
    assert 0.0 <= info["greedy_accuracy"] <= 1.0 and info["seconds"] > 0

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert tokenizer.chat_template and tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.decode(encode_prompt(tokenizer, "1+2")) == "<|user|>1+2<|assistant|>"
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 1
    # The reloaded checkpoint reproduces the recorded accuracy (same weights, same eval).
    test = [json.loads(line) for line in next(Path(cfg.data.dir).glob("*/test.jsonl")).open()]
    accuracy = greedy_accuracy(model, tokenizer, get_task("addition"), test, max_new_tokens=6)
    assert accuracy == info["greedy_accuracy"]

    # An existing checkpoint is left alone, but flagged if built for another answer format.
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    with caplog.at_level(logging.WARNING, logger="rl.base.build"):
        ensure_base(cfg)
        assert not caplog.text
        ensure_base(
            cfg.model_copy(update={"data": cfg.data.model_copy(update={"zero_pad": False})})
        )
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert "'zero_pad': True" in caplog.text and "delete it to rebuild" in caplog.text


class _Oracle:
    """Stands in for a model: answers right on even rows, "0" on odd ones, then EOS."""

    training = False

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def eval(self) -> None: ...

    def train(self, mode: bool = True) -> None: ...

    def generate(self, input_ids, attention_mask, max_new_tokens, **_) -> torch.Tensor:
        tok = self.tokenizer
        # Left padding: every row's real tokens end at the last column.
        assert bool(attention_mask[:, -1].all())
        rows = []
        for i, (ids, mask) in enumerate(zip(input_ids, attention_mask, strict=True)):
            prompt = tok.decode(ids[mask.bool()], skip_special_tokens=True)
            a, b = prompt.split("+")
            answer = str(int(a) + int(b)) if i % 2 == 0 else "0"
            new = tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
            new += [tok.pad_token_id] * (max_new_tokens - len(new))
            rows.append(torch.cat([ids, torch.tensor(new[:max_new_tokens])]))
        return torch.stack(rows)


def test_greedy_accuracy_scores_left_padded_batches(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    examples = [{"prompt": f"{a}+{b}", "answer": str(a + b)} for a, b in [(1, 2), (10, 5), (7, 7)]]
    examples.append({"prompt": "123+4", "answer": "127"})
    oracle = _Oracle(tokenizer)
    assert greedy_accuracy(oracle, tokenizer, get_task("addition"), examples, 6) == 0.5


@pytest.mark.parametrize(("target", "steps"), [(0.5, VALIDATE_EVERY), (0.0, VALIDATE_EVERY + 5)])
def test_sft_stops_at_the_target_accuracy(tiny_model_dir: Path, target: float, steps: int) -> None:
    cfg = BaseBuildConfig(**_TINY_BASE, sft_steps=VALIDATE_EVERY + 5, sft_target_accuracy=target)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = new_model(cfg, tokenizer, seed=0)
    stream = PromptStream([{"prompt": "1+2", "answer": "3"}], seed=0)
    calls = []

    def validate() -> float:
        calls.append(1)
        return 0.5

    stats = sft(model, tokenizer, stream, cfg, validate, partial(answer_row, tokenizer))
    assert stats["steps"] == steps and len(calls) == (target > 0)
    assert stats["val_accuracy"] == (0.5 if target else None)
