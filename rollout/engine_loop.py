"""Many concurrent generate calls served by one engine, stepped by one asyncio task.

The driver streams work in small calls (a group of samples each) so that finished groups come
back while the long tail is still generating. Every engine call happens on the event loop's
thread, between steps, so a weight update or an abort never interleaves with a step.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Protocol

from rl.types import Sample, SamplingParams


class SteppedEngine(Protocol):
    """What the loop needs of an engine (`rollout.vllm_engine.VLLMEngine` in production)."""

    @property
    def num_running(self) -> int: ...

    def start(self, samples: list[Sample], params: SamplingParams) -> None: ...

    def step(self) -> list[Sample]: ...

    def abort(self) -> list[Sample]: ...


class _Call:
    """Samples started together: `done` resolves with them once none of them is running."""

    def __init__(self, samples: list[Sample], done: asyncio.Future[list[Sample]]) -> None:
        self.samples = samples
        self.num_running = len(samples)
        self.done = done


class GenerationLoop:
    def __init__(self, engine: SteppedEngine) -> None:
        self.engine = engine
        self._owner: dict[int, _Call] = {}  # id(sample) -> the call it belongs to
        # key -> the result of the batch started under it, until collected. Ray may run an
        # async actor's `collect` before the `start` sent ahead of it: whichever comes first
        # creates the future.
        self._results: dict[int, asyncio.Future[list[Sample]]] = {}
        self._keys = itertools.count(-1, -1)  # private keys, never a caller's (>= 0)
        self._stepper: asyncio.Task | None = None

    def start(self, batches: dict[int, list[Sample]], params: SamplingParams) -> None:
        """Start every batch of samples (fresh or partial) at once, under one key each for
        `collect`. Many batches in one call fill the engine's first step; added one by one
        as calls trickle in, they cost extra half-empty steps (measured: 0.1-0.2 s a step)."""
        try:
            self.engine.start([s for samples in batches.values() for s in samples], params)
        except Exception as exc:  # the collects waiting for these keys raise it too
            for key in batches:
                self._result(key).set_exception(exc)
            raise
        for key, samples in batches.items():
            call = _Call(samples, self._result(key))
            assert not call.done.done(), f"batch {key} was already started"
            for sample in samples:
                self._owner[id(sample)] = call
            if not samples:
                call.done.set_result([])
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.get_running_loop().create_task(self._run())

    async def collect(self, key: int) -> list[Sample]:
        """The samples started under `key`, once each has finished or been aborted."""
        try:
            return await self._result(key)
        finally:
            del self._results[key]

    def _result(self, key: int) -> asyncio.Future[list[Sample]]:
        if key not in self._results:
            self._results[key] = asyncio.get_running_loop().create_future()
        return self._results[key]

    async def generate(self, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        """Generate `samples` alongside everything else in flight; returns them in order once
        each has finished or been aborted by `interrupt`."""
        key = next(self._keys)
        self.start({key: samples}, params)
        return await self.collect(key)

    def interrupt(self) -> int:
        """Abort every running sample; their calls return them partial. Returns how many."""
        aborted = self.engine.abort()
        self._settle(aborted)
        return len(aborted)

    async def _run(self) -> None:
        try:
            while self.engine.num_running:
                self._settle(self.engine.step())
                # Let other calls in between steps: new work, interrupts, weight updates.
                await asyncio.sleep(0)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _settle(self, samples: list[Sample]) -> None:
        for sample in samples:
            call = self._owner.pop(id(sample))
            call.num_running -= 1
            if not call.num_running:
                call.done.set_result(call.samples)

    def _fail(self, exc: BaseException) -> None:
        """An engine step failed: every waiting call raises it rather than hanging."""
        for call in set(self._owner.values()):
            if not call.done.done():
                call.done.set_exception(exc)
        self._owner.clear()
