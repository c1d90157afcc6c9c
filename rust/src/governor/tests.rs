//! The governor's test fixtures (shared by every concern's tests) and the tests of `submit`.

use super::*;
use crate::config::tests::sample_json;
use crate::error::PolicyError;
use crate::types::{Decision, Outcome};

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
    assert_eq!(g.breaker.level, 1);
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
    assert_eq!(g.breaker.level, 0);
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
