"""Agent functions (`agent.environment: openai:path/to/file.py:function`, or an ecosystem's
`verifiers:<env>` / `openenv:<env>`, whose episodes its built-in agent function runs,
rl.agents.ecosystem) in sandboxed worker processes (rl.agents.agent_worker), for one rollout
worker's event loop.

`AgentPool.run(example, key, seed)` runs one episode's agent and returns its `Outcome`; many
run at once, spread over `agent.env_workers` workers (each forks a process per episode).
Cancelling the coroutine stops the episode's process. A worker that dies fails the episodes
it was running (outcome "crash") and is replaced.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from itertools import count

from rl.agents.ecosystem import ecosystem_env
from rl.config import AgentConfig
from rl.sandbox import STARTUP_TIMEOUT_S, WorkerProcess, clean_env, start_worker, stop_workers
from rl.user_code import parse_file_ref

API_PREFIX = "openai:"
MAX_MESSAGE_BYTES = 1 << 20


def agent_function(environment: str) -> tuple[str, str] | None:
    """(path, function) of `openai:path/to/file.py:function`, or of the built-in agent function
    that runs an ecosystem environment's episodes (`verifiers:<env>`, `openenv:<env>`); None
    for another environment."""
    env = ecosystem_env(environment)
    if env is not None:
        return env.source.agent_file, "run"
    if not environment.startswith(API_PREFIX):
        return None
    ref = environment[len(API_PREFIX) :]
    parsed = parse_file_ref(ref, f"agent.environment {environment!r}")
    if parsed is None:
        raise ValueError(
            f"agent.environment {environment!r}: name the agent function as "
            "'openai:path/to/file.py:function'"
        )
    return parsed


@dataclass(eq=False)
class _Worker:
    process: WorkerProcess
    running: dict[int, asyncio.Future[Outcome]]  # its episodes, by request id


@dataclass(frozen=True)
class Outcome:
    """How an episode's agent ended: "returned" (`value`: its reward, its answer or None),
    "error" (it raised: `message`), "crash" (its process died)."""

    kind: str
    value: float | str | None = None
    message: str = ""


class AgentPool:
    """Workers running `cfg.environment`'s agent function against the endpoint at `socket`."""

    def __init__(
        self, cfg: AgentConfig, socket: str, model: str, log_file: str | None = None
    ) -> None:
        parsed = agent_function(cfg.environment)
        assert parsed is not None, f"not an agent function: {cfg.environment!r}"
        path, name = parsed
        self._settings = {
            "ref": f"{os.path.abspath(path)}:{name}",
            "socket": socket,
            "model": model,
            "environment": cfg.environment,
        }
        # A local ecosystem environment's package is imported from its folder.
        env = ecosystem_env(cfg.environment)
        python_path = [] if env is None else env.python_path
        self._read = [os.path.abspath(path), os.path.dirname(socket), *python_path]
        self._cfg, self._log_file = cfg, log_file
        self._env = clean_env((), python_path)
        self._ids = count()
        self._workers: list[_Worker] = []
        try:
            for _ in range(cfg.env_workers):
                self._add(self._start())
        except BaseException:
            self.close()
            raise

    async def run(self, example: dict, key: str, seed: int | None) -> Outcome:
        worker = min(self._workers, key=lambda w: len(w.running))
        rid = next(self._ids)
        done = asyncio.get_running_loop().create_future()
        worker.running[rid] = done
        request = {"op": "run", "id": rid, "example": example, "key": key, "seed": seed}
        try:
            worker.process.conn.send_bytes(json.dumps(request).encode())
            return await done
        except asyncio.CancelledError:
            if worker.running.pop(rid, None) is not None and worker in self._workers:
                worker.process.conn.send_bytes(json.dumps({"op": "stop", "id": rid}).encode())
            raise

    def close(self) -> None:
        """Stop the workers and every episode they run."""
        loop = asyncio.get_running_loop()
        workers, self._workers = self._workers, []
        for worker in workers:
            loop.remove_reader(worker.process.conn.fileno())
            for done in worker.running.values():
                if not done.done():
                    done.set_result(Outcome("crash", message="the agent pool closed"))
        stop_workers([w.process for w in workers], grace_s=0.5)

    def _start(self) -> WorkerProcess:
        worker = start_worker(
            "rl.agents.agent_worker",
            self._env,
            self._cfg.env_memory_mb,
            self._log_file,
            self._read,
            loopback=True,
        )
        try:
            worker.conn.send_bytes(json.dumps(self._settings).encode())
            if not worker.conn.poll(STARTUP_TIMEOUT_S):
                raise RuntimeError(f"its worker did not start within {STARTUP_TIMEOUT_S:g} s")
            ready = json.loads(worker.conn.recv_bytes(MAX_MESSAGE_BYTES))
            if "failed" in ready:
                raise ValueError(
                    f"agent.environment {self._cfg.environment!r} cannot be loaded: {ready['failed']}"
                )
        except BaseException:
            worker.kill()
            raise
        return worker

    def _add(self, process: WorkerProcess) -> None:
        worker = _Worker(process, {})
        self._workers.append(worker)
        asyncio.get_running_loop().add_reader(process.conn.fileno(), self._receive, worker)

    def _receive(self, worker: _Worker) -> None:
        try:
            reply = json.loads(worker.process.conn.recv_bytes(MAX_MESSAGE_BYTES))
        except (EOFError, OSError, ValueError):
            self._lost(worker)
            return
        done = worker.running.pop(reply.get("id"), None)
        if done is None or done.done():
            return  # a stopped episode's
        if "result" in reply:
            done.set_result(Outcome("returned", value=reply["result"]))
        elif "error" in reply:
            done.set_result(Outcome("error", message=str(reply["error"])))
        else:
            done.set_result(Outcome("crash", message=str(reply.get("crash"))))

    def _lost(self, worker: _Worker) -> None:
        """`worker` died: its episodes crashed; a new worker takes its place."""
        asyncio.get_running_loop().remove_reader(worker.process.conn.fileno())
        self._workers.remove(worker)
        for done in worker.running.values():
            if not done.done():
                done.set_result(Outcome("crash", message="its agent worker died"))
        worker.process.kill()
        self._add(self._start())
