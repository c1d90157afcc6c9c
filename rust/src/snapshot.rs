//! A JSON-ready picture of the governor for metrics, `/api/state` and the KV dashboard.

use serde::Serialize;

use crate::governor::Governor;
use crate::types::{ExpiryReason, Outcome, RejectReason};

#[derive(Debug, Serialize)]
pub struct Snapshot {
    pub now_us: u64,
    pub running: u32,
    pub queued: usize,
    pub queued_by_tier: Vec<(String, usize)>,
    pub shed_level: u8,
    pub draining: bool,
    pub kv_blocks_in_use: u64,
    pub drain_rate_per_s: f64,
    /// Slots kept free for the latency tiers (Erlang C headroom); best-effort work takes none.
    pub headroom_slots: u32,
    pub backends: Vec<BackendSnapshot>,
    pub tenants: Vec<TenantSnapshot>,
    pub requests: Vec<RequestSnapshot>,
    pub counters: CounterSnapshot,
}

#[derive(Debug, Serialize)]
pub struct BackendSnapshot {
    pub name: String,
    /// `both`, or `prefill` / `decode` in a split pool.
    pub role: &'static str,
    pub healthy: bool,
    pub stale: bool,
    pub cap: u32,
    /// Slots usable now (below `cap` while the per-token latency target holds it down).
    pub slots: u32,
    /// Measured seconds per output token while decoding.
    pub tpot_s: Option<f64>,
    pub running: u32,
    pub kv_usage: f64,
    pub kv_blocks_reserved: u64,
    /// Blocks the running requests are expected to reach at their peak.
    pub kv_blocks_committed: u64,
    pub kv_capacity_blocks: u64,
    pub prefill_tokens_per_s: f64,
    pub reported_running: Option<u64>,
    pub reported_waiting: Option<u64>,
    pub preemptions: u64,
}

#[derive(Debug, Serialize)]
pub struct TenantSnapshot {
    pub name: String,
    pub tier: String,
    pub queued: usize,
    pub kv_blocks: u64,
    pub kv_block_seconds: f64,
    pub service: f64,
}

#[derive(Debug, Serialize)]
pub struct RequestSnapshot {
    pub id: u64,
    pub tenant: String,
    pub tier: String,
    pub state: &'static str,
    pub backend: Option<String>,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    pub kv_blocks: u64,
    pub kv_block_seconds: f64,
    pub priority: i64,
    pub age_s: f64,
    /// The served model it routes to, when the backends serve more than one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// In a `prefix` pool: the prompt's leading blocks its backend likely held when it started.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix_hit_blocks: Option<u64>,
}

#[derive(Debug, Serialize)]
pub struct CounterSnapshot {
    pub admitted: u64,
    pub queued: u64,
    pub dispatched: u64,
    pub browned_out: u64,
    pub retries_known: u64,
    pub retries_announced: u64,
    pub late: u64,
    pub rejected: Vec<(RejectReason, u64)>,
    pub finished: Vec<(&'static str, u64)>,
    pub expired: Vec<(&'static str, u64)>,
}

impl Governor {
    // One field per line of the snapshot's JSON: long, but a flat list reads best.
    #[allow(clippy::too_many_lines)]
    pub fn snapshot(&self, now_us: u64) -> Snapshot {
        let stale_after = self.stale_after_us();
        let tiers = &self.config.tiers;
        let backends = self
            .backends
            .iter()
            .enumerate()
            .map(|(i, b)| BackendSnapshot {
                name: b.name.clone(),
                role: self.pools.role(i).as_str(),
                healthy: b.healthy,
                stale: b.is_stale(now_us, stale_after),
                cap: b.cap,
                slots: b.slots(),
                tpot_s: b.tpot_s,
                running: b.running,
                kv_usage: self.backend_kv_usage(i, now_us),
                kv_blocks_reserved: self.ledger.backend_blocks(i as u32),
                kv_blocks_committed: b.committed_blocks,
                kv_capacity_blocks: b.kv_capacity_blocks,
                prefill_tokens_per_s: b.prefill_tps,
                reported_running: b.observed.and_then(|o| o.running),
                reported_waiting: b.observed.and_then(|o| o.waiting),
                preemptions: b.preemptions_total,
            })
            .collect();
        let tenants = self
            .config
            .tenants
            .iter()
            .enumerate()
            .map(|(i, t)| TenantSnapshot {
                name: t.name.clone(),
                tier: t.tier.clone(),
                queued: self.queue.tenant_len(i as u32),
                kv_blocks: self.ledger.tenant_blocks(i as u32),
                kv_block_seconds: self.ledger.tenant_block_seconds(i as u32, now_us),
                service: self.queue.service(i as u32),
            })
            .collect();
        let mut requests: Vec<RequestSnapshot> = self
            .requests
            .iter()
            .map(|(&id, r)| {
                let (blocks, block_seconds) = self.ledger.usage(id, now_us).unwrap_or((0, 0.0));
                let state = match &r.running {
                    None => "queued",
                    Some(run) if run.first_token => "streaming",
                    Some(_) => "prefill",
                };
                RequestSnapshot {
                    id,
                    tenant: self.config.tenants[r.tenant as usize].name.clone(),
                    tier: tiers[r.tier].name.clone(),
                    state,
                    backend: r
                        .running
                        .as_ref()
                        .map(|run| self.backend_name(run.backend).to_owned()),
                    prompt_tokens: r.prompt,
                    generated_tokens: r.generated,
                    kv_blocks: blocks,
                    kv_block_seconds: block_seconds,
                    priority: r.priority,
                    age_s: now_us.saturating_sub(r.submitted_us) as f64 / 1e6,
                    model: (self.pools.len() > 1).then(|| self.pools.name(r.pool).to_owned()),
                    prefix_hit_blocks: r.prefix_hits,
                }
            })
            .collect();
        requests.sort_unstable_by_key(|r| r.id);
        let c = &self.counters;
        Snapshot {
            now_us,
            running: self.running(),
            queued: self.queued(),
            queued_by_tier: tiers
                .iter()
                .enumerate()
                .map(|(i, t)| (t.name.clone(), self.queue.tier_len(i)))
                .collect(),
            shed_level: self.breaker.level,
            draining: self.draining,
            kv_blocks_in_use: self.ledger.total_blocks(),
            drain_rate_per_s: self.drain_rate(),
            headroom_slots: self.headroom_slots(),
            backends,
            tenants,
            requests,
            counters: CounterSnapshot {
                admitted: c.admitted,
                queued: c.queued,
                dispatched: c.dispatched,
                browned_out: c.browned_out,
                retries_known: c.retries_known,
                retries_announced: c.retries_announced,
                late: c.late,
                rejected: RejectReason::ALL
                    .iter()
                    .map(|&r| (r, c.rejected[r as usize]))
                    .collect(),
                finished: Outcome::ALL
                    .iter()
                    .map(|&o| (o.as_str(), c.finished[o as usize]))
                    .collect(),
                expired: ExpiryReason::ALL
                    .iter()
                    .map(|&e| (e.as_str(), c.expired[e as usize]))
                    .collect(),
            },
        }
    }
}
