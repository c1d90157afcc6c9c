"""The llmflow YAML config: one file whose sections mirror the seed's, validated with clear errors.

Defaults are the seed's values (`max_waiting: 200`, `client_window: 8`,
`first_token_timeout_ms: 3000`, `sse_flush_interval: 20ms`, 80% queue fill for normal traffic,
1.5 s TTFT SLA), except two. The seed's fixed 16 per GPU is `seed-gate`'s; here 256 per GPU
(vLLM's default `max_num_seqs`) is only the bound, within which the number running follows the
engine's KV capacity (`kv.fit_target`) and batch borrows what the latency tiers' headroom
leaves. And the KV pressure line is 95%, not 85%: the KV fit keeps the expected peak within the
cache, and the line is its safety net. `Settings.to_core()` turns a validated file into the
mapping `llmflow._core.Governor` takes, so the gateway and the simulator build the very same
policy from the same file.

Pydantic checks the file's shape: types, unknown keys, units such as `20ms`, and the rules of the
keys only the gateway reads (`server`, `limits`, `admin`, `state`, `telemetry`, API keys). Every
value the core is built from is checked by the core alone (`llmflow._core.config_problem`, the
checks `Runtime` makes), and its message is reported at the file's own key: one validator, so the
two sides cannot disagree on what a valid file is.
"""

from __future__ import annotations

import os
import re
import ssl
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from llmflow._core import config_problem
from llmflow.config_paths import (
    CORE_KNOBS,
    CORE_SIGNALS,
    CORE_SIZES,
    LIFECYCLE,
    core_error,
    value_at,
)

__all__ = ["ConfigFileError", "Settings", "load_settings", "parse_duration_ms"]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s|m|h)?\s*$")
_UNIT_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0, "h": 3_600_000.0}


class ConfigFileError(ValueError):
    """A config file could not be read or does not validate; the message lists every problem."""


def parse_duration_ms(value: Any) -> Any:
    """Accept `20ms`, `1.5s`, `2m` or a bare number of milliseconds; `None` stays `None`."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and (match := _DURATION.match(value)):
        return float(match.group(1)) * _UNIT_MS[match.group(2) or "ms"]
    raise ValueError(f"expected a duration such as '20ms', '1.5s' or a number of ms, got {value!r}")


DurationMs = Annotated[float, BeforeValidator(parse_duration_ms), Field(ge=0)]
# The shapes of what the core reads: its durations (their range is the core's to check), and
# its unsigned integer types (the range a JSON number must have to be read at all).
CoreMs = Annotated[float, BeforeValidator(parse_duration_ms)]
U32 = Annotated[int, Field(ge=0, le=2**32 - 1)]
U64 = Annotated[int, Field(ge=0, le=2**64 - 1)]


class _Section(BaseModel):
    # Infinities and NaN are no JSON numbers: the core could not read them.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Streaming(_Section):
    enabled: bool = True
    first_token_timeout_ms: CoreMs | None = 3000.0
    sse_flush_interval: DurationMs = 20.0  # 0 forwards every chunk as soon as it arrives
    on_first_token_timeout: Literal["error", "degrade"] = "degrade"


class Backpressure(_Section):
    client_window: int = Field(8, ge=1, le=4096)  # unacknowledged chunks per client
    pause_when_full: bool = True
    stall_timeout_ms: CoreMs = 30_000.0  # a client stalled this long loses its slot


class Queue(_Section):
    max_waiting: U32 = 200
    strategy: Literal["fair", "fifo"] = "fair"
    max_wait_ms: CoreMs | None = 30_000.0
    # A latency tier may also hold what it is measured to drain within `max_wait_ms` (those
    # requests are served before their queue deadline): the places absorb a burst. False:
    # `max_waiting` is a hard bound on the queue.
    follow_drain: bool = True


class Gate(_Section):
    # The bound on requests running per GPU. Within it the number running follows the engine:
    # requests start while the KV they are expected to reach fits (`kv.fit_target`).
    max_concurrency_per_gpu: U32 = 256
    queue: Queue = Queue()
    on_queue_full: Literal["reject_429"] = "reject_429"
    # Slots kept free for the latency tiers, sized online by Erlang C from their measured
    # arrival rate and hold time: an arrival finds a slot within `headroom_wait_ms` with this
    # probability. Best-effort tiers borrow every other slot. None: no headroom.
    headroom_quantile: float | None = 0.999
    headroom_wait_ms: CoreMs = 500.0
    # per-token latency target: a backend whose measured time per output token is above it
    # runs fewer requests (down to one), more again once well below; None: the bound alone
    tpot_target_ms: CoreMs | None = None
    # `shadow`: forward every request as `direct` would (no cap, queue, refusal or cut) while
    # the runtime decides as usual and records what it would have done (docs/gateway.md)
    mode: Literal["enforce", "shadow"] = "enforce"


class Tier(_Section):
    name: str
    shed_at: float = 1.0  # queue fill above which this tier is refused
    max_share: float = 1.0  # share of each backend's slots this tier may hold
    protected: bool = False  # exempt from KV-pressure and preemption shedding (VIP)
    # no latency objective (batch): never refused for the TTFT SLA; borrows idle slots only
    best_effort: bool = False
    # brownout before refusal: from this queue fill on, max_tokens is clamped (null: never)
    brownout_at: float = 1.0
    brownout_max_tokens: U64 | None = None


class Tenant(_Section):
    name: str
    tier: str
    weight: float = 1.0
    api_keys: list[str] = []
    # rate limits, enforced by the core as token buckets (None: unlimited); refusals are 429
    # rate_limited with the exact Retry-After
    requests_per_s: float | None = None
    tokens_per_min: float | None = None  # prompt + output tokens


class Timeouts(_Section):
    total_ms: CoreMs | None = 120_000.0  # total deadline; the partial text is returned


class Kv(_Section):
    pressure_threshold: float | None = 0.95
    block_size: U32 = 16
    input_token_weight: float = 1.0
    output_token_weight: float = 2.0
    kv_weight: float = 1.0  # how much a long request's KV footprint lowers it
    # share of a backend's KV the running requests may be expected to fill at their peak
    # (prompt + the tenant's measured output, max_tokens until measured); None: prompt only
    fit_target: float | None = 1.0


class Sla(_Section):
    # Refuse a request whose prefill work ahead exceeds this, while its tier is in a sustained
    # overload (arrivals over the last minute above its drain); a burst is left to the queue.
    ttft_ms: CoreMs | None = 1500.0
    prefill_tokens_per_s: float = 8000.0  # prior until measured online
    # A queued request past ttft_ms, or a client's retry of a request refused longer ago than
    # that (known by its body), waits behind every request of its tier that can still be on
    # time, in the order its client first came, in an overload the queue cannot hold. False:
    # one queue, in arrival order, and a retry is a new arrival.
    late_requests_yield: bool = True


class Signals(_Section):
    # What clients say about a request in its headers (docs/gateway.md, "Client signals"): a
    # retry (x-stainless-retry-count, x-envoy-attempt-count) is judged from its first arrival;
    # a deadline (x-llmflow-deadline-ms, x-stainless-timeout) the queue cannot meet is refused
    # at once (429 client_deadline), and a queued request leaves when it passes. A deadline
    # only shortens a wait: max_wait_ms and every timeout still hold.
    retry_headers: bool = True
    max_retry_count: int = Field(10, ge=0)  # a client claiming more retries is not believed
    deadline_headers: bool = True
    min_deadline_ms: DurationMs = Field(1000.0, gt=0)  # a shorter client deadline counts as this


class Preemption(_Section):
    cooldown_ms: CoreMs | None = 10_000.0  # None disables the breaker


class Metrics(_Section):
    scrape_interval_ms: DurationMs = 500.0
    stale_after_ms: CoreMs | None = 3000.0


class Backend(_Section):
    name: str
    url: str | None = None  # None: the built-in simulated vLLM
    gpus: U32 = 1
    models: list[str] = Field(default_factory=lambda: ["llmflow-sim"], min_length=1)
    max_model_len: int = Field(8192, ge=1)
    kv_blocks: U64 = 0  # 0: learn it from vLLM's cache_config_info
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # prefill/decode disaggregation (experimental): a model's backends are all `both`, or split
    # into `prefill` and `decode` instances behind a KV connector (docs/gateway.md)
    role: Literal["both", "prefill", "decode"] = "both"
    # embeddings, rerank, score, tokenize, audio in flight at once (the light lane's cap)
    light_concurrency: int = Field(16, ge=1)
    # An https backend's private CA: a PEM bundle, the only roots its certificate may chain to
    # (both paths, scrapes included); None: the Mozilla roots (certifi's, webpki-roots').
    tls_ca_file: str | None = None
    # Mutual TLS: the certificate (PEM, the gateway's own first, then its chain) and private
    # key the gateway shows an https backend that asks for one; the key may sit in the
    # certificate's file (tls_client_key left out).
    tls_client_cert: str | None = None
    tls_client_key: str | None = None

    @field_validator("tls_ca_file")
    @classmethod
    def _check_ca_file(cls, path: str | None, info: ValidationInfo) -> str | None:
        if path is None:
            return None
        _https_only(info, "a CA file")
        try:
            ssl.create_default_context(cafile=path)
        except ssl.SSLError:
            raise ValueError("the file holds no PEM certificate") from None
        except OSError as exc:
            raise ValueError(f"the file cannot be read ({exc.strerror})") from None
        return path

    @field_validator("tls_client_cert")
    @classmethod
    def _check_client_cert(cls, path: str | None, info: ValidationInfo) -> str | None:
        if path is not None:
            _https_only(info, "a client certificate")
        return path

    @model_validator(mode="after")
    def _check_client_key(self) -> Backend:
        cert, key = self.tls_client_cert, self.tls_client_key
        if key is not None and cert is None:
            raise ValueError(
                f"backend {self.name!r}: tls_client_key is the key of tls_client_cert; "
                "set tls_client_cert too"
            )
        if cert is None:
            return self
        for field, path in (("tls_client_cert", cert), ("tls_client_key", key)):
            try:
                if path is not None:
                    Path(path).read_bytes()
            except OSError as exc:
                raise ValueError(
                    f"backend {self.name!r}: {field} {path} cannot be read ({exc.strerror})"
                ) from None
        try:
            ssl.create_default_context().load_cert_chain(cert, key)
        except ssl.SSLError as exc:
            raise ValueError(
                f"backend {self.name!r}: tls_client_cert and tls_client_key must be a PEM "
                f"certificate and its own private key ({exc.reason or exc})"
            ) from None
        return self



def _https_only(info: ValidationInfo, what: str) -> None:
    url = info.data.get("url")
    if not (isinstance(url, str) and url.startswith("https://")):
        raise ValueError(f"{what} is for an https:// backend; its url is {url!r}")

class Server(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    drain_timeout_ms: CoreMs = 30_000.0  # shutdown: how long live requests may finish
    # How long a client may take to send a request's head and body (slowloris): 408, closed.
    read_timeout_ms: DurationMs = Field(30_000.0, gt=0)
    # How long a client may take nothing of what is written to it before its connection is
    # aborted (a reader that never reads holds no fd, buffer or light-lane slot past it); the
    # runtime's stall timer (backpressure.stall_timeout_ms) cuts a governed stream first.
    write_timeout_ms: DurationMs = Field(60_000.0, gt=0)
    bytes_per_token: float = Field(4.0, gt=0)  # prompt-length estimate for text (no tokenizer)
    # Threads of the front door and the relay (`llmflow serve --workers`); None: one per CPU
    # this process may run on (`threads`). The runtime stays one, whatever the count.
    workers: int | None = Field(None, ge=1, le=64)
    # one CSV row per request at its end, in the simulator's `--requests-out` columns
    access_log: str | None = None
    # The largest SSE event a backend may send (an `echo` with `logprobs` can be large); past
    # it the stream fails with a 502 and no more than this was held (relay and Python path).
    max_event_bytes: int = Field(16 * 1024 * 1024, ge=64 * 1024)
    # A WebSocket with no request live that sends nothing this long is closed (code 1000).
    ws_idle_timeout_ms: DurationMs = Field(300_000.0, gt=0)
    # Host names a keyless gateway answers besides IP literals, `localhost` and `host`: any
    # other Host (DNS rebinding) or a cross-origin Origin gets 403 (docs/reliability.md).
    allowed_hosts: list[str] = []

    @property
    def threads(self) -> int:
        """`workers`, or the CPUs this process may run on (its affinity mask), at most 64."""
        return self.workers or min(len(os.sched_getaffinity(0)), 64)


class Telemetry(_Section):
    """OpenTelemetry traces over OTLP/HTTP (`pip install 'llmflow[otel]'`): a span per governed
    request with the runtime's decision, and W3C `traceparent` carried to vLLM. Off while
    `otlp_endpoint` is unset."""

    otlp_endpoint: str | None = None  # http://collector:4318 (`/v1/traces` added if missing)
    service_name: str = Field("llmflow", min_length=1)
    sample_ratio: Annotated[float, Field(ge=0, le=1)] = 1.0  # of traces the gateway starts

    @model_validator(mode="after")
    def _check_endpoint(self) -> Telemetry:
        scheme = (self.otlp_endpoint or "http://").partition("://")[0]
        if scheme not in ("http", "https"):
            raise ValueError(
                "telemetry.otlp_endpoint: expected an OTLP/HTTP URL such as "
                "http://collector:4318"
            )
        return self


class Limits(_Section):
    """Bounds on what one request may ask for; each is refused with a 4xx saying which to change.

    The body size is `server.max_body_bytes`; the prompt is checked against each model's
    `max_model_len`.
    """

    max_messages: int = Field(2048, ge=1)  # chat messages in one request
    max_n: int = Field(128, ge=1)  # choices in one request (`n`)
    max_tokens: int | None = Field(None, ge=1)  # None: the model's context is the only bound
    max_header_bytes: int = Field(32 * 1024, ge=4096)  # request line plus headers (431 past it)
    max_api_key_bytes: int = Field(256, ge=16)  # longer keys are refused before they are hashed


class Admin(_Section):
    """Where `/api/state`, `/dashboard` and `/metrics` are served, and the key they need.

    With no `port` they stay on the main listener (open unless `api_key` is set); with a `port`
    they move to a listener of their own on `host`, and `api_key` is required.
    """

    host: str = "127.0.0.1"
    port: int | None = Field(None, ge=0, le=65535)
    api_key: str | None = Field(None, min_length=16, repr=False)


class State(_Section):
    """Where admission state lives: in this process (the default), or in Redis, shared by
    gateway replicas (see `docs/scale.md`)."""

    backend: Literal["memory", "redis"] = "memory"
    url: str | None = Field(None, repr=False)  # redis://[:password@]host:port/db
    # Redis unreachable: refuse (no request starts without a lease; they queue, then get a
    # Retry-After), or run on cap / replicas of each backend, unleased, until it is back
    on_loss: Literal["fail_closed", "local_share"] = "fail_closed"
    lease_ttl_ms: DurationMs = Field(10_000.0, gt=0)  # a killed replica's slots return within
    sync_interval_ms: DurationMs = Field(100.0, gt=0)  # renew leases, read the global count
    replicas: int = Field(1, ge=1)  # gateway replicas: local_share's divisor
    key_prefix: str = Field("llmflow", min_length=1)

    @model_validator(mode="after")
    def _check_url(self) -> State:
        if self.backend == "redis":
            scheme = (self.url or "").partition("://")[0]
            if scheme not in ("redis", "rediss", "unix"):
                raise ValueError("state.url: backend redis needs a URL such as redis://host:6379/0")
        return self


RoutePolicy = Literal["free_slots", "round_robin", "least_loaded", "prefix"]


class Routing(_Section):
    """How a model's pool picks among the backends that serve it (see `docs/gateway.md`).

    `free_slots` (the default: the rule before pools existed) takes the backend with the most
    free slots; `round_robin` takes each in turn; `least_loaded` ranks by headroom (free slots,
    free KV blocks, the prefill work queued ahead at the measured rate); `prefix` prefers the
    backend that most likely caches the prompt's leading blocks until it is loaded to
    `prefix_load_bound` (running / slots), then falls back to `least_loaded`.
    """

    policy: RoutePolicy = "free_slots"
    pools: dict[str, RoutePolicy] = {}  # served model name -> its own policy
    prefix_load_bound: float = 0.9
    prefix_memory_blocks: U64 = 65_536  # per backend, when its KV size is unknown


_DEFAULT_TIERS = (
    Tier(name="vip", shed_at=1.0, protected=True),
    Tier(name="normal", shed_at=0.8),
    Tier(name="batch", shed_at=0.5, best_effort=True),
)


class Settings(_Section):
    """The whole config file. Every section is optional; omitted keys take the seed's values."""

    streaming: Streaming = Streaming()
    backpressure: Backpressure = Backpressure()
    gate: Gate = Gate()
    tiers: list[Tier] = Field(default_factory=lambda: list(_DEFAULT_TIERS))
    default_tier: str = "normal"
    tenants: list[Tenant] = []
    timeouts: Timeouts = Timeouts()
    kv: Kv = Kv()
    sla: Sla = Sla()
    signals: Signals = Signals()
    preemption: Preemption = Preemption()
    metrics: Metrics = Metrics()
    backends: list[Backend] = Field(default_factory=lambda: [Backend(name="sim0")])
    server: Server = Server()
    limits: Limits = Limits()
    admin: Admin = Admin()
    state: State = State()
    models: dict[str, str] = {}  # alias -> the served model (a backend's `models`) it routes to
    routing: Routing = Routing()
    telemetry: Telemetry = Telemetry()

    @model_validator(mode="after")
    def _check(self) -> Settings:
        problem = config_problem(self.to_runtime())  # the core's checks, first
        if problem is not None:
            raise core_error(self, *problem)
        # `default_tier` is the file's own key: the core sees it as the tier of the anonymous
        # tenant `to_core` adds, which a file that declares `anonymous` replaces.
        tier_names = [t.name for t in self.tiers]
        if self.default_tier not in tier_names:
            raise ValueError(f"default_tier {self.default_tier!r} is not one of {tier_names}")
        _check_keys(self)
        _check_shadow(self)
        return self

    @property
    def anonymous_tenant(self) -> str:
        """Tenant every request maps to when no API keys are configured."""
        return "anonymous"

    @property
    def auth_enabled(self) -> bool:
        """True when at least one tenant has an API key: requests must then present one."""
        return any(t.api_keys for t in self.tenants)

    def to_core(self) -> dict[str, Any]:
        """The mapping `llmflow._core.Governor` takes (its keys are the core's own names).

        Rate limits go to the core whole: with shared state the replicas exchange what each
        let a tenant use, and every replica's buckets pay for all of it (`docs/scale.md`).
        """
        tenants = [
            {"name": t.name, "tier": t.tier, "weight": t.weight}
            | ({"requests_per_s": t.requests_per_s} if t.requests_per_s is not None else {})
            | ({"tokens_per_min": t.tokens_per_min} if t.tokens_per_min is not None else {})
            for t in self.tenants
        ]
        if self.anonymous_tenant not in {t.name for t in self.tenants}:
            anonymous = {"name": self.anonymous_tenant, "tier": self.default_tier, "weight": 1.0}
            tenants.append(anonymous)
        return {
            "backends": [
                {"name": b.name, "gpus": b.gpus, "kv_blocks": b.kv_blocks, "models": b.models,
                 "role": b.role}
                for b in self.backends
            ],
            "models": dict(self.models),
            "routing": self.routing.model_dump(),
            **{key: value_at(self, path) for key, path in CORE_SIZES.items()},
            "tiers": [t.model_dump() for t in self.tiers],
            "tenants": tenants,
            **{key: value_at(self, path) for key, path in CORE_KNOBS.items()},
            "signals": {key: value_at(self, path) for key, path in CORE_SIGNALS.items()},
        }

    def to_runtime(self) -> dict[str, Any]:
        """The mapping `llmflow._core.Runtime` takes: the policy and the lifecycle around it
        (with `state.backend: redis`, slots leased from the shared store)."""
        lifecycle: dict[str, Any] = {key: value_at(self, path) for key, path in LIFECYCLE.items()}
        lifecycle["first_token_error"] = self.streaming.on_first_token_timeout == "error"
        if self.state.backend == "redis":
            lifecycle["leases"] = {"on_loss": self.state.on_loss, "replicas": self.state.replicas}
        return {"policy": self.to_core(), "lifecycle": lifecycle}


def _check_keys(settings: Settings) -> None:
    # Messages name tenants, never a key: config errors end up in logs.
    seen: dict[str, str] = {}
    limit = settings.limits.max_api_key_bytes
    for tenant in settings.tenants:
        for key in tenant.api_keys:
            if not key.strip() or len(key.encode("utf-8")) > limit:
                raise ValueError(
                    f"tenants[{tenant.name}].api_keys: every key must be 1 to {limit} bytes "
                    "(limits.max_api_key_bytes) and not blank"
                )
            if key in seen:
                raise ValueError(
                    f"api_keys must be unique: tenants {seen[key]!r} and {tenant.name!r} "
                    "share a key"
                )
            seen[key] = tenant.name
    admin = settings.admin
    if admin.port is not None and admin.api_key is None:
        raise ValueError(
            "admin.port is set but admin.api_key is not: the admin listener needs a key "
            "(at least 16 characters)"
        )
    if admin.api_key is not None and admin.api_key in seen:
        raise ValueError(
            f"admin.api_key is also an API key of tenant {seen[admin.api_key]!r}; use another"
        )


def _check_shadow(settings: Settings) -> None:
    if settings.gate.mode != "shadow":
        return
    if settings.state.backend != "memory":
        raise ValueError(
            "gate.mode: shadow runs on one gateway alone; remove the `state` section (Redis "
            "replicas) or use gate.mode: enforce"
        )
    split = [b.name for b in settings.backends if b.role != "both"]
    if split:
        raise ValueError(
            f"gate.mode: shadow forwards as `direct`, which has no prefill/decode proxy; "
            f"backends {split} have a role: use gate.mode: enforce on a split pool"
        )


def load_settings(path: str | Path | None = None, data: dict[str, Any] | None = None) -> Settings:
    """Read and validate a YAML config file (or an already-parsed mapping).

    Args:
        path: YAML file; `None` with no `data` gives the defaults.
        data: a parsed mapping, used instead of `path`.

    Returns:
        The validated settings.

    Raises:
        ConfigFileError: the file is missing, is not YAML, or a key is wrong; the message names
            each bad key, its value and what is allowed.
    """
    if data is None and path is not None:
        data = _read_yaml(Path(path))
    try:
        return Settings.model_validate(data or {})
    except ValidationError as exc:
        raise ConfigFileError(_describe(exc, path, _secrets_in(data or {}))) from None


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigFileError(f"{path}: cannot read config file ({exc.strerror})") from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"{path}: not valid YAML: {exc}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigFileError(f"{path}: the top level must be a mapping of sections")
    return loaded


def _secrets_in(data: dict[str, Any]) -> list[str]:
    # Every string that may be an API key, however malformed the file: the admin key, and any
    # string under `tenants` but a tenant's name or tier. No error message may quote one.
    found: list[str] = []
    admin = data.get("admin")
    if isinstance(admin, dict) and isinstance(admin.get("api_key"), str):
        found.append(admin["api_key"])
    stack: list[Any] = [data.get("tenants")]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, dict):
            stack.extend(v for k, v in item.items() if k not in ("name", "tier"))
        elif isinstance(item, list):
            stack.extend(item)
    return [repr(k)[1:-1] for k in found if k]  # as they would appear inside a repr


def _describe(exc: ValidationError, path: str | Path | None, secrets: list[str]) -> str:
    where = f"{path}: " if path else ""
    lines = [f"{where}invalid config ({exc.error_count()} problem(s)):"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(top level)"
        got = "" if err["type"] == "missing" else f" (got {err.get('input')!r})"
        if not err["loc"] or any(secret in got for secret in secrets):
            got = ""  # the whole file, or a value holding an API key
        elif err["type"] == "core_config" and (
            "got " in err["msg"] or not isinstance(err.get("input"), str | int | float)
        ):
            got = ""  # the core's message quotes the value, or it is a section's (a repeat)
        message = (
            "unknown key; remove it or check its spelling"
            if err["type"] == ("extra_forbidden")
            else err["msg"]
        )
        lines.append(f"  {key}: {message}{got}")
    return "\n".join(lines)
