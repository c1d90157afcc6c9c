//! JSON as the Python path holds it: an ordered tree, and written byte for byte as Python's
//! `json.dumps` writes it.
//!
//! A client's body is read into this tree by `decode::read`, as `pydantic_core.from_json`
//! reads it. `parse` reads what comes from vLLM and the gateway's own templates with serde, in
//! the shape `json.loads` gives Python (objects in their order, an integer an integer, a float
//! a float), and declines what it cannot hold the same way: an integer beyond `i64`/`u64`
//! (serde would read it as a float, Python keeps it exact), `-0` (serde reads a float, Python
//! the int 0), and a key twice in one object. The writer follows CPython's encoder: its
//! escapes, `repr(float)`, `ensure_ascii` and `sort_keys`, so a frame or a body built here is
//! the one Python would send.

use std::fmt;
use std::io::Write as _;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

/// A JSON value as Python's `json.loads` gives it (an object keeps its keys' order).
#[derive(Debug, Clone, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    /// An integer literal (Python's `int`): `i64` and `u64` both fit.
    Int(i128),
    /// An integer past `i128` (a client's body only, `decode::read`), its decimal digits:
    /// Python keeps it exact, and writes it as it came.
    BigInt(String),
    /// A literal with a fraction or an exponent (Python's `float`), always finite.
    Float(f64),
    Str(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

impl Json {
    /// The value of `key` in an object (`None` for another type or a missing key).
    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Object(pairs) => pairs.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// Python's `bool(value)`.
    pub fn truthy(&self) -> bool {
        match self {
            Json::Null => false,
            Json::Bool(b) => *b,
            Json::Int(i) => *i != 0,
            Json::BigInt(_) => true,
            Json::Float(f) => *f != 0.0,
            Json::Str(s) => !s.is_empty(),
            Json::Array(a) => !a.is_empty(),
            Json::Object(o) => !o.is_empty(),
        }
    }
}

/// Read JSON from vLLM or a template, or `None` when it is not JSON or holds something this
/// tree would not hold as Python does (see the module's doc).
pub fn parse(raw: &[u8]) -> Option<Json> {
    if !plain_integers(raw) {
        return None;
    }
    serde_json::from_slice(raw).ok()
}

/// Whether every integer literal outside strings fits `i64`/`u64` and none is `-0`.
fn plain_integers(raw: &[u8]) -> bool {
    let mut i = 0;
    while i < raw.len() {
        match raw[i] {
            b'"' => {
                i += 1;
                while i < raw.len() && raw[i] != b'"' {
                    i += if raw[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            b'-' | b'0'..=b'9' => {
                let start = i;
                while i < raw.len()
                    && matches!(raw[i], b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E')
                {
                    i += 1;
                }
                let token = &raw[start..i];
                if !token.iter().any(|b| matches!(b, b'.' | b'e' | b'E')) && !exact(token) {
                    return false;
                }
            }
            _ => i += 1,
        }
    }
    true
}

/// Whether serde reads an integer literal as the integer Python reads: `-0` is a float to
/// serde, and one past `i64`/`u64` a float too.
fn exact(token: &[u8]) -> bool {
    if token == b"-0" {
        return false;
    }
    let digits = token.len() - usize::from(token[0] == b'-');
    digits <= 18 || {
        let text = std::str::from_utf8(token).unwrap_or("x");
        text.parse::<i64>().is_ok() || text.parse::<u64>().is_ok()
    }
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_bool<E>(self, v: bool) -> Result<Json, E> {
        Ok(Json::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Json, E> {
        Ok(Json::Int(i128::from(v)))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Json, E> {
        Ok(Json::Int(i128::from(v)))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Json, E> {
        Ok(Json::Float(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Json, E> {
        Ok(Json::Str(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Json, E> {
        Ok(Json::Str(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Json::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut pairs: Vec<(String, Json)> = Vec::new();
        while let Some((key, value)) = map.next_entry()? {
            pairs.push((key, value));
        }
        if has_duplicate(&pairs) {
            return Err(de::Error::custom("a key twice in one object"));
        }
        Ok(Json::Object(pairs))
    }
}

fn has_duplicate(pairs: &[(String, Json)]) -> bool {
    if pairs.len() <= 16 {
        return pairs
            .iter()
            .enumerate()
            .any(|(i, (k, _))| pairs[..i].iter().any(|(p, _)| p == k));
    }
    // Sorted, so a hostile object of thousands of keys costs n log n, not n squared.
    let mut keys: Vec<&str> = pairs.iter().map(|(k, _)| k.as_str()).collect();
    keys.sort_unstable();
    keys.windows(2).any(|w| w[0] == w[1])
}

/// How to write: `json.dumps`'s options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Style {
    /// `ensure_ascii`: every non-ASCII character (and DEL) as `\uXXXX`.
    pub ascii: bool,
    /// `sort_keys`: an object's keys in code point order.
    pub sort_keys: bool,
    /// `separators=(",", ":")`; else Python's default `(", ", ": ")`.
    pub compact: bool,
}

/// Append `value` as `json.dumps(value, ...)` writes it under `style`.
pub fn write(out: &mut Vec<u8>, value: &Json, style: Style) {
    let (comma, colon): (&[u8], &[u8]) = if style.compact {
        (b",", b":")
    } else {
        (b", ", b": ")
    };
    match value {
        Json::Null => out.extend_from_slice(b"null"),
        Json::Bool(true) => out.extend_from_slice(b"true"),
        Json::Bool(false) => out.extend_from_slice(b"false"),
        Json::Int(i) => write!(out, "{i}").expect("a Vec takes every write"),
        Json::BigInt(digits) => out.extend_from_slice(digits.as_bytes()),
        Json::Float(f) => write_float(out, *f),
        Json::Str(s) => write_str(out, s, style.ascii),
        Json::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.extend_from_slice(comma);
                }
                write(out, item, style);
            }
            out.push(b']');
        }
        Json::Object(pairs) => {
            let mut order: Vec<&(String, Json)> = pairs.iter().collect();
            if style.sort_keys {
                // UTF-8 byte order is code point order, which is how Python sorts `str` keys.
                order.sort_by(|a, b| a.0.cmp(&b.0));
            }
            out.push(b'{');
            for (i, (key, item)) in order.into_iter().enumerate() {
                if i > 0 {
                    out.extend_from_slice(comma);
                }
                write_str(out, key, style.ascii);
                out.extend_from_slice(colon);
                write(out, item, style);
            }
            out.push(b'}');
        }
    }
}

/// A string as CPython's encoder escapes it: `"`, `\`, the control characters (short forms
/// for `\b \f \n \r \t`), and with `ascii` everything outside `' '..='~'`, astral characters
/// as a surrogate pair, hex in lower case.
pub fn write_str(out: &mut Vec<u8>, s: &str, ascii: bool) {
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut plain = 0; // start of the run of bytes that need no escape
    let mut at = 0;
    while at < bytes.len() {
        let b = bytes[at];
        // The common case first: printable ASCII, or DEL and any UTF-8 byte when not `ascii`.
        if (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\' || (b >= 0x7f && !ascii) {
            at += 1;
            continue;
        }
        out.extend_from_slice(&bytes[plain..at]);
        let c = s[at..].chars().next().expect("a char starts here");
        let short: &[u8] = match c {
            '"' => b"\\\"",
            '\\' => b"\\\\",
            '\n' => b"\\n",
            '\r' => b"\\r",
            '\t' => b"\\t",
            '\u{8}' => b"\\b",
            '\u{c}' => b"\\f",
            _ => b"",
        };
        if short.is_empty() {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                write!(out, "\\u{unit:04x}").expect("a Vec takes every write");
            }
        } else {
            out.extend_from_slice(short);
        }
        at += c.len_utf8();
        plain = at;
    }
    out.extend_from_slice(&bytes[plain..]);
    out.push(b'"');
}

/// `repr(x)` of a finite float: the shortest digits that read back as `x` (Rust's formatter
/// finds the same ones), laid out as CPython does: positional while the decimal point falls
/// within 16 digits of the first (`1e16` is `1e+16`, `0.0001` stays), always with a fraction
/// or an exponent, the exponent signed and at least two digits.
pub fn write_float(out: &mut Vec<u8>, x: f64) {
    let sci = format!("{x:e}"); // e.g. "-1.25e-7", "0e0"
    let (mantissa, exponent) = sci.split_once('e').expect("`{:e}` writes an exponent");
    let (negative, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mantissa),
    };
    let digits: Vec<u8> = mantissa.bytes().filter(|b| *b != b'.').collect();
    let point = exponent
        .parse::<i32>()
        .expect("`{:e}` writes an integer exponent")
        + 1;
    if negative {
        out.push(b'-');
    }
    let n = digits.len() as i32;
    if point <= -4 || point > 16 {
        out.push(digits[0]);
        if n > 1 {
            out.push(b'.');
            out.extend_from_slice(&digits[1..]);
        }
        let e = point - 1;
        write!(out, "e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs())
            .expect("a Vec takes every write");
    } else if point <= 0 {
        out.extend_from_slice(b"0.");
        out.extend(std::iter::repeat_n(b'0', (-point) as usize));
        out.extend_from_slice(&digits);
    } else if point >= n {
        out.extend_from_slice(&digits);
        out.extend(std::iter::repeat_n(b'0', (point - n) as usize));
        out.extend_from_slice(b".0");
    } else {
        out.extend_from_slice(&digits[..point as usize]);
        out.push(b'.');
        out.extend_from_slice(&digits[point as usize..]);
    }
}

/// `value` written under `style`, as a new buffer.
pub fn to_vec(value: &Json, style: Style) -> Vec<u8> {
    let mut out = Vec::with_capacity(128);
    write(&mut out, value, style);
    out
}

#[cfg(test)]
mod tests;
