//! Python's `repr` of text, as the app's error messages show a client's input: the 400s of
//! `invalid.rs` (`serving._invalid`), the 415's encoding and the deadline's 400 (header bytes
//! read as latin-1, as Starlette decodes them).

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
