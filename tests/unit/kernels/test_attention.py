"""`kernels.attention`: the explicit product equals SDPA, packed rows attend within their
segments as under transformers' packed mask, and models load and save with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import find_packed_sequence_indices, packed_sequence_mask_function

from kernels.attention import (
    ATTENTION,
    MAX_EXPLICIT_KEYS,
    Segments,
    attention,
    packed_attention,
    uses_explicit_product,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16
_MODULE = nn.Module()  # what transformers passes: only `training` and the GQA groups are read
_MODULE.num_key_value_groups = NUM_HEADS // NUM_KV_HEADS


def _qkv(num_queries: int, num_keys: int, batch: int = 3, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, NUM_HEADS, num_queries)] + [(batch, NUM_KV_HEADS, num_keys)] * 2
    return [torch.randn(*s, HEAD_DIM, generator=gen).bfloat16().requires_grad_() for s in shapes]


def _padding_mask(lengths: list[int], num_keys: int, left: bool = False) -> torch.Tensor:
    """SDPA's boolean [B, 1, T, T] causal mask over rows padded to `num_keys` (True: attend)."""
    positions = torch.arange(num_keys)
    real = torch.stack(
        [positions >= num_keys - n if left else positions < n for n in lengths]
    )  # [B, T]
    causal = positions[None, :] <= positions[:, None]
    return (causal[None] & real[:, None, :])[:, None]


def _sdpa_fp32(q, k, v, mask) -> torch.Tensor:
    """SDPA on fp32 copies: the reference both half-precision paths are held to."""
    q32, k32, v32 = (t.float() for t in (q, k, v))
    return sdpa_attention_forward(_MODULE, q32, k32, v32, mask, scaling=HEAD_DIM**-0.5)[0]


def _check_against_sdpa(q, k, v, mask, valid_queries: torch.Tensor | None = None) -> None:
    """Outputs, and gradients of a fixed random upstream, within bf16 rounding of fp32 SDPA's."""
    assert uses_explicit_product(q, k)
    out = attention(_MODULE, q, k, v, mask, scaling=HEAD_DIM**-0.5)[0]
    expected = _sdpa_fp32(q, k, v, mask)
    keep = torch.ones(out.shape[:2], dtype=torch.bool) if valid_queries is None else valid_queries
    upstream = (
        torch.randn(out.shape, generator=torch.Generator().manual_seed(1)) * keep[..., None, None]
    )
    torch.testing.assert_close(out.float()[keep], expected[keep], atol=2e-2, rtol=2e-2)
    grads = torch.autograd.grad((out.float() * upstream).sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * upstream).sum(), (q, k, v))
    for grad, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad.float(), want.float(), atol=3e-2, rtol=3e-2)


def test_explicit_product_equals_sdpa_on_right_padded_rows() -> None:
    q, k, v = _qkv(12, 12)
    _check_against_sdpa(q, k, v, _padding_mask([12, 7, 3], 12))


def test_explicit_product_without_a_mask_is_causal_from_the_last_keys() -> None:
    """None is SDPA's skipped causal mask: full rows, or one decoding query per row."""
    for num_queries in (9, 1):
        q, k, v = _qkv(num_queries, 9)
        causal = torch.ones(9, 9, dtype=torch.bool).tril()[-num_queries:]
        out = attention(_MODULE, q, k, v, None, scaling=HEAD_DIM**-0.5)[0]
        expected = _sdpa_fp32(q, k, v, causal[None, None].expand(3, 1, -1, -1))
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_left_padded_queries_that_see_no_key_stay_finite() -> None:
    """Prefilling left-padded prompts: padding queries attend to nothing and must not give NaN,
    while the real queries match SDPA."""
    lengths = [10, 6, 2]
    q, k, v = _qkv(10, 10)
    mask = _padding_mask(lengths, 10, left=True)
    out = attention(_MODULE, q, k, v, mask, scaling=HEAD_DIM**-0.5)[0]
    assert torch.isfinite(out).all()
    real = torch.stack([torch.arange(10) >= 10 - n for n in lengths])  # [B, T] queries
    _check_against_sdpa(q, k, v, mask, valid_queries=real)


def test_fp32_long_keys_and_gpus_go_to_sdpa() -> None:
    short = torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16)
    long = torch.zeros(1, 1, MAX_EXPLICIT_KEYS + 1, 8, dtype=torch.bfloat16)
    assert uses_explicit_product(short, short)
    assert not uses_explicit_product(short, long)
    assert not uses_explicit_product(short.float(), short.float())
    assert not uses_explicit_product(short.to("meta"), short.to("meta"))
    q, k, v = _qkv(6, 6)
    q, k, v = (t.detach().float() for t in (q, k, v))
    out = attention(_MODULE, q, k, v, None, scaling=HEAD_DIM**-0.5)[0]
    torch.testing.assert_close(out, _sdpa_fp32(q, k, v, None), atol=0, rtol=0)


# Two packed rows of width 9: samples of 4 and 3 and a tail of 2; one of 9.
ROWS, WIDTH = [[4, 3], [9]], 9


def test_segments_gather_samples_of_similar_lengths_and_scatter_them_back() -> None:
    segments = Segments.of_rows(ROWS, WIDTH)
    # Flash attention's runs: the tail of 2 is one of its own.
    assert segments.starts.tolist() == [0, 4, 7, 9, 18] and segments.longest == 9
    # Samples of similar lengths gathered together, the longest first: 9 alone (4 < 0.75 x
    # 9), then 4 and 3 (3 >= 0.75 x 4), 3 padded with its last position.
    assert [gather.tolist() for gather in segments.gathers] == [
        [list(range(9, 18))],
        [[0, 1, 2, 3], [4, 5, 6, 6]],
    ]
    # Scattering the gathered samples back gives every sample position its own value and
    # the tail the extra last slot.
    flat = torch.arange(18)
    gathered = [flat[gather].flatten() for gather in segments.gathers]
    gathered = torch.cat([*gathered, torch.tensor([-1])])
    assert gathered[segments.scatter].tolist() == [*range(7), -1, -1, *range(9, 18)]


def _packed_mask(rows: list[list[int]]) -> torch.Tensor:
    """[R, 1, W, W] from transformers' own packed-sequence mask function over the rows'
    restarted positions, a tail a sample of its own (True: attend)."""
    runs = [[*row, WIDTH - sum(row)] if sum(row) < WIDTH else row for row in rows]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in runs])
    mask_function = packed_sequence_mask_function(find_packed_sequence_indices(positions))
    width = positions.shape[1]
    index = torch.arange(width)
    same = torch.stack(
        [mask_function(b, 0, index[:, None], index[None, :]) for b in range(len(rows))]
    )
    return (same & (index[None, :] <= index[:, None]))[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rows_attend_within_their_segments_as_under_the_packed_mask(dtype) -> None:
    """bf16 rows of 9 take the explicit product, fp32 ones SDPA: both as masked SDPA in fp32."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in _qkv(9, 9, batch=len(ROWS)))
    out = packed_attention(
        _MODULE, q, k, v, None, scaling=HEAD_DIM**-0.5, segments=Segments.of_rows(ROWS, WIDTH)
    )[0]
    expected = _sdpa_fp32(q, k, v, _packed_mask(ROWS))
    # The tail (row 0's last 2 positions) attends to nothing: 0, which nothing reads.
    assert not out[0, 7:].any()
    sample = torch.ones(out.shape[:2], dtype=torch.bool)
    sample[0, 7:] = False
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(out.float()[sample], expected[sample], **tolerance)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    upstream[0, 7:] = 0
    grads = torch.autograd.grad((out.float() * upstream).sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * upstream).sum(), (q, k, v))
    tolerance = {"atol": 3e-2, "rtol": 3e-2} if dtype == torch.bfloat16 else {}
    for grad, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad.float(), want.float(), **tolerance)


def test_rows_of_one_sample_each_attend_causally_without_gathering() -> None:
    segments = Segments.of_rows([[5], [3]], 6)
    assert segments.gathers == () and segments.scatter is None
    assert segments.starts.tolist() == [0, 5, 6, 9, 12] and segments.longest == 5
    q, k, v = (t.detach() for t in _qkv(6, 6, batch=2))
    torch.testing.assert_close(
        packed_attention(_MODULE, q, k, v, None, scaling=0.25, segments=segments)[0],
        attention(_MODULE, q, k, v, None, scaling=0.25)[0],
        atol=0,
        rtol=0,
    )


def test_rows_without_segments_attend_as_attention_does() -> None:
    q, k, v = (t.detach() for t in _qkv(6, 6))
    mask = _padding_mask([6, 4, 2], 6)
    torch.testing.assert_close(
        packed_attention(_MODULE, q, k, v, mask, scaling=HEAD_DIM**-0.5)[0],
        attention(_MODULE, q, k, v, mask, scaling=HEAD_DIM**-0.5)[0],
        atol=0,
        rtol=0,
    )


@pytest.fixture
def bf16_model(tiny_model_dir: Path) -> nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.bfloat16, attn_implementation=ATTENTION
    ).eval()


def test_packed_samples_attend_only_within_themselves(bf16_model: nn.Module) -> None:
    """Two samples end to end with restarted positions give each sample's own logits: the
    packed mask from transformers reaches the explicit product."""
    gen = torch.Generator().manual_seed(0)
    first, second = (torch.randint(3, 100, (1, n), generator=gen) for n in (7, 5))
    packed = torch.cat([first, second], dim=1)
    positions = torch.cat([torch.arange(7), torch.arange(5)])[None]
    with torch.no_grad():
        together = bf16_model(input_ids=packed, position_ids=positions, use_cache=False).logits
        alone = [bf16_model(input_ids=ids).logits for ids in (first, second)]
    torch.testing.assert_close(together, torch.cat(alone, dim=1), atol=1e-2, rtol=1e-2)


def test_a_saved_model_does_not_name_the_attention(bf16_model: nn.Module, tmp_path: Path) -> None:
    """Exported checkpoints load anywhere (vLLM, plain transformers) without our registry."""
    bf16_model.save_pretrained(tmp_path)
    assert ATTENTION not in json.dumps(json.loads((tmp_path / "config.json").read_text()))
