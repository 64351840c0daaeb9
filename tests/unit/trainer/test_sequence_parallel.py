"""Ulysses sequence parallelism without a process group: the split of packed rows over N ranks
and its inverse, the head exchange simulated between N ranks, and what the model and the
recipe checks refuse."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2MoeConfig
from transformers.integrations.sdpa_attention import repeat_kv

from rl.config import TrainerConfig
from rl.config.recipe import ConfigError, load_config
from rl.types import Batch
from trainer.packing import IGNORE, packed_input
from trainer.ranks import micro_batches
from trainer.sequence_parallel import (
    SP_ATTENTION,
    heads_from_received,
    heads_to_send,
    kv_repeats,
    merge_slices,
    padded_width,
    positions_to_send,
    prepare_model,
    row_from_received,
    shard_input,
)

REPO = Path(__file__).resolve().parents[3]
# Ragged samples: the longest (11) sets the rows' width, odd so that N = 2 widens the rows; 1
# and 2 are shorter than N = 3 or 4.
LENGTHS = [11, 1, 7, 2, 9, 4, 5, 3]


def _batch(lengths: list[int]) -> Batch:
    gen = torch.Generator().manual_seed(0)
    width = max(lengths)
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    input_ids = torch.randint(1, 64, (len(lengths), width), generator=gen) * mask
    loss_mask = mask[:, 1:].float()
    return Batch(input_ids, mask, loss_mask, loss_mask, loss_mask, loss_mask)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_the_shards_of_packed_rows_put_back_together_score_every_sample_token(size: int) -> None:
    batch = _batch(LENGTHS)
    inputs = packed_input(batch, padded_width(max(LENGTHS), size))
    width = inputs.input_ids.shape[1]
    assert width % size == 0 and width - size < max(LENGTHS) <= width
    shards = [shard_input(inputs, rank, size) for rank in range(size)]
    chunk = width // size
    assert all(shard.input_ids.shape == (inputs.input_ids.shape[0], chunk) for shard in shards)
    # A chunk boundary falls inside a sample: the next chunk starts mid-sample.
    assert any((shard.position_ids[:, 0] > 0).any() for shard in shards[1:])
    # The targets of every chunk, joined and put back into the padded layout, are each
    # sample's next tokens (0 at padding): the batch's own tokens, shifted.
    joined = torch.cat([shard.targets for shard in shards], dim=1)
    expected = batch.input_ids[:, 1:] * batch.attention_mask[:, 1:]
    assert torch.equal(merge_slices(joined, inputs), expected)
    # What no sample scores is IGNORE: the rows' tails, and each sample's last token.
    assert (joined == IGNORE).sum() == joined.numel() - sum(n - 1 for n in LENGTHS)
    ids = torch.cat([shard.input_ids for shard in shards], dim=1)
    positions = torch.cat([shard.position_ids for shard in shards], dim=1)
    assert torch.equal(ids, inputs.input_ids) and torch.equal(positions, inputs.position_ids)
    assert all(shard.segments is inputs.segments for shard in shards)  # the whole rows'


def test_a_sample_shorter_than_the_ranks_is_split_like_any_other() -> None:
    # One row of samples of 2, 1 and 1 tokens over 4 ranks: chunks of one position, the
    # 2-token sample across ranks 0 and 1.
    batch = _batch([1, 2, 1])
    inputs = packed_input(batch)
    assert inputs.input_ids.shape == (2, 2)  # the longest sample is 2 wide: 2 rows
    inputs = packed_input(batch, width=4)
    shards = [shard_input(inputs, rank, 4) for rank in range(4)]
    assert [shard.position_ids.item() for shard in shards] == [0, 1, 0, 0]
    # Only the 2-token sample scores a token (its second), from rank 0's position.
    second = batch.input_ids[1, 1].item()
    assert [shard.targets.item() for shard in shards] == [second, IGNORE, IGNORE, IGNORE]
    joined = torch.cat([shard.targets for shard in shards], dim=1)
    expected = batch.input_ids[:, 1:] * batch.attention_mask[:, 1:]
    assert torch.equal(merge_slices(joined, inputs), expected)
    # The whole row's segments keep each sample to itself across the chunks.
    assert shards[0].segments.starts.tolist() == [0, 2, 3, 4]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size"), [(4, 1, 2), (2, 1, 2), (4, 4, 2), (6, 2, 3), (8, 2, 4)]
)
def test_the_exchanged_heads_attend_over_the_whole_row_as_one_rank_would(
    heads: int, kv_heads: int, size: int
) -> None:
    """N ranks simulated in one process: each holds 1/N of the positions of a causal row; the
    all-to-all hands rank r chunk r of every rank's send buffer."""
    gen = torch.Generator().manual_seed(heads * 10 + size)
    width, dim = 4 * size, 8
    query = torch.randn(2, heads, width, dim, generator=gen)
    key, value = torch.randn(2, 2, kv_heads, width, dim, generator=gen)
    groups = heads // kv_heads
    whole = scaled_dot_product_attention(
        query, repeat_kv(key, groups), repeat_kv(value, groups), is_causal=True
    ).transpose(1, 2)  # [B, W, H, D]
    chunk = width // size

    def exchange(sent: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.stack([sent[j][r] for j in range(size)]) for r in range(size)]

    repeats = kv_repeats(kv_heads, size)
    rows = {}
    for name, states in (
        ("query", query),
        ("key", repeat_kv(key, repeats)),
        ("value", repeat_kv(value, repeats)),
    ):
        local = [states[:, :, r * chunk : (r + 1) * chunk] for r in range(size)]
        received = exchange([heads_to_send(x, size) for x in local])
        rows[name] = [row_from_received(x) for x in received]
    outs = []
    for r in range(size):
        q, k, v = rows["query"][r], rows["key"][r], rows["value"][r]
        local_groups = q.shape[1] // k.shape[1]
        out = scaled_dot_product_attention(
            q, repeat_kv(k, local_groups), repeat_kv(v, local_groups), is_causal=True
        )
        outs.append(positions_to_send(out.transpose(1, 2), size))
    for r, received in enumerate(exchange(outs)):
        mine = whole[:, r * chunk : (r + 1) * chunk]
        torch.testing.assert_close(heads_from_received(received), mine, rtol=1e-6, atol=1e-6)


def test_a_model_is_refused_where_its_heads_or_layers_do_not_split_and_moe_runs() -> None:
    def meta(config) -> torch.nn.Module:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)

    small = {"hidden_size": 16, "num_hidden_layers": 2, "intermediate_size": 16}
    model = meta(Qwen2Config(num_attention_heads=2, num_key_value_heads=1, **small))
    with pytest.raises(ValueError, match=r"sequence_parallel=4 .* m has num_attention_heads=2"):
        prepare_model(model, 4, "m")
    prepare_model(model, 2, "m")  # 1 key/value head: repeated twice
    assert model.config._attn_implementation == SP_ATTENTION
    sliding = Qwen2Config(
        num_attention_heads=2,
        num_key_value_heads=1,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
        **small,
    )
    with pytest.raises(ValueError, match=r"sliding_attention.*full-attention models only"):
        prepare_model(meta(sliding), 2, "m")
    # A mixture of experts runs (its router calls are gathered over the group).
    moe = meta(Qwen2MoeConfig(num_attention_heads=2, num_key_value_heads=1, num_experts=2, **small))
    prepare_model(moe, 2, "m")
    assert moe.config._attn_implementation == SP_ATTENTION


def test_the_ranks_of_a_group_run_the_same_micro_batches_and_the_groups_split_the_rows() -> None:
    batch = _batch(LENGTHS)
    cfg = TrainerConfig(packing=True, sequence_parallel=2, micro_batch_tokens=11)
    rows = [
        [micro_rows.tolist() for _, _, micro_rows in micro_batches(batch, rank, 4, cfg, "cpu")]
        for rank in range(4)
    ]
    assert rows[0] == rows[1] and rows[2] == rows[3]
    assert sorted(row for micro in rows[0] + rows[2] for row in micro) == list(range(8))
    # A group's micro-batch holds 2 x 11 positions: two packed rows of 11.
    assert max(len(micro) for micro in rows[0] + rows[2]) > 2


RECIPE = REPO / "recipes/grpo_addition_cpu.yaml"
SP2 = ["trainer.sequence_parallel=2", "trainer.packing=true"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.sequence_parallel=0"], r"trainer.sequence_parallel must be >= 1"),
        (["trainer.sequence_parallel=3"], r"sequence_parallel=3 must divide .*num_workers=2"),
        (["trainer.sequence_parallel=2"], r"does not run with trainer.packing=false"),
        (
            ["trainer.sequence_parallel=2", "trainer.packing=true", "trainer.compile=true"],
            r"does not run with trainer.compile",
        ),
        (
            [*SP2, "algorithm.advantage=gae", "critic.num_workers=1"],
            r"sequence_parallel=2 must divide critic.num_workers \(its ranks: 1\)",
        ),
        (
            [*SP2, "teacher.path=/teacher", "algorithm.distill_coef=1", "teacher.num_workers=3"],
            r"sequence_parallel=2 must divide teacher.num_workers \(its ranks: 3\)",
        ),
    ],
)
def test_the_recipe_checks_refuse_what_sequence_parallelism_does_not_run_with(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(RECIPE, overrides)


def test_a_critic_and_a_teacher_run_sequence_parallel_on_ranks_of_their_own() -> None:
    cfg = load_config(
        RECIPE, [*SP2, "algorithm.advantage=gae", "teacher.path=/t", "algorithm.distill_coef=1"]
    )
    assert (cfg.critic_world_size(), cfg.teacher_world_size()) == (2, 2)


def test_the_sequences_of_a_step_split_over_the_data_parallel_ranks_only() -> None:
    # 1 x 2 sequences over 4 ranks in one sequence-parallel group: one data-parallel rank.
    step = ["run.prompts_per_step=1", "algorithm.group_size=2", "trainer.num_workers=4"]
    with pytest.raises(ConfigError, match=r"2 sequences must split evenly .* = 4"):
        load_config(RECIPE, step)
    cfg = load_config(RECIPE, [*step, "trainer.sequence_parallel=4", "trainer.packing=true"])
    assert cfg.trainer.sequence_parallel == 4
