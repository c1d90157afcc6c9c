"""Prometheus metrics of the gateway, in a registry of its own.

Counters and histograms are updated on events (admission, first token, end of a request).
Gauges that mirror state (queue by tier, in flight, KV, backend health, shed level) are read
from the core and the scraper when `/metrics` is scraped, so the hot path never touches them.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter as Tally
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

    from prometheus_client.metrics_core import Metric

    from llmflow._core import NativeRoutes, Relay, Runtime
    from llmflow.gateway.access_log import AccessLog
    from llmflow.gateway.errors import GatewayError
    from llmflow.gateway.host import Host
    from llmflow.gateway.scraper import Scraper
    from llmflow.gateway.session import Prepared, StreamSession
    from llmflow.gateway.telemetry import Tracing

__all__ = ["CONTENT_TYPE", "GatewayMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_CHUNK_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
_OUTCOME = {  # how a session ended -> the core's outcome label
    "completed": "completed",
    "error": "error",
    "deadline": "timeout",
    "first_token_timeout": "timeout",
    "queue_timeout": "timeout",
    "client_deadline": "timeout",  # its client's deadline passed while it waited
    "timeout": "timeout",
    "displaced": "rejected",
    "upstream_error": "error",
}


class GatewayMetrics:
    """Every metric the gateway exports.

    Args:
        host: the runtime host (read at scrape time).
        tiers: every configured tier, most important first. The per-tier gauges export each
            of them, 0 while it has nothing waiting or running, so a dashboard panel over an
            idle gateway shows zeros rather than "no data".
    """

    def __init__(self, host: Host, tiers: Iterable[str] = ()) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.host = host
        self.tiers = tuple(tiers)
        self.scraper: Scraper | None = None
        self.relay: Relay | None = None  # relayed streams' write gaps live in the relay
        self.native: NativeRoutes | None = None  # the front's own requests, for the tier gauges
        self.draining: Callable[[], bool] = lambda: False
        self.access_log: AccessLog | None = None  # `server.access_log`
        self.outcomes: Tally[tuple[str, str]] = Tally()  # (outcome, reason) -> n, /api/state
        self.tracing: Tracing | None = None  # OpenTelemetry spans (`telemetry`), when configured
        self.shadow_runtime: Runtime | None = None  # shadow mode: the forwarding runtime
        r = self.registry
        self.requests = Counter(
            "llmflow_requests",
            "Requests by tier, outcome and reason",
            ["tier", "outcome", "reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "llmflow_ttft_seconds",
            "Arrival to first token, as the gateway sees it",
            ["tier"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "llmflow_e2e_seconds",
            "Arrival to the last token of a completed request",
            ["tier"],
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "llmflow_queue_wait_seconds",
            "Time spent queued before admission",
            ["tier"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.inter_chunk = GapTally()  # Python-written streams; the relay counts its own
        self.tokens = Counter(
            "llmflow_tokens_streamed", "Generated tokens relayed to clients", ["tier"], registry=r
        )
        self.truncations = Counter(
            "llmflow_truncations", "Replies cut with a notice", ["reason"], registry=r
        )
        self.aborts = Counter(
            "llmflow_upstream_aborts",
            "Upstream requests aborted before they finished",
            ["reason"],
            registry=r,
        )
        self.registry.register(_StateCollector(self))

    def rejected(
        self, prepared: Prepared, error: GatewayError, at: float | None = None, spans: bool = True
    ) -> None:
        """Count (and log, and trace) a request the core turned away as it arrived (`at`: when,
        monotonic, if not now; `spans`: False where the caller makes its spans)."""
        self.requests.labels(prepared.tier, "rejected", error.code).inc()
        self.outcomes["rejected", error.code] += 1
        if self.access_log is not None:
            self.access_log.refused(prepared, error, at)
        if self.tracing is not None and spans:
            self.tracing.refused(prepared, error, error.headers.get("X-Request-Id"))

    def first_token(self, session: StreamSession) -> None:
        """Record a session's time to first token."""
        assert session.first_token_at is not None
        tier = session.prepared.tier
        self.ttft.labels(tier).observe(session.first_token_at - session.prepared.arrived)

    def request_ended(self, session: StreamSession, spans: bool = True) -> None:
        """Count a finished session by outcome and reason, and its tokens (`spans`: False
        where the caller makes its spans)."""
        outcome = _OUTCOME.get(session.end, "cancelled")
        tier = session.prepared.tier
        self.requests.labels(tier, outcome, session.end).inc()
        self.outcomes[outcome, session.end] += 1
        if session.parser.completion_tokens:
            self.tokens.labels(tier).inc(session.parser.completion_tokens)
        if session.backend is not None:
            self.queue_wait.labels(tier).observe(session.queue_wait_s)
        if outcome == "completed":
            ended = session.ended_at if session.ended_at is not None else time.monotonic()
            self.e2e.labels(tier).observe(ended - session.prepared.arrived)
        if self.access_log is not None:
            self.access_log.ended(session)
        if self.tracing is not None and spans:
            self.tracing.ended(session)

    def shadow_mode(self, runtime: Runtime) -> None:
        """Export what shadow mode's policy runtime would have done (`llmflow_shadow_*`), as
        the core counts it in `runtime` (the forwarding runtime, built with `shadow=`)."""
        self.shadow_runtime = runtime

    def truncated(self, reason: str) -> None:
        """Count a reply cut with a visible notice."""
        self.truncations.labels(reason).inc()

    def upstream_aborted(self, reason: str) -> None:
        """Count an upstream request closed before it finished."""
        self.aborts.labels(reason).inc()

    def ttft_buckets(self) -> dict[str, Any]:
        """`llmflow_ttft_seconds` as `/api/state` shows it: the bucket bounds, and per tier
        the cumulative count at each bound and at +Inf since the gateway started.

        The dashboard keeps its own ten minutes of these and takes differences for its p50/p99,
        so the gateway keeps no history for it.
        """
        by_tier: dict[str, list[int]] = {}
        for metric in self.ttft.collect():
            for sample in metric.samples:
                if sample.name.endswith("_bucket"):  # in `le` order, +Inf last
                    by_tier.setdefault(sample.labels["tier"], []).append(int(sample.value))
        return {"bounds": list(_TTFT_BUCKETS), "by_tier": by_tier}

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class _StateCollector:
    def __init__(self, metrics: GatewayMetrics) -> None:
        self.m = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        host, governor = self.m.host, self.m.host.runtime
        queued: Tally[str] = Tally(dict.fromkeys(self.m.tiers, 0))
        running: Tally[str] = Tally(dict.fromkeys(self.m.tiers, 0))
        for party in host.parties.values():
            (queued if party.queued else running)[party.tier] += 1
        for live in self.m.native.streams() if self.m.native is not None else ():
            (queued if live["backend"] is None else running)[live["tier"]] += 1
        by_tier = GaugeMetricFamily(
            "llmflow_queue_length", "Requests waiting, by tier", labels=["tier"]
        )
        for tier, count in queued.items():
            by_tier.add_metric([tier], count)
        yield by_tier
        in_flight = GaugeMetricFamily(
            "llmflow_tier_in_flight", "Requests holding a backend slot, by tier", labels=["tier"]
        )
        for tier, count in running.items():
            in_flight.add_metric([tier], count)
        yield in_flight
        yield _gauge("llmflow_queue_total", "Requests in the core's waiting queue", governor.queued)
        yield _gauge("llmflow_in_flight", "Requests holding a backend slot", governor.running)
        yield _gauge(
            "llmflow_kv_blocks_in_use", "KV blocks the ledger holds", governor.kv_blocks_in_use
        )
        yield _gauge("llmflow_shed_level", "Preemption-breaker shed level", governor.shed_level)
        retries, late = governor.late_counts
        yield CounterMetricFamily(
            "llmflow_retries_known",
            "Arrivals known by their body as a client's retry of a request that ended unserved",
            value=retries,
        )
        yield CounterMetricFamily(
            "llmflow_late_requests",
            "Queued requests sent behind those still on time: past the TTFT SLA in an overload "
            "the queue cannot hold",
            value=late,
        )
        yield _gauge(
            "llmflow_draining", "1 while the gateway drains for shutdown", int(self.m.draining())
        )
        if self.m.shadow_runtime is not None:
            yield from _shadow(self.m.shadow_runtime, self.m.tiers)
        if self.m.scraper is not None:
            yield from _backend_gauges(self.m.scraper)
        yield _gaps(self.m.inter_chunk, self.m.relay)


def _shadow(runtime: Runtime, tiers: tuple[str, ...]) -> Iterator[Metric]:
    """Shadow mode's families: the policy runtime's would-haves (counted by the core, whichever
    path served the request) and what it would hold now."""
    policy = runtime.shadow
    assert policy is not None
    families = {
        "refused": CounterMetricFamily(
            "llmflow_shadow_refused",
            "Requests the policy would have refused (shadow mode), by tier and reason",
            labels=["tier", "reason"],
        ),
        "cut": CounterMetricFamily(
            "llmflow_shadow_cut",
            "Replies the policy would have cut with a notice (shadow mode), by tier and reason",
            labels=["tier", "reason"],
        ),
        "queued": CounterMetricFamily(
            "llmflow_shadow_queued",
            "Arrivals the policy would have queued (shadow mode), by tier",
            labels=["tier"],
        ),
        "brownout": CounterMetricFamily(
            "llmflow_shadow_brownout",
            "Starts the policy would have browned out, max_tokens clamped (shadow mode)",
            labels=["tier"],
        ),
    }
    tally = runtime.shadow_tally()
    queued = {tier: 0 for tier in tiers}  # a zero per tier, not "no data", while nothing waits
    for what, tier, reason, n in tally:
        if what == "queued":
            queued[tier] = n
        elif reason is not None:
            families[what].add_metric([tier, reason], n)
        else:
            families[what].add_metric([tier], n)
    for tier, n in queued.items():
        families["queued"].add_metric([tier], n)
    yield from families.values()
    yield _gauge(
        "llmflow_shadow_in_flight",
        "Requests the policy would have running now (shadow mode)",
        policy.running,
    )
    yield _gauge(
        "llmflow_shadow_queue_total",
        "Requests the policy would have waiting now (shadow mode)",
        policy.queued,
    )


class GapTally:
    """Gaps between writes to streaming clients, in `llmflow_inter_chunk_seconds`' buckets.

    A plain tally rather than a `Histogram`, so that `/metrics` can add the relay's counts
    (the same buckets, kept in Rust) and show one histogram for every stream.
    """

    def __init__(self) -> None:
        self.counts = [0] * (len(_CHUNK_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, gap_s: float) -> None:
        """Count one gap."""
        self.counts[bisect.bisect_left(_CHUNK_BUCKETS, gap_s)] += 1
        self.sum += gap_s


def _gaps(tally: GapTally, relay: Relay | None) -> Metric:
    counts, total = list(tally.counts), tally.sum
    if relay is not None:
        bounds, relayed, relayed_sum = relay.inter_chunk()
        assert tuple(bounds) == _CHUNK_BUCKETS, "the relay's buckets must match"
        counts = [a + b for a, b in zip(counts, relayed, strict=True)]
        total += relayed_sum
    cumulative, running = [], 0
    for bound, count in zip([*map(str, _CHUNK_BUCKETS), "+Inf"], counts, strict=True):
        running += count
        cumulative.append((bound, running))
    return HistogramMetricFamily(
        "llmflow_inter_chunk_seconds",
        "Gap between writes to a streaming client",
        buckets=cumulative,
        sum_value=total,
    )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _backend_gauges(scraper: Scraper) -> Iterator[Metric]:
    families = {
        "kv_usage": GaugeMetricFamily(
            "llmflow_backend_kv_usage",
            "Backend KV cache usage (0..1), last scrape",
            labels=["backend"],
        ),
        "healthy": GaugeMetricFamily(
            "llmflow_backend_healthy", "1 when the backend is healthy", labels=["backend"]
        ),
        "running": GaugeMetricFamily(
            "llmflow_backend_running", "Requests vLLM reports running", labels=["backend"]
        ),
        "waiting": GaugeMetricFamily(
            "llmflow_backend_waiting", "Requests vLLM reports waiting", labels=["backend"]
        ),
        "age": GaugeMetricFamily(
            "llmflow_backend_scrape_age_seconds",
            "Seconds since the last good scrape",
            labels=["backend"],
        ),
    }
    preemptions = CounterMetricFamily(
        "llmflow_backend_preemptions",
        "Preemptions vLLM reports (its num_preemptions counter), last scrape",
        labels=["backend"],
    )
    # vLLM counts its prefix cache in prompt tokens: looked up, and found cached. Their rates'
    # ratio is the hit rate that prefix routing (`routing.policy: prefix`) is meant to raise.
    prefix_queries = CounterMetricFamily(
        "llmflow_backend_prefix_cache_queries",
        "Prompt tokens vLLM looked up in its prefix cache (vllm:prefix_cache_queries), last scrape",
        labels=["backend"],
    )
    prefix_hits = CounterMetricFamily(
        "llmflow_backend_prefix_cache_hits",
        "Of those, tokens found cached (vllm:prefix_cache_hits), last scrape",
        labels=["backend"],
    )
    now = time.monotonic()
    for name, state in scraper.states.items():
        families["healthy"].add_metric([name], int(state.healthy))
        if state.prefix_queries_total is not None:
            prefix_queries.add_metric([name], state.prefix_queries_total)
        if state.prefix_hits_total is not None:
            prefix_hits.add_metric([name], state.prefix_hits_total)
        if state.kv_usage is not None:
            families["kv_usage"].add_metric([name], state.kv_usage)
        if state.running is not None:
            families["running"].add_metric([name], state.running)
        if state.waiting is not None:
            families["waiting"].add_metric([name], state.waiting)
        if state.scraped_at is not None:
            families["age"].add_metric([name], now - state.scraped_at)
        if state.preemptions_total is not None:
            preemptions.add_metric([name], state.preemptions_total)
    yield from families.values()
    yield preemptions
    yield prefix_queries
    yield prefix_hits
