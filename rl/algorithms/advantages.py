"""Advantage estimators: token rewards [B, T1] (and critic values) -> (advantages, returns).

Conventions: rl/algorithms/masked.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rl.algorithms.masked import at_last_token, by_group, masked_whiten, sequence_scores
from rl.config import AlgorithmConfig, Config
from rl.config.registry import Registry

AdvantageFn = Callable[
    [Tensor, Tensor, AlgorithmConfig, "Tensor | None", "Tensor | None"], tuple[Tensor, Tensor]
]


@dataclass(frozen=True)
class AdvantageTraits:
    needs_critic: bool = False  # it reads critic values: the run has a critic (PPO)
    group_baseline: bool = False  # its baseline is the other responses to the same prompt
    # It takes a per-token KL penalty in the reward (algorithm.kl_in_reward). GRPO and RLOO do
    # not: their group statistics would normalise KL noise up to the size of the score signal
    # and give an all-correct group a non-zero advantage (DeepSeekMath puts GRPO's KL in the
    # loss).
    kl_in_reward: bool = True
    # It whitens over the whole batch: a sample's advantage depends on other prompts' samples.
    whitens_batch: bool = False


ADVANTAGES: Registry[AdvantageFn, AdvantageTraits] = Registry(
    "advantage estimator", AdvantageTraits
)


def needs_critic(cfg: Config) -> bool:
    """Whether the run trains a critic: its advantage estimator reads critic values."""
    return ADVANTAGES.traits(cfg.algorithm.advantage).needs_critic


def couples_groups(cfg: AlgorithmConfig) -> bool:
    """Whether a group's advantages depend on other groups of the step (whitening over the
    batch): such a step cannot be trained group by group (scheduler.streaming)."""
    whitens = ADVANTAGES.traits(cfg.advantage).whitens_batch
    return whitens or (cfg.advantage == "gae" and cfg.whiten_advantages)


GROUP_STD_EPS = 1e-6


def _refuse_kl_penalty(name: str, kl_penalty: Tensor | None) -> None:
    if kl_penalty is not None:
        raise ValueError(
            f"advantage {name!r} takes no KL penalty in the reward: its group statistics would "
            "amplify KL noise; put the KL in the loss (algorithm.kl_in_reward=false)"
        )


def _gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> Tensor:
    """A_t = r_t + gamma V_next - V_t + gamma lam A_next, scanned right to left. All [B, T1].

    "next" is the next *response* position of the row (V_next = A_next = 0 after the last), so
    the carries step over left-padded prompts of any length, right padding and masked holes.
    """
    valid = mask.bool()
    next_value = torch.zeros_like(rewards[:, 0])
    next_adv = torch.zeros_like(rewards[:, 0])
    columns = []
    for t in reversed(range(rewards.shape[1])):
        adv = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * next_adv
        next_adv = torch.where(valid[:, t], adv, next_adv)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        columns.append(next_adv)
    return torch.stack(columns[::-1], dim=1) * mask


@ADVANTAGES.register("grpo", group_baseline=True, kl_in_reward=False)
def grpo_advantages(
    token_rewards: Tensor,
    mask: Tensor,
    cfg: AlgorithmConfig,
    values: Tensor | None = None,
    kl_penalty: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """GRPO: A_i = (s_i - mean_g s) / (std_g s + 1e-6) on every response token of sequence i.

    s = per-sequence sum of token_rewards [B]; mean and unbiased std over i's group of G.
    cfg.normalize_std=False keeps only the centring (Dr.GRPO). A group whose scores are all
    equal, or a group of one, gets 0. Returns (advantages, returns = advantages), both [B, T1].
    """
    _refuse_kl_penalty("grpo", kl_penalty)
    grouped = by_group(sequence_scores(token_rewards, mask), cfg.group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if cfg.normalize_std and cfg.group_size > 1:  # the std of a single sample is NaN
        centred = centred / (grouped.std(dim=1, keepdim=True) + GROUP_STD_EPS)
    advantages = centred.reshape(-1, 1) * mask
    return advantages, advantages


@ADVANTAGES.register("rloo", group_baseline=True, kl_in_reward=False)
def rloo_advantages(
    token_rewards: Tensor,
    mask: Tensor,
    cfg: AlgorithmConfig,
    values: Tensor | None = None,
    kl_penalty: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """RLOO: A_i = s_i - (sum_{j in g, j != i} s_j) / (G - 1) on every response token of i.

    s = per-sequence sum of token_rewards [B]; G = 1 has no other sample and gets 0.
    Returns (advantages, returns = advantages), both [B, T1].
    """
    _refuse_kl_penalty("rloo", kl_penalty)
    grouped = by_group(sequence_scores(token_rewards, mask), cfg.group_size)
    if cfg.group_size > 1:
        leave_one_out = (grouped.sum(dim=1, keepdim=True) - grouped) / (cfg.group_size - 1)
        centred = grouped - leave_one_out
    else:
        centred = torch.zeros_like(grouped)
    advantages = centred.reshape(-1, 1) * mask
    return advantages, advantages


@ADVANTAGES.register("reinforce_pp", whitens_batch=True)
def reinforce_pp_advantages(
    token_rewards: Tensor,
    mask: Tensor,
    cfg: AlgorithmConfig,
    values: Tensor | None = None,
    kl_penalty: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: G_t = sum_{k >= t} gamma^(k-t) r_k over the response; A = whiten(G).

    gamma = cfg.gamma; the whitening is a masked mean/std over every valid token of the batch
    (`masked_whiten`); r includes `kl_penalty` [B, T1] when given. Returns (advantages,
    returns G), both [B, T1].
    """
    if kl_penalty is not None:
        token_rewards = token_rewards + kl_penalty
    returns = _gae(token_rewards, torch.zeros_like(token_rewards), mask, cfg.gamma, 1.0)
    return masked_whiten(returns, mask), returns


@ADVANTAGES.register("reinforce_pp_baseline", group_baseline=True, whitens_batch=True)
def reinforce_pp_baseline_advantages(
    token_rewards: Tensor,
    mask: Tensor,
    cfg: AlgorithmConfig,
    values: Tensor | None = None,
    kl_penalty: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a group baseline (OpenRLHF reinforce_baseline).

    r'_{i,last} = r_{i,last} - mean_g s, with s = per-sequence sum of token_rewards [B] (the
    task scores), then the per-token `kl_penalty` added, then G_t and A = whiten(G) as
    `reinforce_pp`: the baseline centres the raw scores only, so a KL drift the whole group
    shares stays penalised (OpenRLHF's order). Returns (advantages, returns), both [B, T1].
    """
    baseline = by_group(sequence_scores(token_rewards, mask), cfg.group_size).mean(dim=1)
    shaped = token_rewards - at_last_token(baseline.repeat_interleave(cfg.group_size), mask)
    return reinforce_pp_advantages(shaped, mask, cfg, kl_penalty=kl_penalty)


@ADVANTAGES.register("gae", needs_critic=True)
def gae_advantages(
    token_rewards: Tensor,
    mask: Tensor,
    cfg: AlgorithmConfig,
    values: Tensor | None = None,
    kl_penalty: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO GAE: delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}.

    values [B, T1] from the critic (required); t+1 is the next response position, V = A = 0
    after the last one, so responses may start at any column. returns = A + V before
    cfg.whiten_advantages whitens A over the batch's valid tokens; r includes `kl_penalty`
    [B, T1] when given. Returns (A, returns) [B, T1].
    """
    if values is None:
        raise ValueError("advantage 'gae' needs critic values")
    if kl_penalty is not None:
        token_rewards = token_rewards + kl_penalty
    advantages = _gae(token_rewards, values, mask, cfg.gamma, cfg.lam)
    returns = (advantages + values) * mask
    if cfg.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns
