"""Which checkpoint a run continues from, checked before anything heavy starts.

`--resume auto` takes the newest checkpoint of the run that verifies (falling back past
damaged ones, and starting fresh when there is none); `--resume PATH` takes PATH or fails.
Either way the checkpoint must hold the same run: the config may differ only in keys that do
not change what is computed (`RESUMABLE_CHANGES`), its tensors must fit model.path, and
model.path's weight files must be those it was trained from (`base_weights`).

The run then continues that checkpoint's timeline, and its checkpoints/ directory holds that
timeline only (`start_timeline`): checkpoints newer than the resume point are set aside (into
checkpoints/abandoned-<time>/, never deleted), so a fault restart or a later `--resume auto`
cannot switch back to them; a resume point from outside checkpoints/ (one set aside earlier,
another output_dir) sets aside all of them and is brought in (hard-linked where it can be).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rl.checkpoint.base_weights import check_base
from rl.checkpoint.store import (
    CheckpointError,
    adopt,
    checkpoint_root,
    checkpoint_step,
    list_checkpoints,
    newest_valid,
    restore_displaced,
    set_aside,
    verify,
)
from rl.config import Config
from rl.config.recipe import checkpoint_tensor_shapes
from rl.run.directory import RunLock

DRIVER_STATE = "driver.json"
# Config keys a resumed run may change: how long it runs, how it reports and saves.
RESUMABLE_CHANGES = (
    "run.num_steps",
    "run.eval_every",
    "run.num_eval_prompts",
    "run.export_hf",
    "run.output_dir",
    "run.wandb_mode",
    "run.wandb_project",
    "run.tensorboard",
    "run.log_format",
    "run.verbose",
    "checkpoint.",
    "faults.",
)


def find_resume_point(cfg: Config, resume: str | None) -> Path | None:
    """The checkpoint to continue from (None: a fresh start), in this run's checkpoints/ and
    its newest (`start_timeline`). CheckpointError when PATH is not a good checkpoint of this
    run. A fresh start needs no search: it has a directory of its own
    (`rl.run.directory.fresh_run_config`)."""
    root = checkpoint_root(cfg.run.directory())
    if resume is None:
        return None
    if resume == "auto":
        path, skipped = newest_valid(root)
        for reason in skipped:
            print(f"warning: skipping a damaged checkpoint: {reason}", file=sys.stderr)
        if path is None:
            print(f"no checkpoint under {root}: starting from the beginning")
            return None
    else:
        path = Path(resume)
        verify(path)
    check_compatible(cfg, path)
    # Held while the checkpoints move, so a live run of this directory is refused untouched.
    with RunLock(root.parent):
        return start_timeline(root, path)


def start_timeline(root: Path, path: Path) -> Path:
    """Make checkpoint `path` the newest of `root`: the newer ones (all of them, when `path` is
    not one of them) move into root/abandoned-<time>/, and a `path` from elsewhere is brought
    in as root's. Returns where `path` now is in `root`."""
    restore_displaced(root)
    current = list_checkpoints(root)
    ours = path.resolve() in {p.resolve() for p in current}
    step = checkpoint_step(path.resolve()) if ours else _driver_step(path)
    newer = [p for p in current if not ours or checkpoint_step(p) > step]
    if newer:
        aside = set_aside(root, newer)
        print(
            f"resuming from step {step}: {', '.join(p.name for p in newer)} of {root} moved to "
            f"{aside} (to return to them later, --resume a checkpoint there)",
            flush=True,
        )
    if ours:
        return root / path.resolve().name
    adopted = adopt(root, path, step)
    print(
        f"resuming from {path}: brought into {adopted} (its files hard-linked or copied), "
        "where this run continues",
        flush=True,
    )
    return adopted


def _driver_step(path: Path) -> int:
    step = json.loads((path / DRIVER_STATE).read_text()).get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{path / DRIVER_STATE} records no step ({step!r}); it is damaged")
    return step


def _flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_compatible(cfg: Config, path: Path) -> None:
    """CheckpointError naming the keys (or tensors) in which `path` differs from `cfg`."""
    state = json.loads((path / DRIVER_STATE).read_text())
    saved = _flatten(Config.model_validate(state["config"]).model_dump(mode="json"))
    now = _flatten(cfg.model_dump(mode="json"))
    changed = sorted(
        key
        for key in saved.keys() | now.keys()
        if saved.get(key) != now.get(key) and not key.startswith(RESUMABLE_CHANGES)
    )
    if changed:
        details = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed[:5])
        raise CheckpointError(
            f"checkpoint {path} was written by a differently configured run ({details}); "
            "resume with the recipe and overrides it was started with (only run.num_steps, "
            "evaluation, logging, checkpoint.* and faults.* may change)"
        )
    if state["step"] > cfg.run.num_steps:
        raise CheckpointError(
            f"checkpoint {path} is at step {state['step']}, past run.num_steps="
            f"{cfg.run.num_steps}; raise run.num_steps to continue training"
        )
    model_dir = Path(cfg.model.path)
    trains_all = not (cfg.model.lora.enabled or cfg.model.frozen)
    _check_shapes(path / "policy" / "shapes.json", model_dir, trains_all)
    # A missing base is built by the driver (base.build_if_missing), which checks it then.
    if model_dir.is_dir():
        check_base(path, model_dir)


_PEFT_PREFIX = "base_model.model."  # before the model's own names in a LoRA run's checkpoint


def _base_tensor(name: str, shape: list[int]) -> tuple[str, list[int | None]]:
    """The base tensor a checkpoint tensor trains, and the shape that fixes for it (None: a
    size it leaves open): a full fine-tune's tensor itself; a LoRA adapter's (peft's names) the
    weight of the linear it adapts, whose columns A [r, in] fixes and whose rows B [out, r]."""
    name = name.removeprefix(_PEFT_PREFIX)
    if ".lora_A.default." in name:
        return name.replace(".lora_A.default.", "."), [None, shape[1]]
    if ".lora_B.default." in name:
        return name.replace(".lora_B.default.", "."), [shape[0], None]
    return name, list(shape)


def _check_shapes(shapes_file: Path, model_dir: Path, trains_all: bool) -> None:
    """Every tensor the checkpoint trains fits model.path's (a tied lm_head may be absent
    from either); a run that trains the whole model (`trains_all`) holds every one."""
    saved = json.loads(shapes_file.read_text())
    base = checkpoint_tensor_shapes(model_dir)
    trained = set()
    for saved_name, saved_shape in saved.items():
        name, shape = _base_tensor(saved_name, saved_shape)
        trained.add(name)
        if name not in base:
            continue  # a tied lm_head stored once; an unknown tensor fails the load itself
        have = base[name]
        if len(shape) != len(have) or any(
            want not in (None, size) for want, size in zip(shape, have, strict=True)
        ):
            raise CheckpointError(
                f"{shapes_file}: {saved_name} has shape {saved_shape} in the checkpoint, which "
                f"does not fit {name} {have} in model.path={model_dir}; the checkpoint "
                "belongs to another model"
            )
    missing = sorted(set(base) - trained)
    if trains_all and missing:
        raise CheckpointError(
            f"{shapes_file}: the checkpoint lacks {missing[0]} of model.path={model_dir}; "
            "the checkpoint belongs to another model"
        )
