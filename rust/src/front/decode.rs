//! `decode_json`: a client's body read as pydantic-core's `from_json` reads it, into the tree
//! the checks walk, or its 400 worded once for both paths. The front answers the refusals
//! natively; Python's `protocol.decode_json` asks for the same message (`_core.json_refusal`)
//! whenever its own parse refuses a body, so the line and column are this jiter's on both,
//! whichever jiter the installed pydantic-core runs (they differ between versions on where an
//! invalid UTF-8 byte is).
//!
//! The body is walked with jiter as pydantic-core's Python builder walks it
//! (`jiter/src/python.rs`: the same calls, the same recursion limit) and built as Python holds
//! it: an integer exact however long (`Json::BigInt` past `i128`), `-0` the int 0, a key twice
//! in one object at its first place with its last value (`PyDict_SetItem`). A float that
//! overflows to infinity is refused, as `decode_json` refuses it.

use jiter::{Jiter, JiterErrorType, JsonErrorType, LinePosition, NumberAny, NumberInt, Peek};

use super::json::Json;

/// The nesting a body may have: jiter's recursion limit (`DEFAULT_RECURSION_LIMIT`).
const MAX_DEPTH: u8 = 200;
/// Objects with more keys than this find a repeated key through an index, not a scan.
const SCAN_KEYS: usize = 16;
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

/// A body read: the object Python takes, or the message of `decode_json`'s 400.
pub fn read(raw: &[u8]) -> Result<Json, String> {
    let mut walk = Walk {
        jiter: Jiter::new(raw),
        depth_left: MAX_DEPTH,
        infinite: false,
    };
    let top = match walk.document() {
        Ok(top) => top,
        Err((error, index)) => return Err(not_json(raw, &error, index)),
    };
    if !matches!(top, Json::Object(_)) {
        return Err(format!(
            "request body must be a JSON object ({{...}}), got {}",
            type_name(&top)
        ));
    }
    if walk.infinite {
        return Err(
            "a number in the request body is too large for a float (it would be Infinity); \
             send a finite number"
                .to_owned(),
        );
    }
    Ok(top)
}

/// What `decode_json` says of a body: `Some(message)` of its 400 (`invalid_json`), or `None`
/// where Python takes the body.
pub fn refusal(raw: &[u8]) -> Option<String> {
    read(raw).err()
}

/// Python's name of a value's type, as `decode_json` says it (`None`'s as `null`).
fn type_name(value: &Json) -> &'static str {
    match value {
        Json::Null => "null",
        Json::Bool(_) => "bool",
        Json::Int(_) | Json::BigInt(_) => "int",
        Json::Float(_) => "float",
        Json::Str(_) => "str",
        Json::Array(_) => "list",
        Json::Object(_) => "dict",
    }
}

/// A walk of the document as `PythonParser` takes it, noting whether a float is infinite.
struct Walk<'j> {
    jiter: Jiter<'j>,
    depth_left: u8,
    infinite: bool,
}

/// jiter's error: its message (`JsonErrorType`'s) and the byte it points at.
type Failure = (String, usize);

impl Walk<'_> {
    /// `PythonParser::parse`: one value, then nothing but whitespace.
    fn document(&mut self) -> Result<Json, Failure> {
        let peek = self.jiter.peek().map_err(failure)?;
        let value = self.value(peek)?;
        self.jiter.finish().map_err(failure)?;
        Ok(value)
    }

    /// `py_take_value`.
    fn value(&mut self, peek: Peek) -> Result<Json, Failure> {
        match peek {
            Peek::Null => self.jiter.known_null().map(|()| Json::Null),
            Peek::True | Peek::False => self.jiter.known_bool(peek).map(Json::Bool),
            Peek::String => self.jiter.known_str().map(|s| Json::Str(s.to_owned())),
            Peek::Array => {
                let mut items = Vec::new();
                if let Some(mut next) = self.jiter.known_array().map_err(failure)? {
                    loop {
                        items.push(self.nested(next)?);
                        match self.jiter.array_step().map_err(failure)? {
                            Some(peek) => next = peek,
                            None => break,
                        }
                    }
                }
                return Ok(Json::Array(items));
            }
            Peek::Object => {
                let mut object = Object::default();
                let mut key = self
                    .jiter
                    .known_object()
                    .map_err(failure)?
                    .map(str::to_owned);
                while let Some(name) = key {
                    let peek = self.jiter.peek().map_err(failure)?;
                    let value = self.nested(peek)?;
                    object.set(name, value);
                    key = self.jiter.next_key().map_err(failure)?.map(str::to_owned);
                }
                return Ok(Json::Object(object.pairs));
            }
            // `ParseNumberLossy`: what is not a number there is jiter's "expected value"
            // (`known_number` maps it alike).
            _ => self.jiter.known_number(peek).map(|n| match n {
                NumberAny::Int(NumberInt::Int(i)) => Json::Int(i128::from(i)),
                NumberAny::Int(NumberInt::BigInt(big)) => {
                    let digits = big.to_string();
                    digits.parse().map_or(Json::BigInt(digits), Json::Int)
                }
                NumberAny::Float(x) => {
                    self.infinite |= !x.is_finite();
                    Json::Float(x)
                }
            }),
        }
        .map_err(failure)
    }

    /// `check_take_value`: a value inside an array or object, within the recursion limit.
    fn nested(&mut self, peek: Peek) -> Result<Json, Failure> {
        let Some(left) = self.depth_left.checked_sub(1) else {
            let error = JsonErrorType::RecursionLimitExceeded.to_string();
            return Err((error, self.jiter.current_index()));
        };
        self.depth_left = left;
        let taken = self.value(peek);
        self.depth_left += 1;
        taken
    }
}

/// An object as a Python dict fills: a key seen again keeps its place and takes the new value.
#[derive(Default)]
struct Object {
    pairs: Vec<(String, Json)>,
    /// Each key's place, once the object is too large to scan.
    index: Option<std::collections::HashMap<String, usize>>,
}

impl Object {
    fn set(&mut self, key: String, value: Json) {
        let at = match &mut self.index {
            Some(index) => index.get(&key).copied(),
            None => self.pairs.iter().position(|(k, _)| *k == key),
        };
        if let Some(at) = at {
            self.pairs[at].1 = value;
            return;
        }
        if let Some(index) = &mut self.index {
            index.insert(key.clone(), self.pairs.len());
        } else if self.pairs.len() == SCAN_KEYS {
            let index = self.pairs.iter().enumerate();
            self.index = Some(index.map(|(i, (k, _))| (k.clone(), i)).collect());
            self.index
                .as_mut()
                .expect("just made")
                .insert(key.clone(), self.pairs.len());
        }
        self.pairs.push((key, value));
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
        // However it is written: 250 digits with a 2-digit exponent overflow too.
        let sly = [b"{\"x\": ".to_vec(), vec![b'9'; 250], b"e99}".to_vec()].concat();
        assert!(refusal(&sly).is_some_and(|m| m.contains("too large for a float")));
        for taken in [
            &b"{\"a\": 1, \"a\": 2}"[..],
            b"{\"x\": -0}",
            b"{\"x\": 123456789012345678901234567890}",
        ] {
            assert_eq!(refusal(taken), None);
        }
    }

    // Built as Python holds it: a key again keeps its place with the last value (also past
    // the scan's size), `-0` is the int 0, an integer past i128 keeps its digits.
    #[test]
    fn built_as_python_holds_it() {
        let pairs = |raw: &[u8]| match read(raw).unwrap() {
            Json::Object(pairs) => pairs,
            other => panic!("{other:?}"),
        };
        let got = pairs(
            br#"{"a": 1, "b": -0, "a": [2], "c": 123456789012345678901234567890123456789012}"#,
        );
        assert_eq!(
            got,
            vec![
                ("a".to_owned(), Json::Array(vec![Json::Int(2)])),
                ("b".to_owned(), Json::Int(0)),
                (
                    "c".to_owned(),
                    Json::BigInt("123456789012345678901234567890123456789012".to_owned())
                ),
            ]
        );
        let many: Vec<String> = (0..40).map(|i| format!("\"k{}\": {i}", i % 20)).collect();
        let got = pairs(format!("{{{}}}", many.join(",")).as_bytes());
        assert_eq!(got.len(), 20);
        assert_eq!(got[3], ("k3".to_owned(), Json::Int(23)));
        assert_eq!(got[19], ("k19".to_owned(), Json::Int(39)));
    }
}
