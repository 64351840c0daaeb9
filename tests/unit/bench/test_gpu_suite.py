"""bench/gpu_suite.py --tiny runs every part on CPU and prints tables whose numbers are finite and
agree with each other (the GPU run prints the same tables at the GPU shapes)."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

from tests.helpers.repo import REPO

pytestmark = pytest.mark.integration  # real PolicyTrainers, a process group each

SECTIONS = (
    "1. The fused LM head against the three matmuls",
    "2. The gathered transport between two processes",
    "3. A LoRA step (rank 32, every linear module)",
    "4. Trainer steps",
    "5. Packed rows' attention",
)


@pytest.fixture(scope="module")
def stdout() -> str:
    result = subprocess.run(
        [sys.executable, "bench/gpu_suite.py", "--tiny"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def sections(stdout: str) -> dict[str, list[list[dict[str, str]]]]:
    """Section title -> its markdown tables, each a list of {column: cell} rows."""
    out: dict[str, list[list[dict[str, str]]]] = {}
    tables: list[list[dict[str, str]]] = []
    header: list[str] | None = None
    for line in stdout.splitlines():
        if line.startswith("### "):
            tables = out.setdefault(line[4:], [])
            header = None
        elif not line.startswith("|"):
            header = None
        elif header is None:
            header = [cell.strip() for cell in line.strip("|").split("|")]
            tables.append([])
        elif not line.startswith("|---"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            tables[-1].append(dict(zip(header, cells, strict=True)))
    return out


def _number(cell: str) -> float:
    return float(cell.replace(",", "").rstrip("%"))


def test_every_part_ran_in_order(sections: dict) -> None:
    assert tuple(sections) == SECTIONS


def test_the_fused_head_matches_fp64_and_is_timed_against_the_three_matmuls(sections) -> None:
    check, timing = sections[SECTIONS[0]]
    (pair,) = check
    assert pair["pair"] == "torch vs fp64"
    assert all(_number(pair[col]) < 1e-4 for col in ("logprob", "entropy", "grad hidden"))
    assert [row["head (d x V)"].split(":")[0] for row in timing] == ["0.5b", "7b"]
    for row in timing:
        fused, matmuls = _number(row["fused ms"]), _number(row["3 matmuls ms"])
        assert fused > 0 and matmuls > 0
        assert _number(row["fused / matmuls"]) == pytest.approx(fused / matmuls, rel=0.03, abs=0.01)


def test_the_transport_delivers_every_bucket_and_is_timed_against_the_copy(
    sections: dict, stdout: str
) -> None:
    # Over two slots: more than two buckets reuse both (bench/gpu_weight_sync.measure checks
    # the receiver's weights after every sync, its weights zeroed in between).
    assert int(re.search(r"\(tiny\), (\d+) buckets", stdout).group(1)) > 2
    (table,) = sections[SECTIONS[1]]
    paths = {row["path"].split(",")[0].split(" (")[0]: row for row in table}
    assert {"CUDA IPC", "rl.sync.gathered", "bound: one device-to-device copy"} <= set(paths)
    assert all(_number(row["seconds"]) > 0 for row in table)
    assert _number(paths["bound: one device-to-device copy"]["x copy bound"]) == 1.0


def _check_train_rows(rows: list[dict[str, str]]) -> None:
    for row in rows:
        seconds, tokens = _number(row["s/step"]), _number(row["tokens/step"])
        assert seconds > 0 and tokens > 0
        assert _number(row["tokens/s"]) == pytest.approx(tokens / seconds, rel=0.01, abs=1)
        assert 0 < _number(row["MFU"]) <= 100
        assert _number(row["peak GiB"]) > 0 and _number(row["log-probs s"]) > 0
        assert math.isfinite(seconds)


def test_a_lora_step_reports_its_mfu(sections: dict) -> None:
    (rows,) = sections[SECTIONS[2]]
    assert [(row["model"], row["samples of up to"]) for row in rows] == [("1.5b", "8K")]
    _check_train_rows(rows)


def test_trainer_steps_run_every_shape_and_length_and_compiled(sections: dict) -> None:
    (rows,) = sections[SECTIONS[3]]
    plain = [(row["model"], row["samples of up to"]) for row in rows if row["compile"] == "no"]
    assert plain == [("0.5b", "2K"), ("0.5b", "8K"), ("1.5b", "2K"), ("1.5b", "8K")]
    assert [row["compile"] for row in rows].count("yes") == 1  # --tiny: Dynamo takes seconds
    _check_train_rows(rows)
    # Packed samples of up to 2K hold more of them than up to 8K in the same step tokens.
    samples = {
        row["samples of up to"]: int(row["samples"]) for row in rows if row["model"] == "0.5b"
    }
    assert samples["2K"] > samples["8K"]
    assert re.fullmatch(r"n/a \(CPU\)", rows[0]["host waits/step"])


def test_packed_rows_attention_matches_each_sample_alone(sections: dict) -> None:
    (table,) = sections["5. Packed rows' attention"]
    assert [row["attention"] for row in table] == ["packed_attention", "SDPA with the packed mask"]
    for row in table:
        errors = row["max abs error of the output, of the grads vs fp32"].split(", ")
        assert all(_number(error) < 1e-4 for error in errors)  # fp32 on CPU
        assert _number(row["ms"]) > 0
