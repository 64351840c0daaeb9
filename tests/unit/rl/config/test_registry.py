"""Registries: entries carry their traits, and lookups name the valid entries."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from rl.algorithms.advantages import ADVANTAGES, needs_critic
from rl.algorithms.off_policy import OFF_POLICY_CORRECTIONS
from rl.config import AlgorithmConfig, Config, ModelConfig
from rl.config.registry import Registry


@dataclass(frozen=True)
class _Traits:
    fast: bool = False


def test_an_entry_keeps_the_traits_it_was_registered_with_and_defaults_the_rest() -> None:
    registry: Registry = Registry("widget", _Traits)
    registry.register("a", fast=True)(len)
    registry.register("b")(abs)
    assert registry.get("a") is len and registry.traits("a").fast
    assert not registry.traits("b").fast
    assert registry.names(lambda t: t.fast) == ["a"]
    assert registry.names() == ["a", "b"]


def test_a_trait_the_registry_does_not_have_fails_at_registration() -> None:
    registry: Registry = Registry("widget", _Traits)
    with pytest.raises(TypeError, match="slow"):
        registry.register("a", slow=True)


def test_an_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; valid: gae, grpo"):
        ADVANTAGES.traits("ppo")


def test_only_gae_reads_a_critic_and_the_group_estimators_use_the_group_as_baseline() -> None:
    # From the estimators' definitions: GAE bootstraps from V; GRPO, RLOO and REINFORCE++ with
    # a baseline centre each score on the other responses to the prompt (docs/algorithms.md).
    assert ADVANTAGES.names(lambda t: t.needs_critic) == ["gae"]
    assert ADVANTAGES.names(lambda t: t.group_baseline) == ["grpo", "reinforce_pp_baseline", "rloo"]
    ppo = Config(model=ModelConfig(path="m"), algorithm=AlgorithmConfig(advantage="gae"))
    assert needs_critic(ppo) and not needs_critic(Config(model=ModelConfig(path="m")))


def test_only_the_masked_corrections_drop_tokens_and_none_needs_no_proximal_policy() -> None:
    assert OFF_POLICY_CORRECTIONS.names(lambda t: not t.keeps_mask) == [
        "geo-rs",
        "icepop",
        "seq-mis",
        "token-mis",
    ]
    assert OFF_POLICY_CORRECTIONS.names(lambda t: not t.needs_proximal) == ["none"]
