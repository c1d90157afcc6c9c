//! Core throughput: request cycles per second, and decision cost against queue depth.
//!
//! One cycle = submit, admit, first token, 10 token-chunk observations, finish. Run with
//! `cargo bench --bench cycle`; prints one JSON object per measurement (the Python benchmark
//! `benchmarks/core_bench.py` runs this and puts it beside PyO3 and the reference model).

use std::hint::black_box;
use std::time::Instant;

use _core::{Arrival, Event, Governor, Outcome, Runtime};

fn config(max_waiting: u32, sla: &str) -> String {
    format!(
        r#"{{"backends":[{{"name":"b0","gpus":1,"kv_blocks":100000}}],
            "max_concurrency_per_gpu":16,"max_waiting":{max_waiting},
            "tiers":[{{"name":"vip","protected":true}},{{"name":"normal","shed_at":0.8}}],
            "tenants":[{{"name":"t0","tier":"normal"}},{{"name":"t1","tier":"normal"}},
                       {{"name":"t2","tier":"normal"}},{{"name":"v","tier":"vip"}}],
            "kv_pressure_threshold":0.85,"ttft_sla_ms":{sla},"preemption_cooldown_ms":10000,
            "queue_timeout_ms":30000,"first_token_timeout_ms":3000,"request_timeout_ms":120000,
            "stale_after_ms":3000}}"#
    )
}

fn cycles(n: u64) -> f64 {
    let mut g = Governor::from_json(&config(200, "1500")).unwrap();
    let start = Instant::now();
    let mut now = 0;
    for id in 0..n {
        now += 10;
        black_box(
            g.submit(id, Arrival::new((id % 3) as u32, 512, 256), now)
                .unwrap(),
        );
        g.on_first_token(id, now + 1);
        for _ in 0..10 {
            g.on_tokens(id, 1, now + 2);
        }
        g.finish(id, Outcome::Completed, now + 3);
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// The same cycle through the whole runtime: arrive, started, 10 token batches, done, with
/// every action it returns built (start, timer arming, end) and the stall timer on.
fn runtime_cycles(n: u64) -> f64 {
    let text = format!(
        r#"{{"policy":{},"lifecycle":{{"stall_timeout_ms":30000}}}}"#,
        config(200, "1500")
    );
    let mut rt = Runtime::from_json(&text).unwrap();
    let start = Instant::now();
    let mut now = 0;
    for id in 0..n {
        now += 10;
        let arrive = Event::Arrive {
            id,
            tenant: (id % 3) as u32,
            prompt: 512,
            max_tokens: 256,
            stream: true,
            pool: 0,
            chain: vec![],
            fingerprint: 0,
            retries: None,
            deadline_ms: None,
        };
        rt.feed(now, &arrive).unwrap();
        black_box(rt.actions());
        rt.feed(now + 1, &Event::Started { id }).unwrap();
        for _ in 0..10 {
            rt.feed(now + 2, &Event::Tokens { id, n: 1 }).unwrap();
        }
        rt.feed(now + 3, &Event::Done { id }).unwrap();
        black_box(rt.actions());
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// Nanoseconds per decision with `depth` requests already queued (slots all busy): a submit
/// that queues at the back plus its cancel, and a finish + dispatch + refill step.
fn decision_ns(depth: u64, reps: u64) -> (f64, f64) {
    // No TTFT SLA here: with 100,000 prompts queued it would (rightly) refuse everything,
    // and this measures the cost of queueing, not of refusing.
    let mut g = Governor::from_json(&config(u32::MAX, "null")).unwrap();
    for id in 0..depth + 16 {
        g.submit(id, Arrival::new((id % 3) as u32, 512, 256), 0)
            .unwrap();
    }
    assert_eq!(g.queued() as u64, depth);
    let start = Instant::now();
    for i in 0..reps {
        let id = 1_000_000_000 + i;
        let decision = g
            .submit(id, Arrival::new((i % 3) as u32, 512, 256), 1)
            .unwrap();
        assert!(matches!(decision, _core::Decision::Queued { .. }));
        black_box(decision);
        g.finish(id, Outcome::Cancelled, 1);
    }
    let submit_ns = start.elapsed().as_nanos() as f64 / reps as f64;
    let running: Vec<u64> = (0..16).collect();
    let start = Instant::now();
    let mut live = running;
    for i in 0..reps {
        let next = 2_000_000_000 + i;
        let victim = live[(i % 16) as usize];
        g.finish(victim, Outcome::Completed, 2);
        let admitted = g.dispatch(2);
        live[(i % 16) as usize] = admitted[0].request_id;
        g.submit(next, Arrival::new((i % 3) as u32, 512, 256), 2)
            .unwrap();
    }
    let dispatch_ns = start.elapsed().as_nanos() as f64 / reps as f64;
    (submit_ns, dispatch_ns)
}

fn main() {
    let n = 2_000_000;
    cycles(n / 10);
    println!(
        "{{\"measure\":\"rust_cycles_per_s\",\"value\":{:.0}}}",
        cycles(n)
    );
    runtime_cycles(n / 10);
    println!(
        "{{\"measure\":\"rust_runtime_cycles_per_s\",\"value\":{:.0}}}",
        runtime_cycles(n)
    );
    for depth in [10, 1_000, 100_000] {
        let (submit, dispatch) = decision_ns(depth, 200_000);
        println!(
            "{{\"measure\":\"decision_ns\",\"queued\":{depth},\"submit_cancel_ns\":{submit:.1},\"finish_dispatch_submit_ns\":{dispatch:.1}}}"
        );
    }
}
