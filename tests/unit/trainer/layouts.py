"""What every micro-batch layout must reproduce of the padded one, shared by its tests."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rl.algorithms.objective import loss_weights, policy_objective
from rl.config import AlgorithmConfig
from rl.types import Batch
from trainer.fsdp import LogProbModel
from trainer.packing import ModelInput, padded_input


def assert_same_loss_and_gradients(
    model: LogProbModel, batch: Batch, build: Callable[[Batch], ModelInput], agg: str
) -> None:
    """One backward of the policy loss (`agg`, with an entropy bonus) over `build(batch)`
    gives the padded layout's loss and every parameter's gradient."""
    cfg = AlgorithmConfig(loss_agg=agg, entropy_coef=0.01)
    max_len = batch.input_ids.shape[1]
    denominator = loss_weights(cfg, batch.loss_mask, max_len)[1].item()
    results = []
    for layout in (padded_input, build):
        model.zero_grad(set_to_none=True)
        logprob, entropy = model(layout(batch), 0.8)
        loss, _ = policy_objective(cfg, logprob, entropy, batch, max_len, denominator)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (padded_loss, padded_grads), (loss, grads) = results
    torch.testing.assert_close(loss, padded_loss, rtol=1e-5, atol=1e-7)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6)
