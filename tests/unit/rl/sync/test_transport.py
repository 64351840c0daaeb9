"""Which weight transport a placement, and the room in /dev/shm, get."""

from __future__ import annotations

import pytest

from rl.sync.transport import choose_transport

MIB = 1 << 20
ROOMY, TIGHT = 1024 * MIB, 60 * MIB  # free in /dev/shm
NEEDED = 130 * MIB  # what the shared-memory transport would take


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
    assert choose_transport(setting, num_nodes, ROOMY, NEEDED) == expected


def test_shared_memory_across_nodes_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="weight_transport=shared_memory.*2 nodes"):
        choose_transport("shared_memory", 2, ROOMY, NEEDED)


def test_auto_on_one_node_takes_the_gloo_group_when_dev_shm_is_too_small(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert choose_transport("auto", 1, TIGHT, NEEDED) == "distributed"
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one line
    assert "/dev/shm has 60.0 MiB free of the 130.0 MiB the shared-memory transport needs" in out
    assert "using the distributed (gloo) transport" in out


def test_the_gloo_group_needs_no_dev_shm(capsys: pytest.CaptureFixture[str]) -> None:
    assert choose_transport("auto", 2, TIGHT, NEEDED) == "distributed"
    assert choose_transport("distributed", 1, 0, NEEDED) == "distributed"
    assert capsys.readouterr().out == ""


def test_explicit_shared_memory_in_a_too_small_dev_shm_is_a_clear_error() -> None:
    with pytest.raises(
        ValueError, match=r"shared_memory, but /dev/shm has 60\.0 MiB free of the 130\.0 MiB"
    ):
        choose_transport("shared_memory", 1, TIGHT, NEEDED)
