"""Per-request records and their summaries: counts by final state, latency percentiles, Little.

Every user request ends in exactly one state: `completed`, `rejected` (gave up after 429s),
`timed_out` (no answer in time: client timeout or gateway expiry), `truncated` (cut by the
deadline, partial text returned), `cancelled` (the client disconnected), `failed` (refused as
invalid, e.g. longer than `max_model_len`) or `unfinished` (still live when the run stopped).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import simpy

    from llmflow.sim.clients import Attempt, RequestSpec

__all__ = ["STATES", "Recorder", "percentiles", "tpot"]

STATES = ("completed", "rejected", "timed_out", "truncated", "cancelled", "failed", "unfinished")


def percentiles(x: np.ndarray, qs: tuple[int, ...]) -> dict[str, float | None]:
    """`{"p50": ...}` of the finite values of `x`, rounded to the microsecond; None when empty."""
    x = x[np.isfinite(x)]
    if x.size == 0:
        return {f"p{q}": None for q in qs}
    return {f"p{q}": round(float(v), 6) for q, v in zip(qs, np.percentile(x, qs), strict=True)}


class Recorder:
    """Collects one row per ended user request, and the live count's time integral.

    Args:
        env: the simulation environment (its clock times the live-count integral).
    """

    def __init__(self, env: simpy.Environment):
        self.env = env
        self.rows: list[tuple[Any, ...]] = []
        # one per request, in `llmflow.request_log.COLUMNS` order (class as its index)
        self.requests: list[tuple[Any, ...]] = []
        self.live = 0
        self.arrived = 0
        self.area_live = 0.0
        self._last = 0.0
        self.on_end: list[Any] = []  # callables run after each end (progress bar, drain check)

    def _advance(self) -> None:
        now = self.env.now
        self.area_live += (now - self._last) * self.live
        self._last = now

    def arrive(self) -> None:
        """A user request arrived."""
        self._advance()
        self.live += 1
        self.arrived += 1

    def end(
        self, cls: int, t0: float, ttft: float, e2e: float, state: str, attempts: int,
        busy: int, tokens: int, qwait: float, served: float = math.nan,
        req: RequestSpec | None = None, last: Attempt | None = None,
    ) -> None:
        """A user request reached its final state (`req` and its `last` attempt: for its row in
        `requests`)."""
        self._advance()
        self.live -= 1
        self.rows.append(
            (cls, t0, ttft, e2e, state, attempts, busy, tokens, qwait, self.env.now - t0, served))
        if req is not None and last is not None:
            backend = getattr(last.backend, "name", None)
            self.requests.append((
                req.index, cls, req.tenant, t0, attempts, last.t_admit, t0 + ttft, t0 + e2e,
                req.prompt, req.max_tokens, tokens, state, last.reason or None, backend))
        for fn in self.on_end:
            fn()

    def close(self, live: list[tuple[int, float, RequestSpec]]) -> None:
        """Stop the clock: requests still live become `unfinished` rows."""
        self._advance()
        for cls, t0, req in live:
            stay = self.env.now - t0
            self.rows.append(
                (cls, t0, math.nan, stay, "unfinished", 0, 0, 0, math.nan, stay, math.nan))
            self.requests.append((req.index, cls, req.tenant, t0, 0, math.nan, math.nan,
                                  math.nan, req.prompt, req.max_tokens, 0, "unfinished", None,
                                  None))

    def columns(self) -> dict[str, np.ndarray]:
        """The rows as column arrays, in arrival order."""
        rows = sorted(self.rows, key=lambda r: r[1])
        names = ("cls", "t0", "ttft", "e2e", "state", "attempts", "busy", "tokens", "qwait",
                 "sojourn", "served")
        if not rows:
            return {n: np.zeros(0) for n in names}
        cols = list(zip(*rows, strict=True))
        return {
            n: np.array(c, dtype=object if n == "state" else float) for n, c in zip(names, cols,
                                                                                    strict=True)
        }

    def littles_law(self, horizon: float) -> dict[str, float]:
        """L (time-average of requests in the system), lambda and W over `[0, horizon]`.

        `L` comes from the live counter's integral, `W` from the rows' sojourn times: two
        bookkeeping paths that agree only if every request was counted in and out exactly once.
        """
        cols = self.columns()
        n = len(cols["t0"])
        if n == 0 or horizon <= 0:
            return {"L": 0.0, "lambda": 0.0, "W": 0.0, "rel_error": 0.0}
        lam, w = n / horizon, float(np.mean(cols["sojourn"]))
        big_l = self.area_live / horizon
        err = abs(big_l - lam * w) / big_l if big_l else 0.0
        return {"L": round(big_l, 6), "lambda": round(lam, 6), "W": round(w, 6),
                "rel_error": round(err, 9)}


def tpot(cols: dict[str, np.ndarray]) -> np.ndarray:
    """Each request's time per output token after the first (s): `(e2e - ttft) / (tokens - 1)`
    for answers of two tokens or more that were served (completed or truncated), else NaN."""
    state, n = cols["state"], cols["tokens"]
    ok = ((state == "completed") | (state == "truncated")) & (n > 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ok, (cols["e2e"] - cols["ttft"]) / (n - 1), np.nan)


def class_summary(cols: dict[str, np.ndarray], idx: int, chars_per_token: float) -> dict[str, Any]:
    """The report block of one workload class."""
    mine = cols["cls"] == idx
    state = cols["state"][mine]
    out: dict[str, Any] = {"arrived": int(mine.sum())}
    for s in STATES:
        out[s] = int(np.sum(state == s))
    ok = (state == "completed") | (state == "truncated")
    out["ttft_s"] = percentiles(cols["ttft"][mine], (50, 90, 99))
    out["e2e_s"] = percentiles(np.where(ok, cols["e2e"][mine], np.nan), (50, 90, 99))
    out["queue_wait_s"] = percentiles(cols["qwait"][mine], (50, 99))
    # decode-side interference (prefills sharing steps with decodes) shows here, not in TTFT
    out["tpot_s"] = percentiles(tpot(cols)[mine], (50, 90, 99))
    # TTFT p99 with every request that never got an answer (refused, timed out, failed, still
    # waiting) counted as infinitely late: percentiles of the served alone flatter a policy
    # that loses requests. Cancelled requests left by choice and are not counted.
    served = np.where(ok | (state == "cancelled"), cols["ttft"][mine], np.inf)
    counted = served[~((state == "cancelled") & ~np.isfinite(cols["ttft"][mine]))]
    # nearest rank: interpolating between two infinities is undefined
    p99 = float(np.percentile(counted, 99, method="higher")) if counted.size else None
    out["ttft_p99_lost_inf_s"] = None if p99 is None or not math.isfinite(p99) else round(p99, 6)
    ends = (cols["t0"] + cols["e2e"])[mine][ok]
    out["last_done_s"] = round(float(ends.max()), 6) if ends.size else None
    # TTFT of the attempt that was served, from its own submission: what a server-side
    # histogram shows (no 429 backoff, no earlier timed-out attempts)
    out["ttft_served_attempt_s"] = percentiles(cols["served"][mine], (50, 99))
    out["attempts_mean"] = round(float(cols["attempts"][mine].mean()), 4) if out["arrived"] else 0
    out["retries_429"] = int(cols["busy"][mine].sum())
    trunc = state == "truncated"
    toks = cols["tokens"][mine]
    out["truncated_tokens_mean"] = round(float(toks[trunc].mean()), 2) if trunc.any() else None
    out["truncated_chars_mean"] = (
        round(float(toks[trunc].mean()) * chars_per_token, 1) if trunc.any() else None)
    out["output_tokens"] = int(toks[ok].sum())
    return out
