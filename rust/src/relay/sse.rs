//! SSE de-framing of a vLLM stream: bytes in, `data:` payloads out, up to `[DONE]`.

/// The largest event a backend may send when no limit is configured (`server.max_event_bytes`).
pub const DEFAULT_MAX_EVENT_BYTES: usize = 16 << 20;

/// What one call to [`SseDecoder::feed`] found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Decoded {
    /// The payloads of complete events, in order (without `data: ` or the blank line).
    pub payloads: Vec<Vec<u8>>,
    /// `data: [DONE]` was seen: the stream is complete; bytes after it are ignored.
    pub done: bool,
    /// An event grew past the limit without ending: the stream cannot go on (its bytes are
    /// dropped; every later feed answers this again).
    pub too_large: bool,
}

/// Splits a byte stream into SSE events (`\n\n` or `\r\n\r\n` separated) and keeps only their
/// `data:` payloads; several `data:` lines in one event are joined with `\n`, as the SSE spec
/// says. Events with no `data:` line (comments, `event:`-only) are skipped.
///
/// Bounded: an unfinished event holds at most `max_event` bytes, and each byte is scanned for
/// the blank line once (a piece resumes the search where the last one stopped), so a backend
/// that never ends its event costs neither memory nor the thread's time.
#[derive(Debug)]
pub struct SseDecoder {
    buffer: Vec<u8>,
    done: bool,
    too_large: bool,
    /// `buffer[..scanned]` holds no `\n\n` (but its last byte may start one).
    scanned: usize,
    max_event: usize,
}

impl Default for SseDecoder {
    fn default() -> Self {
        Self::with_limit(DEFAULT_MAX_EVENT_BYTES)
    }
}

impl SseDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// A decoder that refuses events of more than `max_event` bytes.
    pub fn with_limit(max_event: usize) -> Self {
        Self {
            buffer: Vec::new(),
            done: false,
            too_large: false,
            scanned: 0,
            max_event: max_event.max(1),
        }
    }

    /// Bytes held back, waiting for the end of their event.
    pub fn pending(&self) -> usize {
        self.buffer.len()
    }

    /// Whether bytes other than whitespace wait for the end of their event (Python's
    /// `decoder.pending.strip()`): a body that ends here ends mid-event.
    pub fn pending_text(&self) -> bool {
        !self.too_large && self.buffer.iter().any(|b| !b" \t\n\r\x0b\x0c".contains(b))
    }

    /// Feed a piece of the body; returns the events it completed.
    pub fn feed(&mut self, piece: &[u8]) -> Decoded {
        let mut out = Decoded::default();
        if self.done || self.too_large {
            out.done = self.done;
            out.too_large = self.too_large;
            return out;
        }
        if piece.contains(&b'\r') || self.buffer.last() == Some(&b'\r') {
            let start = self.buffer.len();
            self.buffer.extend_from_slice(piece);
            strip_cr(&mut self.buffer, start);
        } else {
            self.buffer.extend_from_slice(piece);
        }
        let mut at = 0;
        // A `\r` joined across pieces shortens the old bytes by one: look two bytes back.
        let mut from = self.scanned.saturating_sub(2);
        while let Some(end) = find(&self.buffer[from..], b"\n\n") {
            let block = &self.buffer[at..from + end];
            at = from + end + 2;
            from = at;
            if let Some(data) = data_of(block) {
                if data == b"[DONE]" {
                    self.done = true;
                    out.done = true;
                    break;
                }
                out.payloads.push(data);
            }
        }
        self.buffer.drain(..at);
        self.scanned = self.buffer.len();
        if self.buffer.len() > self.max_event && !self.done {
            self.too_large = true;
            out.too_large = true;
            self.buffer = Vec::new(); // give the memory back now, not when the stream ends
        }
        out
    }
}

/// `\r\n` -> `\n` in `buf[start..]` (a `\r\n` split across pieces is joined first).
fn strip_cr(buf: &mut Vec<u8>, start: usize) {
    let from = start.saturating_sub(1);
    let mut write = from;
    let mut read = from;
    while read < buf.len() {
        if buf[read] == b'\r' && buf.get(read + 1) == Some(&b'\n') {
            read += 1;
            continue;
        }
        buf[write] = buf[read];
        write += 1;
        read += 1;
    }
    buf.truncate(write);
}

/// Where `needle` first starts in `haystack` (its first byte found by `memchr`: these needles
/// are short and the haystacks a chunk long, too short for a searcher's set-up to pay).
pub(super) fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    let (&first, rest) = needle.split_first()?;
    let mut from = 0;
    while let Some(i) = memchr::memchr(first, &haystack[from..]) {
        let at = from + i;
        if haystack[at + 1..].starts_with(rest) {
            return Some(at);
        }
        from = at + 1;
    }
    None
}

fn trim(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

fn data_of(block: &[u8]) -> Option<Vec<u8>> {
    if block.starts_with(b"data:") && !block.contains(&b'\n') {
        return Some(trim(&block[5..]).to_vec());
    }
    let lines: Vec<&[u8]> = block
        .split(|&b| b == b'\n')
        .filter(|l| l.starts_with(b"data:"))
        .map(|l| trim(&l[5..]))
        .collect();
    if lines.is_empty() {
        None
    } else {
        Some(lines.join(&b'\n'))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn events_split_across_pieces_and_crlf() {
        let mut d = SseDecoder::new();
        let a = d.feed(b"data: {\"a\":1}\r");
        assert!(a.payloads.is_empty());
        let b = d.feed(b"\n\r\ndata: {\"b\"");
        assert_eq!(b.payloads, vec![b"{\"a\":1}".to_vec()]);
        let c = d
            .feed(b":2}\n\n: comment\n\nevent: x\ndata: 1\ndata: 2\n\ndata: [DONE]\n\ndata: after");
        assert_eq!(c.payloads, vec![b"{\"b\":2}".to_vec(), b"1\n2".to_vec()]);
        assert!(c.done);
        assert!(d.feed(b"\n\n").payloads.is_empty());
    }

    // A body that ends between events ends cleanly (a Responses stream has no `[DONE]`);
    // one that ends inside an event does not, whitespace aside.
    #[test]
    fn what_is_pending_at_a_body_end() {
        let mut d = SseDecoder::new();
        let events = d.feed(b"event: response.completed\ndata: {\"a\":1}\n\n\r\n");
        assert_eq!(events.payloads, vec![b"{\"a\":1}".to_vec()]);
        assert!(!d.pending_text());
        d.feed(b"event: response.output_text.delta\ndata: {\"a\"");
        assert!(d.pending_text());
    }

    #[test]
    fn an_event_without_end_is_bounded_and_refused() {
        let mut d = SseDecoder::with_limit(1024);
        assert_eq!(d.feed(b"data: {\"a\":1}\n\n").payloads.len(), 1);
        let mut refused = false;
        for _ in 0..100 {
            let out = d.feed(&[b'x'; 100]);
            assert!(d.pending() <= 1024 + 100);
            refused |= out.too_large;
        }
        assert!(refused);
        assert_eq!(d.pending(), 0); // the memory was given back
        let after = d.feed(b"\n\ndata: 1\n\n");
        assert!(after.too_large && after.payloads.is_empty());
    }

    #[test]
    fn an_event_at_the_limit_passes() {
        let mut d = SseDecoder::with_limit(64);
        let event = [b"data: ".as_slice(), &[b'y'; 58]].concat();
        assert_eq!(event.len(), 64);
        let out = d.feed(&event);
        assert!(!out.too_large);
        assert_eq!(d.feed(b"\n\n").payloads, vec![vec![b'y'; 58]]);
    }

    #[test]
    fn crlf_split_at_every_position_never_merges_events() {
        let stream = b"data: a\r\n\r\ndata: b\r\n\r\n: c\r\n\r\ndata: [DONE]\r\n\r\n";
        for cut in 0..=stream.len() {
            for cut2 in cut..=stream.len() {
                let mut d = SseDecoder::new();
                let mut got = Vec::new();
                let mut done = false;
                for piece in [&stream[..cut], &stream[cut..cut2], &stream[cut2..]] {
                    let out = d.feed(piece);
                    got.extend(out.payloads);
                    done |= out.done;
                }
                assert_eq!(
                    got,
                    vec![b"a".to_vec(), b"b".to_vec()],
                    "cut at {cut}, {cut2}"
                );
                assert!(done);
            }
        }
    }

    /// The decoder as a one-shot function of the whole body: `\r\n` is `\n`, events end at
    /// a blank line, an unfinished last event is not one, nothing after `[DONE]` counts.
    fn reference(input: &[u8]) -> (Vec<Vec<u8>>, bool) {
        let mut text = Vec::with_capacity(input.len());
        let mut i = 0;
        while i < input.len() {
            if input[i] == b'\r' && input.get(i + 1) == Some(&b'\n') {
                i += 1;
                continue;
            }
            text.push(input[i]);
            i += 1;
        }
        let mut out = Vec::new();
        let mut rest = text.as_slice();
        while let Some(end) = find(rest, b"\n\n") {
            if let Some(data) = data_of(&rest[..end]) {
                if data == b"[DONE]" {
                    return (out, true);
                }
                out.push(data);
            }
            rest = &rest[end + 2..];
        }
        (out, false)
    }

    fn sse_bytes() -> impl Strategy<Value = Vec<u8>> {
        let token = prop_oneof![
            Just(b"data: ".to_vec()),
            Just(b"data:".to_vec()),
            Just(b"\n".to_vec()),
            Just(b"\r\n".to_vec()),
            Just(b"\r".to_vec()),
            Just(b"\n\n".to_vec()),
            Just(b"\r\n\r\n".to_vec()),
            Just(b": comment".to_vec()),
            Just(b"event: x".to_vec()),
            Just(b"[DONE]".to_vec()),
            Just(b" ".to_vec()),
            proptest::collection::vec(any::<u8>(), 0..8),
            "[a-z{}\":,]{0,12}".prop_map(String::into_bytes),
        ];
        proptest::collection::vec(token, 0..40).prop_map(|t| t.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 500, failure_persistence: None,
                                            ..ProptestConfig::default() })]

        /// Fuzz: however the body is cut into reads, the events are the reference's.
        #[test]
        fn any_split_gives_the_events_of_the_whole(
            input in sse_bytes(), cuts in proptest::collection::vec(any::<usize>(), 0..6)
        ) {
            let mut points: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
            points.sort_unstable();
            let mut d = SseDecoder::new();
            let mut got = Vec::new();
            let mut done = false;
            let mut last = 0;
            for point in points.into_iter().chain([input.len()]) {
                let out = d.feed(&input[last..point]);
                prop_assert!(!out.too_large);
                got.extend(out.payloads);
                done |= out.done;
                last = point;
            }
            prop_assert_eq!((got, done), reference(&input));
        }

        /// Fuzz: what is held back never passes the limit (plus the piece being read).
        #[test]
        fn what_is_held_stays_under_the_limit(
            input in sse_bytes(), limit in 1usize..64, piece in 1usize..16
        ) {
            let mut d = SseDecoder::with_limit(limit);
            for chunk in input.chunks(piece) {
                let out = d.feed(chunk);
                prop_assert!(d.pending() <= limit, "{} held over a limit of {}", d.pending(), limit);
                if out.too_large {
                    prop_assert_eq!(d.pending(), 0);
                }
            }
        }
    }

    #[test]
    fn crlf_split_between_pieces() {
        let mut d = SseDecoder::new();
        assert!(d.feed(b"data: x\r\n\r").payloads.is_empty());
        assert_eq!(d.feed(b"\n").payloads, vec![b"x".to_vec()]);
        assert_eq!(d.pending(), 0);
    }
}
