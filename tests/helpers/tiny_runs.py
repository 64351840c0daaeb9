"""The recipe tree of the small end-to-end runs the integration and e2e tests make."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from tests.helpers.cli import run_rl


def tiny_run_tree(shared: Path, output_dir: Path, name: str, **sections: dict) -> dict:
    """A 2-step GRPO run on 2-digit addition: 1 rollout worker, 2 gloo trainer ranks.

    A random model never solves a prompt, so every advantage would be 0 and nothing would
    train: the runs start from a small SFT base under `shared`, right part of the time (the
    session's `tiny_base`, put there by `with_tiny_base`; a run that finds none builds it,
    base.build_if_missing). `sections` update the tree section by section.
    """
    tree = {
        "model": {"path": str(shared / "base")},
        "base": {
            "build_if_missing": True,
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 2,
            "num_kv_heads": 1,
            "intermediate_size": 128,
            "sft_steps": 400,
            "sft_target_accuracy": 0.3,
        },
        "data": {
            "task": "addition",
            "num_digits": 2,
            "dir": str(shared / "data"),
            "num_train": 2000,
            "num_test": 20,
        },
        "rollout": {"num_workers": 1, "kv_cache_gb": 0.25, "max_new_tokens": 6},
        "trainer": {"num_workers": 2, "lr": 1e-2, "micro_batch_size": 8},
        "algorithm": {"group_size": 8},
        "run": {
            "name": name,
            "output_dir": str(output_dir),
            "num_steps": 2,
            "prompts_per_step": 8,
            "eval_every": 0,
            "num_eval_prompts": 8,
            "wandb_mode": "disabled",
            "tensorboard": False,
        },
    }
    for section, values in sections.items():
        tree[section] = {**tree.get(section, {}), **values}
    return tree


def build_tiny_base(root: Path) -> Path:
    """The tiny runs' SFT base, built by `rl build-base` under `root`; its directory."""
    (root / "base.yaml").write_text(yaml.safe_dump(tiny_run_tree(root, root / "runs", "base")))
    built = run_rl("build-base", str(root / "base.yaml"))
    assert built.returncode == 0, built.stderr[-4000:]
    return root / "base"


def with_tiny_base(shared: Path, base: Path) -> Path:
    """`shared` (created if need be) holding a copy of the built tiny base `base`, as
    tiny_run_tree's runs look for it: several modules' runs start from one build."""
    shared.mkdir(parents=True, exist_ok=True)
    shutil.copytree(base, shared / "base")
    return shared
