"""The console: the live progress display on a terminal, its ETA, and the JSON lines."""

from __future__ import annotations

import io
import re

from rich.console import Console

from rl.observe.console import ProgressConsole, eta_seconds, format_duration, summary_text


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_eta_is_the_remaining_steps_at_the_pace_so_far_and_unknown_before_a_step() -> None:
    assert eta_seconds(num_done=4, elapsed_s=10.0, num_left=6) == 15.0
    assert eta_seconds(num_done=0, elapsed_s=10.0, num_left=6) is None
    assert format_duration(3725.4) == "1:02:05" and format_duration(None) == "-:--:--"


def test_summary_shows_the_key_numbers_present_and_skips_nulls() -> None:
    values = {"reward/mean": 0.7134, "eval/accuracy": None, "time/step_s": 1.2}
    assert summary_text(values) == "reward 0.713 · 1.20 s/step"


def test_live_display_on_a_terminal_shows_step_eta_then_phases_and_numbers_below() -> None:
    out = io.StringIO()
    terminal = Console(file=out, force_terminal=True, width=200, color_system=None)
    clock = Clock()
    console = ProgressConsole("grpo", num_steps=10, console=terminal, clock=clock)
    clock.now = 5.0
    console.step({"step": 0, "eval/accuracy": 0.3})  # the pace starts after the eval
    clock.now = 7.0
    console.step({"step": 1, "reward/mean": 0.25, "time/step_s": 2.0})
    console.phases(["generate", "train"])
    console.message("checkpoint written to [x]")
    console.close()
    text = out.getvalue()
    live = re.sub(r"\x1b\[[0-9?;]*[A-Za-z]", "", text.rsplit("\x1b[?25h", 1)[0])  # no escapes
    bar, status = live.splitlines()[-2:]  # the last redraw
    assert bar.startswith("grpo ━") and bar.endswith(" 1/10 0:00:00 ETA 0:00:18"), bar
    assert status == "generate, train · reward 0.25 · acc 30.0% · 2.00 s/step"
    assert "checkpoint written to [x]" in text
    assert "step 1/10" not in text  # live: no line a step


def test_a_resumed_run_counts_from_its_checkpoint_step() -> None:
    out = io.StringIO()
    clock = Clock()
    console = ProgressConsole(
        "r", num_steps=10, first_step=6, console=Console(file=out), clock=clock
    )
    clock.now = 4.0
    console.step({"step": 8})
    assert out.getvalue().strip() == "step 8/10 · ETA 0:00:04"
