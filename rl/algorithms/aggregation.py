"""Loss aggregations: the loss is sum(token_loss * weights) / sum(count), both summed over every
micro-batch and rank; weights and count are per-row sums, so any split of the rows gives the
same loss, and rows with an empty mask (dummy rows) add nothing to either.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from rl.config.registry import NoTraits, Registry

AggregationFn = Callable[[Tensor, int], tuple[Tensor, Tensor]]

LOSS_AGGREGATIONS: Registry[AggregationFn, NoTraits] = Registry("loss aggregation")


def _non_empty_rows(mask: Tensor) -> Tensor:
    return (mask.sum(dim=1) > 0).sum().to(mask.dtype)


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean_weights(mask: Tensor, max_response_len: int) -> tuple[Tensor, Tensor]:
    """Mean over all valid tokens: weights = mask [B, T1], count = mask.sum() (scalar)."""
    return mask, mask.sum()


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum_weights(mask: Tensor, max_response_len: int) -> tuple[Tensor, Tensor]:
    """Mean over sequences of token sums: weights = mask [B, T1], count = non-empty rows."""
    return mask, _non_empty_rows(mask)


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean_weights(mask: Tensor, max_response_len: int) -> tuple[Tensor, Tensor]:
    """Mean over sequences of token means: weights = mask / row length, count = non-empty rows."""
    return mask / mask.sum(dim=1, keepdim=True).clamp(min=1.0), _non_empty_rows(mask)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm_weights(mask: Tensor, max_response_len: int) -> tuple[Tensor, Tensor]:
    """Dr.GRPO: token sums over a constant: weights = mask / max_response_len, count = non-empty
    rows, so no sequence's tokens are up- or down-weighted by its own length."""
    return mask / max_response_len, _non_empty_rows(mask)
