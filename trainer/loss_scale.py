"""Dynamic loss scaling for fp16 compute (`model.dtype=float16`).

fp16 holds magnitudes down to about 6e-8 (6e-5 at full precision), and the gradients of an
LM's activations often sit below that: they flush to zero in backward. Multiplying the loss by
a large scale lifts them into range; the gradients (reduced in fp32 onto the fp32 master
weights) are divided by it before clipping and the optimizer step, so the update is the
unscaled one. A scale too large overflows to inf somewhere in backward: that step is skipped
(`trainer.ranks.optimizer_step` skips non-finite steps) and the scale halves. After
`growth_interval` finite steps in a row it doubles again, to find the largest scale that fits.
bf16 has fp32's exponent range and needs none of this.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class LossScale:
    """The current scale and the count of finite steps since it last changed. Every rank
    holds the same one: it changes only on the global skip decision."""

    scale: float = 2.0**16
    growth_interval: int = 2000
    num_good_steps: int = 0

    def update(self, skipped: bool) -> None:
        """After an optimizer step: halve on a skipped (overflowed) step, double after
        `growth_interval` taken ones in a row."""
        if skipped:
            self.scale /= 2
            self.num_good_steps = 0
            return
        self.num_good_steps += 1
        if self.num_good_steps == self.growth_interval:
            self.scale *= 2
            self.num_good_steps = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.growth_interval, self.num_good_steps = (
            state["scale"],
            state["growth_interval"],
            state["num_good_steps"],
        )


def loss_scale_for(dtype: str) -> LossScale | None:
    """A LossScale for fp16 compute; None (no scaling) for fp32 and bf16."""
    return LossScale() if dtype == "float16" else None


def loss_multiplier(loss_scale: LossScale | None) -> float:
    """What the loss is multiplied by before backward: the scale, or 1 without scaling."""
    return 1.0 if loss_scale is None else loss_scale.scale
