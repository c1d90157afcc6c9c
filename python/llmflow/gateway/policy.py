"""The core bound to an event loop: tickets for live requests, dispatch, and the deadline timer.

`llmflow._core.Governor` decides everything and reads no clock. This module feeds it the time
(`time.monotonic_ns() // 1000`), hands admissions to the waiting handlers, and arms one loop
timer at the core's `next_deadline_us()` so that expiries are carried out the moment they fall
due. It holds no policy of its own: no thresholds, no ordering, no arithmetic on decisions.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmflow._core import Admitted, Queued, Rejected

if TYPE_CHECKING:
    from collections.abc import Callable

    from llmflow._core import Decision, Governor
    from llmflow.gateway.types import Outcome

__all__ = ["Displaced", "Expiry", "Policy", "Ticket", "now_us"]

_MIN_TIMER_S = 0.001  # re-arm floor when the core reports a deadline already due


def now_us() -> int:
    """The gateway's clock for the core: monotonic microseconds."""
    return time.monotonic_ns() // 1000


class Expiry(Exception):
    """A request's deadline passed, as the core reported it (`queue_timeout`, ...)."""

    def __init__(self, reason: str, retry_after_s: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s  # the core's estimate, for the answer's Retry-After


class Displaced(Expiry):
    """A queued request was pushed out by a newer one (a more important tier, or a tenant
    under its fair share of the waiting places)."""

    def __init__(self, retry_after_s: float | None) -> None:
        super().__init__("displaced", retry_after_s)


@dataclass(eq=False, slots=True)
class Ticket:
    """A request the core knows about, from `submit` until it is released."""

    request_id: int
    tenant: str
    tier: str
    decision: Decision
    backend: str | None = None
    priority: int = 0
    expired: str | None = None
    queue_wait_s: float = 0.0
    admitted: asyncio.Future[None] = field(default_factory=lambda: _future())
    on_expire: Callable[[str], None] | None = None
    released: bool = False

    def _admit(self, backend: str, priority: int, queue_wait_s: float) -> None:
        self.backend, self.priority, self.queue_wait_s = backend, priority, queue_wait_s
        if not self.admitted.done():
            self.admitted.set_result(None)

    def _expire(self, reason: str, error: Expiry | None = None) -> None:
        self.expired = reason
        if not self.admitted.done():
            self.admitted.set_exception(error or Expiry(reason))
            self.admitted.exception()  # retrieved: an abandoned ticket must not log a warning
        elif self.on_expire is not None:
            self.on_expire(reason)


def _future() -> asyncio.Future[None]:
    return asyncio.get_running_loop().create_future()


class Policy:
    """Carries out the core's decisions on one event loop.

    Args:
        governor: the core, built from `Settings.to_core()`.
        tiers: tenant name -> tier name, for labelling tickets.
    """

    def __init__(self, governor: Governor, tiers: dict[str, str]) -> None:
        self.governor = governor
        self._tiers = tiers
        self._ids = itertools.count(1)
        self._tickets: dict[int, Ticket] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: int | None = None
        self.expired_total: dict[str, int] = {}

    @property
    def live(self) -> int:
        """Tickets not yet released (queued, running, or expired but still unwinding)."""
        return len(self._tickets)

    def tickets(self) -> list[Ticket]:
        """The live tickets, oldest first."""
        return list(self._tickets.values())

    def submit(self, tenant: str, prompt_tokens: int, max_tokens: int) -> Ticket:
        """Ask the core about a new request; the ticket carries its decision.

        Args:
            tenant: the tenant the API key maps to.
            prompt_tokens: prompt length (exact or estimated).
            max_tokens: the most tokens the request may generate, all choices together.

        Returns:
            A ticket: admitted (its `admitted` future is done), queued, or rejected.
        """
        request_id = next(self._ids)
        decision = self.governor.submit(request_id, tenant, prompt_tokens, max_tokens, now_us())
        ticket = Ticket(request_id, tenant, self._tiers[tenant], decision)
        if isinstance(decision, Rejected):
            ticket.released = True
            return ticket
        self._tickets[request_id] = ticket
        if isinstance(decision, Queued) and decision.displaced is not None:
            self._displace(decision.displaced, decision.displaced_retry_after_s)
        if isinstance(decision, Admitted):
            ticket._admit(decision.backend, decision.priority, 0.0)
        # The core's submit dispatches by itself; admissions it made for other requests come
        # out of the next dispatch.
        self.pump()
        return ticket

    def _displace(self, request_id: int, retry_after_s: float | None) -> None:
        victim = self._tickets.pop(request_id, None)
        if victim is not None:
            victim.released = True  # the core has already forgotten it
            victim._expire("displaced", Displaced(retry_after_s))

    def first_token(self, ticket: Ticket) -> None:
        """Tell the core a running request produced its first token."""
        if not ticket.released and ticket.expired is None:
            self.governor.on_first_token(ticket.request_id, now_us())

    def tokens(self, ticket: Ticket, n: int) -> None:
        """Tell the core a running request generated `n` more tokens."""
        if n > 0 and not ticket.released and ticket.expired is None:
            self.governor.on_tokens(ticket.request_id, n, now_us())

    def release(self, ticket: Ticket, outcome: Outcome) -> bool:
        """End a request in the core and free what it held; safe to call more than once.

        Returns:
            True when this call ended it (False if it had already ended or expired).
        """
        if ticket.released:
            return False
        ticket.released = True
        self._tickets.pop(ticket.request_id, None)
        ended = self.governor.finish(ticket.request_id, outcome, now_us())
        self.pump()
        return ended

    def observe_backend(self, backend: str, **values: Any) -> None:
        """Feed a backend scrape to the core, then admit whatever it now allows."""
        self.governor.observe_backend(backend, now_us(), **values)
        self.pump()

    def set_backend_health(self, backend: str, healthy: bool) -> None:
        """Mark a backend healthy or not in the core, then admit whatever it now allows."""
        self.governor.set_backend_health(backend, healthy)
        self.pump()

    def start_draining(self) -> None:
        """From now on the core refuses new requests (reason `draining`)."""
        self.governor.start_draining()

    def pump(self) -> None:
        """Hand the core's new admissions to their waiting handlers."""
        for admission in self.governor.dispatch(now_us()):
            ticket = self._tickets.get(admission.request_id)
            if ticket is None:  # its handler already left: give the slot straight back
                self.governor.finish(admission.request_id, "cancelled", now_us())
                continue
            ticket._admit(admission.backend, admission.priority, admission.queue_wait_s)
        self._arm()

    def close(self) -> None:
        """Stop the deadline timer (the loop is going away)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = self._timer_at = None

    def _arm(self) -> None:
        due = self.governor.next_deadline_us()
        if due is None or (self._timer_at is not None and self._timer_at <= due):
            return
        if self._timer is not None:
            self._timer.cancel()
        delay = max((due - now_us()) / 1e6, 0.0)
        self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)
        self._timer_at = due

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        for expired in self.governor.expire(now_us()):
            self.expired_total[expired.reason] = self.expired_total.get(expired.reason, 0) + 1
            ticket = self._tickets.get(expired.request_id)
            if ticket is not None:
                ticket._expire(expired.reason, Expiry(expired.reason, expired.retry_after_s))
        self.pump()
        due = self.governor.next_deadline_us()
        if due is not None and due <= now_us() and self._timer is not None:
            self._timer.cancel()
            self._timer = asyncio.get_running_loop().call_later(_MIN_TIMER_S, self._on_timer)
            self._timer_at = due
