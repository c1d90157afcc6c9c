"""Shadow mode (`gate.mode: shadow`): forward as `direct` would; record what the runtime would do.

Two runtimes, both the core's. The *forwarding* runtime is built from the config with every
limit off (`forwarding_config`: no cap, queue, refusal, deadline, stall cut, brownout or
priority; round robin over a model's backends): the sessions and the native front carry out its
actions exactly as in enforce mode, so the client gets what vLLM answers, and the few rules left
(the status of an upstream failure, the drain) are still the core's, not Python's. The *policy*
runtime is built from the config as written, as enforce mode builds it, inside the forwarding
one (`Runtime(..., shadow=...)`): the core mirrors every event either is fed to it, whichever
host fed it (this loop or a native front task), and records its actions instead of carrying
them out (`rust/src/shadow.rs`: the backlog of a request it holds queued, the one timer of
the two). This module reads what it recorded: each request's `Verdict` when the real request
ends (the access log's `shadow` column, the request's span) and the counts (`llmflow_shadow_*`).
See docs/gateway.md ("Shadow mode") for what follows from the backlog rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmflow._core import Cut, End, Reply, Runtime, shadow_summary
from llmflow.gateway.host import Host
from llmflow.gateway.session import StreamSession

if TYPE_CHECKING:
    from typing import TextIO

    from llmflow._core import Action
    from llmflow.config import Settings

__all__ = ["ShadowHost", "Verdict", "forwarding_config", "uncapped_light"]

_UNBOUNDED = 1_000_000  # slots per GPU and waiting places: more than any vLLM takes at once
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


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the policy runtime did with one request, as it stood when the real request ended.

    `decision` is `queued` (it still waits), `started`, `refused` (a `Reply`: `reason`,
    `status`, `retry_after_s`) or `cut` (`reason`); `queued_first` says it waited in the queue
    first; `backend` where it started; `brownout` the max_tokens a brownout would have sent.
    """

    decision: str
    queued_first: bool
    reason: str | None
    status: int | None
    retry_after_s: int | None
    backend: str | None
    brownout: int | None

    def summary(self) -> str:
        """The access log's `shadow` cell: `start`, `queue>start`, `refuse:queue_full`,
        `queue>refuse:queue_timeout`, `start>cut:deadline`, or `queue` (still waiting when the
        real reply ended)."""
        return shadow_summary(
            self.decision, self.queued_first, self.reason, self.backend is not None
        )


def verdict(taken: tuple[Any, ...] | None) -> Verdict | None:
    """A verdict as the core hands it (`Runtime.take_verdict`, a native record's `shadow`)."""
    return Verdict(*taken) if taken is not None else None


@dataclass(frozen=True, slots=True)
class Policy:
    """Shadow mode's policy runtime, for queries (`/api/state`, the gauges, the tests)."""

    runtime: Runtime


class ShadowHost(Host):
    """The host of shadow mode: carries out the forwarding runtime's actions on the sessions
    (as `Host` does); the core mirrors every event to the policy runtime (`policy`), and a
    session gets its `Verdict` when it ends.

    Args:
        settings: the config; the policy runtime is built from it as written.
        trace: where to write the policy runtime's JSONL trace (`llmflow serve --trace`): it
            replays as any enforce-mode trace does.
    """

    def __init__(self, settings: Settings, trace: TextIO | None = None) -> None:
        config = settings.to_runtime()
        config["lifecycle"].pop("leases", None)  # the policy only records: it leases nothing
        runtime = Runtime(forwarding_config(settings), shadow=config, trace=trace is not None)
        super().__init__(runtime, trace)
        policy = runtime.shadow
        assert policy is not None
        self.policy = Policy(policy)

    def carry(self, actions: list[Action]) -> None:
        """Carry out actions in order; a session that ends gets its verdict first."""
        for action in actions:
            if isinstance(action, (Reply, Cut, End)):
                taken = verdict(self.runtime.take_verdict(action.request_id))
                party = self.parties.get(action.request_id)
                if isinstance(party, StreamSession):
                    party.shadow = taken
        super().carry(actions)
