"""TRL's GRPOTrainer on a workload `bench/vs_trl.py` prepares, for a side-by-side comparison.

Runs in the benchmark venv (.venv-bench: CPU torch, transformers, trl; `make bench` creates
it) and imports nothing from Tandem: the model, its tokenizer and the prompt files are the
ones the Tandem run uses, passed by path. Prints one JSON object: each step's seconds,
generated tokens and mean reward, and held-out greedy accuracy every --eval-every steps
(its time kept apart from the steps').

Settings follow Tandem's GRPO recipe: clipped ratio at 0.2, token-mean loss over the whole
generation batch (TRL's "dapo"), group-normalised advantages, no KL and no reference model,
the recipe's compute dtype (--dtype), one optimizer step per generation round, constant
learning rate.

    .venv-bench/bin/python bench/trl/trl_grpo.py --model DIR --data train.jsonl [...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer


def read_rows(path: str, num: int) -> list[dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[:num]


def chat(prompt: str) -> list[dict]:
    """TRL renders this with the model's chat template and the generation prompt: the
    token ids Tandem's encode_prompt gives."""
    return [{"role": "user", "content": prompt}]


class TimedGRPOTrainer(GRPOTrainer):
    """Counts what a step generated and trained, and its seconds of generation."""

    def __init__(self, counts: dict, **kwargs) -> None:
        super().__init__(**kwargs)
        self.counts = counts

    def _generate(self, prompts: list):
        start = time.perf_counter()
        out = super()._generate(prompts)
        self.counts["generate_seconds"] += time.perf_counter() - start
        return out

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.counts["trained_tokens"] += int(
            out["prompt_mask"].sum() + out["completion_mask"].sum()
        )
        return out


class Steps(TrainerCallback):
    """Per optimizer step (one generation round and its update): seconds, and the generated
    tokens and rewards the reward function saw; held-out accuracy every `eval_every` steps."""

    def __init__(self, counts: dict, evaluate, eval_every: int, target: float | None) -> None:
        self.records: list[dict] = []
        self._counts, self._evaluate = counts, evaluate
        self._eval_every, self._target = eval_every, target
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._counts.update(
            tokens=0, sequences=0, reward=0.0, generate_seconds=0.0, trained_tokens=0
        )
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        seconds = time.perf_counter() - self._start
        record = {
            "step": state.global_step,
            "seconds": seconds,
            "generated_tokens": self._counts["tokens"],
            "generate_seconds": self._counts["generate_seconds"],
            "trained_tokens": self._counts["trained_tokens"],
            "reward": self._counts["reward"] / max(self._counts["sequences"], 1),
        }
        if self._eval_every and state.global_step % self._eval_every == 0:
            start = time.perf_counter()
            record["accuracy"] = self._evaluate(model)
            record["eval_seconds"] = time.perf_counter() - start
            if self._target is not None and record["accuracy"] >= self._target:
                control.should_training_stop = True
        self.records.append(record)
        print(json.dumps({"trl_step": record}), file=sys.stderr, flush=True)


def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int) -> float:
    """Exact-match accuracy of greedy answers, batched with left padding."""
    tokenizer.padding_side = "left"
    texts = [
        tokenizer.apply_chat_template(chat(r["prompt"]), tokenize=False, add_generation_prompt=True)
        for r in rows
    ]
    correct = 0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(rows), 256):
            batch = tokenizer(texts[start : start + 256], return_tensors="pt", padding=True)
            out = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
            answers = tokenizer.batch_decode(
                out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True
            )
            correct += sum(
                a.strip() == r["answer"]
                for a, r in zip(answers, rows[start : start + 256], strict=True)
            )
    model.train()
    return correct / len(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="HF model directory (with its tokenizer)")
    p.add_argument("--data", required=True, help="train prompts: jsonl rows of prompt, answer")
    p.add_argument("--eval-data", help="held-out prompts for --eval-every")
    p.add_argument("--num-eval-prompts", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=0, help="steps between evaluations")
    p.add_argument("--target-accuracy", type=float, help="stop once an evaluation reaches it")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps (at most)")
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=64, help="sequences a forward")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="compute dtype: bfloat16 is TRL's bf16 mixed precision (fp32 master weights)",
    )
    p.add_argument(
        "--torch-compile",
        action="store_true",
        help="TrainingArguments.torch_compile: TRL's counterpart of trainer.compile",
    )
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    batch = args.prompts_per_step * args.group_size
    if batch % args.micro_batch_size:
        p.error("prompts-per-step * group-size must be a multiple of --micro-batch-size")
    rows = read_rows(args.data, args.prompts_per_step * args.steps)
    dataset = Dataset.from_list(
        [{"prompt": chat(r["prompt"]), "answer": r["answer"]} for r in rows]
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    eval_rows = read_rows(args.eval_data, args.num_eval_prompts) if args.eval_data else []
    counts = {
        "tokens": 0,
        "sequences": 0,
        "reward": 0.0,
        "generate_seconds": 0.0,
        "trained_tokens": 0,
    }

    def exact_match(completions, answer, completion_ids, **kwargs) -> list[float]:
        scores = [
            1.0 if c[0]["content"].strip() == a else 0.0
            for c, a in zip(completions, answer, strict=True)
        ]
        counts["tokens"] += sum(len(ids) for ids in completion_ids)
        counts["sequences"] += len(completion_ids)
        counts["reward"] += sum(scores)
        return scores

    config = GRPOConfig(
        output_dir="/tmp/trl-bench-out",
        use_cpu=True,
        # bf16 autocast over fp32 weights, as Tandem's model.dtype=bfloat16 (TRL's default).
        bf16=args.dtype == "bfloat16",
        gradient_checkpointing=False,  # TRL's default is on
        torch_compile=args.torch_compile,
        model_init_kwargs={"dtype": torch.float32},
        max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch_size,
        # One generation round of the whole batch per optimizer step.
        gradient_accumulation_steps=batch // args.micro_batch_size,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.2,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        mask_truncated_completions=False,
        disable_dropout=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        dataloader_num_workers=0,
        shuffle_dataset=True,
    )
    steps = Steps(
        counts,
        lambda model: greedy_accuracy(model, tokenizer, eval_rows, args.max_new_tokens),
        args.eval_every if eval_rows else 0,
        args.target_accuracy,
    )
    trainer = TimedGRPOTrainer(
        counts,
        model=args.model,
        reward_funcs=exact_match,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[steps],
    )
    before = None
    if eval_rows:
        start = time.perf_counter()
        before = {
            "accuracy": greedy_accuracy(trainer.model, tokenizer, eval_rows, args.max_new_tokens),
            "eval_seconds": time.perf_counter() - start,
        }
    trainer.train()
    result = {
        "system": "trl",
        "trl_version": __import__("trl").__version__,
        "num_parameters": sum(q.numel() for q in trainer.model.parameters()),
        "before": before,
        "steps": steps.records,
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
