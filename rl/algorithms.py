"""RL algorithms as small pure functions over tensors, chosen by name through registries.

Conventions: B sequences ordered group by group (G = cfg.group_size consecutive rows answer the
same prompt); T1 = T-1 target positions, aligned to targets as in `rl.types.Batch`; `mask`
[B, T1] is 1.0 on response tokens. Per-token outputs are 0 outside the mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rl.config import AlgorithmConfig
from rl.registry import Registry

AdvantageFn = Callable[[Tensor, Tensor, AlgorithmConfig, "Tensor | None"], tuple[Tensor, Tensor]]
PolicyLossFn = Callable[[Tensor, Tensor, Tensor, Tensor, AlgorithmConfig], tuple[Tensor, Tensor]]
KLFn = Callable[[Tensor, Tensor], Tensor]
AggregationFn = Callable[[Tensor, int], tuple[Tensor, Tensor]]
CorrectionFn = Callable[[Tensor, Tensor, Tensor, AlgorithmConfig], tuple[Tensor, Tensor]]

ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")
KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator")
LOSS_AGGREGATIONS: Registry[AggregationFn] = Registry("loss aggregation")
OFF_POLICY_CORRECTIONS: Registry[CorrectionFn] = Registry("off-policy correction")

# Log-ratios are clamped before exp(): exp(20) ~ 4.9e8 is finite in float32 and bf16 and far
# beyond any ratio that still carries information, so one outlier token cannot make inf/NaN.
LOG_RATIO_LIMIT = 20.0
GROUP_STD_EPS = 1e-6


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` where mask is 1, over all dims -> scalar (0 when the mask is empty)."""
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(values - mean) / sqrt(var + eps) over the batch's valid tokens, [B, T1] -> [B, T1].

    Population variance, as OpenRLHF. eps keeps a batch whose valid values are all equal (std 0)
    at its centred values, i.e. 0, instead of dividing rounding noise up. 0 outside the mask.
    """
    centred = (values - masked_mean(values, mask)) * mask
    return centred * (masked_mean(centred**2, mask) + eps).rsqrt()


def _grouped(scores: Tensor, group_size: int) -> Tensor:
    """[B] -> [B // G, G], refusing a batch that is not a whole number of groups."""
    if group_size < 1 or scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} sequences do not split into groups of {group_size}")
    return scores.view(-1, group_size)


def _scores(token_rewards: Tensor, mask: Tensor) -> Tensor:
    """Each sequence's total reward over its response tokens: [B, T1] -> [B]."""
    return (token_rewards * mask).sum(dim=1)


def at_last_token(per_sequence: Tensor, mask: Tensor) -> Tensor:
    """Place per-sequence values [B] on each row's last response token -> [B, T1], 0 elsewhere."""
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device, dtype=mask.dtype)
    last = (mask * positions).argmax(dim=1, keepdim=True)
    placed = torch.zeros_like(mask).scatter(1, last, per_sequence.unsqueeze(1).to(mask.dtype))
    return placed * mask  # rows with an empty mask get nothing


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


@ADVANTAGES.register("grpo")
def grpo_advantages(
    token_rewards: Tensor, mask: Tensor, cfg: AlgorithmConfig, values: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """GRPO: A_i = (s_i - mean_g s) / (std_g s + 1e-6) on every response token of sequence i.

    s = per-sequence sum of token_rewards [B]; mean and unbiased std over i's group of G.
    cfg.normalize_std=False keeps only the centring (Dr.GRPO). A group whose scores are all
    equal, or a group of one, gets 0. Returns (advantages, returns = advantages), both [B, T1].
    """
    grouped = _grouped(_scores(token_rewards, mask), cfg.group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if cfg.normalize_std and cfg.group_size > 1:  # the std of a single sample is NaN
        centred = centred / (grouped.std(dim=1, keepdim=True) + GROUP_STD_EPS)
    advantages = centred.reshape(-1, 1) * mask
    return advantages, advantages


@ADVANTAGES.register("rloo")
def rloo_advantages(
    token_rewards: Tensor, mask: Tensor, cfg: AlgorithmConfig, values: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """RLOO: A_i = s_i - (sum_{j in g, j != i} s_j) / (G - 1) on every response token of i.

    s = per-sequence sum of token_rewards [B]; G = 1 has no other sample and gets 0.
    Returns (advantages, returns = advantages), both [B, T1].
    """
    grouped = _grouped(_scores(token_rewards, mask), cfg.group_size)
    if cfg.group_size > 1:
        leave_one_out = (grouped.sum(dim=1, keepdim=True) - grouped) / (cfg.group_size - 1)
        centred = grouped - leave_one_out
    else:
        centred = torch.zeros_like(grouped)
    advantages = centred.reshape(-1, 1) * mask
    return advantages, advantages


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp_advantages(
    token_rewards: Tensor, mask: Tensor, cfg: AlgorithmConfig, values: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: G_t = sum_{k >= t} gamma^(k-t) r_k over the response; A = whiten(G).

    gamma = cfg.gamma; the whitening is a masked mean/std over every valid token of the batch
    (`masked_whiten`). Returns (advantages, returns G), both [B, T1].
    """
    returns = _gae(token_rewards, torch.zeros_like(token_rewards), mask, cfg.gamma, 1.0)
    return masked_whiten(returns, mask), returns


@ADVANTAGES.register("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(
    token_rewards: Tensor, mask: Tensor, cfg: AlgorithmConfig, values: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a group baseline (OpenRLHF reinforce_baseline).

    r'_{i,last} = r_{i,last} - mean_g s, with s = per-sequence sum of token_rewards [B], then
    G_t and A = whiten(G) as `reinforce_pp`. Returns (advantages, returns), both [B, T1].
    """
    baseline = _grouped(_scores(token_rewards, mask), cfg.group_size).mean(dim=1)
    shaped = token_rewards - at_last_token(baseline.repeat_interleave(cfg.group_size), mask)
    return reinforce_pp_advantages(shaped, mask, cfg)


@ADVANTAGES.register("gae")
def gae_advantages(
    token_rewards: Tensor, mask: Tensor, cfg: AlgorithmConfig, values: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """PPO GAE: delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}.

    values [B, T1] from the critic (required); t+1 is the next response position, V = A = 0
    after the last one, so responses may start at any column. returns = A + V before
    cfg.whiten_advantages whitens A over the batch's valid tokens. Returns (A, returns) [B, T1].
    """
    if values is None:
        raise ValueError("advantage 'gae' needs critic values")
    advantages = _gae(token_rewards, values, mask, cfg.gamma, cfg.lam)
    returns = (advantages + values) * mask
    if cfg.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def _ratio(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    return torch.exp((logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))


def _clip(ratio: Tensor, advantages: Tensor, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) and where the clipped branch won."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


@POLICY_LOSSES.register("clipped")
def clipped_surrogate(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cfg: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """PPO clip per token: loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)).

    r = exp(logprobs - old_logprobs); clip_high > clip_low is DAPO's clip-higher. Dual-clip
    (Ye et al. 2020), cfg.dual_clip = c > 1: where A < 0, loss = min(loss, -A c), bounding what
    a huge ratio can cost. All inputs [B, T1] -> (loss, clipped: 1.0 where a bound decided).
    """
    if cfg.dual_clip and cfg.dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be 0 (off) or > 1, got {cfg.dual_clip}")
    loss, active = _clip(_ratio(logprobs, old_logprobs), advantages, cfg)
    if cfg.dual_clip:
        bound = -advantages * cfg.dual_clip
        dual = (advantages < 0) & (bound < loss)
        loss = torch.where(dual, bound, loss)
        active = active | dual
    return loss * mask, active.float() * mask


@POLICY_LOSSES.register("gspo")
def gspo_surrogate(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cfg: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """GSPO: sequence ratio s_i = exp(mean_t (logprobs - old_logprobs)) over i's response.

    Token form s_{i,t} = sg[s_i] exp(logprobs - sg[logprobs]): the value is s_i on every token,
    d s_{i,t} / d logprobs_t = s_i, so per-token gradients flow. loss = max(-A s, -A clip(s,
    1 - clip_low, 1 + clip_high)) (GSPO uses clip ranges ~1e-3). All [B, T1] -> (loss, clipped).
    """
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    seq_log_ratio = ((logprobs - old_logprobs) * mask).sum(dim=1, keepdim=True) / lengths
    seq_log_ratio = seq_log_ratio.detach().clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    loss, active = _clip(torch.exp(seq_log_ratio + logprobs - logprobs.detach()), advantages, cfg)
    return loss * mask, active.float() * mask


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = log(pi/ref) = logprobs - ref_logprobs, [B, T1]; unbiased, high variance, can be < 0."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = 0.5 (logprobs - ref_logprobs)^2, [B, T1]; biased, low variance, >= 0."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = exp(x) - 1 - x with x = ref_logprobs - logprobs, [B, T1]; unbiased and >= 0.

    x is clamped to [-20, 20] so one outlier token cannot overflow exp().
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.exp(log_ratio) - 1.0 - log_ratio


# Aggregations: the loss is sum(token_loss * weights) / sum(count), both summed over every
# micro-batch and rank; weights and count are per-row sums, so any split of the rows gives the
# same loss, and rows with an empty mask (dummy rows) add nothing to either.


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


# Off-policy corrections weigh the loss by pi_proximal / pi_behaviour (the trainer's old policy
# over vLLM's sampling policy); weights carry no gradient and are 0 outside the returned mask.


def _log_ratio(proximal: Tensor, behaviour: Tensor, mask: Tensor) -> Tensor:
    return (proximal - behaviour).detach() * mask


def _masked_is(log_ratio: Tensor, mask: Tensor, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """Keep tokens (log_ratio [B, T1]) or sequences ([B, 1]) whose ratio is in [is_low, is_high]."""
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    keep = mask * ((ratio >= cfg.is_low) & (ratio <= cfg.is_high))
    return ratio * keep, keep


@OFF_POLICY_CORRECTIONS.register("none")
def no_correction(
    proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cfg: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """No correction: weights = 1 on the mask [B, T1], mask unchanged."""
    return mask.clone(), mask


@OFF_POLICY_CORRECTIONS.register("token-tis")
def token_tis(
    proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cfg: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """Truncated IS per token: w = min(exp(prox - behav), is_cap) [B, T1], mask unchanged."""
    log_ratio = _log_ratio(proximal_logprobs, behaviour_logprobs, mask)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    return ratio.clamp(max=cfg.is_cap) * mask, mask


@OFF_POLICY_CORRECTIONS.register("token-mis")
def token_mis(
    proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cfg: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """Masked IS per token: r = exp(prox - behav); tokens with r outside [is_low, is_high] leave
    the mask, the kept ones get w = r. Returns (w, mask), both [B, T1]."""
    return _masked_is(_log_ratio(proximal_logprobs, behaviour_logprobs, mask), mask, cfg)


@OFF_POLICY_CORRECTIONS.register("seq-tis")
def seq_tis(
    proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cfg: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """Truncated IS per sequence: w_i = min(exp(sum_t (prox - behav)), is_cap) on every token of
    sequence i. Returns (w, mask unchanged), both [B, T1]."""
    log_ratio = _log_ratio(proximal_logprobs, behaviour_logprobs, mask).sum(dim=1, keepdim=True)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    return ratio.clamp(max=cfg.is_cap) * mask, mask


@OFF_POLICY_CORRECTIONS.register("seq-mis")
def seq_mis(
    proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cfg: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """Masked IS per sequence: r_i = exp(sum_t (prox - behav)); sequences with r_i outside
    [is_low, is_high] leave the mask whole, the kept ones get w = r_i. Returns (w, mask) [B, T1]."""
    log_ratio = _log_ratio(proximal_logprobs, behaviour_logprobs, mask).sum(dim=1, keepdim=True)
    return _masked_is(log_ratio, mask, cfg)


@OFF_POLICY_CORRECTIONS.register("decoupled")
def decoupled(
    proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cfg: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """Decoupled PPO (Hilton et al. 2022): untruncated w = exp(prox - behav) [B, T1], mask kept.

    The PPO ratio is then pi / pi_proximal, so the trust region is around the proximal policy
    (the recomputed old log-probs), while w corrects for sampling from the behaviour policy.
    """
    log_ratio = _log_ratio(proximal_logprobs, behaviour_logprobs, mask)
    return torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)) * mask, mask


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float
) -> Tensor:
    """Clipped critic loss per token, [B, T1]: 0.5 max((v - R)^2, (v_clip - R)^2) with
    v_clip = old + clamp(v - old, -clip, clip); plain 0.5 (v - R)^2 when clip <= 0. 0 off-mask."""
    loss = (values - returns) ** 2
    if clip > 0:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    return 0.5 * loss * mask


def adaptive_kl_coef(
    coef: float, observed_kl: float, target: float, num_samples: int, horizon: int
) -> float:
    """Adaptive KL controller (Ziegler et al. 2019): coef (1 + e num_samples / horizon) with the
    proportional error e = clip(observed_kl / target - 1, -0.2, 0.2)."""
    if target <= 0 or horizon <= 0:
        raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target}, {horizon}")
    error = min(max(observed_kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * num_samples / horizon)


def overlong_penalty(response_lengths: Tensor, max_len: int, buffer: int, penalty: float) -> Tensor:
    """DAPO soft overlong punishment per sequence, [B] -> [B] float: 0 up to max_len - buffer,
    then linear down to -penalty at max_len (and no lower); all 0 when buffer == 0."""
    if buffer < 0:
        raise ValueError(f"overlong buffer must be >= 0, got {buffer}")
    lengths = response_lengths.float()
    if buffer == 0:
        return torch.zeros_like(lengths)
    excess = lengths - (max_len - buffer)
    return (-excess / buffer * penalty).clamp(min=-penalty, max=0.0)


def dynamic_sampling_keep(scores: Tensor, group_size: int) -> Tensor:
    """DAPO dynamic sampling: scores [B] -> [B // G] bool, True for groups whose scores are not
    all equal (the others give GRPO no gradient). A group of one is never kept."""
    grouped = _grouped(scores, group_size)
    return (grouped != grouped[:, :1]).any(dim=1)
