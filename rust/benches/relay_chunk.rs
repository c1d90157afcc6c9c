//! The relay's per-chunk parse without sockets: ns per vLLM chunk through `SseDecoder` and
//! `ChunkShaper` (de-frame, cut the continuous usage, count the tokens), for a client that
//! asked for usage and one that did not. Run with `cargo bench --bench relay_chunk`; prints
//! one JSON object.

use std::hint::black_box;
use std::time::Instant;

use _core::relay::chunk::ChunkShaper;
use _core::relay::sse::SseDecoder;

/// vLLM's chunk `i` of a chat stream, asked for continuous usage (as the relay asks).
fn event(i: usize) -> Vec<u8> {
    format!(
        "data: {{\"id\":\"chatcmpl-4f1c2a9e8b7d4c3fa1e2d3c4b5a69788\",\"object\":\"chat.completion.chunk\",\
         \"created\":1733400000,\"model\":\"meta-llama/Llama-3.1-8B-Instruct\",\"choices\":[{{\"index\":0,\
         \"delta\":{{\"content\":\" token{i}\"}},\"logprobs\":null,\"finish_reason\":null}}],\
         \"usage\":{{\"prompt_tokens\":512,\"total_tokens\":{},\"completion_tokens\":{}}}}}\n\n",
        513 + i,
        i + 1
    )
    .into_bytes()
}

fn ns_per_chunk(include_usage: bool, events: &[Vec<u8>], rounds: u32) -> f64 {
    let start = Instant::now();
    for _ in 0..rounds {
        let mut decoder = SseDecoder::new();
        let mut shaper = ChunkShaper::new(include_usage);
        for piece in events {
            for payload in decoder.feed(piece).payloads {
                black_box(shaper.feed(&payload).expect("a chunk"));
            }
        }
    }
    start.elapsed().as_nanos() as f64 / f64::from(rounds) / events.len() as f64
}

fn main() {
    let events: Vec<Vec<u8>> = (0..100).map(event).collect();
    ns_per_chunk(true, &events, 200); // warm
    let rounds = 2_000;
    println!(
        "{{\"ns_per_chunk_usage\": {:.0}, \"ns_per_chunk_no_usage\": {:.0}}}",
        ns_per_chunk(true, &events, rounds),
        ns_per_chunk(false, &events, rounds)
    );
}
