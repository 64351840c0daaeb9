"""Recipes: a YAML file plus `dotted.key=value` overrides, validated into one `Config`.

Every failure raises `ConfigError` naming the file, the key and how to fix it, before any
actor starts.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from rl.config import Config
from rl.config.checks import ConfigError, check_consistency
from rl.config.safetensors_files import checkpoint_tensors
from rl.config.tree import groups_in_flight, stream_groups


def load_config(recipe: str | Path, overrides: list[str] = ()) -> Config:
    """Read `recipe`, apply `overrides` in order, validate. Raises ConfigError."""
    path = Path(recipe)
    tree = _read_recipe(path, chain=())
    for override in overrides:
        key, value = _parse_override(override, path)
        _set_dotted(tree, key, value, path)
    try:
        config = Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe_validation_error(exc, path, overrides)) from None
    check_consistency(config, path)
    return config


def _read_recipe(path: Path, chain: tuple[Path, ...]) -> dict:
    """The recipe's tree, merged over the recipe it `extends` (a path relative to it), if any.

    One level of sharing keeps variants (dapo, rloo, ...) to the lines that differ.
    """
    if not path.is_file():
        where = f" (extended by {chain[-1]})" if chain else ""
        raise ConfigError(
            f"recipe file not found: {path}{where} (recipes live in recipes/, e.g. "
            "recipes/grpo_addition_cpu.yaml)"
        )
    if path.resolve() in chain:
        raise ConfigError(f"{path}: `extends` loops back to itself through {chain}")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(tree, dict):
        raise ConfigError(
            f"{path}: a recipe is a mapping of sections (model:, trainer:, ...), got {type(tree).__name__}"
        )
    parent = tree.pop("extends", None)
    _check_keys(tree, Config, path, prefix="")
    if parent is None:
        return tree
    base = _read_recipe(path.parent / str(parent), (*chain, path.resolve()))
    return _deep_merge(base, tree)


def _deep_merge(base: dict, update: dict) -> dict:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _parse_override(override: str, path: Path) -> tuple[str, Any]:
    if "=" not in override:
        raise ConfigError(
            f"override {override!r} is not key=value (e.g. trainer.lr=3e-6); recipe {path}"
        )
    key, raw = override.split("=", 1)
    # YAML scalars: numbers, booleans, null, lists such as [0.9,0.95]; anything else stays a string.
    return key.strip(), yaml.safe_load(raw) if raw.strip() else ""


def _set_dotted(tree: dict, key: str, value: Any, path: Path) -> None:
    parts = key.split(".")
    model: type[BaseModel] = Config
    node = tree
    for depth, part in enumerate(parts):
        fields = model.model_fields
        if part not in fields:
            where = ".".join(parts[:depth])
            raise ConfigError(
                _unknown_key_message(key, part, model, where, path, source=f"override {key}=")
            )
        annotation = fields[part].annotation
        is_section = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        if depth == len(parts) - 1:
            node[part] = value
        elif get_origin(annotation) is dict:
            # A free-form mapping (data.task_config): the rest of the key is its keys.
            for inner in parts[depth:-1]:
                if not isinstance(node.get(inner), dict):
                    node[inner] = {}
                node = node[inner]
            node[parts[-1]] = value
            return
        elif not is_section:
            raise ConfigError(
                f"override {key!r}: {'.'.join(parts[: depth + 1])} is a value, not a section; recipe {path}"
            )
        else:
            node = node.setdefault(part, {})
            model = annotation


def _check_keys(tree: dict, model: type[BaseModel], path: Path, prefix: str) -> None:
    for key, value in tree.items():
        if key not in model.model_fields:
            raise ConfigError(
                _unknown_key_message(prefix + str(key), str(key), model, prefix.rstrip("."), path)
            )
        annotation = model.model_fields[key].annotation
        if (
            isinstance(annotation, type)
            and issubclass(annotation, BaseModel)
            and isinstance(value, dict)
        ):
            _check_keys(value, annotation, path, prefix=f"{prefix}{key}.")


def _unknown_key_message(
    full_key: str, part: str, model: type[BaseModel], where: str, path: Path, source: str = ""
) -> str:
    valid = list(model.model_fields)
    close = difflib.get_close_matches(part, valid, n=3, cutoff=0.5)
    section = f"section '{where}'" if where else "the top level"
    hint = f"; did you mean {', '.join(repr(_join(where, c)) for c in close)}?" if close else ""
    origin = f" (from {source.rstrip('=')})" if source else ""
    return (
        f"{path}: unknown key '{full_key}'{origin}{hint} Valid keys in {section}: {', '.join(valid)}. "
        "`rl train --help-config` lists every key."
    )


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _describe_validation_error(exc: ValidationError, path: Path, overrides: list[str]) -> str:
    lines = [f"{path}: invalid configuration"]
    for error in exc.errors():
        key = ".".join(str(p) for p in error["loc"])
        source = next((o for o in overrides if o.split("=", 1)[0].strip() == key), None)
        origin = f" (from override {source})" if source else ""
        got = f"; got {error['input']!r}" if error["type"] != "missing" else ""
        lines.append(f"  {key}: {error['msg']}{got}{origin}")
    return "\n".join(lines)


def describe_config() -> str:
    """Every key with its type, default and description, for `rl train --help-config`."""
    lines: list[str] = []
    _describe_model(Config, "", lines)
    return "\n".join(lines)


def _describe_model(model: type[BaseModel], prefix: str, lines: list[str]) -> None:
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            lines.append(f"{prefix}{name}:")
            _describe_model(annotation, prefix + name + ".", lines)
            continue
        type_name = annotation.__name__ if isinstance(annotation, type) else str(annotation)
        type_name = type_name.replace("typing.", "")
        default = "(required)" if field.is_required() else repr(field.default)
        lines.append(f"  {prefix}{name}: {type_name} = {default}  # {field.description}")


def check_inputs(cfg: Config, path: Path | str) -> None:
    """The files a run reads exist and hold usable rows: the model checkpoint and any data
    files (every row with a prompt and an answer, unless data.bad_rows=skip)."""
    from rl.data.loading import check_data_files, load_examples, prompt_token_limit

    _check_model_path(cfg, path)
    check_teacher(cfg, path)
    try:
        check_data_files(cfg.data)
        prompt_token_limit(cfg)
        if cfg.data.train_files:
            for split in ("train", "test"):
                load_examples(cfg.data, split)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _check_model_path(cfg: Config, path: Path | str) -> None:
    """model.path must be an HF checkpoint directory, unless the recipe builds its own base."""
    model_dir = Path(cfg.model.path)
    if not model_dir.exists():
        if cfg.base.build_if_missing:
            if cfg.base.architecture == "qwen2":
                _check_dense(
                    cfg, path, "the base this recipe builds is dense (base.architecture=qwen2)"
                )
            return
        raise ConfigError(
            f"{path}: model.path={cfg.model.path!r} does not exist. Point it at a local Hugging Face "
            f"checkpoint directory, or build the tiny base with `rl build-base {path}` "
            "(or set base.build_if_missing=true)."
        )
    if not (model_dir / "config.json").is_file():
        raise ConfigError(
            f"{path}: model.path={cfg.model.path!r} has no config.json; it must be a Hugging Face "
            "causal-LM directory (config.json, *.safetensors, tokenizer files)"
        )
    _check_tokenizer(model_dir, f"{path}: model.path={cfg.model.path!r}")
    if not _num_experts(model_dir):
        _check_dense(
            cfg,
            path,
            f"the config.json of model.path={cfg.model.path!r} names no experts (num_experts or "
            "num_local_experts)",
        )
    elif cfg.model.lora.enabled and cfg.rollout.engine == "vllm":
        raise ConfigError(
            f"{path}: model.lora on a mixture of experts ({cfg.model.path!r}) is served by "
            "rollout.engine=torch only: vLLM's LoRA on MoE layers needs its mixed MoE LoRA "
            "format, which the weight receiver does not feed, and vLLM on CPU runs those layers "
            "with Triton kernels it lacks"
        )
    try:
        shapes = checkpoint_tensor_shapes(model_dir)
    except ValueError as exc:
        raise ConfigError(f"{path}: model.path: {exc}") from None
    if not shapes:
        raise ConfigError(
            f"{path}: model.path={cfg.model.path!r} has no *.safetensors files: the trainer "
            "reads its weights from safetensors only (save the model with "
            "save_pretrained(..., safe_serialization=True))"
        )
    if cfg.model.frozen:
        try:
            cfg.model.frozen_names(list(shapes))
        except ValueError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    if cfg.model.lora.enabled:
        linear = _linear_modules(shapes)
        missing = [m for m in cfg.model.lora.target_modules if m not in linear]
        if missing:
            raise ConfigError(
                f"{path}: model.lora.target_modules: {', '.join(map(repr, missing))} is not a "
                f"linear module of {cfg.model.path}; its layers' linear modules are "
                f"{', '.join(sorted(linear))}"
            )


def _check_dense(cfg: Config, path: Path | str, why: str) -> None:
    """ConfigError for a mixture-of-experts setting on a dense model (`why` says how we know
    it is dense)."""
    algo = cfg.algorithm
    for key, on in (
        ("model.routing_replay", cfg.model.routing_replay),
        ("algorithm.router_balance_coef", algo.router_balance_coef > 0),
        ("algorithm.router_z_coef", algo.router_z_coef > 0),
    ):
        if on:
            raise ConfigError(
                f"{path}: {key} is for a mixture of experts' routers, but {why}: unset it, or "
                "train a mixture of experts (base.architecture qwen3_moe or qwen2_moe)"
            )


def _num_experts(model_dir: Path) -> int:
    """The experts a layer of `model_dir`'s model has by its config.json (0: dense, or a
    config that cannot be read, which loading reports)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    if not isinstance(config, dict):
        return 0
    experts = config.get("num_experts", config.get("num_local_experts", 0))
    return experts if isinstance(experts, int) else 0


def check_teacher(cfg: Config, path: Path | str) -> None:
    """teacher.path, when set, is an HF checkpoint directory whose tokenizer is model.path's:
    the teacher scores the student's token ids, which must mean the same tokens to both. A
    model.path the run has yet to build (base.build_if_missing) is compared once built (the
    driver calls this again). ConfigError naming teacher.path and what differs."""
    if not cfg.teacher.enabled:
        return
    teacher_dir, student_dir = Path(cfg.teacher.path), Path(cfg.model.path)
    where = f"{path}: teacher.path={cfg.teacher.path!r}"
    if not (teacher_dir / "config.json").is_file():
        raise ConfigError(
            f"{where} is not a Hugging Face causal-LM directory (no config.json): point it at "
            "a local checkpoint (config, *.safetensors, tokenizer files)"
        )
    _check_tokenizer(teacher_dir, where)
    try:
        shapes = checkpoint_tensor_shapes(teacher_dir)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if not shapes:
        raise ConfigError(f"{where} has no *.safetensors files: the teacher loads from them only")
    if not (student_dir / "config.json").is_file():
        return
    difference = tokenizer_difference(student_dir, teacher_dir)
    if difference:
        raise ConfigError(
            f"{where} does not share the tokenizer of model.path={cfg.model.path!r} "
            f"({difference}): "
            "the teacher scores the student's token ids, so both must read them as the same "
            "tokens; use a teacher of the student's family, with its tokenizer files"
        )


def tokenizer_difference(student_dir: Path, teacher_dir: Path) -> str:
    """What makes `teacher_dir`'s tokenizer read token ids otherwise than `student_dir`'s, or
    render a prompt otherwise (the vocabulary, special tokens, chat template), or ids past the
    teacher's embedding rows; "" when nothing does."""
    from transformers import AutoConfig, AutoTokenizer

    student = AutoTokenizer.from_pretrained(student_dir)
    teacher = AutoTokenizer.from_pretrained(teacher_dir)
    student_vocab, teacher_vocab = student.get_vocab(), teacher.get_vocab()
    if student_vocab != teacher_vocab:
        differing = sorted(
            set(student_vocab.items()) ^ set(teacher_vocab.items()), key=lambda item: item[1]
        )
        token, index = differing[0]
        return (
            f"vocabularies of {len(student_vocab)} and {len(teacher_vocab)} tokens differ, "
            f"first at id {index} ({token!r})"
        )
    for name in ("eos_token", "pad_token", "bos_token", "unk_token"):
        if getattr(student, name) != getattr(teacher, name):
            return f"{name} {getattr(student, name)!r} against {getattr(teacher, name)!r}"
    if student.chat_template != teacher.chat_template:
        return "chat templates differ"
    rows = AutoConfig.from_pretrained(teacher_dir).vocab_size
    if rows < len(student):
        return f"the teacher's {rows} embedding rows cannot score ids up to {len(student) - 1}"
    return ""


# The files a Hugging Face tokenizer is made from: any one of these sets.
_TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))


def _check_tokenizer(model_dir: Path, where: str) -> None:
    """The model directory's tokenizer loads (no remote code) and can pad a batch
    (`rl.data.prompts.padding_id`)."""
    from transformers import AutoTokenizer

    from rl.data.prompts import padding_id

    needs = "tokenizer files (tokenizer.json, or tokenizer.model, or vocab.json and merges.txt)"
    # transformers builds an empty tokenizer of the config's type when the files are missing.
    if not any(all((model_dir / f).is_file() for f in files) for files in _TOKENIZER_FILES):
        raise ConfigError(f"{where} has no tokenizer: the directory needs its {needs}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{where}: its tokenizer does not load ({first_line})") from None
    try:
        padding_id(tokenizer)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def checkpoint_tensor_shapes(model_dir: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, as an HF checkpoint's safetensors files record them (their JSON
    headers only: no tensor is read)."""
    return {name: list(t.shape) for name, t in checkpoint_tensors(model_dir).items()}


def _linear_modules(shapes: dict[str, list[int]]) -> set[str]:
    """The last names of the decoder layers' linear modules (2-D weights), as peft's
    `target_modules` match them: q_proj, ..., down_proj for Qwen2."""
    return {
        name.split(".")[-2]
        for name, shape in shapes.items()
        if ".layers." in name and name.endswith(".weight") and len(shape) == 2
    }


def dry_run_report(cfg: Config, path: Path | str, device_memory_gb: float | None = None) -> str:
    """What `rl train --dry-run` prints: the resolved config, the placement, missing inputs,
    and the memory each rank needs (`rl.cluster.memory_plan`; PlanDoesNotFit when the devices told
    or seen cannot hold it).

    Missing inputs are reported, not fatal: GPU recipes name checkpoints and data that live
    on the cluster, and CI dry-runs every recipe on this machine.
    """
    from rl.cluster.memory_plan import memory_report
    from rl.cluster.placement import plan_placement
    from rl.sandbox import SandboxRefused, configure
    from rl.sandbox_report import isolation_report

    try:
        check_inputs(cfg, path)
        inputs = "inputs (model.path, data files): ok"
    except ConfigError as exc:
        inputs = f"inputs NOT READY HERE: {exc}"
    configure(cfg.sandbox)
    try:
        sandbox = isolation_report(cfg)
    except SandboxRefused as exc:  # reported, not fatal: the cluster's kernel may allow it
        sandbox = f"sandbox REFUSED HERE: {exc}"
    return "\n".join(
        [
            f"{path}: config ok",
            cfg.model_dump_json(indent=2),
            plan_placement(cfg).describe(),
            _describe_overlap(cfg),
            _describe_agent(cfg),
            sandbox,
            inputs,
            memory_report(cfg, device_memory_gb),
            "dry run: nothing started",
        ]
    )


def _describe_agent(cfg: Config) -> str:
    """The agent set-up: environment, tools and their sandbox, the episode's limits."""
    agent = cfg.agent
    if not agent.enabled:
        return "agent: off (single-turn prompt -> response)"
    from rl.agents.agent_pool import agent_function
    from rl.agents.environment import ENVIRONMENTS

    if agent_function(agent.environment) is not None:
        return (
            f"agent: the function {agent.environment}, calling the rollout "
            f"workers' OpenAI-compatible endpoint from {agent.env_workers} sandboxed workers per "
            f"rollout worker ({agent.env_memory_mb} MiB, {agent.env_timeout_s:g} s of its own "
            f"time per episode; {agent.tool_call_format} calls become tool_calls); at most "
            f"{agent.max_turns} turns and {cfg.rollout.max_new_tokens} tokens after the prompt "
            "per episode"
        )
    if agent.environment in ENVIRONMENTS:
        tools = ", ".join([*ENVIRONMENTS.get(agent.environment).tools, *agent.tools]) or "none"
        environment = agent.environment
    else:  # a user's: its tools are read when its sandboxed workers start
        tools = ", ".join(["the environment's", *agent.tools])
        environment = (
            f"{agent.environment} in {agent.env_workers} sandboxed workers per process "
            f"({agent.env_timeout_s:g} s per call, {agent.env_memory_mb} MiB)"
        )
    return (
        f"agent: environment {environment}, tools {tools} "
        f"({agent.tool_call_format} calls) in {agent.tool_workers} sandboxed workers per rollout "
        f"worker (per call: {agent.tool_timeout_s:g} s wall clock, {agent.tool_cpu_s:g} s CPU, "
        f"{agent.tool_memory_mb} MiB); at most "
        f"{agent.max_turns} turns and {cfg.rollout.max_new_tokens} tokens after the prompt per "
        f"episode, tool results cut at {agent.max_tool_output_tokens} tokens"
    )


def _describe_overlap(cfg: Config) -> str:
    """The scheduler's staleness bound and how stale samples are corrected."""
    k = cfg.scheduler.max_staleness
    correction = cfg.algorithm.off_policy
    from rl.algorithms.off_policy import OFF_POLICY_CORRECTIONS, proximal_from_forward

    if not OFF_POLICY_CORRECTIONS.traits(correction).needs_proximal:
        how = "PPO ratio and clip against each token's behaviour log-prob"
    elif proximal_from_forward(cfg):
        how = f"{correction} against proximal log-probs taken from the training forward"
    else:
        how = f"{correction} against proximal log-probs recomputed by a trainer pass"
    sched = cfg.scheduler
    partial = sched.partial_rollout
    if sched.partial_rollout in ("abort", "carry"):
        percentile = "median" if sched.partial_rollout == "carry" else "95th percentile"
        partial += (
            f" at the {percentile} of the last synced step's response lengths"
            if sched.abort_every == "auto"
            else f" every {sched.abort_every} tokens"
        )
    if sched.partial_rollout == "carry":
        live = groups_in_flight(sched.groups_in_flight, cfg.run.prompts_per_step)
        partial += (
            f", each step the first of {live} "
            f"groups in flight to finish; tokens at most {sched.max_token_age} versions old, "
            f"at most {sched.max_stale_share:g} of them over {k}"
        )
    streaming = ""
    if sched.streaming:
        size = stream_groups(sched.stream_groups, cfg.trainer, cfg.algorithm.group_size)
        streaming = (
            f"; the trainer streams each step in chunks of {size} groups as they finish, "
            "gradients summed exactly"
        )
    return (
        f"scheduler: max_staleness={k} ({'on-policy' if k == 0 else 'overlapped'}), "
        f"partial_rollout={partial}{streaming}; off-policy correction: {how}"
    )
