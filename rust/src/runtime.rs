//! The request lifecycle, sans-IO: hosts feed events, the runtime returns actions.
//!
//! In the manner of h11 or quinn-proto, the runtime does no I/O and reads no clock. A host (the
//! gateway's event loop, the simulator's SimPy world, a trace replay) tells it what happened and
//! when — a request arrived, a backend started it, tokens came, the client left, the one timer
//! fired, a scrape came back — and carries out what it answers: start this request upstream on
//! that backend with this priority, abort that one, reply with this status and Retry-After, cut
//! that reply with a notice, re-arm the timer, mark a backend down. Every rule around the
//! governor's decisions lives here once: deadlines and their renderings, the stall timer, backend
//! health, Retry-After as it goes on the wire, dispatch after anything that frees room, and the
//! drain. Both hosts are therefore thin, and a trace of events replays to the same actions.
//!
//! Every request id a host announces with `Arrive` ends with exactly one terminal action:
//! `Reply` (a status before any body), `Cut` (the reply ends now with a visible notice) or `End`
//! (upstream finished, failed after the reply was committed, or the client left).

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

use crate::config::PolicyConfig;
use crate::error::{PolicyError, PolicyResult};
use crate::governor::Route;
use crate::types::{Decision, Expired, ExpiryReason, Outcome, RejectReason};
use crate::Governor;

/// Two failed scrapes in a row mark a backend down (one lost scrape is noise); a backend that
/// never answered is down at its first failure.
const DEFAULT_SCRAPE_FAILURES: u32 = 2;

/// Lifecycle settings that are not admission policy.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LifecycleConfig {
    /// A client whose window stays full this long is stalled: cut, upstream aborted.
    #[serde(default)]
    pub stall_timeout_ms: Option<f64>,
    /// On a first-token timeout answer 504 (else a degraded 200 with the notice).
    #[serde(default)]
    pub first_token_error: bool,
    /// After `Drain`, how long live requests get before they are cut.
    #[serde(default = "default_drain_ms")]
    pub drain_timeout_ms: f64,
    /// Consecutive failed scrapes that mark a backend down.
    #[serde(default = "default_scrape_failures")]
    pub scrape_failures_before_down: u32,
}

fn default_drain_ms() -> f64 {
    30_000.0
}
fn default_scrape_failures() -> u32 {
    DEFAULT_SCRAPE_FAILURES
}

impl Default for LifecycleConfig {
    fn default() -> Self {
        Self {
            stall_timeout_ms: None,
            first_token_error: false,
            drain_timeout_ms: default_drain_ms(),
            scrape_failures_before_down: DEFAULT_SCRAPE_FAILURES,
        }
    }
}

/// What the runtime is built from: the admission policy and the lifecycle around it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeConfig {
    pub policy: PolicyConfig,
    #[serde(default)]
    pub lifecycle: LifecycleConfig,
}

/// Something that happened, as a host saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Event {
    /// A request arrived (tenant index, prompt tokens, the most tokens it may generate), for
    /// a model pool (`Governor::pool_of`), with its prompt's chained block hashes (for prefix
    /// routing). Both are left out of a trace line when default, so older traces still read.
    Arrive {
        id: u64,
        tenant: u32,
        prompt: u64,
        max_tokens: u64,
        stream: bool,
        #[serde(default, skip_serializing_if = "is_zero")]
        pool: u32,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        chain: Vec<u64>,
        /// The host's fingerprint of the request (0: none), by which a retry is known.
        #[serde(default, skip_serializing_if = "is_zero_u64")]
        fingerprint: u64,
    },
    /// The backend accepted the request (response headers came back).
    Started { id: u64 },
    /// A split request's prefill hop answered (its prefill instance returned the KV transfer
    /// parameters): that instance's slot is free; the host now sends the decode hop.
    Prefilled { id: u64 },
    /// `n` more tokens were generated (the first ones count as the first token).
    Tokens { id: u64, n: u64 },
    /// Upstream finished the request.
    Done { id: u64 },
    /// Upstream failed: the status it answered (0 when unreachable), and whether the backend
    /// could not be reached at all.
    Failed {
        id: u64,
        status: u16,
        backend_down: bool,
    },
    /// The client went away.
    ClientGone { id: u64 },
    /// The client's window of unacknowledged chunks filled up.
    WindowFull { id: u64 },
    /// The client took chunks: its window has room again.
    WindowDrained { id: u64 },
    /// The host's timer fired.
    Timer,
    /// A scrape of a backend's metrics, begun at `began_us`.
    ScrapeOk {
        backend: u32,
        began_us: u64,
        kv_usage: Option<f64>,
        running: Option<u64>,
        waiting: Option<u64>,
        preemptions_total: Option<u64>,
        kv_blocks: Option<u64>,
    },
    /// A scrape of a backend failed. `reachable`: the backend answered (an error status,
    /// something that is not vLLM's metrics, or too slowly), so it is alive and only its
    /// metrics are missing; else nothing answered (no connection, or a proxy's 502-504).
    ScrapeFailed {
        backend: u32,
        #[serde(default)]
        reachable: bool,
    },
    /// Other gateway replicas hold `elsewhere` of the backend's slots and have tenants of
    /// total weight `waiting` waiting, `waiting_before` of it on the replicas ordered before
    /// this one (the shared store's figures, fed each sync; see `governor/shared.rs`).
    SharedLoad {
        backend: u32,
        elsewhere: u32,
        #[serde(default)]
        waiting: f64,
        #[serde(default)]
        waiting_before: f64,
    },
    /// The shared store refused a started request's slot lease (the global cap was reached
    /// elsewhere first): the request never reached the backend and is decided again.
    LeaseDenied { id: u64 },
    /// Other gateway replicas gave `tenant` `cost` weighted tokens of service since the last
    /// sync: its fair-queue counter counts them.
    SharedService { tenant: u32, cost: f64 },
    /// Other gateway replicas let `tenant` use `requests` and `tokens` since the last sync:
    /// its rate-limit buckets pay for them.
    SharedUsage {
        tenant: u32,
        requests: f64,
        tokens: f64,
    },
    /// Stop admitting; cut what is still live after the drain timeout.
    Drain,
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
fn is_zero(n: &u32) -> bool {
    *n == 0
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's `skip_serializing_if` passes a reference
fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}

/// Why a reply ended the way it did, as clients and metrics see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    QueueFull,
    TierShed,
    KvPressure,
    TtftSla,
    PreemptionBreaker,
    Draining,
    NoHealthyBackend,
    Displaced,
    RateLimited,
    QueueTimeout,
    FirstTokenTimeout,
    Deadline,
    ClientStall,
    Shutdown,
    UpstreamError,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::QueueFull => "queue_full",
            Self::TierShed => "tier_shed",
            Self::KvPressure => "kv_pressure",
            Self::TtftSla => "ttft_sla",
            Self::PreemptionBreaker => "preemption_breaker",
            Self::Draining => "draining",
            Self::NoHealthyBackend => "no_healthy_backend",
            Self::Displaced => "displaced",
            Self::RateLimited => "rate_limited",
            Self::QueueTimeout => "queue_timeout",
            Self::FirstTokenTimeout => "first_token_timeout",
            Self::Deadline => "deadline",
            Self::ClientStall => "client_stall",
            Self::Shutdown => "shutdown",
            Self::UpstreamError => "upstream_error",
        }
    }

    fn of_reject(reason: RejectReason) -> Self {
        match reason {
            RejectReason::QueueFull => Self::QueueFull,
            RejectReason::TierShed => Self::TierShed,
            RejectReason::KvPressure => Self::KvPressure,
            RejectReason::TtftSla => Self::TtftSla,
            RejectReason::PreemptionBreaker => Self::PreemptionBreaker,
            RejectReason::Draining => Self::Draining,
            RejectReason::NoHealthyBackend => Self::NoHealthyBackend,
            RejectReason::Displaced => Self::Displaced,
            RejectReason::RateLimited => Self::RateLimited,
        }
    }

    fn of_expiry(reason: ExpiryReason) -> Self {
        match reason {
            ExpiryReason::QueueTimeout => Self::QueueTimeout,
            ExpiryReason::FirstTokenTimeout => Self::FirstTokenTimeout,
            ExpiryReason::Deadline => Self::Deadline,
        }
    }
}

/// What a host must do.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Send the request to `backend` with vLLM priority `priority` (and, after a brownout,
    /// with `max_tokens` clamped to this). With `prefill` (a split pool), send it there
    /// first as vLLM's prefill hop (`max_tokens` 1, asking for remote decode), report
    /// `Prefilled`, then send it to `backend` with the KV transfer parameters the prefill
    /// answered.
    Start {
        id: u64,
        backend: u32,
        priority: i64,
        queue_wait_us: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        max_tokens: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        prefill: Option<PrefillHop>,
    },
    /// The request waits in the gateway's queue (informational: keep the client waiting).
    Queued {
        id: u64,
        position: u32,
        estimated_wait_s: f64,
    },
    /// Close the upstream request now: vLLM aborts it and frees its KV blocks.
    Abort { id: u64 },
    /// Terminal: answer with this status; `retry_after_s` is the header's value, as sent.
    Reply {
        id: u64,
        status: u16,
        reason: Reason,
        retry_after_s: Option<u32>,
    },
    /// Terminal: end the reply now with the partial text and a visible notice.
    Cut { id: u64, reason: Reason },
    /// Terminal: the request is over (upstream done or failed after the reply was committed,
    /// or the client left).
    End { id: u64, outcome: Outcome },
    /// (Re)set the host's one timer to fire at `at_us`. It may fire early (nothing is due then
    /// and the runtime arms it again); it must not fire late.
    Arm { at_us: u64 },
    /// A backend went down or came back.
    Backend { backend: u32, healthy: bool },
}

/// A split request's prefill hop: where it goes first, and with which vLLM priority.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PrefillHop {
    pub backend: u32,
    pub priority: i64,
}

impl Action {
    /// Whether this action ends its request.
    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            Self::Reply { .. } | Self::Cut { .. } | Self::End { .. }
        )
    }
}

/// A refusal as `arrive` answers it: the `Reply`'s status, reason and Retry-After.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    pub status: u16,
    pub reason: Reason,
    /// Whole seconds, as the header carries them (`wire_retry_after`).
    pub retry_after_s: u32,
}

impl Refusal {
    fn of(reason: RejectReason, retry_after_s: f64) -> Self {
        let status = match reason {
            RejectReason::Draining | RejectReason::NoHealthyBackend => 503,
            _ => 429,
        };
        Self {
            status,
            reason: Reason::of_reject(reason),
            retry_after_s: wire_retry_after(retry_after_s),
        }
    }
}

/// The seconds a Retry-After header carries: whole seconds (RFC 9110), at least one, rounded up
/// so a client is never told to come back before the estimate.
pub fn wire_retry_after(seconds: f64) -> u32 {
    seconds.ceil().clamp(1.0, f64::from(u32::MAX)) as u32
}

#[derive(Debug, Clone)]
#[allow(clippy::struct_excessive_bools)] // independent facts about one request, not a mode
struct Session {
    stream: bool,
    /// `Start` was emitted: ending the request early must abort it upstream.
    started: bool,
    first_token: bool,
    /// When the stall timer fires, while the client's window is full.
    stall_at: Option<u64>,
    /// Upstream finished while the client's window was full: the slot is free, and the reply
    /// ends when the client takes what it is owed (`End`) or stalls for good (`Cut`).
    upstream_done: bool,
}

/// What a scrape read (`Event::ScrapeOk` without its backend and time).
struct Scrape {
    kv_usage: Option<f64>,
    running: Option<u64>,
    waiting: Option<u64>,
    preemptions_total: Option<u64>,
    kv_blocks: Option<u64>,
}

#[derive(Debug, Clone, Default)]
struct Health {
    healthy: bool,
    ever_scraped: bool,
    /// Consecutive failed scrapes, of any kind.
    failures: u32,
    /// Consecutive scrapes nothing answered.
    unreachable: u32,
    /// When a request last found the backend unreachable: a scrape begun before proves nothing.
    down_at: Option<u64>,
}

/// The lifecycle of every request around one `Governor`.
#[derive(Debug, Clone)]
pub struct Runtime {
    gov: Governor,
    life: LifecycleConfig,
    sessions: FxHashMap<u64, Session>,
    stalls: BTreeSet<(u64, u64)>,
    drain_at: Option<u64>,
    health: Vec<Health>,
    /// The timer the host holds now (what the last `Arm` said), if any.
    armed: Option<u64>,
    out: Vec<Action>,
}

fn us(ms: f64) -> u64 {
    (ms * 1000.0).round() as u64
}

impl Runtime {
    pub fn new(config: RuntimeConfig) -> PolicyResult<Self> {
        let backends = config.policy.backends.len();
        if config
            .lifecycle
            .stall_timeout_ms
            .is_some_and(|v| v.is_nan() || v < 0.0)
        {
            return Err(PolicyError::config(
                "lifecycle.stall_timeout_ms",
                "must be >= 0 or null",
            ));
        }
        if config.lifecycle.drain_timeout_ms.is_nan() || config.lifecycle.drain_timeout_ms < 0.0 {
            return Err(PolicyError::config(
                "lifecycle.drain_timeout_ms",
                "must be >= 0",
            ));
        }
        Ok(Self {
            gov: Governor::new(config.policy)?,
            life: config.lifecycle,
            sessions: FxHashMap::default(),
            stalls: BTreeSet::new(),
            drain_at: None,
            health: vec![
                Health {
                    healthy: true,
                    ..Health::default()
                };
                backends
            ],
            armed: None,
            out: Vec::new(),
        })
    }

    pub fn from_json(text: &str) -> PolicyResult<Self> {
        let config: RuntimeConfig = serde_json::from_str(text)
            .map_err(|e| PolicyError::config("(document)", e.to_string()))?;
        Self::new(config)
    }

    /// The governor, for queries (metrics, snapshots).
    pub fn governor(&self) -> &Governor {
        &self.gov
    }

    /// Requests announced and not yet ended.
    pub fn live(&self) -> usize {
        self.sessions.len()
    }

    pub fn is_live(&self, id: u64) -> bool {
        self.sessions.contains_key(&id)
    }

    pub fn backend_healthy(&self, backend: u32) -> bool {
        self.health[backend as usize].healthy
    }

    pub fn scrape_failures(&self, backend: u32) -> u32 {
        self.health[backend as usize].failures
    }

    /// When the host's timer should fire next, if anything is pending.
    pub fn next_timer_us(&self) -> Option<u64> {
        let stall = self.stalls.first().map(|&(at, _)| at);
        [self.gov.next_wakeup_us(), stall, self.drain_at]
            .into_iter()
            .flatten()
            .min()
    }

    /// What `arrive` would answer a request of `tenant` at `now_us` if it refuses it at once,
    /// without changing anything; `None` when it would admit or queue it, or when only
    /// `arrive` itself can tell (see `Governor::refusal`). A host may answer a refused request
    /// on a short path, but still feeds it `arrive`: the `Reply` it then gets is this refusal.
    pub fn refusal(
        &self,
        tenant: u32,
        prompt: u64,
        max_tokens: u64,
        route: Route<'_>,
        now_us: u64,
    ) -> PolicyResult<Option<Refusal>> {
        let refused = self
            .gov
            .refusal_routed(tenant, prompt, max_tokens, route, now_us)?;
        Ok(refused.map(|(reason, seconds)| Refusal::of(reason, seconds)))
    }

    /// Feed one event that happened at `now_us`; the actions to carry out, in order, are in
    /// `actions()` until the next event. (Reusing one buffer keeps the per-event cost off the
    /// allocator.)
    pub fn feed(&mut self, now_us: u64, event: &Event) -> PolicyResult<()> {
        self.out.clear();
        // The per-chunk hot path: tokens after the first move no deadline and free no room;
        // neither does a backend's accepting the request (recorded for traces only).
        match *event {
            Event::Tokens { id, n } => {
                if let Some(s) = self.sessions.get(&id) {
                    if s.first_token && !s.upstream_done {
                        self.gov.on_tokens(id, n, now_us);
                        return Ok(());
                    }
                }
            }
            Event::Started { .. } => return Ok(()),
            _ => {}
        }
        let frees_room = self.apply(now_us, event)?;
        if frees_room {
            self.dispatch(now_us);
        }
        self.rearm();
        Ok(())
    }

    /// What the last `feed` asked the host to do.
    pub fn actions(&self) -> &[Action] {
        &self.out
    }

    /// `feed`, with the actions returned as a vector (tests, replays).
    pub fn handle(&mut self, now_us: u64, event: &Event) -> PolicyResult<Vec<Action>> {
        self.feed(now_us, event)?;
        Ok(self.out.clone())
    }

    // One arm per event, each a call: splitting the match would only scatter the dispatch.
    #[allow(clippy::too_many_lines)]
    fn apply(&mut self, now: u64, event: &Event) -> PolicyResult<bool> {
        Ok(match *event {
            Event::Arrive {
                id,
                tenant,
                prompt,
                max_tokens,
                stream,
                pool,
                ref chain,
                fingerprint,
            } => {
                let route = Route {
                    pool,
                    chain,
                    fingerprint,
                };
                self.arrive(id, tenant, (prompt, max_tokens), stream, route, now)?;
                true
            }
            Event::Started { .. } => unreachable!("handled in `feed`"),
            Event::Tokens { id, n } => {
                // A first token means the request's prefill is done: a prompt held back by
                // prefill pacing may start now, so the queue is looked at again.
                let mut prefill_done = false;
                if let Some(s) = self.sessions.get_mut(&id) {
                    if n > 0 && s.started && !s.upstream_done {
                        prefill_done = !s.first_token;
                        s.first_token = true;
                        self.gov.on_tokens(id, n, now);
                    }
                }
                prefill_done && self.gov.queued() > 0
            }
            Event::Done { id } => {
                self.done(id, now);
                true
            }
            Event::Prefilled { id } => {
                let live = self
                    .sessions
                    .get(&id)
                    .is_some_and(|s| s.started && !s.upstream_done);
                live && self.gov.prefilled(id, now)
            }
            Event::Failed {
                id,
                status,
                backend_down,
            } => self.failed(id, status, backend_down, now),
            Event::ClientGone { id } => {
                if let Some(s) = self.sessions.get(&id) {
                    if s.started && !s.upstream_done {
                        self.out.push(Action::Abort { id });
                    }
                    self.end(id, Outcome::Cancelled, now);
                }
                true
            }
            Event::WindowFull { id } => {
                let timeout = self.life.stall_timeout_ms.map(us);
                if let (Some(s), Some(timeout)) = (self.sessions.get_mut(&id), timeout) {
                    if s.started && s.stall_at.is_none() {
                        s.stall_at = Some(now + timeout);
                        self.stalls.insert((now + timeout, id));
                    }
                }
                false
            }
            Event::WindowDrained { id } => {
                if let Some(s) = self.sessions.get_mut(&id) {
                    if let Some(at) = s.stall_at.take() {
                        self.stalls.remove(&(at, id));
                    }
                    if s.upstream_done {
                        self.end(id, Outcome::Completed, now);
                    }
                }
                false
            }
            Event::Timer => {
                self.armed = None;
                self.fire(now);
                true
            }
            Event::ScrapeOk {
                backend,
                began_us,
                kv_usage,
                running,
                waiting,
                preemptions_total,
                kv_blocks,
            } => {
                let scrape = Scrape {
                    kv_usage,
                    running,
                    waiting,
                    preemptions_total,
                    kv_blocks,
                };
                self.scraped(backend, began_us, &scrape, now)?;
                true
            }
            Event::ScrapeFailed { backend, reachable } => {
                self.scrape_failed(backend, reachable)?;
                false
            }
            Event::SharedLoad {
                backend,
                elsewhere,
                waiting,
                waiting_before,
            } => self.shared_load(backend, elsewhere, waiting, waiting_before)?,
            Event::LeaseDenied { id } => self.lease_denied(id, now)?,
            Event::SharedService { tenant, cost } => {
                self.gov.charge_elsewhere(tenant, cost)?;
                false
            }
            Event::SharedUsage {
                tenant,
                requests,
                tokens,
            } => {
                self.gov
                    .charge_usage_elsewhere(tenant, requests, tokens, now)?;
                false
            }
            Event::Drain => {
                if self.drain_at.is_none() && !self.gov.draining {
                    self.gov.start_draining();
                    self.drain_at = Some(now + us(self.life.drain_timeout_ms));
                }
                false
            }
        })
    }

    fn check_backend(&self, backend: u32) -> PolicyResult<()> {
        if (backend as usize) < self.health.len() {
            Ok(())
        } else {
            Err(PolicyError::UnknownBackend(backend.to_string()))
        }
    }

    /// Upstream finished: the request ends, or, when its client still owes a full window,
    /// frees its slot now and ends when the client takes what it is owed.
    fn done(&mut self, id: u64, now: u64) {
        match self.sessions.get_mut(&id) {
            Some(s) if s.stall_at.is_some() && !s.upstream_done => {
                s.upstream_done = true;
                self.gov.finish(id, Outcome::Completed, now);
            }
            Some(s) if !s.upstream_done => self.end(id, Outcome::Completed, now),
            _ => {}
        }
    }

    fn scraped(&mut self, backend: u32, began_us: u64, m: &Scrape, now: u64) -> PolicyResult<()> {
        self.check_backend(backend)?;
        if let Some(blocks) = m.kv_blocks {
            self.gov.set_kv_capacity(backend, blocks);
        }
        let kv = m
            .kv_usage
            .filter(|v| !v.is_nan())
            .map(|v| v.clamp(0.0, 1.0));
        self.gov
            .observe_backend(backend, now, kv, m.running, m.waiting, m.preemptions_total)?;
        let h = &mut self.health[backend as usize];
        h.failures = 0;
        h.unreachable = 0;
        h.ever_scraped = true;
        if !h.healthy && h.down_at.is_none_or(|down| began_us > down) {
            self.set_health(backend, true);
        }
        Ok(())
    }

    /// A backend nothing answers is marked down after `scrape_failures_before_down` scrapes
    /// in a row. One that answers without usable metrics stays up: its last scrape ages, so
    /// the stale-metrics rule halves its slots (conservative, not an outage: vLLM's
    /// `/metrics` can be slow exactly when the server is busiest, and a request that fails
    /// still marks it down at once). A backend never scraped is down on any failure: nothing
    /// is known of its KV.
    fn scrape_failed(&mut self, backend: u32, reachable: bool) -> PolicyResult<()> {
        self.check_backend(backend)?;
        let h = &mut self.health[backend as usize];
        h.failures += 1;
        h.unreachable = if reachable { 0 } else { h.unreachable + 1 };
        let enough = h.unreachable >= self.life.scrape_failures_before_down;
        if h.healthy && (enough || !h.ever_scraped) {
            self.set_health(backend, false);
        }
        Ok(())
    }

    /// Decide a started request again after its lease was refused: it queues, starts on a
    /// backend with room, or is refused with a Retry-After, as a new arrival would be (its
    /// queue deadlines restart, and its tenant's request rate is charged again).
    /// Returns whether room may have freed (always: a new decision may start something).
    fn lease_denied(&mut self, id: u64, now: u64) -> PolicyResult<bool> {
        let Some(s) = self.sessions.get(&id) else {
            return Ok(false);
        };
        if !s.started || s.first_token || s.upstream_done {
            return Ok(false);
        }
        let stream = s.stream;
        let Some((tenant, prompt, max_tokens, pool, chain, fingerprint)) =
            self.gov.lease_denied(id, now)
        else {
            return Ok(false);
        };
        self.forget(id);
        let route = Route {
            pool,
            chain: &chain,
            fingerprint,
        };
        self.arrive(id, tenant, (prompt, max_tokens), stream, route, now)?;
        Ok(true)
    }

    /// Other replicas' share of a backend changed: room may have freed.
    fn shared_load(
        &mut self,
        backend: u32,
        elsewhere: u32,
        waiting: f64,
        waiting_before: f64,
    ) -> PolicyResult<bool> {
        self.gov
            .set_elsewhere(backend, elsewhere, waiting, waiting_before)?;
        Ok(true)
    }

    fn arrive(
        &mut self,
        id: u64,
        tenant: u32,
        (prompt, max_tokens): (u64, u64),
        stream: bool,
        route: Route<'_>,
        now: u64,
    ) -> PolicyResult<()> {
        if self.sessions.contains_key(&id) {
            return Err(PolicyError::DuplicateRequest(id));
        }
        let decision = self
            .gov
            .submit_routed(id, tenant, prompt, max_tokens, route, now)?;
        let session = Session {
            stream,
            started: false,
            first_token: false,
            stall_at: None,
            upstream_done: false,
        };
        match decision {
            Decision::Admitted {
                backend,
                priority,
                prefill,
            } => {
                self.sessions.insert(id, session);
                self.start(id, (backend, prefill), priority, 0);
            }
            Decision::Queued {
                position,
                estimated_wait_s,
                displaced,
                ..
            } => {
                if let Some((victim, retry)) = displaced {
                    self.forget(victim);
                    self.out.push(Action::Reply {
                        id: victim,
                        status: 429,
                        reason: Reason::Displaced,
                        retry_after_s: Some(wire_retry_after(retry)),
                    });
                }
                self.sessions.insert(id, session);
                self.out.push(Action::Queued {
                    id,
                    position,
                    estimated_wait_s,
                });
            }
            Decision::Rejected {
                reason,
                retry_after_s,
            } => {
                let refusal = Refusal::of(reason, retry_after_s);
                self.out.push(Action::Reply {
                    id,
                    status: refusal.status,
                    reason: refusal.reason,
                    retry_after_s: Some(refusal.retry_after_s),
                });
            }
        }
        Ok(())
    }

    fn start(
        &mut self,
        id: u64,
        (backend, prefill): (u32, Option<u32>),
        priority: i64,
        queue_wait_us: u64,
    ) {
        if let Some(s) = self.sessions.get_mut(&id) {
            s.started = true;
        }
        let max_tokens = self.gov.browned_out(id);
        let prefill = prefill.map(|backend| PrefillHop {
            backend,
            priority: self.gov.hop_priority(id),
        });
        self.out.push(Action::Start {
            id,
            backend,
            priority,
            queue_wait_us,
            max_tokens,
            prefill,
        });
    }

    fn dispatch(&mut self, now: u64) {
        for a in self.gov.dispatch(now) {
            let to = (a.backend, a.prefill);
            self.start(a.request_id, to, a.priority, a.queue_wait_us);
        }
    }

    /// Drop a request's lifecycle state (its stall timer too).
    fn forget(&mut self, id: u64) -> Option<Session> {
        let s = self.sessions.remove(&id)?;
        if let Some(at) = s.stall_at {
            self.stalls.remove(&(at, id));
        }
        Some(s)
    }

    /// End a request with `End`: upstream done, failed after commit, or the client left.
    fn end(&mut self, id: u64, outcome: Outcome, now: u64) {
        if let Some(s) = self.forget(id) {
            if !s.upstream_done {
                self.gov.finish(id, outcome, now);
            }
            self.out.push(Action::End { id, outcome });
        }
    }

    fn failed(&mut self, id: u64, status: u16, backend_down: bool, now: u64) -> bool {
        if self.sessions.get(&id).is_none_or(|s| s.upstream_done) {
            return false;
        }
        let session = self.forget(id).expect("checked above");
        if backend_down {
            if let Some(backend) = self.gov.request_backend(id) {
                self.health[backend as usize].down_at = Some(now);
                if self.health[backend as usize].healthy {
                    self.set_health(backend, false);
                }
            }
        }
        self.gov.finish(id, Outcome::Error, now);
        if session.stream && session.first_token {
            // The status line is already out: report in-band, as vLLM does.
            self.out.push(Action::Cut {
                id,
                reason: Reason::UpstreamError,
            });
        } else {
            let status = if (400..500).contains(&status) {
                status
            } else {
                502
            };
            self.out.push(Action::Reply {
                id,
                status,
                reason: Reason::UpstreamError,
                retry_after_s: None,
            });
        }
        true
    }

    fn set_health(&mut self, backend: u32, healthy: bool) {
        self.health[backend as usize].healthy = healthy;
        self.gov.set_backend_health(backend, healthy);
        self.out.push(Action::Backend { backend, healthy });
    }

    /// Everything due at `now`: deadlines, stalled clients, the end of the drain.
    fn fire(&mut self, now: u64) {
        for expired in self.gov.expire(now) {
            self.expired(&expired);
        }
        while let Some(&(at, id)) = self.stalls.first() {
            if at > now {
                break;
            }
            self.stalls.remove(&(at, id));
            if let Some(s) = self.sessions.get_mut(&id) {
                s.stall_at = None;
            }
            self.cut(id, Reason::ClientStall, Outcome::Cancelled, now);
        }
        if self.drain_at.is_some_and(|at| at <= now) {
            self.drain_at = None;
            let mut ids: Vec<u64> = self.sessions.keys().copied().collect();
            ids.sort_unstable();
            for id in ids {
                if self.sessions[&id].started {
                    self.cut(id, Reason::Shutdown, Outcome::Cancelled, now);
                } else {
                    self.forget(id);
                    self.gov.finish(id, Outcome::Cancelled, now);
                    self.out.push(Action::Reply {
                        id,
                        status: 503,
                        reason: Reason::Shutdown,
                        retry_after_s: None,
                    });
                }
            }
        }
    }

    fn cut(&mut self, id: u64, reason: Reason, outcome: Outcome, now: u64) {
        if let Some(s) = self.forget(id) {
            if !s.upstream_done {
                self.gov.finish(id, outcome, now);
                self.out.push(Action::Abort { id });
            }
            self.out.push(Action::Cut { id, reason });
        }
    }

    /// Render a deadline the governor reported (it has already ended the request).
    fn expired(&mut self, e: &Expired) {
        let Some(session) = self.forget(e.request_id) else {
            return;
        };
        let id = e.request_id;
        let reason = Reason::of_expiry(e.reason);
        if session.started {
            self.out.push(Action::Abort { id });
        }
        let retry = Some(wire_retry_after(e.retry_after_s));
        self.out.push(match e.reason {
            _ if !e.was_running => Action::Reply {
                id,
                status: 503,
                reason,
                retry_after_s: retry,
            },
            ExpiryReason::FirstTokenTimeout if self.life.first_token_error => Action::Reply {
                id,
                status: 504,
                reason,
                retry_after_s: retry,
            },
            _ => Action::Cut { id, reason },
        });
    }

    fn rearm(&mut self) {
        // Only an earlier time needs the host's timer moved: one set later fires early, finds
        // nothing due, and is re-armed then (one timer event instead of a reset per request).
        let Some(next) = self.next_timer_us() else {
            return;
        };
        if self.armed.is_none_or(|armed| next < armed) {
            self.armed = Some(next);
            self.out.push(Action::Arm { at_us: next });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::sample_json;

    const S: u64 = 1_000_000;

    fn runtime(lifecycle: &str) -> Runtime {
        Runtime::from_json(&format!(
            r#"{{"policy": {}, "lifecycle": {lifecycle}}}"#,
            sample_json()
        ))
        .unwrap()
    }

    fn arrive(id: u64, tenant: u32) -> Event {
        Event::Arrive {
            id,
            tenant,
            prompt: 10,
            max_tokens: 10,
            stream: true,
            pool: 0,
            chain: vec![],
            fingerprint: 0,
        }
    }

    fn terminal(actions: &[Action]) -> Vec<&Action> {
        actions.iter().filter(|a| a.is_terminal()).collect()
    }

    // Admitted requests start at once and arm the timer for their first-token deadline.
    #[test]
    fn arrive_starts_and_arms() {
        let mut rt = runtime("{}");
        let a = rt.governor().tenant_id("a").unwrap();
        let acts = rt.handle(0, &arrive(1, a)).unwrap();
        assert!(matches!(acts[0], Action::Start { id: 1, .. }), "{acts:?}");
        assert!(matches!(acts.last(), Some(Action::Arm { .. })), "{acts:?}");
    }

    // A request ends exactly once: late events for it do nothing.
    #[test]
    fn ends_once() {
        let mut rt = runtime("{}");
        let a = rt.governor().tenant_id("a").unwrap();
        rt.handle(0, &arrive(1, a)).unwrap();
        let acts = rt.handle(1, &Event::Done { id: 1 }).unwrap();
        assert_eq!(terminal(&acts).len(), 1);
        for ev in [
            Event::Done { id: 1 },
            Event::ClientGone { id: 1 },
            Event::Tokens { id: 1, n: 3 },
        ] {
            let acts = rt.handle(2, &ev).unwrap();
            assert!(terminal(&acts).is_empty(), "{ev:?}: {acts:?}");
        }
        assert_eq!((rt.live(), rt.governor().live()), (0, 0));
    }

    // A prompt held back by prefill pacing starts at the first token of the prompt ahead of
    // it (the prefill cleared), not at some later event.
    #[test]
    fn first_token_dispatches_a_paced_prompt() {
        let json = sample_json().replace(
            r#""max_concurrency_per_gpu":2"#,
            r#""max_concurrency_per_gpu":4,"headroom_quantile":0.999,"headroom_wait_ms":500,
               "prefill_tokens_per_s":8000"#,
        );
        let mut rt =
            Runtime::from_json(&format!(r#"{{"policy": {json}, "lifecycle": {{}}}}"#)).unwrap();
        let a = rt.governor().tenant_id("a").unwrap();
        let long = |id| Event::Arrive {
            id,
            tenant: a,
            prompt: 3000,
            max_tokens: 10,
            stream: true,
            pool: 0,
            chain: vec![],
            fingerprint: 0,
        };
        let acts = rt.handle(0, &long(1)).unwrap();
        assert!(matches!(acts[0], Action::Start { id: 1, .. }), "{acts:?}");
        rt.handle(1, &Event::Started { id: 1 }).unwrap();
        // 3,000 + 3,000 tokens at 8,000/s clear in 0.75 s, past the 0.5 s budget: it waits.
        let acts = rt.handle(2, &long(2)).unwrap();
        assert!(
            !acts.iter().any(|x| matches!(x, Action::Start { .. })),
            "{acts:?}"
        );
        assert_eq!(rt.governor().queued(), 1);
        let acts = rt.handle(S, &Event::Tokens { id: 1, n: 1 }).unwrap();
        assert!(
            acts.iter()
                .any(|x| matches!(x, Action::Start { id: 2, .. })),
            "{acts:?}"
        );
        // Later tokens of a request whose prefill is done do not look at the queue again.
        let acts = rt.handle(S + 1, &Event::Tokens { id: 1, n: 1 }).unwrap();
        assert!(acts.is_empty(), "{acts:?}");
    }

    // Freeing a slot starts the queue head in the same step: no separate dispatch call.
    #[test]
    fn done_dispatches_the_queue() {
        let mut rt = runtime("{}");
        let a = rt.governor().tenant_id("a").unwrap();
        for id in 1..=3 {
            rt.handle(0, &arrive(id, a)).unwrap();
        }
        let acts = rt.handle(S, &Event::Done { id: 1 }).unwrap();
        assert!(
            acts.iter().any(
                |x| matches!(x, Action::Start { id: 3, queue_wait_us, .. } if *queue_wait_us == S)
            ),
            "{acts:?}"
        );
    }

    // A denied lease decides the request again: with the other slot held elsewhere it queues,
    // starts once the store says a slot came back, and ends once, as any request.
    #[test]
    fn lease_denied_requeues_until_a_slot_comes_back() {
        let mut rt = runtime("{}");
        let a = rt.governor().tenant_id("a").unwrap();
        rt.handle(0, &arrive(1, a)).unwrap();
        let shared = |elsewhere| Event::SharedLoad {
            backend: 0,
            elsewhere,
            waiting: 0.0,
            waiting_before: 0.0,
        };
        rt.handle(1, &shared(1)).unwrap(); // 2 slots: 1 held elsewhere, 1 by request 1
        let acts = rt.handle(2, &Event::LeaseDenied { id: 1 }).unwrap();
        assert!(
            acts.iter()
                .any(|x| matches!(x, Action::Queued { id: 1, .. })),
            "{acts:?}"
        );
        assert!(terminal(&acts).is_empty());
        let acts = rt.handle(3, &shared(1)).unwrap(); // the sync: one is free again
        assert!(
            acts.iter()
                .any(|x| matches!(x, Action::Start { id: 1, .. })),
            "{acts:?}"
        );
        let acts = rt.handle(4, &Event::Done { id: 1 }).unwrap();
        assert_eq!(terminal(&acts).len(), 1);
        assert!(rt
            .handle(5, &Event::LeaseDenied { id: 1 })
            .unwrap()
            .is_empty());
    }

    // The window full for the stall timeout cuts the request and aborts it upstream; draining
    // the window in time disarms it.
    #[test]
    fn stall_timer() {
        let mut rt = runtime(r#"{"stall_timeout_ms": 500}"#);
        let a = rt.governor().tenant_id("a").unwrap();
        rt.handle(0, &arrive(1, a)).unwrap();
        rt.handle(0, &arrive(2, a)).unwrap();
        rt.handle(10, &Event::Tokens { id: 1, n: 1 }).unwrap();
        rt.handle(10, &Event::Tokens { id: 2, n: 1 }).unwrap();
        let acts = rt.handle(100, &Event::WindowFull { id: 1 }).unwrap();
        assert!(acts.contains(&Action::Arm { at_us: 500_100 }), "{acts:?}");
        rt.handle(150, &Event::WindowFull { id: 2 }).unwrap();
        rt.handle(200, &Event::WindowDrained { id: 2 }).unwrap();
        let acts = rt.handle(500_100, &Event::Timer).unwrap();
        assert_eq!(
            acts[..2],
            [
                Action::Abort { id: 1 },
                Action::Cut {
                    id: 1,
                    reason: Reason::ClientStall
                }
            ]
        );
        assert!(rt.is_live(2));
    }

    // Upstream done while the client's window is full frees the slot at once; the reply ends
    // when the client takes what it is owed, or is cut (without an abort) when it never does.
    #[test]
    fn done_with_a_full_window_lingers() {
        let mut rt = runtime(r#"{"stall_timeout_ms": 500}"#);
        let a = rt.governor().tenant_id("a").unwrap();
        for id in 1..=2 {
            rt.handle(0, &arrive(id, a)).unwrap();
            rt.handle(10, &Event::Tokens { id, n: 5 }).unwrap();
            rt.handle(20, &Event::WindowFull { id }).unwrap();
            let acts = rt.handle(30, &Event::Done { id }).unwrap();
            assert!(terminal(&acts).is_empty(), "{acts:?}");
        }
        assert_eq!((rt.governor().running(), rt.live()), (0, 2));
        let acts = rt.handle(40, &Event::WindowDrained { id: 1 }).unwrap();
        assert_eq!(
            acts,
            [Action::End {
                id: 1,
                outcome: Outcome::Completed
            }]
        );
        let acts = rt.handle(500_020, &Event::Timer).unwrap();
        assert_eq!(
            terminal(&acts),
            [&Action::Cut {
                id: 2,
                reason: Reason::ClientStall
            }]
        );
        assert!(!acts.contains(&Action::Abort { id: 2 }));
        assert_eq!(rt.live(), 0);
    }

    // Rejections carry their status and the wire Retry-After (whole seconds, at least 1).
    #[test]
    fn rejection_reply() {
        let mut rt = runtime("{}");
        let v = rt.governor().tenant_id("v").unwrap();
        for id in 1..=8 {
            rt.handle(0, &arrive(id, v)).unwrap();
        }
        let acts = rt.handle(0, &arrive(9, v)).unwrap();
        let Action::Reply {
            status,
            reason,
            retry_after_s: Some(retry),
            ..
        } = acts[0]
        else {
            panic!("{acts:?}")
        };
        assert_eq!((status, reason), (429, Reason::QueueFull));
        assert!(retry >= 1);
        assert_eq!(wire_retry_after(0.05), 1);
        assert_eq!(wire_retry_after(1.01), 2);
    }

    // The refusal query names the Reply that arrive then sends (a 429 under load, a 503 while
    // draining), changes nothing (the runtime is as it was), and is `None` for a newcomer
    // arrive would start.
    #[test]
    fn refusal_is_the_reply_arrive_sends() {
        let mut rt = runtime("{}");
        let v = rt.governor().tenant_id("v").unwrap();
        assert_eq!(rt.refusal(v, 10, 10, Route::default(), 0).unwrap(), None);
        for id in 1..=8 {
            rt.handle(0, &arrive(id, v)).unwrap();
        }
        for (id, now) in [(9, 0), (10, 1), (11, 2)] {
            let asked = rt
                .refusal(v, 10, 10, Route::default(), now)
                .unwrap()
                .unwrap();
            let live = rt.live();
            assert_eq!(
                rt.refusal(v, 10, 10, Route::default(), now).unwrap(),
                Some(asked)
            );
            assert_eq!(rt.live(), live);
            let acts = rt.handle(now, &arrive(id, v)).unwrap();
            let reply = Action::Reply {
                id,
                status: asked.status,
                reason: asked.reason,
                retry_after_s: Some(asked.retry_after_s),
            };
            assert_eq!(terminal(&acts), [&reply]);
        }
        rt.handle(3, &Event::Drain).unwrap();
        let asked = rt.refusal(v, 10, 10, Route::default(), 4).unwrap().unwrap();
        assert_eq!((asked.status, asked.reason), (503, Reason::Draining));
    }

    // Two scrapes in a row that nothing answers mark a backend down (ones it answers without
    // metrics do not); a request that finds it unreachable marks it down at once, and only a
    // scrape begun after that brings it back.
    #[test]
    fn backend_health() {
        let mut rt = runtime("{}");
        let ok = |began| Event::ScrapeOk {
            backend: 0,
            began_us: began,
            kv_usage: Some(0.1),
            running: Some(0),
            waiting: Some(0),
            preemptions_total: Some(0),
            kv_blocks: None,
        };
        rt.handle(0, &ok(0)).unwrap();
        let failed = |reachable| Event::ScrapeFailed {
            backend: 0,
            reachable,
        };
        for t in 1..=3 {
            // it answers, without metrics: up (stale, so at half its slots)
            assert!(rt.handle(t, &failed(true)).unwrap().is_empty());
        }
        let acts = rt.handle(4, &failed(false)).unwrap();
        assert!(acts.is_empty(), "{acts:?}");
        let acts = rt.handle(5, &failed(false)).unwrap();
        assert_eq!(
            acts,
            [Action::Backend {
                backend: 0,
                healthy: false
            }]
        );
        let acts = rt.handle(6, &ok(6)).unwrap();
        assert!(acts.contains(&Action::Backend {
            backend: 0,
            healthy: true
        }));
        let a = rt.governor().tenant_id("a").unwrap();
        rt.handle(10, &arrive(1, a)).unwrap();
        let acts = rt
            .handle(
                20,
                &Event::Failed {
                    id: 1,
                    status: 0,
                    backend_down: true,
                },
            )
            .unwrap();
        assert!(acts.contains(&Action::Backend {
            backend: 0,
            healthy: false
        }));
        assert!(matches!(
            acts.iter().find(|a| a.is_terminal()),
            Some(Action::Reply { status: 502, .. })
        ));
        let acts = rt.handle(30, &ok(15)).unwrap();
        assert!(!acts.iter().any(|a| matches!(a, Action::Backend { .. })));
        let acts = rt.handle(40, &ok(25)).unwrap();
        assert!(acts
            .iter()
            .any(|a| matches!(a, Action::Backend { healthy: true, .. })));
    }

    // The drain refuses newcomers at once and cuts whatever is live when its timeout passes.
    #[test]
    fn drain_cuts_after_timeout() {
        let mut rt = runtime(r#"{"drain_timeout_ms": 1000}"#);
        let a = rt.governor().tenant_id("a").unwrap();
        for id in 1..=3 {
            rt.handle(0, &arrive(id, a)).unwrap();
        }
        rt.handle(1, &Event::Drain).unwrap();
        let acts = rt.handle(2, &arrive(4, a)).unwrap();
        assert!(matches!(
            acts[0],
            Action::Reply {
                status: 503,
                reason: Reason::Draining,
                ..
            }
        ));
        let acts = rt.handle(1_000_001, &Event::Timer).unwrap();
        let ends: Vec<_> = terminal(&acts);
        assert_eq!(ends.len(), 3, "{acts:?}");
        assert_eq!(rt.live(), 0);
        assert_eq!(rt.governor().live(), 0);
    }

    // Deadlines render by state: queued -> 503 with Retry-After; no first token -> a degraded
    // cut (or 504 when so configured); running -> a cut with the partial text.
    #[test]
    fn expiries_render() {
        let mut rt = runtime(r#"{"first_token_error": true}"#);
        let a = rt.governor().tenant_id("a").unwrap();
        for id in 1..=4 {
            rt.handle(0, &arrive(id, a)).unwrap();
        }
        rt.handle(S, &Event::Tokens { id: 1, n: 1 }).unwrap();
        let acts = rt.handle(4 * S, &Event::Timer).unwrap();
        assert!(
            acts.iter()
                .any(|a| matches!(a, Action::Start { id: 3, .. })),
            "{acts:?}"
        );
        assert!(
            acts.contains(&Action::Reply {
                id: 2,
                status: 504,
                reason: Reason::FirstTokenTimeout,
                retry_after_s: acts.iter().find_map(|a| match a {
                    Action::Reply { retry_after_s, .. } => *retry_after_s,
                    _ => None,
                }),
            }),
            "{acts:?}"
        );
        let acts = rt.handle(6 * S, &Event::Timer).unwrap();
        assert!(
            acts.iter().any(|a| matches!(
                a,
                Action::Reply {
                    id: 4,
                    status: 503,
                    reason: Reason::QueueTimeout,
                    retry_after_s: Some(_)
                }
            )),
            "{acts:?}"
        );
        let acts = rt.handle(61 * S, &Event::Timer).unwrap();
        assert!(acts.contains(&Action::Cut {
            id: 1,
            reason: Reason::Deadline
        }));
    }

    // The timer is armed only when the earliest pending time moves earlier, and re-armed after
    // it fires early.
    #[test]
    fn timer_rearms() {
        let mut rt = runtime("{}");
        let a = rt.governor().tenant_id("a").unwrap();
        let acts = rt.handle(0, &arrive(1, a)).unwrap();
        let Some(Action::Arm { at_us }) = acts.last().cloned() else {
            panic!("{acts:?}")
        };
        let acts = rt.handle(10, &arrive(2, a)).unwrap();
        assert!(!acts.iter().any(|a| matches!(a, Action::Arm { .. })));
        let acts = rt.handle(at_us - 1, &Event::Timer).unwrap();
        assert_eq!(acts, [Action::Arm { at_us }]);
        // A later next time leaves the host's timer as it is: it fires early, then re-arms.
        let acts = rt.handle(at_us - 1, &Event::ClientGone { id: 1 }).unwrap();
        assert!(
            !acts.iter().any(|a| matches!(a, Action::Arm { .. })),
            "{acts:?}"
        );
        let acts = rt.handle(at_us, &Event::Timer).unwrap();
        assert!(
            matches!(acts[..], [Action::Arm { at_us: later }] if later == at_us + 10),
            "{acts:?}"
        );
    }

    // P/D: `Start` names the prefill instance; `Prefilled` frees its slot, which starts the
    // next prompt waiting for one; a prefill instance that fails during its hop is the one
    // marked down.
    #[test]
    fn split_pool_prefill_hop() {
        let policy = r#"{"backends":[{"name":"p","role":"prefill"},
                {"name":"d","gpus":4,"role":"decode"}],"max_concurrency_per_gpu":1,
                "max_waiting":10,"tiers":[{"name":"t"}],"tenants":[{"name":"a","tier":"t"}]}"#;
        let mut rt =
            Runtime::from_json(&format!(r#"{{"policy": {policy}, "lifecycle": {{}}}}"#)).unwrap();
        let acts = rt.handle(0, &arrive(1, 0)).unwrap();
        assert!(
            matches!(
                acts[0],
                Action::Start {
                    id: 1,
                    backend: 1,
                    prefill: Some(PrefillHop { backend: 0, .. }),
                    ..
                }
            ),
            "{acts:?}"
        );
        // One prefill slot: the second waits for it although the decode instance has room.
        let acts = rt.handle(1, &arrive(2, 0)).unwrap();
        assert!(matches!(acts[0], Action::Queued { id: 2, .. }), "{acts:?}");
        let acts = rt.handle(2, &Event::Prefilled { id: 1 }).unwrap();
        assert!(
            matches!(
                acts[0],
                Action::Start {
                    id: 2,
                    prefill: Some(PrefillHop { backend: 0, .. }),
                    ..
                }
            ),
            "{acts:?}"
        );
        assert!(rt
            .handle(3, &Event::Prefilled { id: 1 })
            .unwrap()
            .iter()
            .all(|a| !matches!(a, Action::Start { .. })));
        // Request 2's hop fails with the prefill instance unreachable: it is marked down.
        let acts = rt
            .handle(
                4,
                &Event::Failed {
                    id: 2,
                    status: 0,
                    backend_down: true,
                },
            )
            .unwrap();
        assert!(
            acts.contains(&Action::Backend {
                backend: 0,
                healthy: false
            }),
            "{acts:?}"
        );
        assert!(rt.backend_healthy(1));
        let acts = rt.handle(5, &Event::Done { id: 1 }).unwrap();
        assert_eq!(terminal(&acts).len(), 1);
        assert_eq!((rt.live(), rt.governor().live()), (0, 0));
    }
}
