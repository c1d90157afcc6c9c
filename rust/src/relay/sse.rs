//! SSE de-framing of a vLLM stream: bytes in, `data:` payloads out, up to `[DONE]`.

/// What one call to [`SseDecoder::feed`] found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Decoded {
    /// The payloads of complete events, in order (without `data: ` or the blank line).
    pub payloads: Vec<Vec<u8>>,
    /// `data: [DONE]` was seen: the stream is complete; bytes after it are ignored.
    pub done: bool,
}

/// Splits a byte stream into SSE events (`\n\n` or `\r\n\r\n` separated) and keeps only their
/// `data:` payloads; several `data:` lines in one event are joined with `\n`, as the SSE spec
/// says. Events with no `data:` line (comments, `event:`-only) are skipped.
#[derive(Debug, Default)]
pub struct SseDecoder {
    buffer: Vec<u8>,
    done: bool,
}

impl SseDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes held back, waiting for the end of their event.
    pub fn pending(&self) -> usize {
        self.buffer.len()
    }

    /// Feed a piece of the body; returns the events it completed.
    pub fn feed(&mut self, piece: &[u8]) -> Decoded {
        let mut out = Decoded::default();
        if self.done {
            out.done = true;
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
        while let Some(end) = find(&self.buffer[at..], b"\n\n") {
            let block = &self.buffer[at..at + end];
            at += end + 2;
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

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
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

    #[test]
    fn crlf_split_between_pieces() {
        let mut d = SseDecoder::new();
        assert!(d.feed(b"data: x\r\n\r").payloads.is_empty());
        assert_eq!(d.feed(b"\n").payloads, vec![b"x".to_vec()]);
        assert_eq!(d.pending(), 0);
    }
}
