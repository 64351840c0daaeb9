"""The run timeline: span nesting, Chrome trace export, busy/overlap fractions, the renderer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rl.observe.trace import Span, Trace, load_chrome, load_lanes, summarise
from tests.helpers.repo import REPO


class FakeClock:
    """A clock the test sets by hand: `clock.now = 4.0`."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _trace(lanes: dict[str, list[int]] | None = None) -> tuple[Trace, FakeClock]:
    clock = FakeClock()
    return Trace(lanes or {"rollout-0": [0], "trainer": [0, 1], "driver": []}, clock), clock


def _record(trace: Trace, clock: FakeClock, lane: str, phase: str, start: float, end: float):
    clock.now = start
    trace.begin(lane, phase)
    clock.now = end
    trace.end(lane, phase)


def test_nested_begins_on_one_lane_and_phase_make_one_span_from_first_begin_to_last_end() -> None:
    trace, clock = _trace()
    trace.begin("rollout-0", "generate", step=3)
    clock.now = 1.0
    trace.begin("rollout-0", "generate", step=4)
    clock.now = 2.0
    trace.end("rollout-0", "generate")
    assert trace.spans == []
    clock.now = 5.0
    trace.end("rollout-0", "generate")
    assert trace.spans == [Span("rollout-0", "generate", 0.0, 5.0, step=3)]


def test_different_phases_on_one_lane_are_separate_spans_in_closing_order() -> None:
    trace, clock = _trace()
    trace.begin("trainer", "logprobs")
    with trace.span("trainer", "train", step=1):
        clock.now = 2.0
    clock.now = 3.0
    trace.end("trainer", "logprobs")
    assert [(s.phase, s.start, s.end, s.step) for s in trace.spans] == [
        ("train", 0.0, 2.0, 1),
        ("logprobs", 0.0, 3.0, None),
    ]


def test_span_context_closes_the_span_when_the_block_raises() -> None:
    trace, _ = _trace()
    with pytest.raises(RuntimeError), trace.span("driver", "checkpoint"):
        raise RuntimeError("disk full")
    assert [s.phase for s in trace.spans] == ["checkpoint"]


def test_phase_listener_hears_each_change_of_the_open_phases_in_phase_order() -> None:
    heard: list[list[str]] = []
    trace = Trace({"rollout-0": [0], "trainer": [0]}, FakeClock(), on_phases=heard.append)
    trace.begin("trainer", "train")
    trace.begin("rollout-0", "generate")
    trace.begin("rollout-0", "generate")  # a second request in flight: no change
    trace.end("rollout-0", "generate")
    trace.end("rollout-0", "generate")
    trace.end("trainer", "train")
    assert heard == [["train"], ["generate", "train"], ["train"], []]


def test_end_without_begin_is_an_invariant_violation() -> None:
    trace, _ = _trace()
    with pytest.raises(AssertionError, match="without a matching begin"):
        trace.end("trainer", "train")


def test_unknown_lane_raises_naming_the_valid_lanes() -> None:
    trace, _ = _trace()
    with pytest.raises(ValueError, match="rollout-0, trainer, driver"):
        trace.begin("rollout-7", "generate")


def test_unknown_phase_raises_naming_the_valid_phases() -> None:
    trace, _ = _trace()
    with pytest.raises(ValueError, match="generate, tool, reward, logprobs, train"):
        trace.end("trainer", "backward")


def test_a_span_measured_elsewhere_in_wall_clock_joins_in_closing_order(monkeypatch) -> None:
    trace, clock = _trace()
    trace.begin("rollout-0", "generate")
    clock.now = 10.0
    trace.end("rollout-0", "generate")  # closes at 10 on the trace's clock
    # Another process measured a span at wall-clock 1000..1004; wall clock reads 1010 now,
    # when the trace's reads 10: the span is 0..4 on the trace's clock, closing first.
    monkeypatch.setattr("rl.observe.trace.time.time", lambda: 1010.0)
    trace.add_wall("driver", "tool", 1000.0, 1004.0, step=2)
    assert [(s.phase, s.start, s.end, s.step) for s in trace.spans] == [
        ("tool", 0.0, 4.0, 2),
        ("generate", 0.0, 10.0, None),
    ]
    assert trace.summary(0.0, 10.0)["perf/busy_s_tool"] == 4.0


def test_busy_fraction_is_the_mean_over_devices_of_the_union_of_their_lanes_spans() -> None:
    # Device 0: A 0-5 and B 4-8 overlap, so busy 8 s not 9; device 1: B only, 4 s.
    trace, clock = _trace({"a": [0], "b": [0, 1]})
    _record(trace, clock, "a", "generate", 0.0, 5.0)
    _record(trace, clock, "b", "train", 4.0, 8.0)
    assert trace.summary(0.0, 10.0)["perf/busy_fraction"] == pytest.approx((8 / 10 + 4 / 10) / 2)


def test_lanes_without_devices_count_for_nothing_in_busy_fraction() -> None:
    trace, clock = _trace()
    _record(trace, clock, "driver", "reward", 0.0, 10.0)
    _record(trace, clock, "trainer", "train", 0.0, 5.0)
    # Devices 0 and 1 (the trainer's) half busy; the driver's reward adds nothing.
    assert trace.summary(0.0, 10.0)["perf/busy_fraction"] == pytest.approx(0.5)


def test_overlap_fraction_is_the_time_generate_and_a_trainer_phase_are_both_active() -> None:
    trace, clock = _trace()
    _record(trace, clock, "rollout-0", "generate", 0.0, 6.0)
    _record(trace, clock, "trainer", "train", 4.0, 10.0)
    assert trace.summary(0.0, 10.0)["perf/overlap_fraction"] == pytest.approx(0.2)


def test_overlap_counts_logprobs_as_training_but_not_sync() -> None:
    trace, clock = _trace()
    _record(trace, clock, "rollout-0", "generate", 0.0, 10.0)
    _record(trace, clock, "trainer", "logprobs", 0.0, 3.0)
    _record(trace, clock, "trainer", "sync", 3.0, 10.0)
    assert trace.summary(0.0, 10.0)["perf/overlap_fraction"] == pytest.approx(0.3)


def test_per_phase_busy_seconds_are_unions_across_lanes_clipped_to_the_window() -> None:
    trace, clock = _trace({"rollout-0": [0], "rollout-1": [1]})
    _record(trace, clock, "rollout-0", "generate", 0.0, 6.0)
    _record(trace, clock, "rollout-1", "generate", 4.0, 12.0)
    stats = trace.summary(2.0, 10.0)
    assert stats["perf/busy_s_generate"] == pytest.approx(8.0)
    assert "perf/busy_s_train" not in stats


def test_open_spans_count_up_to_the_clock() -> None:
    trace, clock = _trace()
    clock.now = 2.0
    trace.begin("trainer", "train")
    clock.now = 6.0
    assert trace.summary(0.0, 10.0)["perf/busy_s_train"] == pytest.approx(4.0)
    assert trace.to_chrome()["traceEvents"][-1]["dur"] == pytest.approx(4e6)


def test_an_empty_window_is_a_user_error() -> None:
    trace, _ = _trace()
    with pytest.raises(ValueError, match="empty window"):
        trace.summary(5.0, 5.0)


def test_summarise_without_devices_reports_no_busy_fraction() -> None:
    stats = summarise([Span("trainer", "train", 0.0, 1.0)], {}, 0.0, 2.0)
    assert "perf/busy_fraction" not in stats
    assert stats["perf/busy_s_train"] == pytest.approx(1.0)


def test_chrome_trace_names_lanes_and_times_spans_in_microseconds_since_creation() -> None:
    clock = FakeClock(100.0)
    trace = Trace({"rollout-0": [0], "trainer": [1]}, clock)
    _record(trace, clock, "trainer", "train", 101.0, 101.5)
    chrome = trace.to_chrome()
    assert chrome["displayTimeUnit"] == "ms"
    names, (event,) = chrome["traceEvents"][:2], chrome["traceEvents"][2:]
    assert [(e["ph"], e["tid"], e["args"]["name"]) for e in names] == [
        ("M", 0, "rollout-0"),
        ("M", 1, "trainer"),
    ]
    assert event == {
        "name": "train",
        "ph": "X",
        "ts": pytest.approx(1e6),
        "dur": pytest.approx(0.5e6),
        "pid": 0,
        "tid": 1,
        "args": {"step": None},
    }


def test_write_then_load_chrome_round_trips_lanes_phases_and_times(tmp_path: Path) -> None:
    clock = FakeClock(1000.0)
    trace = Trace({"rollout-0": [0], "reward": [], "trainer": [0, 1]}, clock)
    clock.now = 1000.123456
    trace.begin("rollout-0", "generate", step=2)
    clock.now = 1001.5
    trace.end("rollout-0", "generate")
    _record(trace, clock, "trainer", "train", 1001.0, 1003.25)
    trace.write(tmp_path / "trace.json")
    loaded = load_chrome(tmp_path / "trace.json")
    assert load_lanes(tmp_path / "trace.json") == ["rollout-0", "reward", "trainer"]
    assert [(s.lane, s.phase, s.step) for s in loaded] == [
        ("rollout-0", "generate", 2),
        ("trainer", "train", None),
    ]
    for got, want in zip(loaded, trace.spans, strict=True):
        assert got.start == pytest.approx(want.start - 1000.0, abs=1e-6)
        assert got.end == pytest.approx(want.end - 1000.0, abs=1e-6)


def test_write_replaces_the_file_and_leaves_no_temp_file(tmp_path: Path) -> None:
    trace, clock = _trace()
    path = tmp_path / "trace.json"
    path.write_text("old")
    _record(trace, clock, "trainer", "train", 0.0, 1.0)
    trace.write(path)
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]
    assert len(load_chrome(path)) == 1


def _renderer():
    spec = importlib.util.spec_from_file_location("render_trace", REPO / "bench/render_trace.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_renderer_writes_a_png_of_a_cropped_window(tmp_path: Path) -> None:
    trace, clock = _trace()
    _record(trace, clock, "rollout-0", "generate", 0.0, 6.0)
    _record(trace, clock, "trainer", "train", 4.0, 10.0)
    _record(trace, clock, "driver", "reward", 6.0, 7.0)
    trace.write(tmp_path / "trace.json")
    out = tmp_path / "trace.png"
    _renderer().main([str(tmp_path / "trace.json"), str(out), "--from", "2", "--to", "8"])
    assert out.read_bytes().startswith(b"\x89PNG")


def test_renderer_rejects_an_empty_window(tmp_path: Path) -> None:
    trace, _ = _trace()
    trace.write(tmp_path / "trace.json")
    with pytest.raises(SystemExit):
        _renderer().main([str(tmp_path / "trace.json"), str(tmp_path / "trace.png")])


def test_a_window_summary_reads_only_the_spans_that_reach_into_it(monkeypatch) -> None:
    """Every step asks for its own window: spans of earlier steps are not walked again, and
    the result is the same as over all spans."""
    trace, clock = _trace()
    for step in range(1000):
        _record(trace, clock, "trainer", "train", 2.0 * step, 2.0 * step + 1.0)
    _record(trace, clock, "rollout-0", "generate", 1995.0, 2003.0)
    expected = summarise(trace.spans, trace.lanes, 1998.5, 2003.0)
    seen = []
    monkeypatch.setattr(
        "rl.observe.trace.summarise",
        lambda spans, *args: seen.append(list(spans)) or summarise(spans, *args),
    )
    assert trace.summary(1998.5, 2003.0) == expected
    assert [(s.phase, s.start) for s in seen[0]] == [("train", 1998.0), ("generate", 1995.0)]
