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
//! The code is split by concern: this file holds the state and the queries; `admission`
//! `submit` and its decision, `dispatch`, `deadlines`, `shedding`, `lifecycle` (tokens and
//! `finish`) and `observe` (backend scrapes and health) the rest. The sub-states the governor
//! owns are types with their own methods and tests: `Arrival` (what `submit` decides on),
//! `Request` and `Running`, `DeadlineTable`, `Breaker` (the preemption breaker),
//! `OutputMemory` (expected output), `RetryMemory`, `TierLoad` (per-tier load), `Counters`.

mod admission;
mod arrival;
mod breaker;
mod counters;
mod deadlines;
mod dispatch;
mod headroom;
mod lifecycle;
mod limits;
mod observe;
mod output;
mod pick;
mod refusal;
mod request;
mod retries;
mod shared;
mod shedding;
mod signals;

use std::collections::BTreeSet;

use rustc_hash::FxHashMap;

use crate::backend::BackendState;
use crate::config::{BackendRole, PolicyConfig};
use crate::error::{PolicyError, PolicyResult};
use crate::fair_queue::FairQueue;
use crate::kv::KvLedger;
use crate::routing::{Pools, PrefixMemory};
use crate::types::Admission;

pub use arrival::{Arrival, OwnedArrival, Route, Signals};
use breaker::Breaker;
pub use counters::Counters;
use deadlines::DeadlineTable;
pub use headroom::servers_needed;
use headroom::TierLoad;
use output::OutputMemory;
pub(crate) use request::{Request, Running};

/// Mean service time assumed until the first completion is measured; it only shapes the
/// first Retry-After and queue-wait estimates.
const PRIOR_SERVICE_S: f64 = 10.0;
/// Retry-After bounds: never zero (clients would hammer), never beyond an hour.
const RETRY_AFTER_RANGE: (f64, f64) = (0.05, 3600.0);

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
    deadlines: DeadlineTable,
    /// Queued requests of the fresh lanes by the time they move to the late lane.
    lapses: BTreeSet<(u64, u64)>,
    /// When the clients of requests that ended unserved first came, by fingerprint.
    retries: retries::RetryMemory,
    /// The preemption breaker: its level sheds unprotected tiers' slots.
    pub(crate) breaker: Breaker,
    service_s: Option<f64>,
    /// Per tier: arrival rate, hold time and KV commitment, measured (headroom sizing).
    pub(crate) tier_load: Vec<TierLoad>,
    /// Slots the latency tiers need kept free beyond those they hold, and when computed.
    pub(crate) headroom: u32,
    headroom_at_us: Option<u64>,
    /// Output tokens of completed requests, smoothed (the expected output of a newcomer).
    output: OutputMemory,
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
            deadlines: DeadlineTable::default(),
            lapses: BTreeSet::new(),
            retries: retries::RetryMemory::default(),
            breaker: Breaker::default(),
            service_s: None,
            tier_load: vec![TierLoad::default(); tiers],
            headroom: 0,
            headroom_at_us: None,
            output: OutputMemory::new(config.tenants.len(), tiers),
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

    /// Whether the tenant's tier is protected (never shed; its requests go first wherever the
    /// host orders work, as the front's intake does).
    pub fn is_protected(&self, tenant: u32) -> bool {
        let tier = self.tenant_tier.get(tenant as usize).copied();
        tier.and_then(|t| self.config.tiers.get(t))
            .is_some_and(|t| t.protected)
    }

    pub fn tier_name(&self, tier: usize) -> &str {
        &self.config.tiers[tier].name
    }

    /// The preemption breaker's level (0: nothing shed).
    pub fn shed_level(&self) -> u8 {
        self.breaker.level
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

    /// When a request of the tier whose SLA clock started at `sla_from_us` (its client's first
    /// arrival, `seen`) can no longer meet its TTFT SLA and moves to the late lane; `None`
    /// where the tier has one lane (no SLA, `late_yields` off, or a best-effort tier, which has
    /// no latency target).
    fn lapse_time(&self, tier_idx: usize, sla_from_us: u64) -> Option<u64> {
        if !self.config.late_yields || self.config.tiers[tier_idx].best_effort {
            return None;
        }
        us(self.config.ttft_sla_ms).map(|sla| sla_from_us + sla)
    }

    /// Whether a request of this fingerprint is remembered when it ends unserved: it has one,
    /// and `late_yields` is on (off, retries are not told apart, as before either existed).
    pub(super) fn remembers(&self, fingerprint: u64) -> bool {
        fingerprint != 0 && self.config.late_yields
    }

    /// When the client of a request arriving now first came (its place in its lane), and when
    /// its SLA clock started: earlier than now for a retry of one that ended unserved
    /// (`retries`). A retry its client announces (an honoured retry count above zero) that the
    /// memory does not hold (its first attempt went to another replica, or was forgotten) keeps
    /// its place by now, as an unverified header buys no earlier place, but its SLA clock has
    /// run out: its client has already waited an attempt and a backoff, so it is judged as a
    /// retry past its SLA (the late lane where the tier is overwhelmed, never refused for the
    /// SLA). A count of zero says nothing more than no header: an application's own retry
    /// around an SDK call starts the SDK's count again, so the fingerprint still decides.
    fn seen(&self, tenant: u32, route: Route<'_>, signals: Signals, now_us: u64) -> (u64, u64) {
        if !self.config.late_yields {
            return (now_us, now_us);
        }
        let remembered = (route.fingerprint != 0)
            .then(|| self.retries.first_seen(tenant, route.fingerprint, now_us))
            .flatten();
        if let Some(at) = remembered {
            let at = at.min(now_us);
            return (at, at);
        }
        let announced = self.honoured(signals).retries.is_some_and(|n| n > 0);
        let sla = us(self.config.ttft_sla_ms).filter(|_| announced);
        (now_us, now_us.saturating_sub(sla.unwrap_or(0)))
    }

    /// A request of the tier whose SLA clock started at `sla_from_us` is late now: its SLA
    /// has passed while its tier is overwhelmed (see `lapse`).
    fn is_late(&self, tier_idx: usize, sla_from_us: u64, now_us: u64) -> bool {
        self.lapse_time(tier_idx, sla_from_us)
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
        if let Some(at) = req.and_then(|r| self.lapse_time(r.tier, r.sla_from_us)) {
            self.lapses.remove(&(at, id));
        }
    }

    /// Output tokens a request of this tenant is expected to generate (`OutputMemory`).
    pub(crate) fn expected_output(&self, tenant: u32, max_tokens: u64) -> u64 {
        let tier = self.tenant_tier[tenant as usize];
        self.output.expected(tenant, tier, max_tokens)
    }

    pub(super) fn record_output(&mut self, tenant: u32, generated: u64) {
        let tier = self.tenant_tier[tenant as usize];
        self.output.record(tenant, tier, generated);
    }
}

#[cfg(test)]
pub(crate) mod tests;
