"""Prometheus metrics of the gateway, in a registry of its own.

What is counted per request (`llmflow_requests`, the TTFT, end-to-end and queue-wait
histograms, tokens, cuts, upstream aborts) and the access log's rows are kept in the core's
tally (`llmflow._core.Tally`, `rust/src/tally.rs`): the native front counts its requests there
itself, and the Python path's sessions through the methods below; `/metrics` renders the tally
when it is scraped. Gauges that mirror state (queue by tier, in flight, KV, backend health, shed
level) are read from the core and the scraper then too, so the hot path never touches them.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import Counter as Tally
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.samples import Sample

from llmflow._core import Tally as RequestTally
from llmflow._core import request_outcome
from llmflow.gateway.errors import GatewayError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator
    from pathlib import Path

    from prometheus_client.metrics_core import Metric

    from llmflow._core import NativeRoutes, Relay, Runtime
    from llmflow.gateway.host import Host
    from llmflow.gateway.scraper import Scraper
    from llmflow.gateway.session import Prepared, StreamSession
    from llmflow.gateway.telemetry import Tracing

__all__ = ["CONTENT_TYPE", "GatewayMetrics", "outcome_of"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS, _E2E_BUCKETS = map(tuple, RequestTally.bounds())  # the core's, as it counts
_CHUNK_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


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
        # per-request counts and the access log, shared with the native front (`NativeRoutes`)
        self.tally = RequestTally()
        self.tracing: Tracing | None = None  # OpenTelemetry spans (`telemetry`), when configured
        self.shadow_runtime: Runtime | None = None  # shadow mode: the forwarding runtime
        self.inter_chunk = GapTally()  # Python-written streams; the relay counts its own
        self.registry.register(_RequestCollector(self.tally))
        self.registry.register(_StateCollector(self))

    def open_access_log(self, path: Path, shadow: bool = False) -> None:
        """Write the access log (`server.access_log`) to `path` from now on: one CSV row per
        request at its end, by either path (`shadow`: shadow mode's `shadow` column).

        Raises:
            OSError: the file cannot be created or opened.
        """
        self.tally.open_log(path, shadow)

    def close(self) -> None:
        """Close the access log."""
        self.tally.close_log()

    @property
    def outcomes(self) -> Tally[tuple[str, str]]:
        """(outcome, reason) -> requests, every tier's, as `/api/state` shows them."""
        counts: Tally[tuple[str, str]] = Tally()
        for _, outcome, reason, n, _ in self.tally.families()["requests"]:
            counts[outcome, reason] += int(n)
        return counts

    def rejected(
        self, prepared: Prepared, error: GatewayError, at: float | None = None, spans: bool = True
    ) -> None:
        """Count (and log, and trace) a request the core turned away as it arrived (`at`: when,
        monotonic, if not now; `spans`: False where the caller makes its spans)."""
        self.tally.refused(
            error.headers.get("X-Request-Id"), prepared.tier, prepared.tenant, prepared.arrived,
            prepared.prompt_tokens, prepared.max_tokens, error.status, error.code, at,
        )
        if self.tracing is not None and spans:
            self.tracing.refused(prepared, error, error.headers.get("X-Request-Id"))

    def first_token(self, session: StreamSession) -> None:
        """Record a session's time to first token."""
        assert session.first_token_at is not None
        p = session.prepared
        self.tally.first_token(p.tier, session.first_token_at - p.arrived)

    def request_ended(self, session: StreamSession, spans: bool = True) -> None:
        """Count (and log) a finished session by outcome and reason, and its tokens (`spans`:
        False where the caller makes its spans)."""
        p = session.prepared
        self.tally.ended(
            f"llmflow-{session.request_id}", p.tier, p.tenant, p.arrived,
            queue_wait_s=session.queue_wait_s if session.backend is not None else None,
            first_token_s=session.first_token_at, ended_s=session.ended_at,
            prompt_tokens=p.prompt_tokens, max_tokens=p.max_tokens,
            completion_tokens=session.parser.completion_tokens, end=session.end,
            error_status=_error_status(session), backend=session.backend,
            shadow=session.shadow.summary() if session.shadow is not None else None,
        )
        if self.tracing is not None and spans:
            self.tracing.ended(session)

    def shadow_mode(self, runtime: Runtime) -> None:
        """Export what shadow mode's policy runtime would have done (`llmflow_shadow_*`), as
        the core counts it in `runtime` (the forwarding runtime, built with `shadow=`)."""
        self.shadow_runtime = runtime

    def truncated(self, reason: str) -> None:
        """Count a reply cut with a visible notice."""
        self.tally.truncated(reason)

    def upstream_aborted(self, reason: str) -> None:
        """Count an upstream request closed before it finished."""
        self.tally.upstream_aborted(reason)

    def ttft_buckets(self) -> dict[str, Any]:
        """`llmflow_ttft_seconds` as `/api/state` shows it: the bucket bounds, and per tier
        the cumulative count at each bound and at +Inf since the gateway started.

        The dashboard keeps its own ten minutes of these and takes differences for its p50/p99,
        so the gateway keeps no history for it.
        """
        by_tier = {
            tier: list(itertools.accumulate(counts))
            for tier, counts, _, _ in self.tally.families()["ttft"]
        }
        return {"bounds": list(_TTFT_BUCKETS), "by_tier": by_tier}

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


def outcome_of(session: StreamSession) -> tuple[str, str | None]:
    """A session's outcome in the simulator's words (`completed`, `rejected`, `timed_out`,
    `truncated`, `cancelled`, `failed`) and its reason (the access log's, the span's), as the
    core maps them."""
    return request_outcome(session.end, _error_status(session), session.parser.completion_tokens)


def _error_status(session: StreamSession) -> int | None:
    """The status of the error a session was answered with (its own, or its admission's)."""
    error = session.error
    if error is None and session.admitted.done() and not session.admitted.cancelled():
        exc = session.admitted.exception()
        error = exc if isinstance(exc, GatewayError) else None
    return error.status if error is not None else None


class _RequestCollector:
    """The per-request families, rendered from the core's tally (the names, help, labels and
    buckets prometheus_client's `Counter`s and `Histogram`s exported, `_created` included)."""

    def __init__(self, tally: RequestTally) -> None:
        self.tally = tally

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        families = self.tally.families()
        if not _created_series():  # each row's last item is its creation time
            families = {name: [(*r[:-1], None) for r in rows] for name, rows in families.items()}
        requests = CounterMetricFamily(
            "llmflow_requests", "Requests by tier, outcome and reason",
            labels=["tier", "outcome", "reason"],
        )
        for tier, outcome, reason, n, created in families["requests"]:
            requests.add_metric([tier, outcome, reason], n, created=created)
        yield requests
        yield _histogram(
            "llmflow_ttft_seconds", "Arrival to first token, as the gateway sees it",
            _TTFT_BUCKETS, families["ttft"],
        )
        yield _histogram(
            "llmflow_e2e_seconds", "Arrival to the last token of a completed request",
            _E2E_BUCKETS, families["e2e"],
        )
        yield _histogram(
            "llmflow_queue_wait_seconds", "Time spent queued before admission",
            _TTFT_BUCKETS, families["queue_wait"],
        )
        yield _counter(
            "llmflow_tokens_streamed", "Generated tokens relayed to clients", "tier",
            families["tokens"],
        )
        yield _counter(
            "llmflow_truncations", "Replies cut with a notice", "reason", families["truncations"]
        )
        yield _counter(
            "llmflow_upstream_aborts", "Upstream requests aborted before they finished",
            "reason", families["aborts"],
        )


def _created_series() -> bool:
    """Whether prometheus_client exports `_created` samples (its `disable_created_metrics`)."""
    return bool(getattr(prometheus_metrics, "_use_created", True))


def _counter(
    name: str, doc: str, label: str, children: list[tuple[str, float, float | None]]
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for value, n, created in children:
        family.add_metric([value], n, created=created)
    return family


def _histogram(
    name: str,
    doc: str,
    bounds: tuple[float, ...],
    children: list[tuple[str, list[int], float, float | None]],
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=["tier"])
    les = [*map(str, bounds), "+Inf"]
    for tier, counts, total, created in children:
        cumulative = list(zip(les, itertools.accumulate(counts), strict=True))
        family.add_metric([tier], cumulative, sum_value=total)
        if created is not None:
            family.samples.append(Sample(f"{name}_created", {"tier": tier}, created))
    return family


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
