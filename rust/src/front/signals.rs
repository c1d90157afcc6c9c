//! `read_signals` (`gateway/signals.py`): what a request's headers say of its client, the
//! retries it made and how long it waits, for the runtime's `arrive`.
//!
//! The same reading as Python's: the SDKs' retry count and Envoy's attempt count (the larger),
//! the SDKs' timeout in seconds (the first that parses, as Python's `float()` parses it:
//! its whitespace, `_` between digits, `inf` and `nan`), and ours, `x-llmflow-deadline-ms`,
//! which wins. A header we do not own that does not parse is ignored. Ours, malformed, is
//! Python's 400 `invalid_deadline`, with its message: never a guess, so the front answers
//! every request itself.

use super::pytext::strip_bytes;

/// What a request's client said of it (`None`: nothing, or nothing usable).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ClientSignals {
    /// Retries it made before this attempt.
    pub retries: Option<u32>,
    /// How long after sending it gives up waiting.
    pub deadline_ms: Option<u64>,
}

/// Ours is malformed: Python's 400, with the value as it shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidDeadline {
    /// The value, stripped, its first 40 bytes (`text[:40]`).
    pub shown: Vec<u8>,
}

impl InvalidDeadline {
    /// `_own_deadline`'s `GatewayError(400, ..., "invalid_deadline", param=...)`.
    pub fn reply(&self) -> super::reply::ErrorReply {
        let message = format!(
            "x-llmflow-deadline-ms must be a whole number of milliseconds from 1 to \
             {MAX_DEADLINE_MS} (how long the client waits for the answer), got {}",
            super::pytext::repr_latin1(&self.shown)
        );
        super::reply::ErrorReply::checks(
            400,
            message,
            "invalid_deadline",
            Some("x-llmflow-deadline-ms"),
        )
    }
}

const DEADLINE: &[u8] = b"x-llmflow-deadline-ms"; // ours: ms the client waits, from sending
const RETRY_COUNT: &[u8] = b"x-stainless-retry-count"; // SDKs: retries before this one
const ATTEMPT_COUNT: &[u8] = b"x-envoy-attempt-count"; // Envoy: this attempt's number, from 1
const TIMEOUTS: [&[u8]; 2] = [b"x-stainless-timeout", b"x-stainless-read-timeout"]; // seconds
const MAX_COUNT: u32 = 1_000_000; // a larger count is no SDK's or proxy's: ignored
const MAX_DEADLINE_MS: u64 = 86_400_000; // a day; a longer wait is no deadline: ignored

/// The signals in a request's headers (lower-case names, raw values), in their order.
pub fn read_signals<'a>(
    headers: impl IntoIterator<Item = (&'a [u8], &'a [u8])>,
) -> Result<ClientSignals, InvalidDeadline> {
    let mut retries: Option<u32> = None;
    let mut deadline_ms = None;
    let mut timeout_ms = None;
    for (name, value) in headers {
        if name == RETRY_COUNT {
            retries = most(retries, count(value));
        } else if name == ATTEMPT_COUNT {
            retries = most(retries, count(value).filter(|n| *n > 0).map(|n| n - 1));
        } else if TIMEOUTS.contains(&name) {
            if timeout_ms.is_none() {
                timeout_ms = seconds_ms(value);
            }
        } else if name == DEADLINE {
            deadline_ms = Some(own_deadline(value)?);
        }
    }
    Ok(ClientSignals {
        retries,
        deadline_ms: deadline_ms.or(timeout_ms),
    })
}

fn most(a: Option<u32>, b: Option<u32>) -> Option<u32> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        _ => a.or(b),
    }
}

/// Digits only, at most `max_len` of them: the number, else `None`.
fn digits(text: &[u8], max_len: usize) -> Option<u64> {
    if text.is_empty() || text.len() > max_len || !text.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(text).ok()?.parse().ok()
}

fn count(value: &[u8]) -> Option<u32> {
    digits(strip_bytes(value), 7)
        .and_then(|n| u32::try_from(n).ok())
        .filter(|n| *n <= MAX_COUNT)
}

/// A timeout in seconds as milliseconds, None when Python ignores it: `float()` of the
/// stripped ASCII text, finite and positive, rounded half to even, at most a day.
fn seconds_ms(value: &[u8]) -> Option<u64> {
    let text = strip_bytes(value);
    if text.is_empty() || !text.is_ascii() {
        return None; // Python's `decode("ascii")` or `float("")` fails: ignored
    }
    let seconds = py_float(text)?;
    if !seconds.is_finite() || seconds <= 0.0 {
        return None;
    }
    // Python's `round()`: half to even; past a day (or past any integer) it is ignored.
    let ms = (seconds * 1000.0).round_ties_even();
    (ms > 0.0 && ms <= MAX_DEADLINE_MS as f64).then_some(ms as u64)
}

/// CPython's `float(str)` of ASCII text: its ASCII whitespace stripped (not the separators
/// `\x1c`..`\x1f`, which `str.isspace` holds: only non-ASCII spaces become blanks), `_` only between two digits and then dropped, `inf`, `infinity` or `nan` in any
/// case with a sign, else a decimal (read correctly rounded, as both `dtoa`s read it).
fn py_float(text: &[u8]) -> Option<f64> {
    let space = |b: &u8| matches!(b, b' ' | b'\t'..=b'\r');
    let start = text.iter().position(|b| !space(b))?;
    let end = text
        .iter()
        .rposition(|b| !space(b))
        .map_or(start, |i| i + 1);
    let text = &text[start..end];
    let mut plain = Vec::with_capacity(text.len());
    let mut prev = 0u8;
    for &b in text {
        if b == b'_' {
            if !prev.is_ascii_digit() {
                return None;
            }
        } else {
            if prev == b'_' && !b.is_ascii_digit() {
                return None;
            }
            plain.push(b);
        }
        prev = b;
    }
    if prev == b'_' {
        return None;
    }
    let unsigned = plain
        .strip_prefix(b"+")
        .or(plain.strip_prefix(b"-"))
        .unwrap_or(&plain);
    let word = unsigned.to_ascii_lowercase();
    if matches!(word.as_slice(), b"inf" | b"infinity") {
        return Some(f64::INFINITY); // its sign: not positive or not finite, ignored either way
    }
    if word == b"nan" {
        return Some(f64::NAN);
    }
    if !decimal(&plain) {
        return None;
    }
    std::str::from_utf8(&plain).ok()?.parse().ok()
}

/// `[+-]? (digits [. digits?] | . digits) ([eE] [+-]? digits)?`, the text both Python's
/// `float()` and Rust's parse read as the same correctly rounded number.
fn decimal(text: &[u8]) -> bool {
    let mut rest = text
        .strip_prefix(b"+")
        .or(text.strip_prefix(b"-"))
        .unwrap_or(text);
    let run = |s: &[u8]| s.iter().take_while(|b| b.is_ascii_digit()).count();
    let whole = run(rest);
    rest = &rest[whole..];
    let mut fraction = 0;
    if let Some(after) = rest.strip_prefix(b".") {
        fraction = run(after);
        rest = &after[fraction..];
    }
    if whole + fraction == 0 {
        return false;
    }
    if let Some(after) = rest.strip_prefix(b"e").or(rest.strip_prefix(b"E")) {
        let after = after
            .strip_prefix(b"+")
            .or(after.strip_prefix(b"-"))
            .unwrap_or(after);
        let exponent = run(after);
        return exponent > 0 && exponent == after.len();
    }
    rest.is_empty()
}

/// Ours: a whole number of milliseconds in 1..=a day, else Python's 400.
fn own_deadline(value: &[u8]) -> Result<u64, InvalidDeadline> {
    let text = strip_bytes(value);
    digits(text, 8)
        .filter(|ms| (1..=MAX_DEADLINE_MS).contains(ms))
        .ok_or_else(|| InvalidDeadline {
            shown: text[..text.len().min(40)].to_vec(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(headers: &[(&str, &str)]) -> Result<ClientSignals, InvalidDeadline> {
        read_signals(headers.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())))
    }

    fn signals(retries: Option<u32>, deadline_ms: Option<u64>) -> ClientSignals {
        ClientSignals {
            retries,
            deadline_ms,
        }
    }

    // The SDK's retry count and Envoy's attempt count: the larger; attempt 0 says nothing.
    #[test]
    fn retries() {
        assert_eq!(read(&[]), Ok(signals(None, None)));
        assert_eq!(
            read(&[("x-stainless-retry-count", " 2 ")]),
            Ok(signals(Some(2), None))
        );
        // `bytes.strip` takes the vertical tab too.
        let vertical = read(&[("x-stainless-retry-count", "\u{b}7\u{c}")]);
        assert_eq!(vertical, Ok(signals(Some(7), None)));
        let both = [
            ("x-stainless-retry-count", "1"),
            ("x-envoy-attempt-count", "4"),
        ];
        assert_eq!(read(&both), Ok(signals(Some(3), None)));
        assert_eq!(
            read(&[("x-envoy-attempt-count", "0")]),
            Ok(signals(None, None))
        );
        for junk in ["-1", "1.0", "", "12345678", "1000001", "+3", "٣"] {
            assert_eq!(
                read(&[("x-stainless-retry-count", junk)]),
                Ok(signals(None, None)),
                "{junk}"
            );
        }
        assert_eq!(
            read(&[("x-stainless-retry-count", "1000000")]),
            Ok(signals(Some(1_000_000), None))
        );
    }

    // Timeouts in seconds, rounded half to even; past a day, junk or non-ASCII ignored.
    #[test]
    fn timeouts() {
        let cases = [
            ("600.0", Some(600_000)),
            ("0.0005", None), // rounds to 0
            ("0.0015", Some(2)),
            ("0.0025", Some(2)),
            ("1e-3", Some(1)),
            ("-1", None),
            ("86401", None),
            ("é", None),
            ("0x10", None),
            ("5s", None),
            (",\"usage\":{", None),
        ];
        for (value, ms) in cases {
            let read = read(&[("x-stainless-timeout", value)]);
            assert_eq!(read, Ok(signals(None, ms)), "{value}");
        }
    }

    // The first timeout that parses; ours wins over it.
    #[test]
    fn deadlines() {
        let first = [
            ("x-stainless-timeout", "-1"),
            ("x-stainless-read-timeout", "2"),
            ("x-stainless-timeout", "3"),
        ];
        assert_eq!(read(&first), Ok(signals(None, Some(2_000))));
        let ours = [
            ("x-llmflow-deadline-ms", "1500"),
            ("x-stainless-timeout", "60"),
        ];
        assert_eq!(read(&ours), Ok(signals(None, Some(1_500))));
    }

    // Ours malformed is Python's 400, showing the stripped value's first 40 bytes.
    #[test]
    fn invalid_deadlines() {
        for bad in ["0", "abc", "1.5", "86400001", "123456789", ""] {
            let shown = bad.as_bytes().to_vec();
            let read = read(&[("x-llmflow-deadline-ms", bad)]);
            assert_eq!(read, Err(InvalidDeadline { shown }), "{bad}");
        }
        let long = read(&[("x-llmflow-deadline-ms", &format!(" {} ", "9".repeat(50)))]);
        let shown = "9".repeat(40).into_bytes();
        assert_eq!(long, Err(InvalidDeadline { shown }));
        let error = InvalidDeadline {
            shown: b"1'5\xe9".to_vec(),
        }
        .reply();
        assert_eq!(
            error.message,
            "x-llmflow-deadline-ms must be a whole number of milliseconds from 1 to 86400000 \
             (how long the client waits for the answer), got \"1'5\u{e9}\""
        );
        assert_eq!(
            (error.status, error.code.as_str()),
            (400, "invalid_deadline")
        );
        assert_eq!(error.param.as_deref(), Some("x-llmflow-deadline-ms"));
    }

    // What Python's float() takes beyond a plain decimal is read as it reads it.
    #[test]
    fn python_floats() {
        let cases = [
            ("1_0", Some(10_000)),
            ("1_0.2_5", Some(10_250)),
            ("\u{1c}5", None),
            ("5\u{1f}", None),
            ("+.5", Some(500)),
            ("5.", Some(5_000)),
            ("1E1", Some(10_000)),
            ("inf", None),
            ("-Infinity", None),
            ("nan", None),
            ("_1", None),
            ("1_", None),
            ("1__0", None),
            ("1_.5", None),
            ("1._5", None),
            ("1e_5", None),
            (".", None),
            ("1e", None),
            ("infinit", None),
            ("1 0", None),
            ("1e400", None),
        ];
        for (value, ms) in cases {
            let read = read(&[("x-stainless-timeout", value)]);
            assert_eq!(read, Ok(signals(None, ms)), "{value}");
        }
    }
}
