//! Chunked bodies (RFC 9112 7.1): where one ends, so its bytes can be copied as they are, and
//! its data, so a request the front serves itself is read as uvicorn's parser reads it.
//!
//! The pass-through copies bodies verbatim both ways (a client's chunked upload to the app, the
//! app's chunked reply to the client), so SSE chunks go out as they come and nothing is
//! re-encoded; it only needs to know where one message ends and the next (a pipelined
//! request, the next reply) begins (`feed`). A governed request's body is decoded (`decode`):
//! its data collected, sizes, extensions and trailers dropped.
//!
//! The grammar is llhttp's, as httptools runs it under uvicorn (the app's listener): a size in
//! hex digits, then `;`-separated extensions (token names, token or quoted values; whitespace
//! anywhere in the line is refused), CRLF after the size line and after each chunk's data,
//! trailers as header lines (a token, `:`, a value without control bytes but HTAB), and an
//! empty line at the end. What llhttp refuses is [`Malformed`] here, so a body the front
//! decodes is one the app would have read, and one it refuses the app would have refused.

/// Where a chunk-size line is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// In the hex digits.
    Size,
    /// Just after a `;`: an extension's name (or another `;`) must come.
    NameStart,
    Name,
    /// After `=`: a token, a quoted string, or nothing.
    ValueStart,
    Value,
    Quoted,
    /// After a backslash inside a quoted string.
    Escaped,
    /// After a quoted string's closing quote.
    Unquoted,
    /// After the line's CR.
    Lf,
}

/// Where a trailer line is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    /// At a line's start: a name, or the CR of the empty line that ends the message.
    Start,
    Name,
    Value,
    /// After a field line's CR.
    Lf,
    /// After the empty line's CR.
    EndLf,
}

/// The framing's position inside a chunked body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// In a chunk-size line: where, its length so far, the digits read, the size so far.
    Size {
        at: Line,
        line: usize,
        hex: usize,
        size: u64,
    },
    /// In a chunk's data: this many bytes left.
    Data(u64),
    /// The CRLF after a chunk's data: this many bytes of it left.
    DataEnd(u8),
    /// In the trailer section: where, and the current line's length so far.
    Trailer {
        at: Field,
        line: usize,
    },
    Done,
}

const SIZE_LINE: State = State::Size {
    at: Line::Size,
    line: 0,
    hex: 0,
    size: 0,
};

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
        Self { state: SIZE_LINE }
    }
}

/// RFC 9110's `tchar`: what a token (an extension's or a trailer's name) is made of.
fn tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// A quoted string's text: `qdtext` (HTAB, SP, visible but `"` and `\`, obs-text).
fn qdtext(b: u8) -> bool {
    matches!(b, b'\t' | b' ' | 0x21 | 0x23..=0x5b | 0x5d..=0x7e | 0x80..)
}

/// A field value's byte: anything but a control byte (HTAB aside) and DEL.
fn field_byte(b: u8) -> bool {
    matches!(b, b'\t' | b' '..=0x7e | 0x80..)
}

impl Chunked {
    /// True once the last chunk and the trailers have passed.
    pub fn done(&self) -> bool {
        self.state == State::Done
    }

    /// How many bytes of `buf` belong to the body (all of them unless it ends inside).
    pub fn feed(&mut self, buf: &[u8]) -> Result<usize, Malformed> {
        self.step(buf, |_| {})
    }

    fn step(&mut self, buf: &[u8], mut data: impl FnMut(&[u8])) -> Result<usize, Malformed> {
        let mut i = 0;
        while i < buf.len() && !self.done() {
            let b = buf[i];
            self.state = match self.state {
                State::Data(left) => {
                    let take = left.min((buf.len() - i) as u64);
                    data(&buf[i..i + take as usize]);
                    i += take as usize;
                    self.state = match left - take {
                        0 => State::DataEnd(2),
                        left => State::Data(left),
                    };
                    continue;
                }
                State::DataEnd(2) if b == b'\r' => State::DataEnd(1),
                State::DataEnd(1) if b == b'\n' => SIZE_LINE,
                State::DataEnd(_) => return Err(Malformed),
                State::Size {
                    at,
                    line,
                    hex,
                    size,
                } => size_line(at, line, hex, size, b)?,
                State::Trailer { at, line } => trailer(at, line, b)?,
                State::Done => unreachable!("the loop stops when done"),
            };
            i += 1;
        }
        Ok(i)
    }
}

/// The state after byte `b` of a chunk-size line (at `at`, `line` bytes into it, `hex` digits
/// read, the size so far).
fn size_line(at: Line, line: usize, hex: usize, size: u64, b: u8) -> Result<State, Malformed> {
    if line + 1 > MAX_LINE {
        return Err(Malformed);
    }
    let next = |at| State::Size {
        at,
        line: line + 1,
        hex,
        size,
    };
    Ok(match (at, b) {
        (Line::Size, _) if b.is_ascii_hexdigit() => {
            let digit = u64::from((b as char).to_digit(16).unwrap_or(0));
            let size = size
                .checked_mul(16)
                .and_then(|s| s.checked_add(digit))
                .ok_or(Malformed)?;
            State::Size {
                at,
                line: line + 1,
                hex: hex + 1,
                size,
            }
        }
        (Line::Size, b';' | b'\r') if hex == 0 => return Err(Malformed),
        (
            Line::Size
            | Line::NameStart
            | Line::Name
            | Line::ValueStart
            | Line::Value
            | Line::Unquoted,
            b';',
        ) => next(Line::NameStart),
        (Line::Size | Line::Name | Line::ValueStart | Line::Value | Line::Unquoted, b'\r') => {
            next(Line::Lf)
        }
        (Line::NameStart | Line::Name, _) if tchar(b) => next(Line::Name),
        (Line::Name, b'=') => next(Line::ValueStart),
        (Line::ValueStart, b'"') => next(Line::Quoted),
        (Line::ValueStart | Line::Value, _) if tchar(b) => next(Line::Value),
        (Line::Quoted, b'"') => next(Line::Unquoted),
        (Line::Quoted, b'\\') => next(Line::Escaped),
        (Line::Quoted, _) if qdtext(b) => next(Line::Quoted),
        (Line::Escaped, _) if field_byte(b) => next(Line::Quoted),
        (Line::Lf, b'\n') if size == 0 => State::Trailer {
            at: Field::Start,
            line: 0,
        },
        (Line::Lf, b'\n') => State::Data(size),
        _ => return Err(Malformed),
    })
}

/// The state after byte `b` of the trailer section (at `at`, `line` bytes into a line).
fn trailer(at: Field, line: usize, b: u8) -> Result<State, Malformed> {
    if line + 1 > MAX_LINE {
        return Err(Malformed);
    }
    let next = |at| State::Trailer { at, line: line + 1 };
    Ok(match (at, b) {
        (Field::Start, b'\r') => next(Field::EndLf),
        (Field::Start | Field::Name, _) if tchar(b) => next(Field::Name),
        (Field::Name, b':') => next(Field::Value),
        (Field::Value, b'\r') => next(Field::Lf),
        (Field::Value, _) if field_byte(b) => next(Field::Value),
        (Field::Lf, b'\n') => State::Trailer {
            at: Field::Start,
            line: 0,
        },
        (Field::EndLf, b'\n') => State::Done,
        _ => return Err(Malformed),
    })
}

/// A chunked request body read into its data, within a limit.
#[derive(Debug)]
pub struct Decoder {
    chunked: Chunked,
    data: Vec<u8>,
    limit: usize,
}

impl Decoder {
    /// A body whose data may be `limit` bytes at most (`server.max_body_bytes`).
    pub fn new(limit: usize) -> Self {
        Self {
            chunked: Chunked::default(),
            data: Vec::new(),
            limit,
        }
    }

    /// How many bytes of `buf` belong to the body (as `Chunked::feed`), their data kept; of a
    /// body over the limit, no more than one byte past it is kept (the rest is only framed).
    pub fn feed(&mut self, buf: &[u8]) -> Result<usize, Malformed> {
        let (data, room) = (&mut self.data, self.limit + 1);
        self.chunked.step(buf, |part| {
            let take = part.len().min(room.saturating_sub(data.len()));
            data.extend_from_slice(&part[..take]);
        })
    }

    /// The data has passed the limit (`BodyLimit` counts what the app receives, and answers
    /// 413 once it passes).
    pub fn too_large(&self) -> bool {
        self.data.len() > self.limit
    }

    /// True once the last chunk and the trailers have passed.
    pub fn done(&self) -> bool {
        self.chunked.done()
    }

    /// The body's data.
    pub fn into_data(self) -> Vec<u8> {
        self.data
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

    // Decoded fed one byte at a time: the data of every chunk, nothing of sizes, extensions
    // or trailers, and it ends where the body does.
    #[test]
    fn decode_byte_at_a_time() {
        let body = b"5;a=b;c=\"d e\"\r\nhello\r\n6\r\n world\r\n0\r\nx-t: 1\r\n\r\nNEXT";
        let mut d = Decoder::new(100);
        let mut used = 0;
        for b in body {
            if d.done() {
                break;
            }
            used += d.feed(std::slice::from_ref(b)).unwrap();
        }
        assert!(d.done());
        assert_eq!(&body[used..], b"NEXT");
        assert_eq!(d.into_data(), b"hello world");
    }

    // The data passing the limit is refused as it arrives; at the limit it is read whole.
    #[test]
    fn decode_over_limit() {
        let mut at = Decoder::new(10);
        assert_eq!(at.feed(b"a\r\n0123456789\r\n0\r\n\r\n"), Ok(20));
        assert!(at.done() && !at.too_large());
        let mut over = Decoder::new(10);
        assert_eq!(over.feed(b"6\r\n012345\r\n"), Ok(11));
        assert!(!over.too_large());
        assert_eq!(over.feed(b"5\r\n01234"), Ok(8));
        assert!(over.too_large());
        // The rest is framed, not kept: the body's end is still found.
        assert_eq!(over.feed(b"\r\n9000\r\n"), Ok(8));
        let big = vec![b'x'; 0x9000];
        assert_eq!(over.feed(&big), Ok(0x9000));
        assert_eq!(over.feed(b"\r\n0\r\n\r\nNEXT"), Ok(7));
        assert!(over.done());
        assert_eq!(over.into_data().len(), 11);
        let mut lf = Decoder::new(10);
        assert_eq!(
            lf.feed(b"5\r\nab\nXX"),
            Ok(8),
            "inside a chunk, data is data"
        );
        assert_eq!(lf.into_data(), b"ab\nXX");
        assert_eq!(Decoder::new(10).feed(b"3\r\nabcX"), Err(Malformed));
    }

    // What llhttp (httptools 0.9, under uvicorn 0.55) accepts and refuses, fed whole and byte by
    // byte: the front reads what the app would have read, and refuses what it refused.
    #[test]
    fn llhttps_grammar() {
        let accepted: [&[u8]; 14] = [
            b"5\r\nhello\r\n0\r\n\r\n",
            b"5;a=b\r\nhello\r\n0\r\n\r\n",
            b"5;a=\"b c\"\r\nhello\r\n0\r\n\r\n",
            b"5;a\r\nhello\r\n0\r\n\r\n",
            b"5;a=b;c=\"d\"\r\nhello\r\n0\r\n\r\n",
            b"5;a=\r\nhello\r\n0\r\n\r\n",
            b"5;;a\r\nhello\r\n0\r\n\r\n",
            b"5;!#$%&'*+-.^_`|~=!#\r\nhello\r\n0\r\n\r\n",
            b"5;a=\"b\\\"c\"\r\nhello\r\n0\r\n\r\n",
            b"5;a=\"\xe9\"\r\nhello\r\n0\r\n\r\n",
            b"005\r\nhello\r\n00;x=1\r\n\r\n",
            b"5\r\nhello\r\n0\r\nx-t:  v \r\ny:\r\n\r\n",
            b"5\r\nhello\r\n0\r\nx-t: \xe9\ta\r\n\r\n",
            b"A\r\n0123456789\r\n0\r\n\r\n",
        ];
        let refused: [&[u8]; 21] = [
            b"5\nhello\r\n0\r\n\r\n",
            b"5 \r\nhello\r\n0\r\n\r\n",
            b"5 ;a=b\r\nhello\r\n0\r\n\r\n",
            b"5; a=b\r\nhello\r\n0\r\n\r\n",
            b"5\t\r\nhello\r\n0\r\n\r\n",
            b"0x5\r\nhello\r\n0\r\n\r\n",
            b"5\r\r\nhello\r\n0\r\n\r\n",
            b"5\r\nhello\n0\r\n\r\n",
            b"5\r\nhello\r\n0\r\n\n",
            b"5\r\nhello\r\n0\r\nbad trailer\r\n\r\n",
            b"5\r\nhello\r\n0\r\nbad\r\n\r\n",
            b"\r\nhello\r\n0\r\n\r\n",
            b"5;a=\x01\r\nhello\r\n0\r\n\r\n",
            b"5;a=b\rc\r\nhello\r\n0\r\n\r\n",
            b"fffffffffffffffff\r\n",
            b"5;a =b\r\nhello\r\n0\r\n\r\n",
            b"5;\r\nhello\r\n0\r\n\r\n",
            b"5;a=\xe9\r\nhello\r\n0\r\n\r\n",
            b"5;a=\"b\"c\r\nhello\r\n0\r\n\r\n",
            b"5\r\nhello\r\n0\r\nx-t: a\x01\r\n\r\n",
            b"5\r\nhello\r\n0\r\nx-t: a\r\n b\r\n\r\n",
        ];
        for body in accepted {
            let mut whole = Decoder::new(100);
            assert_eq!(whole.feed(body), Ok(body.len()), "{body:?}");
            assert!(!whole.too_large());
            assert!(whole.done(), "{body:?}");
            let data = whole.into_data();
            assert!(data == b"hello" || data == b"0123456789", "{body:?}");
        }
        for body in refused {
            assert_eq!(Decoder::new(100).feed(body), Err(Malformed), "{body:?}");
            let mut bytewise = Chunked::default();
            let failed = body.iter().any(|b| bytewise.feed(&[*b]).is_err());
            assert!(failed, "{body:?}");
        }
    }
}
