"""The generated sections of docs/benchmarks.md, each between its script's markers."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def write_section(name: str, text: str, docs: Path = DOCS) -> None:
    """Replace the block between `<!-- name:begin -->` and `<!-- name:end -->` in `docs` with
    `text`, or append the block when the markers are not there yet."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    content = docs.read_text()
    block = f"{begin}\n{text}\n{end}"
    if begin in content:
        pattern = re.escape(begin) + ".*?" + re.escape(end)
        content = re.sub(pattern, lambda _: block, content, flags=re.S)
    else:
        content += f"\n{block}\n"
    docs.write_text(content)
