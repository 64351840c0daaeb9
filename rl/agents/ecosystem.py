"""Environments from the ecosystem, on the driver's side: `agent.environment: verifiers:<env>`
(prime-rl's `verifiers` package) names one, and `data.task: verifiers:<env>` its tasks as the
run's data (rl.data.tasks.verifiers_env).

`<env>` is an installed environment's id (a package named after it, as verifiers installs
them) or the path of a local environment package, `path/to/<id>` (a folder, or `<id>.py`),
whose parent folder goes onto the sandbox's PYTHONPATH. Nothing here imports the environment
or the package: their code runs only in sandboxed workers, the agent workers
(rl.agents.verifiers_agent.run, an agent function) and a row worker that brings the
environment's tasks back as JSON (`load_rows`).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from rl.sandbox import STARTUP_TIMEOUT_S, clean_env, start_worker, stop_workers

VERIFIERS_PREFIX = "verifiers:"
VERIFIERS_FIELD = "verifiers"  # an example's field: its environment and task, as JSON
VERIFIERS_INSTALL = "pip install -e .[verifiers]"
AGENT_MODULE = "rl.agents.verifiers_agent"
ROW_WORKER_MEMORY_MB = 4096
ROWS_TIMEOUT_S = 300.0  # loading a taskset may read a dataset
MAX_ROWS_BYTES = 1 << 30


@dataclass(frozen=True)
class VerifiersEnv:
    """A `verifiers:<env>` name: the environment's id and, for a local one, its folder."""

    name: str  # as written, `verifiers:<env>`
    env_id: str
    local_root: str | None = None  # the folder that holds the local package, absolute

    @property
    def python_path(self) -> list[str]:
        return [] if self.local_root is None else [self.local_root]


def env_id_of(name: str) -> str:
    """The environment id in `verifiers:<env>` (a local one's folder or file name), read
    without looking at the filesystem (a sandbox's working directory is not the driver's)."""
    spec = name.removeprefix(VERIFIERS_PREFIX).strip().rstrip("/" + os.sep)
    return Path(spec).stem if "/" in spec or os.sep in spec else spec


def verifiers_env(name: str, key: str = "agent.environment") -> VerifiersEnv | None:
    """The environment `name` (`verifiers:<env>`) names; None for a name of another kind;
    ValueError naming `key` when it cannot be one, or the package is not installed."""
    if not name.startswith(VERIFIERS_PREFIX):
        return None
    spec = name[len(VERIFIERS_PREFIX) :].strip()
    if not spec:
        raise ValueError(f"{key}={name!r}: name the environment, 'verifiers:<env id>'")
    if importlib.util.find_spec("verifiers") is None:  # locates it; runs none of its code
        raise ValueError(f"{key}={name!r} needs the verifiers package: {VERIFIERS_INSTALL}")
    if "/" not in spec and os.sep not in spec:
        return VerifiersEnv(name, spec)
    path = Path(spec)
    if not (path.is_dir() and (path / "__init__.py").is_file()) and not (
        path.suffix == ".py" and path.is_file()
    ):
        raise ValueError(
            f"{key}={name!r}: {spec!r} is not a local environment (a package folder with an "
            "__init__.py, or a .py file)"
        )
    return VerifiersEnv(name, path.stem, str(path.resolve().parent))


def example_fields(env: VerifiersEnv, config: dict, task: dict) -> dict:
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
    env: VerifiersEnv, config: dict, count: int, seed: int, key: str = "data.task"
) -> list[dict]:
    """Up to `count` of `env`'s tasks (shuffled with `seed` when its taskset is finite) as
    examples, made in a sandboxed worker; ValueError naming `key` when the environment cannot
    make them. Prompts that read alike are told apart (`distinct_prompts`)."""
    worker = start_worker(
        AGENT_MODULE,
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


def distinct_prompts(env: VerifiersEnv, examples: list[dict]) -> list[dict]:
    """`examples` with each prompt that is blank or not unique among them (a game whose
    opening message is always the same) told apart by its position: the data pipeline keys
    examples by prompt, and the agent function reads the task, not the prompt."""
    seen = Counter(example["prompt"] for example in examples)
    for index, example in enumerate(examples):
        if not example["prompt"].strip() or seen[example["prompt"]] > 1:
            example["prompt"] = f"{example['prompt']}\n[{env.env_id} task {index}]".strip()
    return examples


def check_pairing(environment: str, task: str, has_files: bool) -> None:
    """A verifiers environment's episodes need its tasks' examples and its tasks need its
    episodes (only its rubric scores them): ValueError naming the key to set otherwise."""
    env = verifiers_env(environment) if environment else None
    if task.startswith(VERIFIERS_PREFIX) and (env is None or env.name != task):
        raise ValueError(
            f"data.task={task!r}: a verifiers environment's tasks are scored by its rubric in "
            f"its episodes; set agent.environment={task!r}"
        )
    if env is not None and not has_files and task != env.name:
        raise ValueError(
            f"agent.environment={environment!r} runs episodes of the environment's own tasks: "
            f"set data.task={environment!r} (or give data.train_files rows with a "
            f"{VERIFIERS_FIELD!r} field)"
        )
