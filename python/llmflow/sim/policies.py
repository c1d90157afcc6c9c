"""Policies compared by the simulator: `direct` (no gateway) and gated ones (the Rust core).

`DirectPolicy` sends every request straight to a backend, round robin, where it waits in vLLM's
unbounded queue. `GatedPolicy` is a host of `llmflow._core.Runtime`, as the gateway is: arrivals,
engine callbacks (first token, end, a stalled client's full window), client disconnects, scrapes
and the one timer go in as events; the actions that come out (start, abort, reply, cut, end,
re-arm) are carried out. Every rule (admission, order, priority, deadlines, stall, Retry-After,
dispatch) lives in the runtime; this module holds none. On a split (prefill/decode) cluster a
`Start` names both instances, and the hand-off between them is `sim/disagg.py`'s. `seed-gate`
and `llmflow` are two configs of the same core (`PRESETS`).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from llmflow._core import Abort, Arm, Cut, End, Reply, Runtime, SetHealth, Start, Wait
from llmflow.config import Settings, load_settings
from llmflow.sim.clients import BUSY, CANCELLED, COMPLETED, ERROR, EXPIRED, REJECTED, TRUNCATED
from llmflow.sim.disagg import Handoff
from llmflow.sim.engine import EngineError, Seq

if TYPE_CHECKING:
    from collections.abc import Callable, Generator
    from typing import TextIO

    import simpy

    from llmflow._core import Action
    from llmflow.sim.clients import Attempt
    from llmflow.sim.cluster import Backend, Cluster
    from llmflow.sim.disagg import Hop
    from llmflow.sim.scenario import PolicySpec, Scenario

__all__ = ["PRESETS", "DirectPolicy", "GatedPolicy", "policy_config", "policy_settings"]

# Built-in policy configs: (llmflow config sections, vLLM scheduling policy, tier of every tenant).
PRESETS: dict[str, tuple[dict[str, Any], str, str | None]] = {
    # The seed's gate section and nothing else: 16 per GPU, 200 waiting, 429 when full, in the
    # seed's own `strategy: "fair"` order (a scenario may override it to "fifo").
    "seed-gate": (
        {
            "gate": {"max_concurrency_per_gpu": 16, "headroom_quantile": None,
                     "queue": {"max_waiting": 200, "strategy": "fair", "max_wait_ms": None}},
            "tiers": [{"name": "all"}],
            "default_tier": "all",
            "kv": {"pressure_threshold": None, "fit_target": None},
            # the seed's gate: no SLA, and no retry memory (a retry is a new arrival)
            "sla": {"ttft_ms": None, "late_requests_yield": False},
            # nor does it read what clients say of themselves (retry count, timeout)
            "signals": {"retry_headers": False, "deadline_headers": False},
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


def policy_config(name: str, spec: PolicySpec, sc: Scenario) -> dict[str, Any]:
    """The llmflow config sections a gated policy runs, before the cluster's backends: preset,
    then the scenario's overrides, then the workload's tenants (unless the scenario lists its
    own)."""
    base, _scheduling, tenant_tier = PRESETS[spec.preset_for(name)]
    data = _merge(base, spec.config)
    tier = spec.tenant_tier or tenant_tier
    if "tenants" not in spec.config:
        seen: dict[str, str] = {}
        for wc in sc.workload:
            seen.setdefault(wc.tenant, tier or wc.tier)
        data["tenants"] = [{"name": t, "tier": tr} for t, tr in seen.items()]
    return data


def policy_settings(name: str, spec: PolicySpec, sc: Scenario, cluster: Cluster) -> Settings:
    """The llmflow config a gated policy runs: `policy_config` plus the cluster's backends.

    Raises:
        ConfigFileError: the merged config does not validate.
    """
    scheduling = PRESETS[spec.preset_for(name)][1]
    data = policy_config(name, spec, sc)
    data["backends"] = [
        {"name": b.name, "gpus": b.gpus, "kv_blocks": b.core.num_blocks,
         "max_model_len": b.core.config.max_model_len,
         "scheduling_policy": spec.scheduling_policy or scheduling, "role": b.role}
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
              _Handler(policy, att), att.stop_after, None, req.hash_ids, req.hash_block)
    att.seq, att.backend, att.t_admit = seq, backend, policy.env.now
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


class _Upstream:
    """A request running on a backend, and the tokens reported to the runtime so far; split,
    its decode (sent once `hop`'s prefill has answered)."""

    __slots__ = ("att", "backend", "hop", "sent", "seq")

    def __init__(self, att: Attempt, backend: Backend, seq: Seq, hop: Hop | None = None):
        self.att, self.backend, self.seq, self.sent, self.hop = att, backend, seq, 0, hop


class GatedPolicy:
    """The gateway's lifecycle (`llmflow._core.Runtime`) in simulated time.

    A thin host: engine callbacks, client disconnects, scrapes and the one timer become runtime
    events; the actions that come back are carried out by `_carry`.

    Args:
        env: the simulation environment.
        cluster: the backends.
        settings: the llmflow config (see `policy_settings`).
        trace: where to write the runtime's JSONL trace (`flush_trace`); `None`: no trace.
    """

    def __init__(self, env: simpy.Environment, cluster: Cluster, settings: Settings,
                 trace: TextIO | None = None):
        self.env, self.cluster = env, cluster
        self.runtime = Runtime(settings.to_runtime(), trace=trace is not None)
        self._trace = trace
        self._window = settings.backpressure.client_window
        self._ids = 0
        self._atts: dict[int, Attempt] = {}  # awaiting their terminal action, by request id
        self._up: dict[int, _Upstream] = {}  # started on a backend, by request id
        self._refused: list[int] = []  # the engine refused them at start (400)
        self._armed: int | None = None  # the timer the runtime holds us to, in µs
        self.peak_queue = 0
        self.rejections: dict[str, int] = {}
        self.browned_out = 0  # starts with max_tokens clamped by a brownout
        self._do: dict[type, Callable[[Any], None]] = {
            Start: self._start, Wait: _ignore, Abort: self._abort, Reply: self._reply,
            Cut: self._cut, End: self._end, Arm: self._arm, SetHealth: _ignore,
        }
        self._handoff = Handoff(env, cluster) if cluster.disaggregated else None
        env.process(self._scrape(settings.metrics.scrape_interval_ms / 1000.0))

    def next_id(self) -> int:
        """A fresh request id."""
        self._ids += 1
        return self._ids

    def _now_us(self) -> int:
        return round(self.env.now * 1e6)

    def _carry(self, actions: list[Action]) -> None:
        while True:
            for action in actions:
                self._do[type(action)](action)
            if not self._refused:
                return
            # after the whole list, so an older `Arm` never overrides a newer one
            actions = self.runtime.failed(self._refused.pop(0), 400, self._now_us())

    def send(self, att: Attempt) -> None:
        """The request arrives at the gateway."""
        rid = att.key = self.next_id()
        self._atts[rid] = att
        req = att.req
        hashes = list(req.hash_ids) if req.hash_ids else None  # for a `prefix` routing pool
        # a retry re-sends the same body: the user request's index is its fingerprint; and says
        # so, with its client's timeout, as the SDKs' headers do
        self._carry(self.runtime.arrive(rid, req.tenant, req.prompt, req.max_tokens, att.stream,
                                        self._now_us(), prefix_hashes=hashes,
                                        fingerprint=req.index + 1, retries=att.retries,
                                        deadline_ms=att.deadline_ms))
        self.peak_queue = max(self.peak_queue, self.runtime.queued)

    def cancel(self, att: Attempt) -> None:
        """Client disconnect: the runtime frees the slot and aborts upstream; the client ends
        the attempt itself."""
        self._atts.pop(att.key, None)
        self._carry(self.runtime.client_gone(att.key, self._now_us()))

    def _report(self, up: _Upstream, generated: int) -> None:
        if generated > up.sent:
            n, up.sent = generated - up.sent, generated
            self._carry(self.runtime.tokens(up.att.key, n, self._now_us()))

    def first_token(self, att: Attempt, now: float) -> None:
        """Engine callback."""
        up = self._up.get(att.key)
        if up is not None:
            if up.hop is None:  # split: the hop set it (the prefill's admission)
                att.t_sched = up.seq.t_sched
            self._report(up, up.backend.core.generated(up.seq))
            att.got_first(now)

    def finished(self, att: Attempt, seq: Seq, now: float) -> None:
        """Engine callback: the backend ended the request (aborted: the client's own stop)."""
        up = self._up.get(att.key)
        if up is not None:
            self._report(up, seq.gen)
            event = self.runtime.client_gone if seq.finish_reason == "abort" else self.runtime.done
            self._carry(event(att.key, self._now_us()))

    def tokens_reached(self, att: Attempt, now: float) -> None:
        """Engine callback: a stalled client's window is full."""
        if att.key in self._up:
            self._carry(self.runtime.window_full(att.key, self._now_us()))

    def prefilled(self, hop: Hop, now: float) -> None:
        """Engine callback (split): the prefill answered; the decode goes to the instance the
        runtime chose, and the prefill's slot is free."""
        up = self._up.get(hop.att.key)
        assert self._handoff is not None
        if up is None or up.hop is not hop:  # it ended without an abort: no decode follows
            self._handoff.drop(hop)
            return
        try:
            self._handoff.decode(hop, up.backend, up.seq)
        except EngineError:
            self._refused.append(hop.att.key)
        self._carry(self.runtime.prefilled(hop.att.key, self._now_us()))

    # ---- actions ----------------------------------------------------------------------------

    def _start(self, a: Start) -> None:
        att = self._atts[a.request_id]
        b, req = self.cluster.by_name[a.backend], att.req
        window = None if att.stall_after is None else att.stall_after + self._window
        max_tokens = req.max_tokens
        if a.max_tokens is not None:  # browned out: a shorter answer
            max_tokens = a.max_tokens
            self.browned_out += 1
        seq = Seq(a.request_id, req.prompt, max_tokens, req.eos, a.priority,
                  _Handler(self, att), att.stop_after, window, req.hash_ids, req.hash_block)
        att.seq, att.backend, att.t_admit = seq, b, self.env.now
        hop = None
        try:
            if a.prefill_backend is None:
                b.submit(seq)
            else:  # split: the prompt goes to its prefill instance first, `seq` after it
                assert self._handoff is not None
                pseq = Seq(a.request_id, req.prompt, 1, None, a.prefill_priority or 0)
                p = self.cluster.by_name[a.prefill_backend]
                hop = att.handler = self._handoff.prefill(self, att, p, pseq)
        except EngineError:
            self._refused.append(a.request_id)
            return
        self._up[a.request_id] = _Upstream(att, b, seq, hop)

    def _abort(self, a: Abort) -> None:
        up = self._up.pop(a.request_id, None)
        if up is None:
            return
        if up.hop is None:
            up.backend.abort(up.seq)
        else:
            assert self._handoff is not None
            self._handoff.abort(up.hop)

    def _close(self, rid: int) -> Attempt | None:
        self._up.pop(rid, None)
        return self._atts.pop(rid, None)

    def _reply(self, a: Reply) -> None:
        att = self._close(a.request_id)
        if att is None:
            return
        retry = float(a.retry_after_s or 0)
        if a.status == 429 or a.reason in ("draining", "no_healthy_backend"):
            self.rejections[a.reason] = self.rejections.get(a.reason, 0) + 1
            att.end(REJECTED, reason=a.reason, retry_after=retry)
        elif a.status == 503:  # queue timeout, deadline while queued, shutdown: come back later
            att.end(BUSY, reason=a.reason, retry_after=retry)
        else:  # 504 first-token timeout; 400 (too long for the model) or 502
            att.end(EXPIRED if a.status == 504 else ERROR, reason=a.reason)

    def _cut(self, a: Cut) -> None:
        att = self._close(a.request_id)
        if att is None:
            return
        tokens = att.seq.gen if att.seq is not None else 0
        if a.reason == "client_stall":
            att.end(CANCELLED, tokens=att.stall_after or 0, reason="stalled")
        elif a.reason == "upstream_error":
            att.end(ERROR, tokens=tokens, reason=a.reason)
        elif tokens and a.reason in ("deadline", "shutdown"):
            att.end(TRUNCATED, tokens=tokens, reason=a.reason)  # partial text + notice
        else:
            att.end(CANCELLED if a.reason == "shutdown" else EXPIRED, tokens=tokens,
                    reason=a.reason)

    def _end(self, a: End) -> None:
        att = self._close(a.request_id)
        if att is not None:
            tokens = att.seq.gen if att.seq is not None else 0
            att.end(COMPLETED if a.outcome == "completed" else CANCELLED, tokens=tokens)

    def _arm(self, a: Arm) -> None:
        # SimPy cannot cancel a timeout: each carries its time, and only the latest one counts
        self._armed = a.at_us
        ev = self.env.timeout(max(0.0, a.at_us / 1e6 - self.env.now), value=a.at_us)
        ev.callbacks.append(self._fire)

    def _fire(self, ev: simpy.Event) -> None:
        if ev.value == self._armed:
            self._armed = None
            self._carry(self.runtime.timer(self._now_us()))

    # ---- scrapes and the trace --------------------------------------------------------------

    def _scrape(self, interval: float) -> Generator[simpy.Event, None, None]:
        runtime, env = self.runtime, self.env
        while True:
            yield env.timeout(interval)
            for up in list(self._up.values()):
                self._report(up, up.backend.core.generated(up.seq))
            now_us = self._now_us()
            for b in self.cluster.backends:
                c = b.core
                self._carry(runtime.scrape_ok(
                    b.name, now_us, now_us, kv_usage=c.kv_usage, running=c.num_running,
                    waiting=c.num_waiting, preemptions_total=c.num_preemptions))
            self.flush_trace()

    def flush_trace(self) -> None:
        """Write the trace recorded since the last flush (a no-op without a trace)."""
        if self._trace is not None:
            self._trace.write(self.runtime.take_trace())


def _ignore(_action: object) -> None:
    """Informational actions: a queued request's place, a backend's health."""
