//! The governor: admission control, queueing, shedding and deadlines for a set of backends.
//!
//! Every call takes `now_us`; nothing here reads a clock, so the simulator and the gateway
//! drive the very same decisions, and a replay of the same events gives the same answers.
//!
//! Life of a request: `submit` admits it onto a backend, queues it, or rejects it with a reason
//! and a Retry-After. `dispatch` moves queued requests onto freed slots in fair order. Token
//! observations grow its KV footprint and its tenant's fair-share counter. `finish` (or
//! `expire`) ends it exactly once and frees its slot, queue entry and KV blocks.

use std::collections::BTreeSet;

use rustc_hash::FxHashMap;

use crate::backend::{BackendState, Observation, EWMA_ALPHA};
use crate::config::{PolicyConfig, Strategy, TierConfig};
use crate::error::{PolicyError, PolicyResult};
use crate::fair_queue::{FairQueue, QueuedItem};
use crate::kv::KvLedger;
use crate::types::{Admission, Decision, Expired, ExpiryReason, Outcome, RejectReason};

/// Mean service time assumed until the first completion is measured; it only shapes the
/// first Retry-After and queue-wait estimates.
const PRIOR_SERVICE_S: f64 = 10.0;
/// Highest preemption-breaker level; each level halves what non-protected tiers may use.
const MAX_SHED_LEVEL: u8 = 3;
/// Retry-After bounds: never zero (clients would hammer), never beyond an hour.
const RETRY_AFTER_RANGE: (f64, f64) = (0.05, 3600.0);
/// How long a refusal keeps counting toward later Retry-Afters (seconds, exponential decay).
/// A burst of N refusals at once gets Retry-Afters spread over N / drain rate, so clients that
/// honour them come back at the pace the backends free slots instead of all together.
const REFUSAL_MEMORY_S: f64 = 5.0;
/// Context tokens per extra unit of output cost: with `kv_weight` 1 a token generated on a
/// 4k context costs 4 more than one on an empty context, since it holds 4x the KV.
const KV_COST_TOKENS: f64 = 1024.0;

#[derive(Debug, Clone)]
pub(crate) struct Running {
    pub backend: u32,
    admitted_us: u64,
    pub first_token: bool,
    /// Prefill work on the backend when admitted (its own prompt included): divided by the
    /// time to first token it measures the backend's prefill throughput.
    prefill_ahead: u64,
}

#[derive(Debug, Clone)]
pub(crate) struct Request {
    pub tenant: u32,
    pub tier: usize,
    pub prompt: u64,
    pub generated: u64,
    pub priority: i64,
    pub submitted_us: u64,
    pub running: Option<Running>,
    deadlines: [Option<u64>; 3],
}

/// Counts by decision, reason and outcome, for metrics.
#[derive(Debug, Clone, Default)]
pub struct Counters {
    pub admitted: u64,
    pub queued: u64,
    pub dispatched: u64,
    pub rejected: [u64; 8],
    pub finished: [u64; 4],
    pub expired: [u64; 3],
}

#[derive(Debug, Clone)]
pub struct Governor {
    pub(crate) config: PolicyConfig,
    tenant_index: FxHashMap<String, u32>,
    pub(crate) tenant_tier: Vec<usize>,
    /// Tenants of each tier, for fair-share checks on the waiting places.
    tier_tenants: Vec<Vec<u32>>,
    /// Recent refusals, decaying with `REFUSAL_MEMORY_S`, and when it was last updated.
    refusals: f64,
    refusals_at_us: u64,
    pub(crate) requests: FxHashMap<u64, Request>,
    pub(crate) queue: FairQueue,
    pub(crate) ledger: KvLedger,
    pub(crate) backends: Vec<BackendState>,
    deadlines: BTreeSet<(u64, u64, ExpiryReason)>,
    pub(crate) shed_level: u8,
    breaker_until_us: u64,
    service_s: Option<f64>,
    pub(crate) draining: bool,
    pub(crate) counters: Counters,
}

fn us(ms: Option<f64>) -> Option<u64> {
    ms.map(|v| (v * 1000.0).round() as u64)
}

impl Governor {
    pub fn new(config: PolicyConfig) -> PolicyResult<Self> {
        config.validate()?;
        let tier_of = |name: &str| config.tiers.iter().position(|t| t.name == name);
        let tenant_tier: Vec<usize> = config
            .tenants
            .iter()
            .map(|t| tier_of(&t.tier).unwrap_or(0))
            .collect();
        let weights: Vec<(usize, f64)> = config
            .tenants
            .iter()
            .zip(&tenant_tier)
            .map(|(t, &tier)| (tier, t.weight))
            .collect();
        let tiers = config.tiers.len();
        let backends = config
            .backends
            .iter()
            .map(|b| {
                BackendState::new(
                    b,
                    config.max_concurrency_per_gpu,
                    tiers,
                    config.prefill_tokens_per_s,
                )
            })
            .collect();
        let tier_tenants = (0..tiers)
            .map(|t| {
                (0..tenant_tier.len() as u32)
                    .filter(|&i| tenant_tier[i as usize] == t)
                    .collect()
            })
            .collect();
        Ok(Self {
            tier_tenants,
            refusals: 0.0,
            refusals_at_us: 0,
            tenant_index: config
                .tenants
                .iter()
                .enumerate()
                .map(|(i, t)| (t.name.clone(), i as u32))
                .collect(),
            queue: FairQueue::new(config.strategy, tiers, &weights),
            ledger: KvLedger::new(
                config.block_size,
                config.tenants.len(),
                config.backends.len(),
            ),
            tenant_tier,
            requests: FxHashMap::default(),
            backends,
            deadlines: BTreeSet::new(),
            shed_level: 0,
            breaker_until_us: 0,
            service_s: None,
            draining: false,
            counters: Counters::default(),
            config,
        })
    }

    pub fn from_json(text: &str) -> PolicyResult<Self> {
        Self::new(PolicyConfig::from_json(text)?)
    }

    // ---- queries -------------------------------------------------------------------------

    pub fn running(&self) -> u32 {
        self.backends.iter().map(|b| b.running).sum()
    }

    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    pub fn live(&self) -> usize {
        self.requests.len()
    }

    pub fn is_live(&self, id: u64) -> bool {
        self.requests.contains_key(&id)
    }

    pub fn tenant_id(&self, name: &str) -> PolicyResult<u32> {
        self.tenant_index
            .get(name)
            .copied()
            .ok_or_else(|| PolicyError::UnknownTenant(name.into()))
    }

    pub fn backend_id(&self, name: &str) -> PolicyResult<u32> {
        self.backends
            .iter()
            .position(|b| b.name == name)
            .map(|i| i as u32)
            .ok_or_else(|| PolicyError::UnknownBackend(name.into()))
    }

    pub fn backend_name(&self, backend: u32) -> &str {
        &self.backends[backend as usize].name
    }

    pub fn tier_name(&self, tier: usize) -> &str {
        &self.config.tiers[tier].name
    }

    /// Earliest pending deadline, so callers know when to call `expire` next.
    pub fn next_deadline_us(&self) -> Option<u64> {
        self.deadlines.first().map(|&(at, _, _)| at)
    }

    /// When the governor next needs the time to move on: the earliest deadline, or the moment
    /// the preemption breaker cools down a level (which frees room for queued requests).
    pub fn next_wakeup_us(&self) -> Option<u64> {
        let breaker = (self.shed_level > 0 && self.config.preemption_cooldown_ms.is_some())
            .then_some(self.breaker_until_us);
        [self.next_deadline_us(), breaker]
            .into_iter()
            .flatten()
            .min()
    }

    /// The backend a running request holds, if it is running.
    pub fn request_backend(&self, id: u64) -> Option<u32> {
        self.requests.get(&id)?.running.as_ref().map(|r| r.backend)
    }

    /// Weighted tokens charged to a tenant so far.
    pub fn tenant_service(&self, tenant: u32) -> f64 {
        self.queue.service(tenant)
    }

    /// Requests per second the backends drain when saturated: slots / mean service time.
    pub fn drain_rate(&self) -> f64 {
        let slots: u32 = self
            .backends
            .iter()
            .filter(|b| b.healthy)
            .map(|b| b.cap)
            .sum();
        f64::from(slots.max(1)) / self.service_s.unwrap_or(PRIOR_SERVICE_S)
    }

    pub(crate) fn stale_after_us(&self) -> Option<u64> {
        us(self.config.stale_after_ms)
    }

    pub(crate) fn backend_kv_usage(&self, b: usize, now_us: u64) -> f64 {
        let backend = &self.backends[b];
        let stale = backend.is_stale(now_us, self.stale_after_us());
        backend.kv_usage(self.ledger.backend_blocks(b as u32), stale)
    }

    // ---- the request lifecycle ---------------------------------------------------------------

    /// Decide on a new request: admit it now, queue it, or reject it.
    pub fn submit(
        &mut self,
        id: u64,
        tenant: u32,
        prompt: u64,
        max_tokens: u64,
        now_us: u64,
    ) -> PolicyResult<Decision> {
        if self.requests.contains_key(&id) {
            return Err(PolicyError::DuplicateRequest(id));
        }
        let tier_idx = *self
            .tenant_tier
            .get(tenant as usize)
            .ok_or_else(|| PolicyError::invalid(format!("tenant index {tenant} out of range")))?;
        self.tick(now_us);
        let decision = self.decide(tenant, tier_idx, prompt, max_tokens, now_us);
        match decision {
            Decision::Rejected { reason, .. } => {
                self.counters.rejected[reason as usize] += 1;
                self.note_refusal(reason, now_us);
            }
            Decision::Admitted { backend, priority } => {
                self.insert(id, tenant, tier_idx, prompt, priority, now_us);
                self.start(id, backend, now_us);
                self.counters.admitted += 1;
            }
            Decision::Queued {
                priority,
                displaced,
                ..
            } => {
                if let Some((victim, _)) = displaced {
                    self.finish_as(victim, None, now_us);
                    self.counters.rejected[RejectReason::Displaced as usize] += 1;
                    self.note_refusal(RejectReason::Displaced, now_us);
                }
                self.insert(id, tenant, tier_idx, prompt, priority, now_us);
                self.queue.push(
                    tenant,
                    QueuedItem {
                        id,
                        prompt_tokens: prompt,
                    },
                );
                if let Some(ms) = us(self.config.queue_timeout_ms) {
                    self.set_deadline(id, ExpiryReason::QueueTimeout, now_us + ms);
                }
                self.counters.queued += 1;
            }
        }
        Ok(decision)
    }

    fn decide(
        &self,
        tenant: u32,
        tier_idx: usize,
        prompt: u64,
        max_tokens: u64,
        now_us: u64,
    ) -> Decision {
        let tier = &self.config.tiers[tier_idx];
        let drain = self.drain_rate();
        // Refusals for load add the recent refusal backlog, so a crowd refused together is
        // told to come back spread out at the drain rate rather than all at once.
        let backlog = self.recent_refusals(now_us) / drain;
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
        if !self.backends.iter().any(|b| b.healthy) {
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
        let priority = self.priority(tier_idx, prompt + max_tokens);
        let ahead: usize = (0..=tier_idx).map(|t| self.queue.tier_len(t)).sum();
        let sla_excess = if tier.protected {
            None
        } else {
            self.sla_excess(tenant, tier_idx, prompt)
        };
        if ahead == 0 {
            if let Some(backend) = self.pick_backend(tier_idx, prompt, now_us) {
                if let Some(excess) = sla_excess {
                    return reject(RejectReason::TtftSla, excess);
                }
                return Decision::Admitted { backend, priority };
            }
        }
        let queued = self.queue.len();
        let max_waiting = self.config.max_waiting as usize;
        let over = |limit: usize| (queued + 1 - limit.min(queued)) as f64 / drain;
        let tier_limit = (tier.shed_at * max_waiting as f64).floor() as usize;
        let mut displaced = None;
        if queued >= tier_limit.min(max_waiting) {
            let (reason, limit) = if queued >= max_waiting {
                (RejectReason::QueueFull, max_waiting)
            } else {
                (RejectReason::TierShed, tier_limit)
            };
            match self.displacement_victim(tenant, tier_idx) {
                Some(victim) => displaced = Some((victim, retry(over(limit)))),
                None => return reject(reason, over(limit)),
            }
        }
        if !tier.protected && self.shed_level > 0 {
            let scale = 0.5_f64.powi(i32::from(self.shed_level));
            let limit = (tier.shed_at * scale * max_waiting as f64).floor() as usize;
            if queued >= limit {
                let cooldown = self.breaker_until_us.saturating_sub(now_us) as f64 / 1e6;
                return reject(RejectReason::PreemptionBreaker, cooldown.max(over(limit)));
            }
        }
        if let Some(excess) = sla_excess {
            return reject(RejectReason::TtftSla, excess);
        }
        let position = ahead - usize::from(displaced.is_some());
        Decision::Queued {
            position: position as u32,
            estimated_wait_s: (position + 1) as f64 / drain,
            priority,
            displaced,
        }
    }

    /// When the waiting places a tier may use are all taken, a newcomer may push out a queued
    /// request instead of being refused: first from the least important tier below its own
    /// (so VIP is never refused while normal waits), else — inside its tier — the newest request
    /// of the tenant furthest over its weighted share, if that tenant holds more than the
    /// newcomer's would (so a heavy tenant filling the queue cannot lock a light one out).
    fn displacement_victim(&self, tenant: u32, tier_idx: usize) -> Option<u64> {
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
        let victim = if let Some(tier) = lower {
            heaviest(tier, None)?
        } else {
            let candidate = heaviest(tier_idx, Some(tenant))?;
            (load(candidate, 0) > load(tenant, 1)).then_some(candidate)?
        };
        self.queue.newest(victim).map(|item| item.id)
    }

    fn recent_refusals(&self, now_us: u64) -> f64 {
        let elapsed = now_us.saturating_sub(self.refusals_at_us) as f64 / 1e6;
        self.refusals * (-elapsed / REFUSAL_MEMORY_S).exp()
    }

    fn note_refusal(&mut self, reason: RejectReason, now_us: u64) {
        if matches!(reason, RejectReason::Draining) {
            return;
        }
        self.refusals = self.recent_refusals(now_us) + 1.0;
        self.refusals_at_us = self.refusals_at_us.max(now_us);
    }

    /// The time for enough running work to finish that KV usage falls below the threshold, when
    /// every healthy backend is above it.
    fn kv_pressure_retry(&self, now_us: u64, drain: f64) -> Option<f64> {
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
    /// Seconds by which the prefill work ahead of a new request overshoots the TTFT SLA.
    ///
    /// Only the work ahead counts: a request whose own prompt takes longer than the SLA is not
    /// refused for it (no amount of waiting would help). Ahead are the prompts running without
    /// a first token, every queued prompt of more important tiers, and — inside its own tier,
    /// under fair order — its tenant's own queued prompts plus, from each other tenant, at most
    /// the weighted share that tenant gets served meanwhile. So a heavy tenant's backlog does
    /// not make a light tenant's requests look late.
    fn sla_excess(&self, tenant: u32, tier_idx: usize, prompt: u64) -> Option<f64> {
        let sla_s = self.config.ttft_sla_ms? / 1000.0;
        let q = &self.queue;
        let higher: u64 = (0..tier_idx).map(|t| q.tier_prompt_tokens(t)).sum();
        let same = if q.strategy() == Strategy::Fair {
            let own = q.tenant_prompt_tokens(tenant);
            let served = (own + prompt) as f64 / q.weight(tenant);
            let others: u64 = self.tier_tenants[tier_idx]
                .iter()
                .filter(|&&t| t != tenant)
                .map(|&t| q.tenant_prompt_tokens(t).min((served * q.weight(t)) as u64))
                .sum();
            own + others
        } else {
            q.tier_prompt_tokens(tier_idx)
        };
        let healthy = self.backends.iter().filter(|b| b.healthy);
        let (pending, tps) = healthy.fold((0, 0.0), |(p, r), b| {
            (p + b.prefill_pending, r + b.prefill_tps)
        });
        let estimate = (higher + same + pending) as f64 / tps;
        (estimate > sla_s).then_some(estimate - sla_s)
    }

    /// vLLM priority (lower runs first): the tier in the thousands, then the request's KV
    /// footprint, so long requests lose priority to short ones of the same tier.
    fn priority(&self, tier_idx: usize, tokens: u64) -> i64 {
        let blocks = self.ledger.blocks_for(tokens) as f64;
        let kv_rank = (blocks * self.config.kv_weight / 8.0).min(999.0) as i64;
        tier_idx as i64 * 1000 + kv_rank
    }

    /// Slots a tier may hold on a backend now. Stale metrics halve everything (we are flying
    /// blind); the preemption breaker halves non-protected tiers per level; `max_share` caps
    /// a tier's own use.
    fn limits(&self, b: usize, tier: &TierConfig, now_us: u64) -> (u32, u32) {
        let backend = &self.backends[b];
        let mut total = backend.cap;
        if backend.is_stale(now_us, self.stale_after_us()) {
            total = (total / 2).max(1);
        }
        if !tier.protected {
            total = (total >> self.shed_level).max(1);
        }
        let share = ((f64::from(backend.cap) * tier.max_share).floor() as u32).max(1);
        (total, share.min(total))
    }

    /// The healthy backend with the most free slots for this tier whose free KV blocks can hold
    /// the prompt, or none. (A prompt that does not fit would only wait in vLLM's own FCFS
    /// queue; waiting here keeps the fair queue in charge of who gets the freed blocks.)
    fn pick_backend(&self, tier_idx: usize, prompt: u64, now_us: u64) -> Option<u32> {
        let tier = &self.config.tiers[tier_idx];
        let mut best: Option<(u32, u32)> = None;
        for (i, b) in self.backends.iter().enumerate() {
            if !b.healthy {
                continue;
            }
            let (total, share) = self.limits(i, tier, now_us);
            if b.running >= total || b.running_by_tier[tier_idx] >= share {
                continue;
            }
            if !tier.protected
                && self
                    .config
                    .kv_pressure_threshold
                    .is_some_and(|t| self.backend_kv_usage(i, now_us) > t)
            {
                continue;
            }
            // Protected tiers skip the fit check: vLLM's priority scheduling preempts lower
            // tiers to make room for them, and waiting here would only delay a VIP.
            if !tier.protected && !self.prompt_fits(i, prompt, now_us) {
                continue;
            }
            let headroom = total - b.running;
            if best.is_none_or(|(h, _)| headroom > h) {
                best = Some((headroom, i as u32));
            }
        }
        best.map(|(_, i)| i)
    }

    /// Whether a backend's free KV blocks hold a prompt plus one block of output. Unknown
    /// capacity, or an idle backend, always fits (vLLM is then the judge).
    fn prompt_fits(&self, b: usize, prompt: u64, now_us: u64) -> bool {
        let backend = &self.backends[b];
        let capacity = backend.kv_capacity_blocks;
        if capacity == 0 || backend.running == 0 {
            return true;
        }
        let reported = (self.backend_kv_usage(b, now_us) * capacity as f64).ceil() as u64;
        let used = reported.max(self.ledger.backend_blocks(b as u32));
        self.ledger.blocks_for(prompt) < capacity.saturating_sub(used)
    }

    /// Move queued requests onto free slots: tiers in strict order, tenants fairly within.
    pub fn dispatch(&mut self, now_us: u64) -> Vec<Admission> {
        self.tick(now_us);
        let mut admitted = Vec::new();
        for tier_idx in 0..self.config.tiers.len() {
            while self.queue.tier_len(tier_idx) > 0 {
                let head = self
                    .queue
                    .peek(tier_idx)
                    .map_or(0, |item| item.prompt_tokens);
                let Some(backend) = self.pick_backend(tier_idx, head, now_us) else {
                    break;
                };
                let Some((_, item)) = self.queue.pop(tier_idx) else {
                    break;
                };
                let req = &self.requests[&item.id];
                let (priority, waited) = (req.priority, now_us.saturating_sub(req.submitted_us));
                self.clear_deadline(item.id, ExpiryReason::QueueTimeout);
                self.start(item.id, backend, now_us);
                self.counters.dispatched += 1;
                admitted.push(Admission {
                    request_id: item.id,
                    backend,
                    priority,
                    queue_wait_us: waited,
                });
            }
        }
        admitted
    }

    fn insert(
        &mut self,
        id: u64,
        tenant: u32,
        tier: usize,
        prompt: u64,
        priority: i64,
        now_us: u64,
    ) {
        let request = Request {
            tenant,
            tier,
            prompt,
            generated: 0,
            priority,
            submitted_us: now_us,
            running: None,
            deadlines: [None; 3],
        };
        self.requests.insert(id, request);
        if let Some(ms) = us(self.config.request_timeout_ms) {
            self.set_deadline(id, ExpiryReason::Deadline, now_us + ms);
        }
    }

    /// Give a request its slot: count it on the backend, open its KV entry, charge its prompt.
    fn start(&mut self, id: u64, backend: u32, now_us: u64) {
        let b = &mut self.backends[backend as usize];
        let req = self.requests.get_mut(&id).expect("start: request is live");
        b.running += 1;
        b.running_by_tier[req.tier] += 1;
        b.prefill_pending += req.prompt;
        req.running = Some(Running {
            backend,
            admitted_us: now_us,
            first_token: false,
            prefill_ahead: b.prefill_pending,
        });
        let (tenant, prompt) = (req.tenant, req.prompt);
        self.ledger.open(id, tenant, backend, prompt, now_us);
        self.queue
            .charge(tenant, self.config.input_token_weight * prompt as f64);
        if let Some(ms) = us(self.config.first_token_timeout_ms) {
            self.set_deadline(id, ExpiryReason::FirstTokenTimeout, now_us + ms);
        }
    }

    /// Record a running request's first token. Returns false if it is not running.
    pub fn on_first_token(&mut self, id: u64, now_us: u64) -> bool {
        let Some(req) = self.requests.get_mut(&id) else {
            return false;
        };
        let Some(run) = req.running.as_mut() else {
            return false;
        };
        if run.first_token {
            return true;
        }
        run.first_token = true;
        let b = &mut self.backends[run.backend as usize];
        b.prefill_pending -= req.prompt;
        b.record_prefill(run.prefill_ahead, now_us.saturating_sub(run.admitted_us));
        self.clear_deadline(id, ExpiryReason::FirstTokenTimeout);
        true
    }

    /// Record `n` more generated tokens (the first ones also count as the first token).
    pub fn on_tokens(&mut self, id: u64, n: u64, now_us: u64) -> bool {
        if n == 0 || !self.on_first_token(id, now_us) {
            return n == 0 && self.requests.get(&id).is_some_and(|r| r.running.is_some());
        }
        let req = self
            .requests
            .get_mut(&id)
            .expect("on_tokens: checked above");
        req.generated += n;
        let context = (req.prompt + req.generated) as f64;
        let tenant = req.tenant;
        self.ledger.grow(id, n, now_us);
        let per_token =
            self.config.output_token_weight + self.config.kv_weight * context / KV_COST_TOKENS;
        self.queue.charge(tenant, per_token * n as f64);
        true
    }

    /// End a live request and free everything it held. Returns false if it was not live.
    pub fn finish(&mut self, id: u64, outcome: Outcome, now_us: u64) -> bool {
        self.finish_as(id, Some(outcome), now_us)
    }

    /// End a request; `None` is a displaced one, counted as a refusal rather than an outcome.
    fn finish_as(&mut self, id: u64, outcome: Option<Outcome>, now_us: u64) -> bool {
        let Some(req) = self.requests.remove(&id) else {
            return false;
        };
        for (slot, at) in req.deadlines.iter().enumerate() {
            if let Some(at) = at {
                self.deadlines.remove(&(*at, id, ExpiryReason::ALL[slot]));
            }
        }
        match req.running {
            None => {
                self.queue.remove(id);
            }
            Some(run) => {
                let b = &mut self.backends[run.backend as usize];
                b.running -= 1;
                b.running_by_tier[req.tier] -= 1;
                if !run.first_token {
                    b.prefill_pending -= req.prompt;
                }
                self.ledger.close(id, now_us);
                if outcome == Some(Outcome::Completed) {
                    let took = now_us.saturating_sub(run.admitted_us) as f64 / 1e6;
                    let smoothed = self.service_s.map_or(took, |s| s + EWMA_ALPHA * (took - s));
                    self.service_s = Some(smoothed.max(1e-3));
                }
            }
        }
        if let Some(outcome) = outcome {
            self.counters.finished[outcome as usize] += 1;
        }
        true
    }

    /// End every request whose deadline has passed, reporting which and why.
    pub fn expire(&mut self, now_us: u64) -> Vec<Expired> {
        let mut expired = Vec::new();
        while let Some(&(at, id, reason)) = self.deadlines.first() {
            if at > now_us {
                break;
            }
            let backend = self.requests[&id].running.as_ref().map(|r| r.backend);
            self.finish(id, Outcome::Timeout, now_us);
            self.counters.expired[reason as usize] += 1;
            let wait = (self.queue.len() + 1) as f64 / self.drain_rate();
            let backlog = self.recent_refusals(now_us) / self.drain_rate();
            expired.push(Expired {
                request_id: id,
                reason,
                was_running: backend.is_some(),
                backend,
                retry_after_s: (wait + backlog).clamp(RETRY_AFTER_RANGE.0, RETRY_AFTER_RANGE.1),
            });
        }
        expired
    }

    fn set_deadline(&mut self, id: u64, reason: ExpiryReason, at: u64) {
        self.deadlines.insert((at, id, reason));
        if let Some(req) = self.requests.get_mut(&id) {
            req.deadlines[reason as usize] = Some(at);
        }
    }

    fn clear_deadline(&mut self, id: u64, reason: ExpiryReason) {
        if let Some(req) = self.requests.get_mut(&id) {
            if let Some(at) = req.deadlines[reason as usize].take() {
                self.deadlines.remove(&(at, id, reason));
            }
        }
    }

    // ---- backend observations ---------------------------------------------------------------

    /// Feed a scrape of a backend's metrics. A rising preemption counter trips the breaker.
    pub fn observe_backend(
        &mut self,
        backend: u32,
        now_us: u64,
        kv_usage: Option<f64>,
        running: Option<u64>,
        waiting: Option<u64>,
        preemptions_total: Option<u64>,
    ) -> PolicyResult<()> {
        if let Some(v) = kv_usage {
            if !(0.0..=1.0 + 1e-9).contains(&v) {
                return Err(PolicyError::invalid(format!(
                    "kv_usage must be in 0..1, got {v}"
                )));
            }
        }
        let b = self
            .backends
            .get_mut(backend as usize)
            .ok_or_else(|| PolicyError::UnknownBackend(backend.to_string()))?;
        b.observed = Some(Observation {
            kv_usage,
            running,
            waiting,
            at_us: now_us,
        });
        let mut tripped = false;
        if let Some(total) = preemptions_total {
            tripped = b.preemptions_seen.is_some_and(|seen| total > seen);
            if tripped {
                b.preemptions_total += total - b.preemptions_seen.unwrap_or(total);
            }
            b.preemptions_seen = Some(total);
        }
        self.tick(now_us);
        if tripped {
            if let Some(cooldown) = us(self.config.preemption_cooldown_ms) {
                self.shed_level = (self.shed_level + 1).min(MAX_SHED_LEVEL);
                self.breaker_until_us = now_us + cooldown;
            }
        }
        Ok(())
    }

    pub fn set_kv_capacity(&mut self, backend: u32, blocks: u64) {
        self.backends[backend as usize].kv_capacity_blocks = blocks;
    }

    pub fn set_backend_health(&mut self, backend: u32, healthy: bool) {
        self.backends[backend as usize].healthy = healthy;
    }

    pub fn start_draining(&mut self) {
        self.draining = true;
    }

    /// Let the breaker cool down one level per elapsed cool-down period.
    fn tick(&mut self, now_us: u64) {
        let Some(cooldown) = us(self.config.preemption_cooldown_ms) else {
            return;
        };
        while self.shed_level > 0 && now_us >= self.breaker_until_us {
            self.shed_level -= 1;
            self.breaker_until_us += cooldown;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::sample_json;

    const S: u64 = 1_000_000;

    fn governor() -> Governor {
        Governor::from_json(&sample_json()).unwrap()
    }

    fn tenant(g: &Governor, name: &str) -> u32 {
        g.tenant_id(name).unwrap()
    }

    // Below the cap requests are admitted at once; beyond it they queue, in order.
    #[test]
    fn admits_then_queues() {
        let mut g = governor();
        let a = tenant(&g, "a");
        assert!(matches!(
            g.submit(1, a, 10, 10, 0).unwrap(),
            Decision::Admitted { .. }
        ));
        assert!(matches!(
            g.submit(2, a, 10, 10, 0).unwrap(),
            Decision::Admitted { .. }
        ));
        let third = g.submit(3, a, 10, 10, 0).unwrap();
        assert!(
            matches!(third, Decision::Queued { position: 0, .. }),
            "{third:?}"
        );
        assert_eq!((g.running(), g.queued()), (2, 1));
    }

    // A finished request frees its slot; dispatch hands it to the queue head.
    #[test]
    fn dispatch_after_finish() {
        let mut g = governor();
        let a = tenant(&g, "a");
        for id in 1..=3 {
            g.submit(id, a, 10, 10, 0).unwrap();
        }
        assert!(g.dispatch(0).is_empty());
        assert!(g.finish(1, Outcome::Completed, S));
        let admitted = g.dispatch(S);
        assert_eq!(admitted.len(), 1);
        assert_eq!((admitted[0].request_id, admitted[0].queue_wait_us), (3, S));
    }

    // Normal traffic is shed at its threshold (50% of 4 = 2 queued) while VIP may still queue,
    // and every rejection carries a positive Retry-After.
    #[test]
    fn tier_shedding_spares_vip() {
        let mut g = governor();
        let (a, v) = (tenant(&g, "a"), tenant(&g, "v"));
        for id in 1..=4 {
            g.submit(id, a, 10, 10, 0).unwrap();
        }
        let shed = g.submit(5, a, 10, 10, 0).unwrap();
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
            g.submit(6, v, 10, 10, 0).unwrap(),
            Decision::Queued { .. }
        ));
    }

    // A full queue refuses even VIP with queue_full.
    #[test]
    fn queue_full() {
        let mut g = governor();
        let v = tenant(&g, "v");
        for id in 1..=6 {
            g.submit(id, v, 10, 10, 0).unwrap();
        }
        let d = g.submit(7, v, 10, 10, 0).unwrap();
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

    // VIP queued requests go before normal ones queued earlier (strict tier order).
    #[test]
    fn strict_tier_order() {
        let mut g = governor();
        let (a, v) = (tenant(&g, "a"), tenant(&g, "v"));
        for id in 1..=3 {
            g.submit(id, a, 10, 10, 0).unwrap();
        }
        g.submit(9, v, 10, 10, 1).unwrap();
        g.finish(1, Outcome::Completed, 2);
        assert_eq!(g.dispatch(2)[0].request_id, 9);
    }

    // max_share keeps a batch flood from taking every slot: batch holds at most 1 of 2 here.
    #[test]
    fn max_share_reserves_slots() {
        let mut g = governor();
        let (z, a) = (tenant(&g, "z"), tenant(&g, "a"));
        assert!(matches!(
            g.submit(1, z, 10, 10, 0).unwrap(),
            Decision::Admitted { .. }
        ));
        assert!(matches!(
            g.submit(2, z, 10, 10, 0).unwrap(),
            Decision::Queued { .. }
        ));
        assert!(matches!(
            g.submit(3, a, 10, 10, 0).unwrap(),
            Decision::Admitted { .. }
        ));
    }

    // KV usage above the threshold sheds non-protected tiers but still lets VIP in.
    #[test]
    fn kv_pressure() {
        let mut g = governor();
        g.observe_backend(0, 0, Some(0.9), None, None, None)
            .unwrap();
        let d = g.submit(1, tenant(&g, "a"), 10, 10, 0).unwrap();
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
            g.submit(2, tenant(&g, "v"), 10, 10, 0).unwrap(),
            Decision::Admitted { .. }
        ));
    }

    // Prefill work ahead beyond the SLA at the prior throughput (8000 tok/s, 1.5 s) is refused;
    // a request's own long prompt is not held against it.
    #[test]
    fn ttft_sla() {
        let mut g = governor();
        let a = tenant(&g, "a");
        assert!(matches!(
            g.submit(1, a, 13_000, 10, 0).unwrap(),
            Decision::Admitted { .. }
        ));
        let d = g.submit(2, a, 10, 10, 0).unwrap();
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
            g.submit(3, a, 10, 10, 2_000).unwrap(),
            Decision::Admitted { .. }
        ));
    }

    // Under fair order a light tenant's SLA estimate does not count a heavy tenant's whole
    // backlog: only what the heavy tenant gets served before it (its equal share here).
    #[test]
    fn sla_estimate_follows_fair_order() {
        let mut g = governor();
        let (heavy, light, vip) = (tenant(&g, "a"), tenant(&g, "b"), tenant(&g, "v"));
        // Fill both slots with VIP work (20 prompt tokens still in prefill).
        for id in 1..=2 {
            g.submit(id, vip, 10, 10, 0).unwrap();
        }
        // The heavy tenant queues 13,000 prompt tokens (1.625 s at 8000 tok/s).
        g.submit(3, heavy, 13_000, 10, 2).unwrap();
        // Its next request would wait behind all of them: refused.
        let d = g.submit(4, heavy, 100, 10, 3).unwrap();
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
        let d = g.submit(5, light, 100, 10, 3).unwrap();
        assert!(matches!(d, Decision::Queued { .. }), "{d:?}");
    }

    // A crowd refused together is told to come back spread out: each refusal adds 1 / drain.
    #[test]
    fn retry_after_spreads_a_crowd() {
        let mut g = governor();
        let v = tenant(&g, "v");
        for id in 1..=6 {
            g.submit(id, v, 10, 10, 0).unwrap();
        }
        let retries: Vec<f64> = (10..14)
            .map(|id| match g.submit(id, v, 10, 10, 0).unwrap() {
                Decision::Rejected { retry_after_s, .. } => retry_after_s,
                other => panic!("{other:?}"),
            })
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
            g.submit(id, a, 10, 10, 0).unwrap();
        }
        let d = g.submit(5, b, 10, 10, 0).unwrap();
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
        let again = g.submit(6, a, 10, 10, 0).unwrap();
        assert!(matches!(
            again,
            Decision::Rejected {
                reason: RejectReason::TierShed,
                ..
            }
        ));
    }

    // A prompt that does not fit in the free KV blocks waits in the gateway's queue (VIP
    // excepted: vLLM's priority scheduling makes room for it).
    #[test]
    fn prompt_must_fit_free_blocks() {
        let mut g = governor();
        g.config.kv_pressure_threshold = None;
        g.config.ttft_sla_ms = None;
        let (normal, vip) = (tenant(&g, "a"), tenant(&g, "v"));
        // 1000 blocks of 16 tokens: 15,000 tokens hold 938 blocks, leaving 62.
        let d = g.submit(1, normal, 15_000, 10, 0).unwrap();
        assert!(matches!(d, Decision::Admitted { .. }), "{d:?}");
        let d = g.submit(2, normal, 2_000, 10, 0).unwrap();
        assert!(matches!(d, Decision::Queued { .. }), "{d:?}");
        assert!(g.dispatch(1).is_empty());
        g.finish(1, Outcome::Completed, 2);
        assert_eq!(g.dispatch(2)[0].request_id, 2);
        let d = g.submit(3, vip, 15_000, 10, 3).unwrap();
        assert!(matches!(d, Decision::Admitted { .. }), "{d:?}");
        // Slots are full now (2 of 2); free one, then a VIP that does not fit still starts.
        assert!(g.finish(2, Outcome::Completed, 3));
        let d = g.submit(4, vip, 2_000, 10, 4).unwrap();
        assert!(matches!(d, Decision::Admitted { .. }), "{d:?}");
    }

    // A rising preemption counter raises the shed level; it decays one level per cool-down.
    #[test]
    fn preemption_breaker() {
        let mut g = governor();
        g.observe_backend(0, 0, None, None, None, Some(5)).unwrap();
        assert_eq!(g.shed_level, 0);
        g.observe_backend(0, 10, None, None, None, Some(7)).unwrap();
        assert_eq!(g.shed_level, 1);
        // Level 1 halves normal's slots (2 -> 1) and its queue room (2 -> 1).
        let a = tenant(&g, "a");
        assert!(matches!(
            g.submit(1, a, 10, 10, 20).unwrap(),
            Decision::Admitted { .. }
        ));
        assert!(matches!(
            g.submit(2, a, 10, 10, 20).unwrap(),
            Decision::Queued { .. }
        ));
        let d = g.submit(3, a, 10, 10, 20).unwrap();
        assert!(matches!(
            d,
            Decision::Rejected {
                reason: RejectReason::PreemptionBreaker,
                ..
            }
        ));
        g.dispatch(10 + 1000 * 1000);
        assert_eq!(g.shed_level, 0);
    }

    // Deadlines: queue wait, first token and total, each reported once with its reason.
    #[test]
    fn deadlines_expire() {
        let mut g = governor();
        let a = tenant(&g, "a");
        for id in 1..=3 {
            g.submit(id, a, 10, 10, 0).unwrap();
        }
        g.on_first_token(1, S);
        let expired = g.expire(4 * S);
        assert_eq!(expired.len(), 1);
        assert_eq!(
            (expired[0].request_id, expired[0].reason),
            (2, ExpiryReason::FirstTokenTimeout)
        );
        let expired = g.expire(6 * S);
        assert_eq!(
            (expired[0].request_id, expired[0].reason),
            (3, ExpiryReason::QueueTimeout)
        );
        assert!(!expired[0].was_running);
        assert!(expired[0].retry_after_s > 0.0);
        let expired = g.expire(61 * S);
        assert_eq!(
            (expired[0].request_id, expired[0].reason),
            (1, ExpiryReason::Deadline)
        );
        assert_eq!((g.live(), g.next_deadline_us()), (0, None));
    }

    // KV grows with tokens and everything returns to zero when work ends; ending twice is a
    // no-op.
    #[test]
    fn ledger_returns_to_zero() {
        let mut g = governor();
        let a = tenant(&g, "a");
        g.submit(1, a, 20, 100, 0).unwrap();
        g.on_tokens(1, 30, 10);
        assert_eq!(g.ledger.total_blocks(), 4);
        assert!(g.finish(1, Outcome::Completed, 20));
        assert!(!g.finish(1, Outcome::Completed, 20));
        assert_eq!((g.ledger.total_blocks(), g.running(), g.live()), (0, 0, 0));
        assert_eq!(g.counters.finished[Outcome::Completed as usize], 1);
    }

    // Draining refuses new work but lets live requests finish.
    #[test]
    fn draining() {
        let mut g = governor();
        let a = tenant(&g, "a");
        g.submit(1, a, 10, 10, 0).unwrap();
        g.start_draining();
        let d = g.submit(2, a, 10, 10, 0).unwrap();
        assert!(matches!(
            d,
            Decision::Rejected {
                reason: RejectReason::Draining,
                ..
            }
        ));
        assert!(g.finish(1, Outcome::Completed, 1));
    }

    // Reusing a live id is an error; after it ends the id may be reused.
    #[test]
    fn duplicate_ids() {
        let mut g = governor();
        let a = tenant(&g, "a");
        g.submit(1, a, 10, 10, 0).unwrap();
        assert_eq!(
            g.submit(1, a, 10, 10, 0),
            Err(PolicyError::DuplicateRequest(1))
        );
        g.finish(1, Outcome::Cancelled, 0);
        assert!(g.submit(1, a, 10, 10, 0).is_ok());
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
