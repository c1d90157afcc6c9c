//! `decode_json`'s refusals: a body that is not one JSON object of finite numbers, worded
//! once for both paths. The front answers them natively; Python's `protocol.decode_json` asks
//! for the same message (`_core.json_refusal`) whenever its own parse refuses a body, so the
//! line and column are this jiter's on both, whichever jiter the installed pydantic-core runs
//! (they differ between versions on where an invalid UTF-8 byte is).
//!
//! The front reads bodies with serde (`json.rs`); only one serde will not hold comes here. It
//! is read again with jiter, walked as pydantic-core's Python builder walks it
//! (`jiter/src/python.rs`: the same calls, the same recursion limit). A body jiter reads as
//! one object of finite numbers is one serde refused for what it cannot hold as Python does (a
//! key twice, `-0`, an integer past 64 bits): Python takes it, and the front is unsure of it.

use jiter::{Jiter, JiterErrorType, JsonErrorType, LinePosition, NumberAny, Peek};

/// The nesting a body may have: jiter's recursion limit (`DEFAULT_RECURSION_LIMIT`).
const MAX_DEPTH: u8 = 200;
const ESCAPE: &str = "a \\u escape takes 4 hex digits, and a UTF-16 surrogate must come as a pair";
/// jiter's message -> what the client should fix.
const HINTS: [(&str, &str); 6] = [
    (
        "recursion limit exceeded",
        "arrays and objects nest deeper than 200 levels",
    ),
    (
        "number out of range",
        "a number has more digits than the gateway reads (4,300)",
    ),
    ("hex escape", ESCAPE),
    ("surrogate", ESCAPE),
    (
        "unicode code point",
        "the body is not UTF-8; send it UTF-8 encoded",
    ),
    (
        "control character",
        "a string holds a raw control character; escape it (\\n, \\u0000)",
    ),
];

/// What `decode_json` says of a body serde would not read: `Some(message)` of its 400
/// (`invalid_json`), or `None` where Python takes the body.
pub fn refusal(raw: &[u8]) -> Option<String> {
    let mut walk = Walk {
        jiter: Jiter::new(raw),
        depth_left: MAX_DEPTH,
        infinite: false,
    };
    let top = match walk.document() {
        Ok(top) => top,
        Err((error, index)) => return Some(not_json(raw, &error, index)),
    };
    if top != "dict" {
        return Some(format!(
            "request body must be a JSON object ({{...}}), got {top}"
        ));
    }
    if walk.infinite && maybe_huge(raw) {
        return Some(
            "a number in the request body is too large for a float (it would be Infinity); \
             send a finite number"
                .to_owned(),
        );
    }
    None
}

/// A walk of the document as `PythonParser` takes it, noting only whether a float is infinite.
struct Walk<'j> {
    jiter: Jiter<'j>,
    depth_left: u8,
    infinite: bool,
}

/// jiter's error: its message (`JsonErrorType`'s) and the byte it points at.
type Failure = (String, usize);

impl Walk<'_> {
    /// `PythonParser::parse`: one value, then nothing but whitespace. The top value's
    /// Python type name (`None`'s as `decode_json` says it: `null`).
    fn document(&mut self) -> Result<&'static str, Failure> {
        let peek = self.jiter.peek().map_err(failure)?;
        let kind = self.value(peek)?;
        self.jiter.finish().map_err(failure)?;
        Ok(kind)
    }

    /// `py_take_value`.
    fn value(&mut self, peek: Peek) -> Result<&'static str, Failure> {
        match peek {
            Peek::Null => self.jiter.known_null().map(|()| "null"),
            Peek::True | Peek::False => self.jiter.known_bool(peek).map(|_| "bool"),
            Peek::String => self.jiter.known_str().map(|_| "str"),
            Peek::Array => {
                if let Some(mut next) = self.jiter.known_array().map_err(failure)? {
                    loop {
                        self.nested(next)?;
                        match self.jiter.array_step().map_err(failure)? {
                            Some(peek) => next = peek,
                            None => break,
                        }
                    }
                }
                return Ok("list");
            }
            Peek::Object => {
                if self.jiter.known_object().map_err(failure)?.is_some() {
                    loop {
                        let peek = self.jiter.peek().map_err(failure)?;
                        self.nested(peek)?;
                        if self.jiter.next_key().map_err(failure)?.is_none() {
                            break;
                        }
                    }
                }
                return Ok("dict");
            }
            // `ParseNumberLossy`: what is not a number there is jiter's "expected value"
            // (`known_number` maps it alike).
            _ => self.jiter.known_number(peek).map(|n| match n {
                NumberAny::Int(_) => "int",
                NumberAny::Float(x) => {
                    self.infinite |= !x.is_finite();
                    "float"
                }
            }),
        }
        .map_err(failure)
    }

    /// `check_take_value`: a value inside an array or object, within the recursion limit.
    fn nested(&mut self, peek: Peek) -> Result<(), Failure> {
        let Some(left) = self.depth_left.checked_sub(1) else {
            let error = JsonErrorType::RecursionLimitExceeded.to_string();
            return Err((error, self.jiter.current_index()));
        };
        self.depth_left = left;
        let taken = self.value(peek);
        self.depth_left += 1;
        taken.map(|_| ())
    }
}

fn failure(error: jiter::JiterError) -> Failure {
    let message = match error.error_type {
        JiterErrorType::JsonError(kind) => kind.to_string(),
        // Not reached: each value is taken by the call its peek names.
        wrong @ JiterErrorType::WrongType { .. } => wrong.to_string(),
    };
    (message, error.index)
}

/// The parser's message, where, and a hint at what to fix.
fn not_json(raw: &[u8], error: &str, index: usize) -> String {
    let position = LinePosition::find(raw, index);
    let detail = format!("{error} at {position}");
    let mut hint = HINTS
        .iter()
        .find(|(key, _)| detail.contains(key))
        .map(|(_, hint)| *hint);
    if hint.is_none()
        && (detail.starts_with("expected value") || detail.starts_with("invalid number"))
    {
        let offset = offset(raw, &position);
        // jiter points at or just past a sign
        let around = &raw[offset.saturating_sub(1).min(raw.len())..(offset + 4).min(raw.len())];
        let has = |needle: &[u8]| around.windows(needle.len()).any(|w| w == needle);
        if has(b"NaN") || has(b"Inf") {
            hint = Some("NaN and Infinity are not JSON; send a finite number or null");
        } else if raw.starts_with(b"\xef\xbb\xbf") {
            hint = Some("the body starts with a byte-order mark; send UTF-8 without one");
        }
    }
    // `not raw.strip()`: bytes.strip's whitespace is ASCII's, with \x0b.
    if raw
        .iter()
        .all(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r' | b'\x0b' | b'\x0c'))
    {
        hint = Some("the body is empty; send a JSON object");
    }
    match hint {
        Some(hint) => format!("request body is not valid JSON: {detail} ({hint})"),
        None => format!("request body is not valid JSON: {detail}"),
    }
}

/// The line and column read back into a byte offset (a missing newline starts the next
/// search at 0 again, as Python's `bytes.find` of -1 did when this was Python's).
fn offset(raw: &[u8], position: &LinePosition) -> usize {
    let mut start = 0;
    for _ in 1..position.line {
        start = raw[start.min(raw.len())..]
            .iter()
            .position(|&b| b == b'\n')
            .map_or(0, |i| start + i + 1);
    }
    start + position.column.saturating_sub(1)
}

/// `protocol._MAYBE_HUGE`: a number that may overflow a float (`[0-9][eE][+]?[0-9]{3}` or
/// 309 digits in a row), anywhere in the bytes.
fn maybe_huge(raw: &[u8]) -> bool {
    let digit = |i: usize| raw.get(i).is_some_and(u8::is_ascii_digit);
    let mut run = 0;
    for (i, b) in raw.iter().enumerate() {
        run = if b.is_ascii_digit() { run + 1 } else { 0 };
        if run >= 309 {
            return true;
        }
        if b.is_ascii_digit() && matches!(raw.get(i + 1), Some(b'e' | b'E')) {
            let at = i + 2 + usize::from(raw.get(i + 2) == Some(&b'+'));
            if digit(at) && digit(at + 1) && digit(at + 2) {
                return true;
            }
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    // The parser's errors, where they are, and decode_json's hints.
    #[test]
    fn not_json_messages() {
        let cases: [(&[u8], &str); 6] = [
            (
                b"{\"a\": [",
                "request body is not valid JSON: EOF while parsing a list at line 1 column 7",
            ),
            (
                b"",
                "request body is not valid JSON: EOF while parsing a value at line 1 column 0 \
                 (the body is empty; send a JSON object)",
            ),
            (
                b"{\"t\": NaN}",
                "request body is not valid JSON: expected value at line 1 column 7 (NaN and \
                 Infinity are not JSON; send a finite number or null)",
            ),
            (
                b"\xef\xbb\xbf{}",
                "request body is not valid JSON: expected value at line 1 column 1 (the body \
                 starts with a byte-order mark; send UTF-8 without one)",
            ),
            (
                b"{\"x\": \"\\ud800\"}",
                "request body is not valid JSON: unexpected end of hex escape at line 1 column \
                 14 (a \\u escape takes 4 hex digits, and a UTF-16 surrogate must come \
                 as a pair)",
            ),
            (
                b"{}\n x",
                "request body is not valid JSON: trailing characters at line 2 column 2",
            ),
        ];
        for (raw, message) in cases {
            assert_eq!(refusal(raw).as_deref(), Some(message), "{raw:?}");
        }
    }

    // 200 levels inside the object are jiter's limit: one more is refused, at the bracket.
    #[test]
    fn depth() {
        let nest = |n: usize| {
            [
                b"{\"x\": ".to_vec(),
                vec![b'['; n],
                vec![b']'; n],
                b"}".to_vec(),
            ]
            .concat()
        };
        assert_eq!(refusal(&nest(200)), None);
        let message = "request body is not valid JSON: recursion limit exceeded at line 1 column \
                       207 (arrays and objects nest deeper than 200 levels)";
        assert_eq!(refusal(&nest(201)).as_deref(), Some(message));
    }

    // Not an object, an infinite float, and what Python takes.
    #[test]
    fn values() {
        for (raw, got) in [
            (&b"[1]"[..], "list"),
            (b" \"s\" ", "str"),
            (b"1", "int"),
            (b"1.5", "float"),
            (b"true", "bool"),
            (b"null", "null"),
        ] {
            let message = format!("request body must be a JSON object ({{...}}), got {got}");
            assert_eq!(refusal(raw), Some(message));
        }
        assert!(refusal(b"{\"x\": 1e400}").is_some_and(|m| m.contains("too large for a float")));
        // Python's regex misses an overflow of 250 digits with a 2-digit exponent: so does this.
        let sly = [b"{\"x\": ".to_vec(), vec![b'9'; 250], b"e99}".to_vec()].concat();
        assert_eq!(refusal(&sly), None);
        for taken in [
            &b"{\"a\": 1, \"a\": 2}"[..],
            b"{\"x\": -0}",
            b"{\"x\": 123456789012345678901234567890}",
        ] {
            assert_eq!(refusal(taken), None);
        }
    }
}
