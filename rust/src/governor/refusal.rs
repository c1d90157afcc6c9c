//! The refusal query: would `submit` refuse this request now? Answered without changing state.
//!
//! A host under a flood answers most requests with a refusal, and each costs it the whole
//! request path (HTTP framework, sessions, tasks) before `submit` says no. This lets a host ask
//! first, cheaply, and take a refused request down a short path; it then still feeds the real
//! `submit`, so counters, the refusal memory (the Retry-After spread) and a trace stay exact.
//!
//! `submit` does some bookkeeping before it decides: a breaker level may cool down (`tick`), and
//! the headroom may be recomputed with this arrival counted (every `RECOMPUTE_US`). When that
//! could change what `decide` reads, the query says "not refused" (`None`) and the host takes
//! its ordinary path: while a cool-down is due, while a recompute is due for a best-effort tier
//! (the headroom is read only when a best-effort request looks for a slot), and while counting
//! this arrival would tip its tier into a sustained overload (the TTFT SLA refuses only then).
//! Otherwise the bookkeeping changes nothing `decide` reads, and the query's refusal is exactly
//! `submit`'s.
//! (A recompute falls due every 100 ms under a flood; deferring every tier then would send each
//! request read before the first deferred one reaches `submit` down the ordinary path.)

use super::headroom::RECOMPUTE_US;
use super::{us, Arrival, Governor, Route};
use crate::error::{PolicyError, PolicyResult};
use crate::types::{Decision, RejectReason};

impl Governor {
    /// The refusal `submit` would return for this request at `now_us` (reason, Retry-After in
    /// seconds), or `None` when it would admit or queue it, or when that cannot be known without
    /// `submit`'s own bookkeeping (a breaker cool-down is due, or a headroom recompute for a
    /// best-effort tier).
    pub fn refusal(
        &self,
        arrival: Arrival<'_>,
        now_us: u64,
    ) -> PolicyResult<Option<(RejectReason, f64)>> {
        let Arrival {
            tenant,
            prompt,
            route,
            ..
        } = arrival;
        self.check_pool(route.pool)?;
        let tier_idx = *self
            .tenant_tier
            .get(tenant as usize)
            .ok_or_else(|| PolicyError::invalid(format!("tenant index {tenant} out of range")))?;
        let best_effort = self.config.tiers[tier_idx].best_effort;
        let due = self.cooldown_due(now_us)
            || self.lapse_due(now_us)
            || (best_effort && self.headroom_due(now_us));
        if due || self.overload_due(tenant, prompt, route, now_us) {
            return Ok(None);
        }
        Ok(match self.judge(arrival, tier_idx, now_us).1 {
            Decision::Rejected {
                reason,
                retry_after_s,
            } => Some((reason, retry_after_s)),
            Decision::Admitted { .. } | Decision::Queued { .. } => None,
        })
    }

    /// `tick` would lower the breaker's level at `now_us`.
    fn cooldown_due(&self, now_us: u64) -> bool {
        us(self.config.preemption_cooldown_ms).is_some() && self.breaker.cooldown_due(now_us)
    }

    /// Counting this arrival would tip its tier into a sustained overload while the request
    /// overshoots the TTFT SLA (so the SLA would refuse it): `submit` counts it before it decides.
    fn overload_due(&self, tenant: u32, prompt: u64, route: Route<'_>, now_us: u64) -> bool {
        let tier_idx = self.tenant_tier[tenant as usize];
        let tier = &self.config.tiers[tier_idx];
        let (load, drain) = (&self.tier_load[tier_idx], self.tier_drain(tier_idx));
        let tips = (load.rate(now_us) > drain) != (load.rate_with_arrival(now_us) > drain);
        tips && !tier.protected
            && !tier.best_effort
            && self
                .sla_excess(tenant, tier_idx, prompt, route.pool)
                .is_some()
    }

    /// `update_headroom` would recompute the headroom at `now_us`.
    fn headroom_due(&self, now_us: u64) -> bool {
        self.config.headroom_quantile.is_some()
            && self
                .headroom_at_us
                .is_none_or(|at| now_us >= at + RECOMPUTE_US)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{governor, tenant, S};
    use super::*;
    use crate::governor::Signals;
    use crate::types::Outcome;

    fn rejected(d: Decision) -> Option<(RejectReason, f64)> {
        match d {
            Decision::Rejected {
                reason,
                retry_after_s,
            } => Some((reason, retry_after_s)),
            _ => None,
        }
    }

    // A crowd refused one after another: each query names the refusal `submit` then makes, to
    // the bit, and asking twice changes nothing (the Retry-After spread moves only with submit).
    #[test]
    fn query_matches_submit_and_changes_nothing() {
        let mut g = governor();
        let a = tenant(&g, "a");
        for id in 1..=4 {
            g.submit(id, Arrival::new(a, 10, 10), 0).unwrap();
        }
        for id in 10..20 {
            let now = id * 1000;
            let memory = |g: &Governor| g.tier_load[1].recent_refusals(now);
            let (counters, before) = (g.counters.rejected, memory(&g));
            let asked = g.refusal(Arrival::new(a, 10, 10), now).unwrap();
            assert_eq!(g.refusal(Arrival::new(a, 10, 10), now).unwrap(), asked);
            assert_eq!((g.counters.rejected, memory(&g)), (counters, before));
            let got = rejected(g.submit(id, Arrival::new(a, 10, 10), now).unwrap());
            assert!(asked.is_some());
            assert_eq!(asked, got, "request {id}");
        }
    }

    // What submit would admit or queue is not a refusal; VIP still queues where normal is shed.
    #[test]
    fn admitted_and_queued_are_not_refusals() {
        let mut g = governor();
        let (a, v) = (tenant(&g, "a"), tenant(&g, "v"));
        assert_eq!(g.refusal(Arrival::new(a, 10, 10), 0).unwrap(), None);
        for id in 1..=4 {
            g.submit(id, Arrival::new(a, 10, 10), 0).unwrap();
        }
        assert!(g.refusal(Arrival::new(a, 10, 10), 0).unwrap().is_some());
        assert_eq!(g.refusal(Arrival::new(v, 10, 10), 0).unwrap(), None);
        assert!(matches!(
            g.submit(5, Arrival::new(v, 10, 10), 0).unwrap(),
            Decision::Queued { .. }
        ));
    }

    // Draining and no healthy backend are refusals too (503s at the runtime).
    #[test]
    fn draining_and_no_backend() {
        let mut g = governor();
        let v = tenant(&g, "v");
        g.set_backend_health(0, false);
        let (reason, _) = g.refusal(Arrival::new(v, 10, 10), 0).unwrap().unwrap();
        assert_eq!(reason, RejectReason::NoHealthyBackend);
        g.set_backend_health(0, true);
        g.start_draining();
        let (reason, _) = g.refusal(Arrival::new(v, 10, 10), 0).unwrap().unwrap();
        assert_eq!(reason, RejectReason::Draining);
    }

    // While a breaker cool-down is due the query defers to submit, which may then admit.
    #[test]
    fn due_cooldown_defers() {
        let mut g = governor();
        let a = tenant(&g, "a");
        g.observe_backend(0, 0, None, None, None, Some(1)).unwrap();
        g.observe_backend(0, 10, None, None, None, Some(2)).unwrap();
        assert_eq!(g.breaker.level, 1);
        g.submit(1, Arrival::new(a, 10, 10), 20).unwrap();
        g.submit(2, Arrival::new(a, 10, 10), 20).unwrap();
        assert!(g.refusal(Arrival::new(a, 10, 10), 30).unwrap().is_some());
        assert_eq!(g.refusal(Arrival::new(a, 10, 10), 2 * S).unwrap(), None);
    }

    // When this very arrival tips its tier into a sustained overload (six arrivals in the
    // minute: 0.1/s, as fast as one request running drains at the prior 10 s hold; a seventh
    // is faster) and it is late for the SLA, the query defers to submit, which refuses it.
    #[test]
    fn arrival_tipping_into_overload_defers() {
        let mut g = governor();
        let a = tenant(&g, "a");
        g.submit(1, Arrival::new(a, 13_000, 10), 0).unwrap();
        for _ in 0..5 {
            g.tier_load[1].arrive(0);
        }
        assert!(g.overload_due(a, 10, Route::default(), 0));
        assert_eq!(g.refusal(Arrival::new(a, 10, 10), 0).unwrap(), None);
        let got = rejected(g.submit(2, Arrival::new(a, 10, 10), 0).unwrap());
        assert_eq!(got.map(|(reason, _)| reason), Some(RejectReason::TtftSla));
    }

    // An unknown tenant index is an error, as in submit.
    #[test]
    fn unknown_tenant() {
        let g = governor();
        assert!(g.refusal(Arrival::new(99, 10, 10), 0).is_err());
    }

    // Random traffic (arrivals of every tier, some of them retries, some with a client's retry
    // count and deadline, completions, scrapes with KV pressure and preemptions, time moving on,
    // headroom on): before every arrival, whenever the query says
    // refused, submit refuses the same way; and whenever submit refuses while no bookkeeping
    // was due, the query had said so.
    #[test]
    fn random_traffic_agrees() {
        let text = crate::config::tests::sample_json().replace(
            r#"{"name":"b","tier":"normal"}"#,
            r#"{"name":"b","tier":"normal","requests_per_s":3,"tokens_per_min":90000}"#,
        );
        let mut g = Governor::from_json(&text).unwrap();
        g.config.headroom_quantile = Some(0.9);
        g.config.tiers[1].brownout_at = 0.25;
        g.config.tiers[1].brownout_max_tokens = Some(100);
        let tenants = ["v", "a", "b", "z"].map(|n| tenant(&g, n));
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let (mut now, mut live, mut preemptions) = (0, Vec::new(), 0);
        let (mut refused, mut deferred) = (0, 0);
        for id in 0..20_000u64 {
            now += next(40_000);
            match next(10) {
                0..=1 if !live.is_empty() => {
                    let victim = live.swap_remove(next(live.len() as u64) as usize);
                    g.finish(victim, Outcome::Completed, now);
                }
                2 => {
                    preemptions += next(2);
                    let kv = Some(next(100) as f64 / 100.0);
                    g.observe_backend(0, now, kv, None, None, Some(preemptions))
                        .unwrap();
                }
                _ => {
                    let t = tenants[next(4) as usize];
                    let (prompt, max_tokens) = (1 + next(4000), 1 + next(500));
                    // a few bodies sent again and again: retries the core may know
                    let route = Route {
                        fingerprint: next(40),
                        ..Route::default()
                    };
                    let due = g.cooldown_due(now)
                        || g.lapse_due(now)
                        || (t == tenants[3] && g.headroom_due(now))
                        || g.overload_due(t, prompt, route, now);
                    // what some clients say: retries (one count past the cap) and deadlines
                    let signals = Signals {
                        retries: [None, Some(0), Some(2), Some(11)][next(4) as usize],
                        deadline_us: (next(3) == 0).then(|| (1 + next(60)) * 1_000_000),
                    };
                    let arrival = Arrival::new(t, prompt, max_tokens)
                        .with_route(route)
                        .with_signals(signals);
                    let asked = g.refusal(arrival, now).unwrap();
                    let decision = g.submit(id, arrival, now);
                    let got = rejected(decision.unwrap());
                    if asked.is_some() {
                        assert_eq!(asked, got, "request {id} at {now}");
                        refused += 1;
                    } else if got.is_some() {
                        assert!(due, "request {id} at {now}: {got:?} not foreseen");
                        deferred += 1;
                    }
                    if got.is_none() {
                        live.push(id);
                    }
                }
            }
            g.dispatch(now);
            for e in g.expire(now) {
                live.retain(|&l| l != e.request_id);
            }
        }
        assert!(refused > 1000 && deferred > 0, "{refused} {deferred}");
        let late = g.counters.rejected[RejectReason::ClientDeadline as usize];
        assert!(late >= 10, "{late} client deadlines refused"); // the path is exercised
    }
}
