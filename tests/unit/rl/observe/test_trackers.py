"""Which wandb mode a run logs in."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl.observe.trackers import resolve_wandb_mode


@pytest.fixture
def no_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home without a netrc, and no wandb variables."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_auto_is_offline_without_credentials(no_credentials: Path) -> None:
    assert resolve_wandb_mode("auto") == "offline"


def test_auto_is_online_with_an_api_key(
    no_credentials: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_wandb_mode("auto") == "online"


def test_auto_is_online_after_wandb_login(no_credentials: Path) -> None:
    netrc = no_credentials / ".netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "x" * 40 + "\n")
    netrc.chmod(0o600)
    assert resolve_wandb_mode("auto") == "online"


def test_wandb_mode_variable_wins_over_auto_but_not_over_an_explicit_mode(
    no_credentials: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_wandb_mode("auto") == "disabled"
    assert resolve_wandb_mode("offline") == "offline"
