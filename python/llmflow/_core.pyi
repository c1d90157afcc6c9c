"""Type stubs and user docs for `llmflow._core`, the Rust policy core.

The core reads no clock: every call that depends on time takes `now_us`, an integer number of
microseconds on any monotonic timeline the caller chooses (the simulator passes
`round(env.now * 1e6)`, the gateway passes `time.monotonic_ns() // 1000`).
"""

import os
from collections.abc import Mapping
from typing import Any, Literal, TypeAlias, final

__version__: str

RejectReason = Literal[
    "queue_full", "tier_shed", "kv_pressure", "ttft_sla", "preemption_breaker", "draining",
    "rate_limited",
    "no_healthy_backend", "displaced", "client_deadline",
]
Outcome = Literal["completed", "error", "timeout", "cancelled"]
ExpiryReason = Literal["queue_timeout", "first_token_timeout", "deadline", "client_deadline"]

class PolicyError(Exception):
    """Base class of every error the core raises."""

class ConfigError(PolicyError):
    """A policy config value is missing, of the wrong type or out of range."""

class UnknownTenantError(PolicyError):
    """`submit` named a tenant the config does not declare."""

class UnknownBackendError(PolicyError):
    """An observation named a backend the config does not declare."""

class UnknownModelError(PolicyError):
    """A request named a model no backend serves and no alias maps (or named none while the
    backends serve several)."""

class DuplicateRequestError(PolicyError):
    """`submit` reused the id of a request that is still live."""

class InvalidArgumentError(PolicyError):
    """An argument is out of range (negative tokens, a KV usage outside 0..1, ...)."""

@final
class Admitted:
    """`Governor.submit` admitted the request: it holds a slot on `backend` now.

    A request that had to queue is dispatched within `submit` itself, so it comes back as
    `Admitted` whenever it can start at once (for instance when the requests ahead of it wait
    for KV room that it does not need).
    """

    __match_args__ = ("request_id", "backend", "priority")
    request_id: int
    backend: str
    """Backend the request runs on."""
    priority: int
    """Integer for vLLM's `--scheduling-policy priority` (lower runs first)."""
    prefill_backend: str | None
    """In a split (prefill/decode) pool: the prefill instance the prompt goes to first;
    `backend` then decodes. It holds a slot there until `Governor.prefilled`."""
    def __new__(
        cls, request_id: int, backend: str, priority: int, prefill_backend: str | None = None
    ) -> Admitted: ...

@final
class Queued:
    """`Governor.submit` queued the request; a later `Governor.dispatch` admits it."""

    __match_args__ = (
        "request_id", "position", "estimated_wait_s", "priority", "displaced",
        "displaced_retry_after_s",
    )
    request_id: int
    position: int
    """0-based place in the waiting queue: queued requests of its tier and the more important
    ones."""
    estimated_wait_s: float
    """Estimated time until the request starts, at the current drain rate."""
    priority: int
    """Integer for vLLM's `--scheduling-policy priority` (lower runs first)."""
    displaced: int | None
    """A queued request this one pushed out because the waiting places its tier may use were
    taken: the newest request of a lower tier, or, inside its own tier, the newest request of
    the tenant furthest over its weighted share (when that tenant holds more than this one's
    would). The caller must end that request with a 429 (reason `displaced`); the core has
    already forgotten it."""
    displaced_retry_after_s: float | None
    """The Retry-After for the displaced request's 429."""
    def __new__(
        cls,
        request_id: int,
        position: int,
        estimated_wait_s: float,
        priority: int,
        displaced: int | None = None,
        displaced_retry_after_s: float | None = None,
    ) -> Queued: ...

@final
class Rejected:
    """`Governor.submit` refused the request. Never an exception: rejecting is normal."""

    __match_args__ = ("request_id", "reason", "retry_after_s")
    request_id: int
    reason: RejectReason
    retry_after_s: float
    """Positive: the estimated time for the queue to drain enough (for the Retry-After)."""
    def __new__(cls, request_id: int, reason: RejectReason, retry_after_s: float) -> Rejected:
        """Build a rejection by hand (for tests and fakes).

        Raises:
            InvalidArgumentError: `reason` is not a known reject reason.
        """

Decision: TypeAlias = Admitted | Queued | Rejected
"""What `Governor.submit` decided; `match` on the class (`case Admitted(): ...`)."""

@final
class Admission:
    """A queued request that `Governor.dispatch` moved onto a backend."""

    request_id: int
    backend: str
    priority: int
    queue_wait_s: float
    prefill_backend: str | None
    """In a split pool: the prefill instance the prompt goes to first."""

@final
class Expired:
    """A request that `Governor.expire` ended because one of its deadlines passed."""

    request_id: int
    reason: ExpiryReason
    was_running: bool
    """True when it held a slot (the caller must abort it upstream)."""
    backend: str | None
    retry_after_s: float
    """Positive: when a retry could expect to get through (for the 503/504's Retry-After)."""

@final
class Governor:
    """Admission controller, fair queue and KV ledger for a set of vLLM backends.

    Args:
        config: the policy config as a mapping (see `llmflow.config.Settings.to_core()`).

    Raises:
        ConfigError: naming the key, the bad value and what is allowed.
    """

    def __new__(cls, config: Mapping[str, Any]) -> Governor: ...
    def submit(
        self,
        request_id: int,
        tenant: str,
        prompt_tokens: int,
        max_tokens: int,
        now_us: int,
        *,
        model: str | None = None,
        prefix_hashes: list[int] | None = None,
    ) -> Decision:
        """Decide on a new request: admit it now, queue it, or reject it.

        A request that queues is dispatched at once (it comes back `Admitted` when it can
        start); other requests that this dispatch starts are returned by the next `dispatch`
        call, so call `dispatch` after `submit` as after any other event.

        Args:
            model: the model it names (a served name or an alias); only backends serving it
                are candidates, and it waits in that model's own queue. None: the one pool
                (an error when the backends serve several models).
            prefix_hashes: its prompt's chained block hashes (each covers the one before it
                and its own block; full blocks only), for a `prefix` routing pool.

        Raises:
            DuplicateRequestError: `request_id` is still live.
            UnknownTenantError: the tenant is not in the config.
            UnknownModelError: no backend serves `model` (or none was named among several).
            InvalidArgumentError: negative token counts.
        """
    def dispatch(self, now_us: int) -> list[Admission]:
        """Move queued requests onto free slots, in fair order. Call after anything frees one.

        Returns:
            First the admissions an earlier `submit` made for other requests, then new ones;
            each admission is returned exactly once.
        """
    def prefilled(self, request_id: int, now_us: int) -> bool:
        """A split request's prefill hop answered: its prefill instance's slot is free.

        Returns:
            False when the request has no prefill hop running (answered already, or ended).
        """
    def on_first_token(self, request_id: int, now_us: int) -> None:
        """Record the first token of a running request (feeds the prefill-throughput estimate)."""
    def on_tokens(self, request_id: int, n: int, now_us: int) -> None:
        """Record `n` more generated tokens: grows the request's KV footprint and its cost."""
    def finish(self, request_id: int, outcome: Outcome, now_us: int) -> bool:
        """End a live request (queued or running) and free what it held.

        Returns:
            False when the request was not live (already ended): ending twice is a no-op.
        """
    def expire(self, now_us: int) -> list[Expired]:
        """End every request whose queue-wait, first-token or total deadline has passed."""
    def next_deadline_us(self) -> int | None:
        """Earliest deadline among live requests, to schedule the next `expire` call."""
    def observe_backend(
        self,
        backend: str,
        now_us: int,
        *,
        kv_usage: float | None = None,
        running: int | None = None,
        waiting: int | None = None,
        preemptions_total: int | None = None,
        kv_blocks: int | None = None,
    ) -> None:
        """Feed a scrape of a backend's metrics (KV usage in 0..1, vLLM's counters).

        Args:
            backend: the backend's name in the config.
            now_us: when the scrape was taken.
            kv_usage: `vllm:kv_cache_usage_perc` (0..1).
            running: `vllm:num_requests_running`.
            waiting: `vllm:num_requests_waiting`.
            preemptions_total: `vllm:num_preemptions_total`; a rise trips the breaker.
            kv_blocks: the backend's KV capacity in blocks (`cache_config_info`), when learned.

        Raises:
            UnknownBackendError: the backend is not in the config.
            InvalidArgumentError: `kv_usage` outside 0..1.
        """
    def set_backend_health(self, backend: str, healthy: bool) -> None:
        """Mark a backend healthy or not; unhealthy backends receive no admissions."""
    def start_draining(self) -> None:
        """Refuse new requests (reason `draining`); live ones continue."""
    @property
    def draining(self) -> bool: ...
    @property
    def running(self) -> int:
        """Requests holding a slot, all backends together."""
    @property
    def queued(self) -> int:
        """Requests in the waiting queue."""
    @property
    def live(self) -> int:
        """Requests queued or running."""
    def is_live(self, request_id: int) -> bool:
        """Whether the request is queued or running."""
    @property
    def kv_blocks_in_use(self) -> int:
        """KV blocks the ledger holds for live requests, all backends together."""
    @property
    def shed_level(self) -> int:
        """Preemption-breaker level: 0 when calm, higher sheds non-protected tiers harder."""
    def request_kv(self, request_id: int, now_us: int) -> tuple[int, float] | None:
        """(blocks now, block-seconds so far) of a live request, or None."""
    def snapshot(self, now_us: int) -> dict[str, Any]:
        """JSON-ready state for metrics and the dashboard (queues, slots, KV, counters)."""
    def tenant_service(self, tenant: str) -> float:
        """Cost charged to a tenant so far, in weighted tokens (for fairness checks)."""
    def __copy__(self) -> Governor:
        """An independent copy of the whole state, via `copy.copy` (for what-if checks)."""

def prefix_hashes(
    data: bytes, chunk: int, max_blocks: int = 4096, keyed: bool = False
) -> list[int]:
    """Chained hashes of `data`'s full chunks of `chunk` bytes, at most `max_blocks` (a partial
    tail gets none): each covers its parent's hash and its chunk, as vLLM's block hashes do, and
    is below 2**63. For `prefix_hashes=` when a host has the prompt's bytes, not its tokens.
    `keyed`: SipHash under this process's random key, so a hash in a trace file reveals nothing
    of the prompt (equal within the process only); otherwise FxHash, the same everywhere."""

def config_problem(config: Mapping[str, Any]) -> tuple[str, str] | None:
    """Check a runtime config (the mapping `Runtime` takes) without building a runtime.

    `llmflow.config` calls it for every file it loads: the core is the one validator of every
    value it is built from, and the loader reports its message at the file's own key.

    Args:
        config: `{"policy": {...}, "lifecycle": {...}}`, as `Settings.to_runtime()` gives.

    Returns:
        None when `Runtime(config)` would build, else the first problem as `(key, message)`:
        the key in the core's names (`max_concurrency_per_gpu`, `tiers[1].shed_at`,
        `lifecycle.drain_timeout_ms`, `(document)` for one that does not parse).

    Raises:
        ConfigError: `config` is not a mapping.
    """

def json_refusal(raw: bytes) -> str | None:
    """What a request body that is not one JSON object of finite numbers is refused with:
    the message of `decode_json`'s 400 (`invalid_json`), read by the jiter the native front
    reads bodies with, so both paths say the same at the same line and column. None: the body
    is one such object."""

def kv_slots(
    vram_bytes: float,
    weights_bytes: float,
    activations_bytes: float,
    avg_context_tokens: float,
    kv_bytes_per_token: float,
) -> float:
    """The seed's capacity formula: `(VRAM - weights - activations) / (ctx * kv_bytes_per_token)`.

    Raises:
        InvalidArgumentError: non-positive context or bytes per token, or negative memory.
    """

def kv_bytes_per_token(
    layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, tp: int = 1
) -> int:
    """KV bytes one token occupies on one GPU: `2 * layers * kv_heads * head_dim * dtype / tp`.

    Raises:
        InvalidArgumentError: a zero argument.
    """

# ---- the runtime: the request lifecycle, sans-IO -------------------------------------------

Reason = Literal[
    "queue_full", "tier_shed", "kv_pressure", "ttft_sla", "preemption_breaker", "draining",
    "rate_limited",
    "no_healthy_backend", "displaced", "queue_timeout", "first_token_timeout", "deadline",
    "client_deadline", "client_stall", "shutdown", "upstream_error",
]

class TraceMismatchError(PolicyError):
    """A replayed trace's actions differ from the recorded ones (the message names the line)."""

@final
class Start:
    """Send the request to `backend`, with vLLM priority `priority` (lower runs first).

    `max_tokens` is set when a brownout clamped the request (its tier's `brownout_max_tokens`,
    once the queue is `brownout_at` full): send it upstream in place of the client's.

    `prefill_backend` is set in a split (prefill/decode) pool: send the request there first as
    vLLM's prefill hop (`max_tokens` 1, not streamed, `kv_transfer_params` asking for a remote
    decode), feed `Runtime.prefilled`, then send it to `backend` with the `kv_transfer_params`
    the prefill answered, and relay that answer.
    """

    request_id: int
    backend: str
    priority: int
    queue_wait_s: float
    max_tokens: int | None
    prefill_backend: str | None
    prefill_priority: int | None
    """The prefill hop's vLLM priority (its tier alone: first come, first served there)."""

@final
class Wait:
    """The request waits in the gateway's queue: keep the client waiting."""

    request_id: int
    position: int
    estimated_wait_s: float

@final
class Abort:
    """Close the request's upstream stream now: vLLM aborts it and frees its KV blocks."""

    request_id: int

@final
class Reply:
    """Terminal: answer with `status`; `retry_after_s` is the `Retry-After` header as sent
    (whole seconds), or `None` for no header."""

    request_id: int
    status: int
    reason: Reason
    retry_after_s: int | None

@final
class Cut:
    """Terminal: end the reply now with its partial text and the visible notice for `reason`."""

    request_id: int
    reason: Reason

@final
class End:
    """Terminal: the request is over (upstream done, failed after the reply was committed, or
    the client left)."""

    request_id: int
    outcome: Outcome

@final
class Arm:
    """(Re)set the host's one timer to fire at `at_us`; then call `Runtime.timer`."""

    at_us: int

@final
class SetHealth:
    """A backend went down or came back."""

    backend: str
    healthy: bool

@final
class Lease:
    """Ask the shared store for a lease on one of `backend`'s slots, granted only while fewer
    than `cap` leases are live there (atomically, across replicas); then feed
    `Runtime.lease_granted`, `lease_denied`, or `lease_failed` (the store did not answer).
    The request's `Start` follows the grant. Sent only with `lifecycle.leases`."""

    request_id: int
    backend: str
    cap: int

@final
class Release:
    """Give the request's lease on `backend` back to the shared store (the request ended)."""

    request_id: int
    backend: str

Action = Start | Wait | Abort | Reply | Cut | End | Arm | SetHealth | Lease | Release

@final
class Runtime:
    """The request lifecycle around a `Governor`, sans-IO: feed events, carry out the actions.

    Every method is one event that happened at `now_us` and returns the actions to carry out,
    in order. Every request announced with `arrive` ends with exactly one terminal action
    (`Reply`, `Cut` or `End`); late events for an ended request are ignored. The host keeps one
    timer, set by `Arm`, and calls `timer` when it fires (early is harmless, late is not).

    A request whose upstream is `done` while its client's window is full lingers: its slot and
    KV are freed at once (`running` drops, `live` does not), and it ends with `End` at the next
    `window_drained`, or with `Cut("client_stall")` (no `Abort`: upstream is over) when the
    stall timer fires first. `failed` and `tokens` for it are ignored.

    Args:
        config: `{"policy": <Governor config>, "lifecycle": {...}}`, as
            `llmflow.config.Settings.to_runtime()` builds it.
        trace: record every event and its actions (see `take_trace`).
        shadow: shadow mode (`gate.mode: shadow`): the policy runtime's config. This runtime
            then forwards (the host carries out its actions), and every event it is fed, by
            any host, is mirrored to a second runtime built from `shadow`, whose actions are
            recorded instead (`take_verdict`, `shadow_tally`): a request it holds queued gets
            the real request's events, compressed, when it starts it; one it ended hears
            nothing more; only it hears a client's signals and a backend's KV size. With
            `trace`, the trace is the policy runtime's. The two runtimes' timers are the
            host's one timer (`Arm`).
    """

    def __new__(
        cls, config: Mapping[str, Any], *, trace: bool = False,
        shadow: Mapping[str, Any] | None = None,
    ) -> Runtime: ...
    @property
    def shadow(self) -> Runtime | None:
        """Shadow mode's policy runtime, for queries (its state, its counts); never feed it."""
    def take_verdict(
        self, request_id: int
    ) -> tuple[str, bool, str | None, int | None, int | None, str | None, int | None] | None:
        """Shadow mode: what the policy runtime did with a request whose real one has ended,
        once: (decision: `queued`, `started`, `refused` or `cut`; whether it queued first;
        reason; status; Retry-After; backend; a brownout's max_tokens). None: not in shadow
        mode, not ended, or taken already."""
    def shadow_tally(self) -> list[tuple[str, str, str | None, int]]:
        """Shadow mode: what the policy would have done so far, `(what, tier, reason, count)`,
        `what` one of `queued`, `refused`, `cut`, `brownout` (a real failure the policy
        repeated is not counted)."""
    @property
    def shadow_held(self) -> int:
        """Shadow mode: requests whose verdict the core still keeps (0 once all have ended and
        their verdicts are taken)."""
    def arrive(
        self, request_id: int, tenant: str, prompt_tokens: int, max_tokens: int, stream: bool,
        now_us: int, *, model: str | None = None, prefix_hashes: list[int] | None = None,
        fingerprint: int = 0, retries: int | None = None, deadline_ms: int | None = None,
    ) -> list[Action]:
        """A request arrived: it starts, waits, or gets its `Reply` at once.

        `model` and `prefix_hashes` route it as `Governor.submit` says. `fingerprint` (0:
        none) identifies the request across a client's retries (the gateway: a hash of its
        body): a retry of a request that ended unserved is judged from its first arrival.

        `retries` and `deadline_ms` are what the client said (None: nothing), bounded by the
        config's `signals` section: the retries it made before this one (a retry the
        fingerprint does not know keeps its place by now but is judged past its SLA), and how
        long it waits, in ms from now. A request whose queue wait is estimated at or beyond
        its deadline is refused at once (429 `client_deadline`, with a Retry-After); a queued
        one whose deadline passes leaves the queue (the same reply) before any later event can
        start it. Both go into the trace.

        Raises:
            UnknownModelError: no backend serves `model`; the request was not announced (the
                gateway answers 404 `model_not_found` before this).
            InvalidArgumentError: `retries` or `deadline_ms` is negative.
        """
    def models(self) -> list[tuple[str, str]]:
        """Every model name a request may send, with the served model it routes to (a served
        name maps to itself, an alias to its target); empty when no backend declares models."""
    def pools(self) -> list[tuple[str, str, list[str]]]:
        """The model table: each pool's served model ("" for the one pool of a config whose
        backends declare no models), its routing policy (`free_slots`, `round_robin`,
        `least_loaded`, `prefix`) and the backends that serve it, in config order. With
        `models`, what every host reads instead of rebuilding it from the config."""
    def resolve_model(self, model: str | None = None) -> str | None:
        """The served model a request naming `model` goes to (aliases resolved); None when the
        config declares no models.

        Raises:
            UnknownModelError: no backend serves it (or none named among several).
        """
    def refusal(
        self, tenant: str, prompt_tokens: int, max_tokens: int, now_us: int, *,
        model: str | None = None, fingerprint: int = 0, retries: int | None = None,
        deadline_ms: int | None = None,
    ) -> tuple[int, Reason, int] | None:
        """Whether `arrive` would refuse this request at once, asked without changing anything.

        A host under a flood may answer a refused request on a short path (the gateway does,
        below FastAPI), but it still feeds it to `arrive`, which then returns exactly this
        refusal as its `Reply`: counters, the Retry-After spread and the trace stay exact.

        Args:
            tenant: the tenant's name.
            prompt_tokens: the request's prompt length, as `arrive` would get it.
            max_tokens: its output bound, as `arrive` would get it.
            now_us: the time `arrive` would be fed at.
            model: the model it names, as `arrive` would get it.
            fingerprint: its fingerprint, as `arrive` would get it.
            retries: what its client said of its retries, as `arrive` would get it.
            deadline_ms: its client's deadline, as `arrive` would get it.

        Returns:
            `(status, reason, retry_after_s)` as `arrive`'s `Reply` would carry them (429, or
            503 for `draining` and `no_healthy_backend`; Retry-After in whole seconds), or None
            when `arrive` would start or queue the request, or when only `arrive` itself can
            tell (at `now_us` a breaker cool-down is due, or, for a best-effort tier, a
            headroom recompute).

        Raises:
            UnknownTenantError: the tenant is not configured.
            InvalidArgumentError: a negative token count.
        """
    def started(self, request_id: int, now_us: int) -> list[Action]:
        """The backend accepted the request (its response headers came back)."""
    def prefilled(self, request_id: int, now_us: int) -> list[Action]:
        """A split request's prefill hop answered: its prefill instance's slot is free (a
        waiting request may start on it)."""
    def tokens(self, request_id: int, n: int, now_us: int) -> list[Action]:
        """`n` more tokens were generated; the first ones are the first token."""
    def tokens_many(self, counts: list[tuple[int, int]], now_us: int) -> list[Action]:
        """`tokens` for each (request_id, n), in order: the relay's periodic batch."""
    def done(self, request_id: int, now_us: int) -> list[Action]:
        """Upstream finished the request."""
    def failed(
        self, request_id: int, status: int, now_us: int, *, backend_down: bool = False
    ) -> list[Action]:
        """Upstream failed with `status` (0: unreachable; `backend_down`: marks it down)."""
    def client_gone(self, request_id: int, now_us: int) -> list[Action]:
        """The client went away: abort upstream, free everything."""
    def window_full(self, request_id: int, now_us: int) -> list[Action]:
        """The client's window filled up: the stall timer starts."""
    def window_drained(self, request_id: int, now_us: int) -> list[Action]:
        """The client took chunks: the stall timer stops."""
    def timer(self, now_us: int) -> list[Action]:
        """The host's timer fired."""
    def scrape_ok(
        self, backend: str, began_us: int, now_us: int, *, kv_usage: float | None = None,
        running: int | None = None, waiting: int | None = None,
        preemptions_total: int | None = None, kv_blocks: int | None = None,
    ) -> list[Action]:
        """A scrape of `backend` begun at `began_us` answered (KV usage is clamped to 0..1)."""
    def scrape_failed(
        self, backend: str, now_us: int, *, reachable: bool = False
    ) -> list[Action]:
        """A scrape of `backend` failed. `reachable`: the backend answered (an error status,
        not vLLM's metrics, too slowly), so it stays up and the stale-metrics rule halves its
        slots; else nothing answered, and `scrape_failures_before_down` such scrapes in a row
        mark it down. A backend never scraped is down on any failure."""
    def shared_load(
        self,
        backend: str,
        elsewhere: int,
        now_us: int,
        *,
        waiting: float = 0.0,
        waiting_before: float = 0.0,
    ) -> list[Action]:
        """Other gateway replicas hold `elsewhere` of `backend`'s slots and have tenants of
        total weight `waiting` waiting (the shared store's figures), `waiting_before` of it on
        the replicas ordered before this one (every replica must use the same order, e.g. by
        replica id): this runtime's free slots are its cap less its own running less
        `elsewhere`, and while others wait it runs at most its share of the cap by waiting
        weight (`waiting_weight` against `waiting`), rounded so that the replicas' shares add
        up to the cap."""
    @property
    def waiting_weight(self) -> float:
        """The weight of the tenants with requests waiting here (for the other replicas)."""
    def shared_service(self, tenant: str, cost: float, now_us: int) -> list[Action]:
        """Other gateway replicas gave `tenant` `cost` weighted tokens of service since the
        last sync: its fair-queue counter counts them (`tenant_service` does not)."""
    def shared_usage(
        self, tenant: str, requests: float, tokens: float, now_us: int
    ) -> list[Action]:
        """Other gateway replicas let `tenant` use `requests` and `tokens` since the last sync:
        its rate-limit buckets pay for them (`tenant_usage` does not count them)."""
    def lease_denied(self, request_id: int, now_us: int) -> list[Action]:
        """The shared store refused the slot lease of a started request (it never reached the
        backend): the request is decided again, as an arrival (queued, started, or refused with
        a Retry-After), and one more slot counts as held elsewhere until the next sync. With
        `lifecycle.leases`, only an answer to a pending `Lease` counts."""
    def lease_granted(self, request_id: int, now_us: int) -> list[Action]:
        """The shared store granted a `Lease`: its `Start` follows (or, when the request ended
        while the store was asked, a `Release`)."""
    def lease_failed(self, request_id: int, now_us: int) -> list[Action]:
        """The shared store did not answer a `Lease`: the store counts as lost, and the
        request is settled as `lifecycle.leases.on_loss` says (`local_share`: started
        unleased; `fail_closed`: decided again, with every slot held elsewhere)."""
    def store_lost(self, now_us: int) -> list[Action]:
        """Another call to the shared store (a sync, a `Release`) failed: the store counts as
        lost (`fail_closed`: every slot held elsewhere; `local_share`: all but cap / replicas,
        at least one; no `Release` goes out until a sync succeeds)."""
    def store_synced(
        self,
        backend: str,
        live: int,
        now_us: int,
        *,
        waiting: float = 0.0,
        waiting_before: float = 0.0,
    ) -> list[Action]:
        """A sync with the shared store succeeded: `live` leases are held on `backend`, this
        replica's among them (the rest count as held elsewhere), and other replicas have
        tenants of total weight `waiting` waiting, `waiting_before` of it on the replicas
        ordered before this one. The store is no longer lost."""
    def leases_held(self) -> list[tuple[str, list[int]]]:
        """The request ids whose leases this replica holds, by backend (every backend listed):
        what each sync renews. Empty without `lifecycle.leases`."""
    def drain(self, now_us: int) -> list[Action]:
        """Stop admitting; cut whatever is live when the drain timeout passes."""
    def carried(self) -> None:
        """The host has carried out every action it was handed (its `Abort`s have reached their
        sockets): the native front's `Start`s of the same events go upstream now."""
    def take_trace(self) -> str:
        """The JSONL trace recorded since the last call (header first); "" when not tracing."""
    @property
    def tracing(self) -> bool: ...
    def next_timer_us(self) -> int | None:
        """When the timer should fire next, if anything is pending."""
    @property
    def live(self) -> int:
        """Requests announced and not yet ended."""
    def is_live(self, request_id: int) -> bool: ...
    @property
    def running(self) -> int: ...
    @property
    def queued(self) -> int: ...
    @property
    def kv_blocks_in_use(self) -> int: ...
    @property
    def shed_level(self) -> int: ...
    @property
    def late_counts(self) -> tuple[int, int]:
        """(arrivals known, by their fingerprint, as a client's retry of a request that ended
        unserved; queued requests that went to their tier's late lane), so far."""
    @property
    def draining(self) -> bool: ...
    def backend_healthy(self, backend: str) -> bool: ...
    def scrape_failures(self, backend: str) -> int:
        """Scrapes of `backend` failed in a row."""
    def request_kv(self, request_id: int, now_us: int) -> tuple[int, float] | None: ...
    def tenant_service(self, tenant: str) -> float: ...
    def tenant_usage(self, tenant: str) -> tuple[float, float]:
        """Requests and tokens this runtime let `tenant` use, ever (rate limits' payments)."""
    def snapshot(self, now_us: int) -> dict[str, Any]:
        """The governor's state, as `Governor.snapshot`."""
    def __copy__(self) -> Runtime:
        """An independent copy (not tracing)."""

def replay_trace(text: str) -> tuple[int, int]:
    """Feed a trace's events to a fresh runtime and check every action, bit for bit.

    Returns:
        (events, actions) replayed.

    Raises:
        TraceMismatchError: the runtime answered differently (the message names the line).
        InvalidArgumentError: the text is not a trace.
    """

@final
class LightRefusal:
    """The light lane refused a request: answer with `status` (429 when every slot is taken,
    when its tier is shed or its tenant is over its rate; 503 when no candidate is healthy or
    the gateway drains) and `Retry-After` as sent (whole seconds, at least 1, spread over the
    lane's drain time for a crowd)."""

    status: int
    reason: Literal[
        "light_lane_full", "tier_shed", "rate_limited", "no_healthy_backend", "draining"
    ]
    retry_after_s: int

@final
class LightLane:
    """Per-backend caps on the routes that generate no tokens (embeddings, rerank, score,
    tokenize, detokenize, audio), apart from the governor's slots and queue. Sans-IO: time is
    `now_us`.

    Args:
        backends: (backend name, cap) for every backend; each cap at least 1.

    Raises:
        ConfigError: no backend, a repeated name, or a cap of 0.
    """

    def __new__(cls, backends: list[tuple[str, int]]) -> LightLane: ...
    def set_rate(self, tenant: str, requests_per_s: float) -> None:
        """Limit `tenant` to `requests_per_s` light requests a second (`tenants[].requests_per_s`).

        Raises:
            ConfigError: the rate is not a finite number above 0.
        """

    def set_tier_share(self, tier: str, shed_at: float) -> None:
        """Let `tier` in on a backend only while fewer than `shed_at` of its light slots are
        taken (rounded down, at least one): `tiers[].shed_at`, lower tiers refused first.

        Raises:
            ConfigError: the share is not in [0, 1].
        """

    def acquire(
        self,
        request_id: int,
        candidates: list[str],
        now_us: int,
        tenant: str | None = None,
        tier: str | None = None,
    ) -> str | LightRefusal:
        """Admit a request on the healthy candidate with the most free slots, or refuse it.

        Args:
            request_id: the caller's id, unique among those held.
            candidates: the backends that serve it (empty: every backend).
            now_us: the host's clock, microseconds.
            tenant: whose request it is: its rate limit (`set_rate`) is checked first (429
                `rate_limited`, nothing paid) and an admitted request pays one request.
            tier: its tenant's tier: let in only on a backend where fewer than the tier's
                share (`set_tier_share`) of the slots are taken (429 `tier_shed` otherwise).

        Returns:
            The backend's name (call `release` when the reply is over), or the refusal.

        Raises:
            DuplicateRequestError: `request_id` is still held.
            UnknownBackendError: a candidate is not configured.
        """
    def release(self, request_id: int, now_us: int) -> bool:
        """The reply is over; `False` for an id not held (a second release is a no-op)."""
    def set_health(self, backend: str, healthy: bool) -> None:
        """The runtime's `SetHealth` for a backend (unhealthy ones get no requests)."""
    def start_draining(self) -> None:
        """Refuse every newcomer with 503 from now on."""
    def in_flight(self, backend: str) -> int:
        """Light requests the backend holds now."""
    def live(self) -> int:
        """Light requests held on every backend together."""

@final
class Relay:
    """Relays streamed completions from vLLM to clients on threads of its own (tokio).

    I/O only: it de-frames SSE, cuts usage, counts tokens and writes to the client's socket;
    every decision stays with the `Runtime`. The front door (`Front`) and its native streams
    run on it (`NativeRoutes` opens them); Python opens none.

    Args:
        threads: relay threads (`llmflow serve --workers`).
        client_window: unwritten chunks a client may owe before its window is full.
        pause_when_full: stop reading upstream while full (else merge overflow).
        flush_interval_ms: coalescing interval; 0 writes each chunk at once.
        token_flush_ms: how often a stream reports its token counts (batched) to its request.
        connect_timeout_ms: giving up on connecting to a backend (it is then down).
        max_event_bytes: the largest SSE event a backend may send; a longer one fails the
            stream (`failed`, a 502, the backend not marked down), holding no more than this.
    """

    def __new__(
        cls,
        *,
        threads: int = 1,
        client_window: int = 8,
        pause_when_full: bool = True,
        flush_interval_ms: float = 0.0,
        token_flush_ms: float = 20.0,
        connect_timeout_ms: float = 5000.0,
        max_event_bytes: int = 16777216,
    ) -> Relay: ...
    def shutdown(self) -> None:
        """Stop every stream and the relay's threads (the relay is unusable afterwards)."""
    @property
    def live(self) -> int:
        """Streams still running."""
    def inter_chunk(self) -> tuple[list[float], list[int], float]:
        """Gaps between writes to clients: bucket bounds (s), per-bucket counts (+Inf last), sum."""

@final
class Front:
    """The native front door: the public listener and every client connection (tokio).

    It runs on the relay's threads. Each request's head is read with the gateway's limits
    (431 `headers_too_large`, 400 `invalid_http`, 408 `request_timeout`, 503
    `too_many_connections` when file descriptors run low, answered as the Python listener
    answers them); every request is passed to the app, which uvicorn serves
    on the private unix socket `app_socket`, with the client's address as `x-llmflow-peer`.

    Args:
        relay: the relay whose threads serve the connections.
        listen_fd: a bound, listening TCP socket (the front owns it from now on).
        app_socket: the path of the unix socket uvicorn serves the app on.
        max_header_bytes: the largest request line plus headers (`limits.max_header_bytes`).
        max_body_bytes: the largest body read whole for the native routes
            (`server.max_body_bytes`); larger ones go to the app, which refuses them.
        read_timeout_ms: how long a client may take to send a request (`server.read_timeout_ms`).
        write_timeout_ms: how long a client may take none of a reply before its connection is
            dropped (`server.write_timeout_ms`).

    Raises:
        InvalidArgumentError: a timeout is not positive, or the relay has shut down.
        OSError: the listener cannot be served.
    """

    def __new__(
        cls,
        relay: Relay,
        listen_fd: int,
        app_socket: str,
        *,
        max_header_bytes: int,
        max_body_bytes: int,
        read_timeout_ms: float = 30000.0,
        write_timeout_ms: float = 60000.0,
    ) -> Front: ...
    @property
    def passing(self) -> int:
        """Requests passed to the app whose reply is still being written to its client (a
        WebSocket counts for its whole life): a shutdown waits for them before `close`."""
    def close(self) -> None:
        """Stop accepting and drop every connection."""

@final
class NativeRoutes:
    """The governed completions served in Rust, end to end, against a runtime Python feeds too.

    From its construction the runtime's actions for the requests it serves, and the runtime's
    one timer (`Arm`), are carried out in Rust; Python's `Runtime` calls return the rest.
    `serve_on(front)` then has the front offer it every `POST /v1/chat/completions` and
    `/v1/completions`; what it is not sure of (see `gateway/native.py`) it passes to the app.

    Args:
        runtime: the runtime Python's host feeds (it may get native routes once).
        relay: the relay whose threads stream the replies.
        notify_fd: the write end of a non-blocking pipe: a byte when `take()` has actions.
        checks: the request checks (`FrontChecks`).
        keys: the API keys (`FrontKeys`).
        backends: (name, base URL, priority scheduling, CA file, client certificate file,
            client key file) of each backend, in the runtime's order: an https backend's
            certificate is verified against its CA file (a PEM bundle) alone, or against the
            Mozilla roots when it has none; where it asks for a client certificate (mutual
            TLS), it is shown the client certificate's chain, signed with the key (which may
            sit in the certificate's file: key file None).
        tally: where it counts each request (at its first token and its end) and writes its
            access-log row, as the Python path's sessions do (`GatewayMetrics.tally`).
        own_hosts: a keyless gateway's own host names (requests naming another Host, or
            carrying an Origin, go to the app's guard); None with API keys.
        write_timeout_ms: how long a client may take none of a reply written whole
            (`server.write_timeout_ms`) before its connection is dropped.
        sample_ratio: `telemetry.sample_ratio` while telemetry is on (None: off). Each request
            then gets a trace (a client's valid `traceparent` continued, its flag deciding the
            sampling; else a new trace sampled by its id as OpenTelemetry's
            `TraceIdRatioBased` samples it), vLLM gets its upstream span's `traceparent`, and
            its record the ids.

    Raises:
        InvalidArgumentError: `backends` are not the runtime's, `notify_fd` is negative,
            `sample_ratio` is not from 0 to 1, a CA file cannot be read or holds no
            certificate, a client certificate or key cannot be read or do not match, or the
            runtime already has native routes.
    """

    def __new__(
        cls,
        runtime: Runtime,
        relay: Relay,
        notify_fd: int,
        checks: FrontChecks,
        keys: FrontKeys,
        backends: list[tuple[str, str, bool, str | None, str | None, str | None]],
        *,
        tally: Tally,
        own_hosts: list[str] | None = None,
        write_timeout_ms: float = 60000.0,
        sample_ratio: float | None = None,
    ) -> NativeRoutes: ...
    def serve_on(self, front: Front) -> None:
        """Serve `front`'s governed routes natively from now on."""
    def take(self) -> tuple[list[Action], list[dict[str, Any]]]:
        """Empty the inbox: (actions of Python's requests that a native request's event
        caused, to carry out in order; the end records of the native requests Python has work
        with (its spans while telemetry is on, a prefill hop's warning), each a dict: `id`,
        `tenant`, `tier`, `arrived_us`, `started_us`, `first_token_us`, `ended_us`,
        `prompt_tokens`, `max_tokens`, `completion_tokens`, `end`, `error` ((status, code) or
        None), `retry_after_s`, `refused`, `truncated`, `upstream_aborted`, `backend`,
        `path`, `stream`, `model`, `queue_wait_us` and
        `brownout_max_tokens` (the runtime's `Start`'s, None before it), `prefill_unread`
        (the URL of a split request's prefill instance that answered no `kv_transfer_params`,
        else None), `trace` (None while
        telemetry is off, else a dict: `trace_id`, `span_id`, `queue_span_id`,
        `upstream_span_id`, `parent_span_id` (the client's, or None), `parent_flags`, `flags`
        (its spans': sampled, random trace id)))."""
    def streams(self) -> list[dict[str, Any]]:
        """The requests it serves now: `id`, `tenant`, `tier`, `arrived_us`, `backend` (None
        while queued), `streaming` (past its first token), oldest first."""
    @property
    def live(self) -> int:
        """Requests it serves now (arrived and not yet ended)."""

@final
class Tally:
    """The gateway's per-request counts and its access log, kept once for both paths: the
    native front counts its requests here itself (`NativeRoutes(tally=...)`), the Python
    path's sessions through these methods. Times are monotonic seconds (`time.monotonic()`,
    the runtime's clock); the access log writes them as Unix seconds.

    The counts are `/metrics`' per-request families (`families()`); the access log
    (`open_log`) has one CSV row per request (`llmflow.request_log.COLUMNS`, cells as
    `format_row` and `csv.writer` write them), written in one `write` when the request ends.
    """

    def __new__(cls) -> Tally: ...
    def open_log(self, path: str | os.PathLike[str], shadow: bool = False) -> None:
        """Append the access log's rows to `path` from now on (its folder made, the header
        written when the file is new; `shadow`: shadow mode's last column, `shadow`).

        Raises:
            OSError: the file cannot be created or opened.
        """
    def close_log(self) -> None:
        """Stop writing the access log, and close its file."""
    def first_token(self, tier: str, ttft_s: float) -> None:
        """A request's first token, `ttft_s` after it arrived (`llmflow_ttft_seconds`)."""
    def truncated(self, reason: str) -> None:
        """A reply cut with a visible notice (`llmflow_truncations`)."""
    def upstream_aborted(self, reason: str) -> None:
        """An upstream request closed before it finished (`llmflow_upstream_aborts`)."""
    def refused(
        self,
        request: str | None,
        tier: str,
        tenant: str,
        arrived_s: float,
        prompt_tokens: int,
        max_tokens: int | None,
        status: int,
        code: str,
        at_s: float | None = None,
    ) -> None:
        """A request refused as it arrived: counted `rejected` with its code, and logged
        (`request`: its X-Request-Id; `at_s`: when it was answered, None: now)."""
    def ended(
        self,
        request: str | None,
        tier: str,
        tenant: str,
        arrived_s: float,
        *,
        queue_wait_s: float | None,
        first_token_s: float | None,
        ended_s: float | None,
        prompt_tokens: int,
        max_tokens: int | None,
        completion_tokens: int,
        end: str,
        error_status: int | None,
        backend: str | None,
        shadow: str | None,
    ) -> None:
        """A request that ended: counted by its outcome (`end`, the runtime's word, mapped as
        the core maps it) and reason, its tokens, its queue wait (`queue_wait_s`: None when it
        never started), its duration when completed; and logged (`error_status`: the status of
        the error it was answered with; `shadow`: the verdict's summary in shadow mode;
        `ended_s` None: now)."""
    def families(self) -> dict[str, list[tuple[Any, ...]]]:
        """The per-request families as they stand, each label set in first-counted order:
        `requests` (tier, outcome, reason, value, created); `ttft`, `e2e`, `queue_wait`
        (tier, per-bucket counts with +Inf's last, sum, created); `tokens` (tier, value,
        created), `truncations` and `aborts` (reason, value, created). `created`: Unix
        seconds of its first count."""
    @staticmethod
    def bounds() -> tuple[list[float], list[float]]:
        """The bucket bounds: TTFT's and the queue wait's, then end to end's."""

def request_outcome(
    end: str, error_status: int | None, completion_tokens: int
) -> tuple[str, str | None]:
    """A request's outcome in the simulator's words (`completed`, `rejected`, `timed_out`,
    `truncated`, `cancelled`, `failed`) and its reason (None when completed), from how it ended
    (`end`), the status of the error it was answered with, and the tokens it was sent."""

def shadow_summary(decision: str, queued_first: bool, reason: str | None, started: bool) -> str:
    """A shadow verdict as the access log's `shadow` cell (`queue>start`, `refuse:queue_full`,
    `start>cut:deadline`...)."""

# ---- the native front's pure checks (a test seam: tests hold each against Python's own) ----

@final
class FrontPrepared:
    """A request the native front would serve: every value of Python's `Prepared` and its
    `ClientOptions` but the identity and the signals."""

    @property
    def endpoint(self) -> Literal["chat", "completions"]: ...
    @property
    def path(self) -> str:
        """The path vLLM serves it on."""
    @property
    def asked_model(self) -> str:
        """The model the client named (`ClientOptions.model`)."""
    @property
    def model(self) -> str:
        """The served model it routes to (an alias resolved)."""
    @property
    def stream(self) -> bool: ...
    @property
    def choices(self) -> int:
        """`n` for each prompt of a batch (`ClientOptions.n`)."""
    @property
    def include_usage(self) -> bool: ...
    @property
    def continuous_usage(self) -> bool: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def planned_tokens(self) -> int:
        """What the batch may generate at its peak (`Prepared.max_tokens`)."""
    @property
    def max_tokens(self) -> int | None:
        """The request's output bound after the gateway's cap (`limits.max_tokens`)."""
    @property
    def prefix_hashes(self) -> list[int] | None: ...
    @property
    def fingerprint(self) -> int: ...
    @property
    def unstreamed(self) -> bool: ...
    @property
    def body(self) -> bytes:
        """The body vLLM gets, as `json.dumps(prepared.body).encode()` writes Python's."""
    def upstream_body(self, priority: int | None = None, max_tokens: int | None = None) -> bytes:
        """`session.upstream_body`'s bytes: with the core's priority and brownout bound."""

@final
class FrontChecks:
    """`CompletionService.prepare`'s checks in Rust, with the service's arguments.

    Args:
        models: served model name (and alias) -> context length.
        bytes_per_token: UTF-8 bytes per token of the prompt estimate.
        streaming: `streaming.enabled`.
        max_messages: `limits.max_messages`.
        max_n: `limits.max_n`.
        max_tokens: `limits.max_tokens`.
        fingerprint_key: the body fingerprint's BLAKE2b key (64 bytes at most).
        aliases: alias -> served model.
        prefix_models: served models whose pool routes by prefix.
        block_size: tokens per KV block.

    Raises:
        InvalidArgumentError: `bytes_per_token` not above 0, or the key too long.
    """

    def __new__(
        cls,
        models: Mapping[str, int],
        bytes_per_token: float,
        streaming: bool,
        max_messages: int,
        max_n: int,
        max_tokens: int | None,
        fingerprint_key: bytes,
        *,
        aliases: Mapping[str, str],
        prefix_models: set[str] | frozenset[str],
        block_size: int,
    ) -> FrontChecks: ...
    def prepare(
        self, endpoint_name: Literal["chat", "completions", "responses"], raw: bytes
    ) -> FrontPrepared | None:
        """The request's values, or None where Python's `prepare` (`prepare_response`) would
        refuse it.

        Raises:
            InvalidArgumentError: an endpoint other than chat, completions or responses.
        """
    def refusal(
        self,
        endpoint_name: Literal["chat", "completions", "responses"],
        raw: bytes,
        default_headers: list[tuple[bytes, bytes]],
        keep_alive: bool,
    ) -> bytes | None:
        """The error the native front answers a body with, as it goes on the wire: Python's
        `prepare` refuses the body so (`GatewayError.response()` as uvicorn writes it).

        Args:
            endpoint_name: `"chat"`, `"completions"` or `"responses"`.
            raw: the request body.
            default_headers: the server's own headers (`date`, `server`), in order.
            keep_alive: whether the connection goes on after it.

        Returns:
            The response's bytes, or None: the front serves the body.

        Raises:
            InvalidArgumentError: an endpoint other than chat, completions or responses.
        """

@final
class FrontKeys:
    """`KeyRing.authenticate`'s checks in Rust.

    Args:
        enabled: whether API keys are configured.
        anonymous: (tenant, tier) of every caller when they are not.
        max_bytes: `limits.max_api_key_bytes`.
        keys: (the key's UTF-8 bytes, tenant, tier) of each configured key.
    """

    def __new__(
        cls,
        enabled: bool,
        anonymous: tuple[str, str],
        max_bytes: int,
        keys: list[tuple[bytes, str, str]],
    ) -> FrontKeys: ...
    def authenticate(self, authorization: bytes | None) -> tuple[str, str] | None:
        """(tenant, tier) of an `Authorization` header's raw value, or None (Python's 401)."""
    def refusal(
        self,
        authorization: bytes | None,
        default_headers: list[tuple[bytes, bytes]],
        keep_alive: bool,
    ) -> bytes | None:
        """The 401 the native front answers for this header, as it goes on the wire.

        Args:
            authorization: the header's raw value, or None when absent.
            default_headers: the server's own headers (`date`, `server`), in order.
            keep_alive: whether the connection goes on after it.

        Returns:
            The response's bytes, or None when the key opens a tenant.
        """

def front_signals(headers: list[tuple[bytes, bytes]]) -> tuple[int | None, int | None] | None:
    """`read_signals` in Rust: (retries, deadline_ms), or None where Python answers 400."""

def front_foreign_request(
    host: bytes | None, origin: bytes | None, allowed: frozenset[str] | set[str]
) -> str | None:
    """Why a keyless gateway refuses a request with this Host and Origin, or None.

    The rule of `HostGuard` and of the native front (`front/origin.rs`), in one place.

    Args:
        host: the first `host` header's raw value, if any.
        origin: the first `origin` header's raw value, if any.
        allowed: the gateway's own host names, lower-cased (`allowed_host_names`).

    Returns:
        The 403's message, or None when the request may be answered.
    """

def front_traceparent(header: bytes) -> tuple[int, int, int] | None:
    """A client's `traceparent` as the native front reads it: (trace_id, span_id, flags), or
    None where it starts a trace of its own (where OpenTelemetry's propagator extracts
    nothing)."""

def front_trace_sampled(trace_id: int, sample_ratio: float) -> bool:
    """Whether the native front samples a trace it starts with this id at this ratio (as
    OpenTelemetry's `TraceIdRatioBased`)."""

def front_refusal_bytes(
    reason: str,
    status: int,
    retry_after_s: int | None,
    request_id: int,
    default_headers: list[tuple[bytes, bytes]],
    keep_alive: bool,
    upstream: tuple[int, str, str, str | None] | None = None,
) -> bytes:
    """A runtime refusal's bytes on the wire, as uvicorn writes `reply_error(...).response()`
    (`tests/gateway/test_front_replies.py`); `upstream`: (status, code, message, vLLM's error
    JSON) of a backend's failure."""

def front_cut_frame(
    endpoint_name: Literal["chat", "completions"],
    model: str,
    template: str | None,
    open_choices: list[int],
    reason: str,
    request_id: int,
    now_s: int,
) -> bytes:
    """`encode_event(tail_chunk(...))`: the frame that ends a reply the runtime cut.

    Raises:
        InvalidArgumentError: an endpoint other than chat or completions.
    """

def front_in_band_error(error: str | None, message: str, code: str) -> bytes:
    """`encode_event({"error": in_band_error(...)})`: vLLM's error object, else ours."""

def front_cut_names_itself(reason: str) -> bool:
    """Whether a reply cut for `reason` names it in `x-llmflow-reason`, as the front decides
    (`contract.REFUSALS[reason].cut` on the Python side)."""

def front_merge_frames(frames: list[bytes]) -> list[bytes]:
    """The relay's coalescing of the frames waiting for the flush interval: as
    `[encode_item(c) for c in merge_chunks(items)]` writes them."""

def front_stream_frames(
    endpoint_name: Literal["chat", "completions"],
    model: str,
    payloads: list[bytes],
    now_s: int,
    include_usage: bool,
    continuous_usage: bool,
    n: int,
    cut: tuple[str, int] | None = None,
) -> bytes | str:
    """What the relay writes to a streaming client for an upstream stream's `data:` payloads,
    before any coalescing: each payload's frames, then the finishing chunks still held (at
    `[DONE]`), or the frames of a cut after the payloads (the held chunks, the notice naming
    the choices still open); or the failure's message at the first payload that fails it.

    Args:
        endpoint_name: the route.
        model: the model the client named.
        payloads: the stream's payloads, in order.
        now_s: the clock's whole seconds (the `created` of a notice no chunk named).
        include_usage: the client asked for `stream_options.include_usage`.
        continuous_usage: the client asked for `stream_options.continuous_usage_stats`.
        n: the choices asked for (`ClientOptions.n`).
        cut: `(reason, request_id)` of a cut after the payloads.

    Raises:
        InvalidArgumentError: an endpoint other than chat or completions.
    """

def front_whole_reply(
    endpoint_name: Literal["chat", "completions"],
    model: str,
    payloads: list[bytes],
    now_s: int,
    cut: tuple[str, int] | None = None,
    n: int = 1,
) -> bytes | str:
    """A non-streamed reply assembled from an upstream stream's `data:` payloads, as the
    native front assembles it: the body `JSONResponse(Accumulator.response(usage))` renders,
    or the failure's message at the first payload it does not take.

    Args:
        endpoint_name: the route.
        model: the model the client named.
        payloads: the stream's payloads, in order.
        now_s: the clock's whole seconds (the `created` of a reply no chunk named).
        cut: `(reason, request_id)` of a cut after the payloads.
        n: the choices asked for (`ClientOptions.n`).

    Raises:
        InvalidArgumentError: an endpoint other than chat or completions.
    """
