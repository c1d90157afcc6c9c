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
//!
//! Tiers shed here as in the governor's queue, lower tiers first: a tier is admitted on a
//! backend only while fewer than its `shed_at` share of that backend's light slots are taken
//! (rounded up), so a flood of a low tier's embeddings leaves the rest of the lane to
//! the more important tiers.

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
    /// Tier -> the share of a backend's slots taken past which it is refused
    /// (`tiers[].shed_at`); a tier not named here may fill them all.
    shares: FxHashMap<String, f64>,
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
            shares: FxHashMap::default(),
        })
    }

    /// Admit `tier`'s requests on a backend only while fewer than `shed_at` of its light slots
    /// are taken (rounded up, at least one slot): `tiers[].shed_at`, so lower tiers are
    /// refused first.
    ///
    /// # Errors
    /// `Config` when the share is not in [0, 1].
    pub fn set_tier_share(&mut self, tier: &str, shed_at: f64) -> PolicyResult<()> {
        if !(0.0..=1.0).contains(&shed_at) {
            return Err(PolicyError::config(
                "tiers[].shed_at",
                format!("tier `{tier}`: must be from 0 to 1"),
            ));
        }
        self.shares.insert(tier.to_owned(), shed_at);
        Ok(())
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

    /// Admit or refuse a light request of `tenant` in `tier`: its rate limit first (429
    /// `rate_limited`, Retry-After when its bucket holds a whole request again; nothing is
    /// paid), then [`acquire`](Self::acquire) on a backend where fewer than the tier's share
    /// of the slots are taken (429 `tier_shed` when there are free slots, but none within
    /// it). An admitted request pays one request.
    ///
    /// # Errors
    /// As `acquire`.
    pub fn acquire_for(
        &mut self,
        tenant: Option<&str>,
        tier: Option<&str>,
        request_id: u64,
        candidates: &[String],
        now_us: u64,
    ) -> PolicyResult<LightDecision> {
        if let Some(b) = tenant.and_then(|t| self.rates.get_mut(t)) {
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
        let share = tier
            .and_then(|t| self.shares.get(t))
            .copied()
            .unwrap_or(1.0);
        let decision = self.acquire_within(request_id, candidates, now_us, share)?;
        if matches!(decision, LightDecision::Admit { .. }) {
            if let Some(b) = tenant.and_then(|t| self.rates.get_mut(t)) {
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
        self.acquire_within(request_id, candidates, now_us, 1.0)
    }

    /// `acquire` on a backend where fewer than `share` of the slots are taken (rounded up).
    fn acquire_within(
        &mut self,
        request_id: u64,
        candidates: &[String],
        now_us: u64,
        share: f64,
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
        let held = |lane: &Lane| u32::try_from(lane.holding.len()).unwrap_or(u32::MAX);
        let free = |lane: &Lane| lane.cap.saturating_sub(held(lane));
        let within_share = |lane: &Lane| held(lane) < Self::share_of(lane.cap, share);
        let best = healthy
            .iter()
            .copied()
            .filter(|&i| free(&self.lanes[i]) > 0 && within_share(&self.lanes[i]))
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
        let shed = healthy.iter().any(|&i| free(&self.lanes[i]) > 0);
        Ok(LightDecision::Refuse {
            status: 429,
            reason: if shed { "tier_shed" } else { "light_lane_full" },
            retry_after_s: self.refusal_after_us(first_free, now_us),
        })
    }

    /// How many of a lane's `cap` slots may be taken for a tier with `share` to be let in:
    /// rounded up, so a small lane is not shut to a tier by rounding (a lane of one slot
    /// serves every tier).
    fn share_of(cap: u32, share: f64) -> u32 {
        ((f64::from(cap) * share).ceil() as u32).clamp(1, cap)
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
            admitted(&l.acquire_for(Some("t"), None, id, &[], 0).unwrap());
        }
        let refused = l.acquire_for(Some("t"), None, 3, &[], 100_000).unwrap();
        assert_eq!(
            refused,
            LightDecision::Refuse {
                status: 429,
                reason: "rate_limited",
                retry_after_s: 1
            }
        );
        assert_eq!(l.live(), 2);
        admitted(&l.acquire_for(Some("t"), None, 4, &[], 500_000).unwrap()); // 1 refilled at 0.5 s
        admitted(&l.acquire_for(Some("other"), None, 5, &[], 500_000).unwrap());
        // no limit of its own
    }

    // Lower tiers shed first: batch (shed_at 0.5) is let in while fewer than 5 of 10 slots are
    // taken, then refused with `tier_shed` while vip still gets the rest.
    #[test]
    fn a_tier_fills_only_its_share_of_the_slots() {
        let mut l = lane(&[("a", 10)]);
        l.set_tier_share("batch", 0.5).unwrap();
        assert!(l.set_tier_share("batch", -0.1).is_err());
        assert!(l.set_tier_share("batch", f64::NAN).is_err());
        assert!(l.set_tier_share("batch", 1.5).is_err());
        for id in 1..=5 {
            admitted(&l.acquire_for(Some("t"), Some("batch"), id, &[], 0).unwrap());
        }
        assert!(matches!(
            l.acquire_for(Some("t"), Some("batch"), 6, &[], 0).unwrap(),
            LightDecision::Refuse { status: 429, reason: "tier_shed", retry_after_s } if retry_after_s >= 1
        ));
        for id in 7..=11 {
            admitted(&l.acquire_for(Some("v"), Some("vip"), id, &[], 0).unwrap());
        }
        assert!(matches!(
            l.acquire_for(Some("v"), Some("vip"), 12, &[], 0).unwrap(),
            LightDecision::Refuse {
                reason: "light_lane_full",
                ..
            }
        ));
        for id in 7..=11 {
            assert!(l.release(id, 10)); // vip leaves: 5 taken, batch's share, still shed
        }
        assert!(matches!(
            l.acquire_for(Some("t"), Some("batch"), 13, &[], 10)
                .unwrap(),
            LightDecision::Refuse {
                reason: "tier_shed",
                ..
            }
        ));
        assert!(l.release(1, 20)); // below half taken: batch is let in again
        admitted(
            &l.acquire_for(Some("t"), Some("batch"), 14, &[], 20)
                .unwrap(),
        );
        assert_eq!(l.live(), 5);
    }

    // A share rounds up, so a one-slot lane serves every tier and 0.5 of 3 slots is 2.
    #[test]
    fn a_share_rounds_up() {
        let mut l = lane(&[("a", 1), ("b", 3)]);
        l.set_tier_share("batch", 0.5).unwrap();
        let only = |name: &str| vec![name.to_owned()];
        let batch = |l: &mut LightLane, id| l.acquire_for(None, Some("batch"), id, &only("b"), 0);
        assert_eq!(
            admitted(
                &l.acquire_for(None, Some("batch"), 1, &only("a"), 0)
                    .unwrap()
            ),
            "a"
        );
        assert_eq!(admitted(&batch(&mut l, 2).unwrap()), "b");
        assert_eq!(admitted(&batch(&mut l, 3).unwrap()), "b"); // ceil(0.5 * 3) = 2
        assert!(matches!(
            batch(&mut l, 4).unwrap(),
            LightDecision::Refuse {
                reason: "tier_shed",
                ..
            }
        ));
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
