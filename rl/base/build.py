"""The tiny SFT "pretrained" checkpoint that the CPU recipes start RL from (`rl build-base`).

There is no model hub on these machines, so a base model is made here: a byte-level tokenizer
and a small Qwen2 trained from scratch, supervised on the task's train split (prompt -> answer
in the chat template), deliberately stopped while it is still imperfect so RL has work to do.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import datasets
import torch
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    get_cosine_schedule_with_warmup,
)

from rl.agents.env_pool import close_env_pools
from rl.agents.resolve import get_environment
from rl.agents.tool_pool import ToolPool
from rl.agents.trajectory import render
from rl.base.episodes import IGNORE, demonstration, demonstration_row, greedy_episode_accuracy
from rl.config import BaseBuildConfig, Config
from rl.data.loading import PromptStream, load_split
from rl.data.prompts import encode_prompt
from rl.data.tasks import Task, get_task
from trainer.hf_model import SPECIAL_TOKENS, new_model, save_hf_atomic, train_tokenizer

logger = logging.getLogger(__name__)

BASE_INFO = "base_info.json"
VALIDATE_EVERY = 25  # SFT steps between early-stopping checks (each costs ~2 steps' time)
NUM_VALIDATION = 200  # train examples held out from SFT for early stopping


def answer_row(tokenizer: PreTrainedTokenizerBase, example: dict) -> tuple[list[int], list[int]]:
    """(input ids, labels) of prompt -> answer: labels only on the answer tokens and EOS.

    The answer is encoded on its own after the generation prompt, exactly the token
    sequence that a rollout must produce to be scored correct.
    """
    prompt = encode_prompt(tokenizer, example["prompt"])
    answer = tokenizer.encode(example["answer"], add_special_tokens=False)
    answer.append(tokenizer.eos_token_id)
    return prompt + answer, [IGNORE] * len(prompt) + answer


def _sft_batch(
    tokenizer: PreTrainedTokenizerBase, rows: list[tuple[list[int], list[int]]]
) -> dict[str, torch.Tensor]:
    """Right-padded input_ids/attention_mask/labels of (ids, labels) rows."""
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    return {
        "input_ids": torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows]),
        "attention_mask": torch.tensor(
            [[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows]
        ),
        "labels": torch.tensor([lab + [IGNORE] * (width - len(lab)) for _, lab in rows]),
    }


def sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    stream: PromptStream,
    cfg: BaseBuildConfig,
    validate: Callable[[], float],
    row: Callable[[dict], tuple[list[int], list[int]]],
) -> dict[str, float | None]:
    """Train `model` in place with AdamW for up to `cfg.sft_steps` steps.

    `row(example)` gives an example's (input ids, labels): `answer_row` for prompt -> answer,
    `rl.base.episodes.demonstration_row` for an agent's demonstration. Every `VALIDATE_EVERY` steps `validate()` (a held-out greedy accuracy) is checked against
    `cfg.sft_target_accuracy`. Learning to add is abrupt: the loss sits on a plateau for a
    seed-dependent few hundred steps and then accuracy climbs by tens of points per hundred
    steps, so a fixed step count cannot land reliably on an imperfect-but-close base; stopping
    on accuracy can. Returns the steps run, the last loss and the last validation accuracy (None if
    never validated).
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.0)
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, num_warmup_steps=max(1, cfg.sft_steps // 20), num_training_steps=cfg.sft_steps
    )
    model.train()
    stats: dict[str, float | None] = {"steps": 0, "loss": math.nan, "val_accuracy": None}
    for step in range(1, cfg.sft_steps + 1):
        batch = _sft_batch(tokenizer, [row(ex) for ex in stream.next_batch(cfg.sft_batch_size)])
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        stats |= {"steps": step, "loss": loss.item()}
        if step % VALIDATE_EVERY and step != cfg.sft_steps:
            continue
        logger.info("sft step %d/%d loss %.4f", step, cfg.sft_steps, stats["loss"])
        if cfg.sft_target_accuracy > 0:
            stats["val_accuracy"] = accuracy = validate()
            logger.info("sft validation greedy accuracy %.3f", accuracy)
            if accuracy >= cfg.sft_target_accuracy:
                break
    model.eval()
    return stats


@torch.no_grad()
def generate_responses(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float = 0.0,
    num_samples: int = 1,
    batch_size: int = 512,
) -> list[list[str]]:
    """`num_samples` decoded responses per prompt; temperature 0 means greedy.

    Prompts are left-padded so every row's continuation starts at the same position.
    """
    was_training = model.training
    model.eval()
    pad = tokenizer.pad_token_id
    out: list[list[str]] = []
    for start in range(0, len(prompts), batch_size):
        encoded = [encode_prompt(tokenizer, p) for p in prompts[start : start + batch_size]]
        width = max(len(ids) for ids in encoded)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded])
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        generated = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            num_return_sequences=num_samples,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
            **(sampling if temperature > 0 else {"do_sample": False}),
        )
        texts = tokenizer.batch_decode(generated[:, width:], skip_special_tokens=True)
        out.extend(texts[i : i + num_samples] for i in range(0, len(texts), num_samples))
    model.train(was_training)
    return out


def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    examples: list[dict],
    max_new_tokens: int,
) -> float:
    """Fraction of `examples` whose greedy response `task` scores correct."""
    prompts = [ex["prompt"] for ex in examples]
    responses = generate_responses(model, tokenizer, prompts, max_new_tokens)
    scores = [task.score(r[0], ex) for r, ex in zip(responses, examples, strict=True)]
    return sum(scores) / len(scores)


def build_base(cfg: Config) -> Path:
    """Train tokenizer and model for `cfg.data.task`, save them at `cfg.model.path`.

    Runs single-process on `cfg.trainer.num_threads` torch threads; also writes
    base_info.json (held-out greedy accuracy, steps, seconds) into the checkpoint.
    """
    start = time.time()
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.trainer.num_threads)
    try:
        task = get_task(cfg.data.task)
        train = load_split(cfg.data, "train")
        test = [dict(ex) for ex in load_split(cfg.data, "test")]
        # Early stopping looks at train examples SFT never sees, leaving the test split clean.
        num_val = max(1, min(NUM_VALIDATION, len(train) // 10))
        val = [dict(ex) for ex in train.select(range(len(train) - num_val, len(train)))]
        train = train.select(range(len(train) - num_val))
        with ExitStack() as stack:
            if cfg.agent.enabled:
                tokenizer, model, row, accuracy_of = _agent_base(cfg, task, train, stack)
            else:
                tokenizer = train_tokenizer(
                    (text for ex in train for text in (ex["prompt"], ex["answer"])),
                    cfg.base.vocab_size,
                )
                # Seeded like the run so that `rl build-base` is reproducible end to end.
                model = new_model(cfg.base, tokenizer, seed=cfg.run.seed)
                row = partial(answer_row, tokenizer)
                max_new = cfg.rollout.max_new_tokens
                accuracy_of = partial(
                    greedy_accuracy, model, tokenizer, task, max_new_tokens=max_new
                )
            stream = PromptStream(train, cfg.run.seed)
            stats = sft(model, tokenizer, stream, cfg.base, lambda: accuracy_of(val), row)
            accuracy = accuracy_of(test)
    finally:
        torch.set_num_threads(threads)
    info = {
        "task": task.name,
        "task_params": _task_params(cfg),
        "greedy_accuracy": accuracy,
        "num_test": len(test),
        "sft_steps": stats["steps"],
        "sft_final_loss": stats["loss"],
        "sft_val_accuracy": stats["val_accuracy"],
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "seconds": round(time.time() - start, 2),
    }
    if cfg.agent.enabled:  # what `rl eval` and `rl generate` run its episodes with
        info["agent"] = cfg.agent.model_dump()
    path = save_hf_atomic(
        model, tokenizer, cfg.model.path, extra_files={BASE_INFO: json.dumps(info, indent=2)}
    )
    logger.info("built base model at %s: %s", path, info)
    return path


def _agent_base(
    cfg: Config, task: Task, train: datasets.Dataset, stack: ExitStack
) -> tuple[PreTrainedTokenizerFast, PreTrainedModel, Callable, Callable]:
    """Tokenizer, model, SFT row and held-out accuracy functions of an agent recipe's base:
    SFT on the environment's demonstrations, accuracy of greedy episodes with real tools (in a
    sandboxed pool that `stack` closes)."""
    # An agent function has no demonstrations: the base learns from base.environment's.
    agent = cfg.agent.model_copy(
        update={"environment": cfg.base.environment or cfg.agent.environment}
    )
    # Started first: an environment or a tool that cannot be served fails before any training.
    stack.callback(close_env_pools)
    env_class = get_environment(agent)
    pool = stack.enter_context(ToolPool.for_agent(agent))
    schemas = pool.schemas or None
    # The tokenizer learns merges from whole conversations as the template renders them,
    # special tokens left out (they are never merged).
    renderer = train_tokenizer([], cfg.base.vocab_size)
    specials = re.compile("|".join(map(re.escape, SPECIAL_TOKENS)))

    def texts() -> Iterator[str]:
        for example in train:
            messages = demonstration(env_class, example)
            yield from specials.split(render(renderer, messages, schemas, False))

    tokenizer = train_tokenizer(texts(), cfg.base.vocab_size)
    model = new_model(cfg.base, tokenizer, seed=cfg.run.seed)
    max_new = cfg.rollout.max_new_tokens

    def accuracy_of(examples: list[dict]) -> float:
        return greedy_episode_accuracy(
            model, tokenizer, task, examples, env_class, schemas, pool, agent, max_new
        )

    return (
        tokenizer,
        model,
        partial(demonstration_row, env_class, tokenizer, tools=schemas),
        accuracy_of,
    )


def _task_params(cfg: Config) -> dict:
    """What a base's answer format depends on: the task and its generation parameters."""
    task = get_task(cfg.data.task)
    return {"task": task.name} | {field: getattr(cfg.data, field) for field in task.param_fields}


def _warn_if_built_for_other_params(path: Path, cfg: Config) -> None:
    # The path is the user's choice, so a base built for other task parameters (another answer
    # format) is used as asked, but it will score badly and deserves a loud hint.
    info_file = path / BASE_INFO
    if not info_file.exists():
        return  # not built here (any HF checkpoint)
    built_for = json.loads(info_file.read_text()).get("task_params")
    if built_for is not None and built_for != _task_params(cfg):
        logger.warning(
            "base model at %s was built for %s but this run uses %s: delete it to rebuild",
            path,
            built_for,
            _task_params(cfg),
        )


def ensure_base(cfg: Config) -> None:
    """Make sure `cfg.model.path` exists, building it when `cfg.base.build_if_missing`."""
    path = Path(cfg.model.path)
    if path.exists():
        _warn_if_built_for_other_params(path, cfg)
        return
    if not cfg.base.build_if_missing:
        raise ValueError(
            f"model.path {cfg.model.path!r} does not exist: build it with `rl build-base RECIPE` "
            "or set base.build_if_missing=true"
        )
    build_base(cfg)
