//! The fair queue from outside: tier order, tenant fairness, lanes and pools.

use super::*;

fn item(id: u64) -> QueuedItem {
    QueuedItem {
        id,
        prompt_tokens: 10,
    }
}

// Two tenants of one tier alternate when each service costs the same.
#[test]
fn equal_tenants_alternate() {
    let mut q = FairQueue::new(Strategy::Fair, 1, &[(0, 1.0), (0, 1.0)]);
    for id in 0..4 {
        q.push(0, item(id));
    }
    for id in 10..14 {
        q.push(1, item(id));
    }
    let mut order = vec![];
    while let Some((tenant, it)) = q.pop(0) {
        q.charge(tenant, 100.0);
        order.push(it.id);
    }
    assert_eq!(order, vec![0, 10, 1, 11, 2, 12, 3, 13]);
}

// A tenant of weight 2 is served twice as often as one of weight 1.
#[test]
fn weights_share_service() {
    let mut q = FairQueue::new(Strategy::Fair, 1, &[(0, 2.0), (0, 1.0)]);
    for id in 0..6 {
        q.push(0, item(id));
        q.push(1, item(100 + id));
    }
    let mut heavy = 0;
    for _ in 0..6 {
        let (tenant, _) = q.pop(0).unwrap();
        q.charge(tenant, 10.0);
        heavy += usize::from(tenant == 0);
    }
    assert_eq!(heavy, 4);
}

// A tenant that was idle is lifted to the backlogged minimum, earning no credit for idling.
#[test]
fn lift_on_new_backlog() {
    let mut q = FairQueue::new(Strategy::Fair, 1, &[(0, 1.0), (0, 1.0)]);
    q.push(0, item(1));
    q.charge(0, 1000.0);
    q.push(0, item(2));
    q.push(1, item(3));
    assert!((q.counter(1) - 1000.0).abs() < 1e-9);
}

// A tenant served at once (never queued) still sets the lift: a newcomer that starts its
// burst while nobody waits is lifted to it instead of keeping its idle credit.
#[test]
fn lift_after_direct_service() {
    let mut q = FairQueue::new(Strategy::Fair, 1, &[(0, 1.0), (0, 1.0)]);
    q.arrive(0);
    q.served(0);
    q.charge(0, 1000.0);
    q.arrive(0);
    q.served(0);
    q.arrive(1);
    assert!((q.counter(1) - 1000.0).abs() < 1e-9);
    q.push(1, item(1));
    q.push(0, item(2));
    assert_eq!(
        q.pop(0).map(|(t, _)| t),
        Some(0),
        "equal counters: lower index first"
    );
}

// FIFO keeps arrival order across tenants of a tier.
#[test]
fn fifo_is_arrival_order() {
    let mut q = FairQueue::new(Strategy::Fifo, 1, &[(0, 1.0), (0, 1.0)]);
    q.push(0, item(1));
    q.push(0, item(2));
    q.push(1, item(3));
    q.charge(0, 1e9);
    let order: Vec<u64> = std::iter::from_fn(|| q.pop(0).map(|(_, i)| i.id)).collect();
    assert_eq!(order, vec![1, 2, 3]);
}

// A pool's waiting head never blocks another pool's: each pops on its own, and queries by
// tier and tenant add the pools up; the newest of a tenant is compared across pools.
#[test]
fn pools_are_independent() {
    let mut q = FairQueue::pooled(Strategy::Fair, 1, &[(0, 1.0)], 2);
    q.push_to(0, 0, item(1), 0, false);
    q.push_to(1, 0, item(2), 1, false);
    q.push_to(0, 0, item(3), 2, false);
    assert_eq!(
        (q.tier_len(0), q.pool_tier_len(1, 0), q.tenant_len(0)),
        (3, 1, 3)
    );
    assert_eq!(q.newest(0).map(|i| i.id), Some(3));
    assert_eq!(q.pop_from(1, 0).map(|(_, i)| i.id), Some(2));
    assert!(q.pop_from(1, 0).is_none());
    assert_eq!(q.remove(1).map(|(_, i)| i.id), Some(1));
    assert_eq!((q.len(), q.pool_of(3)), (1, Some(0)));
    assert_eq!(
        (
            q.pool_tier_prompt_tokens(0, 0),
            q.pool_tenant_prompt_tokens(1, 0)
        ),
        (10, 0)
    );
}

// Removing from the middle keeps counts and prompt totals right.
#[test]
fn remove_anywhere() {
    let mut q = FairQueue::new(Strategy::Fair, 2, &[(0, 1.0), (1, 1.0)]);
    q.push(0, item(1));
    q.push(0, item(2));
    q.push(1, item(3));
    assert_eq!(q.remove(2).map(|(_, i)| i.id), Some(2));
    assert!(q.remove(2).is_none());
    assert_eq!(
        (q.len(), q.tier_len(0), q.tier_prompt_tokens(0)),
        (2, 1, 10)
    );
    assert_eq!(q.pop(0).map(|(_, i)| i.id), Some(1));
    assert!(q.pop(0).is_none());
    assert_eq!(q.pop(1).map(|(_, i)| i.id), Some(3));
    assert!(q.is_empty());
}

// The late lane: behind every fresh request of the tier, whatever the tenants' counters,
// in the order their clients first came; counts and prompt totals follow the moves.
#[test]
fn late_lane_yields_to_fresh() {
    for strategy in [Strategy::Fair, Strategy::Fifo] {
        let mut q = FairQueue::new(strategy, 1, &[(0, 1.0), (0, 1.0)]);
        q.push_to(0, 0, item(1), 900, false);
        q.push_to(0, 0, item(2), 950, false);
        q.push_to(0, 1, item(3), 500, true); // a retry whose client first came at 500
        q.push_to(0, 1, item(4), 990, false);
        q.push_to(0, 1, item(5), 400, false); // a retry, not late: ahead of its tenant's 4
        q.charge(1, 1.0e6); // tenant 1 far over its share: its fresh ones still go first
        assert!(q.lapse(1));
        assert!(!q.lapse(1) && q.is_late(1) && q.is_late(3) && !q.is_late(2));
        assert_eq!((q.pool_tier_fresh_len(0, 0), q.tier_len(0)), (3, 5));
        assert_eq!(
            (
                q.pool_tenant_fresh_prompt_tokens(0, 0),
                q.pool_tenant_prompt_tokens(0, 0)
            ),
            (10, 20)
        );
        // the back of tenant 0's line is now its late request
        assert_eq!(q.newest(0).map(|i| i.id), Some(1));
        let order: Vec<u64> = std::iter::from_fn(|| q.pop(0).map(|(_, i)| i.id)).collect();
        let want = match strategy {
            // fresh: tenant 0 (smaller counter), then 1's by first come; late: VTC again
            Strategy::Fair => vec![2, 5, 4, 1, 3],
            // fresh by first come (400, 950, 990); late by first come (500 before 900)
            Strategy::Fifo => vec![5, 2, 4, 3, 1],
        };
        assert_eq!(order, want, "{strategy:?}");
        assert_eq!(
            (q.pool_tier_fresh_len(0, 0), q.tier_prompt_tokens(0)),
            (0, 0)
        );
    }
}
