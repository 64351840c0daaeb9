"""`rl export CHECKPOINT --to DIR [--merge]`: a checkpoint's policy as a Hugging Face model
directory, or a LoRA run's adapters in PEFT's format.

A checkpoint holds the policy's trained tensors (DCP shards), the run's config, and a copy of
every file of the base model (`model.path`) but its weights: HF config, generation config,
tokenizer, chat template. So a full fine-tune's checkpoint exports on its own, after the base
has moved or on another machine: the export builds the model from those files, loads the
trained tensors into it through the restricted DCP reader, and writes it with the same atomic
save the trainer's own export uses, in fp32 (the trainer's master weights), so both exports
hold the same bytes.

A LoRA run's checkpoint holds only its adapters. They export on their own, in PEFT's format
(with the tokenizer), for `PeftModel.from_pretrained(base, DIR)` or a vLLM `LoRARequest`;
`--merge` writes the base with them merged in instead (and the adapters under DIR/adapter),
which needs the base: model.path, checked to be the weights the run trained from. A run with
`model.frozen` likewise reads its frozen tensors from model.path.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from rl.checkpoint.base_weights import check_base, is_weight_file
from rl.checkpoint.resume import DRIVER_STATE
from rl.checkpoint.store import CheckpointError, verify
from rl.config import Config

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

# torch and transformers are imported where used: a checkpoint that fails its checks is
# reported in a second, not after the seconds those imports take.

POLICY_DIR = "policy"
SHAPES = "shapes.json"
MODEL_FILES_DIR = "model_files"  # the base model's files but its weights


def copy_model_files(model_dir: Path, dest: Path) -> None:
    """Copy the top-level files of HF model `model_dir` to `dest`, weights (and their
    index files) left out."""
    dest.mkdir()
    for file in sorted(model_dir.iterdir()):
        # Weights, which the policy shards replace; every other file of the base is small.
        if file.is_file() and not is_weight_file(file.name):
            shutil.copy2(file, dest / file.name)


def export_checkpoint(checkpoint: Path, out_dir: Path, merge: bool = False) -> Path:
    """Write the policy of `checkpoint` (a step_NNNNNN directory) to `out_dir` (replaced
    atomically): an HF model, or for a LoRA run its adapters (`merge`: the merged model);
    CheckpointError naming the file at fault otherwise."""
    verify(checkpoint)  # before anything heavy: a damaged file is named, nothing is written
    cfg = _run_config(checkpoint / DRIVER_STATE)
    lora = cfg.model.lora.enabled
    if merge and not lora:
        raise CheckpointError(
            f"--merge merges a LoRA run's adapters into its base; {checkpoint} is a checkpoint "
            "of a full fine-tune: export it without --merge"
        )
    policy = checkpoint / POLICY_DIR
    saved = _saved_shapes(policy)
    _check_out_dir(out_dir, checkpoint, Path(cfg.model.path))
    from trainer.hf_model import save_hf_atomic, save_lora_hf_atomic

    if lora and not merge:
        return _export_adapters(cfg, policy, saved, checkpoint / MODEL_FILES_DIR, out_dir)
    trains_all = not (lora or cfg.model.frozen)
    frozen_from = None if trains_all else Path(cfg.model.path)
    model, tokenizer = _model_from_files(checkpoint, frozen_from)
    if lora:
        from trainer.fsdp import with_lora

        model = with_lora(model, cfg.model.lora, seed=0)
    _load_policy(model, policy, saved, trains_all)
    if lora:
        return save_lora_hf_atomic(model, tokenizer, out_dir)
    return save_hf_atomic(model, tokenizer, out_dir)


def export_model(checkpoint: Path, out_dir: Path) -> Path:
    """The policy of `checkpoint` as an HF model directory whatever its run trained (a LoRA
    run's: merged), for what loads a model (`rl eval`, `rl generate`)."""
    merge = _run_config(checkpoint / DRIVER_STATE).model.lora.enabled
    return export_checkpoint(checkpoint, out_dir, merge=merge)


def _export_adapters(
    cfg: Config, policy: Path, saved: dict[str, list[int]], files: Path, out_dir: Path
) -> Path:
    """A LoRA checkpoint's adapters in PEFT's format with the base's tokenizer, without the
    base: peft keys them over its model built on meta from the config in `files`."""
    import torch

    from trainer.hf_model import adapter_file_tensors, write_adapter, write_dir_atomic

    tensors = {name: torch.empty(shape, dtype=torch.float32) for name, shape in saved.items()}
    try:  # the same tensors, keyed by peft from the base's config (in files)
        adapter = adapter_file_tensors(files, cfg.model.lora, tensors)
    except ValueError as e:
        raise CheckpointError(f"{policy / SHAPES}: {e}; the checkpoint is damaged") from None
    _read_shards({"model": tensors}, policy)
    config = cfg.model.lora.peft_config()
    config.base_model_name_or_path = str(Path(cfg.model.path).resolve())
    _, tokenizer = _config_and_tokenizer(files)

    def write(directory: Path) -> None:
        write_adapter(directory, adapter, config)
        tokenizer.save_pretrained(directory)

    return write_dir_atomic(out_dir, write)


def _run_config(driver_file: Path) -> Config:
    """The run's config as the driver recorded it in `driver_file`."""
    if not driver_file.is_file():
        raise CheckpointError(
            f"{driver_file} is missing: the checkpoint does not record its run's config; "
            "export a checkpoint written by `rl train`"
        )
    try:
        return Config.model_validate(json.loads(driver_file.read_text())["config"])
    except (json.JSONDecodeError, KeyError, TypeError, ValidationError) as e:
        raise CheckpointError(
            f"{driver_file} holds no valid run config ({type(e).__name__}: {e}); export a "
            "checkpoint written by this version of `rl train`"
        ) from e


def _saved_shapes(policy: Path) -> dict[str, list[int]]:
    """Tensor name -> full shape of the policy in `policy` (the DCP directory)."""
    shapes_file = policy / SHAPES
    for needed in (policy / ".metadata", shapes_file):
        if not needed.is_file():
            raise CheckpointError(
                f"{needed} is missing: {policy.parent} holds no trainer checkpoint of the "
                "policy; export a checkpoint written by `rl train`"
            )
    try:
        shapes = json.loads(shapes_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{shapes_file} is unreadable ({e}); the checkpoint is damaged"
        ) from e
    if not isinstance(shapes, dict) or not shapes:
        raise CheckpointError(f"{shapes_file} lists no tensors; the checkpoint is damaged")
    return shapes


def _check_out_dir(out_dir: Path, checkpoint: Path, base: Path) -> None:
    """Refuse destinations whose atomic replacement would destroy something else: the
    checkpoint, the base model every checkpoint of the run needs, or a directory that is
    not an HF model (a typo such as `--to .` would otherwise replace the working tree)."""
    target = out_dir.resolve()
    for precious, what in (
        (checkpoint.resolve(), "the checkpoint"),
        (base.resolve(), "model.path"),
    ):
        if target == precious or precious.is_relative_to(target) or target.is_relative_to(precious):
            raise CheckpointError(
                f"--to {out_dir} would overwrite {what} ({precious}); export to a new directory"
            )
    exported = any((out_dir / name).is_file() for name in ("config.json", "adapter_config.json"))
    if out_dir.is_dir() and any(out_dir.iterdir()) and not exported:
        raise CheckpointError(
            f"--to {out_dir} is a non-empty directory that is not an HF model or adapter (no "
            "config.json or adapter_config.json) and would be replaced; give a new directory "
            "or an earlier export"
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"--to {out_dir} is a file; give a directory")


def _config_and_tokenizer(files: Path) -> tuple[PretrainedConfig, PreTrainedTokenizerBase]:
    """The HF config and tokenizer of the base's files in `files`."""
    if not (files / "config.json").is_file():
        raise CheckpointError(
            f"{files / 'config.json'} is missing: the checkpoint holds no copy of the base "
            "model's config and tokenizer; export a checkpoint written by this version of "
            "`rl train`"
        )
    from transformers import AutoConfig, AutoTokenizer

    try:
        return AutoConfig.from_pretrained(files), AutoTokenizer.from_pretrained(files)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{files} holds no usable HF config and tokenizer ({e})") from e


def _model_from_files(
    checkpoint: Path, frozen_from: Path | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model the base's files in `checkpoint` describe, in fp32 (as the trainer loads
    it), with its generation config, and its tokenizer. Its weights are the checkpoint's,
    loaded next; those its run kept frozen come from `frozen_from` (model.path; None: the run
    trained them all), once checked to be the base the run trained from."""
    files = checkpoint / MODEL_FILES_DIR
    config, tokenizer = _config_and_tokenizer(files)
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if frozen_from is None:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        if not frozen_from.is_dir():
            raise CheckpointError(
                f"{checkpoint} holds only the tensors its run trained (LoRA adapters or all "
                f"but model.frozen); the rest is the base, model.path={frozen_from}, which is "
                "not here: put the base back there (or export a LoRA run's adapters without "
                "--merge)"
            )
        check_base(checkpoint, frozen_from)
        model = AutoModelForCausalLM.from_pretrained(
            frozen_from, config=config, dtype=torch.float32
        )
    if (files / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(files)
    return model, tokenizer


def _check_shapes(
    saved: dict[str, list[int]],
    target: dict[str, torch.Tensor],
    shapes_file: Path,
    base: Path,
    trains_all: bool,
) -> None:
    """Every checkpoint tensor fits the base model, and (`trains_all`: a run that trained the
    whole model) every base tensor is in the checkpoint or tied to one that is (a tied lm_head
    may be stored once)."""
    for name, shape in saved.items():
        if name not in target:
            raise CheckpointError(
                f"{shapes_file}: {name} is not a tensor of the model in {base}; the "
                "checkpoint belongs to another model"
            )
        if list(target[name].shape) != shape:
            raise CheckpointError(
                f"{shapes_file}: {name} has shape {shape} in the checkpoint but "
                f"{list(target[name].shape)} in the model in {base}; the checkpoint belongs "
                "to another model"
            )
    if not trains_all:
        return
    stored = {target[name].data_ptr() for name in saved}
    for name, tensor in target.items():
        if name not in saved and tensor.data_ptr() not in stored:
            raise CheckpointError(
                f"{shapes_file}: the checkpoint lacks {name} of the model in {base}; the "
                "checkpoint belongs to another model"
            )


def _read_shards(state: dict, policy: Path) -> None:
    """Fill `state` (DCP's nested dict of tensors) from the policy shards in `policy`."""
    from torch.distributed.checkpoint.api import CheckpointException

    from trainer.checkpoint import load_shards

    with warnings.catch_warnings():
        # One process reading every shard is the intent, which DCP warns about.
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load")
        try:
            load_shards(state, policy, no_dist=True)
        # CheckpointException (a read failing) derives from BaseException, not Exception.
        except (ValueError, RuntimeError, CheckpointException) as e:
            raise CheckpointError(f"{policy} could not be read as a policy checkpoint: {e}") from e


def _load_policy(
    model: PreTrainedModel, policy: Path, saved: dict[str, list[int]], trains_all: bool
) -> None:
    """Overwrite `model`'s tensors in place with the checkpoint's (`trains_all`: it must hold
    them all)."""
    target = model.state_dict()  # views of the parameters: DCP copies into them
    _check_shapes(saved, target, policy / SHAPES, policy.parent / MODEL_FILES_DIR, trains_all)
    state = {"model": {name: target[name] for name in saved}}
    _read_shards(state, policy)
    # DCP fills plain tensors in place; loading them back also covers one it replaced.
    model.load_state_dict(state["model"], strict=False)
