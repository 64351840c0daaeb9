"""rl.algorithms, losses and corrections: every policy loss, KL estimator, aggregation and
off-policy correction against values worked out by hand from its formula."""

from __future__ import annotations

import math

import pytest
import torch
from torch.autograd import gradcheck

from rl.algorithms.advantages import ADVANTAGES
from rl.algorithms.aggregation import LOSS_AGGREGATIONS
from rl.algorithms.dapo import dynamic_sampling_keep, overlong_penalty
from rl.algorithms.kl import KL_ESTIMATORS, adaptive_kl_coef
from rl.algorithms.off_policy import OFF_POLICY_CORRECTIONS, mismatch_metrics
from rl.algorithms.policy_losses import POLICY_LOSSES
from rl.algorithms.value_loss import value_loss
from rl.config import AlgorithmConfig
from tests.unit.rl.algorithms.tensors import GARBAGE, close, t

# ---------------------------------------------------------------- policy losses

# (ratio, advantage) -> loss with clip_low 0.2, clip_high 0.28, and whether a bound decided.
CLIP_CASES = [
    (1.1, 1.0, -1.1, 0.0),  # inside the range
    (1.25, 1.0, -1.25, 0.0),  # above 1.2 but inside the clip-higher bound 1.28
    (1.5, 1.0, -1.28, 1.0),  # capped at 1 + clip_high
    (0.7, 1.0, -0.7, 0.0),  # A > 0 never clips from below
    (0.7, -1.0, 0.8, 1.0),  # A < 0 clips at 1 - clip_low
    (1.5, -2.0, 3.0, 0.0),  # A < 0 keeps the larger unclipped loss
]


def _ppo(ratios: list[float], advs: list[float], cfg: AlgorithmConfig, mask: list[float]):
    logprobs = torch.log(t(ratios)).unsqueeze(0).requires_grad_()
    loss, clipped = POLICY_LOSSES.get("clipped")(
        logprobs, torch.zeros_like(logprobs), t([advs]), t([mask]), cfg
    )
    return logprobs, loss, clipped


def test_clipped_uses_asymmetric_bounds_and_zeroes_tokens_outside_the_mask() -> None:
    ratios, advs, losses, flags = map(list, zip(*CLIP_CASES, strict=True))
    cfg = AlgorithmConfig(clip_low=0.2, clip_high=0.28)
    _, loss, clipped = _ppo(ratios + [3.0], advs + [1.0], cfg, [1.0] * 6 + [0.0])
    assert close(loss, [losses + [0.0]])
    assert clipped.tolist() == [flags + [0.0]]


def test_clip_higher_lets_a_ratio_past_the_symmetric_bound() -> None:
    symmetric = _ppo([1.25], [1.0], AlgorithmConfig(clip_low=0.2, clip_high=0.2), [1.0])
    higher = _ppo([1.25], [1.0], AlgorithmConfig(clip_low=0.2, clip_high=0.28), [1.0])
    assert close(symmetric[1], [[-1.2]]) and symmetric[2].item() == 1.0
    assert close(higher[1], [[-1.25]]) and higher[2].item() == 0.0


def test_dual_clip_bounds_the_loss_of_negative_advantages() -> None:
    # c = 3: ratio 5 with A = -1 would cost 5, capped at 3 (no gradient); ratio 2 costs 2;
    # positive advantages are untouched (ratio 5, A = 1 -> -1.2).
    cfg = AlgorithmConfig(dual_clip=3.0)
    logprobs, loss, clipped = _ppo([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0], cfg, [1.0] * 3)
    assert close(loss, [[3.0, 2.0, -1.2]])
    assert clipped.tolist() == [[1.0, 0.0, 1.0]]
    loss.sum().backward()
    assert close(logprobs.grad, [[0.0, 2.0, 0.0]])


@pytest.mark.parametrize("bad", [0.5, 1.0])
def test_dual_clip_must_exceed_one(bad: float) -> None:
    with pytest.raises(ValueError, match="dual_clip"):
        _ppo([1.0], [-1.0], AlgorithmConfig(dual_clip=bad), [1.0])


def test_unclipped_ppo_gradient_is_minus_advantage_times_ratio() -> None:
    # d(-A r)/d logp = -A r, since d r / d logp = r; clipped tokens get no gradient.
    logprobs, loss, _ = _ppo([1.1, 0.9, 1.5], [2.0, -1.0, 1.0], AlgorithmConfig(), [1.0] * 3)
    loss.sum().backward()
    assert close(logprobs.grad, [[-2.2, 0.9, 0.0]])


def test_clipped_passes_gradcheck_away_from_the_clip_bounds() -> None:
    # Inside the range, clipped above/below, dual-clipped, and a large unclipped A < 0 ratio.
    ratios = torch.tensor([[1.05, 0.9, 1.5, 0.6, 4.0, 2.0]], dtype=torch.float64)
    advs = torch.tensor([[1.0, -1.0, 1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones_like(advs)
    cfg = AlgorithmConfig(dual_clip=3.0)
    logprobs = torch.log(ratios).requires_grad_()
    old = torch.zeros_like(logprobs).requires_grad_()
    fn = POLICY_LOSSES.get("clipped")
    assert gradcheck(lambda lp, o: fn(lp, o, advs, mask, cfg)[0], (logprobs, old))


def test_gspo_uses_the_sequence_ratio_on_every_token_with_per_token_gradient() -> None:
    # Row 0: log-ratios [0.1, -0.1] -> s = 1, A = 2 -> loss -2 per token, d/dlogp_t = -2.
    # Row 1: log-ratios [0.3, 0.1] -> s = e^0.2 = 1.2214 (< 1.28), A = 1 -> -s, d/dlogp_t = -s.
    old = t([[-1.0, -1.0, 0.0], [-2.0, -2.0, 0.0]])
    logprobs = (old + t([[0.1, -0.1, GARBAGE], [0.3, 0.1, GARBAGE]])).requires_grad_()
    mask = t([[1, 1, 0], [1, 1, 0]])
    cfg = AlgorithmConfig(clip_high=0.28)
    loss, clipped = POLICY_LOSSES.get("gspo")(logprobs, old, t([[2.0] * 3, [1.0] * 3]), mask, cfg)
    s = math.exp(0.2)
    assert close(loss, [[-2, -2, 0], [-s, -s, 0]])
    assert clipped.sum() == 0
    # Token 0's loss moves only with token 0 (sg[s_i] blocks the path through the mean).
    loss[:, 0].sum().backward()
    assert close(logprobs.grad, [[-2, 0, 0], [-s, 0, 0]])


def test_gspo_clips_whole_sequences() -> None:
    # s = e^0.2 = 1.2214 > 1.2 with A > 0: every token of the row is capped at 1.2.
    old = t([[0.0, 0.0]])
    loss, clipped = POLICY_LOSSES.get("gspo")(
        old + t([[0.3, 0.1]]), old, t([[1.0, 1.0]]), t([[1, 1]]), AlgorithmConfig()
    )
    assert close(loss, [[-1.2, -1.2]])
    assert clipped.tolist() == [[1.0, 1.0]]


def test_gspo_token_gradient_equals_the_sequence_objective_gradient() -> None:
    # Averaged over each response, the token form's value is -A s_i and its autograd gradient
    # must match the finite differences of the sequence-level objective -A exp(mean log-ratio).
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.float64)
    old = -torch.rand(2, 4, dtype=torch.float64)
    logprobs = (old + 0.05 * torch.randn(2, 4, dtype=torch.float64)).requires_grad_()
    advs = torch.tensor([[1.5], [-0.5]], dtype=torch.float64).expand(2, 4)
    cfg = AlgorithmConfig(clip_low=0.5, clip_high=0.5)
    fn = POLICY_LOSSES.get("gspo")

    def per_sequence(lp: torch.Tensor) -> torch.Tensor:
        return (fn(lp, old, advs, mask, cfg)[0] * mask / mask.sum(1, keepdim=True)).sum(1)

    assert gradcheck(per_sequence, (logprobs,))


def test_cispo_loss_and_gradient_follow_the_papers_formula_token_by_token() -> None:
    # MiniMax-M1 eqs. 4-5: J = sg[clip(r, 1 - eps_low, 1 + eps_high)] A log pi, loss = -J, so
    # d loss / d logp = -clip(r) A on every token, clipped ones included (PPO's get 0 there).
    torch.manual_seed(0)
    old = -torch.rand(3, 6, dtype=torch.float64) - 0.1
    logprobs = (old + 0.5 * torch.randn(3, 6, dtype=torch.float64)).requires_grad_()
    advs = torch.randn(3, 6, dtype=torch.float64)
    mask = (torch.rand(3, 6) > 0.25).double()
    loss, clipped = POLICY_LOSSES.get("cispo")(
        logprobs, old, advs, mask, AlgorithmConfig(clip_low=0.2, clip_high=0.28)
    )
    loss.sum().backward()
    for b in range(3):
        for k in range(6):
            lp, a, on = logprobs[b, k].item(), advs[b, k].item(), mask[b, k].item()
            r = math.exp(lp - old[b, k].item())
            w = min(max(r, 0.8), 1.28)
            assert loss[b, k].item() == pytest.approx(-w * a * lp * on, abs=1e-12)
            assert logprobs.grad[b, k].item() == pytest.approx(-w * a * on, abs=1e-12)
            assert clipped[b, k].item() == float(on == 1 and not 0.8 <= r <= 1.28)
    assert 0 < clipped.sum() < mask.sum()  # both kinds of token were checked


# ---------------------------------------------------------------- KL estimators


def test_kl_estimators_by_hand() -> None:
    # logp - ref = [0.5, -1]; x = ref - logp = [-0.5, 1].
    logprobs, ref = t([-1.0, -2.0]), t([-1.5, -1.0])
    assert close(KL_ESTIMATORS.get("k1")(logprobs, ref), [0.5, -1.0])
    assert close(KL_ESTIMATORS.get("k2")(logprobs, ref), [0.125, 0.5])
    assert close(KL_ESTIMATORS.get("k3")(logprobs, ref), [math.exp(-0.5) - 0.5, math.e - 2])
    assert KL_ESTIMATORS.get("k3")(logprobs, logprobs).abs().max() == 0


def test_k3_clamps_the_log_ratio_so_it_stays_finite() -> None:
    kl = KL_ESTIMATORS.get("k3")(t([0.0, 0.0]), t([-1000.0, 1000.0]))
    assert torch.allclose(kl, t([math.exp(-20) - 1 + 20, math.exp(20) - 1 - 20]), rtol=1e-6)


# ---------------------------------------------------------------- loss aggregation

AGG_MASK = [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]  # lengths 3, 1 and a dummy row
AGG_LOSS = [[1, 2, 3, GARBAGE], [4, GARBAGE, GARBAGE, GARBAGE], [GARBAGE] * 4]
AGG_CASES = {
    # name: (weights, count, loss = sum(loss * weights) / count)
    "token-mean": (AGG_MASK, 4.0, (1 + 2 + 3 + 4) / 4),
    "seq-mean-token-sum": (AGG_MASK, 2.0, (6 + 4) / 2),
    "seq-mean-token-mean": (
        [[1 / 3, 1 / 3, 1 / 3, 0], [1, 0, 0, 0], [0, 0, 0, 0]],
        2.0,
        (6 / 3 + 4 / 1) / 2,
    ),
    "seq-mean-token-sum-norm": (
        [[0.25, 0.25, 0.25, 0], [0.25, 0, 0, 0], [0, 0, 0, 0]],
        2.0,
        (6 / 4 + 4 / 4) / 2,
    ),
}


@pytest.mark.parametrize("name", list(AGG_CASES))
def test_aggregation_weights_and_count_by_hand(name: str) -> None:
    weights, count, expected = AGG_CASES[name]
    got_weights, got_count = LOSS_AGGREGATIONS.get(name)(t(AGG_MASK), 4)
    assert close(got_weights, weights)
    assert got_count.ndim == 0 and got_count.item() == count
    assert math.isclose(((t(AGG_LOSS) * got_weights).sum() / got_count).item(), expected)


@pytest.mark.parametrize("name", list(AGG_CASES))
@pytest.mark.parametrize("split", [1, 3, 4])
def test_aggregation_over_row_splits_equals_the_full_batch(name: str, split: int) -> None:
    torch.manual_seed(0)
    mask = (torch.rand(5, 6) > 0.4).float()
    mask[3] = 0.0  # a dummy row with an empty mask
    mask[0, 0] = 1.0  # at least one valid token
    loss = torch.randn(5, 6)
    fn = LOSS_AGGREGATIONS.get(name)
    weights, count = fn(mask, 6)
    full = (loss * weights).sum() / count
    halves = [fn(mask[rows], 6) + (loss[rows],) for rows in (slice(0, split), slice(split, 5))]
    numerator = sum((part_loss * w).sum() for w, _, part_loss in halves)
    assert torch.allclose(numerator / sum(c for _, c, _ in halves), full, atol=1e-6)


# ---------------------------------------------------------------- off-policy corrections

# pi_prox / pi_behav per token; column 3 is outside the mask and holds a huge log-ratio.
IS_RATIOS = [[0.25, 1.5, 3.0, 1.0], [1.2, 0.8, 1.0, 1.0], [3.0, 1.0, 1.0, 1.0], [0.6, 0.6, 1, 1]]
IS_MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]]
# Sequence ratios: 0.25 * 1.5 * 3 = 1.125, 1.2 * 0.8 = 0.96, 3, 0.6 * 0.6 = 0.36; their
# geometric means 1.125^(1/3) = 1.040, 0.96^(1/2) = 0.980, 3^(1/2) = 1.732, 0.6.
# is_cap 2, is_low 0.5, is_high 2, geo_low 0.95, geo_high 1.05.
IS_CASES = {
    "none": (IS_MASK, IS_MASK),
    "token-tis": ([[0.25, 1.5, 2, 0], [1.2, 0.8, 0, 0], [2, 1, 0, 0], [0.6, 0.6, 0, 0]], IS_MASK),
    "token-mis": (
        [[0, 1.5, 0, 0], [1.2, 0.8, 0, 0], [0, 1, 0, 0], [0.6, 0.6, 0, 0]],
        [[0, 1, 0, 0], [1, 1, 0, 0], [0, 1, 0, 0], [1, 1, 0, 0]],
    ),
    "icepop": (
        [[0, 1.5, 0, 0], [1.2, 0.8, 0, 0], [0, 1, 0, 0], [0.6, 0.6, 0, 0]],
        [[0, 1, 0, 0], [1, 1, 0, 0], [0, 1, 0, 0], [1, 1, 0, 0]],
    ),
    "geo-rs": (
        [[1, 1, 1, 0], [1, 1, 0, 0], [0] * 4, [0] * 4],
        [[1, 1, 1, 0], [1, 1, 0, 0], [0] * 4, [0] * 4],
    ),
    "seq-tis": (
        [[1.125] * 3 + [0], [0.96, 0.96, 0, 0], [2, 2, 0, 0], [0.36, 0.36, 0, 0]],
        IS_MASK,
    ),
    "seq-mis": (
        [[1.125] * 3 + [0], [0.96, 0.96, 0, 0], [0] * 4, [0] * 4],
        [[1, 1, 1, 0], [1, 1, 0, 0], [0] * 4, [0] * 4],
    ),
    "decoupled": ([[0.25, 1.5, 3, 0], [1.2, 0.8, 0, 0], [3, 1, 0, 0], [0.6, 0.6, 0, 0]], IS_MASK),
}


@pytest.mark.parametrize("name", list(IS_CASES))
def test_off_policy_weights_and_mask_by_hand(name: str) -> None:
    behaviour = -torch.ones(4, 4)
    proximal = (behaviour + torch.log(t(IS_RATIOS))).requires_grad_()
    with torch.no_grad():
        proximal[0, 3] = 1000.0  # outside the mask: ignored, no overflow
    cfg = AlgorithmConfig(is_cap=2.0, is_low=0.5, is_high=2.0, geo_low=0.95, geo_high=1.05)
    weights, mask = OFF_POLICY_CORRECTIONS.get(name)(proximal, behaviour, t(IS_MASK), cfg)
    expected_weights, expected_mask = IS_CASES[name]
    assert close(weights, expected_weights)
    assert torch.equal(mask, t(expected_mask))
    assert not weights.requires_grad


def _random_log_probs(seed: int, rows: int, cols: int, spread: float):
    torch.manual_seed(seed)
    behaviour = -3 * torch.rand(rows, cols)
    proximal = behaviour + spread * torch.randn(rows, cols)
    mask = (torch.rand(rows, cols) > 0.25).float()
    mask[:, 0] = 1.0  # no empty row
    return proximal, behaviour, mask


def test_icepop_keeps_and_weighs_only_tokens_whose_ratio_is_inside_alpha_beta() -> None:
    # IcePop (Ring-1T): M(k; alpha, beta) = k for alpha <= k <= beta, else 0 (out of the loss),
    # with k = pi_train / pi_infer of each sampled token; alpha, beta = 0.5, 5 here.
    proximal, behaviour, mask = _random_log_probs(1, 5, 8, spread=1.0)
    weights, kept = OFF_POLICY_CORRECTIONS.get("icepop")(
        proximal, behaviour, mask, AlgorithmConfig(is_low=0.5, is_high=5.0)
    )
    for b in range(5):
        for k in range(8):
            ratio = math.exp(proximal[b, k].item() - behaviour[b, k].item())
            inside = mask[b, k].item() == 1 and 0.5 <= ratio <= 5.0
            assert kept[b, k].item() == float(inside)
            assert weights[b, k].item() == pytest.approx(ratio if inside else 0.0, rel=1e-5)
    assert 0 < kept.sum() < mask.sum()  # both kinds of token were checked


def test_geo_rs_drops_whole_sequences_by_the_geometric_mean_of_their_ratios() -> None:
    # Geo-RS: g_i = (prod_t r_t)^(1 / |y_i|) over i's response tokens; the sequence stays in the
    # loss, with weight 1, iff geo_low <= g_i <= geo_high.
    proximal, behaviour, mask = _random_log_probs(2, 8, 5, spread=0.03)
    weights, kept = OFF_POLICY_CORRECTIONS.get("geo-rs")(
        proximal, behaviour, mask, AlgorithmConfig(geo_low=0.99, geo_high=1.01)
    )
    whole_rows = 0
    for b in range(8):
        ratios = [
            math.exp(proximal[b, k].item() - behaviour[b, k].item())
            for k in range(5)
            if mask[b, k].item() == 1
        ]
        inside = 0.99 <= math.prod(ratios) ** (1 / len(ratios)) <= 1.01
        whole_rows += inside
        assert kept[b].tolist() == [float(inside) * m for m in mask[b].tolist()]
        assert torch.equal(weights[b], kept[b])
    assert 0 < whole_rows < 8  # both kinds of sequence were checked


@pytest.mark.parametrize("name", list(IS_CASES))
def test_off_policy_weights_stay_finite_for_huge_log_ratios(name: str) -> None:
    proximal, behaviour = t([[500.0, -500.0]]), t([[0.0, 0.0]])
    weights, _ = OFF_POLICY_CORRECTIONS.get(name)(
        proximal, behaviour, t([[1, 1]]), AlgorithmConfig()
    )
    assert torch.isfinite(weights).all()


def test_mismatch_metrics_by_hand_overall_and_per_age() -> None:
    # Per token (d = log p_trainer - log p_engine, in the mask, kept by the correction, the
    # row's age); row 1 lost a token to the correction, its third column is padding.
    tokens = {
        0: [(0.1, True), (-0.2, True)],
        1: [(0.5, False), (0.0, True)],
        2: [(-1.0, True)],
    }
    ages = {0: 0, 1: 1, 2: 0}
    behaviour = -torch.ones(3, 3)
    proximal = behaviour.clone()
    mask, kept = torch.zeros(3, 3), torch.zeros(3, 3)
    for row, row_tokens in tokens.items():
        for col, (d, keep) in enumerate(row_tokens):
            proximal[row, col] += d
            mask[row, col], kept[row, col] = 1.0, float(keep)
    proximal[1, 2] = 50.0  # padding: never counted

    def expected(rows: list[int]) -> dict[str, float]:
        ds = [d for r in rows for d, _ in tokens[r]]
        return {
            "mismatch_k1": sum(-d for d in ds) / len(ds),  # log p_engine - log p_trainer
            "mismatch_k3": sum(math.exp(d) - 1 - d for d in ds) / len(ds),
            "kept_token_frac": sum(keep for r in rows for _, keep in tokens[r]) / len(ds),
            "kept_seq_frac": sum(all(keep for _, keep in tokens[r]) for r in rows) / len(rows),
        }

    want = {f"off_policy/{k}": v for k, v in expected([0, 1, 2]).items()}
    for age in (0, 1):
        rows = [r for r in tokens if ages[r] == age]
        want |= {f"off_policy/{k}_age{age}": v for k, v in expected(rows).items()}
    got = mismatch_metrics(proximal, behaviour, mask, kept, torch.tensor([0, 1, 0]))
    assert got == pytest.approx(want)
    overall = {k: v for k, v in want.items() if "_age" not in k}
    assert mismatch_metrics(proximal, behaviour, mask, kept, None) == pytest.approx(overall)


# ---------------------------------------------------------------- value loss and controls


def test_value_loss_takes_the_larger_of_plain_and_clipped_errors() -> None:
    # clip 0.2:
    #   v 1.0, old 0.8, R 1.5: (−0.5)^2 = .25; v_clip 1.0 -> .25        -> 0.125
    #   v 2.0, old 1.0, R 1.0: 1;            v_clip 1.2 -> .04          -> 0.5
    #   v 1.4, old 1.0, R 1.5: .01;          v_clip 1.2 -> .09 (larger) -> 0.045
    values, old, returns = t([[1.0, 2.0, 1.4, 9.0]]), t([[0.8, 1.0, 1.0, 0]]), t([[1.5, 1, 1.5, 0]])
    mask = t([[1, 1, 1, 0]])
    assert close(value_loss(values, old, returns, mask, 0.2), [[0.125, 0.5, 0.045, 0]])
    assert close(value_loss(values, old, returns, mask, 0.0), [[0.125, 0.5, 0.005, 0]])


def test_adaptive_kl_coef_moves_proportionally_with_a_clipped_error() -> None:
    # coef 0.1, target 0.1, 100 samples over a 1000 horizon:
    #   kl 0.15 -> error 0.5 clipped to 0.2  -> 0.1 * (1 + 0.2 * 0.1)  = 0.102
    #   kl 0.09 -> error -0.1                -> 0.1 * (1 - 0.1 * 0.1)  = 0.099
    #   kl 0    -> error -1 clipped to -0.2  -> 0.1 * (1 - 0.2 * 0.1)  = 0.098
    for kl, expected in [(0.15, 0.102), (0.09, 0.099), (0.0, 0.098)]:
        assert math.isclose(adaptive_kl_coef(0.1, kl, 0.1, 100, 1000), expected)
    with pytest.raises(ValueError, match="target > 0"):
        adaptive_kl_coef(0.1, 0.1, 0.0, 100, 1000)


def test_overlong_penalty_is_linear_over_the_buffer() -> None:
    # max_len 10, buffer 4: free up to 6, then -(len - 6) / 4 * penalty.
    lengths = torch.tensor([3, 6, 8, 10])
    assert close(overlong_penalty(lengths, 10, 4, 1.0), [0, 0, -0.5, -1.0])
    assert close(overlong_penalty(torch.tensor([9]), 10, 4, 2.0), [-1.5])
    assert torch.equal(overlong_penalty(lengths, 10, 0, 1.0), torch.zeros(4))


def test_dynamic_sampling_keeps_only_groups_with_different_scores() -> None:
    scores = t([1, 1, 0, 1, 0, 0, 0, 0, 2, 2, 2, 2])
    assert dynamic_sampling_keep(scores, 4).tolist() == [True, False, False]
    assert dynamic_sampling_keep(scores, 1).tolist() == [False] * 12


# ---------------------------------------------------------------- registries


def test_registries_hold_exactly_the_documented_names_each_with_a_docstring() -> None:
    expected = {
        ADVANTAGES: ["gae", "grpo", "reinforce_pp", "reinforce_pp_baseline", "rloo"],
        POLICY_LOSSES: ["cispo", "clipped", "gspo"],
        KL_ESTIMATORS: ["k1", "k2", "k3"],
        LOSS_AGGREGATIONS: [
            "seq-mean-token-mean",
            "seq-mean-token-sum",
            "seq-mean-token-sum-norm",
            "token-mean",
        ],
        OFF_POLICY_CORRECTIONS: [
            "decoupled",
            "geo-rs",
            "icepop",
            "none",
            "seq-mis",
            "seq-tis",
            "token-mis",
            "token-tis",
        ],
    }
    for registry, names in expected.items():
        assert registry.names() == names
        for name in names:
            assert registry.get(name).__doc__, f"{registry.kind} {name} has no docstring"


def test_registries_list_valid_names_on_a_typo() -> None:
    with pytest.raises(ValueError, match="valid: k1, k2, k3"):
        KL_ESTIMATORS.get("k4")
    with pytest.raises(ValueError, match="valid: gae, grpo, reinforce_pp, reinforce_pp_baseline"):
        ADVANTAGES.get("ppo")
    with pytest.raises(ValueError, match="valid: seq-mean-token-mean, .*token-mean"):
        LOSS_AGGREGATIONS.get("token_mean")
