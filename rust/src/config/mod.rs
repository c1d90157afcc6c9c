//! The policy config the core is built from, with validation that names the key, the bad value
//! and what is allowed. The user-facing YAML lives in Python (`llmflow.config`); it produces this
//! shape, which is also what Rust benchmarks and tests build directly. The checks are in
//! `validate`.

use serde::{Deserialize, Serialize};

/// One vLLM instance the gateway routes to.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    pub name: String,
    #[serde(default = "one")]
    pub gpus: u32,
    /// KV blocks vLLM allocated; 0 when unknown (the ledger then cannot estimate usage itself).
    #[serde(default)]
    pub kv_blocks: u64,
    /// Model names this backend serves (vLLM's `--served-model-name`s). Empty on every backend:
    /// one pool that takes any model name (the core then does not check names).
    #[serde(default)]
    pub models: Vec<String>,
    /// Its part in prefill/decode disaggregation (`both`: co-located serving, the default).
    #[serde(default)]
    pub role: BackendRole,
}

/// What a backend does with a request (vLLM's disaggregated serving with a KV connector).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendRole {
    /// Prefill and decode on the same instance.
    #[default]
    Both,
    /// Prefill only: it computes the prompt's KV (a request with `max_tokens` 1) and keeps it
    /// until a decode instance has read it.
    Prefill,
    /// Decode only: it reads a prompt's KV from the prefill instance and generates.
    Decode,
}

impl BackendRole {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Both => "both",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

/// How a pool picks among the backends that serve its model and have room.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoutePolicy {
    /// The most free slots, the first on a tie (the rule before per-pool routing; the default,
    /// so configs without `routing` decide exactly as before).
    FreeSlots,
    /// Each backend in turn.
    RoundRobin,
    /// The headroom score: free slots and free KV blocks, discounted by the prefill work queued
    /// ahead at the backend's measured prefill rate (`routing::headroom_score`).
    LeastLoaded,
    /// The backend holding the longest prefix of the prompt's block hashes, unless it is loaded
    /// past `prefix_load_bound`; else `least_loaded`.
    Prefix,
}

impl RoutePolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::FreeSlots => "free_slots",
            Self::RoundRobin => "round_robin",
            Self::LeastLoaded => "least_loaded",
            Self::Prefix => "prefix",
        }
    }
}

/// Which of a client's own signals (`governor::Signals`) are honoured, and their bounds. A
/// client's deadline only ever shortens its wait: the queue limit and every other deadline
/// stand (waiting to a 60 s client deadline instead of the 30 s queue limit made the brownout
/// scenario's median TTFT 40 s instead of 1.3 s).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignalsConfig {
    /// A client's retry count is honoured (else as if it sent none).
    #[serde(default = "default_true")]
    pub retries: bool,
    /// The most retries a client may claim: a higher count is not honoured (a runaway loop,
    /// or a header that does not mean what the SDKs mean by it).
    #[serde(default = "default_max_retries")]
    pub max_retries: u32,
    /// A client's deadline is honoured (else as if it sent none).
    #[serde(default = "default_true")]
    pub deadlines: bool,
    /// The shortest deadline honoured: a client asking less gets this much (so a truncated or
    /// mistaken header cannot have every request refused before the queue is looked at).
    #[serde(default = "default_min_deadline")]
    pub min_deadline_ms: f64,
}

impl Default for SignalsConfig {
    fn default() -> Self {
        Self {
            retries: true,
            max_retries: default_max_retries(),
            deadlines: true,
            min_deadline_ms: default_min_deadline(),
        }
    }
}

/// Routing between the backends of a pool.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingConfig {
    /// The policy of every pool not named in `pools`.
    #[serde(default = "default_route_policy")]
    pub policy: RoutePolicy,
    /// Per model (a served name, not an alias): its own policy.
    #[serde(default)]
    pub pools: std::collections::BTreeMap<String, RoutePolicy>,
    /// Load (running / slots, 0..1] at which `prefix` stops preferring a backend for its cache,
    /// so a hot prefix cannot pile onto one replica.
    #[serde(default = "default_prefix_load_bound")]
    pub prefix_load_bound: f64,
    /// Block hashes remembered per backend when its KV capacity is unknown (with a known
    /// capacity: one per KV block, as many as vLLM can cache).
    #[serde(default = "default_prefix_memory")]
    pub prefix_memory_blocks: u64,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        Self {
            policy: default_route_policy(),
            pools: std::collections::BTreeMap::new(),
            prefix_load_bound: default_prefix_load_bound(),
            prefix_memory_blocks: default_prefix_memory(),
        }
    }
}

/// A priority class. Tiers are listed from most to least important; that order is strict.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TierConfig {
    pub name: String,
    /// Queue fill (0..1] beyond which this tier is refused, so lower tiers are shed first.
    #[serde(default = "one_f")]
    pub shed_at: f64,
    /// Share (0..1] of each backend's slots this tier may hold at once, so a flood of one tier
    /// cannot take every slot from the others.
    #[serde(default = "one_f")]
    pub max_share: f64,
    /// Exempt from KV-pressure, TTFT-SLA and preemption-breaker shedding (a VIP tier).
    #[serde(default)]
    pub protected: bool,
    /// No latency objective (a batch tier): never refused for the TTFT SLA, and it borrows
    /// only the slots and KV the latency tiers' headroom leaves idle (work-conserving sharing).
    #[serde(default)]
    pub best_effort: bool,
    /// Brownout before refusal: once the queue is this full (0..1], requests of the tier are
    /// admitted with `max_tokens` clamped to `brownout_max_tokens` (a shorter answer that
    /// holds its slot and KV for less time), before `shed_at` refuses them outright.
    #[serde(default = "one_f")]
    pub brownout_at: f64,
    #[serde(default)]
    pub brownout_max_tokens: Option<u64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    pub name: String,
    pub tier: String,
    /// Fair-share weight inside the tier: a weight-2 tenant gets twice the service.
    #[serde(default = "one_f")]
    pub weight: f64,
    /// Rate limits (token buckets; `None`: unlimited): requests per second (a second's worth,
    /// at least one, may come at once) and prompt plus output tokens per minute.
    #[serde(default)]
    pub requests_per_s: Option<f64>,
    #[serde(default)]
    pub tokens_per_min: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// Virtual Token Counter fairness between tenants inside a tier.
    Fair,
    /// Arrival order inside a tier (the seed's plain bounded queue).
    Fifo,
}

/// Every knob of the policy. Optional limits set to `None` are disabled.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    pub backends: Vec<BackendConfig>,
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    #[serde(default = "default_concurrency")]
    pub max_concurrency_per_gpu: u32,
    #[serde(default = "default_waiting")]
    pub max_waiting: u32,
    #[serde(default = "default_strategy")]
    pub strategy: Strategy,
    pub tiers: Vec<TierConfig>,
    pub tenants: Vec<TenantConfig>,
    #[serde(default)]
    pub kv_pressure_threshold: Option<f64>,
    #[serde(default)]
    pub ttft_sla_ms: Option<f64>,
    #[serde(default = "default_prefill_tps")]
    pub prefill_tokens_per_s: f64,
    #[serde(default)]
    pub preemption_cooldown_ms: Option<f64>,
    #[serde(default)]
    pub queue_timeout_ms: Option<f64>,
    /// A latency tier may also hold what it drains within `queue_timeout_ms`, beyond
    /// `max_waiting` (see `Governor::waiting_room`); false: `max_waiting` is a hard bound.
    #[serde(default = "default_true")]
    pub queue_follows_drain: bool,
    /// A queued request past its TTFT SLA, or a retry whose client first came longer ago than
    /// that, waits in its tier's late lane behind the fresh (see `fair_queue`), and a retry
    /// keeps the place of its first arrival; false: one lane, and retries are not told apart.
    #[serde(default = "default_true")]
    pub late_yields: bool,
    #[serde(default)]
    pub first_token_timeout_ms: Option<f64>,
    #[serde(default)]
    pub request_timeout_ms: Option<f64>,
    #[serde(default)]
    pub stale_after_ms: Option<f64>,
    #[serde(default = "one_f")]
    pub input_token_weight: f64,
    #[serde(default = "default_output_weight")]
    pub output_token_weight: f64,
    #[serde(default = "one_f")]
    pub kv_weight: f64,
    /// Share of a backend's KV blocks that admitted work may be expected to fill at its peak
    /// (prompt plus the tenant's measured output, or `max_tokens` until measured). `None`: only
    /// the prompt must fit the free blocks.
    #[serde(default)]
    pub kv_fit_target: Option<f64>,
    /// Headroom for the latency tiers, sized online (Erlang C) from their measured arrival rate
    /// and service time: the probability that an arrival of theirs finds a slot within
    /// `headroom_wait_ms`. Best-effort tiers never take that headroom. `None`: no headroom.
    #[serde(default)]
    pub headroom_quantile: Option<f64>,
    #[serde(default = "default_headroom_wait")]
    pub headroom_wait_ms: f64,
    /// Per-token latency target: while a backend's measured time per output token is above
    /// it, fewer requests may run there (down to one), and more again (up to the cap) once it
    /// is well below. `None`: the cap alone.
    #[serde(default)]
    pub tpot_target_ms: Option<f64>,
    /// Model aliases: a name clients may send -> the served model name whose pool takes it.
    #[serde(default)]
    pub models: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    pub routing: RoutingConfig,
    #[serde(default)]
    pub signals: SignalsConfig,
}

fn one() -> u32 {
    1
}
fn one_f() -> f64 {
    1.0
}
fn default_block_size() -> u32 {
    16
}
fn default_concurrency() -> u32 {
    16
}
fn default_waiting() -> u32 {
    200
}
fn default_true() -> bool {
    true
}
fn default_max_retries() -> u32 {
    10
}
fn default_min_deadline() -> f64 {
    1000.0
}
fn default_strategy() -> Strategy {
    Strategy::Fair
}
fn default_prefill_tps() -> f64 {
    8000.0
}
fn default_output_weight() -> f64 {
    2.0
}
fn default_headroom_wait() -> f64 {
    500.0
}
fn default_route_policy() -> RoutePolicy {
    RoutePolicy::FreeSlots
}
fn default_prefix_load_bound() -> f64 {
    0.9
}
fn default_prefix_memory() -> u64 {
    65_536
}

mod validate;

#[cfg(test)]
pub(crate) mod tests;
