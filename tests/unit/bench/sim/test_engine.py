"""bench/sim/engine.py: a simulated vLLM engine takes, sample by sample, the time continuous
batching gives its decode steps (the roofline written out here from the datasheet), holds
what its KV cache holds, and loses no token to a preemption or an interrupt."""

from __future__ import annotations

import pytest

from rl.types import fresh_samples
from tests.unit.bench.bench_modules import bench_import

clock_module = bench_import("sim.clock")
costs = bench_import("sim.costs")
engine_module = bench_import("sim.engine")

PROMPT = 64
COST = costs.CostModel(costs.H100, costs.QWEN25_7B)


def per_step(batch: int) -> tuple[float, float]:
    """(a, b): a memory-bound decode step of `batch` samples over a context of c tokens
    takes a + b x c seconds (costs.py's docstring, from the H100 datasheet and Qwen2.5-7B's
    config: 7.62e9 bf16 parameters, 28 layers x 4 KV heads x 128 dims of bf16 keys+values)."""
    bandwidth = 3.35e12 * 0.8
    a = 0.001 + 4.5e-5 * batch + 2 * 7.62e9 / bandwidth
    b = 2 * 28 * 4 * 128 * 2 / bandwidth
    return a, b


def prefill_s(tokens: int) -> float:
    return (2 * 7.62e9 * tokens + 2 * 28 * 3584 * tokens * tokens) / (989e12 * 0.5)


def make_engine(lengths: dict[tuple[int, int], int], capacity: int = 10**9):
    clock = clock_module.SimClock()
    engine = engine_module.SimEngine(
        0, clock, COST, lambda s: lengths[(s.group_id, s.index)], capacity, tokens_per_id=1
    )
    return clock, engine


def samples(group_id: int, n: int):
    return fresh_samples([[1] * PROMPT], n, [group_id])


def run_until_polled(clock, engine) -> dict:
    future = engine.poll()
    clock.wait_first([future])
    return future.result()


def test_a_lone_sample_takes_its_prefill_then_a_step_per_token_over_its_growing_context() -> None:
    clock, engine = make_engine({(0, 0): 1000})
    engine.submit(0, samples(0, 1), stop_every=0)
    (batch,) = run_until_polled(clock, engine).values()
    a, b = per_step(1)
    # A step at context c costs a + b c; the context grows from the prompt by a token a step.
    expected = prefill_s(PROMPT) + 1000 * a + b * (1000 * PROMPT + 1000**2 / 2)
    assert clock.now() == pytest.approx(expected, rel=1e-9)
    assert len(batch[0].response_ids) == 1000 and batch[0].finish_reason == "stop"
    assert batch[0].token_versions == [0] * 1000


def test_samples_batched_together_share_steps_until_the_shorter_one_ends() -> None:
    clock, engine = make_engine({(0, 0): 100, (1, 0): 300})
    engine.submit(0, samples(0, 1), stop_every=0)
    engine.submit(1, samples(1, 1), stop_every=0)
    first = run_until_polled(clock, engine)
    a2, b = per_step(2)
    both = 2 * prefill_s(PROMPT) + 100 * a2 + b * (100 * 2 * PROMPT + 100**2)
    assert list(first) == [0] and clock.now() == pytest.approx(both, rel=1e-9)
    second = run_until_polled(clock, engine)
    a1, _ = per_step(1)
    alone = 200 * a1 + b * (200 * (PROMPT + 100) + 200**2 / 2)
    assert list(second) == [1] and clock.now() == pytest.approx(both + alone, rel=1e-9)


def test_a_sample_the_kv_cache_cannot_hold_beside_another_waits_for_it() -> None:
    clock, engine = make_engine({(0, 0): 100, (0, 1): 100}, capacity=2 * PROMPT + 1)
    engine.submit(0, samples(0, 2), stop_every=0)
    assert len(engine.running) == 1 and len(engine.queue) == 1
    run_until_polled(clock, engine)
    a, b = per_step(1)
    one = prefill_s(PROMPT) + 100 * a + b * (100 * PROMPT + 100**2 / 2)
    assert clock.now() == pytest.approx(2 * one, rel=1e-9)


def test_a_preempted_sample_is_prefilled_again_and_keeps_every_token() -> None:
    # Room for both prompts and 20 steps of both: then the later one is preempted.
    clock, engine = make_engine({(0, 0): 100, (0, 1): 100}, capacity=2 * PROMPT + 2 * 20)
    engine.submit(0, samples(0, 2), stop_every=0)
    (batch,) = run_until_polled(clock, engine).values()
    assert engine.stats.preemptions == 1
    assert engine.stats.reprefilled_ids == 20  # its tokens when preempted, prefilled again
    assert [len(s.response_ids) for s in batch] == [100, 100]
    assert [len(s.token_versions) for s in batch] == [100, 100]
    assert engine.stats.generated_ids == 200


def test_an_interrupt_hands_back_partial_samples_that_resume_under_the_next_version() -> None:
    clock, engine = make_engine({(0, 0): 500, (0, 1): 500})
    engine.submit(0, samples(0, 2), stop_every=0)
    a, b = per_step(2)
    after_prefill = 2 * prefill_s(PROMPT)
    # 200 steps in: contexts 2 x (PROMPT + x) as x goes from 0 to 200. (Within a stretch of
    # steps the engine runs at one rate, so where it stands mid-stretch is within a step or
    # two of the exact count.)
    clock.advance(after_prefill + 200 * a + b * (200 * 2 * PROMPT + 200**2))
    assert engine.interrupt() == 2
    (batch,) = run_until_polled(clock, engine).values()
    done = len(batch[0].response_ids)
    assert 198 <= done <= 202 and len(batch[1].response_ids) == done
    assert all(s.is_partial for s in batch)
    engine.version = 1
    engine.submit(0, batch, stop_every=0)
    (batch,) = run_until_polled(clock, engine).values()
    assert [s.token_versions for s in batch] == [[0] * done + [1] * (500 - done)] * 2
    assert engine.stats.reprefilled_ids == 2 * done


def test_an_abort_point_stops_a_sample_at_the_next_multiple_of_it() -> None:
    clock, engine = make_engine({(0, 0): 500})
    engine.submit(0, samples(0, 1), stop_every=128)
    (batch,) = run_until_polled(clock, engine).values()
    assert len(batch[0].response_ids) == 128 and batch[0].is_partial
    engine.submit(0, batch, stop_every=128)
    (batch,) = run_until_polled(clock, engine).values()
    assert len(batch[0].response_ids) == 256


def test_at_half_the_gpu_decoding_takes_twice_as_long() -> None:
    clock, engine = make_engine({(0, 0): 1000})
    engine.set_speed(0.5)
    engine.submit(0, samples(0, 1), stop_every=0)
    run_until_polled(clock, engine)
    a, b = per_step(1)
    expected = prefill_s(PROMPT) + 1000 * a + b * (1000 * PROMPT + 1000**2 / 2)
    assert clock.now() == pytest.approx(2 * expected, rel=1e-9)
