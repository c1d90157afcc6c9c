"""The status contract: what each refusal answers, so a dispatcher can key on it.

Every error the gateway answers carries its reason twice: as the body's `error.code` and as the
`x-llmflow-reason` header (a proxy reads headers, not bodies). The refusals a client should
plan for, those of capacity, policy, deadlines and the backend, are `REFUSALS`, one entry per
reason; the table in `docs/gateway.md` ("Status contract") is checked against it, and the
contract test drives each one from outside. The statuses mean one thing each:

- 429: capacity exists and this request is over its share of it now (its queue, its tier, its
  rate limit): come back after `Retry-After`, which every 429 carries;
- 503: there is no capacity for it now (no healthy backend, the gateway draining or out of
  connections, the queue wait spent): try another replica, or come back after `Retry-After`
  where it is given;
- 504: it started and the backend did not answer in time; 502: the backend failed.

Backpressure is never a 500: a 500 is a bug (`internal_error`). A reply already streaming
cannot change its status: a refusal then is a cut, the reason in the notice (`REFUSALS[r].cut`).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["REASON_HEADER", "REFUSALS", "TRANSPORT_RETRY_AFTER_S", "Rule", "reason_header"]

REASON_HEADER = "x-llmflow-reason"  # on every error response: the body's `error.code`
# Retry-After of a refusal no runtime priced: no request exists yet (out of connections), or
# it is the socket's own bound (a WebSocket's requests sent ahead)
TRANSPORT_RETRY_AFTER_S = 1


class Rule(NamedTuple):
    """How one reason goes on the wire."""

    statuses: tuple[int, ...]  # the reply's status(es); () when it only ever ends a stream
    retry_after: bool  # a reply with it carries Retry-After (whole seconds, >= 1); else never
    cut: bool  # it may also end a started reply in-band, with the notice naming it
    llm_d: str | None  # llm-d's `x-llm-d-request-dropped-reason` for it; None: no counterpart


# fmt: off
REFUSALS: dict[str, Rule] = {
    # 429: over its share; come back after Retry-After
    "queue_full":                Rule((429,), True, False, "rejected-saturated"),
    "tier_shed":                 Rule((429,), True, False, "rejected-saturated"),
    "kv_pressure":               Rule((429,), True, False, "rejected-saturated"),
    "ttft_sla":                  Rule((429,), True, False, "rejected-saturated"),
    "preemption_breaker":        Rule((429,), True, False, "rejected-saturated"),
    "displaced":                 Rule((429,), True, False, "evicted-priority"),
    "rate_limited":              Rule((429,), True, False, None),
    "light_lane_full":           Rule((429,), True, False, "rejected-saturated"),
    "too_many_pending_requests": Rule((429,), True, False, None),
    # 503: no capacity for it now
    "no_healthy_backend":        Rule((503,), True, False, "rejected-no-endpoints"),
    "draining":                  Rule((503,), True, False, "rejected-shutting-down"),
    "too_many_connections":      Rule((503,), True, False, None),
    "queue_timeout":             Rule((503,), True, False, "rejected-ttl-expired"),
    "deadline":                  Rule((503,), True, True, "rejected-ttl-expired"),
    "shutdown":                  Rule((503,), False, True, "rejected-shutting-down"),
    # armed when it starts: 504 with `on_first_token_timeout: error`, else a cut
    "first_token_timeout":       Rule((504,), True, True, "evicted"),
    # the backend failed: 502, or in-band once the reply has begun
    "backend_unavailable":       Rule((502,), False, False, None),
    "backend_error":             Rule((502,), False, True, None),
    # the client stopped reading: its connection is closed, nobody reads a status
    "client_stall":              Rule((), False, True, None),
    # the client's own deadline (x-llmflow-deadline-ms, an SDK's timeout) cannot be met: a 429
    # like the SLA's, whose Retry-After says when its budget will suffice (llm-d answers its
    # queue TTL's expiry with 429 too while it has endpoints)
    "client_deadline":           Rule((429,), True, False, "rejected-ttl-expired"),
}
# fmt: on


def reason_header(code: str) -> tuple[bytes, bytes]:
    """The `x-llmflow-reason` header of an error with this code, as raw bytes."""
    return REASON_HEADER.encode(), code.encode("latin-1", "replace")
