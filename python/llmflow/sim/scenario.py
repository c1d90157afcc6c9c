"""Scenario files: the YAML schema of a simulated cluster, its workload and the policies compared.

A scenario names the backends (GPU and model presets, vLLM flags), the workload classes (tenant,
tier, arrival process, length distributions, client behaviour, SLO) and the policies to run. The
gated policies carry an llmflow config (the same YAML sections the gateway reads); the simulator
fills in `backends` and `tenants` from the cluster and the workload. See docs/simulator.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from llmflow.presets import GIB, GpuSpec, ModelSpec, gpu, model, model_from_hf_config

__all__ = [
    "Arrival", "BackendGroup", "ClientSpec", "Dist", "GpuMapping", "Link", "PolicySpec", "Retry",
    "Scenario",
    "ScenarioError", "Slo", "WorkloadClass", "all_scenarios", "find_scenario", "load_scenario",
    "search_roots",
]


# The trace formats of `llmflow.sim.traces.FORMATS`.
TraceFormat = Literal["csv", "mooncake", "vllm-bench", "burstgpt", "requests"]


class ScenarioError(ValueError):
    """A scenario file is missing, is not YAML or does not validate."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Dist(_Model):
    """A token-length distribution; values are rounded and clipped to `[min, max]`."""

    kind: Literal["fixed", "uniform", "lognormal", "exponential", "empirical"]
    value: int | None = None  # fixed
    low: int | None = None  # uniform, inclusive
    high: int | None = None
    median: float | None = None  # lognormal
    sigma: float | None = None
    mean: float | None = None  # exponential (rounded up: a geometric number of tokens)
    path: str | None = None  # empirical: a trace file, relative to the scenario file
    column: str | None = None  # its column (`prompt`, `output`, or the file's own name)
    format: TraceFormat | None = None  # the trace's format; None: from the file
    min: int = 1
    max: int = 1_000_000

    @model_validator(mode="after")
    def _check(self) -> Dist:
        need = {
            "fixed": ("value",), "uniform": ("low", "high"), "lognormal": ("median", "sigma"),
            "exponential": ("mean",), "empirical": ("path", "column"),
        }[self.kind]
        missing = [k for k in need if getattr(self, k) is None]
        if missing:
            raise ValueError(f"a {self.kind} distribution needs {missing}")
        return self


class Arrival(_Model):
    """When requests of a class arrive.

    `poisson`: rate_per_s between start_s and stop_s; `burst`: count requests at at_s, spread
    evenly over over_s; `onoff`: Poisson at rate_per_s during on_s, silent during off_s;
    `trace`: timestamps (and lengths) from a trace file (`llmflow.sim.traces`: Azure CSV,
    Mooncake JSONL, vLLM bench JSON, BurstGPT CSV, llmflow's per-request rows); a trace
    without times (vLLM bench without `start_times`) arrives as Poisson at `rate_per_s` or
    at the rate its file records.
    """

    kind: Literal["poisson", "burst", "onoff", "trace"]
    rate_per_s: float | None = Field(None, gt=0)
    start_s: float = Field(0.0, ge=0)
    stop_s: float | None = None  # default: the scenario's duration_s
    at_s: float = Field(0.0, ge=0)
    count: int | None = Field(None, ge=1)
    over_s: float = Field(0.0, ge=0)
    on_s: float | None = Field(None, gt=0)
    off_s: float | None = Field(None, ge=0)
    path: str | None = None
    format: TraceFormat | None = None  # trace: the file's format; None: detect it
    tenant: str | None = None  # trace: keep only this tenant's rows (the requests format)
    time_scale: float = Field(1.0, gt=0)  # trace: divide gaps by this (2 = twice as fast)
    max_requests: int | None = Field(None, ge=1)  # cap on arrivals of this class

    @model_validator(mode="after")
    def _check(self) -> Arrival:
        need = {"poisson": ("rate_per_s",), "burst": ("count",), "onoff": ("rate_per_s", "on_s",
                "off_s"), "trace": ("path",)}[self.kind]
        missing = [k for k in need if getattr(self, k) is None]
        if missing:
            raise ValueError(f"a {self.kind} arrival needs {missing}")
        return self


class Retry(_Model):
    """Retry on 429 (and a gateway's queue timeout) with exponential backoff and jitter."""

    max_attempts: int | None = Field(None, ge=1)  # None: retry until served
    base_s: float = Field(1.0, gt=0)
    cap_s: float = Field(60.0, gt=0)
    jitter: Literal["none", "equal", "full"] = "equal"
    honour_retry_after: bool = True


class ClientSpec(_Model):
    """How the clients of a class behave."""

    stream: bool = True
    timeout_s: float | None = Field(None, gt=0)  # s without a first token (unstreamed: answer)
    retries_on_timeout: int = Field(0, ge=0)  # the avalanche: re-send after a timeout
    retry_delay_s: float = Field(0.0, ge=0)
    retry_429: Retry | None = Retry()
    render_tps: float | None = Field(None, gt=0)  # tokens/s the client displays
    disconnect_after_tokens: int | None = Field(None, ge=1)
    disconnect_after_s: float | None = Field(None, gt=0)
    stall_after_tokens: int | None = Field(None, ge=1)  # stops reading (a frozen tab)
    chars_per_token: float = Field(4.0, gt=0)  # to report returned text length


class Slo(_Model):
    """Targets a class's verdict is judged against (user-perceived, from the first attempt)."""

    ttft_p99_s: float | None = Field(None, gt=0)
    e2e_p99_s: float | None = Field(None, gt=0)
    # time per output token after the first, per request; like the others it is a p99 bound
    # for the verdict and a per-request bound for goodput
    tpot_p99_s: float | None = Field(None, gt=0)
    min_completed_frac: float | None = Field(None, ge=0, le=1)


class PrefixSpec(_Model):
    """Prompts that share prefixes, as block hash ids (`sim/prefixes.py`): each request opens
    with one of `system_prompts` shared system prompts and continues one of `conversations`
    multi-turn chats, resending its whole history; `prompt_tokens` is then the new message."""

    block_tokens: int = Field(16, ge=1)  # tokens per hash id (the engine's block size)
    system_prompts: int = Field(1, ge=1)  # distinct shared system prompts
    system_tokens: int = Field(0, ge=0)  # tokens of each system prompt
    conversations: int = Field(1, ge=1)  # chats in progress at once
    max_context: int = Field(6000, ge=1)  # a chat whose next prompt would pass this starts over


class WorkloadClass(_Model):
    """One class of traffic: who sends it, when, how long, and how the client behaves."""

    name: str = Field(min_length=1)
    tenant: str = Field(min_length=1)
    tier: str = "normal"
    arrival: Arrival
    prompt_tokens: Dist | None = None  # None: from the trace
    output_tokens: Dist | None = None  # where the model would stop (EOS); None: from the trace
    max_tokens: int | None = Field(None, ge=1)  # None: ask exactly output_tokens (ignore_eos)
    client: ClientSpec = ClientSpec()
    slo: Slo | None = None
    prefix: PrefixSpec | None = None  # shared system prompts and multi-turn chats (hash ids)

    @model_validator(mode="after")
    def _check(self) -> WorkloadClass:
        if self.arrival.kind != "trace" and (self.prompt_tokens is None
                                             or self.output_tokens is None):
            raise ValueError("prompt_tokens and output_tokens are required unless from a trace")
        return self


class GpuMapping(_Model):
    """An accelerator described by its datasheet, for a GPU without a preset."""

    name: str = "custom-gpu"
    peak_tflops: float = Field(gt=0)  # dense bf16 TFLOP/s
    memory_gib: float = Field(gt=0)  # device memory as CUDA reports its total, GiB
    bandwidth_gb_s: float = Field(gt=0)  # HBM bandwidth, GB/s (decimal)
    pcie_gb_s: float = Field(25.0, gt=0)  # host link (swap preemption), GB/s
    link_gb_s: float | None = Field(None, gt=0)  # GPU-to-GPU all-reduce bus (TP), GB/s

    def spec(self) -> GpuSpec:
        """The `GpuSpec` the cost model reads."""
        return GpuSpec(self.name, self.peak_tflops * 1e12, self.memory_gib * GIB,
                       self.bandwidth_gb_s * 1e9, self.pcie_gb_s * 1e9)


class Link(_Model):
    """The network a decode instance reads prompt KV over (P/D disaggregation)."""

    bandwidth_gb_s: float = Field(gt=0)  # GB/s (decimal), the instance's whole inbound link
    latency_ms: float = Field(0.0, ge=0)  # ms added to each transfer (setup, notification)


class BackendGroup(_Model):
    """`count` identical vLLM instances, each on `tp` GPUs."""

    name: str = Field(min_length=1)
    count: int = Field(1, ge=1)
    # a preset name or a datasheet mapping; required unless a profile gives the step cost
    gpu: str | GpuMapping | None = None
    model: str | None = None  # a preset name, or a Hugging Face config.json (path ending .json)
    tp: int = Field(1, ge=1)
    engine: dict[str, Any] = {}  # EngineConfig fields (vLLM flags)
    knobs: dict[str, float] = {}  # cost-model knob overrides
    profile: str | None = None  # measured step cost (`llmflow calibrate`) instead of gpu/model
    role: Literal["prefill", "decode", "both"] = "both"  # P/D disaggregation (`sim/disagg.py`)
    link: Link | None = None  # decode: the inbound KV link, one per instance

    @model_validator(mode="after")
    def _check(self) -> BackendGroup:
        if self.role == "decode" and self.link is None:
            raise ValueError("a decode group needs `link: {bandwidth_gb_s, latency_ms}`, the "
                             "network its instances read prompt KV over")
        if self.role != "both" and self.profile is not None:
            raise ValueError(f"a {self.role} group needs `gpu` and `model` (the KV bytes per "
                             "token its transfers carry); a measured profile does not give them")
        if self.profile is None and (self.gpu is None or self.model is None):
            raise ValueError("a backend group needs `gpu` and `model`, or a `profile`")
        if self.profile is None:
            try:
                self.specs()  # an unknown preset or a bad config.json fails at load time
            except KeyError as exc:
                raise ValueError(exc.args[0]) from None
        return self

    def specs(self) -> tuple[GpuSpec, ModelSpec, dict[str, float]]:
        """The GPU, the model and the knob overrides its cost model runs with.

        Raises:
            KeyError: an unknown preset.
            ValueError: an unreadable or incomplete config.json.
        """
        g = self.gpu
        gpu_spec = gpu(g) if isinstance(g, str) else g.spec() if g is not None else gpu("")
        m = self.model or ""
        model_spec = model_from_hf_config(Path(m)) if m.endswith(".json") else model(m)
        knobs = dict(self.knobs)
        if isinstance(g, GpuMapping) and g.link_gb_s is not None:
            knobs.setdefault("link_bandwidth", g.link_gb_s * 1e9)
        return gpu_spec, model_spec, knobs


class ReplicaSpec(_Model):
    """`replicas:` in a gated policy of a scenario."""

    n: int = Field(ge=1)
    shared: bool = True  # False: no Redis, each replica on the whole cap
    redis_rtt_ms: float = Field(0.5, ge=0)
    lease_ttl_ms: float = Field(10_000.0, gt=0)
    sync_ms: float = Field(100.0, gt=0)
    balance: Literal["round_robin", "by_tenant"] = "round_robin"
    crash_at_s: float | None = Field(None, ge=0)  # replica 0 crashes then (None: never)



class PolicySpec(_Model):
    """A policy to compare: `direct` (no gateway) or `gated` (the core with `config`)."""

    kind: Literal["direct", "gated"] = "gated"
    preset: Literal["seed-gate", "llmflow"] | None = None  # None: the policy's name, or llmflow
    config: dict[str, Any] = {}  # llmflow YAML sections, merged over the preset
    scheduling_policy: Literal["fcfs", "priority"] | None = None  # vLLM's; None: preset's
    engine: dict[str, Any] = {}  # vLLM flag overrides for this policy's run (preemption_mode...)
    tenant_tier: str | None = None  # put every tenant in this tier
    propagate_disconnect: bool = True  # direct: False when a proxy hides client disconnects
    cluster: list[BackendGroup] | None = None  # this policy's own cluster (None: the scenario's)
    replicas: ReplicaSpec | None = None  # gated: N gateway replicas (sim/replicas.py)

    def preset_for(self, name: str) -> str:
        """The built-in config this policy starts from."""
        if self.preset is not None:
            return self.preset
        return name if name in ("seed-gate", "llmflow") else "llmflow"


class Scenario(_Model):
    """A whole scenario file."""

    title: str
    seed: int = 0
    duration_s: float = Field(gt=0)  # arrivals stop here; the run drains afterwards
    max_sim_s: float | None = Field(None, gt=0)  # hard stop (default: 20 x duration + 1 h)
    sample_interval_s: float = Field(1.0, gt=0)
    cluster: list[BackendGroup] = Field(min_length=1)
    workload: list[WorkloadClass] = Field(min_length=1)
    policies: dict[str, PolicySpec] = Field(default_factory=lambda: {
        "direct": PolicySpec(kind="direct"), "seed-gate": PolicySpec(), "llmflow": PolicySpec()})
    base_dir: Path = Path(".")  # the scenario file's folder (set by load_scenario)

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        names = [c.name for c in self.workload]
        if len(set(names)) != len(names):
            raise ValueError(f"workload class names must be unique: {names}")
        for name, spec in {"": None, **self.policies}.items():
            groups = self.cluster if spec is None else spec.cluster
            if groups is None:
                continue
            where = f"policy {name}'s cluster" if name else "cluster"
            if len({g.name for g in groups}) != len(groups):
                raise ValueError(f"{where}: group names must be unique")
            _check_roles(where, groups)
        for name, spec in self.policies.items():
            split = any(g.role != "both" for g in spec.cluster or self.cluster)
            if split and spec.replicas is not None:
                raise ValueError(
                    f"policy {name} has `replicas:` on a split (prefill/decode) cluster: a "
                    "replica's lease covers one backend per request, not a prefill and a decode")
        return self

    @property
    def horizon_s(self) -> float:
        """Simulated time after which a run stops even if requests are still live."""
        return self.max_sim_s or 20 * self.duration_s + 3600.0

    def resolve(self, path: str) -> Path:
        """A path from the file, relative to the scenario's folder."""
        p = Path(path)
        return p if p.is_absolute() else self.base_dir / p


def _check_roles(where: str, groups: list[BackendGroup]) -> None:
    roles = {g.role for g in groups}
    if roles != {"both"} and roles != {"prefill", "decode"}:
        raise ValueError(f"{where}: a disaggregated cluster needs both a `role: prefill` and a "
                         "`role: decode` group and no `role: both` group (got "
                         f"{sorted(roles)})")


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario YAML file.

    Raises:
        ScenarioError: naming the file and each bad key.
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read scenario ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: the top level must be a mapping")
    data["base_dir"] = path.resolve().parent
    policy_groups = [g for p in (data.get("policies") or {}).values() if isinstance(p, dict)
                     for g in (p.get("cluster") or ())]
    for group in [*(data.get("cluster") or ()), *policy_groups]:
        if isinstance(group, dict) and isinstance(group.get("profile"), str):
            group["profile"] = str(data["base_dir"] / group["profile"])  # relative to the file
        if isinstance(group, dict) and str(group.get("model", "")).endswith(".json"):
            group["model"] = str(data["base_dir"] / group["model"])
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        lines = [f"{path}: invalid scenario ({exc.error_count()} problem(s)):"]
        for err in exc.errors():
            key = ".".join(str(p) for p in err["loc"]) or "(top level)"
            lines.append(f"  {key}: {err['msg']}")
        raise ScenarioError("\n".join(lines)) from None


_SEARCH = ("sim/scenarios", "sim/incidents")  # where a bare scenario name is looked up


def search_roots() -> list[Path]:
    """Where scenario files and fidelity cases are looked up: the working folder, then the
    checkout this package runs from (when it has `sim/`)."""
    checkout = Path(__file__).resolve().parents[3]  # python/llmflow/sim/scenario.py -> repo root
    return [Path.cwd(), *([checkout] if (checkout / "sim").is_dir() else [])]


def find_scenario(name: str) -> Path:
    """Resolve a scenario argument: a YAML path, or a name under `sim/scenarios` or
    `sim/incidents` (from the current folder, then from the source checkout).

    Raises:
        FileNotFoundError: listing where it looked.
    """
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    tried = []
    for root in search_roots():
        for folder in _SEARCH:
            cand = root / folder / f"{p.stem if p.suffix else name}.yaml"
            tried.append(str(cand))
            if cand.is_file():
                return cand
    raise FileNotFoundError(f"no scenario {name!r}; tried {name} and " + ", ".join(tried))


def all_scenarios() -> list[Path]:
    """Every scenario `find_scenario` can name, one per name (the current folder's first)."""
    seen: dict[str, Path] = {}
    for root in search_roots():
        for folder in _SEARCH:
            for f in sorted((root / folder).glob("*.yaml")):
                seen.setdefault(f"{folder.split('/')[1]}/{f.stem}", f)
    return list(seen.values())
