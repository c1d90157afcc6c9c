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
    /// The cap the per-token latency target allows now (`tpot_target_ms`; `cap` without one).
    pub tpot_cap: u32,
    /// Requests past their first token (decoding), and tokens they generated since
    /// `decode_at_us`, for the time-per-output-token measurement.
    pub decoding: u32,
    decoded: u64,
    decode_at_us: Option<u64>,
    decoding_at_sample: u32,
    /// Seconds per output token while decoding, smoothed; `None` until measured.
    pub tpot_s: Option<f64>,
    pub kv_capacity_blocks: u64,
    /// Requests holding a slot here (on a prefill instance: prefill hops).
    pub running: u32,
    /// A prefill instance of a split pool: its slots hold prefill hops of requests that run
    /// on a decode instance, so it adds nothing to the requests running or the slots serving
    /// them (`Governor::running`, `drain_rate`, the headroom pool).
    pub prefill_only: bool,
    /// Slots other gateway replicas hold (their shared store's count; 0 with one replica).
    pub elsewhere: u32,
    /// Weight of the tenants other replicas have waiting (0 with one replica).
    pub waiting_elsewhere: f64,
    /// The part of `waiting_elsewhere` on the replicas ordered before this one.
    pub waiting_before: f64,
    pub running_by_tier: Vec<u32>,
    /// Prompt tokens of running requests still waiting for their first token.
    pub prefill_pending: u64,
    /// KV blocks the running requests are expected to need at their peak (see `kv_fit_target`).
    pub committed_blocks: u64,
    pub healthy: bool,
    pub observed: Option<Observation>,
    pub preemptions_seen: Option<u64>,
    pub preemptions_total: u64,
    /// Prefill tokens per second, smoothed (EWMA), measured while prefill work was waiting.
    pub prefill_tps: f64,
    /// Prompt tokens prefilled (their first token seen) since `sample_at_us`, and the prefill
    /// work pending then.
    prefilled: u64,
    sample_at_us: Option<u64>,
    pending_at_sample: u64,
}

/// Shortest interval over which a prefill-throughput or time-per-token sample is taken (µs).
const SAMPLE_US: u64 = 500_000;

/// Weight of a new sample in the smoothed estimates: recent enough to follow load shifts,
/// smooth enough that one odd request does not swing admission.
pub const EWMA_ALPHA: f64 = 0.2;

impl BackendState {
    pub fn new(config: &BackendConfig, per_gpu: u32, tiers: usize, prefill_tps: f64) -> Self {
        Self {
            name: config.name.clone(),
            cap: config.gpus * per_gpu,
            tpot_cap: config.gpus * per_gpu,
            decoding: 0,
            decoded: 0,
            decode_at_us: None,
            decoding_at_sample: 0,
            tpot_s: None,
            kv_capacity_blocks: config.kv_blocks,
            running: 0,
            prefill_only: config.role == crate::config::BackendRole::Prefill,
            elsewhere: 0,
            waiting_elsewhere: 0.0,
            waiting_before: 0.0,
            running_by_tier: vec![0; tiers],
            prefill_pending: 0,
            committed_blocks: 0,
            healthy: true,
            observed: None,
            preemptions_seen: None,
            preemptions_total: 0,
            prefill_tps,
            prefilled: 0,
            sample_at_us: None,
            pending_at_sample: 0,
        }
    }

    /// Slots usable now: the cap, or less while the per-token latency target holds it down,
    /// less those other replicas hold.
    pub fn slots(&self) -> u32 {
        self.cap.min(self.tpot_cap).saturating_sub(self.elsewhere)
    }

    pub fn record_decoded(&mut self, tokens: u64) {
        self.decoded += tokens;
    }

    /// Take a time-per-output-token sample over the interval since the last one (>= 500 ms,
    /// with requests decoding throughout): decoding requests x elapsed / tokens they made.
    /// Returns the smoothed figure when a sample was taken.
    pub fn sample_tpot(&mut self, now_us: u64) -> Option<f64> {
        let mut sampled = None;
        if let Some(at) = self.decode_at_us {
            let elapsed = now_us.saturating_sub(at);
            if elapsed < SAMPLE_US {
                return None;
            }
            let decoding = f64::from(self.decoding_at_sample + self.decoding) / 2.0;
            if self.decoding_at_sample > 0 && self.decoding > 0 && self.decoded > 0 {
                let sample = decoding * (elapsed as f64 / 1e6) / self.decoded as f64;
                let tpot = self
                    .tpot_s
                    .map_or(sample, |t| t + EWMA_ALPHA * (sample - t));
                self.tpot_s = Some(tpot);
                sampled = Some(tpot);
            }
        }
        self.decoded = 0;
        self.decode_at_us = Some(now_us);
        self.decoding_at_sample = self.decoding;
        sampled
    }

    /// Follow the per-token latency target: over it, shrink the cap in proportion (at most
    /// by half); well under it while every slot is taken, grow by an eighth. Never below one
    /// slot or above `cap`.
    pub fn follow_tpot(&mut self, tpot_s: f64, target_s: f64) {
        if tpot_s > target_s {
            let scaled = (f64::from(self.running) * (target_s / tpot_s).max(0.5)).floor() as u32;
            self.tpot_cap = scaled.clamp(1, self.cap).min(self.tpot_cap);
        } else if tpot_s < 0.8 * target_s && self.running >= self.slots() {
            self.tpot_cap = (self.tpot_cap + (self.tpot_cap / 8).max(1)).min(self.cap);
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

    /// Count a prompt whose first token came out `elapsed_us` after it started (0: it shared
    /// the backend's prefill with others, so its own time bounds nothing), and take a
    /// throughput sample when due.
    ///
    /// The rate is measured as prompt tokens completed per second over intervals of at least
    /// 500 ms that began with prefill work pending: a busy backend's throughput, not the
    /// arrival rate of an idle one. (Timing each request's first token against all the work
    /// ahead of it overestimates badly: a long prompt counts whole until its first token even
    /// when vLLM has chunked most of it already.) A lightly loaded backend is seldom busy for
    /// a whole interval, so a prompt that had the prefill to itself also gives a lower bound,
    /// its own tokens over its own time to first token, which may only raise the estimate.
    pub fn record_prefill(&mut self, prompt: u64, elapsed_us: u64, now_us: u64) {
        self.prefilled += prompt;
        if elapsed_us > 0 && prompt > 0 {
            let floor = prompt as f64 / (elapsed_us as f64 / 1e6);
            if floor > self.prefill_tps {
                let clamped = floor.min(self.prefill_tps * 100.0);
                self.prefill_tps += EWMA_ALPHA * (clamped - self.prefill_tps);
            }
        }
        self.sample_prefill(now_us);
    }

    /// A split request's prefill hop here answered (or its first token came): its prompt
    /// counts as prefilled (`record_prefill`), and its slot and prefill work leave.
    pub fn prefill_hop_answered(&mut self, tier: usize, prompt: u64, alone_us: u64, now_us: u64) {
        self.record_prefill(prompt, alone_us, now_us);
        self.prefill_hop_ended(tier, prompt);
    }

    /// A split request's prefill hop on this prefill instance is over (answered, or the
    /// request ended first): its slot and its prompt's prefill work leave.
    pub fn prefill_hop_ended(&mut self, tier: usize, prompt: u64) {
        self.running -= 1;
        self.running_by_tier[tier] -= 1;
        self.prefill_pending -= prompt;
    }

    /// Take a prefill-throughput sample if one is due (also called on every scrape).
    pub fn sample_prefill(&mut self, now_us: u64) {
        let Some(at) = self.sample_at_us else {
            self.restart_sample(now_us);
            return;
        };
        let elapsed = now_us.saturating_sub(at);
        if elapsed < SAMPLE_US {
            return;
        }
        if self.pending_at_sample > 0 && self.prefilled > 0 {
            let sample = self.prefilled as f64 / (elapsed as f64 / 1e6);
            let clamped = sample.clamp(self.prefill_tps / 100.0, self.prefill_tps * 100.0);
            self.prefill_tps += EWMA_ALPHA * (clamped - self.prefill_tps);
        }
        self.restart_sample(now_us);
    }

    fn restart_sample(&mut self, now_us: u64) {
        self.prefilled = 0;
        self.sample_at_us = Some(now_us);
        self.pending_at_sample = self.prefill_pending;
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
            models: vec![],
            role: crate::config::BackendRole::Both,
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

    // The prefill estimate moves toward the tokens a busy backend prefills per second; an
    // interval that began with nothing pending, or is shorter than 500 ms, is no sample.
    #[test]
    fn prefill_estimate() {
        let mut b = backend();
        b.prefill_pending = 4000;
        b.sample_prefill(0);
        b.record_prefill(1000, 1_000_000, 250_000);
        assert!((b.prefill_tps - 1000.0).abs() < 1e-9);
        b.record_prefill(1000, 1_000_000, 1_000_000); // 2000 tokens in 1 s
        assert!((b.prefill_tps - 1200.0).abs() < 1e-9);
        b.prefill_pending = 0;
        b.sample_prefill(2_000_000);
        b.record_prefill(100, 1_000_000, 3_000_000); // began idle: the arrival rate
        assert!((b.prefill_tps - 1200.0).abs() < 1e-9);
        // A prompt of 3000 tokens prefilled alone in 1 s: at least 3000 tokens/s.
        b.record_prefill(3000, 1_000_000, 3_100_000);
        assert!((b.prefill_tps - 1560.0).abs() < 1e-9);
    }

    // Time per output token: 10 requests decoding for 1 s made 200 tokens, 50 ms a token.
    // Over a 25 ms target the cap shrinks to the running count scaled by target/measured (at
    // most by half); well under it, with every slot taken, it grows by an eighth up to `cap`.
    #[test]
    fn tpot_follows_the_target() {
        let mut b = backend(); // cap 32
        b.decoding = 10;
        assert_eq!(b.sample_tpot(0), None);
        b.record_decoded(200);
        assert_eq!(b.sample_tpot(1_000_000), Some(0.05));
        b.running = 20;
        b.follow_tpot(0.05, 0.025);
        assert_eq!(b.slots(), 10);
        b.follow_tpot(0.01, 0.025); // under target but slots not full: no growth
        b.running = 10;
        b.follow_tpot(0.01, 0.025);
        assert_eq!(b.slots(), 11);
        for _ in 0..40 {
            b.running = b.slots();
            b.follow_tpot(0.01, 0.025);
        }
        assert_eq!(b.slots(), 32);
    }
}
