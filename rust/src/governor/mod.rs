//! The governor: admission control, queueing, shedding and deadlines for a set of backends.
//!
//! Every call takes `now_us`; nothing here reads a clock, so the simulator and the gateway
//! drive the very same decisions, and a replay of the same events gives the same answers.
//!
//! Life of a request: `submit` admits it onto a backend, queues it, or rejects it with a reason
//! and a Retry-After; a request it queues is dispatched at once when a slot can take it (and
//! then comes back admitted). `dispatch` moves queued requests onto freed slots in fair order.
//! Token observations grow its KV footprint and its tenant's fair-share counter. `finish` (or
//! `expire`) ends it exactly once and frees its slot, queue entry and KV blocks.
//!
//! The methods fall into four kinds (as in quinn-proto's `Connection`):
//! - queries: `running`, `queued`, `live`, `is_live`, `tenant_id`, `backend_id`,
//!   `backend_name`, `drain_rate`, `next_deadline_us`, `snapshot`;
//! - events in: `submit`, `on_first_token`, `on_tokens`, `finish`, `observe_backend`,
//!   `set_kv_capacity`, `set_backend_health`;
//! - commands: `start_draining`;
//! - actions out: `dispatch` (admissions) and `expire` (missed deadlines).
//!
//! The code is split by concern: this file holds the state, the queries and `submit`;
//! `dispatch`, `deadlines`, `shedding`, `lifecycle` (tokens and `finish`) and `observe`
//! (backend scrapes and health) hold the rest.

mod arrival;
mod deadlines;
mod dispatch;
mod headroom;
mod lifecycle;
mod limits;
mod observe;
mod refusal;
mod retries;
mod shared;
mod shedding;

use std::collections::BTreeSet;

use rustc_hash::FxHashMap;

use crate::backend::{BackendState, EWMA_ALPHA};
use crate::config::{BackendRole, PolicyConfig, RoutePolicy};
use crate::error::{PolicyError, PolicyResult};
use crate::fair_queue::{FairQueue, QueuedItem};
use crate::kv::KvLedger;
use crate::routing::{Pools, PrefixMemory};
use crate::types::{Admission, Decision, ExpiryReason, Outcome, RejectReason};

pub use arrival::{Arrival, OwnedArrival, Route};
pub use headroom::servers_needed;
use headroom::TierLoad;

/// Mean service time assumed until the first completion is measured; it only shapes the
/// first Retry-After and queue-wait estimates.
const PRIOR_SERVICE_S: f64 = 10.0;
/// Retry-After bounds: never zero (clients would hammer), never beyond an hour.
const RETRY_AFTER_RANGE: (f64, f64) = (0.05, 3600.0);

#[derive(Debug, Clone)]
pub(crate) struct Running {
    /// Where it holds its slot and KV and decodes.
    pub backend: u32,
    /// In a split pool, while its prefill hop runs: the prefill instance (its slot there is
    /// held until the hop answers, `Governor::prefilled`, or the request ends).
    pub prefill: Option<u32>,
    /// Its pool is split: its prompt's prefill was counted on the prefill instance.
    split: bool,
    admitted_us: u64,
    pub first_token: bool,
    /// Nothing else was in prefill on its backend when it started: its own time to first
    /// token then bounds the backend's prefill throughput from below.
    prefill_alone: bool,
}

impl Running {
    /// How long its prompt took to its first token (or its prefill hop's answer) if nothing
    /// else was in prefill on its backend when it started, else 0. Only such a prompt bounds
    /// the backend's prefill throughput: under a burst each prompt shares the steps, and its
    /// own time says little.
    pub(crate) fn alone_us(&self, now_us: u64) -> u64 {
        if self.prefill_alone {
            now_us.saturating_sub(self.admitted_us)
        } else {
            0
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Request {
    pub tenant: u32,
    pub tier: usize,
    /// The model pool it waits and runs in.
    pub pool: u32,
    /// Its block hashes, kept only in a `prefix` pool (remembered where it starts).
    pub chain: Vec<u64>,
    /// In a `prefix` pool, once started: the leading blocks its backend likely held then.
    pub prefix_hits: Option<u64>,
    pub prompt: u64,
    pub max_tokens: u64,
    pub generated: u64,
    /// KV blocks this request counts against its backend while running: the larger of its
    /// expected peak (prompt plus expected output, fixed at start) and what it holds now.
    pub committed: u64,
    /// `max_tokens` after a brownout clamped it (`None`: as asked).
    pub browned_out: Option<u64>,
    pub priority: i64,
    pub submitted_us: u64,
    /// When its client first came: `submitted_us`, or earlier for a known retry.
    first_seen_us: u64,
    fingerprint: u64,
    pub running: Option<Running>,
    deadlines: [Option<u64>; 3],
}

/// Counts by decision, reason and outcome, for metrics.
///
/// A request `submit` queued and its own dispatch then started at once counts as `admitted`
/// (its decision says so), not as `queued` plus `dispatched`; other requests that dispatch
/// started count as `dispatched`, like those a host's `dispatch` call starts.
#[derive(Debug, Clone, Default)]
pub struct Counters {
    pub admitted: u64,
    pub queued: u64,
    pub dispatched: u64,
    /// Requests admitted or queued with `max_tokens` clamped by a brownout.
    pub browned_out: u64,
    /// Arrivals known as a client's retry of a request that ended unserved (`retries`).
    pub retries_known: u64,
    /// Queued requests that went to their tier's late lane (moved there, or arrived late).
    pub late: u64,
    pub rejected: [u64; RejectReason::ALL.len()],
    pub finished: [u64; Outcome::ALL.len()],
    pub expired: [u64; ExpiryReason::ALL.len()],
}

#[derive(Debug, Clone)]
pub struct Governor {
    pub(crate) config: PolicyConfig,
    tenant_index: FxHashMap<String, u32>,
    pub(crate) tenant_tier: Vec<usize>,
    /// Tenants of each tier, for fair-share checks on the waiting places.
    tier_tenants: Vec<Vec<u32>>,
    pub(crate) requests: FxHashMap<u64, Request>,
    pub(crate) queue: FairQueue,
    pub(crate) ledger: KvLedger,
    pub(crate) backends: Vec<BackendState>,
    /// The model pools and their routing.
    pub(crate) pools: Pools,
    /// Per backend: the block hashes of prompts routed there (its likely prefix cache).
    pub(crate) prefix: Vec<PrefixMemory>,
    deadlines: BTreeSet<(u64, u64, ExpiryReason)>,
    /// Queued requests of the fresh lanes by the time they move to the late lane.
    lapses: BTreeSet<(u64, u64)>,
    /// When the clients of requests that ended unserved first came, by fingerprint.
    retries: retries::RetryMemory,
    pub(crate) shed_level: u8,
    breaker_until_us: u64,
    service_s: Option<f64>,
    /// Per tier: arrival rate, hold time and KV commitment, measured (headroom sizing).
    pub(crate) tier_load: Vec<TierLoad>,
    /// Slots the latency tiers need kept free beyond those they hold, and when computed.
    pub(crate) headroom: u32,
    headroom_at_us: Option<u64>,
    /// Output tokens of completed requests, smoothed (`None` until one ends): per tenant, then
    /// per tier and over all, for tenants with no completed request yet.
    expected_output: Vec<Option<f64>>,
    tier_output: Vec<Option<f64>>,
    all_output: Option<f64>,
    /// Per tenant: its rate-limit token buckets.
    buckets: Vec<limits::Buckets>,
    pub(crate) draining: bool,
    pub(crate) counters: Counters,
    /// Admissions `submit`'s own dispatch made for other requests, handed out first by the
    /// next `dispatch` call.
    pending: Vec<Admission>,
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
        let pools = Pools::new(&config);
        let prefix = config
            .backends
            .iter()
            .map(|b| {
                PrefixMemory::new(if b.kv_blocks > 0 {
                    b.kv_blocks
                } else {
                    config.routing.prefix_memory_blocks
                })
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
            tenant_index: config
                .tenants
                .iter()
                .enumerate()
                .map(|(i, t)| (t.name.clone(), i as u32))
                .collect(),
            queue: FairQueue::pooled(config.strategy, tiers, &weights, pools.len()),
            ledger: KvLedger::new(
                config.block_size,
                config.tenants.len(),
                config.backends.len(),
            ),
            tenant_tier,
            requests: FxHashMap::default(),
            backends,
            pools,
            prefix,
            deadlines: BTreeSet::new(),
            lapses: BTreeSet::new(),
            retries: retries::RetryMemory::default(),
            shed_level: 0,
            breaker_until_us: 0,
            service_s: None,
            tier_load: vec![TierLoad::default(); tiers],
            headroom: 0,
            headroom_at_us: None,
            expected_output: vec![None; config.tenants.len()],
            tier_output: vec![None; tiers],
            all_output: None,
            buckets: Self::full_buckets(&config),
            draining: false,
            counters: Counters::default(),
            pending: Vec::new(),
            config,
        })
    }

    pub fn from_json(text: &str) -> PolicyResult<Self> {
        Self::new(PolicyConfig::from_json(text)?)
    }

    // ---- queries -------------------------------------------------------------------------

    /// Requests running (each holds one slot on a backend that is not a prefill instance).
    pub fn running(&self) -> u32 {
        self.serving().map(|b| b.running).sum()
    }

    /// The backends requests run on: all but a split pool's prefill instances.
    pub(crate) fn serving(&self) -> impl Iterator<Item = &BackendState> + '_ {
        self.backends.iter().filter(|b| !b.prefill_only)
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

    /// The pool a request naming `model` goes to (see `Pools::resolve`).
    ///
    /// # Errors
    /// `UnknownModel` or `ModelRequired`.
    /// Whether a pool has a healthy backend to serve a request: in a split pool, a healthy
    /// prefill and a healthy decode instance.
    fn pool_can_serve(&self, pool: u32) -> bool {
        let healthy = |role: Option<BackendRole>| {
            (0..self.backends.len()).any(|b| {
                self.backends[b].healthy
                    && self.pools.serves(pool, b)
                    && role.is_none_or(|r| self.pools.role(b) == r)
            })
        };
        if self.pools.is_split(pool) {
            healthy(Some(BackendRole::Prefill)) && healthy(Some(BackendRole::Decode))
        } else {
            healthy(None)
        }
    }

    pub fn pool_of(&self, model: Option<&str>) -> PolicyResult<u32> {
        self.pools.resolve(model)
    }

    /// The model pools: names clients may send and the served model each routes to.
    pub fn pools(&self) -> &Pools {
        &self.pools
    }

    pub fn backend_name(&self, backend: u32) -> &str {
        &self.backends[backend as usize].name
    }

    pub fn tier_name(&self, tier: usize) -> &str {
        &self.config.tiers[tier].name
    }

    /// Weighted tokens charged to a tenant so far.
    pub fn tenant_service(&self, tenant: u32) -> f64 {
        self.queue.service(tenant)
    }

    /// Requests per second the backends drain when saturated: slots / mean service time.
    pub fn drain_rate(&self) -> f64 {
        let slots: u32 = self
            .serving()
            .filter(|b| b.healthy)
            .map(BackendState::slots)
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

    /// Queued requests of this pool, of this tier and the more important ones: those a
    /// newcomer of the tier waits behind.
    fn waiting_ahead(&self, pool: u32, tier_idx: usize) -> usize {
        (0..=tier_idx)
            .map(|t| self.queue.pool_tier_len(pool, t))
            .sum()
    }

    /// Those a fresh newcomer of the tier waits behind: the more important tiers, and its own
    /// tier's fresh lane.
    fn fresh_ahead(&self, pool: u32, tier_idx: usize) -> usize {
        (0..tier_idx)
            .map(|t| self.queue.pool_tier_len(pool, t))
            .sum::<usize>()
            + self.queue.pool_tier_fresh_len(pool, tier_idx)
    }

    /// When a request of the tier whose client first came at `first_seen_us` can no longer
    /// meet its TTFT SLA and moves to the late lane; `None` where the tier has one lane (no
    /// SLA, `late_yields` off, or a best-effort tier, which has no latency target).
    fn lapse_time(&self, tier_idx: usize, first_seen_us: u64) -> Option<u64> {
        if !self.config.late_yields || self.config.tiers[tier_idx].best_effort {
            return None;
        }
        us(self.config.ttft_sla_ms).map(|sla| first_seen_us + sla)
    }

    /// Whether a request of this fingerprint is remembered when it ends unserved: it has one,
    /// and `late_yields` is on (off, retries are not told apart, as before either existed).
    pub(super) fn remembers(&self, fingerprint: u64) -> bool {
        fingerprint != 0 && self.config.late_yields
    }

    /// When the client of a request arriving now first came: earlier than now for a retry of
    /// one that ended unserved (`retries`).
    fn first_seen(&self, tenant: u32, fingerprint: u64, now_us: u64) -> u64 {
        if !self.remembers(fingerprint) {
            return now_us;
        }
        self.retries
            .first_seen(tenant, fingerprint, now_us)
            .map_or(now_us, |at| at.min(now_us))
    }

    /// A request of the tier whose client first came at `first_seen_us` is late now: its SLA
    /// has passed while its tier is overwhelmed (see `lapse`).
    fn is_late(&self, tier_idx: usize, first_seen_us: u64, now_us: u64) -> bool {
        self.lapse_time(tier_idx, first_seen_us)
            .is_some_and(|at| at <= now_us)
            && self.overwhelmed(tier_idx, now_us)
    }

    /// A lapse is due: a fresh-lane request is past its SLA and not yet moved.
    pub(super) fn lapse_due(&self, now_us: u64) -> bool {
        self.lapses.first().is_some_and(|&(at, _)| at <= now_us)
    }

    /// Move every queued request past its SLA to its tier's late lane, where the tier is
    /// overwhelmed (`overwhelmed`). In a burst, or an overload the queue absorbs, first come,
    /// first served keeps the worst wait shortest (azure-code's TTFT p99: 19.9 s in one lane,
    /// 20.6 s with lanes from any sustained overload); only an overload whose excess the queue
    /// cannot hold is worth reordering for the requests that can still be on time. A request
    /// past its SLA while its tier is not overwhelmed stays where it is.
    pub(super) fn lapse(&mut self, now_us: u64) {
        while let Some(&(at, id)) = self.lapses.first() {
            if at > now_us {
                break;
            }
            self.lapses.pop_first();
            let Some(req) = self.requests.get(&id) else {
                continue;
            };
            if self.overwhelmed(req.tier, now_us) && self.queue.lapse(id) {
                self.counters.late += 1;
            }
        }
    }

    /// A request leaves the queue: it no longer lapses (its entry, if it had one, is at its
    /// `lapse_time`; one that queued late or has lapsed already has none).
    pub(super) fn clear_lapse(&mut self, id: u64) {
        let req = self.requests.get(&id);
        if let Some(at) = req.and_then(|r| self.lapse_time(r.tier, r.first_seen_us)) {
            self.lapses.remove(&(at, id));
        }
    }

    /// Output tokens a request of this tenant is expected to generate: the tenant's measured
    /// mean; for a tenant with no completed request yet, its tier's, else everyone's (a new
    /// tenant's requests are expected to look like the others'); never above the request's own
    /// `max_tokens`, which is the guess until anything is measured.
    pub(crate) fn expected_output(&self, tenant: u32, max_tokens: u64) -> u64 {
        let tier = self.tenant_tier[tenant as usize];
        self.expected_output[tenant as usize]
            .or(self.tier_output[tier])
            .or(self.all_output)
            .map_or(max_tokens, |mean| (mean.ceil() as u64).min(max_tokens))
    }

    pub(super) fn record_output(&mut self, tenant: u32, generated: u64) {
        let g = generated as f64;
        let fold =
            |slot: &mut Option<f64>| *slot = Some(slot.map_or(g, |m| m + EWMA_ALPHA * (g - m)));
        let tier = self.tenant_tier[tenant as usize];
        fold(&mut self.expected_output[tenant as usize]);
        fold(&mut self.tier_output[tier]);
        fold(&mut self.all_output);
    }

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

    fn check_pool(&self, pool: u32) -> PolicyResult<()> {
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
        let first_seen = self.first_seen(tenant, route.fingerprint, now_us);
        self.counters.retries_known += u64::from(first_seen < now_us);
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
            self.insert(id, kept, tier_idx, priority, first_seen, now_us);
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
        let first_seen = self.requests[&id].first_seen_us;
        let late = self.is_late(tier_idx, first_seen, now_us);
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
        if let Some(at) = self.lapse_time(tier_idx, first_seen).filter(|_| !late) {
            self.lapses.insert((at, id));
        }
        if let Some(ms) = us(self.config.queue_timeout_ms) {
            self.set_deadline(id, ExpiryReason::QueueTimeout, now_us + ms);
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
        let late = self.is_late(
            tier_idx,
            self.first_seen(tenant, route.fingerprint, now_us),
            now_us,
        );
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
        if !tier.protected && self.shed_level > 0 {
            let scale = 0.5_f64.powi(i32::from(self.shed_level));
            // The configured places, not the drained room: preemptions mean the measured drain
            // no longer holds.
            let configured = f64::from(self.config.max_waiting);
            let limit = (tier.shed_at * scale * configured).floor() as usize;
            if queued >= limit {
                let cooldown = self.breaker_until_us.saturating_sub(now_us) as f64 / 1e6;
                return reject(RejectReason::PreemptionBreaker, cooldown.max(over(limit)));
            }
        }
        if let Some(excess) = sla_excess {
            return reject(RejectReason::TtftSla, excess);
        }
        let position = ahead - usize::from(counted_victim);
        Decision::Queued {
            position: position as u32,
            estimated_wait_s: (position + 1) as f64 / drain,
            priority,
            displaced,
        }
    }

    /// Make a request `submit` let in live (started or queued): `arrival` as it is kept (after
    /// a brownout's clamp), when its client first came and now.
    fn insert(
        &mut self,
        id: u64,
        arrival: Arrival<'_>,
        tier: usize,
        priority: i64,
        first_seen_us: u64,
        now_us: u64,
    ) {
        let Arrival {
            tenant,
            prompt,
            max_tokens,
            route,
        } = arrival;
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
            running: None,
            deadlines: [None; 3],
        };
        self.requests.insert(id, request);
        if let Some(ms) = us(self.config.request_timeout_ms) {
            self.set_deadline(id, ExpiryReason::Deadline, now_us + ms);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::config::tests::sample_json;

    pub(crate) const S: u64 = 1_000_000;

    /// The crate's sample config: one backend of 2 slots and 1000 KV blocks, a 4-deep queue,
    /// tiers vip (protected), normal (shed at 50%) and batch (shed at 50%, half the slots).
    pub(crate) fn governor() -> Governor {
        Governor::from_json(&sample_json()).unwrap()
    }

    pub(crate) fn tenant(g: &Governor, name: &str) -> u32 {
        g.tenant_id(name).unwrap()
    }

    /// A minute in which the tier's requests arrived far faster than it drains (sixty at
    /// `now_us`, against the prior hold's 0.1/s per request running), so the TTFT SLA may refuse.
    pub(crate) fn sustained(g: &mut Governor, tier: usize, now_us: u64) {
        for _ in 0..60 {
            g.tier_load[tier].arrive(now_us);
        }
    }

    // Below the cap requests are admitted at once; beyond it they queue, in order.
    #[test]
    fn admits_then_queues() {
        let mut g = governor();
        let a = tenant(&g, "a");
        assert!(matches!(
            g.submit(1, Arrival::new(a, 10, 10), 0).unwrap(),
            Decision::Admitted { .. }
        ));
        assert!(matches!(
            g.submit(2, Arrival::new(a, 10, 10), 0).unwrap(),
            Decision::Admitted { .. }
        ));
        let third = g.submit(3, Arrival::new(a, 10, 10), 0).unwrap();
        assert!(
            matches!(third, Decision::Queued { position: 0, .. }),
            "{third:?}"
        );
        assert_eq!((g.running(), g.queued()), (2, 1));
        assert_eq!((g.counters.admitted, g.counters.queued), (2, 1));
    }

    // Reusing a live id is an error; after it ends the id may be reused.
    #[test]
    fn duplicate_ids() {
        let mut g = governor();
        let a = tenant(&g, "a");
        g.submit(1, Arrival::new(a, 10, 10), 0).unwrap();
        assert_eq!(
            g.submit(1, Arrival::new(a, 10, 10), 0),
            Err(PolicyError::DuplicateRequest(1))
        );
        g.finish(1, Outcome::Cancelled, 0);
        assert!(g.submit(1, Arrival::new(a, 10, 10), 0).is_ok());
    }

    // A request that queues behind one held back by KV fit starts at once when it fits: the
    // decision says admitted, and it counts as admitted, not as queued and dispatched.
    #[test]
    fn submit_dispatches_its_own_request() {
        let mut g = governor();
        g.config.kv_pressure_threshold = None;
        g.config.ttft_sla_ms = None;
        let (a, z) = (tenant(&g, "a"), tenant(&g, "z"));
        g.submit(1, Arrival::new(a, 15_000, 10), 0).unwrap();
        // 2,000 tokens do not fit in the 62 free blocks: normal's head waits.
        assert!(matches!(
            g.submit(2, Arrival::new(a, 2_000, 10), 0).unwrap(),
            Decision::Queued { .. }
        ));
        // A small batch request has normal's request ahead of it, yet fits the free slot.
        let decision = g.submit(3, Arrival::new(z, 10, 10), 1).unwrap();
        assert!(
            matches!(decision, Decision::Admitted { backend: 0, .. }),
            "{decision:?}"
        );
        assert_eq!((g.running(), g.queued()), (2, 1));
        let counters = &g.counters;
        assert_eq!(
            (counters.admitted, counters.queued, counters.dispatched),
            (2, 1, 0)
        );
        assert!(g.dispatch(1).is_empty());
    }

    // Other requests that submit's dispatch starts (here: a breaker level cooled down) are not
    // lost: the next dispatch call returns them first, once, and the newcomer's position no
    // longer counts them.
    #[test]
    fn submit_buffers_other_admissions() {
        let mut g = governor();
        let (a, z) = (tenant(&g, "a"), tenant(&g, "z"));
        g.observe_backend(0, 0, None, None, None, Some(1)).unwrap();
        g.observe_backend(0, 10, None, None, None, Some(2)).unwrap();
        assert_eq!(g.shed_level, 1);
        // Level 1 leaves normal one slot: the second request waits.
        g.submit(1, Arrival::new(a, 10, 10), 20).unwrap();
        assert!(matches!(
            g.submit(2, Arrival::new(a, 10, 10), 20).unwrap(),
            Decision::Queued { .. }
        ));
        // After the cool-down a batch request queues behind it; its dispatch starts request 2
        // on the freed level and leaves the batch request first in line.
        let decision = g.submit(3, Arrival::new(z, 10, 10), 2 * S).unwrap();
        assert!(
            matches!(
                decision,
                Decision::Queued {
                    position: 0,
                    displaced: None,
                    ..
                }
            ),
            "{decision:?}"
        );
        assert_eq!(g.shed_level, 0);
        let handed = g.dispatch(2 * S);
        assert_eq!(handed.len(), 1);
        assert_eq!(
            (handed[0].request_id, handed[0].queue_wait_us),
            (2, 2 * S - 20)
        );
        assert!(g.dispatch(2 * S).is_empty());
        let counters = &g.counters;
        assert_eq!(
            (counters.admitted, counters.queued, counters.dispatched),
            (1, 2, 1)
        );
    }

    // A request ended before its buffered admission is collected is not handed out.
    #[test]
    fn ended_requests_leave_the_buffer() {
        let mut g = governor();
        let (a, z) = (tenant(&g, "a"), tenant(&g, "z"));
        g.observe_backend(0, 0, None, None, None, Some(1)).unwrap();
        g.observe_backend(0, 10, None, None, None, Some(2)).unwrap();
        g.submit(1, Arrival::new(a, 10, 10), 20).unwrap();
        g.submit(2, Arrival::new(a, 10, 10), 20).unwrap();
        g.submit(3, Arrival::new(z, 10, 10), 2 * S).unwrap();
        assert!(g.finish(2, Outcome::Cancelled, 2 * S));
        let handed: Vec<u64> = g.dispatch(2 * S).iter().map(|a| a.request_id).collect();
        assert_eq!(handed, vec![3]);
    }
}
