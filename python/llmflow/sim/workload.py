"""Workload generation: arrival times and token lengths of every request of a scenario.

Each class draws from its own `numpy.random.Generator` seeded by `(seed, class index)`, so adding
a class does not change the others and every policy of a run sees the very same requests.
Traces are CSV files with a timestamp column (`TIMESTAMP`, as the Azure LLM inference traces:
`2023-11-16 18:17:03.9799600`, or plain seconds) and `ContextTokens` / `GeneratedTokens`.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from llmflow.sim.scenario import Arrival, Dist, Scenario, WorkloadClass

__all__ = ["Requests", "build_requests", "read_trace", "sample_lengths"]

_PROMPT_COLUMNS = ("ContextTokens", "num_prefill_tokens", "prompt_tokens")
_OUTPUT_COLUMNS = ("GeneratedTokens", "num_decode_tokens", "output_tokens")


@dataclass(frozen=True)
class Requests:
    """All requests of a run, sorted by arrival time (column arrays of equal length)."""

    t: np.ndarray  # arrival time, s
    cls: np.ndarray  # workload class index
    prompt: np.ndarray  # prompt tokens
    eos: np.ndarray  # output tokens after which the model stops
    max_tokens: np.ndarray  # what the client asks for

    def __len__(self) -> int:
        return int(self.t.size)


def _seconds(stamp: str) -> float:
    try:
        return float(stamp)
    except ValueError:
        pass
    date, _, clock = stamp.strip().partition(" ")
    h, m, s = clock.split(":")
    day = int(date.replace("-", ""))
    return day * 86400.0 + int(h) * 3600.0 + int(m) * 60.0 + float(s)


@lru_cache(maxsize=8)
def read_trace(path: Path) -> dict[str, np.ndarray]:
    """Read a trace CSV into columns: `t` (seconds from the first row, if timestamped), `prompt`,
    `output`.

    Raises:
        ValueError: no known length columns, or an unreadable file.
    """
    try:
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except OSError as exc:
        raise ValueError(f"{path}: cannot read trace ({exc.strerror})") from None
    if not rows:
        raise ValueError(f"{path}: empty trace")
    cols = rows[0].keys()
    out: dict[str, np.ndarray] = {}
    for key, names in (("prompt", _PROMPT_COLUMNS), ("output", _OUTPUT_COLUMNS)):
        name = next((n for n in names if n in cols), None)
        if name is None:
            raise ValueError(f"{path}: no {key} column (expected one of {names})")
        out[key] = np.array([int(r[name]) for r in rows], dtype=np.int64)
    stamp = next((c for c in ("TIMESTAMP", "timestamp", "t") if c in cols), None)
    if stamp is not None:
        t = np.array([_seconds(r[stamp]) for r in rows])
        order = np.argsort(t, kind="stable")
        out = {k: v[order] for k, v in out.items()}
        out["t"] = t[order] - t[order][0]
    for name in cols:
        if name not in (stamp, *_PROMPT_COLUMNS, *_OUTPUT_COLUMNS):
            try:
                out[name] = np.array([float(r[name]) for r in rows])
            except ValueError:
                continue
    return out


def sample_lengths(dist: Dist, n: int, rng: np.random.Generator, base: Path) -> np.ndarray:
    """Draw `n` token lengths from `dist`, rounded and clipped to `[dist.min, dist.max]`."""
    if dist.kind == "fixed":
        x = np.full(n, float(dist.value or 0))
    elif dist.kind == "uniform":
        x = rng.integers(dist.low or 0, (dist.high or 0) + 1, size=n).astype(float)
    elif dist.kind == "lognormal":
        x = np.exp(rng.normal(np.log(dist.median or 1.0), dist.sigma or 0.0, size=n))
    elif dist.kind == "exponential":
        x = np.ceil(rng.exponential(dist.mean or 1.0, size=n))
    else:
        path = Path(dist.path or "")
        table = read_trace(path if path.is_absolute() else base / path)
        column = {"ContextTokens": "prompt", "GeneratedTokens": "output"}.get(
            dist.column or "", dist.column or "")
        if column not in table:
            raise ValueError(f"{dist.path}: no column {dist.column!r}")
        x = rng.choice(table[column], size=n).astype(float)
    out: np.ndarray = np.clip(np.rint(x), dist.min, dist.max).astype(np.int64)
    return out


def _times(arr: Arrival, duration: float, rng: np.random.Generator, base: Path) -> np.ndarray:
    stop = arr.stop_s if arr.stop_s is not None else duration
    if arr.kind == "burst":
        n = arr.count or 0
        return arr.at_s + (np.arange(n) * (arr.over_s / n) if arr.over_s else np.zeros(n))
    if arr.kind == "trace":
        t = read_trace(base / (arr.path or ""))["t"] / arr.time_scale + arr.start_s
        return t[t < stop]
    rate = arr.rate_per_s or 1.0
    if arr.kind == "poisson":
        return _poisson(rate, arr.start_s, stop, rng)
    period = (arr.on_s or 0.0) + (arr.off_s or 0.0)
    t = _poisson(rate, 0.0, (stop - arr.start_s) * (arr.on_s or 0.0) / period, rng)
    on = arr.on_s or 1.0
    return arr.start_s + np.floor(t / on) * period + np.mod(t, on)


def _poisson(rate: float, start: float, stop: float, rng: np.random.Generator) -> np.ndarray:
    if stop <= start:
        return np.zeros(0)
    expected = rate * (stop - start)
    chunks, t = [], start
    while t < stop:
        gaps = rng.exponential(1.0 / rate, size=int(expected * 1.1) + 16)
        times = t + np.cumsum(gaps)
        chunks.append(times)
        t = float(times[-1])
    times = np.concatenate(chunks)
    return times[times < stop]


def _class_requests(
    wc: WorkloadClass, idx: int, sc: Scenario, seed: int
) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(np.random.SeedSequence([seed, idx]))
    t = _times(wc.arrival, sc.duration_s, rng, sc.base_dir)
    if wc.arrival.max_requests is not None:
        t = t[: wc.arrival.max_requests]
    n = t.size
    trace = read_trace(sc.resolve(wc.arrival.path or "")) if wc.arrival.kind == "trace" else None
    if wc.prompt_tokens is not None:
        prompt = sample_lengths(wc.prompt_tokens, n, rng, sc.base_dir)
    else:
        prompt = np.maximum(trace["prompt"][:n], 1) if trace is not None else np.ones(n, np.int64)
    if wc.output_tokens is not None:
        eos = sample_lengths(wc.output_tokens, n, rng, sc.base_dir)
    else:
        eos = np.maximum(trace["output"][:n], 1) if trace is not None else np.ones(n, np.int64)
    max_tokens = np.full(n, wc.max_tokens, np.int64) if wc.max_tokens else eos.copy()
    return t, np.full(n, idx, np.int64), prompt, eos, max_tokens


def build_requests(sc: Scenario, seed: int | None = None) -> Requests:
    """Every request of the scenario, merged across classes and sorted by arrival time.

    Args:
        sc: the scenario.
        seed: overrides `sc.seed`.
    """
    seed = sc.seed if seed is None else seed
    parts = [_class_requests(wc, i, sc, seed) for i, wc in enumerate(sc.workload)]
    t, cls, prompt, eos, max_tokens = (np.concatenate(col) for col in zip(*parts, strict=True))
    order = np.lexsort((cls, t))
    return Requests(t[order], cls[order], prompt[order], eos[order], max_tokens[order])
