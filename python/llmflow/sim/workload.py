"""Workload generation: arrival times and token lengths of every request of a scenario.

Each class draws from its own `numpy.random.Generator` seeded by `(seed, class index)`, so adding
a class does not change the others and every policy of a run sees the very same requests.
Traces are read by `llmflow.sim.traces` (Azure CSV, Mooncake JSONL, vLLM bench JSON, BurstGPT,
llmflow's own per-request rows); a trace's prefix block hashes (`hash_ids`) ride along with its
requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmflow.sim.prefixes import prefixed_prompts
from llmflow.sim.traces import read_trace

if TYPE_CHECKING:
    from llmflow.sim.scenario import Arrival, Dist, Scenario, WorkloadClass

__all__ = ["Requests", "build_requests", "read_trace", "sample_lengths"]

@dataclass(frozen=True)
class Requests:
    """All requests of a run, sorted by arrival time (column arrays of equal length)."""

    t: np.ndarray  # arrival time, s
    cls: np.ndarray  # workload class index
    prompt: np.ndarray  # prompt tokens
    eos: np.ndarray  # output tokens after which the model stops
    max_tokens: np.ndarray  # what the client asks for
    # per request: the prompt's block hashes (a tuple of ints) from a trace, or None
    hash_ids: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.t.size)


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
        table = read_trace(path if path.is_absolute() else base / path, dist.format)
        column = _ALIASES.get(dist.column or "", dist.column or "")
        if column not in table or table[column].dtype == object:
            raise ValueError(f"{dist.path}: no numeric column {dist.column!r}")
        x = rng.choice(table[column], size=n).astype(float)
    out: np.ndarray = np.clip(np.rint(x), dist.min, dist.max).astype(np.int64)
    return out


# the length columns every format reads into `prompt` and `output`, by their usual names
_ALIASES = {"ContextTokens": "prompt", "GeneratedTokens": "output", "input_length": "prompt",
            "output_length": "output", "prompt_tokens": "prompt", "output_tokens": "output",
            "Request tokens": "prompt", "Response tokens": "output"}


def _trace(arr: Arrival, sc: Scenario) -> dict[str, Any]:
    """The arrival's trace, only its tenant's rows when it names one."""
    path = sc.resolve(arr.path or "")
    table = read_trace(path, arr.format)
    if arr.tenant is None:
        return table
    if "tenant" not in table:
        raise ValueError(f"{arr.path}: no tenant column to pick {arr.tenant!r} from "
                         "(only the requests format has one); remove `tenant:`")
    keep = table["tenant"] == arr.tenant
    if not keep.any():
        raise ValueError(f"{arr.path}: no request of tenant {arr.tenant!r}")
    n = keep.size
    return {k: v[keep] if isinstance(v, np.ndarray) and v.size == n else v
            for k, v in table.items()}


def _trace_times(arr: Arrival, trace: dict[str, Any], rng: np.random.Generator) -> np.ndarray:
    if "t" in trace:
        return np.asarray(trace["t"] / arr.time_scale + arr.start_s)
    n = trace["prompt"].size  # no times in the file: spaced by the rate the run used
    rate = arr.rate_per_s or trace.get("rate_per_s")
    if rate is None:
        raise ValueError(f"{arr.path}: the trace has no arrival times; give the arrival a "
                         "`rate_per_s`")
    if math.isinf(rate):  # vLLM sent them all at once
        return np.full(n, arr.start_s)
    return np.asarray(arr.start_s + np.cumsum(rng.exponential(1.0 / rate, size=n)))


def _times(arr: Arrival, duration: float, rng: np.random.Generator, sc: Scenario) -> np.ndarray:
    stop = arr.stop_s if arr.stop_s is not None else duration
    if arr.kind == "burst":
        n = arr.count or 0
        return arr.at_s + (np.arange(n) * (arr.over_s / n) if arr.over_s else np.zeros(n))
    if arr.kind == "trace":
        t = _trace_times(arr, _trace(arr, sc), rng)
        return t[t < stop]
    rate = arr.rate_per_s or 1.0
    if arr.kind == "poisson":
        return _poisson(rate, arr.start_s, stop, rng)
    period = (arr.on_s or 0.0) + (arr.off_s or 0.0)
    t = _poisson(rate, 0.0, (stop - arr.start_s) * (arr.on_s or 0.0) / period, rng)
    on = arr.on_s or 1.0
    shifted: np.ndarray = arr.start_s + np.floor(t / on) * period + np.mod(t, on)
    return shifted


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
    t = _times(wc.arrival, sc.duration_s, rng, sc)
    if wc.arrival.max_requests is not None:
        t = t[: wc.arrival.max_requests]
    n = t.size
    trace = _trace(wc.arrival, sc) if wc.arrival.kind == "trace" else None
    if wc.prompt_tokens is not None:
        prompt = sample_lengths(wc.prompt_tokens, n, rng, sc.base_dir)
    else:
        prompt = np.maximum(trace["prompt"][:n], 1) if trace is not None else np.ones(n, np.int64)
    if wc.output_tokens is not None:
        eos = sample_lengths(wc.output_tokens, n, rng, sc.base_dir)
    else:
        eos = np.maximum(trace["output"][:n], 1) if trace is not None else np.ones(n, np.int64)
    max_tokens = np.full(n, wc.max_tokens, np.int64) if wc.max_tokens else eos.copy()
    hash_ids = np.empty(n, dtype=object)  # None unless the trace has them
    if trace is not None and "hash_ids" in trace:
        hash_ids[:] = trace["hash_ids"][:n]
    if wc.prefix is not None:  # shared prefixes: the prompt grows by the chat's history
        prompt, hash_ids = prefixed_prompts(wc.prefix, prompt, eos, rng, (seed, idx))
    return t, np.full(n, idx, np.int64), prompt, eos, max_tokens, hash_ids


def build_requests(sc: Scenario, seed: int | None = None) -> Requests:
    """Every request of the scenario, merged across classes and sorted by arrival time.

    Args:
        sc: the scenario.
        seed: overrides `sc.seed`.
    """
    seed = sc.seed if seed is None else seed
    parts = [_class_requests(wc, i, sc, seed) for i, wc in enumerate(sc.workload)]
    t, cls, prompt, eos, max_tokens, hash_ids = (
        np.concatenate(col) for col in zip(*parts, strict=True))
    order = np.lexsort((cls, t))
    hashed = any(h is not None for h in hash_ids)
    return Requests(t[order], cls[order], prompt[order], eos[order], max_tokens[order],
                    hash_ids[order] if hashed else None)
