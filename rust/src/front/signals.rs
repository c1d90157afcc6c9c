//! `read_signals` (`gateway/signals.py`): what a request's headers say of its client, the
//! retries it made and how long it waits, for the runtime's `arrive`.
//!
//! The same reading as Python's: the SDKs' retry count and Envoy's attempt count (the larger),
//! the SDKs' timeout in seconds (the first that parses), and ours, `x-llmflow-deadline-ms`,
//! which wins. A header we do not own that does not parse is ignored. Ours, malformed, is
//! Python's 400: `Unsure`, and the front passes the request to the app to answer it. So is a
//! timeout this reading cannot be sure of (Python's `float()` takes `1_0`, `inf`, and
//! separators `str.strip` removes; those are for the app to read).

/// What a request's client said of it (`None`: nothing, or nothing usable).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ClientSignals {
    /// Retries it made before this attempt.
    pub retries: Option<u32>,
    /// How long after sending it gives up waiting.
    pub deadline_ms: Option<u64>,
}

/// The headers cannot be read as Python reads them here: the app answers the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unsure;

const DEADLINE: &[u8] = b"x-llmflow-deadline-ms"; // ours: ms the client waits, from sending
const RETRY_COUNT: &[u8] = b"x-stainless-retry-count"; // SDKs: retries before this one
const ATTEMPT_COUNT: &[u8] = b"x-envoy-attempt-count"; // Envoy: this attempt's number, from 1
const TIMEOUTS: [&[u8]; 2] = [b"x-stainless-timeout", b"x-stainless-read-timeout"]; // seconds
const MAX_COUNT: u32 = 1_000_000; // a larger count is no SDK's or proxy's: ignored
const MAX_DEADLINE_MS: u64 = 86_400_000; // a day; a longer wait is no deadline: ignored

/// The signals in a request's headers (lower-case names, raw values), in their order.
pub fn read_signals<'a>(
    headers: impl IntoIterator<Item = (&'a [u8], &'a [u8])>,
) -> Result<ClientSignals, Unsure> {
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
                timeout_ms = seconds_ms(value)?;
            }
        } else if name == DEADLINE {
            deadline_ms = Some(own_deadline(value).ok_or(Unsure)?);
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

/// `bytes.strip()`: ASCII whitespace, `\x0b` included (which `trim_ascii` keeps).
fn strip(value: &[u8]) -> &[u8] {
    let space = |b: &u8| matches!(b, b' ' | b'\t' | b'\n' | b'\r' | b'\x0b' | b'\x0c');
    let start = value.iter().position(|b| !space(b)).unwrap_or(value.len());
    let end = value
        .iter()
        .rposition(|b| !space(b))
        .map_or(start, |i| i + 1);
    &value[start..end]
}

/// Digits only, at most `max_len` of them: the number, else `None`.
fn digits(text: &[u8], max_len: usize) -> Option<u64> {
    if text.is_empty() || text.len() > max_len || !text.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(text).ok()?.parse().ok()
}

fn count(value: &[u8]) -> Option<u32> {
    digits(strip(value), 7)
        .and_then(|n| u32::try_from(n).ok())
        .filter(|n| *n <= MAX_COUNT)
}

/// A timeout in seconds as milliseconds, `Ok(None)` when Python ignores it, `Unsure` when
/// the text is not a plain decimal (Python's `float()` may or may not take it).
fn seconds_ms(value: &[u8]) -> Result<Option<u64>, Unsure> {
    let text = strip(value);
    if text.is_empty() || !text.is_ascii() {
        return Ok(None); // Python's `decode("ascii")` or `float("")` fails: ignored
    }
    if !decimal(text) {
        // What no `float()` text holds (its digits, signs, point, exponent, `_`, spaces and
        // the letters of inf, infinity and nan) is surely ignored; the rest is unsure.
        let floaty =
            |b: &u8| b"0123456789+-.eE_ \t\n\r\x0b\x0c\x1c\x1d\x1e\x1finfatyINFATY".contains(b);
        return if text.iter().all(floaty) {
            Err(Unsure)
        } else {
            Ok(None)
        };
    }
    let seconds: f64 = std::str::from_utf8(text)
        .ok()
        .and_then(|t| t.parse().ok())
        .ok_or(Unsure)?;
    if !seconds.is_finite() || seconds <= 0.0 {
        return Ok(None);
    }
    // Python's `round()`: half to even; past a day (or past any integer) it is ignored.
    let ms = (seconds * 1000.0).round_ties_even();
    Ok((ms > 0.0 && ms <= MAX_DEADLINE_MS as f64).then_some(ms as u64))
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
fn own_deadline(value: &[u8]) -> Option<u64> {
    digits(strip(value), 8).filter(|ms| (1..=MAX_DEADLINE_MS).contains(ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(headers: &[(&str, &str)]) -> Result<ClientSignals, Unsure> {
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

    // Ours malformed is Python's 400; a timeout Python's float() may read otherwise, unsure.
    #[test]
    fn unsure() {
        for bad in ["0", "abc", "1.5", "86400001", "123456789", ""] {
            assert_eq!(
                read(&[("x-llmflow-deadline-ms", bad)]),
                Err(Unsure),
                "{bad}"
            );
        }
        for odd in ["1_0", "inf", "nan", "\u{1c}5", "Infinity", "."] {
            assert_eq!(read(&[("x-stainless-timeout", odd)]), Err(Unsure), "{odd}");
        }
    }
}
