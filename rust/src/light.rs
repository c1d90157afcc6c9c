//! The light lane: vLLM's routes that generate no tokens (embeddings, rerank, score, tokenize,
//! detokenize, audio) under a cap of their own per backend.
//!
//! These requests are short and their cost is not the decode slots and KV that the governor
//! accounts, so they do not go through it: they would queue behind generations and take slots
//! the latency tiers need. They still need a bound, or a flood of embeddings starves the
//! engine. The lane admits a request on the healthy candidate backend with the most free light
//! slots, or refuses it at once with a computed Retry-After: the time until the first slot is
//! expected to free (each slot's start plus the measured mean hold time), plus a spread, so a
//! crowd refused together comes back over the lane's drain time instead of all at once. It
//! reads no clock: time is an argument, in microseconds, like everywhere in the core.

use rustc_hash::FxHashMap;

use crate::error::{PolicyError, PolicyResult};
use crate::runtime::wire_retry_after;

/// The mean hold time the lane assumes before it has measured one (tokenize takes
/// milliseconds, a long embedding batch a second).
const SEED_HOLD_US: f64 = 500_000.0;
/// Weight of each new hold-time sample in the running mean.
const HOLD_ALPHA: f64 = 0.2;

/// What the lane says to a light request.
#[derive(Debug, Clone, PartialEq)]
pub enum LightDecision {
    /// Send it to this backend now; call `release` when its reply is over.
    Admit { backend: String },
    /// Answer with this status and Retry-After; nothing is held.
    Refuse {
        status: u16,
        reason: &'static str,
        retry_after_s: u32,
    },
}

#[derive(Debug, Clone)]
struct Lane {
    name: String,
    cap: u32,
    healthy: bool,
    /// Start times of the requests it holds (the earliest frees first, on average).
    holding: Vec<u64>,
}

/// Per-backend caps on light requests, and the refusal when all are full.
#[derive(Debug, Clone)]
pub struct LightLane {
    lanes: Vec<Lane>,
    /// request id -> (lane index, start time).
    live: FxHashMap<u64, (usize, u64)>,
    mean_hold_us: f64,
    /// Refusals told to come back within the current drain window: each is spread further.
    recent_refusals: Vec<u64>,
    /// The gateway is shutting down: every newcomer is refused with 503.
    draining: bool,
    /// Per-tenant request buckets (`tenants[].requests_per_s`): a tenant's rate limit holds
    /// on the light routes too, or embeddings would be a way around it.
    rates: FxHashMap<String, Bucket>,
}

/// A token bucket of requests: `rate` per second, holding at most `max(rate, 1)`.
#[derive(Debug, Clone)]
struct Bucket {
    rate: f64,
    tokens: f64,
    at_us: u64,
}

impl LightLane {
    /// A lane per backend, each with its cap (at least 1).
    ///
    /// # Errors
    /// `Config` when there is no backend, a name repeats or a cap is 0.
    pub fn new(backends: &[(String, u32)]) -> PolicyResult<Self> {
        if backends.is_empty() {
            return Err(PolicyError::config(
                "backends",
                "the light lane needs a backend",
            ));
        }
        let mut lanes: Vec<Lane> = Vec::with_capacity(backends.len());
        for (name, cap) in backends {
            if *cap == 0 {
                return Err(PolicyError::config(
                    "backends[].light_concurrency",
                    format!("backend `{name}`: must be at least 1"),
                ));
            }
            if lanes.iter().any(|l| &l.name == name) {
                return Err(PolicyError::config("backends", format!("`{name}` repeats")));
            }
            lanes.push(Lane {
                name: name.clone(),
                cap: *cap,
                healthy: true,
                holding: Vec::new(),
            });
        }
        Ok(Self {
            lanes,
            live: FxHashMap::default(),
            mean_hold_us: SEED_HOLD_US,
            recent_refusals: Vec::new(),
            draining: false,
            rates: FxHashMap::default(),
        })
    }

    /// Limit `tenant` to `requests_per_s` light requests a second (its bucket starts full).
    ///
    /// # Errors
    /// `Config` when the rate is not a finite number above 0.
    pub fn set_rate(&mut self, tenant: &str, requests_per_s: f64) -> PolicyResult<()> {
        if !(requests_per_s.is_finite() && requests_per_s > 0.0) {
            return Err(PolicyError::config(
                "tenants[].requests_per_s",
                format!("tenant `{tenant}`: must be a number above 0"),
            ));
        }
        let bucket = Bucket {
            rate: requests_per_s,
            tokens: requests_per_s.max(1.0),
            at_us: 0,
        };
        self.rates.insert(tenant.to_owned(), bucket);
        Ok(())
    }

    /// Admit or refuse a light request of `tenant`: its rate limit first (429
    /// `rate_limited`, Retry-After when its bucket holds a whole request again; nothing is
    /// paid), then [`acquire`](Self::acquire). An admitted request pays one request.
    ///
    /// # Errors
    /// As `acquire`.
    pub fn acquire_for(
        &mut self,
        tenant: &str,
        request_id: u64,
        candidates: &[String],
        now_us: u64,
    ) -> PolicyResult<LightDecision> {
        if let Some(b) = self.rates.get_mut(tenant) {
            let elapsed = now_us.saturating_sub(b.at_us) as f64 / 1e6;
            b.at_us = b.at_us.max(now_us);
            b.tokens = (b.tokens + b.rate * elapsed).min(b.rate.max(1.0));
            if b.tokens < 1.0 {
                let wait_s = (1.0 - b.tokens) / b.rate;
                return Ok(LightDecision::Refuse {
                    status: 429,
                    reason: "rate_limited",
                    retry_after_s: wire_retry_after(wait_s),
                });
            }
        }
        let decision = self.acquire(request_id, candidates, now_us)?;
        if matches!(decision, LightDecision::Admit { .. }) {
            if let Some(b) = self.rates.get_mut(tenant) {
                b.tokens -= 1.0;
            }
        }
        Ok(decision)
    }

    /// Admit or refuse a light request.
    ///
    /// `candidates`: the backends that serve what it asks for (all of them when empty).
    ///
    /// # Errors
    /// `DuplicateRequest` when `request_id` is still held; `UnknownBackend` for a candidate
    /// that is not configured.
    pub fn acquire(
        &mut self,
        request_id: u64,
        candidates: &[String],
        now_us: u64,
    ) -> PolicyResult<LightDecision> {
        if self.live.contains_key(&request_id) {
            return Err(PolicyError::DuplicateRequest(request_id));
        }
        let wanted = self.candidate_lanes(candidates)?;
        if self.draining {
            return Ok(LightDecision::Refuse {
                status: 503,
                reason: "draining",
                retry_after_s: self.refusal_after_us(0.0, now_us),
            });
        }
        let healthy: Vec<usize> = wanted
            .into_iter()
            .filter(|&i| self.lanes[i].healthy)
            .collect();
        if healthy.is_empty() {
            return Ok(LightDecision::Refuse {
                status: 503,
                reason: "no_healthy_backend",
                retry_after_s: self.refusal_after_us(0.0, now_us),
            });
        }
        let free = |lane: &Lane| lane.cap - u32::try_from(lane.holding.len()).unwrap_or(u32::MAX);
        let best = healthy
            .iter()
            .copied()
            .filter(|&i| free(&self.lanes[i]) > 0)
            .max_by_key(|&i| (free(&self.lanes[i]), std::cmp::Reverse(i)));
        if let Some(i) = best {
            self.lanes[i].holding.push(now_us);
            self.live.insert(request_id, (i, now_us));
            return Ok(LightDecision::Admit {
                backend: self.lanes[i].name.clone(),
            });
        }
        // Full: the first slot is expected to free at its start plus the mean hold time.
        let first_free = healthy
            .iter()
            .flat_map(|&i| self.lanes[i].holding.iter())
            .map(|&start| (start as f64 + self.mean_hold_us - now_us as f64).max(0.0))
            .fold(f64::INFINITY, f64::min);
        Ok(LightDecision::Refuse {
            status: 429,
            reason: "light_lane_full",
            retry_after_s: self.refusal_after_us(first_free, now_us),
        })
    }

    /// The request's reply is over (completed, failed or the client left).
    ///
    /// Returns `false` for an id the lane does not hold (a second release is a no-op).
    pub fn release(&mut self, request_id: u64, now_us: u64) -> bool {
        let Some((lane, start)) = self.live.remove(&request_id) else {
            return false;
        };
        let holding = &mut self.lanes[lane].holding;
        if let Some(at) = holding.iter().position(|&s| s == start) {
            holding.swap_remove(at);
        }
        let held = now_us.saturating_sub(start) as f64;
        self.mean_hold_us += HOLD_ALPHA * (held - self.mean_hold_us);
        true
    }

    /// A backend's health (from the runtime's `SetHealth`): unhealthy ones get no requests.
    ///
    /// # Errors
    /// `UnknownBackend` when it is not configured.
    pub fn set_health(&mut self, backend: &str, healthy: bool) -> PolicyResult<()> {
        let i = self.index(backend)?;
        self.lanes[i].healthy = healthy;
        Ok(())
    }

    /// The gateway drains: refuse every newcomer (those held finish as usual).
    pub fn start_draining(&mut self) {
        self.draining = true;
    }

    /// Light requests a backend holds now.
    ///
    /// # Errors
    /// `UnknownBackend` when it is not configured.
    pub fn in_flight(&self, backend: &str) -> PolicyResult<u32> {
        let lane = &self.lanes[self.index(backend)?];
        Ok(u32::try_from(lane.holding.len()).unwrap_or(u32::MAX))
    }

    /// Light requests held on every backend together.
    #[must_use]
    pub fn live(&self) -> usize {
        self.live.len()
    }

    fn index(&self, backend: &str) -> PolicyResult<usize> {
        self.lanes
            .iter()
            .position(|l| l.name == backend)
            .ok_or_else(|| PolicyError::UnknownBackend(backend.to_owned()))
    }

    fn candidate_lanes(&self, candidates: &[String]) -> PolicyResult<Vec<usize>> {
        if candidates.is_empty() {
            return Ok((0..self.lanes.len()).collect());
        }
        candidates.iter().map(|c| self.index(c)).collect()
    }

    /// Retry-After for a refusal: the wait until a slot frees, plus this refusal's place among
    /// those refused within one drain window, spread at the lane's drain rate.
    fn refusal_after_us(&mut self, first_free_us: f64, now_us: u64) -> u32 {
        let window = self.mean_hold_us.max(1_000_000.0);
        self.recent_refusals
            .retain(|&at| (now_us.saturating_sub(at) as f64) < window);
        let ahead = self.recent_refusals.len() as f64;
        self.recent_refusals.push(now_us);
        let capacity: u32 = self.lanes.iter().map(|l| l.cap).sum();
        let drain_per_us = f64::from(capacity) / self.mean_hold_us;
        let wait_us = first_free_us + ahead / drain_per_us;
        wire_retry_after(wait_us / 1e6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lane(caps: &[(&str, u32)]) -> LightLane {
        let owned: Vec<(String, u32)> = caps.iter().map(|(n, c)| ((*n).to_owned(), *c)).collect();
        LightLane::new(&owned).unwrap()
    }

    fn admitted(decision: &LightDecision) -> &str {
        match decision {
            LightDecision::Admit { backend } => backend,
            LightDecision::Refuse { .. } => panic!("refused: {decision:?}"),
        }
    }

    // A tenant's rate limit holds on the lane: 2/s admits 2 at once, refuses the third with
    // the wait until a whole request has refilled, and nothing refused is paid for.
    #[test]
    fn a_tenants_rate_limit_holds_and_a_refusal_costs_nothing() {
        let mut l = lane(&[("a", 10)]);
        l.set_rate("t", 2.0).unwrap();
        assert!(l.set_rate("t", f64::NAN).is_err());
        for id in 1..=2 {
            admitted(&l.acquire_for("t", id, &[], 0).unwrap());
        }
        let refused = l.acquire_for("t", 3, &[], 100_000).unwrap();
        assert_eq!(
            refused,
            LightDecision::Refuse {
                status: 429,
                reason: "rate_limited",
                retry_after_s: 1
            }
        );
        assert_eq!(l.live(), 2);
        admitted(&l.acquire_for("t", 4, &[], 500_000).unwrap()); // 1 refilled at 0.5 s
        admitted(&l.acquire_for("other", 5, &[], 500_000).unwrap()); // no limit of its own
    }

    // The backend with the most free slots gets the request; the cap is never passed.
    #[test]
    fn admits_up_to_the_cap_then_refuses_with_retry_after() {
        let mut l = lane(&[("a", 2), ("b", 1)]);
        assert_eq!(admitted(&l.acquire(1, &[], 0).unwrap()), "a");
        assert_eq!(admitted(&l.acquire(2, &[], 0).unwrap()), "a");
        assert_eq!(admitted(&l.acquire(3, &[], 0).unwrap()), "b");
        let refused = l.acquire(4, &[], 0).unwrap();
        assert!(matches!(
            refused,
            LightDecision::Refuse { status: 429, reason: "light_lane_full", retry_after_s } if retry_after_s >= 1
        ));
        assert_eq!(l.in_flight("a").unwrap(), 2);
        assert!(l.release(1, 100_000));
        assert_eq!(admitted(&l.acquire(4, &[], 100_000).unwrap()), "a");
    }

    // Releasing twice, or an id never held, changes nothing.
    #[test]
    fn release_is_idempotent() {
        let mut l = lane(&[("a", 1)]);
        l.acquire(1, &[], 0).unwrap();
        assert!(l.release(1, 10));
        assert!(!l.release(1, 20));
        assert!(!l.release(9, 20));
        assert_eq!(l.live(), 0);
        assert_eq!(l.in_flight("a").unwrap(), 0);
    }

    // Only the named candidates are used, and an unhealthy one is skipped (503 when none).
    #[test]
    fn candidates_and_health() {
        let mut l = lane(&[("a", 4), ("b", 1)]);
        assert_eq!(admitted(&l.acquire(1, &["b".into()], 0).unwrap()), "b");
        l.set_health("a", false).unwrap();
        assert!(matches!(
            l.acquire(2, &["a".into()], 0).unwrap(),
            LightDecision::Refuse { status: 503, .. }
        ));
        assert!(l.acquire(3, &["zzz".into()], 0).is_err());
        assert!(l.acquire(1, &[], 0).is_err()); // still live
    }

    // Draining refuses newcomers with 503 and lets the held ones release.
    #[test]
    fn draining_refuses_newcomers() {
        let mut l = lane(&[("a", 4)]);
        l.acquire(1, &[], 0).unwrap();
        l.start_draining();
        assert!(matches!(
            l.acquire(2, &[], 0).unwrap(),
            LightDecision::Refuse {
                status: 503,
                reason: "draining",
                ..
            }
        ));
        assert!(l.release(1, 10));
    }

    // A crowd refused at one instant is spread: later refusals are told to wait longer.
    #[test]
    fn refusals_are_spread() {
        let mut l = lane(&[("a", 1)]);
        l.acquire(1, &[], 0).unwrap();
        let waits: Vec<u32> = (2..40)
            .map(|id| match l.acquire(id, &[], 0).unwrap() {
                LightDecision::Refuse { retry_after_s, .. } => retry_after_s,
                LightDecision::Admit { .. } => panic!("admitted past the cap"),
            })
            .collect();
        assert!(waits.windows(2).all(|w| w[0] <= w[1]));
        assert!(waits.last() > waits.first());
    }

    // A zero cap is a config error that names the key.
    #[test]
    fn zero_cap_is_refused() {
        let err = LightLane::new(&[("a".into(), 0)]).unwrap_err();
        assert!(err.to_string().contains("light_concurrency"));
    }
}
