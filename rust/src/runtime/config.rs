//! The runtime's own settings: the lifecycle around the admission policy.

use serde::Deserialize;

use super::lease::LeaseConfig;
use crate::config::PolicyConfig;
use crate::error::{PolicyError, PolicyResult};

/// Two failed scrapes in a row mark a backend down (one lost scrape is noise); a backend that
/// never answered is down at its first failure.
const DEFAULT_SCRAPE_FAILURES: u32 = 2;

/// Lifecycle settings that are not admission policy.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LifecycleConfig {
    /// A client whose window stays full this long is stalled: cut, upstream aborted.
    #[serde(default)]
    pub stall_timeout_ms: Option<f64>,
    /// On a first-token timeout answer 504 (else a degraded 200 with the notice).
    #[serde(default)]
    pub first_token_error: bool,
    /// After `Drain`, how long live requests get before they are cut.
    #[serde(default = "default_drain_ms")]
    pub drain_timeout_ms: f64,
    /// Consecutive failed scrapes that mark a backend down.
    #[serde(default = "default_scrape_failures")]
    pub scrape_failures_before_down: u32,
    /// Slots are leased from a store shared by gateway replicas (`runtime/lease.rs`); `None`:
    /// this process alone, and a `Start` goes out at once.
    #[serde(default)]
    pub leases: Option<LeaseConfig>,
}

fn default_drain_ms() -> f64 {
    30_000.0
}
fn default_scrape_failures() -> u32 {
    DEFAULT_SCRAPE_FAILURES
}

impl Default for LifecycleConfig {
    fn default() -> Self {
        Self {
            stall_timeout_ms: None,
            first_token_error: false,
            drain_timeout_ms: default_drain_ms(),
            scrape_failures_before_down: DEFAULT_SCRAPE_FAILURES,
            leases: None,
        }
    }
}

/// What the runtime is built from: the admission policy and the lifecycle around it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeConfig {
    pub policy: PolicyConfig,
    #[serde(default)]
    pub lifecycle: LifecycleConfig,
}

impl RuntimeConfig {
    /// Parse and check a document of this shape without building a runtime: it refuses what
    /// `Runtime::from_json` refuses, with the same error (the config loader's one validator).
    ///
    /// # Errors
    /// `Config`, naming the key, for a document that does not parse or a value out of range.
    pub fn check_json(text: &str) -> PolicyResult<()> {
        let config: Self = serde_json::from_str(text)
            .map_err(|e| PolicyError::config("(document)", e.to_string()))?;
        config.lifecycle.validate()?;
        config.policy.validate()
    }
}

impl LifecycleConfig {
    /// The settings' own checks (the policy's are `PolicyConfig::validate`).
    pub(super) fn validate(&self) -> PolicyResult<()> {
        if self.stall_timeout_ms.is_some_and(|v| v.is_nan() || v < 0.0) {
            return Err(PolicyError::config(
                "lifecycle.stall_timeout_ms",
                "must be >= 0 or null",
            ));
        }
        if self.drain_timeout_ms.is_nan() || self.drain_timeout_ms < 0.0 {
            return Err(PolicyError::config(
                "lifecycle.drain_timeout_ms",
                "must be >= 0",
            ));
        }
        if let Some(leases) = self.leases {
            leases.validate()?;
        }
        Ok(())
    }
}
