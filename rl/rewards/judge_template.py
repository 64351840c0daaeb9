"""A judge's prompt template: plain `{name}` fields in text, filled without Python's format
machinery.

A template comes from a recipe (inline or a file), so it is parsed once, strictly: `{{` and
`}}` are literal braces, every other brace pair is a field named by a bare identifier, and
conversions (`!r`), format specs (`:>10`), attribute and index access (`{x.attr}`, `{x[0]}`)
are refused. Rendering joins the parsed literals and the values; nothing of the template is
ever evaluated or handed to `str.format`.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from pathlib import Path

# The fields each mode's template may use; the response fields of its mode are required.
FIELDS = {
    "pointwise": ("prompt", "answer", "response"),
    "pairwise": ("prompt", "answer", "response_a", "response_b"),
    "listwise": ("prompt", "answer", "responses", "num_responses"),
}
REQUIRED = {
    "pointwise": ("response",),
    "pairwise": ("response_a", "response_b"),
    "listwise": ("responses",),
}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Template:
    """A parsed template: `source` names it in errors (the file, or "the inline template")."""

    source: str
    pieces: tuple[tuple[str, str | None], ...]  # (literal text, field after it or None)

    @property
    def fields(self) -> set[str]:
        return {field for _, field in self.pieces if field is not None}

    def render(self, values: dict[str, str]) -> str:
        """The template with each field replaced by `values[field]` (every field it uses must
        be there; the values are inserted verbatim, braces included)."""
        return "".join(
            text + (values[field] if field is not None else "") for text, field in self.pieces
        )


def parse_template(text: str, source: str, mode: str) -> Template:
    """`text` as a template for judging in `mode`; ValueError naming `source` when a field is
    not a plain name, is not one of the mode's fields, or a required field is missing."""
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:  # "Single '}' encountered", an unclosed '{'
        raise ValueError(f"{source}: {exc} (write {{{{ and }}}} for literal braces)") from None
    allowed = FIELDS[mode]
    pieces = []
    for literal, field, spec, conversion in parsed:
        if field is not None:
            if conversion is not None or spec:
                suffix = (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
                raise ValueError(
                    f"{source}: field {{{field}{suffix}}}: conversions and format specs are "
                    "not allowed; write a plain {name}"
                )
            if not _IDENTIFIER.fullmatch(field):
                raise ValueError(
                    f"{source}: field {{{field}}} is not a plain name (no attribute or index "
                    f"access); the {mode} fields are {_braced(allowed)}"
                )
            if field not in allowed:
                raise ValueError(
                    f"{source}: unknown field {{{field}}}; the {mode} fields are {_braced(allowed)}"
                )
        pieces.append((literal, field))
    template = Template(source, tuple(pieces))
    missing = [field for field in REQUIRED[mode] if field not in template.fields]
    if missing:
        raise ValueError(
            f"{source}: a {mode} template must show the judge {_braced(missing)}; it has "
            f"{_braced(sorted(template.fields)) or 'no fields'}"
        )
    return template


def load_template(inline: str, file: str, mode: str, key: str) -> Template:
    """The template of a judge from its `template` or `template_file` (exactly one set);
    `key` is the config key of the judge (`reward.terms[1].judge`), for errors."""
    if bool(inline) == bool(file):
        raise ValueError(f"{key}: set exactly one of template and template_file")
    if inline:
        return parse_template(inline, f"{key}.template (inline)", mode)
    path = Path(file)
    if not path.is_file():
        raise ValueError(f"{key}.template_file={file!r}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{key}.template_file={file!r}: cannot read it ({exc})") from None
    return parse_template(text, f"{key}.template_file={file!r}", mode)


def _braced(names: list[str] | tuple[str, ...]) -> str:
    return ", ".join(f"{{{name}}}" for name in names)
