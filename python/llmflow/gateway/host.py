"""The gateway as a host of the core's runtime: feed it events, carry out its actions.

`llmflow._core.Runtime` owns the whole request lifecycle (admission, dispatch, deadlines, the
stall timer, backend health, Retry-After, the drain) and reads no clock. This module gives it
the time (`time.monotonic_ns() // 1000`), keeps the one loop timer it asks for with `Arm`, and
hands every other action to the session it names. It holds no policy of its own; the bytes and
HTTP of a WebSocket's sessions live in `session.py`, `ws.py` and `upstream.py` (the native front
hosts the same runtime for HTTP, `rust/src/front/owner.rs`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from llmflow._core import Abort, Arm, Cut, End, Lease, Release, Reply, SetHealth, Start, Wait
from llmflow.gateway.signals import NO_SIGNALS

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TextIO

    from llmflow._core import Action, Runtime
    from llmflow.gateway.signals import ClientSignals

__all__ = ["Host", "Leases", "Party", "now_us"]

log = logging.getLogger("llmflow.gateway")


def now_us() -> int:
    """The gateway's clock for the core: monotonic microseconds."""
    return time.monotonic_ns() // 1000


class Party(Protocol):
    """What the runtime's per-request actions are carried out on (a `StreamSession`)."""

    @property
    def tier(self) -> str: ...
    @property
    def queued(self) -> bool: ...

    def on_start(self, action: Start) -> None: ...
    def on_abort(self) -> None: ...
    def on_reply(self, action: Reply) -> None: ...
    def on_cut(self, reason: str) -> None: ...
    def on_end(self, outcome: str) -> None: ...


class Leases(Protocol):
    """Where the runtime's slot-lease actions are carried (`shared_state.SharedSlots`)."""

    def lease(self, action: Lease) -> None: ...
    def release(self, action: Release) -> None: ...


class Host:
    """Carries out the runtime's actions on one event loop.

    Args:
        runtime: the core runtime, built from `Settings.to_runtime()`.
        trace: where to write the runtime's JSONL trace (the runtime must be tracing).
    """

    def __init__(self, runtime: Runtime, trace: TextIO | None = None) -> None:
        self.runtime = runtime
        self.parties: dict[int, Party] = {}
        self.on_health: Callable[[str, bool], None] = lambda _backend, _healthy: None
        self._ids = itertools.count(1)
        self._trace = trace
        self._timer: asyncio.TimerHandle | None = None
        # Slot leases shared with other replicas (`state: {backend: redis}`), where the
        # runtime's `Lease` and `Release` go; None: this process alone (it sends none).
        self.leases: Leases | None = None
        self._carry_by_type: dict[type, Callable[[Any], None]] = {
            Start: lambda a: self.parties[a.request_id].on_start(a),
            Wait: lambda a: None,
            Abort: lambda a: self.parties[a.request_id].on_abort(),
            Reply: lambda a: self.parties.pop(a.request_id).on_reply(a),
            Cut: lambda a: self.parties.pop(a.request_id).on_cut(a.reason),
            End: lambda a: self.parties.pop(a.request_id).on_end(a.outcome),
            Arm: self._arm,
            SetHealth: lambda a: self.on_health(a.backend, a.healthy),
            Lease: lambda a: self._store().lease(a),
            Release: lambda a: self._store().release(a),
        }

    def _store(self) -> Leases:
        assert self.leases is not None, "a runtime with lifecycle.leases needs host.leases"
        return self.leases

    def new_id(self) -> int:
        """A fresh request id."""
        return next(self._ids)

    def carry(self, actions: list[Action]) -> None:
        """Carry out actions in order (and write the trace, when recording)."""
        if self._trace is not None:
            self._trace.write(self.runtime.take_trace())
        for action in actions:
            self._carry_by_type[type(action)](action)
        self.runtime.carried()  # a native `Start` behind one of these aborts may go now

    # ---- events ------------------------------------------------------------------------------

    def arrive(
        self,
        party: Party,
        request_id: int,
        tenant: str,
        prompt: int,
        max_tokens: int,
        stream: bool,
        *,
        model: str | None = None,
        prefix_hashes: list[int] | None = None,
        fingerprint: int = 0,
        signals: ClientSignals = NO_SIGNALS,
    ) -> None:
        """A request arrived; its party hears `on_start` or `on_reply` (maybe at once).

        `model` picks its pool (only backends serving it are candidates), `prefix_hashes` feed
        a `prefix` pool's routing; the runtime decides both. `fingerprint` (of its body) lets
        the runtime know a client's retry of a request it refused; `signals` are what its
        headers said (its retries, its client's deadline), for the runtime to weigh.
        """
        self.parties[request_id] = party
        try:
            actions = self.runtime.arrive(
                request_id,
                tenant,
                prompt,
                max_tokens,
                stream,
                now_us(),
                model=model,
                prefix_hashes=prefix_hashes,
                fingerprint=fingerprint,
                retries=signals.retries,
                deadline_ms=signals.deadline_ms,
            )
        except BaseException:
            del self.parties[request_id]  # the runtime never took it: nothing to end
            raise
        self.carry(actions)

    def started(self, request_id: int) -> None:
        self.carry(self.runtime.started(request_id, now_us()))

    def prefilled(self, request_id: int) -> None:
        """A split request's prefill hop answered (`disagg.py`)."""
        self.carry(self.runtime.prefilled(request_id, now_us()))

    def tokens(self, request_id: int, n: int) -> None:
        # The per-chunk path: the runtime answers tokens with no action unless it must.
        actions = self.runtime.tokens(request_id, n, now_us())
        if actions or self._trace is not None:
            self.carry(actions)

    def tokens_many(self, counts: list[tuple[int, int]]) -> None:
        """Token counts of many requests at once (the relay's periodic batch)."""
        actions = self.runtime.tokens_many(counts, now_us())
        if actions or self._trace is not None:
            self.carry(actions)

    def done(self, request_id: int) -> None:
        self.carry(self.runtime.done(request_id, now_us()))

    def failed(self, request_id: int, status: int, backend_down: bool) -> None:
        self.carry(self.runtime.failed(request_id, status, now_us(), backend_down=backend_down))

    def client_gone(self, request_id: int) -> None:
        self.carry(self.runtime.client_gone(request_id, now_us()))

    def window_full(self, request_id: int) -> None:
        self.carry(self.runtime.window_full(request_id, now_us()))

    def window_drained(self, request_id: int) -> None:
        self.carry(self.runtime.window_drained(request_id, now_us()))

    def scrape_ok(self, backend: str, began_us: int, **values: Any) -> None:
        self.carry(self.runtime.scrape_ok(backend, began_us, now_us(), **values))

    def scrape_failed(self, backend: str, reachable: bool = False) -> None:
        self.carry(self.runtime.scrape_failed(backend, now_us(), reachable=reachable))

    def store_synced(
        self, backend: str, live: int, waiting: float = 0.0, before: float = 0.0
    ) -> None:
        """The shared store holds `live` leases on `backend` (ours among them), and other
        replicas have tenants of total weight `waiting` waiting, `before` of it on the
        replicas ordered before this one."""
        now = now_us()
        actions = self.runtime.store_synced(
            backend, live, now, waiting=waiting, waiting_before=before
        )
        self.carry(actions)

    def store_lost(self) -> None:
        """A call to the shared store failed."""
        self.carry(self.runtime.store_lost(now_us()))

    def shared_service(self, tenant: str, cost: float) -> None:
        """Other replicas gave `tenant` `cost` weighted tokens of service since the last sync."""
        self.carry(self.runtime.shared_service(tenant, cost, now_us()))

    def shared_usage(self, tenant: str, requests: float, tokens: float) -> None:
        """Other replicas let `tenant` use `requests` and `tokens` since the last sync."""
        self.carry(self.runtime.shared_usage(tenant, requests, tokens, now_us()))

    def lease_granted(self, request_id: int) -> None:
        """The shared store granted a `Lease`."""
        self.carry(self.runtime.lease_granted(request_id, now_us()))

    def lease_denied(self, request_id: int) -> None:
        """The shared store refused a `Lease`."""
        self.carry(self.runtime.lease_denied(request_id, now_us()))

    def lease_failed(self, request_id: int) -> None:
        """The shared store did not answer a `Lease`."""
        self.carry(self.runtime.lease_failed(request_id, now_us()))

    def drain(self) -> None:
        self.carry(self.runtime.drain(now_us()))

    # ---- the one timer -----------------------------------------------------------------------

    def _arm(self, action: Arm) -> None:
        if self._timer is not None:
            self._timer.cancel()
        delay = max(action.at_us - now_us(), 0) / 1e6
        self._timer = asyncio.get_running_loop().call_later(delay, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self.carry(self.runtime.timer(now_us()))

    def close(self) -> None:
        """Stop the timer and flush the trace (the loop is going away)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._trace is not None:
            self._trace.write(self.runtime.take_trace())
            self._trace.flush()
