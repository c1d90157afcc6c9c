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
    "refit",
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


def _nnls(x: Any, y: Any) -> Any:
    """min ||x c - y|| subject to c >= 0 (Lawson and Hanson's active set).

    A coefficient is zero only where the data, with the others fitted, pull it below zero
    (the Karush-Kuhn-Tucker conditions hold at the answer); solving without the bound and
    dropping whichever term came out most negative, as this fit once did, can zero a term the
    data support and keep a correlated one that takes its share. Columns are scaled to unit
    norm first, so terms of 1e-8 s and 1e-3 s meet the same tolerances.
    """
    norms = np.linalg.norm(x, axis=0)
    norms[norms == 0] = np.inf  # a column of zeros: its coefficient stays 0
    a = x / norms
    n, eps = a.shape[1], 1e-12
    coef, free = np.zeros(n), np.zeros(n, dtype=bool)
    for _ in range(3 * n):
        grad = a.T @ (y - a @ coef)
        grad[free | np.isinf(norms)] = -np.inf
        if grad.max() <= eps:
            break
        free[int(np.argmax(grad))] = True
        while True:
            trial = np.zeros(n)
            trial[free] = np.linalg.lstsq(a[:, free], y, rcond=None)[0]
            if (trial[free] > eps).all():
                coef = trial
                break
            bad = free & (trial <= eps)
            step = float(np.min(coef[bad] / (coef[bad] - trial[bad])))
            coef = coef + step * (trial - coef)
            free &= coef > eps
            coef[~free] = 0.0
    return coef / norms


@dataclass(frozen=True)
class _Stage:
    """One stage of the fit: its rows' terms and the coefficients fitted to them."""

    coef: Any  # fitted, non-negative
    rel: Any  # (prediction - y) / y per row
    rel_se: list[float | None]  # standard error / coefficient, None where unknown


def _stage(x: Any, y: Any) -> _Stage:
    """Non-negative least squares on relative error (rows weighted `1 / y`), with each
    positive coefficient's standard error from the residual scatter (None where the rows
    leave no degree of freedom or the term is at its bound)."""
    w = 1.0 / y
    xw, yw = x * w[:, None], y * w
    coef = _nnls(xw, yw)
    free = coef > 0
    rel_se: list[float | None] = [None] * len(coef)
    dof = len(y) - int(free.sum())
    if dof > 0 and free.any():
        scatter = float(np.sum((xw @ coef - yw) ** 2)) / dof
        cov = np.linalg.pinv(xw[:, free].T @ xw[:, free]) * scatter
        for i, var in zip(np.flatnonzero(free), np.diag(cov), strict=True):
            rel_se[i] = round(float(np.sqrt(max(var, 0.0)) / coef[i]), 4)
    return _Stage(coef, (x @ coef - y) / y, rel_se)


def _need(rows: int, distinct: int, terms: int, what: str, fix: str) -> None:
    if rows < terms or distinct < 2:
        raise ValueError(f"{rows} {what} measurements cannot fit {terms} terms: {fix}")


def fit_step_model(
    prefill: list[PrefillSample], decode: list[DecodeSample], mixed: list[MixedSample] | None = None
) -> tuple[StepModel, float, dict[str, Any]]:
    """Fit the step model and the frontend latency to measurements, in stages.

    Each term comes from the probes that isolate it, so noise in one sweep cannot trade one
    term against another (docs/fidelity.md, "Fitting the step costs"):

    1. decode-only steps: `overhead + decode_seq * D + decode_ctx * C` (the batches must vary
       in size and in context, so that D and C are not proportional);
    2. idle first tokens, less the overhead of 1: `frontend + prefill_token * P +
       prefill_attn * P**2`;
    3. mixed steps, less everything 1 and 2 predict for them: `mixed_prefill * P`.

    Repeats of one configuration are first combined by their median. Every stage is a
    non-negative least squares on relative error (rows weighted `1 / y`: a 2 ms decode step
    counts as much as a 30 ms prefill).

    Args:
        prefill: first-token times of single requests on an idle engine.
        decode: mean step times of batches decoding together.
        mixed: steps in which a prompt joined a decoding batch (without them `mixed_prefill`
            is zero: prompts cost the same alone or among decodes).

    Returns:
        (step model, frontend seconds, fit statistics: per-row relative errors, each term's
        relative standard error, the terms at their zero bound).

    Raises:
        ValueError: no prefill or no decode rows, or too few distinct ones to fit their stage.
    """
    if not decode or not prefill:
        raise ValueError("the fit needs both prefill and decode measurements")
    prefill, decode, mixed = _medians(prefill, decode, mixed or [])
    _need(len(decode), min(len({d.concurrency for d in decode}),
                           len({d.prompt_tokens for d in decode})), 3, "decode",
          "probe two or more batch sizes at two or more context lengths")
    _need(len(prefill), len(prefill), 3, "prefill", "probe three or more prompt lengths")
    d = _stage(np.array([[1.0, b.concurrency, b.decode_ctx] for b in decode]),
               np.array([b.itl_s for b in decode]))
    overhead, decode_seq, decode_ctx = (float(c) for c in d.coef)

    def base(p: float, decodes: float, ctx: float) -> float:
        return overhead + decode_seq * decodes + decode_ctx * ctx

    ttft = np.array([p.ttft_s for p in prefill])
    p_rows = np.array([[1.0, p.prompt_tokens, p.prompt_tokens**2] for p in prefill])
    # the first token pays the frontend and one prefill step: fit what the overhead leaves
    pre = _stage(p_rows, ttft - overhead)
    frontend, prefill_token, prefill_attn = (float(c) for c in pre.coef)
    pre_rel = (p_rows @ pre.coef + overhead - ttft) / ttft
    mixed_prefill, mix_rel, mix_se = 0.0, np.zeros(0), None
    if mixed:
        step = np.array([m.step_s for m in mixed])
        known = np.array([base(0, m.decodes, m.decode_ctx) + prefill_token * m.prompt_tokens
                          + prefill_attn * m.prompt_tokens**2 for m in mixed])
        tokens = np.array([[float(m.prompt_tokens)] for m in mixed])
        w = 1.0 / step
        mixed_prefill = float(_nnls(tokens * w[:, None], (step - known) * w)[0])
        mix_rel = (known + mixed_prefill * tokens[:, 0] - step) / step
        if mixed_prefill > 0 and len(mixed) > 1:
            scatter = float(np.sum((mix_rel) ** 2)) / (len(mixed) - 1)
            mix_se = round(float(np.sqrt(scatter / np.sum((tokens[:, 0] * w) ** 2))
                                 / mixed_prefill), 4)
    values = {"frontend": frontend, "overhead": overhead, "prefill_token": prefill_token,
              "prefill_attn": prefill_attn, "decode_seq": decode_seq, "decode_ctx": decode_ctx,
              "mixed_prefill": mixed_prefill}
    se = dict(zip(("overhead", "decode_seq", "decode_ctx"), d.rel_se, strict=True))
    se.update(zip(("frontend", "prefill_token", "prefill_attn"), pre.rel_se, strict=True))
    if mixed:
        se["mixed_prefill"] = mix_se
    rel = np.concatenate([pre_rel, d.rel, mix_rel])
    stats = {
        "method": "staged",  # decode, then prefill, then mixed (fit_step_model)
        "rows": len(rel),
        "median_abs_rel_error": round(float(np.median(np.abs(rel))), 4),
        "max_abs_rel_error": round(float(np.max(np.abs(rel))), 4),
        "prefill_rel_error": [round(float(r), 4) for r in pre_rel],
        "decode_rel_error": [round(float(r), 4) for r in d.rel],
        "mixed_rel_error": [round(float(r), 4) for r in mix_rel],
        "rel_stderr": se,
        "zeroed_terms": [n for n, c in values.items() if c == 0.0 and (n != "mixed_prefill"
                                                                        or mixed)],
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


def refit(profile: Profile) -> Profile:
    """The profile fitted again, by this version's `fit_step_model`, from the raw measurements
    it holds. A gateway hop that was added to its frontend latency (`fit.gateway_hop_s`, written
    by the fidelity recordings) is added again.

    Raises:
        ValueError: its measurements cannot be fitted.
    """
    hop = float(profile.fit.get("gateway_hop_s", 0.0))
    out = pooled([profile])
    fit = {**out.fit, "gateway_hop_s": hop} if hop else out.fit
    return out.model_copy(update={"frontend_s": out.frontend_s + hop, "fit": fit})


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
