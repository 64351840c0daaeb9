"""Recipes load into the typed config and overrides patch it."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl.recipe import ConfigError, load_config

REPO = Path(__file__).resolve().parents[3]


def test_every_shipped_recipe_validates() -> None:
    recipes = sorted((REPO / "recipes").glob("*.yaml"))
    assert recipes
    for recipe in recipes:
        load_config(recipe)


def test_overrides_apply_in_order_and_parse_yaml_scalars() -> None:
    cfg = load_config(
        REPO / "recipes/grpo_addition_cpu.yaml",
        ["trainer.lr=3e-6", "trainer.betas=[0.9,0.95]", "run.export_hf=false", "trainer.lr=4e-6"],
    )
    assert cfg.trainer.lr == 4e-6
    assert cfg.trainer.betas == (0.9, 0.95)
    assert cfg.run.export_hf is False


def test_override_into_a_value_is_rejected() -> None:
    with pytest.raises(ConfigError, match="trainer.lr is a value, not a section"):
        load_config(REPO / "recipes/grpo_addition_cpu.yaml", ["trainer.lr.x=1"])


def test_override_without_equals_is_rejected() -> None:
    with pytest.raises(ConfigError, match="is not key=value"):
        load_config(REPO / "recipes/grpo_addition_cpu.yaml", ["trainer.lr"])


def test_non_mapping_recipe_is_rejected(tmp_path: Path) -> None:
    recipe = tmp_path / "list.yaml"
    recipe.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="a recipe is a mapping"):
        load_config(recipe)
