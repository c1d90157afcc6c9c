//! The JSON reader's and writer's unit tests: Python's values and bytes, case by case.
use super::*;

const COMPACT: Style = Style {
    ascii: true,
    sort_keys: false,
    compact: true,
};

fn float(x: f64) -> String {
    let mut out = Vec::new();
    write_float(&mut out, x);
    String::from_utf8(out).unwrap()
}

// Python's repr, case by case: positional within 16 digits, else a signed 2-digit exponent.
#[test]
fn floats_as_python_repr() {
    let cases = [
        (0.0, "0.0"),
        (-0.0, "-0.0"),
        (1.0, "1.0"),
        (0.1, "0.1"),
        (1e16, "1e+16"),
        (1e15, "1000000000000000.0"),
        (123_456_789_012_345_680.0, "1.2345678901234568e+17"),
        (0.0001, "0.0001"),
        (0.00001, "1e-05"),
        (1.5e-7, "1.5e-07"),
        (1e300, "1e+300"),
        (-2.5, "-2.5"),
        (5e-324, "5e-324"),
        (f64::MAX, "1.7976931348623157e+308"),
    ];
    for (x, repr) in cases {
        assert_eq!(float(x), repr, "{x}");
    }
}

// Escapes as CPython's: short forms, \u00XX for other controls, DEL and non-ASCII only in
// ascii mode, astral characters as a surrogate pair.
#[test]
fn strings_as_python_escapes() {
    let s = "a\"\\\n\r\t\u{8}\u{c}\u{1}\u{7f}é😀";
    let mut ascii = Vec::new();
    write_str(&mut ascii, s, true);
    assert_eq!(
        String::from_utf8(ascii).unwrap(),
        r#""a\"\\\n\r\t\b\f\u0001\u007f\u00e9\ud83d\ude00""#
    );
    let mut raw = Vec::new();
    write_str(&mut raw, s, false);
    assert_eq!(
        String::from_utf8(raw).unwrap(),
        "\"a\\\"\\\\\\n\\r\\t\\b\\f\\u0001\u{7f}é😀\""
    );
}

// Order is kept, ints stay ints, floats floats; sort_keys and the default separators.
#[test]
fn round_trip_keeps_order_and_types() {
    let value = parse(br#"{"b": 1, "a": [1.0, -2, "x", null, true], "c": {}}"#).unwrap();
    assert_eq!(
        to_vec(&value, COMPACT),
        br#"{"b":1,"a":[1.0,-2,"x",null,true],"c":{}}"#
    );
    let sorted = Style {
        sort_keys: true,
        compact: false,
        ..COMPACT
    };
    assert_eq!(
        to_vec(&value, sorted),
        br#"{"a": [1.0, -2, "x", null, true], "b": 1, "c": {}}"#
    );
}

// What Python would hold otherwise (a big int, -0, a duplicate key) or not at all is refused.
#[test]
fn declines_what_python_holds_differently() {
    assert!(parse(b"{\"a\": 123456789012345678}").is_some());
    assert!(parse(b"{\"a\": 1234567890123456789}").is_some());
    assert!(parse(b"{\"a\": 18446744073709551615, \"b\": -9223372036854775808}").is_some());
    assert!(parse(b"{\"a\": 18446744073709551616}").is_none());
    assert!(parse(b"{\"a\": -9223372036854775809}").is_none());
    assert!(parse(b"{\"a\": -0}").is_none());
    assert!(parse(b"{\"a\": -0.0}").is_some());
    assert!(parse(b"{\"s\": \"-0 12345678901234567890\"}").is_some());
    assert!(parse(b"{\"a\": 1, \"a\": 2}").is_none());
    assert!(parse(b"{\"a\": 1e400}").is_none());
    assert!(parse(b"{\"a\": NaN}").is_none());
    assert!(parse(b"{\"a\": \"\\ud800\"}").is_none());
    assert!(parse(b"{\"a\": \"\xff\"}").is_none());
    assert!(parse(b"{\"a\": 1} x").is_none());
    let many: String = (0..40)
        .map(|i| format!("\"k{}\":0,", i % 39))
        .collect::<Vec<_>>()
        .concat();
    assert!(parse(format!("{{{many}\"z\":0}}").as_bytes()).is_none());
}

// Python's truthiness, used where the gateway reads a raw field with `bool(...)`.
#[test]
fn truthiness() {
    let falsy = parse(br#"[null, false, 0, 0.0, "", [], {}]"#).unwrap();
    let truthy = parse(br#"[true, 1, 0.5, "0", [0], {"a": 0}]"#).unwrap();
    let (Json::Array(f), Json::Array(t)) = (falsy, truthy) else {
        panic!()
    };
    assert!(f.iter().all(|v| !v.truthy()) && t.iter().all(Json::truthy));
}
