"""Per-request rows: one schema for the simulator's `--requests-out` and the gateway's access log.

The same columns on both sides let a simulated run and a real one sit side by side, and let a
real day (the access log) be replayed in the simulator (`sim/traces.py`, format `requests`).
Times are seconds on the run's clock: simulated seconds from the start in the simulator, Unix
time in the gateway. An empty cell (CSV) or a null (Parquet) is a moment that never came (no
admission, no first token). CSV needs nothing; Parquet needs `pyarrow`.
"""

from __future__ import annotations

import csv
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence
    from pathlib import Path

__all__ = ["COLUMNS", "check_path", "format_row", "read_rows", "write_rows"]

COLUMNS = (
    "request",  # id: the simulator's request index, the gateway's X-Request-Id
    "class",  # the simulator's workload class; the gateway's tier
    "tenant",
    "arrival_s",  # the request's first attempt reached the gateway
    "attempts",  # HTTP attempts of the user request (the gateway sees one per row)
    "admitted_s",  # the served (last) attempt was started upstream
    "first_token_s",  # the first token reached the client
    "end_s",  # the final state
    "prompt_tokens",  # the count the gateway planned with (exact for token ids)
    "max_tokens",  # what the request may generate
    "output_tokens",  # generated and delivered
    "outcome",  # completed, rejected, timed_out, truncated, cancelled, failed, unfinished
    "reason",  # why, when not completed (the runtime's reason)
    "backend",  # where the served attempt ran
)
_TIMES = frozenset(("arrival_s", "admitted_s", "first_token_s", "end_s"))
_INTS = frozenset(("attempts", "prompt_tokens", "max_tokens", "output_tokens"))
_SUFFIXES = (".csv", ".parquet")


def check_path(path: Path) -> None:
    """Fail early on a file this module cannot write.

    Raises:
        ValueError: neither `.csv` nor `.parquet`, or `.parquet` without `pyarrow`.
    """
    if path.suffix.lower() not in _SUFFIXES:
        raise ValueError(f"{path}: per-request rows are written as .csv or .parquet; "
                         "rename the file")
    if path.suffix.lower() == ".parquet":
        _pyarrow(path)


def _pyarrow(path: Path) -> Any:
    try:
        import pyarrow.parquet as pq  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        raise ValueError(f"{path}: Parquet needs pyarrow: `pip install pyarrow`, or write "
                         ".csv instead") from None
    return pq


def format_row(values: Sequence[Any]) -> list[str]:
    """One row as CSV cells: times to the microsecond, NaN and None as empty cells."""
    out = []
    for name, v in zip(COLUMNS, values, strict=True):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            out.append("")
        elif name in _TIMES:
            out.append(f"{float(v):.6f}")
        elif name in _INTS:
            out.append(str(int(v)))
        else:
            out.append(str(v))
    return out


def write_rows(path: Path, rows: Iterable[Sequence[Any]]) -> None:
    """Write rows (tuples in `COLUMNS` order) to `path`, CSV or Parquet by its suffix.

    Raises:
        ValueError: see `check_path`.
    """
    check_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".csv":
        with path.open("w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(COLUMNS)
            w.writerows(format_row(r) for r in rows)
        return
    import pyarrow as pa  # type: ignore[import-not-found, unused-ignore]

    cols: dict[str, list[Any]] = {c: [] for c in COLUMNS}
    for r in rows:
        for name, v in zip(COLUMNS, r, strict=True):
            cols[name].append(None if isinstance(v, float) and math.isnan(v) else v)
    _pyarrow(path).write_table(pa.table(cols), path)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a CSV or Parquet file as mappings (CSV cells stay strings).

    Raises:
        ValueError: a Parquet file without `pyarrow`.
        OSError: an unreadable file.
    """
    if path.suffix.lower() == ".parquet":
        table = _pyarrow(path).read_table(path)
        return list(table.to_pylist())
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))
