//! Shedding: who may not wait, how long to tell refused clients to stay away, and how much of
//! a backend a tier may use.
//!
//! Every rule here is a pure reading of the governor's state except the refusal memory and the
//! breaker's cool-down, which only ever move forward with `now_us`.

use super::{us, Governor};
use crate::config::{Strategy, TierConfig};
use crate::types::RejectReason;

impl Governor {
    /// When the waiting places a tier may use are all taken, a newcomer may push out a queued
    /// request instead of being refused: first from the least important tier below its own
    /// (so VIP is never refused while normal waits), else — inside its tier — the newest request
    /// of the tenant furthest over its weighted share, if that tenant holds more than the
    /// newcomer's would (so a heavy tenant filling the queue cannot lock a light one out).
    ///
    /// Returns the victim's id and tier.
    pub(super) fn displacement_victim(&self, tenant: u32, tier_idx: usize) -> Option<(u64, usize)> {
        let load =
            |t: u32, extra: usize| (self.queue.tenant_len(t) + extra) as f64 / self.queue.weight(t);
        let heaviest = |tier: usize, except: Option<u32>| {
            self.tier_tenants[tier]
                .iter()
                .copied()
                .filter(|&t| Some(t) != except && self.queue.tenant_len(t) > 0)
                .max_by(|&a, &b| load(a, 0).total_cmp(&load(b, 0)).then(b.cmp(&a)))
        };
        let lower = (tier_idx + 1..self.config.tiers.len())
            .rev()
            .find(|&t| self.queue.tier_len(t) > 0);
        let (victim, tier) = if let Some(tier) = lower {
            (heaviest(tier, None)?, tier)
        } else {
            let candidate = heaviest(tier_idx, Some(tenant))?;
            (
                (load(candidate, 0) > load(tenant, 1)).then_some(candidate)?,
                tier_idx,
            )
        };
        self.queue.newest(victim).map(|item| (item.id, tier))
    }

    /// Requests of a tier that leave per second while it is saturated: its requests running on
    /// healthy backends over their measured hold time. Refused clients of the tier get places
    /// at this pace, whatever other tiers do (a batch crowd told to come back at the pace short
    /// business calls finish would come back far too soon). With none running: `drain_rate`.
    pub(super) fn tier_drain(&self, tier_idx: usize) -> f64 {
        let running: u32 = self
            .serving()
            .filter(|b| b.healthy)
            .map(|b| b.running_by_tier[tier_idx])
            .sum();
        if running == 0 {
            return self.drain_rate();
        }
        f64::from(running) / self.tier_load[tier_idx].hold()
    }

    /// Whether the tier is in a sustained overload: over the last minute its requests arrived
    /// faster than it drains them. Only then does the TTFT SLA refuse: a queue that only grows
    /// can be kept on time by refusing early, and nothing else will. A burst the tier drains
    /// faster than it arrives on average is left to the queue: refusing it does not make less
    /// of it late (the backends serve the same work), it reorders who is late, and every
    /// refused client adds its backoff and a retry to the tail, where the queue's own order
    /// bounds the worst wait (azure-code: a 33 s TTFT p99 against vLLM's 20 s).
    pub(super) fn sustained_overload(&self, tier_idx: usize, now_us: u64) -> bool {
        self.tier_load[tier_idx].rate(now_us) > self.tier_drain(tier_idx)
    }

    /// Whether the tier is overwhelmed: the excess of its arrivals over its drain in a minute
    /// is more than it drains within the queue's wait limit, so the queue overflows within the
    /// minute and its requests are refused or time out whatever the order (arrivals above 1.5
    /// times the drain, with the default 30 s wait). Only then do its requests past the TTFT
    /// SLA go behind those still on time (`lapse`). Measured: the brownout scenario's surge
    /// runs at 3 to 8 times its drain; azure-code's bursts and fairness's heavy tenant stay
    /// within 1.55 and 1.16, where first come, first served keeps their tails shortest.
    pub(super) fn overwhelmed(&self, tier_idx: usize, now_us: u64) -> bool {
        let wait_s = self.config.queue_timeout_ms.unwrap_or(0.0) / 1000.0;
        let room = 1.0 + wait_s / super::headroom::ARRIVAL_WINDOW_S;
        self.tier_load[tier_idx].rate(now_us) > self.tier_drain(tier_idx) * room
    }

    /// The waiting places a newcomer of the tier may fill: (its tier's, the whole queue's).
    ///
    /// Configured, they are `shed_at` of `max_waiting` and `max_waiting`. A latency tier may
    /// also hold (unless `queue_follows_drain` is off, which makes `max_waiting` a hard bound)
    /// what it drains within the queue's own wait limit (`queue_timeout_ms`), as in
    /// Little's law: a request queued there is served before its queue deadline, so refusing
    /// it for room would only add a client's backoff to its wait, while a burst beyond that
    /// room would wait past the deadline anyway. Best-effort tiers get no such room (their
    /// requests hold slots for minutes, and more of them waiting only delays the rest). The
    /// room of a latency tier is open to every more important tier too, which could displace
    /// its requests there anyway: so no tier is refused for room a less important one gets.
    /// Only a measured drain counts (a tier with a completed request): the prior hold time is
    /// a guess, and the configured places stand until it is replaced.
    pub(super) fn waiting_room(&self, tier_idx: usize) -> (usize, usize) {
        let tier = &self.config.tiers[tier_idx];
        let max_waiting = self.config.max_waiting as usize;
        let shed = (tier.shed_at * max_waiting as f64).floor() as usize;
        let limit = self
            .config
            .queue_timeout_ms
            .filter(|_| self.config.queue_follows_drain);
        let drained = limit.map_or(0, |ms| {
            (tier_idx..self.config.tiers.len())
                .filter(|&t| !self.config.tiers[t].best_effort && self.tier_load[t].measured())
                .map(|t| (self.tier_drain(t) * ms / 1000.0) as usize)
                .max()
                .unwrap_or(0)
        });
        (shed.max(drained), max_waiting.max(drained))
    }

    /// Seconds the tier's recent refusals need to be served at its drain rate.
    pub(super) fn refusal_backlog_s(&self, tier_idx: usize, now_us: u64) -> f64 {
        self.tier_load[tier_idx].recent_refusals(now_us) / self.tier_drain(tier_idx)
    }

    pub(super) fn note_refusal(&mut self, reason: RejectReason, tier_idx: usize, now_us: u64) {
        if matches!(reason, RejectReason::Draining | RejectReason::RateLimited) {
            return; // a rate limit's Retry-After is exact: no crowd to spread
        }
        self.tier_load[tier_idx].refuse(now_us);
    }

    /// The time for enough running work to finish that KV usage falls below the threshold, when
    /// every healthy backend is above it.
    pub(super) fn kv_pressure_retry(&self, now_us: u64, drain: f64) -> Option<f64> {
        let threshold = self.config.kv_pressure_threshold?;
        let lowest = (0..self.backends.len())
            .filter(|&i| self.backends[i].healthy)
            .map(|i| self.backend_kv_usage(i, now_us))
            .fold(f64::INFINITY, f64::min);
        if lowest <= threshold {
            return None;
        }
        let running = f64::from(self.running().max(1));
        let must_finish = (running * (lowest - threshold) / lowest).ceil().max(1.0);
        Some(must_finish / drain)
    }

    /// Seconds by which the prefill work ahead of a new request overshoots the TTFT SLA.
    ///
    /// Only the work ahead counts: a request whose own prompt takes longer than the SLA is not
    /// refused for it (no amount of waiting would help). Ahead are the prompts running without
    /// a first token, every queued prompt of more important tiers, and — inside its own tier's
    /// fresh lane (the late lane waits behind it), under fair order — its tenant's own queued
    /// prompts plus, from each other tenant, at most the weighted share that tenant gets served
    /// meanwhile. So a heavy tenant's backlog does not make a light tenant's requests look
    /// late.
    pub(super) fn sla_excess(
        &self,
        tenant: u32,
        tier_idx: usize,
        prompt: u64,
        pool: u32,
    ) -> Option<f64> {
        let sla_s = self.config.ttft_sla_ms? / 1000.0;
        // Only the request's model pool: another model's backlog waits for other backends and
        // does not delay this request's first token.
        let q = &self.queue;
        let higher: u64 = (0..tier_idx)
            .map(|t| q.pool_tier_prompt_tokens(pool, t))
            .sum();
        let same = if q.strategy() == Strategy::Fair {
            let own = q.pool_tenant_fresh_prompt_tokens(pool, tenant);
            let served = (own + prompt) as f64 / q.weight(tenant);
            let others: u64 = self.tier_tenants[tier_idx]
                .iter()
                .filter(|&&t| t != tenant)
                .map(|&t| {
                    q.pool_tenant_fresh_prompt_tokens(pool, t)
                        .min((served * q.weight(t)) as u64)
                })
                .sum();
            own + others
        } else {
            self.tier_tenants[tier_idx]
                .iter()
                .map(|&t| q.pool_tenant_fresh_prompt_tokens(pool, t))
                .sum()
        };
        let serving = (0..self.backends.len())
            .filter(|&b| self.backends[b].healthy && self.pools.serves(pool, b))
            .map(|b| &self.backends[b]);
        let (pending, tps) = serving.fold((0, 0.0), |(p, r), b| {
            (p + b.prefill_pending, r + b.prefill_tps)
        });
        let estimate = (higher + same + pending) as f64 / tps;
        (estimate > sla_s).then_some(estimate - sla_s)
    }

    /// vLLM priority (lower runs first): the tier in the thousands, then the request's KV
    /// footprint, so long requests lose priority to short ones of the same tier.
    pub(super) fn priority(&self, tier_idx: usize, tokens: u64) -> i64 {
        let blocks = self.ledger.blocks_for(tokens) as f64;
        let kv_rank = (blocks * self.config.kv_weight / 8.0).min(999.0) as i64;
        tier_idx as i64 * 1000 + kv_rank
    }

    /// The vLLM priority of a split request's prefill hop: its tier alone. A prefill instance
    /// holds a prompt's KV only until the decode instance reads it, so the footprint that
    /// orders requests on the instance they live on buys nothing there; first come, first
    /// served within a tier keeps the tail of the time to first token short (smallest first
    /// would starve the longest prompts of a loaded prefill pool).
    pub fn hop_priority(&self, id: u64) -> i64 {
        self.requests.get(&id).map_or(0, |r| r.tier as i64 * 1000)
    }

    /// Slots a tier may hold on a backend now. Stale metrics halve everything (we are flying
    /// blind); the preemption breaker halves non-protected tiers per level; `max_share` caps
    /// a tier's own use.
    pub(super) fn limits(&self, b: usize, tier: &TierConfig, now_us: u64) -> (u32, u32) {
        let backend = &self.backends[b];
        let mut total = backend.slots();
        if let Some(share) = self.replica_share(b) {
            total = total.min(share); // other replicas have requests waiting: our share at most
        }
        if total == 0 {
            return (0, 0); // other replicas hold every slot: the floors below must not add one
        }
        if backend.is_stale(now_us, self.stale_after_us()) {
            total = (total / 2).max(1);
        }
        if !tier.protected {
            total = (total >> self.breaker.level).max(1);
        }
        let share = ((f64::from(backend.cap) * tier.max_share).floor() as u32).max(1);
        (total, share.min(total))
    }

    /// Let the breaker cool down one level per elapsed cool-down period.
    pub(super) fn tick(&mut self, now_us: u64) {
        let Some(cooldown) = us(self.config.preemption_cooldown_ms) else {
            return;
        };
        self.breaker.cool(now_us, cooldown);
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{governor, sustained, tenant};
    use crate::governor::Arrival;
    use crate::types::{Decision, RejectReason};

    // Normal traffic is shed at its threshold (50% of 4 = 2 queued) while VIP may still queue,
    // and every rejection carries a positive Retry-After.
    #[test]
    fn tier_shedding_spares_vip() {
        let mut g = governor();
        let (a, v) = (tenant(&g, "a"), tenant(&g, "v"));
        for id in 1..=4 {
            g.submit(id, Arrival::new(a, 10, 10), 0).unwrap();
        }
        let shed = g.submit(5, Arrival::new(a, 10, 10), 0).unwrap();
        let Decision::Rejected {
            reason,
            retry_after_s,
        } = shed
        else {
            panic!("{shed:?}")
        };
        assert_eq!(reason, RejectReason::TierShed);
        assert!(retry_after_s > 0.0);
        assert!(matches!(
            g.submit(6, Arrival::new(v, 10, 10), 0).unwrap(),
            Decision::Queued { .. }
        ));
    }

    // A full queue refuses even VIP with queue_full.
    #[test]
    fn queue_full() {
        let mut g = governor();
        let v = tenant(&g, "v");
        for id in 1..=6 {
            g.submit(id, Arrival::new(v, 10, 10), 0).unwrap();
        }
        let d = g.submit(7, Arrival::new(v, 10, 10), 0).unwrap();
        assert!(
            matches!(
                d,
                Decision::Rejected {
                    reason: RejectReason::QueueFull,
                    ..
                }
            ),
            "{d:?}"
        );
    }

    // KV usage above the threshold sheds non-protected tiers but still lets VIP in.
    #[test]
    fn kv_pressure() {
        let mut g = governor();
        g.observe_backend(0, 0, Some(0.9), None, None, None)
            .unwrap();
        let d = g
            .submit(1, Arrival::new(tenant(&g, "a"), 10, 10), 0)
            .unwrap();
        assert!(
            matches!(
                d,
                Decision::Rejected {
                    reason: RejectReason::KvPressure,
                    ..
                }
            ),
            "{d:?}"
        );
        assert!(matches!(
            g.submit(2, Arrival::new(tenant(&g, "v"), 10, 10), 0)
                .unwrap(),
            Decision::Admitted { .. }
        ));
    }

    // In a sustained overload, prefill work ahead beyond the SLA at the prior throughput
    // (8000 tok/s, 1.5 s) is refused; a request's own long prompt is not held against it.
    #[test]
    fn ttft_sla() {
        let mut g = governor();
        let a = tenant(&g, "a");
        sustained(&mut g, 1, 0);
        assert!(matches!(
            g.submit(1, Arrival::new(a, 13_000, 10), 0).unwrap(),
            Decision::Admitted { .. }
        ));
        let d = g.submit(2, Arrival::new(a, 10, 10), 0).unwrap();
        let Decision::Rejected {
            reason,
            retry_after_s,
        } = d
        else {
            panic!("{d:?}")
        };
        assert_eq!(reason, RejectReason::TtftSla);
        assert!((retry_after_s - 0.125).abs() < 1e-9, "{retry_after_s}");
        g.on_first_token(1, 1_000);
        assert!(matches!(
            g.submit(3, Arrival::new(a, 10, 10), 2_000).unwrap(),
            Decision::Admitted { .. }
        ));
    }

    // Outside a sustained overload (a burst: two arrivals in the last minute, against one
    // request running at the prior 10 s hold) the same late request is let in, not refused:
    // the queue absorbs a burst, and refusing it would only add the client's backoff.
    #[test]
    fn ttft_sla_leaves_a_burst_to_the_queue() {
        let mut g = governor();
        let a = tenant(&g, "a");
        g.submit(1, Arrival::new(a, 13_000, 10), 0).unwrap();
        assert!(g.sla_excess(a, 1, 10, 0).is_some());
        assert!(!g.sustained_overload(1, 0));
        assert!(matches!(
            g.submit(2, Arrival::new(a, 10, 10), 0).unwrap(),
            Decision::Admitted { .. }
        ));
    }

    // A latency tier that drains fast may queue what it serves within the queue's wait limit
    // (2 running at a 10 ms hold: 200/s, over the sample's 5 s, 1000 places) beyond its
    // configured 2 of 4, and so may VIP above it; a best-effort tier keeps the configured
    // places.
    #[test]
    fn waiting_room_follows_the_drain() {
        let mut g = governor();
        g.config.ttft_sla_ms = None;
        g.config.tiers[2].best_effort = true;
        let (a, z) = (tenant(&g, "a"), tenant(&g, "z"));
        assert_eq!(g.waiting_room(1), (2, 4));
        g.submit(1, Arrival::new(a, 10, 10), 0).unwrap();
        g.submit(2, Arrival::new(a, 10, 10), 0).unwrap();
        g.tier_load[1].held(0.01);
        assert_eq!(g.waiting_room(1), (1000, 1000));
        assert_eq!(g.waiting_room(0), (1000, 1000));
        assert_eq!(g.waiting_room(2), (2, 4));
        g.config.queue_follows_drain = false; // max_waiting as a hard bound
        assert_eq!(g.waiting_room(1), (2, 4));
        g.config.queue_follows_drain = true;
        for id in 3..=12 {
            let d = g.submit(id, Arrival::new(a, 10, 10), 0).unwrap();
            assert!(matches!(d, Decision::Queued { .. }), "{id}: {d:?}");
        }
        let d = g.submit(13, Arrival::new(z, 10, 10), 0).unwrap();
        assert!(
            matches!(
                d,
                Decision::Rejected {
                    reason: RejectReason::QueueFull,
                    ..
                }
            ),
            "{d:?}"
        );
    }

    // Under fair order a light tenant's SLA estimate does not count a heavy tenant's whole
    // backlog: only what the heavy tenant gets served before it (its equal share here).
    #[test]
    fn sla_estimate_follows_fair_order() {
        let mut g = governor();
        let (heavy, light, vip) = (tenant(&g, "a"), tenant(&g, "b"), tenant(&g, "v"));
        sustained(&mut g, 1, 0);
        // Fill both slots with VIP work (20 prompt tokens still in prefill).
        for id in 1..=2 {
            g.submit(id, Arrival::new(vip, 10, 10), 0).unwrap();
        }
        // The heavy tenant queues 13,000 prompt tokens (1.625 s at 8000 tok/s).
        g.submit(3, Arrival::new(heavy, 13_000, 10), 2).unwrap();
        // Its next request would wait behind all of them: refused.
        let d = g.submit(4, Arrival::new(heavy, 100, 10), 3).unwrap();
        assert!(
            matches!(
                d,
                Decision::Rejected {
                    reason: RejectReason::TtftSla,
                    ..
                }
            ),
            "{d:?}"
        );
        // The light tenant waits only for the heavy one's equal share (100 tokens): queued.
        let d = g.submit(5, Arrival::new(light, 100, 10), 3).unwrap();
        assert!(matches!(d, Decision::Queued { .. }), "{d:?}");
    }

    // A crowd refused together is told to come back spread out: each refusal adds 1 / drain.
    #[test]
    fn retry_after_spreads_a_crowd() {
        let mut g = governor();
        let v = tenant(&g, "v");
        for id in 1..=6 {
            g.submit(id, Arrival::new(v, 10, 10), 0).unwrap();
        }
        let retries: Vec<f64> = (10..14)
            .map(
                |id| match g.submit(id, Arrival::new(v, 10, 10), 0).unwrap() {
                    Decision::Rejected { retry_after_s, .. } => retry_after_s,
                    other => panic!("{other:?}"),
                },
            )
            .collect();
        let step = 1.0 / g.drain_rate();
        for pair in retries.windows(2) {
            assert!((pair[1] - pair[0] - step).abs() < 1e-9, "{retries:?}");
        }
    }

    // When normal's waiting places are full of tenant a's requests, tenant b (holding none)
    // pushes out a's newest instead of being refused; a cannot do the same back to b.
    #[test]
    fn light_tenant_displaces_heavy() {
        let mut g = governor();
        let (a, b) = (tenant(&g, "a"), tenant(&g, "b"));
        for id in 1..=4 {
            g.submit(id, Arrival::new(a, 10, 10), 0).unwrap();
        }
        let d = g.submit(5, Arrival::new(b, 10, 10), 0).unwrap();
        let Decision::Queued {
            displaced: Some((victim, retry)),
            position,
            ..
        } = d
        else {
            panic!("{d:?}")
        };
        assert_eq!((victim, position), (4, 1));
        assert!(retry > 0.0);
        assert!(!g.is_live(4));
        assert_eq!(g.queued(), 2);
        assert_eq!(g.counters.rejected[RejectReason::Displaced as usize], 1);
        let again = g.submit(6, Arrival::new(a, 10, 10), 0).unwrap();
        assert!(matches!(
            again,
            Decision::Rejected {
                reason: RejectReason::TierShed,
                ..
            }
        ));
    }

    // A victim from a lower tier was never counted ahead of the newcomer, so pushing it out
    // leaves the newcomer's position at the count of its own tier and above.
    #[test]
    fn lower_tier_victim_keeps_position() {
        let mut g = governor();
        let (a, b, z) = (tenant(&g, "a"), tenant(&g, "b"), tenant(&g, "z"));
        g.submit(1, Arrival::new(a, 10, 10), 0).unwrap();
        g.submit(2, Arrival::new(z, 10, 10), 0).unwrap();
        // Slots full; one normal and one batch request wait: normal's 2 places are taken.
        g.submit(3, Arrival::new(a, 10, 10), 0).unwrap();
        g.submit(4, Arrival::new(z, 10, 10), 0).unwrap();
        let decision = g.submit(5, Arrival::new(b, 10, 10), 0).unwrap();
        let Decision::Queued {
            position,
            estimated_wait_s,
            displaced: Some((4, _)),
            ..
        } = decision
        else {
            panic!("{decision:?}")
        };
        assert_eq!(position, 1);
        assert!((estimated_wait_s - 2.0 / g.drain_rate()).abs() < 1e-9);
    }

    // Tiers sharing a shed_at: a newcomer with nobody of its tier or above waiting pushes out a
    // lower tier's request and is told position 0 (the old count underflowed here).
    #[test]
    fn displacing_into_an_empty_tier_is_position_zero() {
        let mut g = governor();
        let (a, b, z) = (tenant(&g, "a"), tenant(&g, "b"), tenant(&g, "z"));
        g.submit(1, Arrival::new(a, 10, 10), 0).unwrap();
        g.submit(2, Arrival::new(z, 10, 10), 0).unwrap();
        g.submit(3, Arrival::new(z, 10, 10), 0).unwrap();
        g.submit(4, Arrival::new(z, 10, 10), 0).unwrap();
        let decision = g.submit(5, Arrival::new(b, 10, 10), 0).unwrap();
        assert!(
            matches!(
                decision,
                Decision::Queued {
                    position: 0,
                    displaced: Some((4, _)),
                    ..
                }
            ),
            "{decision:?}"
        );
        assert_eq!(g.queued(), 2);
    }

    // A rising preemption counter raises the shed level; it decays one level per cool-down.
    #[test]
    fn preemption_breaker() {
        let mut g = governor();
        g.observe_backend(0, 0, None, None, None, Some(5)).unwrap();
        assert_eq!(g.breaker.level, 0);
        g.observe_backend(0, 10, None, None, None, Some(7)).unwrap();
        assert_eq!(g.breaker.level, 1);
        // Level 1 halves normal's slots (2 -> 1) and its queue room (2 -> 1).
        let a = tenant(&g, "a");
        assert!(matches!(
            g.submit(1, Arrival::new(a, 10, 10), 20).unwrap(),
            Decision::Admitted { .. }
        ));
        assert!(matches!(
            g.submit(2, Arrival::new(a, 10, 10), 20).unwrap(),
            Decision::Queued { .. }
        ));
        let d = g.submit(3, Arrival::new(a, 10, 10), 20).unwrap();
        assert!(matches!(
            d,
            Decision::Rejected {
                reason: RejectReason::PreemptionBreaker,
                ..
            }
        ));
        g.dispatch(10 + 1000 * 1000);
        assert_eq!(g.breaker.level, 0);
    }

    // Brownout before refusal: once the queue is brownout_at full, a tier with a clamp is let
    // in with shorter answers (counted); below it, and for tiers without one, max_tokens stands.
    #[test]
    fn brownout_clamps_max_tokens_under_pressure() {
        let mut g = governor();
        g.config.tiers[1].brownout_at = 0.25; // normal: from 1 of 4 waiting places
        g.config.tiers[1].brownout_max_tokens = Some(64);
        let a = tenant(&g, "a");
        for id in 1..=2 {
            g.submit(id, Arrival::new(a, 10, 500), 0).unwrap(); // the two slots
        }
        g.submit(3, Arrival::new(a, 10, 500), 0).unwrap(); // queued, the queue was empty: as asked
        assert_eq!(g.browned_out(3), None);
        let d = g.submit(4, Arrival::new(a, 10, 500), 0).unwrap(); // 1 of 4 waiting: clamped
        assert!(matches!(d, Decision::Queued { .. }), "{d:?}");
        assert_eq!(g.browned_out(4), Some(64));
        assert_eq!(g.requests[&4].max_tokens, 64);
        assert_eq!(g.counters.browned_out, 1);
        let v = tenant(&g, "v");
        g.submit(5, Arrival::new(v, 10, 500), 0).unwrap(); // VIP has no clamp
        assert_eq!(g.browned_out(5), None);
    }

    // Long requests get a larger (worse) vLLM priority than short ones of the same tier, and
    // any VIP beats any normal.
    #[test]
    fn priority_orders_tier_then_length() {
        let g = governor();
        assert!(g.priority(1, 100) < g.priority(1, 8000));
        assert!(g.priority(0, 100_000) < g.priority(1, 1));
    }
}
