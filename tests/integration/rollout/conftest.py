"""Fixtures of the agent-function tests here: a tiny Qwen2 whose turns end by themselves
(tests.helpers.agent_engines), and the engines built over it in the test's process, one set
per module (test_agent_loop.py has its own, over two checkpoints)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.agent_engines import Engines, build_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("agent-model") / "untied", tied=False)


@pytest.fixture(scope="module")
def engines(model_dir: Path) -> Iterator[Engines]:
    made = Engines({"untied": model_dir})
    try:
        yield made
    finally:
        made.close()
