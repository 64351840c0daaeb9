"""Data contracts: what crosses an actor boundary is one of these, never a dict of tensors."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from rl.config import Config


# Seeds: a run with seed s samples with base seed s * RUN_SEED_STRIDE; sample k of group g draws
# with base + g * n + k, moved on by RESUME_SEED_STRIDE per token of a resumed prefix. Group ids
# are unique in a run, so no two samples share a seed, however prompts are spread over workers.
RUN_SEED_STRIDE = 100_003
RESUME_SEED_STRIDE = 1_000_003
# The version of a response token the policy did not sample (a multi-turn observation).
NOT_SAMPLED = -1


@dataclass
class SamplingParams:
    """How the rollout engine samples. Temperature is applied to logits as vLLM applies it.

    Training's comes from the config (`for_training`); evaluation and tests state their own.
    """

    max_new_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    # Deterministic abort points: a sample stops, partial, each time its response length
    # reaches a multiple of this (0: never), to resume under the next policy version.
    stop_every: int = 0

    @classmethod
    def for_training(cls, cfg: Config) -> SamplingParams:
        """What the driver asks of the rollout engines in training."""
        return cls(
            max_new_tokens=cfg.rollout.max_new_tokens,
            n=cfg.algorithm.group_size,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            seed=cfg.run.seed * RUN_SEED_STRIDE,
        )

    def episode_seed(self, sample: Sample) -> int | None:
        """The seed of `sample` as a whole (None: unseeded): what an agent function is seeded
        with, each time its episode starts or resumes (rollout.api_agent_loop)."""
        if self.seed is None:
            return None
        return self.seed + sample.group_id * self.n + sample.index

    def seed_of(self, sample: Sample) -> int | None:
        """The seed `sample` draws its next token with (None: unseeded), so a seeded batch
        reproduces however prompts are spread over workers, and a resumed one continues."""
        seed = self.episode_seed(sample)
        if seed is None:
            return None
        return seed + RESUME_SEED_STRIDE * len(sample.response_ids)

    def stop_length(self, sample: Sample) -> int:
        """The response length at which `sample`, started now, stops: max_new_tokens
        (finish_reason "length"), or the next multiple of `stop_every` below it (then partial,
        finish_reason "abort")."""
        length = len(sample.response_ids)
        if self.stop_every:
            return min(self.max_new_tokens, (length // self.stop_every + 1) * self.stop_every)
        return self.max_new_tokens

    def length_finish(self, sample: Sample) -> str:
        """The finish_reason of a sample that reached its `stop_length`."""
        return "length" if len(sample.response_ids) >= self.max_new_tokens else "abort"


@dataclass
class Episode:
    """What a multi-turn agent's sample carries besides its tokens (rl.agents.episode runs it).

    `env` is the episode's environment, an `rl.agents.environment.Environment` (typed `Any`
    here: the contracts sit below the agents package), with its state; it travels, pickled,
    with the sample. `messages` and `tools` (function schemas) are the conversation as the chat
    template renders it. `turn_start`: response tokens before the turn being generated (the
    engine appends that turn's tokens after it). Counters feed the step's agent/* metrics.

    An agent function's episode (rl.agents.api_calls: it calls the rollout worker's
    OpenAI-compatible endpoint) has no `env`; it holds its data `example` and `calls`, one
    JSON object per call served: the request as normalised and the reply (None while that
    turn is being generated), so that the agent, run again from its start after a pause or a
    resume, is answered from them until it reaches the call that was in flight. A call whose
    history is not the episode's starts a new sequence; the earlier ones are its `segments`.
    """

    env: Any
    messages: list[dict[str, Any]]
    tools: list[dict] | None
    turn_start: int = 0
    num_turns: int = 0
    reward: float = 0.0  # the sum of the environment's step rewards
    turns_with_calls: int = 0  # turns with at least one tool call ...
    turns_well_formed: int = 0  # ... all of them well-formed, known and with valid arguments
    num_calls: int = 0
    num_runs: int = 0  # calls a tool worker ran
    # Failed calls by kind (rl.agents.tool_calls' and rl.agents.tool_pool's error kinds).
    errors: Counter = field(default_factory=Counter)
    tool_seconds: float = 0.0
    # (start, end) wall-clock times (time.time()) of the calls run since the driver last took
    # them for its trace (rl.run.scheduler.loop).
    tool_spans: list[tuple[float, float]] = field(default_factory=list)
    max_turns_reached: bool = False
    env_failures: int = 0  # steps of a user's environment that failed (rl.agents.env_pool)
    env_timeouts: int = 0  # of those, the ones over agent.env_timeout_s
    template_mismatches: int = 0  # observations the chat template could not append (ends it)
    example: dict[str, Any] | None = None  # an agent function's data example
    calls: list[dict[str, Any]] = field(default_factory=list)  # an agent function's calls
    served: int = 0  # of `calls`, those answered in the agent's current run
    # An agent function's sequences closed by prefix breaks, each a sample of its own tokens
    # (no episode) trained with the episode's advantage; the sample holds the last one.
    segments: list[Sample] = field(default_factory=list)
    refused_calls: int = 0  # calls past agent.max_turns or the token budget
    prefix_breaks: int = 0  # calls whose history is not the episode's so far
    replay_mismatches: int = 0  # a re-run agent that asked what it had not asked before

    @property
    def answer(self) -> str:
        """The last assistant message: what the task's reward scores."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")


@dataclass
class Sample:
    """One response to one prompt, generated or being generated.

    `logprobs[i]` is the behaviour policy's log-probability of `response_ids[i]` (at the
    sampling temperature) and `token_versions[i]` the policy version that sampled it, so the
    three lists have one entry per response token. A generation interrupted by a weight sync
    is a partial sample (finish_reason "abort"); resumed, it keeps its prefix and its new
    tokens carry the newer version, so the off-policy correction stays exact per token.

    A multi-turn agent's sample (`episode` set: `Episode`) holds the whole
    trajectory: every token after the prompt, sampled or inserted by the environment
    (observations, template text), with `loss_mask` 1 on the sampled ones. Inserted tokens
    carry log-prob 0.0 and version NOT_SAMPLED; nothing trains on them. `loss_mask` None:
    every response token was sampled (single-turn).
    """

    prompt_ids: list[int]
    group_id: int  # the prompt's id: samples of one prompt share it (unique within a run)
    index: int = 0  # position within its group, 0 .. n-1
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "stop" (EOS or stop string), "length", or "abort" (partial)
    response_text: str = ""
    # Filled by the trainer side before training (see rl.run.experience): the proximal policy's
    # and the frozen reference's log-probs and the critic's values, one per response token.
    old_logprobs: list[float] | None = None
    ref_logprobs: list[float] | None = None
    values: list[float] | None = None
    # Multi-turn only: 1 per sampled response token, 0 per inserted one (see the docstring);
    # while a turn is being generated it covers the tokens before that turn.
    loss_mask: list[int] | None = None
    episode: Episode | None = None
    # Engines that report their prefix cache (vLLM): the prompt tokens of the finished
    # requests that generated this sample (an agent's turn is one), and how many of them the
    # cache served instead of a prefill. None: the engine does not report it.
    request_prompt_tokens: int = 0
    cached_prompt_tokens: int | None = None
    # On-policy distillation (rl.run.experience): the frozen teacher's log-prob of each response
    # token, at the sampling temperature; filled with the other annotations.
    teacher_logprobs: list[float] | None = None
    # Mixture-of-experts policies with model.routing_replay (rl.expert_routing): the experts
    # the engine's routers chose, [positions, MoE layers, top-k] ids (uint8 or int16), one row
    # per position of prompt + response the engine ran, in order from position 0; the last
    # token is never run, so a finished sample holds one row fewer than its tokens. Each row
    # is recorded once, by the policy version that ran that position first.
    routed_experts: torch.Tensor | None = None

    @property
    def sampled_mask(self) -> list[int]:
        """1 per response token the policy sampled, 0 per token the environment inserted."""
        if self.loss_mask is None:
            return [1] * len(self.response_ids)
        assert len(self.loss_mask) == len(self.response_ids), "a turn is still being generated"
        return self.loss_mask

    @property
    def policy_version(self) -> int:
        """The oldest policy version among its sampled tokens (what the staleness bound
        limits)."""
        versions = [v for v in self.token_versions if v != NOT_SAMPLED]
        assert versions, "a sample without sampled tokens has no policy version"
        return min(versions)

    @property
    def is_partial(self) -> bool:
        return self.finish_reason == "abort"


def fresh_samples(prompts: list[list[int]], n: int, group_ids: list[int]) -> list[Sample]:
    """n empty samples per prompt, ordered prompt by prompt, ready to generate."""
    if len(group_ids) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(group_ids)} group ids")
    return [
        Sample(prompt_ids=list(prompt), group_id=group_id, index=k)
        for prompt, group_id in zip(prompts, group_ids, strict=True)
        for k in range(n)
    ]


@dataclass
class Batch:
    """A padded training batch built from samples (see `rl.run.batching.build_batch`).

    Shapes: B sequences, T = longest prompt+response in the batch. Position t of
    `input_ids` predicts `input_ids[t+1]`; per-token tensors are aligned to the *target*
    token, so `loss_mask[b, t]` is 1 when `input_ids[b, t+1]` is a response token.
    """

    input_ids: torch.Tensor  # [B, T] long, right-padded with pad_id
    attention_mask: torch.Tensor  # [B, T] long, 1 on real tokens
    loss_mask: torch.Tensor  # [B, T-1] float, 1 on response targets that are trained on
    behaviour_logprobs: torch.Tensor  # [B, T-1] float, recorded by the rollout engine
    old_logprobs: torch.Tensor  # [B, T-1] float, the proximal policy: behaviour or recomputed
    advantages: torch.Tensor  # [B, T-1] float, 0 outside the response
    ref_logprobs: torch.Tensor | None = None  # [B, T-1] float, frozen reference policy
    is_weights: torch.Tensor | None = None  # [B, T-1] float, off-policy correction (detached)
    returns: torch.Tensor | None = None  # [B, T-1] float, value targets (PPO critic)
    old_values: torch.Tensor | None = None  # [B, T-1] float, critic values at generation
    teacher_logprobs: torch.Tensor | None = None  # [B, T-1] float, distillation's teacher
    # [B, T, MoE layers, top-k] int16 per input position: the experts to route to (the rollout
    # engine's choice, rl.expert_routing), -1 where the router chooses (padding, unrecorded).
    routing: torch.Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    def trim(self, num_tokens: int) -> Batch:
        """The first `num_tokens` positions of every row (per-token tensors: one fewer), for
        rows whose real tokens all lie within them."""
        return Batch(
            **{
                f.name: None
                if (t := getattr(self, f.name)) is None
                else t[:, : num_tokens - (t.shape[1] != self.input_ids.shape[1])]
                for f in fields(self)
            }
        )

    def rows_with_advantage(self) -> torch.Tensor:
        """Indices [R] of the rows whose advantage is non-zero on some loss-mask token."""
        moving = (self.advantages != 0) & (self.loss_mask > 0)
        return moving.any(dim=1).nonzero().flatten()

    def select(self, index: torch.Tensor | slice) -> Batch:
        """Rows `index` of every tensor (a micro- or mini-batch)."""
        return Batch(
            **{
                f.name: None if (t := getattr(self, f.name)) is None else t[index]
                for f in fields(self)
            }
        )


class PolicyObjective(Protocol):
    """What the policy trainer minimises, handed to it by the driver (rl.algorithms.objective
    builds it from the recipe), so the trainer knows no algorithm by name.

    Shapes as `Batch`: logprobs and entropy [B, T-1] under the current policy.
    """

    kl_in_loss: bool  # the loss has a KL-to-reference term (its metric is reported)
    forward_correction: str | None  # an off-policy correction computed from the forward
    zero_advantage_rows_are_inert: bool  # a row with advantage 0 everywhere has no gradient

    def token_count(self, batch: Batch) -> float:
        """The loss's denominator over the whole mini-batch `batch`."""
        ...

    def loss(
        self, logprobs: torch.Tensor, entropy: torch.Tensor, batch: Batch, denominator: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of one micro-batch divided by `denominator`, and its detached metrics."""
        ...

    # A mixture of experts: per MoE layer of one forward, the router logits [N, E] and the
    # experts the tokens were routed to [N, k], over the tokens of `mask` [N].
    def router_loss(
        self, logits: list[torch.Tensor], experts: list[torch.Tensor], mask: torch.Tensor
    ) -> torch.Tensor:
        """The router losses' term (0 when their coefficients are): a mean over the tokens."""
        ...

    def router_tally(
        self, logits: list[torch.Tensor], experts: list[torch.Tensor], mask: torch.Tensor
    ) -> torch.Tensor:
        """Expert-load counts and loss sums that add over micro-batches and ranks."""
        ...

    def router_metrics(self, tally: torch.Tensor) -> dict[str, float]:
        """The moe/* metrics of a sum of `router_tally`s."""
        ...


class ValueLoss(Protocol):
    """The critic's loss per token, [B, T-1], 0 off the mask (rl.algorithms.value_loss)."""

    def __call__(
        self,
        values: torch.Tensor,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        mask: torch.Tensor,
        clip: float,
    ) -> torch.Tensor: ...
