"""Which weight transport a placement, and the room in /dev/shm, get."""

from __future__ import annotations

import pytest

from rl.sync.selection import choose_transport

MIB = 1 << 20
ROOMY, TIGHT = 1024 * MIB, 60 * MIB  # free in /dev/shm
NEEDED = 130 * MIB  # what the shared-memory transport would take
CPU = {"on_gpu": False, "colocated": True}


@pytest.mark.parametrize(
    ("setting", "num_nodes", "on_gpu", "colocated", "expected"),
    [
        ("auto", 1, False, True, "shared_memory"),
        ("auto", 1, False, False, "shared_memory"),
        ("auto", 2, False, True, "distributed"),
        # Colocated GPUs on one node: each bucket gathered into every GPU, read there.
        ("auto", 1, True, True, "gathered"),
        # GPUs of their own: each trainer rank sends each engine rank its rows over NCCL.
        ("auto", 1, True, False, "distributed"),
        ("auto", 2, True, True, "distributed"),
        ("distributed", 1, True, True, "distributed"),
        ("shared_memory", 1, False, True, "shared_memory"),
        ("gathered", 1, False, False, "gathered"),  # on CPU every slot is host memory
    ],
)
def test_transport_follows_the_devices_and_placement_unless_overridden(
    setting: str, num_nodes: int, on_gpu: bool, colocated: bool, expected: str
) -> None:
    chosen = choose_transport(setting, num_nodes, ROOMY, NEEDED, on_gpu=on_gpu, colocated=colocated)
    assert chosen == expected


def test_gathered_on_gpus_of_their_own_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="weight_transport=gathered .* scheduler.placement=split"):
        choose_transport("gathered", 1, ROOMY, NEEDED, on_gpu=True, colocated=False)
    with pytest.raises(ValueError, match="weight_transport=gathered.*2 nodes"):
        choose_transport("gathered", 2, ROOMY, NEEDED, **CPU)


def test_shared_memory_across_nodes_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="weight_transport=shared_memory.*2 nodes"):
        choose_transport("shared_memory", 2, ROOMY, NEEDED, **CPU)


def test_auto_on_one_node_takes_the_gloo_group_when_dev_shm_is_too_small(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert choose_transport("auto", 1, TIGHT, NEEDED, **CPU) == "distributed"
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one line
    assert "/dev/shm has 60.0 MiB free of the 130.0 MiB the shared-memory transport needs" in out
    assert "using the distributed (gloo) transport" in out


def test_the_gloo_group_needs_no_dev_shm(capsys: pytest.CaptureFixture[str]) -> None:
    assert choose_transport("auto", 2, TIGHT, NEEDED, **CPU) == "distributed"
    assert choose_transport("distributed", 1, 0, NEEDED, **CPU) == "distributed"
    assert capsys.readouterr().out == ""


def test_explicit_shared_memory_in_a_too_small_dev_shm_is_a_clear_error() -> None:
    with pytest.raises(
        ValueError, match=r"shared_memory, but /dev/shm has 60\.0 MiB free of the 130\.0 MiB"
    ):
        choose_transport("shared_memory", 1, TIGHT, NEEDED, **CPU)
