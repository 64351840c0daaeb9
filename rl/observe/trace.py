"""A run's timeline of work, per lane: spans of phases, Chrome trace export, utilisation.

A lane is a worker or a group of workers the driver talks to as one ("rollout-0", "trainer",
"reward", "driver"). Each lane occupies some devices (bundle indices of the device pool); busy
fraction is measured over those devices. Times are seconds on one clock (time.perf_counter
unless a test passes another). Not thread-safe: the driver records from one thread.

The trace file (`Trace.write`) is Chrome trace-event JSON: open it in https://ui.perfetto.dev
or chrome://tracing, or draw it with bench/render_trace.py.
"""

from __future__ import annotations

import bisect
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

PHASES = ("generate", "tool", "reward", "logprobs", "train", "sync", "eval", "checkpoint")
# What counts as "training" for the overlap fraction (generation running under training).
TRAINER_PHASES = ("logprobs", "train")

Interval = tuple[float, float]


@dataclass
class Span:
    """One phase of work on one lane: [start, end] in seconds on the trace's clock."""

    lane: str
    phase: str
    start: float
    end: float
    step: int | None = None


@dataclass
class _Open:
    count: int
    start: float
    step: int | None


class Trace:
    """Records spans per lane; `lanes` maps lane name -> device indices it occupies.

    A lane may occupy no devices (the driver, rewards computed on the driver host): its spans
    show in the timeline but count for nothing in busy fraction.
    """

    def __init__(
        self,
        lanes: dict[str, list[int]],
        clock: Callable[[], float] = time.perf_counter,
        on_phases: Callable[[list[str]], None] | None = None,
    ) -> None:
        """`on_phases` hears the phases open on any lane (in PHASES order) whenever that
        set changes: the console shows what the run is doing now."""
        self.lanes = {name: list(devices) for name, devices in lanes.items()}
        self.spans: list[Span] = []  # closed spans, in closing order
        self._clock = clock
        self._origin = clock()
        self._open: dict[tuple[str, str], _Open] = {}
        self._on_phases = on_phases
        self._open_phases: list[str] = []

    def begin(self, lane: str, phase: str, step: int | None = None) -> None:
        """Open (lane, phase), or count one more begin if it is already open.

        The driver keeps many generation requests in flight on one rollout worker: that is one
        "generate" span from the first request's begin to the last request's end, labelled
        with the first begin's step.
        """
        self._check(lane, phase)
        key = (lane, phase)
        if key in self._open:
            self._open[key].count += 1
        else:
            self._open[key] = _Open(count=1, start=self._clock(), step=step)
            self._phases_changed()

    def end(self, lane: str, phase: str) -> None:
        """Count one end of (lane, phase); the span closes when every begin has ended."""
        self._check(lane, phase)
        key = (lane, phase)
        assert key in self._open, f"end({lane!r}, {phase!r}) without a matching begin"
        opened = self._open[key]
        opened.count -= 1
        if opened.count == 0:
            del self._open[key]
            self.spans.append(Span(lane, phase, opened.start, self._clock(), opened.step))
            self._phases_changed()

    def _phases_changed(self) -> None:
        if self._on_phases is None:
            return
        phases = [phase for phase in PHASES if any(p == phase for _, p in self._open)]
        if phases != self._open_phases:
            self._on_phases(phases)
            self._open_phases = phases

    def add_wall(
        self, lane: str, phase: str, start: float, end: float, step: int | None = None
    ) -> None:
        """Add a span another process measured, in wall-clock seconds (time.time()), such as
        an agent's tool call in a rollout worker. Spans stay in closing order."""
        self._check(lane, phase)
        offset = self._clock() - time.time()
        span = Span(lane, phase, start + offset, end + offset, step)
        bisect.insort(self.spans, span, key=lambda s: s.end)

    @contextmanager
    def span(self, lane: str, phase: str, step: int | None = None) -> Iterator[None]:
        """begin/end around a block (the span closes even if the block raises)."""
        self.begin(lane, phase, step)
        try:
            yield
        finally:
            self.end(lane, phase)

    def to_chrome(self) -> dict:
        """Chrome trace-event JSON: one complete ("X") event per span, one name per lane.

        ts/dur are microseconds since the trace's creation; tid is the lane's index in `lanes`.
        Spans still open are included up to now.
        """
        tids = {lane: i for i, lane in enumerate(self.lanes)}
        names = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": lane}}
            for lane, i in tids.items()
        ]
        events = [
            {
                "name": s.phase,
                "ph": "X",
                "ts": (s.start - self._origin) * 1e6,
                "dur": (s.end - s.start) * 1e6,
                "pid": 0,
                "tid": tids[s.lane],
                "args": {"step": s.step},
            }
            for s in self._spans_until_now()
        ]
        return {"traceEvents": names + events, "displayTimeUnit": "ms"}

    def write(self, path: Path) -> None:
        """Write `to_chrome()` to `path` atomically: readers never see a partial file."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_chrome(), f)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def summary(self, start: float, end: float) -> dict[str, float]:
        """Utilisation over the window [start, end] (clock seconds); see `summarise`.

        The scheduler asks for every step's window: spans close in clock order, so only the
        newest reach into it, and a summary costs that step's spans, not the whole run's
        (which made a long run's driver slower with every step).
        """
        first = bisect.bisect_right(self.spans, start, key=lambda span: span.end)
        return summarise(self._spans_until_now(first), self.lanes, start, end)

    def _spans_until_now(self, first: int = 0) -> list[Span]:
        """The closed spans from index `first` on, and the open ones as if they closed now."""
        now = self._clock()
        still_open = [
            Span(lane, phase, opened.start, now, opened.step)
            for (lane, phase), opened in self._open.items()
        ]
        return self.spans[first:] + still_open

    def _check(self, lane: str, phase: str) -> None:
        if lane not in self.lanes:
            raise ValueError(f"unknown lane {lane!r}; lanes: {', '.join(self.lanes)}")
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases: {', '.join(PHASES)}")


def summarise(
    spans: Iterable[Span], lanes: dict[str, list[int]], start: float, end: float
) -> dict[str, float]:
    """Utilisation of the window [start, end] (seconds); spans are clipped to it.

    "perf/busy_fraction": mean over all devices (the union of the lanes' device indices) of the
        fraction of the window in which some lane on that device has a span. Present only when
        some lane occupies a device (a renderer that knows no devices passes `lanes={}`).
    "perf/overlap_fraction": fraction of the window in which a "generate" span and a
        TRAINER_PHASES span are both active, on any lanes.
    "perf/busy_s_<phase>": seconds of the window covered by that phase's spans (any lane), for
        each phase with spans in the window.
    """
    if end <= start:
        raise ValueError(f"empty window: end ({end}) must be after start ({start})")
    spans = list(spans)
    window = end - start

    def covered(keep: Callable[[Span], bool]) -> list[Interval]:
        return _union(_clip([(s.start, s.end) for s in spans if keep(s)], start, end))

    out: dict[str, float] = {}
    devices = sorted({d for lane_devices in lanes.values() for d in lane_devices})
    if devices:
        busy = [_length(covered(lambda s, d=d: d in lanes.get(s.lane, ()))) for d in devices]
        out["perf/busy_fraction"] = sum(busy) / (len(devices) * window)
    generating = covered(lambda s: s.phase == "generate")
    training = covered(lambda s: s.phase in TRAINER_PHASES)
    out["perf/overlap_fraction"] = _length(_intersect(generating, training)) / window
    for phase in PHASES:
        phase_covered = covered(lambda s, p=phase: s.phase == p)
        if phase_covered:
            out[f"perf/busy_s_{phase}"] = _length(phase_covered)
    return out


def load_lanes(path: Path) -> list[str]:
    """The lane names of a trace file written by `Trace.write`, in the trace's lane order."""
    return list(_lane_names(_read_events(path)).values())


def load_chrome(path: Path) -> list[Span]:
    """The spans of a trace file written by `Trace.write`; times in seconds since its creation."""
    events = _read_events(path)
    names = _lane_names(events)
    return [
        Span(
            lane=names[e["tid"]],
            phase=e["name"],
            start=e["ts"] / 1e6,
            end=(e["ts"] + e["dur"]) / 1e6,
            step=e["args"].get("step"),
        )
        for e in events
        if e["ph"] == "X"
    ]


def _read_events(path: Path) -> list[dict]:
    return json.loads(Path(path).read_text())["traceEvents"]


def _lane_names(events: list[dict]) -> dict[int, str]:
    """tid -> lane name, in tid order."""
    named = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    return dict(sorted(named.items()))


def covered_seconds(intervals: Iterable[Interval], start: float, end: float) -> float:
    """Seconds of [start, end] that the union of `intervals` covers."""
    return _length(_union(_clip(intervals, start, end)))


def _clip(intervals: Iterable[Interval], start: float, end: float) -> list[Interval]:
    return [(max(a, start), min(b, end)) for a, b in intervals]


def _union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points; empty intervals dropped."""
    merged: list[Interval] = []
    for a, b in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _length(intervals: Iterable[Interval]) -> float:
    """Total length of disjoint intervals (a `_union`'s output)."""
    return sum((b - a for a, b in intervals), 0.0)


def _intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Points in both of two `_union` outputs, as sorted disjoint intervals."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        # Advance whichever ends first: it can meet nothing further along the other list.
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out
