"""Multi-turn masks through the real training path: the tokens an environment inserted into an
episode (observations, template text) get no gradient and no advantage, and GAE's recursion
steps over them from one sampled token to the next."""

from __future__ import annotations

import pytest
import torch

from rl.agents.environment import ToolUse
from rl.agents.episode import start_group
from rl.agents.trajectory import add_observation, end_turn
from rl.algorithms.objective import Objective
from rl.config import BaseBuildConfig, Config
from rl.run.batching import build_batch
from rl.run.experience import prepare_batch
from rl.types import NOT_SAMPLED, Sample
from tests.helpers.chat_templates import qwen_tokenizer
from tests.unit.rl.algorithms.tensors import GARBAGE, close
from trainer.hf_model import new_model

TURN_1 = (
    "Let me check the weather in Paris.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
RESULT_1 = '{"temperature": 21, "sky": "sunny"}'
TURN_2 = "It is sunny and 21 degrees in Paris."
# Every term of the loss is on (KL to the reference, entropy bonus): none may leak through
# the mask. GAE without whitening, so advantages are as the recursion gives them.
ALGORITHM = {
    "advantage": "gae",
    "gamma": 0.5,
    "lam": 0.8,
    "whiten_advantages": False,
    "kl_coef": 0.05,
    "entropy_coef": 0.01,
}


def config(**algorithm: object) -> Config:
    return Config(
        model={"path": "unused"},
        algorithm=ALGORITHM | algorithm,
        rollout={"temperature": 0.8},
    )


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float):
    """(log-prob of each next token, entropy), [B, T-1], from logits [B, T, V]."""
    log_p = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    picked = log_p.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return picked, -(log_p.exp() * log_p).sum(dim=-1)


@pytest.fixture(scope="module")
def episode_run():
    """A tiny real Qwen2; a two-turn episode (turn, tool result, turn) played through
    rl.agents.trajectory and a single-turn sample, annotated as the trainer side would:
    behaviour log-probs as the policy gave them (ratio 1), reference log-probs and critic
    values on every response token, observations included."""
    tokenizer = qwen_tokenizer()
    cfg = config()
    shape = BaseBuildConfig(
        hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64
    )
    model = new_model(shape, tokenizer, seed=0).eval()

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    (episode,) = start_group(ToolUse, tokenizer, {"prompt": "Weather?"}, None, 1, group_id=0)
    turn_1, turn_2 = encode(TURN_1) + [im_end], encode(TURN_2) + [im_end]

    def generate(turn: list[int]) -> None:  # the engine's part
        episode.response_ids += turn
        episode.logprobs += [-1.0] * len(turn)
        episode.token_versions += [0] * len(turn)

    generate(turn_1)
    end_turn(tokenizer, episode)
    observation = add_observation(tokenizer, episode, [{"role": "tool", "content": RESULT_1}])
    generate(turn_2)
    end_turn(tokenizer, episode)
    single = Sample(encode("What is the weather in Paris today?"), group_id=1)
    single.response_ids = encode(TURN_2) + [im_end]
    single.logprobs = [-1.0] * len(single.response_ids)
    single.token_versions = [0] * len(single.response_ids)
    samples = [episode, single]

    with torch.no_grad():
        batch = build_batch(samples, tokenizer.pad_token_id)
        logits = model(batch.input_ids, attention_mask=batch.attention_mask).logits
        policy, _ = token_logprobs(logits, batch.input_ids, cfg.rollout.temperature)
    generator = torch.Generator().manual_seed(0)
    for row, sample in enumerate(samples):
        mask = sample.sampled_mask
        at = slice(len(sample.prompt_ids) - 1, len(sample.prompt_ids) + len(mask) - 1)
        sample.logprobs = [
            lp if m else 0.0 for lp, m in zip(policy[row, at].tolist(), mask, strict=True)
        ]
        sample.ref_logprobs = (policy[row, at] + 0.3).tolist()
        sample.values = torch.rand(len(mask), generator=generator).tolist()
    assert episode.response_ids == turn_1 + observation + turn_2
    observed = range(len(turn_1), len(turn_1) + len(observation))  # response indices
    return tokenizer, model, samples, observed


def test_an_observation_token_never_receives_gradient(episode_run):
    tokenizer, model, samples, observed = episode_run
    cfg = config()
    batch, _, _ = prepare_batch(
        cfg, samples, [1.0, 0.0], tokenizer.pad_token_id, cfg.algorithm.kl_coef
    )
    objective = Objective.from_config(cfg)
    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=batch.attention_mask).logits
    logits.requires_grad_(True)
    logprobs, entropy = token_logprobs(logits, batch.input_ids, cfg.rollout.temperature)
    loss, _ = objective.loss(logprobs, entropy, batch, objective.token_count(batch))
    loss.backward()
    # Position t's logits score target t + 1 alone: its gradient is that target's loss's.
    grad = logits.grad[:, :-1].abs().sum(dim=-1)  # [B, T-1]

    episode, single = samples
    start = len(episode.prompt_ids) - 1  # the target of response token i is start + i
    inserted = [start + i for i in observed]
    sampled = [start + i for i in range(len(episode.response_ids)) if i not in observed]
    assert len(inserted) > 0 and len(sampled) > 0
    assert torch.equal(grad[0, inserted], torch.zeros(len(inserted)))
    assert bool((grad[0, sampled] > 0).all())
    # Nothing moves the prompt's targets or the padding either.
    assert torch.equal(grad[0, :start], torch.zeros(start))
    single_start = len(single.prompt_ids) - 1
    single_end = single_start + len(single.response_ids)
    assert bool((grad[1, single_start:single_end] > 0).all())
    assert torch.equal(grad[1, single_end:], torch.zeros(grad.shape[1] - single_end))


def test_gae_gives_observations_no_advantage_and_carries_over_them():
    # Prompt [1, 2]; sampled s0 s1 (values 0.5, 0.2), observation o o (critic values GARBAGE:
    # unused), sampled s2 (value 0.4), episode score 1 on s2. gamma 0.5, lam 0.8:
    # gamma * lam = 0.4; the step after s1 is s2, as if the observation were not there.
    #   s2: delta = 1 - 0.4 = 0.6;                        A = 0.6
    #   s1: delta = 0.5 * 0.4 - 0.2 = 0;                  A = 0 + 0.4 * 0.6 = 0.24
    #   s0: delta = 0.5 * 0.2 - 0.5 = -0.4;               A = -0.4 + 0.4 * 0.24 = -0.304
    # returns = A + V: s0 0.196, s1 0.44, s2 1.0.
    sample = Sample(
        prompt_ids=[1, 2],
        group_id=0,
        response_ids=[3, 4, 5, 6, 7],
        logprobs=[-0.1, -0.2, 0.0, 0.0, -0.3],
        token_versions=[0, 0, NOT_SAMPLED, NOT_SAMPLED, 0],
        loss_mask=[1, 1, 0, 0, 1],
        values=[0.5, 0.2, GARBAGE, GARBAGE, 0.4],
    )
    cfg = config(kl_coef=0.0)  # no reference: the rewards are the score alone
    batch, _, _ = prepare_batch(cfg, [sample], [1.0], 0, cfg.algorithm.kl_coef)
    # Targets: s0 at 1, s1 at 2, the observation at 3 and 4, s2 at 5.
    assert close(batch.advantages, [[0, -0.304, 0.24, 0, 0, 0.6]])
    assert close(batch.returns, [[0, 0.196, 0.44, 0, 0, 1.0]])
