"""Markdown pieces the reference generator writes: table cells that cannot break a table, code spans, tables."""

from __future__ import annotations

import json
import re


def cell(text: str) -> str:
    """Text for one table cell: a pipe would end the cell and a newline the row."""
    return " ".join(text.split()).replace("|", "\\|")


def code(text: object) -> str:
    """An inline code span holding `text` exactly (a backtick inside needs a longer fence)."""
    s = str(text)
    fence = "``" if "`" in s else "`"
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{fence}{pad}{s}{pad}{fence}".replace("|", "\\|")


def table(header: list[str], rows: list[list[str]]) -> str:
    """A pipe table; every cell is escaped by the caller (cell, code)."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def literal(value: object) -> str:
    """A default value as the TOML or JSON a user would write it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    return str(value)


def size(n: int) -> str:
    """A byte count a reader can take in at a glance (1073741824 -> 1 GiB)."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def anchor(*parts: str) -> str:
    """A heading id of our own (attr_list's `{#id}`), so links survive heading text that slugs badly (paths)."""
    return "-".join(re.sub(r"[^a-z0-9]+", "-", p.lower()).strip("-") for p in parts if p)
