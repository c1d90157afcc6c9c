//! The config's checks: each names the key, the bad value and what is allowed.

use super::{BackendRole, PolicyConfig};
use crate::error::{PolicyError, PolicyResult};

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
        positive_f("signals.min_deadline_ms", self.signals.min_deadline_ms)?;
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

/// Names under `key` are set and distinct; an empty one is named by its place (`key[i].name`
/// for a list of named entries, `key[i]` for a list of names), so the user can find it.
fn unique<'a>(key: &str, names: impl Iterator<Item = &'a str>) -> PolicyResult<()> {
    let mut seen = std::collections::HashSet::new();
    let entries = matches!(key, "backends" | "tiers" | "tenants");
    for (i, name) in names.enumerate() {
        if name.is_empty() {
            let place = if entries {
                format!("{key}[{i}].name")
            } else {
                format!("{key}[{i}]")
            };
            return Err(PolicyError::config(place, "must not be empty"));
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
