//! Backend health: up or down, judged from scrapes and from requests that found a backend
//! unreachable, and the `Backend` action that tells the host.

use super::{Action, Runtime};
use crate::error::{PolicyError, PolicyResult};

#[derive(Debug, Clone)]
struct BackendHealth {
    healthy: bool,
    ever_scraped: bool,
    /// Consecutive failed scrapes, of any kind.
    failures: u32,
    /// Consecutive scrapes nothing answered.
    unreachable: u32,
    /// When a request last found the backend unreachable: a scrape begun before proves nothing.
    down_at: Option<u64>,
}

/// Every backend's health. Its methods say whether the backend's state flips; the runtime then
/// sets it (`Runtime::set_health`), so the governor and the host hear of it together.
#[derive(Debug, Clone)]
pub(super) struct Health {
    backends: Vec<BackendHealth>,
    /// Consecutive scrapes nothing answered that mark a backend down.
    failures_before_down: u32,
}

impl Health {
    /// All `backends` up, none scraped yet.
    pub fn new(backends: usize, failures_before_down: u32) -> Self {
        let up = BackendHealth {
            healthy: true,
            ever_scraped: false,
            failures: 0,
            unreachable: 0,
            down_at: None,
        };
        Self {
            backends: vec![up; backends],
            failures_before_down,
        }
    }

    pub fn check(&self, backend: u32) -> PolicyResult<()> {
        if (backend as usize) < self.backends.len() {
            Ok(())
        } else {
            Err(PolicyError::UnknownBackend(backend.to_string()))
        }
    }

    pub fn healthy(&self, backend: u32) -> bool {
        self.backends[backend as usize].healthy
    }

    pub fn failures(&self, backend: u32) -> u32 {
        self.backends[backend as usize].failures
    }

    /// A scrape begun at `began_us` answered with metrics. Whether a backend that was down
    /// comes back: only a scrape begun after a request last found it unreachable proves it.
    pub fn scraped(&mut self, backend: u32, began_us: u64) -> bool {
        let h = &mut self.backends[backend as usize];
        h.failures = 0;
        h.unreachable = 0;
        h.ever_scraped = true;
        !h.healthy && h.down_at.is_none_or(|down| began_us > down)
    }

    /// A scrape failed (`reachable`: the backend answered, without usable metrics). Whether it
    /// goes down now: after `failures_before_down` scrapes in a row nothing answered, or at
    /// any failure while it was never scraped (nothing is known of its KV).
    ///
    /// One that answers without usable metrics stays up: its last scrape ages, so the
    /// stale-metrics rule halves its slots (conservative, not an outage: vLLM's `/metrics` can
    /// be slow exactly when the server is busiest, and a request that fails still marks it
    /// down at once).
    pub fn scrape_failed(&mut self, backend: u32, reachable: bool) -> bool {
        let h = &mut self.backends[backend as usize];
        h.failures += 1;
        h.unreachable = if reachable { 0 } else { h.unreachable + 1 };
        let enough = h.unreachable >= self.failures_before_down;
        h.healthy && (enough || !h.ever_scraped)
    }

    /// A request found the backend unreachable at `now`. Whether it goes down now (it was up).
    pub fn unreachable(&mut self, backend: u32, now: u64) -> bool {
        let h = &mut self.backends[backend as usize];
        h.down_at = Some(now);
        h.healthy
    }

    fn set(&mut self, backend: u32, healthy: bool) {
        self.backends[backend as usize].healthy = healthy;
    }
}

/// What a scrape read (`Event::ScrapeOk` without its backend and time).
pub(super) struct Scrape {
    pub kv_usage: Option<f64>,
    pub running: Option<u64>,
    pub waiting: Option<u64>,
    pub preemptions_total: Option<u64>,
    pub kv_blocks: Option<u64>,
}

impl Runtime {
    pub(super) fn scraped(
        &mut self,
        backend: u32,
        began_us: u64,
        m: &Scrape,
        now: u64,
    ) -> PolicyResult<()> {
        self.health.check(backend)?;
        if let Some(blocks) = m.kv_blocks {
            self.gov.set_kv_capacity(backend, blocks);
        }
        let kv = m
            .kv_usage
            .filter(|v| !v.is_nan())
            .map(|v| v.clamp(0.0, 1.0));
        self.gov
            .observe_backend(backend, now, kv, m.running, m.waiting, m.preemptions_total)?;
        if self.health.scraped(backend, began_us) {
            self.set_health(backend, true);
        }
        Ok(())
    }

    pub(super) fn scrape_failed(&mut self, backend: u32, reachable: bool) -> PolicyResult<()> {
        self.health.check(backend)?;
        if self.health.scrape_failed(backend, reachable) {
            self.set_health(backend, false);
        }
        Ok(())
    }

    pub(super) fn set_health(&mut self, backend: u32, healthy: bool) {
        self.health.set(backend, healthy);
        self.gov.set_backend_health(backend, healthy);
        self.out.push(Action::Backend { backend, healthy });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Scrapes that answer without metrics never mark a backend down once it was scraped; two
    // in a row that nothing answers do, and a good scrape resets the count.
    #[test]
    fn unreachable_scrapes_in_a_row() {
        let mut h = Health::new(1, 2);
        assert!(!h.scraped(0, 0));
        assert!(!h.scrape_failed(0, true));
        assert!(!h.scrape_failed(0, false));
        assert!(!h.scraped(0, 1)); // up already: nothing flips
        assert!(!h.scrape_failed(0, false));
        assert!(h.scrape_failed(0, false));
        assert_eq!(h.failures(0), 2);
        assert!(h.check(1).is_err());
    }

    // A backend never scraped is down at its first failure.
    #[test]
    fn never_scraped_is_down_at_once() {
        let mut h = Health::new(2, 2);
        assert!(h.scrape_failed(1, true));
        assert!(h.healthy(0));
    }

    // After a request found a backend unreachable, only a scrape begun later brings it back.
    #[test]
    fn only_a_later_scrape_brings_it_back() {
        let mut h = Health::new(1, 2);
        assert!(h.unreachable(0, 100));
        h.set(0, false);
        assert!(!h.unreachable(0, 100)); // down already
        assert!(!h.scraped(0, 90));
        assert!(!h.scraped(0, 100));
        assert!(h.scraped(0, 101));
    }
}
