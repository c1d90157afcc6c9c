//! Admission: `submit` decides a new request (admit now, queue, or refuse), and makes one it
//! lets in live; `judge` and `decide` are the pure decision the refusal query asks too.

use super::{us, Arrival, Governor, Request, PRIOR_SERVICE_S, RETRY_AFTER_RANGE};
use crate::config::RoutePolicy;
use crate::error::{PolicyError, PolicyResult};
use crate::fair_queue::QueuedItem;
use crate::types::{Decision, ExpiryReason, RejectReason};

impl Governor {
    /// `max_tokens` as a request of this tier may have it now: clamped once the queue is
    /// `brownout_at` full, for tiers that set `brownout_max_tokens`.
    pub(super) fn brownout(&self, tier_idx: usize, max_tokens: u64) -> u64 {
        let tier = &self.config.tiers[tier_idx];
        let Some(clamp) = tier.brownout_max_tokens else {
            return max_tokens;
        };
        let fill = self.queue.len() as f64 / f64::from(self.config.max_waiting.max(1));
        if fill >= tier.brownout_at {
            max_tokens.min(clamp)
        } else {
            max_tokens
        }
    }

    pub(super) fn check_pool(&self, pool: u32) -> PolicyResult<()> {
        if pool as usize >= self.pools.len() {
            return Err(PolicyError::invalid(format!(
                "pool index {pool} out of range (the config has {} model pools)",
                self.pools.len()
            )));
        }
        Ok(())
    }

    fn note_brownout(&mut self, id: u64, asked: u64) {
        if let Some(req) = self.requests.get_mut(&id) {
            if req.max_tokens < asked {
                req.browned_out = Some(req.max_tokens);
            }
        }
    }

    /// The clamped `max_tokens` of a live request a brownout shortened (`None`: as asked).
    pub fn browned_out(&self, id: u64) -> Option<u64> {
        self.requests.get(&id).and_then(|r| r.browned_out)
    }

    // ---- the request lifecycle ---------------------------------------------------------------

    /// Decide on a new request: admit it now, queue it, or reject it. Only backends serving
    /// its pool's model are candidates, and it waits in the pool's own queue.
    ///
    /// A request that queues is dispatched at once: when it can start (the requests ahead of it
    /// are held back, e.g. by KV fit) the decision is `Admitted`. Other requests that this
    /// dispatch starts are handed out by the next `dispatch` call, so a host that calls
    /// `dispatch` after every event misses none.
    pub fn submit(&mut self, id: u64, arrival: Arrival<'_>, now_us: u64) -> PolicyResult<Decision> {
        let Arrival {
            tenant,
            prompt,
            max_tokens,
            route,
            ..
        } = arrival;
        self.check_pool(route.pool)?;
        if self.requests.contains_key(&id) {
            return Err(PolicyError::DuplicateRequest(id));
        }
        let tier_idx = *self
            .tenant_tier
            .get(tenant as usize)
            .ok_or_else(|| PolicyError::invalid(format!("tenant index {tenant} out of range")))?;
        self.tick(now_us);
        self.lapse(now_us);
        self.tier_load[tier_idx].arrive(now_us);
        self.queue.arrive_in(route.pool, tenant);
        self.update_headroom(now_us);
        let asked = max_tokens;
        let seen = self.seen(tenant, route, arrival.signals, now_us);
        let first_seen = seen.0;
        self.counters.retries_known += u64::from(first_seen < now_us);
        let announced = self
            .honoured(arrival.signals)
            .retries
            .is_some_and(|n| n > 0);
        self.counters.retries_announced += u64::from(announced);
        self.rate_limited(tenant, prompt, now_us); // refills the tenant's buckets to now
        let (max_tokens, decision) = self.judge(arrival, tier_idx, now_us);
        if !matches!(decision, Decision::Rejected { .. }) {
            self.pay_request(tenant, prompt);
        }
        if max_tokens < asked && !matches!(decision, Decision::Rejected { .. }) {
            self.counters.browned_out += 1;
        }
        // A request let in (started or queued) becomes live the same way either way.
        if let Decision::Admitted { priority, .. } | Decision::Queued { priority, .. } = decision {
            let kept = arrival.clamped(max_tokens);
            self.insert(id, kept, tier_idx, priority, seen, now_us);
            self.note_brownout(id, asked);
        }
        Ok(match decision {
            Decision::Rejected { reason, .. } => {
                self.counters.rejected[reason as usize] += 1;
                self.note_refusal(reason, tier_idx, now_us);
                if self.remembers(route.fingerprint) {
                    self.retries
                        .remember(tenant, route.fingerprint, first_seen, now_us);
                }
                decision
            }
            Decision::Admitted {
                backend, prefill, ..
            } => {
                self.start(id, backend, prefill, now_us);
                self.counters.admitted += 1;
                decision
            }
            Decision::Queued { .. } => self.enqueue(id, arrival, tier_idx, decision, now_us),
        })
    }

    /// Queue a request `decide` queued (`submit` made it live), then dispatch. The displacement `decide` chose is
    /// carried out only if dispatch made no room: when anything started, the queue is no longer
    /// than before this request came, and nobody needs to be pushed out.
    fn enqueue(
        &mut self,
        id: u64,
        arrival: Arrival<'_>,
        tier_idx: usize,
        queued: Decision,
        now_us: u64,
    ) -> Decision {
        let Arrival {
            tenant,
            prompt,
            route,
            ..
        } = arrival;
        let Decision::Queued {
            priority,
            displaced,
            ..
        } = queued
        else {
            unreachable!("enqueue takes a queued decision")
        };
        let req = &self.requests[&id];
        let (first_seen, sla_from) = (req.first_seen_us, req.sla_from_us);
        let client_deadline = req.client_deadline_us;
        let late = self.is_late(tier_idx, sla_from, now_us);
        self.queue.push_to(
            route.pool,
            tenant,
            QueuedItem {
                id,
                prompt_tokens: prompt,
            },
            first_seen,
            late,
        );
        self.counters.late += u64::from(late);
        if let Some(at) = self.lapse_time(tier_idx, sla_from).filter(|_| !late) {
            self.lapses.insert((at, id));
        }
        if let Some(ms) = us(self.config.queue_timeout_ms) {
            self.set_deadline(id, ExpiryReason::QueueTimeout, now_us + ms);
        }
        if let Some(at) = client_deadline {
            // Its client gives up then: it leaves the queue, never to start (`expire`).
            self.set_deadline(id, ExpiryReason::ClientDeadline, at);
        }
        let mut placed = self.place_queued(now_us);
        let own = placed
            .iter()
            .position(|a| a.request_id == id)
            .map(|i| placed.remove(i));
        let made_room = own.is_some() || !placed.is_empty();
        self.counters.dispatched += placed.len() as u64;
        self.pending.extend(placed);
        if let Some(own) = own {
            self.counters.admitted += 1;
            return Decision::Admitted {
                backend: own.backend,
                priority,
                prefill: own.prefill,
            };
        }
        self.counters.queued += 1;
        if made_room {
            let ahead = if late {
                self.waiting_ahead(route.pool, tier_idx)
            } else {
                self.fresh_ahead(route.pool, tier_idx)
            };
            let position = ahead - 1;
            return Decision::Queued {
                position: position as u32,
                estimated_wait_s: (position + 1) as f64 / self.drain_rate(),
                priority,
                displaced: None,
            };
        }
        if let Some((victim, _)) = displaced {
            let victim_tier = self.requests[&victim].tier;
            self.finish_as(victim, None, now_us);
            self.counters.rejected[RejectReason::Displaced as usize] += 1;
            self.note_refusal(RejectReason::Displaced, victim_tier, now_us);
        }
        queued
    }

    /// The decision `submit` makes once its bookkeeping is done, and the `max_tokens` it lets
    /// the request have: the tenant's rate limit first (unless draining), then brownout, then
    /// `decide`. Pure, so the refusal query asks the very same thing.
    pub(super) fn judge(
        &self,
        arrival: Arrival<'_>,
        tier_idx: usize,
        now_us: u64,
    ) -> (u64, Decision) {
        let max_tokens = arrival.max_tokens;
        if !self.draining {
            if let Some(wait) = self.rate_wait(arrival.tenant, arrival.prompt, now_us) {
                let refused = Decision::Rejected {
                    reason: RejectReason::RateLimited,
                    retry_after_s: wait.clamp(RETRY_AFTER_RANGE.0, RETRY_AFTER_RANGE.1),
                };
                return (max_tokens, refused);
            }
        }
        let max_tokens = self.brownout(tier_idx, max_tokens);
        let arrival = arrival.clamped(max_tokens);
        (max_tokens, self.decide(arrival, tier_idx, now_us))
    }

    fn decide(&self, arrival: Arrival<'_>, tier_idx: usize, now_us: u64) -> Decision {
        let (tenant, prompt, route) = (arrival.tenant, arrival.prompt, arrival.route);
        let max_tokens = arrival.max_tokens;
        let tier = &self.config.tiers[tier_idx];
        let drain = self.drain_rate();
        // Refusals for load add the tier's refused clients still away, so a crowd refused
        // together is told to come back spread out at the pace its tier gets places, rather
        // than all at once.
        let tier_drain = self.tier_drain(tier_idx);
        let backlog = self.refusal_backlog_s(tier_idx, now_us);
        let retry =
            |seconds: f64| (seconds + backlog).clamp(RETRY_AFTER_RANGE.0, RETRY_AFTER_RANGE.1);
        let reject = |reason, seconds: f64| Decision::Rejected {
            reason,
            retry_after_s: retry(seconds),
        };
        if self.draining {
            let wait = f64::from(self.running() + 1) / drain;
            return Decision::Rejected {
                reason: RejectReason::Draining,
                retry_after_s: wait.clamp(RETRY_AFTER_RANGE.0, RETRY_AFTER_RANGE.1),
            };
        }
        let pool = route.pool;
        if !self.pool_can_serve(pool) {
            let wait = self
                .stale_after_us()
                .map_or(PRIOR_SERVICE_S, |u| u as f64 / 1e6);
            return reject(RejectReason::NoHealthyBackend, wait);
        }
        if !tier.protected {
            if let Some(seconds) = self.kv_pressure_retry(now_us, drain) {
                return reject(RejectReason::KvPressure, seconds);
            }
        }
        let priority = self.priority(tier_idx, prompt + self.expected_output(tenant, max_tokens));
        // A retry already past its SLA waits behind its whole tier and is never refused for the
        // SLA again: no refusal can make it on time, and each one only adds a backoff.
        let sla_from = self.seen(tenant, route, arrival.signals, now_us).1;
        let late = self.is_late(tier_idx, sla_from, now_us);
        let ahead = if late {
            self.waiting_ahead(pool, tier_idx)
        } else {
            self.fresh_ahead(pool, tier_idx)
        };
        let sla_excess = if tier.protected || tier.best_effort || late {
            None
        } else {
            self.sla_excess(tenant, tier_idx, prompt, pool)
                .filter(|_| self.sustained_overload(tier_idx, now_us))
        };
        if ahead == 0 {
            let peak = prompt + self.expected_output(tenant, max_tokens);
            if let Some((backend, prefill)) = self.pick(tier_idx, route, prompt, peak, now_us) {
                if let Some(excess) = sla_excess {
                    return reject(RejectReason::TtftSla, excess);
                }
                return Decision::Admitted {
                    backend,
                    priority,
                    prefill,
                };
            }
        }
        let queued = self.queue.len();
        let over = |limit: usize| (queued + 1 - limit.min(queued)) as f64 / tier_drain;
        let (tier_limit, max_waiting) = self.waiting_room(tier_idx);
        let mut displaced = None;
        // A victim of the newcomer's own tier was counted in `ahead` (if in the lanes counted
        // there); one of a lower tier not.
        let mut counted_victim = false;
        if queued >= tier_limit.min(max_waiting) {
            let (reason, limit) = if queued >= max_waiting {
                (RejectReason::QueueFull, max_waiting)
            } else {
                (RejectReason::TierShed, tier_limit)
            };
            match self.displacement_victim(tenant, tier_idx) {
                Some((victim, victim_tier)) => {
                    displaced = Some((victim, retry(over(limit))));
                    counted_victim =
                        victim_tier == tier_idx && (late || !self.queue.is_late(victim));
                }
                None => return reject(reason, over(limit)),
            }
        }
        if !tier.protected && self.breaker.level > 0 {
            let scale = 0.5_f64.powi(i32::from(self.breaker.level));
            // The configured places, not the drained room: preemptions mean the measured drain
            // no longer holds.
            let configured = f64::from(self.config.max_waiting);
            let limit = (tier.shed_at * scale * configured).floor() as usize;
            if queued >= limit {
                let cooldown = self.breaker.remaining_s(now_us);
                return reject(RejectReason::PreemptionBreaker, cooldown.max(over(limit)));
            }
        }
        if let Some(excess) = sla_excess {
            return reject(RejectReason::TtftSla, excess);
        }
        let position = ahead - usize::from(counted_victim);
        if let Some(excess) = self.deadline_excess(arrival, late, drain) {
            return reject(RejectReason::ClientDeadline, excess);
        }
        Decision::Queued {
            position: position as u32,
            estimated_wait_s: (position + 1) as f64 / drain,
            priority,
            displaced,
        }
    }

    /// Make a request `submit` let in live (started or queued): `arrival` as it is kept (after
    /// a brownout's clamp), when its client first came and its SLA clock started (`seen`),
    /// and now.
    fn insert(
        &mut self,
        id: u64,
        arrival: Arrival<'_>,
        tier: usize,
        priority: i64,
        (first_seen_us, sla_from_us): (u64, u64),
        now_us: u64,
    ) {
        let Arrival {
            tenant,
            prompt,
            max_tokens,
            route,
            signals,
        } = arrival;
        let signals = self.honoured(signals);
        let keep_chain = self.pools.policy(route.pool) == RoutePolicy::Prefix;
        let request = Request {
            tenant,
            tier,
            pool: route.pool,
            prefix_hits: None,
            chain: if keep_chain {
                route.chain.to_vec()
            } else {
                Vec::new()
            },
            prompt,
            max_tokens,
            generated: 0,
            committed: 0,
            browned_out: None,
            priority,
            submitted_us: now_us,
            first_seen_us,
            fingerprint: route.fingerprint,
            sla_from_us,
            client_deadline_us: signals.deadline_us.map(|d| now_us + d),
            retries: signals.retries,
            running: None,
            deadlines: [None; ExpiryReason::ALL.len()],
        };
        self.requests.insert(id, request);
        if let Some(ms) = us(self.config.request_timeout_ms) {
            self.set_deadline(id, ExpiryReason::Deadline, now_us + ms);
        }
    }
}
