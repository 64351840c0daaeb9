"""Where the repository and its shipped recipes are."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The example runtime environment for `ray job submit` sits beside the recipes; it is not one.
RUNTIME_ENV = REPO / "recipes" / "runtime_env.yaml"


def shipped_recipes() -> list[Path]:
    """Every recipe under recipes/, sorted."""
    return sorted(p for p in (REPO / "recipes").rglob("*.yaml") if p != RUNTIME_ENV)
