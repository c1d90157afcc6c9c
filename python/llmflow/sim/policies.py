"""Policies compared by the simulator: `direct` (no gateway) and gated ones (the Rust core).

`DirectPolicy` sends every request straight to a backend, round robin, where it waits in vLLM's
unbounded queue. `GatedPolicy` does what the gateway does around `llmflow._core.Governor`:
`submit` on arrival, start admitted requests with the core's priority, `dispatch` after anything
frees a slot, `expire` at the core's next deadline, feed `observe_backend` every scrape interval,
and report tokens. Every decision (admit, queue, reject, order, priority, deadlines, shedding)
comes from the core; this module only carries them out. `seed-gate` and `llmflow` are two
configs of the same core (`PRESETS`).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from llmflow._core import Admitted, Rejected
from llmflow.config import Settings, load_settings
from llmflow.sim.clients import BUSY, CANCELLED, COMPLETED, ERROR, EXPIRED, REJECTED, TRUNCATED
from llmflow.sim.engine import EngineError, Seq

if TYPE_CHECKING:
    from collections.abc import Generator

    import simpy

    from llmflow.sim.clients import Attempt
    from llmflow.sim.cluster import Backend, Cluster
    from llmflow.sim.scenario import PolicySpec, Scenario

__all__ = ["PRESETS", "DirectPolicy", "GatedPolicy", "policy_settings"]

# Built-in policy configs: (llmflow config sections, vLLM scheduling policy, tier of every tenant).
PRESETS: dict[str, tuple[dict[str, Any], str, str | None]] = {
    # The seed's gate section and nothing else: 16 per GPU, 200 waiting, 429 when full, in the
    # seed's own `strategy: "fair"` order (a scenario may override it to "fifo").
    "seed-gate": (
        {
            "gate": {"max_concurrency_per_gpu": 16,
                     "queue": {"max_waiting": 200, "strategy": "fair", "max_wait_ms": None}},
            "tiers": [{"name": "all"}],
            "default_tier": "all",
            "kv": {"pressure_threshold": None},
            "sla": {"ttft_ms": None},
            "preemption": {"cooldown_ms": None},
            "timeouts": {"total_ms": None},
            "streaming": {"first_token_timeout_ms": None},
        },
        "fcfs",
        "all",
    ),
    # The full policy with its defaults; vLLM runs the core's priorities.
    "llmflow": ({}, "priority", None),
}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def policy_settings(name: str, spec: PolicySpec, sc: Scenario, cluster: Cluster) -> Settings:
    """The llmflow config a gated policy runs: preset, then the scenario's overrides, then the
    cluster's backends and the workload's tenants (unless the scenario lists its own).

    Raises:
        ConfigFileError: the merged config does not validate.
    """
    base, scheduling, tenant_tier = PRESETS[spec.preset_for(name)]
    data = _merge(base, spec.config)
    tier = spec.tenant_tier or tenant_tier
    if "tenants" not in spec.config:
        seen: dict[str, str] = {}
        for wc in sc.workload:
            seen.setdefault(wc.tenant, tier or wc.tier)
        data["tenants"] = [{"name": t, "tier": tr} for t, tr in seen.items()]
    data["backends"] = [
        {"name": b.name, "gpus": b.gpus, "kv_blocks": b.core.num_blocks,
         "max_model_len": b.core.config.max_model_len,
         "scheduling_policy": spec.scheduling_policy or scheduling}
        for b in cluster.backends
    ]
    data.setdefault("kv", {})["block_size"] = cluster.backends[0].core.block_size
    return load_settings(data=data)


class _Handler:
    """Engine callbacks of one attempt, forwarded to its policy."""

    __slots__ = ("att", "policy")

    def __init__(self, policy: DirectPolicy | GatedPolicy, att: Attempt):
        self.policy, self.att = policy, att

    def on_first_token(self, seq: Seq, now: float) -> None:
        self.policy.first_token(self.att, now)

    def on_finished(self, seq: Seq, now: float) -> None:
        self.policy.finished(self.att, seq, now)

    def on_tokens_reached(self, seq: Seq, now: float) -> None:
        self.policy.tokens_reached(self.att, now)


def _start(policy: DirectPolicy | GatedPolicy, att: Attempt, backend: Backend, prio: int) -> bool:
    req = att.req
    seq = Seq(policy.next_id(), req.prompt, req.max_tokens, req.eos, prio,
              _Handler(policy, att), att.stop_after)
    att.seq, att.backend = seq, backend
    try:
        backend.submit(seq)
    except EngineError as exc:
        att.end(ERROR, reason=str(exc))
        return False
    return True


def _end_reason(seq: Seq) -> str:
    return CANCELLED if seq.finish_reason == "abort" else COMPLETED


class DirectPolicy:
    """No gateway: round robin over the backends, vLLM queues everything.

    Args:
        env: the simulation environment.
        cluster: the backends.
        propagate_disconnect: a client's disconnect aborts its request in vLLM (False models a
            proxy or client library that leaves orphaned requests running).
    """

    def __init__(self, env: simpy.Environment, cluster: Cluster, propagate_disconnect: bool = True):
        self.env, self.backends = env, cluster.backends
        self.propagate = propagate_disconnect
        self._rr = 0
        self._ids = 0

    def next_id(self) -> int:
        """A fresh request id."""
        self._ids += 1
        return self._ids

    def send(self, att: Attempt) -> None:
        """Forward to the next backend in turn."""
        b = self.backends[self._rr]
        self._rr = (self._rr + 1) % len(self.backends)
        _start(self, att, b, 0)

    def cancel(self, att: Attempt) -> None:
        """Client disconnect: vLLM aborts the request (unless disconnects do not reach it)."""
        if att.seq is not None and self.propagate:
            att.backend.abort(att.seq)  # type: ignore[attr-defined]

    def first_token(self, att: Attempt, now: float) -> None:
        """Engine callback."""
        att.t_sched = att.seq.t_sched if att.seq is not None else now
        att.got_first(now)

    def finished(self, att: Attempt, seq: Seq, now: float) -> None:
        """Engine callback."""
        att.end(_end_reason(seq), tokens=seq.gen)

    def tokens_reached(self, att: Attempt, now: float) -> None:
        """Engine callback (never asked for: vLLM ignores a stalled reader)."""


class GatedPolicy:
    """The gateway's use of the core, in simulated time.

    Args:
        env: the simulation environment.
        cluster: the backends.
        settings: the llmflow config (see `policy_settings`).
    """

    def __init__(self, env: simpy.Environment, cluster: Cluster, settings: Settings):
        from llmflow._core import Governor

        self.env, self.cluster = env, cluster
        self.gov = Governor(settings.to_core())
        self.settings = settings
        self._ids = 0
        self.queued: dict[int, Attempt] = {}
        self.live: dict[int, Attempt] = {}  # running on a backend, by request id
        self._reported: dict[int, int] = {}
        self._armed: int | None = None
        self.peak_queue = 0
        self.rejections: dict[str, int] = {}
        env.process(self._scrape(settings.metrics.scrape_interval_ms / 1000.0))

    def next_id(self) -> int:
        """A fresh request id."""
        self._ids += 1
        return self._ids

    def _now_us(self) -> int:
        return round(self.env.now * 1e6)

    def send(self, att: Attempt) -> None:
        """`submit` to the core and act on its decision."""
        rid = self.next_id()
        att.key = rid
        req = att.req
        d = self.gov.submit(rid, req.tenant, req.prompt, req.max_tokens, self._now_us())
        if isinstance(d, Rejected):
            self.rejections[d.reason] = self.rejections.get(d.reason, 0) + 1
            att.end(REJECTED, reason=d.reason, retry_after=d.retry_after_s)
            return
        if isinstance(d, Admitted):
            self._run(att, rid, d.backend, d.priority)
        else:
            self.queued[rid] = att
            q = self.gov.queued
            if q > self.peak_queue:
                self.peak_queue = q
            # a lower tier, or a tenant over its share of the waiting places, loses its newest
            # queued request to this one
            if d.displaced is not None:
                self._refuse_displaced(d.displaced, d.displaced_retry_after_s)
        # submit dispatches by itself; admissions it made for other requests come out here
        self._dispatch()

    def _refuse_displaced(self, rid: int, retry_after: float | None) -> None:
        victim = self.queued.pop(rid, None)
        if victim is not None:
            self.rejections["displaced"] = self.rejections.get("displaced", 0) + 1
            victim.end(REJECTED, reason="displaced", retry_after=retry_after or 0.0)

    def _run(self, att: Attempt, rid: int, backend: str | None, priority: int) -> None:
        b = self.cluster.by_name[backend or ""]
        req = att.req
        bp = self.settings.backpressure
        window_full = None if att.stall_after is None else att.stall_after + bp.client_window
        seq = Seq(rid, req.prompt, req.max_tokens, req.eos, priority, _Handler(self, att),
                  att.stop_after, window_full)
        att.seq, att.backend = seq, b
        try:
            b.submit(seq)
        except EngineError as exc:
            self.gov.finish(rid, "error", self._now_us())
            att.end(ERROR, reason=str(exc))
            return
        self.live[rid] = att
        self._reported[rid] = 0

    def cancel(self, att: Attempt) -> None:
        """Client disconnect: free the slot (or queue place) and abort upstream."""
        rid = att.key
        self.queued.pop(rid, None)
        if self.live.pop(rid, None) is not None and att.seq is not None:
            att.backend.abort(att.seq)  # type: ignore[attr-defined]
            self._reported.pop(rid, None)
        if self.gov.finish(rid, "cancelled", self._now_us()):
            self._dispatch()

    def first_token(self, att: Attempt, now: float) -> None:
        """Engine callback."""
        if att.seq is not None:
            att.t_sched = att.seq.t_sched
        self.gov.on_first_token(att.key, self._now_us())
        att.got_first(now)

    def finished(self, att: Attempt, seq: Seq, now: float) -> None:
        """Engine callback: the backend ended the request."""
        rid = att.key
        if self.live.pop(rid, None) is None:
            return
        now_us = self._now_us()
        delta = seq.gen - self._reported.pop(rid, 0)
        if delta > 0:
            self.gov.on_tokens(rid, delta, now_us)
        outcome = _end_reason(seq)
        self.gov.finish(rid, "cancelled" if outcome == CANCELLED else "completed", now_us)
        att.end(outcome, tokens=seq.gen)
        self._dispatch()

    def tokens_reached(self, att: Attempt, now: float) -> None:
        """Engine callback: a stalled client's window is full; after the stall timeout the
        gateway ends the request and frees its slot (`backpressure.stall_timeout_ms`).
        """
        rid = att.key

        def _stalled(_ev: simpy.Event) -> None:
            if rid not in self.live:
                return
            self.cancel(att)
            att.end(CANCELLED, tokens=att.stall_after or 0, reason="stalled")

        ev = self.env.timeout(self.settings.backpressure.stall_timeout_ms / 1000.0)
        ev.callbacks.append(_stalled)

    def _dispatch(self) -> None:
        for adm in self.gov.dispatch(self._now_us()):
            att = self.queued.pop(adm.request_id, None)
            if att is not None:
                self._run(att, adm.request_id, adm.backend, adm.priority)
        self._arm()

    def _arm(self) -> None:
        nd = self.gov.next_deadline_us()
        if nd is None or (self._armed is not None and self._armed <= nd):
            return
        self._armed = nd
        # one microsecond late, so the clock read back at the callback is past the deadline
        ev = self.env.timeout(max(0.0, (nd + 1) / 1e6 - self.env.now))
        ev.callbacks.append(self._on_deadline)

    def _on_deadline(self, _ev: simpy.Event) -> None:
        self._armed = None
        for exp in self.gov.expire(self._now_us()):
            self._expired(exp.request_id, exp.reason, exp.was_running)
        self._dispatch()

    def _expired(self, rid: int, reason: str, was_running: bool) -> None:
        att = self.queued.pop(rid, None)
        if att is None:
            att = self.live.pop(rid, None)
        if att is None:
            return
        tokens = 0
        if was_running and att.seq is not None:
            att.backend.abort(att.seq)  # type: ignore[attr-defined]
            tokens = att.seq.gen
            self._reported.pop(rid, None)
        if reason == "deadline" and tokens > 0:
            att.end(TRUNCATED, tokens=tokens, reason=reason)  # partial text + notice
        elif reason == "queue_timeout":
            att.end(BUSY, reason=reason)
        else:
            att.end(EXPIRED, tokens=tokens, reason=reason)

    def _scrape(self, interval: float) -> Generator[simpy.Event, None, None]:
        gov, env = self.gov, self.env
        while True:
            yield env.timeout(interval)
            now_us = self._now_us()
            for b in self.cluster.backends:
                c = b.core
                gov.observe_backend(b.name, now_us, kv_usage=c.kv_usage, running=c.num_running,
                                    waiting=c.num_waiting, preemptions_total=c.num_preemptions)
            for rid, att in self.live.items():
                seq = att.seq
                if seq is None:
                    continue
                n = att.backend.core.generated(seq)  # type: ignore[attr-defined]
                delta = n - self._reported[rid]
                if delta > 0:
                    gov.on_tokens(rid, delta, now_us)
                    self._reported[rid] = n
            for exp in gov.expire(now_us):
                self._expired(exp.request_id, exp.reason, exp.was_running)
            self._dispatch()
