"""Many concurrent generate calls served by one engine, stepped by one asyncio task.

The driver streams work in small calls (a group of samples each) so that finished groups come
back while the long tail is still generating. Every engine call happens on the event loop's
thread, between steps, so a weight update or an abort never interleaves with a step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial

from rl.types import Sample, SamplingParams
from rollout.engines.contract import RolloutEngine

PASSES_BETWEEN_STEPS = 4


class _Call:
    """Samples started together; `done` resolves with them once none of them is running."""

    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples
        self.num_running = len(samples)
        self.done: asyncio.Future[list[Sample]] = asyncio.get_running_loop().create_future()


class FinishedBatches:
    """Batches started under keys, handed back by `poll` as they finish: the polling side of
    GenerationLoop and of rollout.agent_loop.AgentLoop."""

    def __init__(self) -> None:
        self._finished: dict[int, list[Sample]] = {}  # key -> samples, until polled
        self._has_finished = asyncio.Event()
        self._failure: BaseException | None = None

    def add(self, key: int, samples: list[Sample]) -> None:
        assert key not in self._finished, f"batch {key} finished twice before a poll"
        self._finished[key] = samples
        self._has_finished.set()

    def fail(self, exc: BaseException) -> None:
        """Nothing else would report `exc` (batches start without waiting): the next poll
        raises it."""
        self._failure = exc
        self._has_finished.set()

    def settle(self, key: int, done: asyncio.Future[list[Sample]]) -> None:
        """A done-callback: the batch's samples, or the failure that ended it."""
        if done.exception() is not None:
            self.fail(done.exception())
        else:
            self.add(key, done.result())

    async def poll(self) -> dict[int, list[Sample]]:
        """{key: samples} of every batch finished since the last poll, once there is at
        least one: batches that finish together come back in one message, the long tail's
        one by one."""
        while not self._finished:
            if self._failure is not None:
                failure, self._failure = self._failure, None
                raise failure
            self._has_finished.clear()
            await self._has_finished.wait()
        finished, self._finished = self._finished, {}
        return finished


class GenerationLoop:
    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self._owner: dict[int, _Call] = {}  # id(sample) -> the call it belongs to
        self._batches = FinishedBatches()
        self._stepper: asyncio.Task | None = None
        # Awaited between steps when set: a caller whose work arrives call by call (agent
        # functions through the endpoint) holds the next step until more of it is in.
        self.gather: Callable[[], Awaitable[None]] | None = None

    def start(self, batches: dict[int, list[Sample]], params: SamplingParams) -> None:
        """Start every batch of samples (fresh or partial) at once; `poll` hands each back
        under its key. Many batches in one call fill the engine's first step; added one by
        one as calls trickle in, they cost extra half-empty steps."""
        try:
            calls = self._start(list(batches.values()), params)
        except Exception as exc:
            # The driver starts batches without waiting (its poll waits instead), so nothing
            # would ever report this: the engine's state is unknown, everything in flight
            # fails with it, and the waiting poll raises it.
            self._fail(exc)
            self._batches.fail(exc)
            return
        for key, call in zip(batches, calls, strict=True):
            call.done.add_done_callback(partial(self._batches.settle, key))

    async def poll(self) -> dict[int, list[Sample]]:
        """{key: samples} of every batch finished (or aborted) since the last poll (see
        FinishedBatches.poll)."""
        return await self._batches.poll()

    async def generate(self, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        """Generate `samples` alongside everything else in flight, outside the polled batches;
        returns them in order once each has finished or stopped partial (`stop_every`, or an
        `interrupt`)."""
        return await self._start([samples], params)[0].done

    def interrupt(self) -> int:
        """Abort every running sample; their batches come back partial. Returns how many."""
        aborted = self.engine.abort()
        self._settle(aborted)
        return len(aborted)

    def _start(self, batches: list[list[Sample]], params: SamplingParams) -> list[_Call]:
        self.engine.start([sample for samples in batches for sample in samples], params)
        calls = [_Call(samples) for samples in batches]
        for call in calls:
            for sample in call.samples:
                self._owner[id(sample)] = call
            if not call.samples:
                call.done.set_result([])
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.get_running_loop().create_task(self._run())
        return calls

    async def _run(self) -> None:
        try:
            while self.engine.num_running:
                self._settle(self.engine.step())
                # Let other calls in between steps: new work, interrupts, weight updates.
                # Several passes of the event loop: a request handled in stages (an HTTP call
                # read, parsed, dispatched) gets through them between two steps, not one a step.
                for _ in range(PASSES_BETWEEN_STEPS):
                    await asyncio.sleep(0)
                if self.gather is not None:
                    await self.gather()
        except Exception as exc:  # handed to every waiting caller, who raise it
            self._fail(exc)

    def _settle(self, samples: list[Sample]) -> None:
        for sample in samples:
            call = self._owner.pop(id(sample))
            call.num_running -= 1
            if not call.num_running:
                call.done.set_result(call.samples)

    def _fail(self, exc: Exception) -> None:
        """An engine step failed: every waiting caller raises it rather than hanging."""
        for call in {id(call): call for call in self._owner.values()}.values():
            call.done.set_exception(exc)
        self._owner.clear()
        self.engine.abort()  # drop what the failed step left running: those calls are over
