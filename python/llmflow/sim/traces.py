"""Trace files: the request logs a scenario can replay, in the formats people publish them in.

Each reader returns columns of equal length: `prompt` and `output` (tokens), `t` (arrival, s from
the first request) when the file has arrival times, and, where the format carries them,
`tenant` (the access log's) and `hash_ids` (Mooncake's prefix block hashes, one tuple of ints per
request, `None` where a row has none). Other numeric columns pass through for `empirical`
lengths. Formats (`FORMATS`):

- `csv`: `TIMESTAMP` (`2023-11-16 18:17:03.97`, or seconds), `ContextTokens`, `GeneratedTokens`
  (the Azure LLM inference traces; `num_prefill_tokens`/`prompt_tokens` and
  `num_decode_tokens`/`output_tokens` are read too);
- `mooncake`: JSON lines with `timestamp` (ms), `input_length`, `output_length`, `hash_ids`;
- `vllm-bench`: the JSON `vllm bench serve --save-result --save-detailed` writes
  (`input_lens`, `output_lens`, and `start_times` where vLLM records them; without them, no
  arrival times: the file's `request_rate`, or the scenario's, spaces them);
- `burstgpt`: BurstGPT's CSV (`Timestamp` in s, `Request tokens`, `Response tokens`, `Model`,
  `Log Type`);
- `requests`: llmflow's own per-request rows (`sim run --requests-out`, the gateway's
  `server.access_log`), CSV or Parquet: a real day replayed as it happened.
"""

from __future__ import annotations

import csv
import datetime
import json
import math
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from llmflow.request_log import COLUMNS as REQUEST_COLUMNS
from llmflow.request_log import read_rows

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["FORMATS", "TraceError", "detect_format", "read_trace"]

FORMATS = ("csv", "mooncake", "vllm-bench", "burstgpt", "requests")
_PROMPT_COLUMNS = ("ContextTokens", "num_prefill_tokens", "prompt_tokens")
_OUTPUT_COLUMNS = ("GeneratedTokens", "num_decode_tokens", "output_tokens")
_STAMP_COLUMNS = ("TIMESTAMP", "timestamp", "t")
_BURSTGPT = ("Timestamp", "Request tokens", "Response tokens")
_REQUESTS_KEY = ("arrival_s", "prompt_tokens", "output_tokens", "outcome")  # tells it apart


class TraceError(ValueError):
    """A trace file that cannot be read: the message names the file and what to fix."""


def detect_format(path: Path) -> str:
    """The format of a trace file, from its extension and its first line or keys.

    Raises:
        TraceError: the file is unreadable or in none of `FORMATS`.
    """
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return "mooncake"
    if suffix == ".json":
        return "vllm-bench"
    if suffix == ".parquet":
        return "requests"
    try:
        with path.open(newline="", encoding="utf-8") as f:
            header = next(csv.reader(f), [])
    except OSError as exc:
        raise TraceError(f"{path}: cannot read trace ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not a text file; {_KNOWN}") from None
    if all(c in header for c in _REQUESTS_KEY):
        return "requests"
    if all(c in header for c in _BURSTGPT):
        return "burstgpt"
    if any(c in header for c in _PROMPT_COLUMNS) and any(c in header for c in _OUTPUT_COLUMNS):
        return "csv"
    raise TraceError(f"{path}: unknown trace header {header[:8]}; {_KNOWN}")


_KNOWN = (
    "known formats: Azure-style CSV (TIMESTAMP,ContextTokens,GeneratedTokens), Mooncake JSONL "
    "(.jsonl: timestamp, input_length, output_length), vllm bench serve JSON (.json, saved with "
    "--save-detailed), BurstGPT CSV (Timestamp,Request tokens,Response tokens), llmflow requests "
    "(--requests-out or server.access_log, .csv or .parquet); or set the trace's `format:`"
)


@lru_cache(maxsize=16)
def read_trace(path: Path, fmt: str | None = None) -> dict[str, Any]:
    """Read a trace into columns (see the module docstring), sorted by arrival time.

    Args:
        path: the file.
        fmt: one of `FORMATS`; `None`: detect it (`detect_format`).

    Raises:
        TraceError: an unreadable file, an unknown format, or a missing field, named.
    """
    fmt = fmt or detect_format(path)
    if fmt not in _READERS:
        raise TraceError(f"{path}: unknown trace format {fmt!r}; choose one of {FORMATS}")
    try:
        out = _READERS[fmt](path)
    except OSError as exc:
        raise TraceError(f"{path}: cannot read trace ({exc.strerror})") from None
    except (KeyError, ValueError, TypeError, json.JSONDecodeError) as exc:
        if isinstance(exc, TraceError):
            raise
        raise TraceError(f"{path}: not a valid {fmt} trace: {exc}") from None
    if out["prompt"].size == 0:
        raise TraceError(f"{path}: empty trace")
    if "t" in out:
        order = np.argsort(out["t"], kind="stable")
        out = {k: v[order] if isinstance(v, np.ndarray) and v.size == order.size else v
               for k, v in out.items()}
        out["t"] = out["t"] - out["t"][0]
    return out


def _ints(values: list[Any]) -> np.ndarray:
    return np.array([int(float(v)) for v in values], dtype=np.int64)


def _stamps(values: list[str]) -> np.ndarray:
    """Seconds: plain numbers, or `YYYY-MM-DD hh:mm:ss.fff` dates counted from the first day
    (so that the float keeps its sub-microsecond digits)."""
    try:
        return np.array([float(v) for v in values])
    except ValueError:
        pass
    days, secs = [], []
    for v in values:
        date, _, clock = v.strip().partition(" ")
        h, m, s = clock.split(":")
        days.append(datetime.date.fromisoformat(date).toordinal())
        secs.append(int(h) * 3600.0 + int(m) * 60.0 + float(s))
    first = min(days)
    return np.array([(d - first) * 86400.0 + s for d, s in zip(days, secs, strict=True)])


def _csv_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _read_csv(path: Path) -> dict[str, Any]:
    rows = _csv_rows(path)
    cols = rows[0].keys() if rows else ()
    out: dict[str, Any] = {}
    for key, names in (("prompt", _PROMPT_COLUMNS), ("output", _OUTPUT_COLUMNS)):
        name = next((n for n in names if n in cols), None)
        if name is None:
            raise TraceError(f"{path}: no {key} column (expected one of {names})")
        out[key] = _ints([r[name] for r in rows])
    stamp = next((c for c in _STAMP_COLUMNS if c in cols), None)
    if stamp is not None:
        out["t"] = _stamps([r[stamp] for r in rows])
    for name in cols:
        if name not in (stamp, *_PROMPT_COLUMNS, *_OUTPUT_COLUMNS):
            try:
                out[name] = np.array([float(r[name]) for r in rows])
            except ValueError:
                continue
    return out


def _read_mooncake(path: Path) -> dict[str, Any]:
    t, prompt, output, hashes = [], [], [], []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                t.append(float(row["timestamp"]) / 1000.0)  # ms
                prompt.append(int(row["input_length"]))
                output.append(int(row["output_length"]))
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{n}: not JSON ({exc.msg})") from None
            except KeyError as exc:
                raise TraceError(f"{path}:{n}: missing {exc.args[0]!r} (each line needs "
                                 "timestamp, input_length, output_length)") from None
            ids = row.get("hash_ids")
            hashes.append(tuple(int(h) for h in ids) if ids is not None else None)
    ids = np.empty(len(hashes), dtype=object)  # one tuple per cell, never a 2-D array
    for i, h in enumerate(hashes):
        ids[i] = h
    return {"t": np.array(t), "prompt": np.array(prompt, dtype=np.int64),
            "output": np.array(output, dtype=np.int64), "hash_ids": ids}


def _read_vllm_bench(path: Path) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8")
    data, _end = json.JSONDecoder().raw_decode(text.lstrip())  # --append-result: the first run
    if not isinstance(data, dict) or "input_lens" not in data or "output_lens" not in data:
        raise TraceError(f"{path}: no per-request input_lens/output_lens; rerun `vllm bench "
                         "serve` with --save-result --save-detailed")
    out: dict[str, Any] = {"prompt": _ints(data["input_lens"]),
                           "output": _ints(data["output_lens"])}
    starts = data.get("start_times")
    if starts and len(starts) == out["prompt"].size:
        out["t"] = np.array(starts, dtype=float)
    else:  # vLLM drew its arrivals from the rate and did not record them
        rate = data.get("request_rate")
        out["rate_per_s"] = math.inf if rate in (None, "inf") else float(rate)
    for key in ("ttfts", "latencies"):
        if key in data and len(data[key]) == out["prompt"].size:
            out[key] = np.array([math.nan if v is None else float(v) for v in data[key]])
    return out


def _read_burstgpt(path: Path) -> dict[str, Any]:
    rows = _csv_rows(path)
    return {"t": np.array([float(r["Timestamp"]) for r in rows]),
            "prompt": _ints([r["Request tokens"] for r in rows]),
            "output": _ints([r["Response tokens"] for r in rows]),
            "model": np.array([r.get("Model", "") for r in rows], dtype=object)}


def _read_requests(path: Path) -> dict[str, Any]:
    rows = read_rows(path)
    missing = [c for c in ("arrival_s", "tenant", "prompt_tokens", "output_tokens")
               if rows and c not in rows[0]]
    if missing:
        raise TraceError(f"{path}: missing request columns {missing}; expected "
                         f"{list(REQUEST_COLUMNS)}")
    return {"t": np.array([float(r["arrival_s"]) for r in rows]),
            "prompt": _ints([r["prompt_tokens"] for r in rows]),
            "output": _ints([r["output_tokens"] or 0 for r in rows]),
            "tenant": np.array([str(r["tenant"]) for r in rows], dtype=object)}


_READERS = {"csv": _read_csv, "mooncake": _read_mooncake, "vllm-bench": _read_vllm_bench,
            "burstgpt": _read_burstgpt, "requests": _read_requests}
