"""The contract every rollout engine meets: what the RolloutWorker, its generation loop and
the offline evaluator call, and the request checks the engines share.

An engine is a plain class (no Ray) serving one policy version at a time. It samples with
behaviour log-probs after temperature and top-p, seeded per sample (`SamplingParams.seed_of`),
so that an engine gives the same samples for the same seeds and weights (two engines of one
kind do; vLLM and the torch engine draw differently); it steps many
samples at once; and it replaces its weights in place, bucket by bucket, from a weight-sync
channel (rl.sync.transport), refusing to generate while an update is half applied.
"""

from __future__ import annotations

from typing import Protocol

from rl.sync.transport import ChannelSpec
from rl.types import Sample, SamplingParams


class RolloutEngine(Protocol):
    version: int  # the policy version of the weights being served
    startup_seconds: float  # how long construction took

    # Stepping (rollout.engine_loop drives these for many concurrent calls).
    @property
    def num_running(self) -> int:
        """Samples started and not yet finished or aborted."""
        ...

    def start(self, samples: list[Sample], params: SamplingParams) -> None:
        """Start fresh or aborted (partial) samples; a partial one continues its prefix."""
        ...

    def step(self) -> list[Sample]:
        """One engine step; returns the samples that finished in it."""
        ...

    def abort(self) -> list[Sample]:
        """Stop every running sample; returns them partial (finish_reason "abort"), each with
        the tokens and log-probs it has."""
        ...

    # Whole calls.
    def generate(self, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        """Start `samples` and step until all have finished; returns them."""
        ...

    def score(self, sequences: list[list[int]], num_prompt_tokens: list[int]) -> list[list[float]]:
        """Temperature-1 log-probs of each sequence's tokens after its prompt."""
        ...

    # Weight sync (the receiving side).
    def open_weight_receiver(
        self, plan_json: str, channel_spec: ChannelSpec, first_member: int
    ) -> None:
        """Join the channel as members first_member .. first_member + TP size - 1."""
        ...

    def apply_weight_bucket(self, bucket: int, version: int) -> int:
        """Load bucket `bucket` of `version`; returns the bytes its busiest TP rank read."""
        ...

    def finish_weight_update(self, version: int) -> dict[str, float]:
        """Close the update: serve `version` from now on; returns the update's stats."""
        ...

    # Device memory, handed to a colocated trainer while it computes (GPU only).
    def release_memory(self) -> bool:
        """Free weights and KV cache; False where there is nothing to free (CPU)."""
        ...

    def reclaim_weights(self) -> None: ...

    def reclaim_memory(self) -> None: ...

    def take_peak_memory_bytes(self) -> int:
        """Peak memory since the previous call."""
        ...

    def close(self) -> None:
        """Stop the engine and whatever it started (processes, shared memory)."""
        ...


def check_startable(samples: list[Sample], params: SamplingParams, max_model_len: int) -> None:
    """Raise ValueError unless every sample is fresh or aborted and has room to generate."""
    for sample in samples:
        if sample.finish_reason not in ("", "abort"):
            raise ValueError(
                f"sample {sample.group_id}/{sample.index} already finished "
                f"({sample.finish_reason}); only fresh or aborted samples are generated"
            )
        if params.max_new_tokens - len(sample.response_ids) < 1:
            raise ValueError(
                f"sample {sample.group_id}/{sample.index} already has "
                f"{len(sample.response_ids)} tokens of max_new_tokens={params.max_new_tokens}"
            )
        if len(sample.prompt_ids) + params.max_new_tokens > max_model_len:
            raise ValueError(
                f"prompt of {len(sample.prompt_ids)} tokens + rollout.max_new_tokens="
                f"{params.max_new_tokens} exceeds rollout.max_model_len={max_model_len}"
            )


def check_scorable(
    sequences: list[list[int]], num_prompt_tokens: list[int], max_model_len: int
) -> None:
    """Raise ValueError unless each sequence has a prompt length inside it and fits the engine."""
    if len(num_prompt_tokens) != len(sequences):
        raise ValueError(f"{len(sequences)} sequences but {len(num_prompt_tokens)} prompt lengths")
    for seq, start in zip(sequences, num_prompt_tokens, strict=True):
        if not 1 <= start <= len(seq):
            raise ValueError(f"num_prompt_tokens={start} outside [1, {len(seq)}]")
        if len(seq) >= max_model_len:
            raise ValueError(
                f"sequence of {len(seq)} tokens needs rollout.max_model_len > {len(seq)}"
            )


def decode_responses(tokenizer: object, samples: list[Sample]) -> None:
    """Set each sample's response_text from its tokens, special tokens skipped (one batched
    decode is much cheaper than vLLM's per-token incremental detokenizer)."""
    if samples:
        texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
        for sample, text in zip(samples, texts, strict=True):
            sample.response_text = text
