"""Measured step-cost profiles: a linear engine-step model fitted to a live vLLM backend.

`llmflow calibrate` times a real backend (first-token latency of single requests at several
prompt lengths, inter-token latency at several batch sizes and context lengths, and the step a
prompt adds to a decoding batch) and fits

    step = overhead + prefill_token * P + prefill_attn * A + decode_seq * D + decode_ctx * C
           + mixed_prefill * P * [D > 0]

where, for one engine step, `P` is the prompt tokens computed, `A = sum(n * (2 * offset + n))`
over the prefill chunks (causal attention), `D` the sequences decoding and `C` their contexts
summed. `mixed_prefill` is what a prompt token costs beyond `prefill_token` when it shares the
step with decodes (on vLLM's CPU build about as much again, see docs/fidelity.md). A request's
first token also pays `frontend_s` once: the HTTP, tokenizer and IPC path between the client
and the engine, which no engine step contains. The fit is a non-negative,
relative-error least squares (`fit_step_model`), so a coefficient the data cannot support comes
out as zero rather than negative.

`FittedStepCost` is that model behind the simulator's `StepCost` interface; a scenario backend
uses it with `profile: PATH` (see `load_profile`). The profile file is YAML: the fitted
coefficients, the engine limits observed or given (block size, KV blocks, `max_num_seqs`, ...),
the fit's residuals, and every raw measurement, so a fit can be redone or audited.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmflow.sim.costmodel import StepCost

__all__ = [
    "ENGINE_KEYS",
    "STEP_TERMS",
    "DecodeSample",
    "FittedStepCost",
    "MixedSample",
    "PrefillSample",
    "Profile",
    "ProfileError",
    "StepModel",
    "fit_step_model",
    "load_profile",
    "pooled",
]

PROFILE_FORMAT = "llmflow-step-profile/1"  # the `format:` line of a profile file
STEP_TERMS = ("overhead", "prefill_token", "prefill_attn", "decode_seq", "decode_ctx",
              "mixed_prefill")
ENGINE_KEYS = ("block_size", "num_gpu_blocks", "max_model_len", "max_num_seqs",
               "max_num_batched_tokens")  # EngineConfig fields a profile may pin


class ProfileError(ValueError):
    """A profile file is missing, is not YAML, or does not validate."""


class StepModel(BaseModel):
    """Coefficients of the linear step-time model, in seconds per unit of each term."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    overhead: float = Field(ge=0)  # s per step
    prefill_token: float = Field(0.0, ge=0)  # s per prompt token computed
    prefill_attn: float = Field(0.0, ge=0)  # s per unit of n * (2 * offset + n)
    decode_seq: float = Field(0.0, ge=0)  # s per decoding sequence
    decode_ctx: float = Field(0.0, ge=0)  # s per context token of the decoding sequences
    mixed_prefill: float = Field(0.0, ge=0)  # s per prompt token extra in a step with decodes

    def step_time(self, prefill: int, attn: int, decodes: int, ctx: int) -> float:
        """Seconds of one step with these terms."""
        mixed = self.mixed_prefill * prefill if decodes else 0.0
        return (self.overhead + self.prefill_token * prefill + self.prefill_attn * attn
                + self.decode_seq * decodes + self.decode_ctx * ctx + mixed)


class Profile(BaseModel):
    """A profile file: what was measured, on what, and the model fitted to it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: str = PROFILE_FORMAT
    backend: str = ""  # URL that was measured
    model: str = ""  # served model name
    created: str = ""  # UTC timestamp
    step_s: StepModel
    frontend_s: float = Field(0.0, ge=0)  # per request, client to engine and back
    engine: dict[str, int] = {}  # EngineConfig fields (see ENGINE_KEYS)
    fit: dict[str, Any] = {}  # residuals and what was dropped
    measurements: dict[str, Any] = {}  # raw samples: prefill and decode

    def cost(self) -> FittedStepCost:
        """The step-cost model for the simulator's engine (with the frontend latency)."""
        return FittedStepCost(self.step_s, self.engine.get("num_gpu_blocks"),
                              self.engine.get("block_size"), self.frontend_s)

    def engine_flags(self) -> dict[str, int]:
        """The engine limits to run the simulated vLLM with (`EngineConfig` keyword arguments)."""
        return {k: v for k, v in self.engine.items() if k in ENGINE_KEYS}

    def dump(self, path: str | Path) -> None:
        """Write the profile as YAML."""
        data = self.model_dump(mode="json")
        Path(path).write_text(yaml.safe_dump(data, sort_keys=False, width=100), encoding="utf-8")


class FittedStepCost(StepCost):
    """A `StepCost` from a fitted `StepModel`.

    The simulated backend (`llmflow.sim.cluster.Backend`) delays every output its clients see
    by `frontend_s`; no engine step contains that time.

    Args:
        model: the fitted coefficients.
        num_gpu_blocks: KV blocks the backend reported (None: effectively unbounded).
        block_size: tokens per block of that report (None: whatever the engine asks with).
        frontend_s: seconds between the engine and the client, per output.
    """

    def __init__(self, model: StepModel, num_gpu_blocks: int | None = None,
                 block_size: int | None = None, frontend_s: float = 0.0):
        self.model = model
        self.num_gpu_blocks, self.block_size = num_gpu_blocks, block_size
        self.frontend_s = frontend_s
        self.kv_bytes_per_token = 1.0  # only swap preemption reads it; CPU vLLM recomputes
        m = model
        self._c = (m.overhead, m.prefill_token, m.prefill_attn, m.decode_seq, m.decode_ctx,
                   m.mixed_prefill)

    def step_time(
        self, decodes: int, decode_ctx: int, prefill_tokens: int, prefill_attn: int,
        prefill_ctx: int, swap_bytes: float,
    ) -> float:
        """Seconds one step takes (`prefill_ctx` and `swap_bytes` are not in the model)."""
        c0, c1, c2, c3, c4, c5 = self._c
        if decodes:
            c1 += c5
        return c0 + c1 * prefill_tokens + c2 * prefill_attn + c3 * decodes + c4 * decode_ctx

    def kv_blocks(
        self, block_size: int, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256
    ) -> int:
        """The measured KV capacity, in blocks of `block_size` tokens."""
        if self.num_gpu_blocks is None:
            return 1_000_000
        tokens = self.num_gpu_blocks * (self.block_size or block_size)
        return tokens // block_size


@dataclass(frozen=True)
class PrefillSample:
    """One request alone on an idle engine: its prompt and its time to first token."""

    prompt_tokens: int
    ttft_s: float


@dataclass(frozen=True)
class DecodeSample:
    """A batch decoding together: mean seconds per step while every sequence was decoding."""

    concurrency: int
    prompt_tokens: int
    itl_s: float
    decode_ctx: float  # mean over the window of the batch's summed context


@dataclass(frozen=True)
class MixedSample:
    """A prompt joining a decoding batch: the seconds of the one step that computed it."""

    decodes: int
    decode_ctx: float  # the batch's summed context at that step
    prompt_tokens: int
    step_s: float


def _medians(
    prefill: list[PrefillSample], decode: list[DecodeSample], mixed: list[MixedSample]
) -> tuple[list[PrefillSample], list[DecodeSample], list[MixedSample]]:
    """One row per prompt length, per (batch, context) and per (batch, prompt): the median of
    its repeats.

    Interference on a shared machine only ever adds time, in bursts; the median of a few
    repeats ignores a burst that a mean would spread over the fit.
    """
    by_len: dict[int, list[float]] = {}
    for p in prefill:
        by_len.setdefault(p.prompt_tokens, []).append(p.ttft_s)
    by_batch: dict[tuple[int, int], list[DecodeSample]] = {}
    for d in decode:
        by_batch.setdefault((d.concurrency, d.prompt_tokens), []).append(d)
    pre = [PrefillSample(n, float(np.median(v))) for n, v in sorted(by_len.items())]
    dec = [
        DecodeSample(b, c, float(np.median([d.itl_s for d in v])),
                     float(np.mean([d.decode_ctx for d in v])))
        for (b, c), v in sorted(by_batch.items())
    ]
    by_join: dict[tuple[int, int], list[MixedSample]] = {}
    for m in mixed:
        by_join.setdefault((m.decodes, m.prompt_tokens), []).append(m)
    mix = [
        MixedSample(d, float(np.mean([m.decode_ctx for m in v])), n,
                    float(np.median([m.step_s for m in v])))
        for (d, n), v in sorted(by_join.items())
    ]
    return pre, dec, mix


def _rows(
    prefill: list[PrefillSample], decode: list[DecodeSample], mixed: list[MixedSample]
) -> tuple[Any, Any, list[str]]:
    # columns: frontend, then STEP_TERMS; a first token pays frontend + one prefill step
    names = ["frontend", *STEP_TERMS]
    x = [[1.0, 1.0, p.prompt_tokens, p.prompt_tokens**2, 0.0, 0.0, 0.0] for p in prefill]
    x += [[0.0, 1.0, 0.0, 0.0, d.concurrency, d.decode_ctx, 0.0] for d in decode]
    x += [[0.0, 1.0, m.prompt_tokens, m.prompt_tokens**2, m.decodes, m.decode_ctx,
           m.prompt_tokens] for m in mixed]
    y = [p.ttft_s for p in prefill] + [d.itl_s for d in decode] + [m.step_s for m in mixed]
    return np.array(x, dtype=float), np.array(y, dtype=float), names


def _nnls(x: Any, y: Any) -> Any:
    """Least squares with non-negative coefficients: drop the most negative term and refit."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


def fit_step_model(
    prefill: list[PrefillSample], decode: list[DecodeSample], mixed: list[MixedSample] | None = None
) -> tuple[StepModel, float, dict[str, Any]]:
    """Fit the step model and the frontend latency to measurements.

    Repeats of one configuration are first combined by their median. Each row is weighted by
    `1 / y`, so the fit minimises relative error: a 10 ms decode step counts as much as a
    100 ms prefill.

    Args:
        prefill: first-token times of single requests on an idle engine.
        decode: mean step times of batches decoding together.
        mixed: steps in which a prompt joined a decoding batch (without them `mixed_prefill`
            is zero: prompts cost the same alone or among decodes).

    Returns:
        (step model, frontend seconds, fit statistics with per-row relative errors).

    Raises:
        ValueError: fewer rows than terms, or no decode rows (the step overhead and the
            frontend latency cannot be told apart without them).
    """
    if not decode or not prefill:
        raise ValueError("the fit needs both prefill and decode measurements")
    prefill, decode, mixed = _medians(prefill, decode, mixed or [])
    x, y, names = _rows(prefill, decode, mixed)
    if not mixed:
        x = x[:, :-1]
    if len(y) < x.shape[1]:
        raise ValueError(f"{len(y)} measurements cannot fit {x.shape[1]} terms")
    w = 1.0 / y
    coef = _nnls(x * w[:, None], y * w)
    pred = x @ coef
    rel = (pred - y) / y
    values = dict(zip(names, (float(c) for c in coef), strict=False))
    stats = {
        "rows": len(y),
        "median_abs_rel_error": round(float(np.median(np.abs(rel))), 4),
        "max_abs_rel_error": round(float(np.max(np.abs(rel))), 4),
        "prefill_rel_error": [round(float(r), 4) for r in rel[: len(prefill)]],
        "decode_rel_error": [round(float(r), 4) for r in rel[len(prefill):len(y) - len(mixed)]],
        "mixed_rel_error": [round(float(r), 4) for r in rel[len(y) - len(mixed):]],
        "zeroed_terms": [n for n, c in values.items() if c == 0.0],
    }
    frontend = values.pop("frontend")
    return StepModel(**values), frontend, stats


def pooled(profiles: list[Profile]) -> Profile:
    """One profile fitted to the measurements of several, e.g. taken before and after a run
    whose conditions they should bracket. Engine limits and metadata come from the first.

    Raises:
        ValueError: the pooled measurements cannot be fitted.
    """
    prefill = [PrefillSample(**m) for p in profiles for m in p.measurements.get("prefill", ())]
    decode = [DecodeSample(**m) for p in profiles for m in p.measurements.get("decode", ())]
    mixed = [MixedSample(**m) for p in profiles for m in p.measurements.get("mixed", ())]
    step, frontend, stats = fit_step_model(prefill, decode, mixed)
    measurements = {k: [m for p in profiles for m in p.measurements.get(k, ())]
                    for k in ("prefill", "decode", "mixed")}
    return profiles[0].model_copy(update={"step_s": step, "frontend_s": frontend, "fit": stats,
                                          "measurements": measurements})


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile file written by `llmflow calibrate`.

    Raises:
        ProfileError: naming the file and what is wrong with it.
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read profile ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: the top level must be a mapping")
    try:
        profile = Profile.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ProfileError(f"{path}: invalid profile: {problems}") from None
    if profile.format != PROFILE_FORMAT:
        raise ProfileError(f"{path}: format {profile.format!r}, expected {PROFILE_FORMAT!r}")
    unknown = sorted(set(profile.engine) - set(ENGINE_KEYS))
    if unknown:
        raise ProfileError(f"{path}: unknown engine key(s) {unknown}; known: {list(ENGINE_KEYS)}")
    return profile
