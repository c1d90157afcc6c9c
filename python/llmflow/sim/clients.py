"""Clients: one SimPy process per user request, from its first attempt to its final state.

A client sends an `Attempt` through a policy (`direct` or a gated one), then waits for its first
token and its end. It retries on 429 (and on a gateway's 503, e.g. its queue timeout) with
exponential backoff and jitter, never sooner than the `Retry-After` header (whole seconds, as on
the wire); it gives up after `timeout_s` without a first token (without the whole answer when
not streaming) and re-sends up to `retries_on_timeout` times (the avalanche); each attempt says,
as the OpenAI SDK's headers do, how many attempts came before it and how long its client waits
(`Attempt.retries`, `Attempt.deadline_ms`); it may disconnect after some tokens or seconds.
Latency is user-perceived: counted from the first attempt. Tokens are consumed in batches: the
engine reports only first tokens and ends, never single tokens. A client may stall (stop reading
after some tokens): a gateway's runtime then cuts it once its backpressure window has stayed
full too long; without one, vLLM generates to the end for nobody.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import random
    from collections.abc import Generator

    import simpy

    from llmflow.sim.engine import Seq
    from llmflow.sim.metrics import Recorder
    from llmflow.sim.scenario import ClientSpec, Retry

__all__ = ["Attempt", "Gateway", "RequestSpec", "backoff_delay", "client"]

# What an attempt ended with (`Attempt.outcome`).
COMPLETED, CANCELLED, TRUNCATED = "completed", "cancelled", "truncated"
REJECTED, BUSY, EXPIRED, ERROR = "rejected", "busy", "expired", "error"


class RequestSpec:
    """What one user request asks for (shared by all its attempts)."""

    __slots__ = ("cls", "eos", "hash_block", "hash_ids", "index", "max_tokens", "prompt",
                 "tenant")

    def __init__(self, cls: int, tenant: str, prompt: int, eos: int, max_tokens: int,
                 index: int = 0, hash_ids: tuple[int, ...] | None = None,
                 hash_block: int = 512):
        self.cls, self.tenant, self.prompt, self.eos, self.max_tokens = (
            cls, tenant, prompt, eos, max_tokens)
        self.index = index  # its place in the run's requests (the per-request rows' id)
        self.hash_ids = hash_ids  # the prompt's prefix block hashes, from a trace
        self.hash_block = hash_block  # tokens per hash id (Mooncake's traces: 512)


class Gateway(Protocol):
    """What a client talks to: a policy in front of the backends."""

    def send(self, att: Attempt) -> None:
        """Start an attempt; a 429 or 400 may end it before this returns."""

    def cancel(self, att: Attempt) -> None:
        """The client disconnected: abort the attempt wherever it is."""


class Attempt:
    """One HTTP request of a client; the engine's `Seq` owner while it runs.

    Args:
        env: the simulation environment.
        req: the user request it tries to serve.
        stop_after: tokens after which the client disconnects (`None`: never).
        stall_after: tokens after which the client stops reading (`None`: never).
        stream: the client asked for a streamed answer.
        retries: the attempts its client made before this one (the SDKs' retry count header).
        deadline_ms: how long its client waits for it (the SDKs' timeout header), if it gives up.
    """

    __slots__ = (
        "backend", "deadline_ms", "done", "ended", "env", "first", "handler", "key", "outcome",
        "reason", "req", "retries", "retry_after", "seq", "stall_after", "stop_after", "stream",
        "t_admit", "t_first", "t_sched", "t_submit", "tokens",
    )

    def __init__(self, env: simpy.Environment, req: RequestSpec, stop_after: int | None,
                 stall_after: int | None = None, stream: bool = True, retries: int = 0,
                 deadline_ms: int | None = None):
        self.env, self.req, self.stop_after, self.stall_after = env, req, stop_after, stall_after
        self.stream, self.retries, self.deadline_ms = stream, retries, deadline_ms
        self.first = env.event()
        self.done = env.event()
        self.ended = False
        self.outcome, self.reason = "", ""
        self.retry_after = 0.0
        self.t_submit = env.now
        self.t_first = self.t_sched = self.t_admit = math.nan  # t_admit: started upstream
        self.tokens = 0
        self.seq: Seq | None = None
        self.backend: object = None
        self.handler: object = None  # the policy's hook object
        self.key = 0

    def got_first(self, now: float) -> None:
        """The first token reached the client."""
        self.t_first = now
        if not self.first.triggered:
            self.first.succeed()

    def end(self, outcome: str, tokens: int = 0, reason: str = "", retry_after: float = 0.0,
            ) -> None:
        """The attempt is over (served, refused or cut); wakes the client."""
        if self.ended:
            return
        self.ended = True
        self.outcome, self.tokens, self.reason, self.retry_after = (
            outcome, tokens, reason, retry_after)
        if not self.first.triggered:
            self.first.succeed()
        self.done.succeed()


def backoff_delay(policy: Retry, retries: int, retry_after: float, rng: random.Random) -> float:
    """Seconds to wait before retry number `retries + 1` after a 429.

    `min(cap, base * 2**retries)` with the jitter applied (`equal`: half fixed, half uniform;
    `full`: uniform from 0), and never less than the server's Retry-After when honoured.
    """
    d = min(policy.cap_s, policy.base_s * 2.0 ** min(retries, 60))
    if policy.jitter == "full":
        d = rng.uniform(0.0, d)
    elif policy.jitter == "equal":
        d = d / 2 + rng.uniform(0.0, d / 2)
    if policy.honour_retry_after and retry_after > d:
        d = retry_after
    return d


def client(
    env: simpy.Environment, req: RequestSpec, gw: Gateway, spec: ClientSpec, rng: random.Random,
    rec: Recorder,
) -> Generator[simpy.Event, object, None]:
    """The life of one user request (a SimPy process); records its final state in `rec`."""
    t0 = env.now
    rec.arrive()
    attempts = timeouts = busy = 0
    ttft = qwait = served = math.nan
    # What an SDK client says with each attempt: its retries so far and its own timeout.
    deadline_ms = None if spec.timeout_s is None else round(spec.timeout_s * 1000)
    while True:
        att = Attempt(env, req, spec.disconnect_after_tokens, spec.stall_after_tokens,
                      spec.stream, attempts, deadline_ms)
        attempts += 1
        gw.send(att)
        if not att.ended:
            yield from _wait(env, att, gw, spec)
        if att.t_first == att.t_first and ttft != ttft:  # first token of the request (not NaN)
            ttft = att.t_first - t0
            served = att.t_first - att.t_submit
            qwait = att.t_sched - att.t_submit
        outcome = att.outcome
        if outcome in (REJECTED, BUSY):
            retry = spec.retry_429
            if retry is not None and (retry.max_attempts is None or busy + 1 < retry.max_attempts):
                yield env.timeout(backoff_delay(retry, busy, att.retry_after, rng))
                busy += 1
                continue
            state = "rejected" if outcome == REJECTED else "timed_out"
        elif outcome == EXPIRED:
            if timeouts < spec.retries_on_timeout:
                timeouts += 1
                if spec.retry_delay_s:
                    yield env.timeout(spec.retry_delay_s)
                continue
            state = "timed_out"
        elif outcome == ERROR:
            state = "failed"
        else:
            state = outcome  # completed, cancelled, truncated
        stall = spec.stall_after_tokens
        if stall is not None and state == COMPLETED and att.tokens > stall:
            state, att.tokens = CANCELLED, stall  # the user left with what was shown
        end = env.now
        if spec.render_tps and att.tokens and state != "failed":
            end = max(end, att.t_first + att.tokens / spec.render_tps)
        if not spec.stream:  # an unstreamed answer shows up all at once, or not at all
            shown = state in (COMPLETED, TRUNCATED)
            ttft = end - t0 if shown else math.nan
            served = end - att.t_submit if shown else math.nan
        rec.end(req.cls, t0, ttft, end - t0, state, attempts, busy, att.tokens, qwait, served,
                req=req, last=att)
        return


def _wait(
    env: simpy.Environment, att: Attempt, gw: Gateway, spec: ClientSpec
) -> Generator[simpy.Event, object, None]:
    """Wait for the attempt's first token and end, honouring the client's own limits."""
    if spec.timeout_s is not None:
        watched = att.first if spec.stream else att.done
        limit = env.timeout(spec.timeout_s)
        yield watched | limit
        if not watched.triggered:
            gw.cancel(att)
            att.end(EXPIRED, reason="client_timeout")
            return
    if att.ended:
        return
    if spec.disconnect_after_s is not None:
        limit = env.timeout(max(0.0, spec.disconnect_after_s - (env.now - att.t_submit)))
        yield att.done | limit
        if not att.done.triggered:
            gw.cancel(att)
            seq = att.seq
            att.end(CANCELLED, tokens=seq.gen if seq is not None else 0, reason="disconnect")
        return
    yield att.done
