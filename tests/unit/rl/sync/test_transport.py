"""Which weight transport a placement gets."""

from __future__ import annotations

import pytest

from rl.sync.transport import choose_transport


@pytest.mark.parametrize(
    ("setting", "num_nodes", "expected"),
    [
        ("auto", 1, "shared_memory"),
        ("auto", 2, "distributed"),
        ("distributed", 1, "distributed"),
        ("shared_memory", 1, "shared_memory"),
    ],
)
def test_transport_follows_the_placement_unless_overridden(
    setting: str, num_nodes: int, expected: str
) -> None:
    assert choose_transport(setting, num_nodes) == expected


def test_shared_memory_across_nodes_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="weight_transport=shared_memory.*2 nodes"):
        choose_transport("shared_memory", 2)
