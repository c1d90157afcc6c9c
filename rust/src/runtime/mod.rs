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
//!
//! The code is split as quinn-proto splits its connection: this file holds the state, the
//! queries and the event dispatch (`feed`); `session` the per-request state and the events
//! that move a request along; `timer` the deadlines and the one timer; `health` backend
//! health; `drain` the drain; `reply` how a request's end is rendered (replies and cuts);
//! `event`, `action` and `config` the types a host speaks in.

mod action;
mod config;
mod drain;
mod event;
mod health;
mod lease;
mod reply;
mod session;
#[cfg(test)]
mod tests;
mod timer;

pub use action::{Action, PrefillHop};
pub use config::{LifecycleConfig, RuntimeConfig};
pub use event::Event;
pub use lease::{LeaseConfig, OnLoss};
pub use reply::{wire_retry_after, Reason, Refusal};

use crate::error::{PolicyError, PolicyResult};
use crate::governor::{Arrival, Route, Signals};
use crate::Governor;
use health::{Health, Scrape};
use lease::Leases;
use session::Sessions;
use timer::Timer;

/// The lifecycle of every request around one `Governor`.
#[derive(Debug, Clone)]
pub struct Runtime {
    gov: Governor,
    life: LifecycleConfig,
    sessions: Sessions,
    drain_at: Option<u64>,
    health: Health,
    timer: Timer,
    leases: Leases,
    out: Vec<Action>,
}

fn us(ms: f64) -> u64 {
    (ms * 1000.0).round() as u64
}

impl Runtime {
    pub fn new(config: RuntimeConfig) -> PolicyResult<Self> {
        config.lifecycle.validate()?;
        let health = Health::new(
            config.policy.backends.len(),
            config.lifecycle.scrape_failures_before_down,
        );
        Ok(Self {
            gov: Governor::new(config.policy)?,
            leases: Leases::new(config.lifecycle.leases),
            life: config.lifecycle,
            sessions: Sessions::default(),
            drain_at: None,
            health,
            timer: Timer::default(),
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
        self.sessions.contains(id)
    }

    pub fn backend_healthy(&self, backend: u32) -> bool {
        self.health.healthy(backend)
    }

    pub fn scrape_failures(&self, backend: u32) -> u32 {
        self.health.failures(backend)
    }

    /// What `arrive` would answer this arrival at `now_us` if it refuses it at once, without
    /// changing anything; `None` when it would admit or queue it, or when only `arrive` itself
    /// can tell (see `Governor::refusal`). A host may answer a refused request on a short
    /// path, but still feeds it `arrive`: the `Reply` it then gets is this refusal.
    pub fn refusal(&self, arrival: Arrival<'_>, now_us: u64) -> PolicyResult<Option<Refusal>> {
        let refused = self.gov.refusal(arrival, now_us)?;
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
                if let Some(s) = self.sessions.get(id) {
                    if s.first_token && !s.upstream_done {
                        self.gov.on_tokens(id, n, now_us);
                        return Ok(());
                    }
                }
            }
            Event::Started { .. } => return Ok(()),
            Event::Timer => {}
            _ => self.expire_client_deadlines(now_us),
        }
        let frees_room = self.apply(now_us, event)?;
        if frees_room {
            self.dispatch(now_us);
        }
        self.rearm();
        self.settle_leases();
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

    /// Carry out one event; whether it may have freed room (then the queue is dispatched).
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
                retries,
                deadline_ms,
            } => {
                let route = Route {
                    pool,
                    chain,
                    fingerprint,
                };
                let signals = Signals {
                    retries,
                    deadline_us: deadline_ms.map(|ms| ms.saturating_mul(1000)),
                };
                let arrival = Arrival::new(tenant, prompt, max_tokens)
                    .with_route(route)
                    .with_signals(signals);
                self.arrive(id, arrival, stream, now)?;
                true
            }
            Event::Started { .. } => unreachable!("handled in `feed`"),
            Event::Tokens { id, n } => self.tokens(id, n, now),
            Event::Done { id } => {
                self.done(id, now);
                true
            }
            Event::Prefilled { id } => self.prefilled(id, now),
            Event::Failed {
                id,
                status,
                backend_down,
            } => self.failed(id, status, backend_down, now),
            Event::ClientGone { id } => {
                self.client_gone(id, now);
                true
            }
            Event::WindowFull { id } => {
                self.window_full(id, now);
                false
            }
            Event::WindowDrained { id } => {
                self.window_drained(id, now);
                false
            }
            Event::Timer => {
                self.timer.fired();
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
            } => {
                // Other replicas' share of a backend changed: room may have freed.
                self.gov
                    .set_elsewhere(backend, elsewhere, waiting, waiting_before)?;
                true
            }
            Event::LeaseDenied { id } => self.lease_refused(id, now)?,
            Event::LeaseGranted { id } => self.lease_granted(id),
            Event::LeaseFailed { id } => self.lease_failed(id, now)?,
            Event::StoreLost => self.store_lost()?,
            Event::StoreSynced {
                backend,
                live,
                waiting,
                waiting_before,
            } => self.store_synced(backend, live, waiting, waiting_before)?,
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
                self.drain(now);
                false
            }
        })
    }
}
