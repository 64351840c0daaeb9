"""The keys a run's metrics.jsonl may hold: those docs/metrics.md documents."""

from __future__ import annotations

import re

from tests.helpers.repo import REPO


def documented_keys() -> re.Pattern:
    """One pattern matching every key docs/metrics.md lists (`<name>` stands for a word)."""
    table = (REPO / "docs" / "metrics.md").read_text()
    rows = re.findall(r"^\| (`.+?`) \|", table, re.M)
    keys = [key for row in rows for key in re.findall(r"`([^`]+)`", row)]
    patterns = [re.sub(r"<[a-z]+>", "[a-z0-9_]+", re.escape(key)) for key in keys]
    return re.compile("|".join(f"(?:{pattern})" for pattern in patterns))


def check_metric_keys(records: list[dict]) -> None:
    """Every record: an int step and numbers or nulls, under keys docs/metrics.md documents."""
    documented = documented_keys()
    for record in records:
        assert isinstance(record["step"], int)
        for key, value in record.items():
            assert documented.fullmatch(key), f"{key} is not documented in docs/metrics.md"
            assert value is None or isinstance(value, int | float), (key, value)
