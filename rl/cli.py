"""`rl` command line: `rl train RECIPE [key=value ...]`, `rl build-base RECIPE [key=value ...]`."""

from __future__ import annotations

import argparse
import sys

from rl.recipe import ConfigError, check_model_path, describe_config, load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rl", description="Tandem: RL post-training for LLMs.")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="run a recipe (GRPO)")
    train.add_argument("recipe", nargs="?", help="YAML recipe, e.g. recipes/grpo_addition_cpu.yaml")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=3e-6")
    train.add_argument("--help-config", action="store_true", help="print every config key and exit")
    build = commands.add_parser("build-base", help="build the recipe's tiny SFT base checkpoint")
    build.add_argument("recipe")
    build.add_argument("overrides", nargs="*")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "train" and args.help_config:
        print(describe_config())
        return 0
    if args.recipe is None:
        _parser().error("train needs a RECIPE (or --help-config)")
    try:
        cfg = load_config(args.recipe, args.overrides)
        if args.command == "train":
            check_model_path(cfg, args.recipe)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Heavy imports (torch, ray, vllm) only once the config is known to be good.
    if args.command == "build-base":
        from trainer.base_model import build_base

        print(f"base checkpoint written to {build_base(cfg)}")
        return 0
    from rl.driver import train

    train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
