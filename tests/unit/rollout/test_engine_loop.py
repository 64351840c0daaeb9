"""GenerationLoop: many batches served by one stepped engine, handed back as they finish."""

from __future__ import annotations

import asyncio

import pytest

from rl.types import Sample, SamplingParams
from rollout.engine_loop import GenerationLoop

PARAMS = SamplingParams(max_new_tokens=8)


class FakeEngine:
    """Sample k of group g wants g + 1 tokens; each step adds one token to every sample."""

    def __init__(self, fail_at_step: int | None = None) -> None:
        self.running: list[Sample] = []
        self.num_steps = 0
        self.fail_at_step = fail_at_step

    @property
    def num_running(self) -> int:
        return len(self.running)

    def start(self, samples: list[Sample], params: SamplingParams) -> None:
        for sample in samples:
            sample.finish_reason = ""
        self.running += samples

    def step(self) -> list[Sample]:
        self.num_steps += 1
        if self.num_steps == self.fail_at_step:
            raise RuntimeError("engine step failed")
        for sample in self.running:
            sample.response_ids.append(self.num_steps)
            sample.token_versions.append(0)
        done = [s for s in self.running if len(s.response_ids) > s.group_id]
        for sample in done:
            sample.finish_reason = "stop"
        self.running = [s for s in self.running if s not in done]
        return done

    def abort(self) -> list[Sample]:
        aborted, self.running = self.running, []
        for sample in aborted:
            sample.finish_reason = "abort"
        return aborted


def _batch(group_id: int, n: int = 2) -> list[Sample]:
    return [Sample([1], group_id=group_id, index=k) for k in range(n)]


def test_batches_that_finish_together_come_back_in_one_poll() -> None:
    async def run() -> list[dict]:
        loop = GenerationLoop(FakeEngine())
        loop.start({10: _batch(0), 11: _batch(0), 12: _batch(2)}, PARAMS)
        return [await loop.poll(), await loop.poll()]

    first, second = asyncio.run(run())
    assert sorted(first) == [10, 11] and list(second) == [12]
    assert [len(s.response_ids) for s in second[12]] == [3, 3]


def test_an_interrupt_hands_back_partial_samples_with_their_tokens() -> None:
    async def run() -> dict:
        engine = FakeEngine()
        loop = GenerationLoop(engine)
        loop.start({7: _batch(5)}, PARAMS)
        while engine.num_steps < 2:
            await asyncio.sleep(0)
        assert loop.interrupt() == 2
        return await loop.poll()

    samples = asyncio.run(run())[7]
    assert all(s.is_partial and s.response_ids == [1, 2] for s in samples)


def test_generate_waits_for_its_own_samples_beside_polled_batches() -> None:
    async def run() -> tuple[list[Sample], dict]:
        loop = GenerationLoop(FakeEngine())
        loop.start({1: _batch(3)}, PARAMS)
        mine = await loop.generate(_batch(0, n=3), PARAMS)
        return mine, await loop.poll()

    mine, polled = asyncio.run(run())
    assert [len(s.response_ids) for s in mine] == [1, 1, 1]
    assert list(polled) == [1]


def test_a_failed_engine_step_reaches_every_waiting_caller() -> None:
    async def run() -> None:
        loop = GenerationLoop(FakeEngine(fail_at_step=1))
        waiting = asyncio.ensure_future(loop.generate(_batch(3), PARAMS))
        await asyncio.sleep(0)  # started before the failing step
        loop.start({1: _batch(3)}, PARAMS)
        with pytest.raises(RuntimeError, match="engine step failed"):
            await loop.poll()
        with pytest.raises(RuntimeError, match="engine step failed"):
            await waiting
        # The loop serves new work after a failure.
        assert len(await loop.generate(_batch(0), PARAMS)) == 2

    asyncio.run(run())


class _RefusingEngine(FakeEngine):
    def start(self, samples: list[Sample], params: SamplingParams) -> None:
        raise ValueError("prompt too long")


def test_a_start_that_fails_reaches_the_waiting_poll_instead_of_hanging_it() -> None:
    async def run() -> None:
        loop = GenerationLoop(_RefusingEngine())
        polled = asyncio.ensure_future(loop.poll())  # the driver's outstanding poll
        await asyncio.sleep(0)
        loop.start({1: _batch(0)}, PARAMS)  # fire and forget, as the driver calls it
        with pytest.raises(ValueError, match="prompt too long"):
            await asyncio.wait_for(polled, timeout=5)

    asyncio.run(run())


def test_work_arriving_while_the_gather_hook_holds_joins_the_next_step() -> None:
    """A sample started during the hook's wait after step 1 is in step 2, not a step later."""

    async def run() -> list[int]:
        engine = FakeEngine()
        loop = GenerationLoop(engine)
        late = _batch(0, n=1)
        held = []

        async def gather() -> None:
            held.append(engine.num_steps)
            if engine.num_steps == 1:
                loop.start({2: late}, PARAMS)  # arrives while the next step waits
                await asyncio.sleep(0.01)

        loop.gather = gather
        loop.start({1: _batch(3, n=1)}, PARAMS)
        await loop.poll()
        await loop.poll()
        return held + [late[0].response_ids]

    *held, late_ids = asyncio.run(run())
    assert held[:2] == [1, 2]  # the hook ran between every two steps
    assert late_ids == [2]  # the late sample's one token came from step 2
