//! The native front's request check without Python: ns per `prepare` of a typical 1 KiB chat
//! body (`benchmarks/front_prepare_bench.py` times it through PyO3 beside Python's), and its
//! parts (the strict parse, the fingerprint). Run with `cargo bench --bench front_prepare`;
//! prints one JSON object.

use std::collections::{HashMap, HashSet};
use std::hint::black_box;
use std::time::Instant;

use _core::front::{json, prepare};

fn body() -> Vec<u8> {
    let text = "lorem ipsum ".repeat(60);
    format!(
        r#"{{"model": "llama", "messages": [{{"role": "system", "content": "You are a concise assistant. Answer in plain English."}}, {{"role": "user", "content": "Summarise this text in two sentences: {text}"}}], "stream": true, "stream_options": {{"include_usage": true}}, "max_tokens": 256, "temperature": 0.7, "top_p": 0.9, "user": "user-1234"}}"#
    )
    .into_bytes()
}

fn ns_per_call(n: u32, mut call: impl FnMut()) -> f64 {
    let start = Instant::now();
    for _ in 0..n {
        call();
    }
    start.elapsed().as_nanos() as f64 / f64::from(n)
}

fn main() {
    let raw = body();
    let config = prepare::FrontConfig {
        models: HashMap::from([("llama".to_owned(), 8192)]),
        aliases: HashMap::new(),
        prefix_models: HashSet::new(),
        block_size: 16,
        bytes_per_token: 4.0,
        streaming: true,
        max_messages: 2048,
        max_n: 128,
        max_tokens: None,
        fingerprint_key: vec![7; 32],
    };
    assert!(prepare::prepare(prepare::Endpoint::Chat, &raw, &config).is_some());
    let n = 200_000;
    let best = |call: &mut dyn FnMut()| {
        (0..5)
            .map(|_| ns_per_call(n, &mut *call))
            .fold(f64::MAX, f64::min)
    };
    let prepare_ns = best(&mut || {
        black_box(prepare::prepare(
            prepare::Endpoint::Chat,
            black_box(&raw),
            &config,
        ));
    });
    let parse_ns = best(&mut || {
        black_box(json::parse(black_box(&raw)));
    });
    let fingerprint_ns = best(&mut || {
        black_box(prepare::fingerprint(
            black_box(&raw),
            &config.fingerprint_key,
        ));
    });
    let prepared = prepare::prepare(prepare::Endpoint::Chat, &raw, &config).unwrap();
    let body_ns = best(&mut || {
        black_box(prepared.body_bytes());
    });
    println!(
        r#"{{"body_bytes": {}, "prepare_ns": {prepare_ns:.0}, "parse_ns": {parse_ns:.0}, "fingerprint_ns": {fingerprint_ns:.0}, "body_bytes_ns": {body_ns:.0}}}"#,
        raw.len()
    );
}
