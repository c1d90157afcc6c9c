"""The suite's verdict: one row per invariant, as a text table and as JSON."""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["PASS", "Row", "Status", "failed", "render", "write_json"]

Status = Literal["pass", "fail", "n/a"]
PASS: Status = "pass"
_WIDTHS = (30, 34, 6, 52)  # invariant, what was done, verdict, measured (characters)


@dataclass(frozen=True)
class Row:
    """One invariant: what the suite did, its verdict, and what it measured."""

    invariant: str
    done: str
    status: Status
    measured: str


def failed(rows: list[Row]) -> bool:
    """Whether any applicable invariant failed."""
    return any(row.status == "fail" for row in rows)


def render(rows: list[Row], title: str) -> str:
    """The rows as a text table (cells wrapped to fit), with a one-line summary."""
    header = ("invariant", "what the suite did", "result", "measured")
    rule = "+" + "+".join("-" * (w + 2) for w in _WIDTHS) + "+"
    lines = [title, rule, *_cells(header), rule.replace("-", "=")]
    for row in rows:
        lines += _cells((row.invariant, row.done, row.status.upper(), row.measured))
        lines.append(rule)
    counts = {s: sum(r.status == s for r in rows) for s in ("pass", "fail", "n/a")}
    lines.append(f"{counts['pass']} passed, {counts['fail']} failed, {counts['n/a']} n/a")
    return "\n".join(lines)


def _cells(cells: tuple[str, str, str, str]) -> list[str]:
    wrapped = [textwrap.wrap(c, w) or [""] for c, w in zip(cells, _WIDTHS, strict=True)]
    height = max(len(w) for w in wrapped)
    out = []
    for i in range(height):
        parts = [
            (w[i] if i < len(w) else "").ljust(n) for w, n in zip(wrapped, _WIDTHS, strict=True)
        ]
        out.append("| " + " | ".join(parts) + " |")
    return out


def write_json(rows: list[Row], gateway: str, path: Path) -> None:
    """Write the rows, the gateway's URL and the overall verdict to `path`."""
    data = {"gateway": gateway, "passed": not failed(rows), "rows": [asdict(r) for r in rows]}
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
