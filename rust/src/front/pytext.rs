//! Python's ways with a client's text, where the front must match the app's: `repr`, as the
//! app's error messages show input (the 400s of `invalid.rs`, `serving._invalid`; the 415's
//! encoding and the deadline's 400, header bytes read as latin-1, as Starlette decodes them),
//! and `strip`, of bytes and of latin-1 text.

use super::printable::is_printable;

/// `repr(str)`: single quotes unless it holds one and no double quote, the escapes of `\\`,
/// the quote and `\t \n \r`, and every character Python does not print as it is written
/// `\xhh`, `\uhhhh` or `\Uhhhhhhhh` by its size.
pub fn repr_str(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if is_printable(c) => out.push(c),
            c => {
                let code = u32::from(c);
                let escape = match code {
                    0..=0xff => format!("\\x{code:02x}"),
                    0x100..=0xffff => format!("\\u{code:04x}"),
                    _ => format!("\\U{code:08x}"),
                };
                out.push_str(&escape);
            }
        }
    }
    out.push(quote);
    out
}

/// `repr()` of header bytes decoded as latin-1 (each byte the code point of its value).
pub fn repr_latin1(text: &[u8]) -> String {
    repr_str(&text.iter().map(|&b| char::from(b)).collect::<String>())
}

/// `bytes.strip()`: ASCII whitespace, `\x0b` included (which `trim_ascii` keeps).
pub fn strip_bytes(value: &[u8]) -> &[u8] {
    strip_where(value, |b| {
        matches!(b, b' ' | b'\t' | b'\n' | b'\r' | b'\x0b' | b'\x0c')
    })
}

/// `str.strip()` of latin-1 text: the characters `str.isspace` holds (`\t`..`\r`, the
/// separators `\x1c`..`\x1f`, space, NEL `\x85`, NBSP `\xa0`).
pub fn strip_latin1(text: &[u8]) -> &[u8] {
    strip_where(
        text,
        |b| matches!(b, 0x09..=0x0d | 0x1c..=0x20 | 0x85 | 0xa0),
    )
}

fn strip_where(text: &[u8], space: impl Fn(u8) -> bool) -> &[u8] {
    let start = text.iter().position(|&b| !space(b)).unwrap_or(text.len());
    let end = text
        .iter()
        .rposition(|&b| !space(b))
        .map_or(start, |i| i + 1);
    &text[start..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    // Printable characters as they are, others escaped by their size, the quote chosen by
    // what the text holds; latin-1's controls, its C1 block, NBSP and the soft hyphen escaped.
    #[test]
    fn text_as_python_repr() {
        for (text, shown) in [
            ("é😀", "'é😀'"),
            ("\u{a0}\u{ad}\u{7f}", r"'\xa0\xad\x7f'"),
            ("\u{200b}\u{2028}", r"'\u200b\u2028'"),
            ("\u{e0001}\u{10ffff}", r"'\U000e0001\U0010ffff'"),
            ("it's", r#""it's""#),
            ("'\"", r#"'\'"'"#),
            ("a\\b\t\n\r", r"'a\\b\t\n\r'"),
        ] {
            assert_eq!(repr_str(text), shown, "{text:?}");
        }
        assert_eq!(
            repr_latin1(b"gz\x85\xa0\xad\xe9\x01"),
            r"'gz\x85\xa0\xad\xe9\x01'".replace("\\xe9", "é")
        );
    }

    // `bytes.strip` and `str.strip` of latin-1: which bytes each takes for space.
    #[test]
    fn strips() {
        assert_eq!(strip_bytes(b"\x0b 1 \x0c"), b"1");
        assert_eq!(strip_bytes(b"\x1c1\xa0"), b"\x1c1\xa0");
        assert_eq!(strip_latin1(b"\x1c\x85 k \xa0"), b"k");
        assert_eq!(strip_latin1(b"  "), b"");
    }

    // Python's `repr` quotes and escapes.
    #[test]
    fn latin1_reprs() {
        assert_eq!(repr_latin1(b"a'b"), "\"a'b\"");
        assert_eq!(repr_latin1(b"a'\"b"), "'a\\'\"b'");
        assert_eq!(
            repr_latin1(b"\\\t\x00\x7f\xad\xff"),
            "'\\\\\\t\\x00\\x7f\\xad\u{ff}'"
        );
    }
}
