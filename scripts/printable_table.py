"""Write `rust/src/front/printable.rs`: the code points Python's `str.isprintable` calls
printable, as ranges, for the front's `repr` of a client's text in its 400s.

Run with the Python the gateway ships on (`unicodedata.unidata_version` is in the file);
`tests/gateway/test_front_checks.py` compares the table with that Python's `repr`.
"""

from __future__ import annotations

import sys
import unicodedata
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "rust/src/front/printable.rs"


def ranges() -> list[tuple[int, int]]:
    """Runs of printable code points, first and last of each."""
    runs: list[tuple[int, int]] = []
    start = None
    for cp in range(sys.maxunicode + 1):
        if chr(cp).isprintable():
            start = cp if start is None else start
        elif start is not None:
            runs.append((start, cp - 1))
            start = None
    if start is not None:
        runs.append((start, sys.maxunicode))
    return runs


def main() -> None:
    runs = ranges()
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    rows = [
        " ".join(f"(0x{a:x}, 0x{b:x})," for a, b in runs[i : i + 4]) for i in range(0, len(runs), 4)
    ]
    body = "\n".join(f"    {row}" for row in rows)
    OUT.write_text(
        "//! Which characters Python's `repr` shows as they are (`str.isprintable`), from Unicode\n"
        f"//! {unicodedata.unidata_version} as Python {python} "
        "has it. Written by `scripts/printable_table.py`; do not edit.\n\n"
        "/// Printable code points: sorted, disjoint, inclusive ranges.\n#[rustfmt::skip]\n"
        f"const PRINTABLE: [(u32, u32); {len(runs)}] = [\n{body}\n];\n\n"
        "/// `c.isprintable()`.\n"
        "pub fn is_printable(c: char) -> bool {\n"
        "    let c = u32::from(c);\n"
        "    let at = PRINTABLE.partition_point(|&(_, last)| last < c);\n"
        "    PRINTABLE.get(at).is_some_and(|&(first, _)| first <= c)\n"
        "}\n"
    )


if __name__ == "__main__":
    main()
