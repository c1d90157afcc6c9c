//! The runtime from outside: events in, actions out.

use super::*;
use crate::config::tests::sample_json;
use crate::types::Outcome;

const S: u64 = 1_000_000;

fn runtime(lifecycle: &str) -> Runtime {
    Runtime::from_json(&format!(
        r#"{{"policy": {}, "lifecycle": {lifecycle}}}"#,
        sample_json()
    ))
    .unwrap()
}

fn arrive(id: u64, tenant: u32) -> Event {
    Event::plain_arrival(id, tenant)
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
        retries: None,
        deadline_ms: None,
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
    assert_eq!(rt.refusal(Arrival::new(v, 10, 10), 0).unwrap(), None);
    for id in 1..=8 {
        rt.handle(0, &arrive(id, v)).unwrap();
    }
    for (id, now) in [(9, 0), (10, 1), (11, 2)] {
        let asked = rt.refusal(Arrival::new(v, 10, 10), now).unwrap().unwrap();
        let live = rt.live();
        assert_eq!(
            rt.refusal(Arrival::new(v, 10, 10), now).unwrap(),
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
    let asked = rt.refusal(Arrival::new(v, 10, 10), 4).unwrap().unwrap();
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

// A queued request whose client deadline has passed is refused (429 client_deadline, with a
// Retry-After) at the first event after it, even before the host's timer fires: the slot that
// event frees goes to the next request, and the late one never starts.
#[test]
fn a_request_whose_client_gave_up_never_starts() {
    let json = sample_json().replace(r#""queue_timeout_ms":5000"#, r#""queue_timeout_ms":20000"#);
    let mut rt =
        Runtime::from_json(&format!(r#"{{"policy": {json}, "lifecycle": {{}}}}"#)).unwrap();
    let a = rt.governor().tenant_id("a").unwrap();
    for id in 1..=2 {
        rt.handle(0, &arrive(id, a)).unwrap();
    }
    let mut waits = arrive(3, a);
    if let Event::Arrive { deadline_ms, .. } = &mut waits {
        *deadline_ms = Some(6_000);
    }
    let acts = rt.handle(0, &waits).unwrap();
    assert!(matches!(acts[0], Action::Queued { id: 3, .. }), "{acts:?}");
    rt.handle(1, &arrive(4, a)).unwrap();
    let acts = rt.handle(7 * S, &Event::Done { id: 1 }).unwrap();
    let refused = Action::Reply {
        id: 3,
        status: 429,
        reason: Reason::ClientDeadline,
        retry_after_s: Some(10),
    };
    assert_eq!(acts[0], refused, "{acts:?}");
    assert!(
        acts.iter()
            .any(|x| matches!(x, Action::Start { id: 4, .. })),
        "{acts:?}"
    );
    assert!(
        !acts
            .iter()
            .any(|x| matches!(x, Action::Start { id: 3, .. })),
        "{acts:?}"
    );
    assert_eq!((rt.is_live(3), rt.governor().is_live(3)), (false, false));
}
