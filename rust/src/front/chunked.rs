//! Where a chunked body ends (RFC 9112 7.1), so its bytes can be copied as they are.
//!
//! The pass-through copies bodies verbatim both ways (a client's chunked upload to the app, the
//! app's chunked reply to the client), so SSE chunks go out as they come and nothing is
//! re-encoded; it only needs to know where one message ends and the next (a pipelined
//! request, the next reply) begins. Sizes are read, data skipped, trailers passed over.

/// The framing's position inside a chunked body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// In a chunk-size line (hex digits, extensions) up to its LF: its length so far, the
    /// digits read.
    Size {
        line: usize,
        hex: usize,
        size: u64,
        in_ext: bool,
    },
    /// In a chunk's data: this many bytes left.
    Data(u64),
    /// The CRLF after a chunk's data: this many bytes of it left.
    DataEnd(u8),
    /// In the trailer section: bytes of the current line so far.
    Trailer(usize),
    Done,
}

/// A malformed chunked body: the message cannot be framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Malformed;

const MAX_LINE: usize = 4096; // a chunk-size line or a trailer line longer than this is refused

/// Follows a chunked body through the bytes fed to it.
#[derive(Debug, Clone)]
pub struct Chunked {
    state: State,
}

impl Default for Chunked {
    fn default() -> Self {
        Self {
            state: State::Size {
                line: 0,
                hex: 0,
                size: 0,
                in_ext: false,
            },
        }
    }
}

impl Chunked {
    /// True once the last chunk and the trailers have passed.
    pub fn done(&self) -> bool {
        self.state == State::Done
    }

    /// How many bytes of `buf` belong to the body (all of them unless it ends inside).
    pub fn feed(&mut self, buf: &[u8]) -> Result<usize, Malformed> {
        let mut i = 0;
        while i < buf.len() && !self.done() {
            match &mut self.state {
                State::Data(left) => {
                    let take = (*left).min((buf.len() - i) as u64);
                    *left -= take;
                    i += take as usize;
                    if *left == 0 {
                        self.state = State::DataEnd(2);
                    }
                    continue;
                }
                State::DataEnd(left) => {
                    let want = if *left == 2 { b'\r' } else { b'\n' };
                    if buf[i] != want {
                        return Err(Malformed);
                    }
                    *left -= 1;
                    if *left == 0 {
                        self.state = State::Size {
                            line: 0,
                            hex: 0,
                            size: 0,
                            in_ext: false,
                        };
                    }
                }
                State::Size {
                    line,
                    hex,
                    size,
                    in_ext,
                } => {
                    let b = buf[i];
                    *line += 1;
                    if *line > MAX_LINE {
                        return Err(Malformed);
                    }
                    match (b, *in_ext) {
                        (b'\n', _) if *hex == 0 => return Err(Malformed),
                        (b'\n', _) => {
                            self.state = match *size {
                                0 => State::Trailer(0),
                                n => State::Data(n),
                            };
                        }
                        (_, true) | (b'\r', false) => {}
                        (b';' | b' ' | b'\t', false) => *in_ext = true,
                        (_, false) => {
                            let digit = (b as char).to_digit(16).ok_or(Malformed)?;
                            *hex += 1;
                            *size = size
                                .checked_mul(16)
                                .and_then(|s| s.checked_add(u64::from(digit)))
                                .ok_or(Malformed)?;
                        }
                    }
                }
                State::Trailer(len) => {
                    if buf[i] == b'\n' {
                        // An empty line (only CR before the LF) ends the message.
                        self.state = if *len <= 1 {
                            State::Done
                        } else {
                            State::Trailer(0)
                        };
                    } else {
                        *len += 1;
                        if *len > MAX_LINE {
                            return Err(Malformed);
                        }
                    }
                }
                State::Done => unreachable!("the loop stops when done"),
            }
            i += 1;
        }
        Ok(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // A whole body, fed at once, ends where its last CRLF ends; what follows is not its.
    #[test]
    fn whole_body_then_next_message() {
        let body = b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\n\r\nGET / HTTP/1.1\r\n";
        let mut c = Chunked::default();
        let n = c.feed(body).unwrap();
        assert!(c.done());
        assert_eq!(&body[n..], b"GET / HTTP/1.1\r\n");
    }

    // Fed one byte at a time, it ends at the same place.
    #[test]
    fn byte_at_a_time() {
        let body = b"a\r\n0123456789\r\n0\r\nx-t: 1\r\n\r\n";
        let mut c = Chunked::default();
        for (i, b) in body.iter().enumerate() {
            assert!(!c.done(), "ended early at {i}");
            assert_eq!(c.feed(std::slice::from_ref(b)).unwrap(), 1);
        }
        assert!(c.done());
    }

    // Bad sizes, a missing CRLF after data, and an oversized line are refused.
    #[test]
    fn malformed() {
        for bad in [
            &b"zz\r\n"[..],
            b"\r\n",
            b"3\r\nabcX",
            b"fffffffffffffffff1\r\n",
        ] {
            assert_eq!(Chunked::default().feed(bad), Err(Malformed), "{bad:?}");
        }
        assert_eq!(
            Chunked::default().feed(&[b'1'; MAX_LINE + 1]),
            Err(Malformed)
        );
    }
}
