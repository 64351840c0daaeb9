"""Session fixtures: tiny randomly initialised HF checkpoints built locally (no hub)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.models import build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Untied tiny checkpoint."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("models") / "tiny-untied", False)


@pytest.fixture(scope="session")
def tiny_tied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny checkpoint with tie_word_embeddings=True."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("models") / "tiny-tied", True)
