//! Slot leases in a store shared by gateway replicas (Redis, or the simulator's), decided here
//! once: the hosts only carry `Lease` and `Release` to the store and feed back what it said.
//!
//! With `lifecycle.leases` set, a request the governor starts does not get `Start` at once:
//! the runtime asks for a lease on one of the backend's slots (`Lease`, with the backend's
//! cap, for the store's atomic compare-and-increment) and keeps the `Start` until the store
//! answers. `LeaseGranted` lets it out; `LeaseDenied` (the cap was reached elsewhere first)
//! decides the request again; `LeaseFailed` (the store did not answer) marks the store lost
//! and settles the request by `on_loss`. A request that ends while its lease is asked keeps
//! its ask open, so a lease granted after all is released, never leaked. A lease is released
//! when its request ends, and the store renews the held ones each sync (`held`): its count
//! less ours is the load other replicas put on the backend (`StoreSynced`).
//!
//! While the store is lost, `fail_closed` counts every slot as held elsewhere (nothing starts;
//! requests queue and are refused with a Retry-After in time), and `local_share` counts all
//! but `cap / replicas` (at least one), and starts go ahead unleased (held all the same, so
//! the first sync that succeeds re-adds them). No release goes to a lost store: its leases
//! expire by their TTL.

use rustc_hash::FxHashMap;
use serde::Deserialize;

use super::{Action, Runtime};
use crate::error::{PolicyError, PolicyResult};

/// What to do while the shared store cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnLoss {
    /// Every slot counts as held elsewhere: no request starts without a lease.
    FailClosed,
    /// All but `cap / replicas` count as held elsewhere, and starts go ahead unleased.
    LocalShare,
}

/// `lifecycle.leases`: slots are leased from a store shared by `replicas` gateway replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseConfig {
    pub on_loss: OnLoss,
    /// How many replicas share the store: `local_share`'s divisor.
    pub replicas: u32,
}

impl LeaseConfig {
    pub(super) fn validate(self) -> PolicyResult<()> {
        if self.replicas == 0 {
            return Err(PolicyError::config(
                "lifecycle.leases.replicas",
                "must be >= 1",
            ));
        }
        Ok(())
    }

    /// The slots of a backend with `cap` counted as held elsewhere while the store is lost.
    fn lost_elsewhere(self, cap: u32) -> u32 {
        match self.on_loss {
            OnLoss::FailClosed => cap,
            OnLoss::LocalShare => cap - (cap / self.replicas).max(1).min(cap),
        }
    }
}

/// A lease asked of the store and not yet answered.
#[derive(Debug, Clone)]
struct Ask {
    backend: u32,
    /// The `Start` it holds back; `None` once the request ended (a late grant is released).
    start: Option<Action>,
}

/// This replica's leases: asked, held, and whether the store is lost.
#[derive(Debug, Clone, Default)]
pub(super) struct Leases {
    config: Option<LeaseConfig>,
    lost: bool,
    asked: FxHashMap<u64, Ask>,
    /// Request id -> backend: leased, or started unleased while the store was lost.
    held: FxHashMap<u64, u32>,
}

impl Leases {
    pub fn new(config: Option<LeaseConfig>) -> Self {
        Self {
            config,
            ..Self::default()
        }
    }

    pub fn enabled(&self) -> bool {
        self.config.is_some()
    }

    /// Whether the last store call failed (and no sync has succeeded since).
    pub fn lost(&self) -> bool {
        self.lost
    }

    /// The leases this replica holds, by backend, each list sorted (what a sync renews).
    pub fn held(&self, backends: usize) -> Vec<Vec<u64>> {
        let mut out = vec![Vec::new(); backends];
        for (&id, &b) in &self.held {
            out[b as usize].push(id);
        }
        for ids in &mut out {
            ids.sort_unstable();
        }
        out
    }

    fn held_on(&self, backend: u32) -> u32 {
        self.held.values().filter(|&&b| b == backend).count() as u32
    }
}

impl Runtime {
    /// Carry out a `Start` the governor decided: at once without a shared store (or unleased
    /// while it is lost under `local_share`), else behind a `Lease`.
    pub(super) fn start_leased(&mut self, start: Action) {
        let Action::Start { id, backend, .. } = start else {
            unreachable!("only a Start is leased")
        };
        let Some(config) = self.leases.config else {
            self.out.push(start);
            return;
        };
        if self.leases.lost && config.on_loss == OnLoss::LocalShare {
            self.leases.held.insert(id, backend);
            self.out.push(start);
            return;
        }
        let cap = self.gov.backend_cap(backend);
        self.leases.asked.insert(
            id,
            Ask {
                backend,
                start: Some(start),
            },
        );
        self.out.push(Action::Lease { id, backend, cap });
    }

    /// After an event: release the leases of requests that ended, and mark asks whose request
    /// ended (their answer, if a grant, is released).
    ///
    /// A `Release` goes right after its request's terminal action, ahead of any `Lease` the
    /// same event asked for (the freed slot's next request): a store that takes the calls in
    /// the order they are issued then frees the slot before it is asked for again. Issued the
    /// other way round, the ask found the store full and was denied, and the slot stayed idle
    /// until the next sync: a replica ran below its share.
    pub(super) fn settle_leases(&mut self) {
        if !self.leases.enabled() {
            return;
        }
        let mut i = 0;
        while i < self.out.len() {
            if let Action::Reply { id, .. } | Action::Cut { id, .. } | Action::End { id, .. } =
                self.out[i]
            {
                if let Some(ask) = self.leases.asked.get_mut(&id) {
                    ask.start = None;
                } else if let Some(backend) = self.leases.held.remove(&id) {
                    if !self.leases.lost {
                        i += 1;
                        self.out.insert(i, Action::Release { id, backend });
                    }
                }
            }
            i += 1;
        }
    }

    /// The store granted a lease. Returns whether room may have freed (never).
    pub(super) fn lease_granted(&mut self, id: u64) -> bool {
        let Some(ask) = self.leases.asked.remove(&id) else {
            return false; // not asked (a lease held already, or an unknown id): nothing to do
        };
        match ask.start {
            Some(start) => {
                self.leases.held.insert(id, ask.backend);
                self.out.push(start);
            }
            None => self.out.push(Action::Release {
                id,
                backend: ask.backend,
            }),
        }
        false
    }

    /// The store refused a lease (or, without a shared store, the host says it did).
    pub(super) fn lease_refused(&mut self, id: u64, now: u64) -> PolicyResult<bool> {
        if !self.leases.enabled() {
            return self.lease_denied(id, now);
        }
        match self.leases.asked.remove(&id) {
            Some(Ask { start: Some(_), .. }) => self.lease_denied(id, now),
            _ => Ok(false),
        }
    }

    /// The store call for a lease failed: the store is lost, and the request is settled as
    /// `on_loss` says (started unleased, or decided again).
    pub(super) fn lease_failed(&mut self, id: u64, now: u64) -> PolicyResult<bool> {
        let Some(config) = self.leases.config else {
            return Ok(false);
        };
        self.store_lost()?;
        match self.leases.asked.remove(&id) {
            Some(Ask {
                backend,
                start: Some(start),
            }) if config.on_loss == OnLoss::LocalShare => {
                self.leases.held.insert(id, backend);
                self.out.push(start);
                Ok(true)
            }
            Some(Ask { start: Some(_), .. }) => {
                self.lease_denied(id, now)?;
                Ok(true)
            }
            _ => Ok(true),
        }
    }

    /// A store call failed: count the slots `on_loss` says are held elsewhere. Returns
    /// whether room may have freed (under `local_share`, it may).
    pub(super) fn store_lost(&mut self) -> PolicyResult<bool> {
        let Some(config) = self.leases.config else {
            return Ok(false);
        };
        self.leases.lost = true;
        for b in 0..self.gov.backend_count() {
            let elsewhere = config.lost_elsewhere(self.gov.backend_cap(b));
            self.gov.set_elsewhere(b, elsewhere, 0.0, 0.0)?;
        }
        Ok(true)
    }

    /// A sync succeeded: `live` leases are in the store on `backend`, ours among them; the
    /// rest are other replicas'.
    pub(super) fn store_synced(
        &mut self,
        backend: u32,
        live: u32,
        waiting: f64,
        waiting_before: f64,
    ) -> PolicyResult<bool> {
        if !self.leases.enabled() {
            return Ok(false);
        }
        self.leases.lost = false;
        let elsewhere = live.saturating_sub(self.leases.held_on(backend));
        self.gov
            .set_elsewhere(backend, elsewhere, waiting, waiting_before)?;
        Ok(true)
    }

    /// The leases this replica holds, by backend index (what the host renews each sync);
    /// empty without a shared store.
    pub fn leases_held(&self) -> Vec<Vec<u64>> {
        if !self.leases.enabled() {
            return Vec::new();
        }
        self.leases.held(self.gov.backend_count() as usize)
    }

    /// Whether the shared store is lost (the last call failed, no sync succeeded since).
    pub fn store_is_lost(&self) -> bool {
        self.leases.lost()
    }
}

#[cfg(test)]
mod tests {
    use super::super::Event;
    use super::*;
    use crate::config::tests::sample_json;

    fn runtime(on_loss: &str, replicas: u32) -> Runtime {
        Runtime::from_json(&format!(
            r#"{{"policy": {}, "lifecycle": {{"leases": {{"on_loss": "{on_loss}",
                "replicas": {replicas}}}}}}}"#,
            sample_json()
        ))
        .unwrap()
    }

    // As a trace line reads it, so the fields a trace may leave out take their defaults.
    fn arrive(id: u64) -> Event {
        let line = format!(
            r#"{{"arrive":{{"id":{id},"tenant":1,"prompt":10,"max_tokens":10,"stream":true}}}}"#
        );
        serde_json::from_str(&line).unwrap()
    }

    fn kinds(acts: &[Action]) -> Vec<&'static str> {
        acts.iter()
            .map(|a| match a {
                Action::Start { .. } => "start",
                Action::Lease { .. } => "lease",
                Action::Release { .. } => "release",
                Action::Queued { .. } => "queued",
                Action::Abort { .. } => "abort",
                Action::End { .. } => "end",
                Action::Reply { .. } => "reply",
                Action::Cut { .. } => "cut",
                Action::Arm { .. } => "arm",
                Action::Backend { .. } => "backend",
            })
            .collect()
    }

    // A start waits for its lease, asked with the backend's cap (1 GPU x 2); the grant lets
    // the very Start out, and the end of the request releases the lease.
    #[test]
    fn start_waits_for_its_lease_and_releases_it() {
        let mut rt = runtime("fail_closed", 2);
        let acts = rt.handle(0, &arrive(1)).unwrap();
        assert_eq!(
            acts[0],
            Action::Lease {
                id: 1,
                backend: 0,
                cap: 2
            }
        );
        assert!(!kinds(&acts).contains(&"start"), "{acts:?}");
        let acts = rt.handle(1, &Event::LeaseGranted { id: 1 }).unwrap();
        assert!(
            matches!(
                acts[0],
                Action::Start {
                    id: 1,
                    backend: 0,
                    ..
                }
            ),
            "{acts:?}"
        );
        assert_eq!(rt.leases_held(), vec![vec![1]]);
        let acts = rt.handle(2, &Event::Done { id: 1 }).unwrap();
        assert_eq!(kinds(&acts), ["end", "release"]);
        assert_eq!(rt.leases_held(), vec![Vec::<u64>::new()]);
        // A second grant for it (a late duplicate) does nothing.
        assert!(rt
            .handle(3, &Event::LeaseGranted { id: 1 })
            .unwrap()
            .is_empty());
    }

    // The slot a request frees goes back to the store before the next request asks for it:
    // the Release comes right after the End, ahead of the queued request's Lease.
    #[test]
    fn release_goes_before_the_next_lease() {
        let mut rt = runtime("fail_closed", 2);
        for id in 1..=2 {
            rt.handle(0, &arrive(id)).unwrap();
            rt.handle(0, &Event::LeaseGranted { id }).unwrap();
        }
        let acts = rt.handle(1, &arrive(3)).unwrap();
        assert!(kinds(&acts).contains(&"queued"), "{acts:?}");
        let acts = rt.handle(2, &Event::Done { id: 1 }).unwrap();
        let order: Vec<_> = kinds(&acts).into_iter().filter(|k| *k != "arm").collect();
        assert_eq!(order, ["end", "release", "lease"], "{acts:?}");
        assert_eq!(acts[1], Action::Release { id: 1, backend: 0 });
    }

    // A request that ends while its lease is asked: a grant that comes after is released (no
    // lease leaks), a denial is dropped; neither starts it.
    #[test]
    fn an_ask_outlives_its_request() {
        let mut rt = runtime("fail_closed", 2);
        rt.handle(0, &arrive(1)).unwrap();
        rt.handle(0, &arrive(2)).unwrap();
        let acts = rt.handle(1, &Event::ClientGone { id: 1 }).unwrap();
        assert!(!kinds(&acts).contains(&"release"), "{acts:?}");
        rt.handle(1, &Event::ClientGone { id: 2 }).unwrap();
        let acts = rt.handle(2, &Event::LeaseGranted { id: 1 }).unwrap();
        assert_eq!(acts, [Action::Release { id: 1, backend: 0 }]);
        assert!(rt
            .handle(2, &Event::LeaseDenied { id: 2 })
            .unwrap()
            .is_empty());
        assert_eq!(rt.leases_held(), vec![Vec::<u64>::new()]);
    }

    // A denied lease decides the request again (here: it queues behind the slot the store
    // said is taken), and a sync's count less our own leases is what others hold.
    #[test]
    fn denied_queues_and_sync_counts_others() {
        let mut rt = runtime("fail_closed", 2);
        rt.handle(0, &arrive(1)).unwrap();
        rt.handle(0, &Event::LeaseGranted { id: 1 }).unwrap();
        rt.handle(0, &arrive(2)).unwrap();
        let acts = rt.handle(1, &Event::LeaseDenied { id: 2 }).unwrap();
        assert!(kinds(&acts).contains(&"queued"), "{acts:?}");
        assert_eq!(rt.governor().backends[0].elsewhere, 1);
        let synced = |live| Event::StoreSynced {
            backend: 0,
            live,
            waiting: 0.0,
            waiting_before: 0.0,
        };
        rt.handle(2, &synced(2)).unwrap(); // ours and one other: still full
        assert_eq!(rt.governor().backends[0].elsewhere, 1);
        let acts = rt.handle(3, &synced(1)).unwrap(); // only ours: request 2 asks again
        assert_eq!(
            acts[0],
            Action::Lease {
                id: 2,
                backend: 0,
                cap: 2
            }
        );
    }

    // A lost store under fail_closed: every slot is held elsewhere, the failed ask is decided
    // again (it queues), nothing is released to the lost store, and the next sync restores
    // the true count and the queue asks again.
    #[test]
    fn fail_closed_loss() {
        let mut rt = runtime("fail_closed", 2);
        rt.handle(0, &arrive(1)).unwrap();
        rt.handle(0, &Event::LeaseGranted { id: 1 }).unwrap();
        rt.handle(0, &arrive(2)).unwrap();
        let acts = rt.handle(1, &Event::LeaseFailed { id: 2 }).unwrap();
        assert!(kinds(&acts).contains(&"queued"), "{acts:?}");
        assert!(rt.store_is_lost());
        assert_eq!(rt.governor().backends[0].elsewhere, 2);
        let acts = rt.handle(2, &Event::Done { id: 1 }).unwrap();
        assert_eq!(kinds(&acts), ["end"]); // no release to a lost store
        let acts = rt
            .handle(
                3,
                &Event::StoreSynced {
                    backend: 0,
                    live: 1, // request 1's lease, not yet expired: someone else's now
                    waiting: 0.0,
                    waiting_before: 0.0,
                },
            )
            .unwrap();
        assert!(!rt.store_is_lost());
        assert_eq!(
            acts[0],
            Action::Lease {
                id: 2,
                backend: 0,
                cap: 2
            }
        );
    }

    // A lost store under local_share: all but cap / replicas (at least one) are held
    // elsewhere, the failed ask starts unleased, later starts skip the store, and what runs
    // is held (renewed at the next sync).
    #[test]
    fn local_share_loss() {
        let mut rt = runtime("local_share", 3);
        rt.handle(0, &arrive(1)).unwrap();
        let acts = rt.handle(1, &Event::LeaseFailed { id: 1 }).unwrap();
        assert!(matches!(acts[0], Action::Start { id: 1, .. }), "{acts:?}");
        assert_eq!(rt.governor().backends[0].elsewhere, 1); // 2 - max(2 / 3, 1)
        let acts = rt.handle(2, &arrive(2)).unwrap();
        assert!(kinds(&acts).contains(&"queued"), "{acts:?}"); // our share (1) runs
        assert_eq!(rt.leases_held(), vec![vec![1]]);
        rt.handle(3, &Event::StoreLost).unwrap();
        assert_eq!(rt.governor().backends[0].elsewhere, 1);
    }

    // The share a lost store leaves: fail_closed none, local_share cap / replicas, at least
    // one and at most the cap.
    #[test]
    fn lost_elsewhere() {
        let share = |on_loss, replicas, cap| LeaseConfig { on_loss, replicas }.lost_elsewhere(cap);
        assert_eq!(share(OnLoss::FailClosed, 3, 8), 8);
        assert_eq!(share(OnLoss::LocalShare, 3, 8), 6);
        assert_eq!(share(OnLoss::LocalShare, 9, 8), 7);
        assert_eq!(share(OnLoss::LocalShare, 1, 8), 0);
        assert!(LeaseConfig {
            on_loss: OnLoss::LocalShare,
            replicas: 0
        }
        .validate()
        .is_err());
    }

    // Without a shared store nothing changes: Start at once, and the store's events are
    // no-ops (old traces replay as before).
    #[test]
    fn without_a_store() {
        let mut rt = Runtime::from_json(&format!(
            r#"{{"policy": {}, "lifecycle": {{}}}}"#,
            sample_json()
        ))
        .unwrap();
        let acts = rt.handle(0, &arrive(1)).unwrap();
        assert!(matches!(acts[0], Action::Start { id: 1, .. }), "{acts:?}");
        for ev in [
            Event::LeaseGranted { id: 1 },
            Event::LeaseFailed { id: 1 },
            Event::StoreLost,
        ] {
            assert!(rt.handle(1, &ev).unwrap().is_empty(), "{ev:?}");
        }
        assert!(rt.leases_held().is_empty());
        assert_eq!(rt.governor().backends[0].elsewhere, 0);
    }
}
