"""Session fixtures: tiny randomly initialised HF checkpoints built locally (no hub), and the
tiny runs' SFT base (tests.helpers.tiny_runs), built once for the modules that train from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.models import build_tiny_checkpoint
from tests.helpers.tiny_runs import build_tiny_base


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Untied tiny checkpoint."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("models") / "tiny-untied", False)


@pytest.fixture(scope="session")
def tiny_tied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny checkpoint with tie_word_embeddings=True."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("models") / "tiny-tied", True)


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_run_tree's SFT base; a module copies it into its tree (with_tiny_base)."""
    return build_tiny_base(tmp_path_factory.mktemp("tiny-base"))
