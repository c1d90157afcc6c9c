//! Work-conserving sharing: how many slots the latency tiers need kept free, so that best-effort
//! tiers (batch) may borrow every other slot instead of a fixed share.
//!
//! The latency tiers are a queue in front of the pool's slots: requests arrive at a measured rate
//! and hold a slot for a measured time. Erlang C gives, for `c` slots, the probability that an
//! arrival finds none free and how long it then waits (exponential service, as in Tempo and QLM's
//! waiting-time estimators). The headroom is the smallest `c` for which an arrival gets a slot
//! within `headroom_wait_ms` with probability `headroom_quantile`; best-effort work may hold
//! everything else. The estimates move only with `now_us`, like the rest of the core.

use super::Governor;
use crate::backend::{BackendState, EWMA_ALPHA};

/// Time constant of the arrival-rate estimate (s): long enough to smooth a Poisson stream of a
/// few requests per second, short enough to follow a shift within a minute.
pub(super) const ARRIVAL_WINDOW_S: f64 = 60.0;
/// Hold time assumed for a tier until one of its requests has completed (s).
const PRIOR_HOLD_S: f64 = 10.0;
/// How long a refusal keeps counting toward later Retry-Afters (s, exponential decay). (A
/// queue of refused clients draining linearly at the tier's rate was tried: it cut batch
/// retries in the marketing flood further, 3.4 to 2.4 per request, but its Retry-Afters ran
/// long, the batch job finished 100 s later and azure-code's tail doubled.)
const REFUSAL_MEMORY_S: f64 = 5.0;
/// How often the headroom is recomputed (µs): the inputs move on a scale of seconds.
pub(super) const RECOMPUTE_US: u64 = 100_000;

/// What a latency tier asks of the pool, measured online.
#[derive(Debug, Clone, Default)]
pub(crate) struct TierLoad {
    /// Arrivals, decaying with `ARRIVAL_WINDOW_S`, and when last updated.
    arrivals: f64,
    arrivals_at_us: u64,
    /// Mean time a completed request held its slot (s), smoothed.
    hold_s: Option<f64>,
    /// Mean KV blocks a request of the tier commits (prompt plus expected output), smoothed.
    pub blocks: Option<f64>,
    /// Recent refusals of the tier, decaying, as of `refused_at_us`: each refusal's
    /// Retry-After adds them at the tier's drain rate, so a crowd refused together is told to
    /// come back spread out at the pace its tier gets places, not all at once.
    refused: f64,
    refused_at_us: u64,
}

impl TierLoad {
    fn decayed(&self, now_us: u64) -> f64 {
        let elapsed = now_us.saturating_sub(self.arrivals_at_us) as f64 / 1e6;
        self.arrivals * (-elapsed / ARRIVAL_WINDOW_S).exp()
    }

    /// Requests per second.
    pub fn rate(&self, now_us: u64) -> f64 {
        self.decayed(now_us) / ARRIVAL_WINDOW_S
    }

    /// `rate` once one more request arrives at `now_us` (what `arrive` then makes it, to the
    /// bit: `arrive` leaves no time to decay over).
    pub fn rate_with_arrival(&self, now_us: u64) -> f64 {
        (self.decayed(now_us) + 1.0) / ARRIVAL_WINDOW_S
    }

    pub fn arrive(&mut self, now_us: u64) {
        self.arrivals = self.decayed(now_us) + 1.0;
        self.arrivals_at_us = self.arrivals_at_us.max(now_us);
    }

    pub fn held(&mut self, seconds: f64) {
        self.hold_s = Some(
            self.hold_s
                .map_or(seconds, |s| s + EWMA_ALPHA * (seconds - s)),
        );
    }

    pub fn committed(&mut self, blocks: u64) {
        let b = blocks as f64;
        self.blocks = Some(self.blocks.map_or(b, |m| m + EWMA_ALPHA * (b - m)));
    }

    /// Whether a request of the tier has completed: its hold time is measured, not the prior.
    pub fn measured(&self) -> bool {
        self.hold_s.is_some()
    }

    pub fn hold(&self) -> f64 {
        self.hold_s.unwrap_or(PRIOR_HOLD_S)
    }

    /// The tier's recent refusals at `now_us`, decaying with `REFUSAL_MEMORY_S`.
    pub fn recent_refusals(&self, now_us: u64) -> f64 {
        let elapsed = now_us.saturating_sub(self.refused_at_us) as f64 / 1e6;
        self.refused * (-elapsed / REFUSAL_MEMORY_S).exp()
    }

    pub fn refuse(&mut self, now_us: u64) {
        self.refused = self.recent_refusals(now_us) + 1.0;
        self.refused_at_us = self.refused_at_us.max(now_us);
    }
}

/// The fewest servers for which a Poisson stream offering `load` Erlangs (mean hold `hold_s`)
/// finds a server within `wait_s` with probability at least `quantile`; `limit` if even that
/// many do not suffice.
///
/// Erlang C by the Erlang B recursion (stable for any load): `B(k) = a·B(k-1) / (k + a·B(k-1))`,
/// `C(c) = c·B(c) / (c - a·(1 - B(c)))`, and `P(wait > t) = C(c)·exp(-(c - a)·t / hold)`.
pub fn servers_needed(load: f64, hold_s: f64, wait_s: f64, quantile: f64, limit: u32) -> u32 {
    if load.is_nan() || load <= 0.0 {
        return 0;
    }
    let miss = 1.0 - quantile;
    let mut erlang_b = 1.0;
    for c in 1..=limit {
        let k = f64::from(c);
        erlang_b = load * erlang_b / (k + load * erlang_b);
        if k <= load {
            continue; // an unstable queue: waits grow without bound
        }
        let erlang_c = k * erlang_b / (k - load * (1.0 - erlang_b));
        if erlang_c * (-(k - load) * wait_s / hold_s).exp() <= miss {
            return c;
        }
    }
    limit
}

impl Governor {
    /// Slots the latency tiers need free now, beyond those they already hold (pool-wide).
    pub fn headroom_slots(&self) -> u32 {
        self.headroom
    }

    /// Recompute the headroom from the latency tiers' measured load (at most every 100 ms).
    pub(super) fn update_headroom(&mut self, now_us: u64) {
        let Some(quantile) = self.config.headroom_quantile else {
            return;
        };
        if self
            .headroom_at_us
            .is_some_and(|at| now_us < at + RECOMPUTE_US)
        {
            return;
        }
        self.headroom_at_us = Some(now_us);
        let (mut load, mut rate) = (0.0, 0.0);
        let mut running = 0;
        for (t, tier) in self.config.tiers.iter().enumerate() {
            if tier.best_effort {
                continue;
            }
            let l = &self.tier_load[t];
            let r = l.rate(now_us);
            rate += r;
            load += r * l.hold();
            running += self.serving().map(|b| b.running_by_tier[t]).sum::<u32>();
        }
        let pool: u32 = self
            .serving()
            .filter(|b| b.healthy)
            .map(BackendState::slots)
            .sum();
        let hold = if rate > 0.0 {
            load / rate
        } else {
            PRIOR_HOLD_S
        };
        let wait_s = self.config.headroom_wait_ms / 1000.0;
        let needed = servers_needed(load, hold, wait_s, quantile, pool);
        self.headroom = needed.saturating_sub(running);
    }

    /// Whether a best-effort request may take a slot on backend `b` without eating into the
    /// latency tiers' headroom, in slots (pool-wide) and in KV blocks (this backend's share).
    pub(super) fn leaves_headroom(&self, b: usize, blocks: u64) -> bool {
        let headroom = self.headroom_slots();
        if headroom == 0 {
            return true;
        }
        let healthy = self.serving().filter(|x| x.healthy);
        let (pool, running) = healthy.fold((0, 0), |(p, r), x| (p + x.slots(), r + x.running));
        if running + headroom >= pool {
            return false;
        }
        let backend = &self.backends[b];
        let capacity = backend.kv_capacity_blocks;
        let (Some(target), true) = (self.config.kv_fit_target, capacity > 0) else {
            return true;
        };
        // This backend's share of the headroom, at the latency tiers' mean commitment each.
        let share = f64::from(headroom) * f64::from(backend.slots()) / f64::from(pool.max(1));
        let per_request = self
            .config
            .tiers
            .iter()
            .zip(&self.tier_load)
            .filter(|(t, _)| !t.best_effort)
            .filter_map(|(_, l)| l.blocks)
            .fold(0.0, f64::max);
        let reserved = (share * per_request).ceil() as u64;
        backend.committed_blocks + blocks + reserved <= (target * capacity as f64) as u64
    }
}

impl Governor {
    /// Whether a prompt may join the prefill work already started on backend `b`.
    ///
    /// vLLM schedules its running requests' prefill chunks before any waiting request, so a
    /// burst of long prompts started at once delays every later arrival behind all of them
    /// (and trips their first-token timeouts). Unprotected work is started at the pace the
    /// backend prefills: the prompts in prefill, its own included, must clear within the
    /// latency tiers' wait budget (`headroom_wait_ms`) at the measured prefill rate. Until then
    /// it waits in the fair queue, which holds no KV. A backend with nothing in prefill always
    /// takes one, however long.
    pub(super) fn prefill_paced(&self, b: usize, prompt: u64) -> bool {
        if self.config.headroom_quantile.is_none() {
            return true;
        }
        let backend = &self.backends[b];
        if backend.prefill_pending == 0 {
            return true;
        }
        let seconds = (backend.prefill_pending + prompt) as f64 / backend.prefill_tps;
        seconds <= self.config.headroom_wait_ms / 1000.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Textbook values: 10 Erlangs on 12 servers wait with probability C ~ 0.449; with a 1 s
    // wait allowed at a 10 s hold, 0.449·exp(-0.2) ~ 0.368 miss.
    #[test]
    fn erlang_c_matches_tables() {
        // P(wait > 0) <= 0.45 first holds at 12 servers (C(11) ~ 0.68, C(12) ~ 0.449).
        assert_eq!(servers_needed(10.0, 10.0, 0.0, 0.55, 100), 12);
        // More patience needs fewer servers; a stricter quantile needs more.
        let p99 = servers_needed(10.0, 10.0, 1.0, 0.99, 100);
        let p90 = servers_needed(10.0, 10.0, 1.0, 0.90, 100);
        assert!(p90 < p99 && p99 <= 25, "{p90} {p99}");
        assert!(servers_needed(10.0, 10.0, 5.0, 0.99, 100) < p99);
    }

    // No load needs no servers; an impossible target takes everything there is.
    #[test]
    fn edges() {
        assert_eq!(servers_needed(0.0, 10.0, 1.0, 0.99, 64), 0);
        assert_eq!(servers_needed(100.0, 10.0, 1.0, 0.99, 64), 64);
    }

    // The arrival estimate converges to a steady rate and decays when arrivals stop.
    #[test]
    fn arrival_rate() {
        let mut l = TierLoad::default();
        for i in 0..1200u64 {
            l.arrive(i * 200_000); // 5 per second for 240 s
        }
        let r = l.rate(240_000_000);
        assert!((r - 5.0).abs() < 0.2, "{r}");
        assert!(l.rate(480_000_000) < 0.2);
    }
}
