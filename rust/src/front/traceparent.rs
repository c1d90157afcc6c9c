//! W3C trace context for the requests the front serves while telemetry is on: which trace a
//! request belongs to, whether it is sampled, and the `traceparent` vLLM gets.
//!
//! The spans themselves are Python's (`gateway/telemetry.py` builds them from the request's
//! record when it ends); the only thing needed while the request is on the wire is the
//! upstream span's context, so the ids are decided here, as the Python path's OpenTelemetry
//! SDK decides them: a valid incoming `traceparent` is continued (`parse` reads it as the
//! SDK's `TraceContextTextMapPropagator.extract` does) and decides the sampling by its flag;
//! else a new random trace is sampled by its id as `TraceIdRatioBased` samples it, so both
//! paths keep the same traces. The flags are the SDK's too (W3C Trace Context level 2, as
//! the SDK sets them since 1.43): the sampled bit as decided, and the random-trace-id bit on a
//! trace of our own (its id is random) or as the client's parent had it.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};

/// The SDK's limit on a `traceparent` it reads (`_TRACEPARENT_MAXIMUM_LENGTH`).
const MAX_LEN: usize = 512;
/// The `sampled` bit of the trace flags.
const SAMPLED: u8 = 0x01;
/// The `random-trace-id` bit (level 2): the trace id's right 7 bytes at least are random.
const RANDOM: u8 = 0x02;
/// SplitMix64's increment (the golden ratio's 64 bits).
const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// A client's `traceparent`, as the propagator reads it: the trace its request continues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parent {
    pub trace_id: u128,
    pub span_id: u64,
    pub flags: u8,
}

/// One request's trace: its ids and its spans' flags (sampled: its spans are exported).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceIds {
    pub trace_id: u128,
    /// The client's span, when its `traceparent` was continued.
    pub parent: Option<Parent>,
    /// `llmflow.request`, `llmflow.queue` and `llmflow.upstream`.
    pub span_id: u64,
    pub queue_span_id: u64,
    pub upstream_span_id: u64,
    /// The three spans' trace flags: `sampled` and `random-trace-id` only.
    pub flags: u8,
}

impl TraceIds {
    /// Whether its spans are exported (and vLLM records its own).
    pub fn sampled(&self) -> bool {
        self.flags & SAMPLED != 0
    }

    /// The `traceparent` sent to vLLM: the upstream span's context (the sampled bit clear
    /// when the trace is not sampled, so vLLM records none of it either).
    pub fn traceparent(&self) -> String {
        format!(
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id, self.upstream_span_id, self.flags
        )
    }
}

/// `telemetry`'s sampling, and the ids' generator.
#[derive(Debug)]
pub struct Tracing {
    /// A new trace is sampled when its id's low 64 bits are below this (`TraceIdRatioBased`).
    bound: u128,
    /// SplitMix64's state: ids need not be unguessable, only unique and uniform (the SDK draws
    /// them from `random.getrandbits`).
    state: AtomicU64,
}

impl Tracing {
    /// `sample_ratio`: the share of the traces the gateway starts that are sampled, 0 to 1.
    pub fn new(sample_ratio: f64) -> Self {
        // std's per-process SipHash keys come from the OS: one seed for the generator.
        let seed = std::collections::hash_map::RandomState::new().hash_one(std::process::id());
        Self {
            bound: ratio_bound(sample_ratio),
            state: AtomicU64::new(seed),
        }
    }

    /// The trace of a request whose client sent `traceparent` (the header's first value).
    pub fn begin(&self, traceparent: Option<&[u8]>) -> TraceIds {
        let parent = traceparent.and_then(parse);
        let (trace_id, flags) = if let Some(p) = parent {
            (p.trace_id, p.flags & (SAMPLED | RANDOM))
        } else {
            let trace_id = self.trace_id();
            let sampled = sampled_by_ratio(trace_id, self.bound);
            (trace_id, RANDOM | if sampled { SAMPLED } else { 0 })
        };
        TraceIds {
            trace_id,
            parent,
            span_id: self.span_id(),
            queue_span_id: self.span_id(),
            upstream_span_id: self.span_id(),
            flags,
        }
    }

    fn trace_id(&self) -> u128 {
        loop {
            let id = (u128::from(self.next()) << 64) | u128::from(self.next());
            if id != 0 {
                return id;
            }
        }
    }

    fn span_id(&self) -> u64 {
        loop {
            let id = self.next();
            if id != 0 {
                return id;
            }
        }
    }

    /// SplitMix64 over an atomic Weyl sequence: lock-free across the front's threads.
    fn next(&self) -> u64 {
        let mut z = self
            .state
            .fetch_add(GAMMA, Ordering::Relaxed)
            .wrapping_add(GAMMA);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// `TraceIdRatioBased.get_bound_for_rate`: `round(rate * 2**64)`, Python's `round` (ties to
/// even); 2**64 itself at 1, so every id is below it.
pub fn ratio_bound(ratio: f64) -> u128 {
    (ratio.clamp(0.0, 1.0) * 18_446_744_073_709_551_616.0).round_ties_even() as u128
}

/// `TraceIdRatioBased.should_sample`: the id's low 64 bits below the bound.
pub fn sampled_by_ratio(trace_id: u128, bound: u128) -> bool {
    u128::from(trace_id as u64) < bound
}

/// A `traceparent` as `TraceContextTextMapPropagator.extract` reads it, or None where it
/// ignores it (the request then starts a trace of its own): at most 512 bytes matching
/// `^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:(-.*)|[ \t]*)$`
/// (Python's `$`: the end, or before a last `\n`), neither id all zeros, the version not
/// `ff`, and nothing after the flags for version `00`.
pub fn parse(header: &[u8]) -> Option<Parent> {
    if header.len() > MAX_LEN {
        return None;
    }
    let rest = trim_start(header);
    if rest.len() < 55 || [2, 35, 52].iter().any(|&i| rest[i] != b'-') {
        return None;
    }
    let version = hex(&rest[..2])? as u8;
    let trace_id = hex(&rest[3..35])?;
    let span_id = hex(&rest[36..52])? as u64;
    let flags = hex(&rest[53..55])? as u8;
    let tail = &rest[55..];
    let tail = tail.strip_suffix(b"\n").unwrap_or(tail);
    let extended = match tail.first() {
        Some(b'-') if !tail.contains(&b'\n') => true,
        _ if tail.iter().all(|&b| b == b' ' || b == b'\t') => false,
        _ => return None,
    };
    let valid = trace_id != 0 && span_id != 0 && version != 0xff && !(version == 0 && extended);
    valid.then_some(Parent {
        trace_id,
        span_id,
        flags,
    })
}

fn trim_start(bytes: &[u8]) -> &[u8] {
    let start = bytes
        .iter()
        .position(|&b| b != b' ' && b != b'\t')
        .unwrap_or(bytes.len());
    &bytes[start..]
}

/// Lower-case hex digits only, as the propagator's pattern.
fn hex(digits: &[u8]) -> Option<u128> {
    digits.iter().try_fold(0u128, |n, &d| {
        let v = match d {
            b'0'..=b'9' => d - b'0',
            b'a'..=b'f' => d - b'a' + 10,
            _ => return None,
        };
        Some((n << 4) | u128::from(v))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const SPAN: &str = "00f067aa0ba902b7";

    fn header(version: &str, flags: &str, tail: &str) -> Vec<u8> {
        format!("{version}-{TRACE}-{SPAN}-{flags}{tail}").into_bytes()
    }

    // A well-formed header gives its ids and flags.
    #[test]
    fn reads_a_valid_header() {
        let p = parse(&header("00", "01", "")).unwrap();
        assert_eq!(p.trace_id, u128::from_str_radix(TRACE, 16).unwrap());
        assert_eq!(p.span_id, u64::from_str_radix(SPAN, 16).unwrap());
        assert_eq!(p.flags, 1);
        assert_eq!(parse(&header("00", "02", "")).unwrap().flags, 2);
    }

    // Spaces and tabs before and after, and one last newline, are what the pattern allows.
    #[test]
    fn allows_the_patterns_blanks() {
        for (before, after) in [(" \t", ""), ("", " \t "), ("", "\n"), ("  ", "\t\n")] {
            let h = format!("{before}00-{TRACE}-{SPAN}-01{after}");
            assert!(parse(h.as_bytes()).is_some(), "{h:?}");
        }
        for bad in [
            format!("00-{TRACE}-{SPAN}-01\n\n"),
            format!("\n00-{TRACE}-{SPAN}-01"),
        ] {
            assert_eq!(parse(bad.as_bytes()), None, "{bad:?}");
        }
    }

    // Upper-case hex, short or long fields, zero ids and version ff are ignored.
    #[test]
    fn refuses_what_the_propagator_refuses() {
        let zero_trace = format!("00-{}-{SPAN}-01", "0".repeat(32));
        let zero_span = format!("00-{TRACE}-{}-01", "0".repeat(16));
        let upper = format!("00-{}-{SPAN}-01", TRACE.to_uppercase());
        let short = format!("00-{}-{SPAN}-01", &TRACE[1..]);
        for bad in [
            zero_trace.into_bytes(),
            zero_span.into_bytes(),
            upper.into_bytes(),
            short.into_bytes(),
            header("ff", "01", ""),
            header("00", "1", ""),
            header("00", "01", "x"),
            header("00", "01", " -x"),
            b"".to_vec(),
        ] {
            assert_eq!(parse(&bad), None, "{:?}", String::from_utf8_lossy(&bad));
        }
    }

    // After the flags, version 00 takes nothing more; a later version takes a `-` and more.
    #[test]
    fn a_later_version_may_say_more() {
        assert_eq!(parse(&header("00", "01", "-what")), None);
        assert_eq!(parse(&header("cc", "01", "-what\n")).unwrap().flags, 1);
        assert_eq!(parse(&header("cc", "01", "-wh\nat")), None);
        assert!(parse(&header("cc", "01", "")).is_some());
    }

    // 512 bytes are read, one more is not.
    #[test]
    fn bounds_the_length() {
        let base = header("cc", "01", "-");
        let fill = |n: usize| [base.clone(), vec![b'x'; n - base.len()]].concat();
        assert!(parse(&fill(512)).is_some());
        assert_eq!(parse(&fill(513)), None);
    }

    // The header sent upstream is the upstream span's context, in lower-case hex.
    #[test]
    fn formats_the_upstream_span() {
        let ids = TraceIds {
            trace_id: 0xab,
            parent: None,
            span_id: 1,
            queue_span_id: 2,
            upstream_span_id: 0xcd,
            flags: 0x03,
        };
        let sent = ids.traceparent();
        assert_eq!(sent, format!("00-{:0>32}-{:0>16}-03", "ab", "cd"));
        let p = parse(sent.as_bytes()).unwrap();
        assert_eq!((p.trace_id, p.span_id, p.flags), (0xab, 0xcd, 3));
        let unsampled = TraceIds { flags: 0, ..ids };
        assert!(unsampled.traceparent().ends_with("-00"));
    }

    // The bound is Python's round(rate * 2**64): ties to even, 2**64 at 1.
    #[test]
    fn the_ratio_bound_is_the_samplers() {
        assert_eq!(ratio_bound(0.0), 0);
        assert_eq!(ratio_bound(1.0), 1 << 64);
        assert_eq!(ratio_bound(0.5), 1 << 63);
        assert_eq!(ratio_bound(0.25), 1 << 62);
        assert_eq!(ratio_bound(2f64.powi(-65)), 0); // 0.5 rounds to even
        assert_eq!(ratio_bound(3.0 * 2f64.powi(-65)), 2); // 1.5 rounds to even
    }

    // Only the id's low 64 bits are compared, strictly below the bound.
    #[test]
    fn samples_by_the_low_bits() {
        let bound = ratio_bound(0.5);
        assert!(sampled_by_ratio((u128::MAX << 64) | ((1 << 63) - 1), bound));
        assert!(!sampled_by_ratio(1 << 63, bound));
        assert!(sampled_by_ratio(u128::MAX, ratio_bound(1.0)));
        assert!(!sampled_by_ratio(1, ratio_bound(0.0)));
    }

    // A client's trace is continued and its sampled flag decides; its random bit is kept,
    // its other bits are not.
    #[test]
    fn continues_a_clients_trace() {
        let tracing = Tracing::new(0.0);
        let ids = tracing.begin(Some(&header("00", "ff", "")));
        let parent = ids.parent.unwrap();
        assert_eq!(ids.trace_id, parent.trace_id);
        assert!(ids.sampled());
        assert!(ids.traceparent().ends_with("-03"));
        assert_eq!(tracing.begin(Some(&header("00", "05", ""))).flags, 0x01);
        let tracing = Tracing::new(1.0);
        let ids = tracing.begin(Some(&header("00", "02", "")));
        assert!(!ids.sampled());
        assert!(ids.traceparent().ends_with("-02"));
        assert_eq!(tracing.begin(Some(&header("00", "00", ""))).flags, 0);
    }

    // A new trace: fresh nonzero ids, distinct, sampled by the ratio.
    #[test]
    fn starts_a_trace_of_its_own() {
        let tracing = Tracing::new(0.5);
        let mut seen = std::collections::HashSet::new();
        let mut sampled = 0;
        for _ in 0..1000 {
            let ids = tracing.begin(Some(b"not a traceparent"));
            assert_eq!(ids.parent, None);
            assert_eq!(ids.sampled(), sampled_by_ratio(ids.trace_id, 1 << 63));
            assert_eq!(ids.flags & RANDOM, RANDOM); // its id is random
            sampled += usize::from(ids.sampled());
            for id in [ids.span_id, ids.queue_span_id, ids.upstream_span_id] {
                assert!(id != 0 && seen.insert(id));
            }
        }
        assert!((400..600).contains(&sampled), "{sampled} of 1000 at 0.5");
        assert_eq!(Tracing::new(0.0).begin(None).flags, 0x02);
        assert_eq!(Tracing::new(1.0).begin(None).flags, 0x03);
    }
}
