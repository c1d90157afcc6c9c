"""Per-tenant rate limits against a reference token bucket written from the documented rule.

Covers: for random arrivals (time steps, tenants, prompts) and streamed output, the core refuses
a request for `rate_limited` exactly when the reference says the tenant's buckets cannot pay for
it, with the Retry-After the reference computes; a tenant's limit never refuses another tenant;
and an unlimited tenant is never rate-limited. Every other refusal is kept out (a large cap and
queue, no SLA, no KV checks), so any refusal seen is a rate limit.

The rule (docs and `rust/src/governor/limits.rs`): the request bucket holds a second's worth of
`requests_per_s` (at least one) and the token bucket a minute's worth of `tokens_per_min`; both
start full and refill continuously. A request enters while the request bucket holds one request
and the token bucket holds its prompt (at most the whole bucket); it pays one request and its
prompt, and its output tokens are paid as they stream (possibly below zero).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from llmflow import Governor, Rejected
from property_tests.strategies import policy_config

LIMITS = {"a": (2.0, 600.0), "b": (0.5, None), "c": (None, 3000.0), "d": (None, None)}


@dataclass
class Bucket:
    """The reference: one tenant's two buckets, in seconds and tokens."""

    req_rate: float | None
    tok_per_min: float | None
    requests: float = 0.0
    tokens: float = 0.0
    at_us: int = 0

    def __post_init__(self) -> None:
        self.requests = max(1.0, self.req_rate) if self.req_rate else 0.0
        self.tokens = self.tok_per_min or 0.0

    def refill(self, now_us: int) -> None:
        dt = max(0, now_us - self.at_us) / 1e6
        self.at_us = max(self.at_us, now_us)
        if self.req_rate:
            self.requests = min(max(1.0, self.req_rate), self.requests + self.req_rate * dt)
        if self.tok_per_min:
            self.tokens = min(self.tok_per_min, self.tokens + self.tok_per_min / 60.0 * dt)

    def wait(self, prompt: int) -> float:
        """Seconds until the tenant may send this request (0: now)."""
        w = 0.0
        if self.req_rate:
            w = max(w, (1.0 - self.requests) / self.req_rate)
        if self.tok_per_min:
            w = max(w, (min(prompt, self.tok_per_min) - self.tokens) / (self.tok_per_min / 60.0))
        return w


events = st.lists(
    st.tuples(
        st.integers(0, 2_000_000),  # µs since the previous event
        st.sampled_from(sorted(LIMITS)),
        st.integers(1, 1500),  # prompt tokens
        st.integers(0, 400),  # output tokens it then streams
    ),
    min_size=1,
    max_size=80,
)


@given(events)
def test_rate_limits_match_the_reference(steps: list[tuple[int, str, int, int]]) -> None:
    tenants = [
        {"name": name, "tier": "normal", "weight": 1.0}
        | ({"requests_per_s": r} if r else {})
        | ({"tokens_per_min": t} if t else {})
        for name, (r, t) in LIMITS.items()
    ]
    config = policy_config(
        max_waiting=10_000,
        per_gpu=10_000,
        gpus=(1,),
        tenants=tenants,
        kv_pressure_threshold=None,
        queue_timeout_ms=None,
        first_token_timeout_ms=None,
        request_timeout_ms=None,
    )
    core = Governor(config)
    ref = {name: Bucket(*limits) for name, limits in LIMITS.items()}
    now = 0
    for rid, (dt, tenant, prompt, output) in enumerate(steps, start=1):
        now += dt
        bucket = ref[tenant]
        bucket.refill(now)
        expected_wait = bucket.wait(prompt)
        decision = core.submit(rid, tenant, prompt, output + 1, now)
        if expected_wait > 0.0:
            assert isinstance(decision, Rejected), (rid, tenant, expected_wait, decision)
            assert decision.reason == "rate_limited"
            want = min(max(expected_wait, 0.05), 3600.0)
            assert math.isclose(decision.retry_after_s, want, rel_tol=1e-6, abs_tol=1e-6)
            continue
        assert not isinstance(decision, Rejected), (rid, tenant, decision)
        if bucket.req_rate:
            bucket.requests -= 1.0
        if bucket.tok_per_min:
            bucket.tokens -= prompt
        core.dispatch(now)
        if output:
            core.on_tokens(rid, output, now)
            if bucket.tok_per_min:
                bucket.tokens -= output
        core.finish(rid, "completed", now)
