"""Dynamic loss scaling: when the scale moves, and for which dtypes it exists."""

from __future__ import annotations

from trainer.loss_scale import LossScale, loss_multiplier, loss_scale_for


def test_an_overflowed_step_halves_the_scale_and_restarts_the_count() -> None:
    scale = LossScale(scale=1024.0, growth_interval=3)
    scale.update(skipped=False)
    scale.update(skipped=True)
    assert (scale.scale, scale.num_good_steps) == (512.0, 0)


def test_the_scale_doubles_after_growth_interval_finite_steps_in_a_row() -> None:
    scale = LossScale(scale=1024.0, growth_interval=3)
    for _ in range(2):
        scale.update(skipped=False)
    assert scale.scale == 1024.0
    scale.update(skipped=False)
    assert (scale.scale, scale.num_good_steps) == (2048.0, 0)


def test_state_round_trips() -> None:
    scale = LossScale(scale=8.0, growth_interval=5, num_good_steps=2)
    restored = LossScale()
    restored.load_state_dict(scale.state_dict())
    assert restored == scale


def test_only_fp16_is_scaled() -> None:
    assert loss_scale_for("float16") == LossScale()
    assert loss_scale_for("bfloat16") is None and loss_scale_for("float32") is None
    assert loss_multiplier(None) == 1.0
    assert loss_multiplier(LossScale(scale=4.0)) == 4.0
