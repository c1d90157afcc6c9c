"""Shadow mode (`gate.mode: shadow`): forward as `direct` would; record what the runtime would do.

Two runtimes, both the core's. The *forwarding* runtime is built from the config with every
limit off (`forwarding_config`: no cap, queue, refusal, deadline, stall cut, brownout or
priority; round robin over a model's backends): the sessions carry out its actions exactly as
in enforce mode, so the client gets what vLLM answers, and the few rules left (the status of an
upstream failure, the drain) are still the core's, not Python's. The *policy* runtime is built
from the config as written, as enforce mode builds it. `ShadowHost` feeds it every event of
every request as it happens, and records its actions (`Verdict`) instead of carrying them out:
the metrics `llmflow_shadow_*`, the access log's `shadow` column, the request's span.

What the policy runtime hears is what enforce mode's would, with one difference it cannot
avoid: a request it holds in its queue is already running upstream. Its events (started,
tokens, done, failed) are kept while it waits (`Verdict.backlog`) and fed the moment the policy
runtime starts it, at that instant (a client that leaves is told at once, as enforce mode's
runtime would hear it); a request it refused or cut hears nothing more. See docs/gateway.md
("Shadow mode") for what follows from that.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmflow._core import Runtime
from llmflow.gateway.host import Host
from llmflow.gateway.session import StreamSession
from llmflow.gateway.signals import NO_SIGNALS

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TextIO

    from llmflow._core import Action, Reply, Start
    from llmflow.config import Settings
    from llmflow.gateway.host import Party
    from llmflow.gateway.signals import ClientSignals

__all__ = ["ShadowHost", "Verdict", "forwarding_config", "uncapped_light"]

_UNBOUNDED = 1_000_000  # slots per GPU and waiting places: more than any vLLM takes at once
_MIRRORED_FAILURE = "upstream_error"  # the policy runtime repeating a real failure, no verdict
# Every limit of the policy, off: what the forwarding runtime needs to start all at once.
_NO_LIMITS: dict[str, Any] = {
    "max_concurrency_per_gpu": _UNBOUNDED,
    "max_waiting": _UNBOUNDED,
    "kv_pressure_threshold": None,
    "ttft_sla_ms": None,
    "preemption_cooldown_ms": None,
    "queue_timeout_ms": None,
    "late_yields": False,
    "first_token_timeout_ms": None,
    "request_timeout_ms": None,
    "stale_after_ms": None,
    "kv_fit_target": None,
    "headroom_quantile": None,
    "tpot_target_ms": None,
}


def forwarding_config(settings: Settings) -> dict[str, Any]:
    """The forwarding runtime's config: the same backends, models, tiers and tenants, and
    nothing that holds a request back (a backend's KV size is left unknown, so no KV check
    waits; tenants lose their rate limits; tiers their shedding, shares and brownout; the pools
    go round robin, as `direct` sends)."""
    config = settings.to_runtime()
    policy = config["policy"]
    policy.update(_NO_LIMITS)
    policy["backends"] = [{**b, "kv_blocks": 0} for b in policy["backends"]]
    policy["tiers"] = [{"name": t["name"]} for t in policy["tiers"]]
    policy["tenants"] = [
        {k: v for k, v in t.items() if k in ("name", "tier", "weight")} for t in policy["tenants"]
    ]
    policy["routing"] = {**policy["routing"], "policy": "round_robin", "pools": {}}
    config["lifecycle"] = {**config["lifecycle"], "stall_timeout_ms": None}
    return config


def uncapped_light(settings: Settings) -> Settings:
    """The settings the light lane (embeddings, rerank, tokenize, audio) is built from in
    shadow mode: its per-backend caps and the tenants' rate limits lifted, as `direct` sends
    those at once too. (The light lane is not the runtime's: what it would have refused is not
    recorded.)"""
    backends = [b.model_copy(update={"light_concurrency": _UNBOUNDED}) for b in settings.backends]
    tenants = [t.model_copy(update={"requests_per_s": None}) for t in settings.tenants]
    return settings.model_copy(update={"backends": backends, "tenants": tenants})


class Verdict:
    """What the policy runtime did with one request: the party its actions are recorded on.

    `decision` is `queued` (it waits), `started`, `refused` (a `Reply`: `reason`, `status`,
    `retry_after_s`) or `cut` (`reason`); `queued_first` says it waited in the queue first.
    """

    __slots__ = (
        "backend",
        "backlog",
        "brownout",
        "decision",
        "live",
        "queued_first",
        "reason",
        "request_id",
        "retry_after_s",
        "shadow",
        "status",
        "tier",
    )

    def __init__(self, shadow: ShadowHost, request_id: int, tier: str) -> None:
        self.shadow, self.request_id, self.tier = shadow, request_id, tier
        self.decision = "arriving"
        self.queued_first = False
        self.live = True  # the policy runtime has not ended it
        self.reason: str | None = None
        self.status: int | None = None
        self.retry_after_s: int | None = None
        self.backend: str | None = None
        self.brownout: int | None = None  # the max_tokens a brownout would have sent
        # The real request's events while the policy runtime holds it queued, in order.
        self.backlog: list[tuple[str, tuple[Any, ...]]] = []

    @property
    def queued(self) -> bool:
        """True while the policy runtime holds it in its queue."""
        return self.decision in ("arriving", "queued")

    @property
    def running(self) -> bool:
        """True while the policy runtime holds it started and live: its events go through."""
        return self.live and self.decision == "started"

    def summary(self) -> str:
        """The access log's `shadow` cell: `start`, `queue>start`, `refuse:queue_full`,
        `queue>refuse:queue_timeout`, `start>cut:deadline`, or `queue` (still waiting when the
        real reply ended)."""
        steps = ["queue"] if self.queued_first or self.decision == "queued" else []
        if self.decision == "started" or (self.decision == "cut" and self.backend is not None):
            steps.append("start")
        if self.decision == "refused":
            steps.append(f"refuse:{self.reason}")
        elif self.decision == "cut":
            steps.append(f"cut:{self.reason}")
        return ">".join(steps)

    # ---- the policy runtime's actions, recorded ----------------------------------------------

    def on_start(self, action: Start) -> None:
        self.queued_first = self.decision == "queued"
        self.decision, self.backend = "started", action.backend
        self.brownout = action.max_tokens
        if action.max_tokens is not None:
            self.shadow.record("brownout", self.tier, None)
        if self.queued_first:
            self.shadow.catch_up(self)

    def on_abort(self) -> None:
        pass  # the cut, reply or end that follows says why

    def on_reply(self, action: Reply) -> None:
        self._ended()
        if action.reason == _MIRRORED_FAILURE:
            return
        self.queued_first = self.queued_first or self.decision == "queued"
        self.decision, self.reason = "refused", action.reason
        self.status, self.retry_after_s = action.status, action.retry_after_s
        self.shadow.record("refused", self.tier, action.reason)

    def on_cut(self, reason: str) -> None:
        self._ended()
        if reason == _MIRRORED_FAILURE:
            return
        self.decision, self.reason = "cut", reason
        self.shadow.record("cut", self.tier, reason)

    def on_end(self, outcome: str) -> None:
        self._ended()

    def _ended(self) -> None:
        self.live = False
        self.shadow.verdicts.pop(self.request_id, None)  # nothing of it is mirrored again


class _PolicyHost(Host):
    """The policy runtime's host: after each list of actions, the mirror's catch-up runs
    (a `Start` from the queue may come from any event, the policy's own timer included)."""

    def __init__(self, runtime: Runtime, trace: TextIO | None, after: Callable[[], None]):
        super().__init__(runtime, trace)
        self._after = after

    def carry(self, actions: list[Action]) -> None:
        super().carry(actions)
        self._after()


class ShadowHost(Host):
    """The host of shadow mode: carries out the forwarding runtime's actions on the sessions
    (as `Host` does) and mirrors every event to the policy runtime, whose actions go to each
    request's `Verdict`.

    Args:
        settings: the config; the policy runtime is built from it as written.
        trace: where to write the policy runtime's JSONL trace (`llmflow serve --trace`): it
            replays as any enforce-mode trace does.
    """

    def __init__(self, settings: Settings, trace: TextIO | None = None) -> None:
        super().__init__(Runtime(forwarding_config(settings)))
        config = settings.to_runtime()
        config["lifecycle"].pop("leases", None)  # the policy only records: it leases nothing
        policy = Runtime(config, trace=trace is not None)
        self.policy: Host = _PolicyHost(policy, trace, self._catch_up_all)
        self.verdicts: dict[int, Verdict] = {}  # requests the policy runtime still holds
        # (what, tier, reason) of each would-have: the metrics' `llmflow_shadow_*`
        self.record: Callable[[str, str, str | None], None] = lambda _w, _t, _r: None
        self._waiting: list[Verdict] = []  # started from the queue, backlog not yet fed
        self._catching_up = False

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
        """A request arrived: the policy runtime decides (recorded), the forwarding runtime
        starts it. Only the policy hears the client's signals: a client deadline must not
        refuse anything the forwarding runtime carries."""
        verdict = Verdict(self, request_id, party.tier)
        if isinstance(party, StreamSession):
            party.shadow = verdict
        self.verdicts[request_id] = verdict
        args = (request_id, tenant, prompt, max_tokens, stream)
        extra: dict[str, Any] = {
            "model": model, "prefix_hashes": prefix_hashes, "fingerprint": fingerprint
        }
        try:
            self.policy.arrive(verdict, *args, **extra, signals=signals)
        except BaseException:
            self.verdicts.pop(request_id, None)
            raise
        if verdict.decision == "arriving":
            verdict.decision = "queued"
            self.record("queued", verdict.tier, None)
        try:
            super().arrive(party, *args, **extra)
        except BaseException:
            self._mirror(request_id, "client_gone")  # the policy runtime must not keep it
            raise

    # ---- per-request events: the sessions' (forwarding) and mirrored (policy) ----------------

    def started(self, request_id: int) -> None:
        super().started(request_id)
        self._mirror(request_id, "started")

    def tokens(self, request_id: int, n: int) -> None:
        super().tokens(request_id, n)
        self._mirror(request_id, "tokens", n)

    def tokens_many(self, counts: list[tuple[int, int]]) -> None:
        """Token counts of many requests at once (the relay's periodic batch)."""
        super().tokens_many(counts)
        through = []
        for request_id, n in counts:
            verdict = self.verdicts.get(request_id)
            if verdict is None:
                continue
            if verdict.running:
                through.append((request_id, n))
            else:
                verdict.backlog.append(("tokens", (n,)))
        if through:
            self.policy.tokens_many(through)

    def done(self, request_id: int) -> None:
        super().done(request_id)
        self._mirror(request_id, "done")

    def failed(self, request_id: int, status: int, backend_down: bool) -> None:
        super().failed(request_id, status, backend_down)
        self._mirror(request_id, "failed", status, backend_down)

    def client_gone(self, request_id: int) -> None:
        super().client_gone(request_id)
        self._mirror(request_id, "client_gone")

    def window_full(self, request_id: int) -> None:
        super().window_full(request_id)
        self._mirror(request_id, "window_full")

    def window_drained(self, request_id: int) -> None:
        super().window_drained(request_id)
        self._mirror(request_id, "window_drained")

    # ---- events of the whole gateway: both runtimes ------------------------------------------

    def scrape_ok(self, backend: str, began_us: int, **values: Any) -> None:
        # The forwarding runtime is not told the KV size: it must never wait for KV.
        super().scrape_ok(backend, began_us, **{**values, "kv_blocks": None})
        self.policy.scrape_ok(backend, began_us, **values)

    def scrape_failed(self, backend: str, reachable: bool = False) -> None:
        super().scrape_failed(backend, reachable)
        self.policy.scrape_failed(backend, reachable)

    def drain(self) -> None:
        super().drain()
        self.policy.drain()

    def close(self) -> None:
        """Stop both timers and flush the policy runtime's trace."""
        super().close()
        self.policy.close()

    # ---- the mirror ----------------------------------------------------------------------------

    def _mirror(self, request_id: int, event: str, *args: Any) -> None:
        verdict = self.verdicts.get(request_id)
        if verdict is None:  # the policy runtime has ended it: it hears nothing more
            return
        # A client leaving is fed at once, even while the policy holds the request queued:
        # enforce mode's runtime would hear it then too (and take it out of its queue).
        if verdict.running or event == "client_gone":
            getattr(self.policy, event)(request_id, *args)
        else:
            verdict.backlog.append((event, args))

    def catch_up(self, verdict: Verdict) -> None:
        """The policy runtime started a request it held queued: what the real request did
        meanwhile is fed once the action list that started it has been carried out."""
        self._waiting.append(verdict)

    def _catch_up_all(self) -> None:
        if self._catching_up:  # a catch-up's own events: the outer loop goes on
            return
        self._catching_up = True
        try:
            while self._waiting:
                verdict = self._waiting.pop(0)
                backlog, verdict.backlog = verdict.backlog, []
                for event, args in _compressed(backlog):
                    if not verdict.running:
                        break
                    getattr(self.policy, event)(verdict.request_id, *args)
        finally:
            self._catching_up = False


def _compressed(backlog: list[tuple[str, tuple[Any, ...]]]) -> list[tuple[str, tuple[Any, ...]]]:
    """A backlog as the events to feed at once: started, every token in one count, the last
    window state, the end. (Each as it came, only all at the instant the policy started it.)"""
    events = [e for e in backlog if e[0] == "started"][:1]
    tokens = sum(args[0] for event, args in backlog if event == "tokens")
    if tokens:
        events.append(("tokens", (tokens,)))
    window = [e for e in backlog if e[0] in ("window_full", "window_drained")]
    if window and window[-1][0] == "window_full":
        events.append(window[-1])
    events += [e for e in backlog if e[0] in ("done", "failed", "client_gone")][:1]
    return events
