"""bench/docs_section.py: a script's generated block replaces its old one and nothing else."""

from __future__ import annotations

from pathlib import Path

from tests.unit.bench.bench_modules import load_bench_module

docs_section = load_bench_module("docs_section")


def test_a_section_replaces_its_block_and_keeps_the_rest(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text("intro\n<!-- a:begin -->\nold\n<!-- a:end -->\nafter\n")
    docs_section.write_section("a", "new | 1.0x", docs)
    assert docs.read_text() == "intro\n<!-- a:begin -->\nnew | 1.0x\n<!-- a:end -->\nafter\n"
    docs_section.write_section("b", "first", docs)
    assert docs.read_text().endswith("after\n\n<!-- b:begin -->\nfirst\n<!-- b:end -->\n")
