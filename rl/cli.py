"""`rl` command line: `rl train RECIPE [key=value ...] [--resume auto|PATH] [--address A]`,
`rl build-base RECIPE [key=value ...]`, `rl export CHECKPOINT --to DIR [--merge]`, `rl report RUN_DIR`,
`rl eval MODEL --data FILE [--k K]`, `rl generate MODEL PROMPT [--n N]`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rl.checkpoint.resume import find_resume_point
from rl.checkpoint.store import CheckpointError
from rl.cluster.memory_plan import PlanDoesNotFit
from rl.config.recipe import ConfigError, check_inputs, describe_config, dry_run_report, load_config
from rl.run.directory import RunInUse, fresh_run_config
from rollout.engines.registry import ENGINES


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rl", description="Tandem: RL post-training for LLMs.")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="run a recipe (GRPO family or PPO)")
    train.add_argument("recipe", nargs="?", help="YAML recipe, e.g. recipes/grpo_addition_cpu.yaml")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=3e-6")
    train.add_argument("--help-config", action="store_true", help="print every config key and exit")
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="resolve the config and plan the placement, start nothing",
    )
    train.add_argument(
        "--resume",
        metavar="auto|PATH",
        help="continue from a checkpoint: 'auto' = the newest good one of this run (or a fresh "
        "start if there is none), or a checkpoint directory",
    )
    train.add_argument(
        "--device-memory-gb",
        type=float,
        metavar="GIB",
        help="--dry-run: check the memory plan against GPUs of this size (default: the GPU "
        "this machine has, else host memory)",
    )
    train.add_argument(
        "--log-format",
        choices=("progress", "json"),
        help="console output (the same as run.log_format=...): a live progress display (a line a "
        "step off a terminal), or a JSON line a step",
    )
    train.add_argument(
        "--verbose",
        action="store_true",
        help="stream Ray's and vLLM's worker output to the console (run.verbose=true)",
    )
    train.add_argument(
        "--address",
        help="join this Ray cluster (HOST:PORT of its head; the RAY_ADDRESS environment "
        "variable, which `ray job submit` sets, does the same); default: start a local one",
    )
    build = commands.add_parser("build-base", help="build the recipe's tiny SFT base checkpoint")
    build.add_argument("recipe")
    build.add_argument("overrides", nargs="*")
    export = commands.add_parser("export", help="write a checkpoint's policy as an HF model")
    export.add_argument(
        "checkpoint", help="a checkpoint directory, e.g. runs/NAME/checkpoints/step_000100"
    )
    export.add_argument("--to", required=True, help="output directory (replaced atomically)")
    export.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: the base with the adapters merged in (default: the adapters alone, "
        "in PEFT's format)",
    )
    report = commands.add_parser("report", help="plot a run and write a Markdown summary")
    report.add_argument("run_dir", help="a run's directory, e.g. runs/grpo-addition")
    report.add_argument("--out", help="where the PNGs and summary.md go (default RUN_DIR/report)")
    evaluate = commands.add_parser("eval", help="a model's accuracy and pass@k on a data file")
    generate = commands.add_parser("generate", help="samples of one prompt with their log-probs")
    for command in (evaluate, generate):
        command.add_argument("model", help="an HF model directory or a run checkpoint")
    evaluate.add_argument("--data", required=True, help="jsonl/parquet rows with prompt, answer")
    evaluate.add_argument("--task", help="the verifier (default: the one the model records)")
    evaluate.add_argument("--k", type=int, default=1, help="samples per prompt for pass@k")
    generate.add_argument("prompt")
    generate.add_argument("--n", type=int, default=1, help="samples")
    for command in (evaluate, generate):
        command.add_argument("--temperature", type=float, default=1.0, help="of the samples")
        command.add_argument("--max-new-tokens", type=int, default=32)
        command.add_argument("--max-model-len", type=int, default=512)
        command.add_argument("--seed", type=int, default=0)
        command.add_argument(
            "--engine", choices=ENGINES.names(), default="vllm", help="rollout engine"
        )
        command.add_argument(
            "--environment",
            help="run multi-turn episodes of this agent environment (a built-in one or "
            "path/to/file.py:ClassName, run in a sandbox); "
            "default: the one the model records, if any",
        )
        command.add_argument(
            "--max-turns", type=int, help="assistant turns at most (default: as recorded, or 4)"
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    args, extra = _parser().parse_known_args(argv)
    # argparse stops collecting positionals at the first flag, so overrides written after
    # --dry-run arrive here; anything else is a genuine unknown argument.
    unknown = [arg for arg in extra if arg.startswith("-") or "=" not in arg]
    if unknown:
        _parser().error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if args.command == "train":  # flags for two run.* keys, applied as their overrides
        args.overrides += [f"run.log_format={args.log_format}"] if args.log_format else []
        args.overrides += ["run.verbose=true"] if args.verbose else []
    if args.command == "export":
        return _export(args.checkpoint, args.to, args.merge)
    if args.command == "report":
        return _report(args.run_dir, args.out)
    if args.command in ("eval", "generate"):
        return _serve(args)
    if args.command == "train" and args.help_config:
        print(describe_config())
        return 0
    if args.recipe is None:
        _parser().error("train needs a RECIPE (or --help-config)")
    dry_run = args.command == "train" and args.dry_run
    resume = args.resume if args.command == "train" else None
    try:
        cfg = load_config(args.recipe, args.overrides)
        if args.command == "train" and not dry_run:
            check_inputs(cfg, args.recipe)
            fresh = fresh_run_config(cfg, resuming=resume is not None)
            if fresh.run.name != cfg.run.name:
                print(
                    f"{cfg.run.directory()} holds an earlier run, left as it is: this run writes "
                    f"{fresh.run.directory()} (continue the earlier one with --resume auto)",
                    flush=True,
                )
            cfg = fresh
            resume_from = find_resume_point(cfg, resume)
    except (ConfigError, CheckpointError, RunInUse) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if dry_run:
        try:
            print(dry_run_report(cfg, args.recipe, args.device_memory_gb))
        except PlanDoesNotFit as exc:
            print(
                f"error: {args.recipe}: the plan does not fit its devices. {exc}", file=sys.stderr
            )
            return 2
        return 0
    # Heavy imports (torch, ray, vllm) only once the config is known to be good.
    if args.command == "build-base":
        from rl.base.build import build_base
        from rl.sandbox import configure as configure_sandbox

        configure_sandbox(cfg.sandbox)  # an agent's base runs its tools
        print(f"base checkpoint written to {build_base(cfg)}")
        return 0
    from rl.run.driver import RunAborted, train
    from rl.sandbox import SandboxRefused

    if args.address:
        os.environ["RAY_ADDRESS"] = args.address  # what rl.cluster.reservation.init_ray joins
    try:
        train(cfg, resume_from)
    # model.path checked again once built, and at restarts; teacher.path against a built base.
    except (CheckpointError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (RunAborted, RunInUse) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except SandboxRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _export(checkpoint: str, out_dir: str, merge: bool) -> int:
    from rl.checkpoint.export import export_checkpoint

    try:
        path = export_checkpoint(Path(checkpoint), Path(out_dir), merge)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    what = "HF model" if (path / "config.json").is_file() else "LoRA adapters (PEFT format)"
    print(f"{what} written to {path}")
    return 0


def _report(run_dir: str, out_dir: str | None) -> int:
    from rl.observe.report import ReportError, write_report

    try:
        summary = write_report(Path(run_dir), Path(out_dir) if out_dir else None)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"report written to {summary}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    """`rl eval` and `rl generate` (rl.run.offline_eval); bad input exits 2 before vLLM starts."""
    from rl.run import offline_eval

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the results, not vLLM's warnings
    try:
        offline_eval.check_model(Path(args.model))
        if args.command == "eval":
            task = offline_eval.task_of(Path(args.model), args.task)
            rows = offline_eval.load_eval_rows(Path(args.data), task)
        agent = offline_eval.agent_of(Path(args.model), args.environment, args.max_turns)
        with offline_eval.model_directory(Path(args.model)) as model_dir:
            evaluator = offline_eval.Evaluator(
                model_dir, args.max_new_tokens, args.max_model_len, args.seed, args.engine, agent
            )
            try:
                if args.command == "eval":
                    result = evaluator.evaluate(rows, task, args.k, args.temperature)
                    print(f"{args.data}: {result.describe()}")
                else:
                    example = {"prompt": args.prompt}
                    samples = evaluator.sample([example], args.n, args.temperature)[0]
                    print(offline_eval.format_samples(args.prompt, samples, evaluator.tokenizer))
            finally:
                evaluator.close()
    except (CheckpointError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
