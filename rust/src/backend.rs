//! What the governor knows about one backend: its slots, what it last reported, and the online
//! estimate of its prefill throughput.

use crate::config::BackendConfig;

/// The last scrape of a backend's `/metrics`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Observation {
    pub kv_usage: Option<f64>,
    pub running: Option<u64>,
    pub waiting: Option<u64>,
    pub at_us: u64,
}

#[derive(Debug, Clone)]
pub struct BackendState {
    pub name: String,
    /// Hard concurrency cap: GPUs x `max_concurrency_per_gpu`.
    pub cap: u32,
    pub kv_capacity_blocks: u64,
    pub running: u32,
    pub running_by_tier: Vec<u32>,
    /// Prompt tokens of running requests still waiting for their first token.
    pub prefill_pending: u64,
    pub healthy: bool,
    pub observed: Option<Observation>,
    pub preemptions_seen: Option<u64>,
    pub preemptions_total: u64,
    /// Prefill tokens per second, smoothed (EWMA) from measured first-token times.
    pub prefill_tps: f64,
}

/// Weight of a new sample in the smoothed estimates: recent enough to follow load shifts,
/// smooth enough that one odd request does not swing admission.
pub const EWMA_ALPHA: f64 = 0.2;

impl BackendState {
    pub fn new(config: &BackendConfig, per_gpu: u32, tiers: usize, prefill_tps: f64) -> Self {
        Self {
            name: config.name.clone(),
            cap: config.gpus * per_gpu,
            kv_capacity_blocks: config.kv_blocks,
            running: 0,
            running_by_tier: vec![0; tiers],
            prefill_pending: 0,
            healthy: true,
            observed: None,
            preemptions_seen: None,
            preemptions_total: 0,
            prefill_tps,
        }
    }

    /// True once a scrape has been seen and none has arrived for `stale_after_us`.
    pub fn is_stale(&self, now_us: u64, stale_after_us: Option<u64>) -> bool {
        match (self.observed, stale_after_us) {
            (Some(obs), Some(limit)) => now_us.saturating_sub(obs.at_us) > limit,
            _ => false,
        }
    }

    /// KV usage in 0..1: the backend's own figure while fresh; when stale or missing, the
    /// larger of the last report and the ledger's estimate, so a silent backend looks fuller,
    /// never emptier.
    pub fn kv_usage(&self, ledger_blocks: u64, stale: bool) -> f64 {
        let reported = self.observed.and_then(|o| o.kv_usage);
        let estimated = if self.kv_capacity_blocks > 0 {
            (ledger_blocks as f64 / self.kv_capacity_blocks as f64).min(1.0)
        } else {
            0.0
        };
        match reported {
            Some(usage) if !stale => usage,
            Some(usage) => usage.max(estimated),
            None => estimated,
        }
    }

    /// Fold a measured prefill rate into the estimate (ignoring absurd samples from clock
    /// jitter: more than 100x off the current estimate either way).
    pub fn record_prefill(&mut self, tokens: u64, elapsed_us: u64) {
        if elapsed_us == 0 || tokens == 0 {
            return;
        }
        let sample = tokens as f64 / (elapsed_us as f64 / 1e6);
        let clamped = sample.clamp(self.prefill_tps / 100.0, self.prefill_tps * 100.0);
        self.prefill_tps += EWMA_ALPHA * (clamped - self.prefill_tps);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend() -> BackendState {
        let config = BackendConfig {
            name: "b".into(),
            gpus: 2,
            kv_blocks: 100,
        };
        BackendState::new(&config, 16, 2, 1000.0)
    }

    // The cap is GPUs x per-GPU concurrency.
    #[test]
    fn cap_scales_with_gpus() {
        assert_eq!(backend().cap, 32);
    }

    // Without a scrape the ledger's estimate is used; a fresh scrape wins; a stale one never
    // reads lower than the ledger.
    #[test]
    fn kv_usage_sources() {
        let mut b = backend();
        assert!((b.kv_usage(50, false) - 0.5).abs() < 1e-9);
        b.observed = Some(Observation {
            kv_usage: Some(0.2),
            ..Observation::default()
        });
        assert!((b.kv_usage(50, false) - 0.2).abs() < 1e-9);
        assert!((b.kv_usage(50, true) - 0.5).abs() < 1e-9);
    }

    // Staleness needs both a past scrape and a configured limit.
    #[test]
    fn staleness() {
        let mut b = backend();
        assert!(!b.is_stale(10_000_000, Some(1000)));
        b.observed = Some(Observation {
            at_us: 0,
            ..Observation::default()
        });
        assert!(b.is_stale(10_000, Some(1000)));
        assert!(!b.is_stale(10_000, None));
    }

    // The prefill estimate moves toward measurements, but an outlier moves it at most 100x.
    #[test]
    fn prefill_estimate() {
        let mut b = backend();
        b.record_prefill(2000, 1_000_000);
        assert!((b.prefill_tps - 1200.0).abs() < 1e-9);
        b.record_prefill(1, 0);
        assert!((b.prefill_tps - 1200.0).abs() < 1e-9);
    }
}
