//! The policy config the core is built from, with validation that names the key, the bad value
//! and what is allowed. The user-facing YAML lives in Python (`llmflow.config`); it produces this
//! shape, which is also what Rust benchmarks and tests build directly.

use serde::{Deserialize, Serialize};

use crate::error::{PolicyError, PolicyResult};

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

impl PolicyConfig {
    /// Parse and validate a JSON document of this shape.
    pub fn from_json(text: &str) -> PolicyResult<Self> {
        let config: Self = serde_json::from_str(text)
            .map_err(|e| PolicyError::config("(document)", e.to_string()))?;
        config.validate()?;
        Ok(config)
    }

    /// Check every value against what the policy can work with.
    pub fn validate(&self) -> PolicyResult<()> {
        if self.backends.is_empty() {
            return Err(PolicyError::config(
                "backends",
                "at least one backend is required",
            ));
        }
        unique("backends", self.backends.iter().map(|b| b.name.as_str()))?;
        for (i, b) in self.backends.iter().enumerate() {
            if b.gpus == 0 {
                return Err(PolicyError::config(
                    format!("backends[{i}].gpus"),
                    "must be >= 1, got 0",
                ));
            }
        }
        self.validate_models()?;
        positive_int("block_size", self.block_size)?;
        positive_int("max_concurrency_per_gpu", self.max_concurrency_per_gpu)?;
        self.validate_tiers()?;
        if self.tenants.is_empty() {
            return Err(PolicyError::config(
                "tenants",
                "at least one tenant is required",
            ));
        }
        unique("tenants", self.tenants.iter().map(|t| t.name.as_str()))?;
        for (i, t) in self.tenants.iter().enumerate() {
            if !self.tiers.iter().any(|tier| tier.name == t.tier) {
                let names: Vec<&str> = self.tiers.iter().map(|t| t.name.as_str()).collect();
                return Err(PolicyError::config(
                    format!("tenants[{i}].tier"),
                    format!("{:?} is not a declared tier; allowed: {names:?}", t.tier),
                ));
            }
            positive_f(&format!("tenants[{i}].weight"), t.weight)?;
            if let Some(v) = t.requests_per_s {
                positive_f(&format!("tenants[{i}].requests_per_s"), v)?;
            }
            if let Some(v) = t.tokens_per_min {
                positive_f(&format!("tenants[{i}].tokens_per_min"), v)?;
            }
        }
        for (key, value) in [
            ("kv_pressure_threshold", self.kv_pressure_threshold),
            ("kv_fit_target", self.kv_fit_target),
        ] {
            if let Some(v) = value {
                fraction(key, v)?;
            }
        }
        if let Some(q) = self.headroom_quantile {
            if !(q > 0.0 && q < 1.0) {
                return Err(PolicyError::config(
                    "headroom_quantile",
                    format!("must be in (0, 1), e.g. 0.99, got {q}"),
                ));
            }
        }
        positive_f("headroom_wait_ms", self.headroom_wait_ms)?;
        positive_f("prefill_tokens_per_s", self.prefill_tokens_per_s)?;
        for (key, value) in [
            ("ttft_sla_ms", self.ttft_sla_ms),
            ("preemption_cooldown_ms", self.preemption_cooldown_ms),
            ("queue_timeout_ms", self.queue_timeout_ms),
            ("first_token_timeout_ms", self.first_token_timeout_ms),
            ("request_timeout_ms", self.request_timeout_ms),
            ("stale_after_ms", self.stale_after_ms),
            ("tpot_target_ms", self.tpot_target_ms),
        ] {
            if let Some(v) = value {
                positive_f(key, v)?;
            }
        }
        for (key, value) in [
            ("input_token_weight", self.input_token_weight),
            ("output_token_weight", self.output_token_weight),
            ("kv_weight", self.kv_weight),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(PolicyError::config(
                    key,
                    format!("must be >= 0, got {value}"),
                ));
            }
        }
        Ok(())
    }

    /// Served model names (the pools), in first-declared order; empty when no backend
    /// declares any (one pool that takes any name).
    pub fn served_models(&self) -> Vec<&str> {
        let mut names: Vec<&str> = Vec::new();
        for b in &self.backends {
            for m in &b.models {
                if !names.contains(&m.as_str()) {
                    names.push(m);
                }
            }
        }
        names
    }

    fn validate_models(&self) -> PolicyResult<()> {
        let declaring = self
            .backends
            .iter()
            .filter(|b| !b.models.is_empty())
            .count();
        if declaring > 0 && declaring < self.backends.len() {
            let i = self
                .backends
                .iter()
                .position(|b| b.models.is_empty())
                .unwrap_or(0);
            return Err(PolicyError::config(
                format!("backends[{i}].models"),
                "is empty while other backends declare theirs; once one backend lists the \
                 models it serves, every backend must (a request is routed only to backends \
                 that serve its model)",
            ));
        }
        for (i, b) in self.backends.iter().enumerate() {
            unique(
                &format!("backends[{i}].models"),
                b.models.iter().map(String::as_str),
            )?;
        }
        let served = self.served_models();
        for (alias, target) in &self.models {
            if alias.is_empty() {
                return Err(PolicyError::config(
                    "models",
                    "alias names must not be empty",
                ));
            }
            if served.contains(&alias.as_str()) {
                return Err(PolicyError::config(
                    format!("models.{alias}"),
                    "is already a model a backend serves; an alias must be a new name",
                ));
            }
            if !served.contains(&target.as_str()) {
                let message = if served.is_empty() {
                    format!(
                        "points at {target:?}, but no backend declares its `models`; list the \
                         served names under each backend's `models` to use aliases"
                    )
                } else {
                    format!("points at {target:?}, which no backend serves; served: {served:?}")
                };
                return Err(PolicyError::config(format!("models.{alias}"), message));
            }
        }
        for model in self.routing.pools.keys() {
            if !served.contains(&model.as_str()) {
                return Err(PolicyError::config(
                    format!("routing.pools.{model}"),
                    format!("names no served model (aliases are not pools); served: {served:?}"),
                ));
            }
        }
        self.validate_roles()?;
        fraction("routing.prefix_load_bound", self.routing.prefix_load_bound)?;
        if self.routing.prefix_memory_blocks == 0 {
            return Err(PolicyError::config(
                "routing.prefix_memory_blocks",
                "must be >= 1, got 0",
            ));
        }
        Ok(())
    }

    /// Each model pool is co-located (every backend `both`) or split (`prefill` and `decode`
    /// backends, at least one of each): a request of a split pool needs one of each.
    fn validate_roles(&self) -> PolicyResult<()> {
        let served = self.served_models();
        let pools: Vec<Option<&str>> = if served.is_empty() {
            vec![None]
        } else {
            served.into_iter().map(Some).collect()
        };
        for model in pools {
            let members: Vec<(usize, BackendRole)> = self
                .backends
                .iter()
                .enumerate()
                .filter(|(_, b)| model.is_none_or(|m| b.models.iter().any(|x| x == m)))
                .map(|(i, b)| (i, b.role))
                .collect();
            let has = |r: BackendRole| members.iter().any(|&(_, x)| x == r);
            if !has(BackendRole::Prefill) && !has(BackendRole::Decode) {
                continue;
            }
            let pool = model.map_or_else(|| "the backends".to_owned(), |m| format!("model {m:?}"));
            if let Some(&(i, _)) = members.iter().find(|&&(_, r)| r == BackendRole::Both) {
                return Err(PolicyError::config(
                    format!("backends[{i}].role"),
                    format!(
                        "is \"both\" while other backends of {pool} are split into prefill and \
                         decode; a pool is co-located or split: give every backend of it a \
                         role of \"prefill\" or \"decode\", or none"
                    ),
                ));
            }
            for (need, other) in [
                (BackendRole::Prefill, BackendRole::Decode),
                (BackendRole::Decode, BackendRole::Prefill),
            ] {
                if !has(need) {
                    let i = members
                        .iter()
                        .find(|&&(_, r)| r == other)
                        .map_or(0, |m| m.0);
                    return Err(PolicyError::config(
                        format!("backends[{i}].role"),
                        format!(
                            "is {:?} but {pool} has no {:?} backend; a split pool needs at \
                             least one of each",
                            other.as_str(),
                            need.as_str()
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    fn validate_tiers(&self) -> PolicyResult<()> {
        if self.tiers.is_empty() {
            return Err(PolicyError::config(
                "tiers",
                "at least one tier is required",
            ));
        }
        if self.tiers.len() > 255 {
            return Err(PolicyError::config("tiers", "at most 255 tiers"));
        }
        unique("tiers", self.tiers.iter().map(|t| t.name.as_str()))?;
        for (i, t) in self.tiers.iter().enumerate() {
            fraction(&format!("tiers[{i}].shed_at"), t.shed_at)?;
            fraction(&format!("tiers[{i}].max_share"), t.max_share)?;
            fraction(&format!("tiers[{i}].brownout_at"), t.brownout_at)?;
            if t.brownout_max_tokens == Some(0) {
                return Err(PolicyError::config(
                    format!("tiers[{i}].brownout_max_tokens"),
                    "must be >= 1 (or null: no brownout), got 0",
                ));
            }
            if t.protected && t.best_effort {
                return Err(PolicyError::config(
                    format!("tiers[{i}]"),
                    "a tier cannot be both protected (never shed) and best_effort (no latency \
                     objective); choose one",
                ));
            }
            // A more important tier must never be shed while a less important one is still let
            // in: that is what makes "VIP is never shed before normal" hold by construction.
            if i > 0 && t.shed_at > self.tiers[i - 1].shed_at {
                return Err(PolicyError::config(
                    format!("tiers[{i}].shed_at"),
                    format!(
                        "{} is above the more important tier {:?} ({}); tiers are listed from \
                         most to least important and shed_at must not increase down the list",
                        t.shed_at,
                        self.tiers[i - 1].name,
                        self.tiers[i - 1].shed_at
                    ),
                ));
            }
        }
        Ok(())
    }
}

fn unique<'a>(key: &str, names: impl Iterator<Item = &'a str>) -> PolicyResult<()> {
    let mut seen = std::collections::HashSet::new();
    for name in names {
        if name.is_empty() {
            return Err(PolicyError::config(key, "names must not be empty"));
        }
        if !seen.insert(name) {
            return Err(PolicyError::config(
                key,
                format!("name {name:?} appears twice"),
            ));
        }
    }
    Ok(())
}

fn positive_int(key: &str, value: u32) -> PolicyResult<()> {
    if value == 0 {
        return Err(PolicyError::config(key, "must be >= 1, got 0"));
    }
    Ok(())
}

fn positive_f(key: &str, value: f64) -> PolicyResult<()> {
    if !(value.is_finite() && value > 0.0) {
        return Err(PolicyError::config(
            key,
            format!("must be a number > 0, got {value}"),
        ));
    }
    Ok(())
}

fn fraction(key: &str, value: f64) -> PolicyResult<()> {
    if !(value > 0.0 && value <= 1.0) {
        return Err(PolicyError::config(
            key,
            format!("must be in (0, 1], got {value}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn sample_json() -> String {
        r#"{"backends":[{"name":"b0","gpus":1,"kv_blocks":1000}],
            "max_concurrency_per_gpu":2,"max_waiting":4,
            "tiers":[{"name":"vip","protected":true},{"name":"normal","shed_at":0.5},
                     {"name":"batch","shed_at":0.5,"max_share":0.5}],
            "tenants":[{"name":"v","tier":"vip"},{"name":"a","tier":"normal"},
                       {"name":"b","tier":"normal"},{"name":"z","tier":"batch"}],
            "kv_pressure_threshold":0.85,"ttft_sla_ms":1500,"preemption_cooldown_ms":1000,
            "queue_timeout_ms":5000,"first_token_timeout_ms":3000,"request_timeout_ms":60000}"#
            .to_string()
    }

    // The sample used across the crate's tests parses and validates.
    #[test]
    fn sample_is_valid() {
        let c = PolicyConfig::from_json(&sample_json()).unwrap();
        assert_eq!(c.tiers.len(), 3);
        assert_eq!(c.strategy, Strategy::Fair);
    }

    // An unknown key is refused with its name, so typos do not silently fall back to defaults.
    #[test]
    fn unknown_key_is_named() {
        let text = sample_json().replace("\"max_waiting\"", "\"max_wating\"");
        let err = PolicyConfig::from_json(&text).unwrap_err().to_string();
        assert!(err.contains("max_wating"), "{err}");
    }

    // A tenant pointing at a missing tier names the key and the allowed tiers.
    #[test]
    fn tenant_tier_must_exist() {
        let text = sample_json().replace(r#""tier":"batch""#, r#""tier":"gold""#);
        let err = PolicyConfig::from_json(&text).unwrap_err().to_string();
        assert!(
            err.contains("tenants[3].tier") && err.contains("vip"),
            "{err}"
        );
    }

    // shed_at must not rise down the tier list, or VIP could be shed before normal.
    #[test]
    fn shed_at_must_not_increase() {
        let text = sample_json().replace(
            r#"{"name":"vip","protected":true}"#,
            r#"{"name":"vip","protected":true,"shed_at":0.4}"#,
        );
        let err = PolicyConfig::from_json(&text).unwrap_err().to_string();
        assert!(err.contains("tiers[1].shed_at"), "{err}");
    }

    // Backends must all declare their models or none; an alias must point at a served model.
    #[test]
    fn models_are_declared_consistently() {
        let two = sample_json().replace(
            r#"[{"name":"b0","gpus":1,"kv_blocks":1000}]"#,
            r#"[{"name":"b0","models":["m"]},{"name":"b1"}]"#,
        );
        let err = PolicyConfig::from_json(&two).unwrap_err().to_string();
        assert!(err.contains("backends[1].models"), "{err}");
        let alias = sample_json().replace(
            r#"[{"name":"b0","gpus":1,"kv_blocks":1000}]"#,
            r#"[{"name":"b0","models":["m"]}],"models":{"fast":"n"}"#,
        );
        let err = PolicyConfig::from_json(&alias).unwrap_err().to_string();
        assert!(
            err.contains("models.fast") && err.contains(r#"["m"]"#),
            "{err}"
        );
        let pool = sample_json().replace(
            r#"[{"name":"b0","gpus":1,"kv_blocks":1000}]"#,
            r#"[{"name":"b0","models":["m"]}],"routing":{"pools":{"x":"prefix"}}"#,
        );
        let err = PolicyConfig::from_json(&pool).unwrap_err().to_string();
        assert!(err.contains("routing.pools.x"), "{err}");
    }

    // Thresholds outside (0, 1] are refused with the value.
    #[test]
    fn fraction_range() {
        let text = sample_json().replace("0.85", "1.5");
        let err = PolicyConfig::from_json(&text).unwrap_err().to_string();
        assert!(
            err.contains("kv_pressure_threshold") && err.contains("1.5"),
            "{err}"
        );
    }
}
