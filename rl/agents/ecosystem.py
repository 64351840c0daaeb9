"""Environments from the ecosystem, on the driver's side: `agent.environment: <source>:<env>`
names one and `data.task: <source>:<env>` its tasks as the run's data, for each `Source` in
`SOURCES`: prime-rl's `verifiers` (rl.agents.verifiers_agent, rl.data.tasks.verifiers_env) and
Meta's OpenEnv (rl.agents.openenv_agent, rl.data.tasks.openenv_env).

`<env>` is an installed environment's package name or the path of a local environment package,
`path/to/<id>` (a folder; for verifiers also `<id>.py`), whose parent folder goes onto the
sandbox's PYTHONPATH. Nothing here imports the environment or its source's package: their code
runs only in sandboxed workers, the agent workers (each source's built-in agent function) and,
for verifiers, a row worker that brings the environment's tasks back as JSON (`load_rows`).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from rl.sandbox import STARTUP_TIMEOUT_S, clean_env, start_worker, stop_workers

AGENTS_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Source:
    """An ecosystem whose environments Tandem runs as episodes, named `<prefix><env>`."""

    prefix: str  # "verifiers:"
    package: str  # the module its environments need installed
    install: str  # how to install it
    agent_module: str  # the built-in agent function's module: its `run` plays an episode
    field: str  # an example's field: what its episode needs, as JSON
    file_env: bool  # whether a local environment may be a single `<id>.py`

    @property
    def agent_file(self) -> str:
        return os.path.join(AGENTS_DIR, self.agent_module.rsplit(".", 1)[1] + ".py")


VERIFIERS = Source(
    "verifiers:",
    "verifiers",
    "pip install -e .[verifiers]",
    "rl.agents.verifiers_agent",
    "verifiers",
    file_env=True,
)
OPENENV = Source(
    "openenv:",
    "openenv",
    "pip install -e .[openenv]",
    "rl.agents.openenv_agent",
    "openenv",
    file_env=False,
)
SOURCES = (VERIFIERS, OPENENV)
VERIFIERS_PREFIX = VERIFIERS.prefix
VERIFIERS_FIELD = VERIFIERS.field
ROW_WORKER_MEMORY_MB = 4096
ROWS_TIMEOUT_S = 300.0  # loading a taskset may read a dataset
MAX_ROWS_BYTES = 1 << 30


@dataclass(frozen=True)
class EcosystemEnv:
    """A `<source>:<env>` name: its source, the environment's id and, for a local one, its
    folder."""

    source: Source
    name: str  # as written, `<source>:<env>`
    env_id: str
    local_root: str | None = None  # the folder that holds the local package, absolute

    @property
    def python_path(self) -> list[str]:
        return [] if self.local_root is None else [self.local_root]


def source_of(name: str) -> Source | None:
    """The source whose prefix `name` carries; None for a name of another kind."""
    return next((s for s in SOURCES if name.startswith(s.prefix)), None)


def env_id_of(name: str) -> str:
    """The environment id in `<source>:<env>` (a local one's folder or file name), read
    without looking at the filesystem (a sandbox's working directory is not the driver's)."""
    source = source_of(name)
    assert source is not None, f"not an ecosystem environment: {name!r}"
    spec = name.removeprefix(source.prefix).strip().rstrip("/" + os.sep)
    return Path(spec).stem if "/" in spec or os.sep in spec else spec


def ecosystem_env(name: str, key: str = "agent.environment") -> EcosystemEnv | None:
    """The environment `name` (`<source>:<env>`) names; None for a name of another kind;
    ValueError naming `key` when it cannot be one, or its source's package is not
    installed."""
    source = source_of(name)
    if source is None:
        return None
    spec = name[len(source.prefix) :].strip()
    if not spec:
        raise ValueError(f"{key}={name!r}: name the environment, '{source.prefix}<env>'")
    if importlib.util.find_spec(source.package) is None:  # locates it; runs none of its code
        raise ValueError(f"{key}={name!r} needs the {source.package} package: {source.install}")
    if "/" not in spec and os.sep not in spec:
        return EcosystemEnv(source, name, spec)
    path = Path(spec)
    folder = path.is_dir() and (path / "__init__.py").is_file()
    if not folder and not (source.file_env and path.suffix == ".py" and path.is_file()):
        kinds = "a package folder with an __init__.py" + (
            ", or a .py file" if source.file_env else ""
        )
        raise ValueError(f"{key}={name!r}: {spec!r} is not a local environment ({kinds})")
    return EcosystemEnv(source, name, path.stem, str(path.resolve().parent))


def example_fields(env: EcosystemEnv, config: dict, task: dict) -> dict:
    """An example of `env`'s `task` (its wire data): the prompt's text (unique among a split's
    prompts once `load_rows` has made it so), the task's `answer` when it has one, and what
    the agent function needs to run it."""
    prompt = task.get("prompt")
    if isinstance(prompt, list):  # messages
        prompt = "\n\n".join(str(m.get("content") or "") for m in prompt if isinstance(m, dict))
    answer = task.get("answer")
    spec = {"env": env.env_id, "config": config, "task": task}
    return {
        "prompt": prompt or "",
        "answer": "" if answer is None else str(answer),
        VERIFIERS_FIELD: json.dumps(spec, sort_keys=True),
    }


def load_rows(
    env: EcosystemEnv, config: dict, count: int, seed: int, key: str = "data.task"
) -> list[dict]:
    """Up to `count` of `env`'s tasks (shuffled with `seed` when its taskset is finite) as
    examples, made in a sandboxed worker; ValueError naming `key` when the environment cannot
    make them. Prompts that read alike are told apart (`distinct_prompts`)."""
    worker = start_worker(
        VERIFIERS.agent_module,
        clean_env((), env.python_path),
        ROW_WORKER_MEMORY_MB,
        None,
        env.python_path,
    )
    try:
        request = {"env": env.env_id, "config": config, "count": count, "seed": seed}
        worker.conn.send_bytes(json.dumps(request).encode())
        if not worker.conn.poll(STARTUP_TIMEOUT_S + ROWS_TIMEOUT_S):
            raise ValueError(f"{key}={env.name!r}: its tasks were not made in time")
        try:
            reply = json.loads(worker.conn.recv_bytes(MAX_ROWS_BYTES))
        except (EOFError, OSError) as e:
            raise ValueError(f"{key}={env.name!r}: its row worker died ({e})") from None
    finally:
        stop_workers([worker], grace_s=1.0)
    if "failed" in reply:
        raise ValueError(f"{key}={env.name!r}: its tasks cannot be loaded: {reply['failed']}")
    return distinct_prompts(env, [example_fields(env, config, task) for task in reply["rows"]])


def distinct_prompts(env: EcosystemEnv, examples: list[dict]) -> list[dict]:
    """`examples` with each prompt that is blank or not unique among them (a game whose
    opening message is always the same) told apart by its position: the data pipeline keys
    examples by prompt, and the agent function reads the task, not the prompt."""
    seen = Counter(example["prompt"] for example in examples)
    for index, example in enumerate(examples):
        if not example["prompt"].strip() or seen[example["prompt"]] > 1:
            example["prompt"] = f"{example['prompt']}\n[{env.env_id} task {index}]".strip()
    return examples


def check_pairing(environment: str, task: str, has_files: bool) -> None:
    """An ecosystem environment's episodes need its tasks' examples and its tasks need its
    episodes (only the environment scores them): ValueError naming the key to set
    otherwise."""
    env = ecosystem_env(environment) if environment else None
    task_source = source_of(task)
    if task_source is not None and (env is None or env.name != task):
        raise ValueError(
            f"data.task={task!r}: a {task_source.package} environment's tasks are scored in its "
            f"episodes; set agent.environment={task!r}"
        )
    if env is not None and not has_files and task != env.name:
        raise ValueError(
            f"agent.environment={environment!r} runs episodes of the environment's own tasks: "
            f"set data.task={environment!r} (or give data.train_files rows with a "
            f"{env.source.field!r} field)"
        )
