//! The first of pydantic's errors for a body the request models refuse, as
//! `serving._invalid` words it: `{field}: {pydantic's message} (got {repr(input):.80})`.
//!
//! Only the common cases, each read as pydantic reads it: a required field missing, a
//! top-level field of the wrong type or past its bound, a prompt of no shape the union takes,
//! a chat message that is no object, has no role or content of no shape, `stop` of no shape,
//! `stream_options` no object or with a flag that is not a boolean.
//! pydantic validates the fields in the model's order, so the first error is the first field
//! that fails; this walks them in that order and names an error only when every field
//! before it is sure to pass and the failing one is sure to fail so. Text is shown as Python's
//! `repr` shows it, with the printable characters of Python's Unicode tables (`printable.rs`).

use super::json::{self, Json, Style};
use super::prepare::Endpoint;
use super::pytext::repr_str;
use super::request::MAX_INT;

/// The fields of `ChatCompletionRequest` / `CompletionRequest`, in pydantic's order (a
/// subclass's field keeps its base's place).
const CHAT: [&str; 12] = [
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "user",
    "messages",
    "max_completion_tokens",
    "n",
];
const COMPLETIONS: [&str; 12] = [
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "user",
    "prompt",
    "n",
    "echo",
];
/// `serving._PROMPT_SHAPES`: a union's first error ("should be a valid string") would mislead.
const PROMPT_SHAPES: &str =
    "send text, or token ids (integers from 0 to 2147483647), or a list of one of either";

/// What pydantic makes of one field.
enum Field<'a> {
    Valid,
    /// Its message, and the input it names (none for a missing field).
    Invalid(String, Option<&'a Json>),
    /// An error inside it: the path below the field (`.0.role`), the message, the input.
    Inside(String, String, Option<&'a Json>),
    Unsure,
}

/// `_invalid`'s message and param for the first error pydantic raises on `body` (an
/// object), or None: the body passes, or this reading is unsure of the first error.
pub fn first_error(endpoint: Endpoint, body: &Json) -> Option<(String, String)> {
    let fields = match endpoint {
        Endpoint::Chat => CHAT,
        Endpoint::Completions => COMPLETIONS,
        Endpoint::Responses => return None, // `responses::first_error`
    };
    for name in fields {
        match field(endpoint, name, body.get(name)) {
            Field::Valid => {}
            Field::Unsure => return None,
            Field::Invalid(message, input) => {
                return Some(worded(name.to_owned(), &message, input))
            }
            Field::Inside(path, message, input) => {
                return Some(worded(format!("{name}{path}"), &message, input));
            }
        }
    }
    None
}

/// `_invalid`: `{param}: {message} (got {repr(input):.80})`, and the param.
fn worded(param: String, message: &str, input: Option<&Json>) -> (String, String) {
    let got = match input {
        None => String::new(),
        Some(value) => format!(" (got {})", truncated(&repr(value), 80)),
    };
    (format!("{param}: {message}{got}"), param)
}

fn field<'a>(endpoint: Endpoint, name: &str, value: Option<&'a Json>) -> Field<'a> {
    let Some(value) = value else {
        let required = matches!(name, "model" | "messages" | "prompt");
        return if required {
            Field::Invalid("Field required".to_owned(), None)
        } else {
            Field::Valid
        };
    };
    let least_tokens = i128::from(endpoint == Endpoint::Chat); // chat's bound is 1, completions' 0
    match name {
        "model" => match value {
            Json::Str(s) if s.is_empty() => {
                invalid("String should have at least 1 character", value)
            }
            Json::Str(_) => Field::Valid,
            _ => invalid("Input should be a valid string", value),
        },
        "stream" | "echo" => nullable(value, |v| match v {
            Json::Bool(_) => Field::Valid,
            _ => invalid("Input should be a valid boolean", v),
        }),
        "max_tokens" => nullable(value, |v| int(v, least_tokens)),
        "max_completion_tokens" => nullable(value, |v| int(v, 1)),
        "n" if endpoint == Endpoint::Chat => nullable(value, |v| int(v, 1)),
        "n" => int(value, 1), // not nullable in `CompletionRequest`
        "seed" => nullable(value, |v| match v {
            Json::Int(_) | Json::BigInt(_) => Field::Valid,
            _ => invalid("Input should be a valid integer", v),
        }),
        "temperature" => nullable(value, |v| {
            number(v, |x| (x >= 0.0, "greater than or equal to 0"))
        }),
        "top_p" => nullable(value, |v| {
            number(v, |x| {
                if x > 0.0 {
                    (x <= 1.0, "less than or equal to 1")
                } else {
                    (false, "greater than 0")
                }
            })
        }),
        "user" => nullable(value, |v| match v {
            Json::Str(_) => Field::Valid,
            _ => invalid("Input should be a valid string", v),
        }),
        "messages" => match value {
            Json::Array(items) if items.is_empty() => invalid(
                "List should have at least 1 item after validation, not 0",
                value,
            ),
            Json::Array(items) => items
                .iter()
                .enumerate()
                .find_map(|(i, item)| chat_message(i, item))
                .unwrap_or(Field::Valid),
            _ => invalid("Input should be a valid list", value),
        },
        "prompt" => prompt(value),
        // `str | list[str] (at most 4) | None`: no shape is the union's first member's error.
        "stop" => nullable(value, |v| match v {
            Json::Str(_) => Field::Valid,
            Json::Array(items)
                if items.len() <= 4 && items.iter().all(|s| matches!(s, Json::Str(_))) =>
            {
                Field::Valid
            }
            _ => invalid("Input should be a valid string", v),
        }),
        "stream_options" => nullable(value, stream_options),
        _ => Field::Unsure,
    }
}

/// `StreamOptions`: an object whose two flags are `bool | None` (in that order).
fn stream_options(value: &Json) -> Field<'_> {
    if !matches!(value, Json::Object(_)) {
        let message = "Input should be a valid dictionary or instance of StreamOptions";
        return invalid(message, value);
    }
    for key in ["include_usage", "continuous_usage_stats"] {
        match value.get(key) {
            None | Some(Json::Null | Json::Bool(_)) => {}
            Some(flag) => {
                let message = "Input should be a valid boolean".to_owned();
                return Field::Inside(format!(".{key}"), message, Some(flag));
            }
        }
    }
    Field::Valid
}

/// The first error of message `i` (`ChatMessage`: a role, and content none, text or typed
/// parts), or None when it passes. Content of no shape is the union's first member's error.
fn chat_message(i: usize, value: &Json) -> Option<Field<'_>> {
    const DICT: &str = "Input should be a valid dictionary or instance of ChatMessage";
    const STRING: &str = "Input should be a valid string";
    if !matches!(value, Json::Object(_)) {
        return Some(Field::Inside(format!(".{i}"), DICT.to_owned(), Some(value)));
    }
    let at = |key: &str, message: &str, input| {
        Some(Field::Inside(
            format!(".{i}.{key}"),
            message.to_owned(),
            input,
        ))
    };
    match value.get("role") {
        None => return at("role", "Field required", None),
        Some(Json::Str(_)) => {}
        Some(role) => return at("role", STRING, Some(role)),
    }
    match value.get("content") {
        None | Some(Json::Null | Json::Str(_)) => None,
        Some(Json::Array(parts)) if parts.iter().all(|p| matches!(p, Json::Object(_))) => None,
        Some(content) => at("content", STRING, Some(content)),
    }
}

fn invalid<'a>(message: &str, input: &'a Json) -> Field<'a> {
    Field::Invalid(message.to_owned(), Some(input))
}

/// `X | None`: null passes.
fn nullable<'a>(value: &'a Json, check: impl FnOnce(&'a Json) -> Field<'a>) -> Field<'a> {
    if *value == Json::Null {
        Field::Valid
    } else {
        check(value)
    }
}

/// A strict `int` with `Field(ge=least, le=MAX_INT)`.
fn int(value: &Json, least: i128) -> Field<'_> {
    match value {
        Json::Int(i) if *i < least => Field::Invalid(
            format!("Input should be greater than or equal to {least}"),
            Some(value),
        ),
        Json::Int(i) if *i > MAX_INT => {
            invalid("Input should be less than or equal to 2147483647", value)
        }
        Json::Int(_) => Field::Valid,
        Json::BigInt(digits) if digits.starts_with('-') => Field::Invalid(
            format!("Input should be greater than or equal to {least}"),
            Some(value),
        ),
        Json::BigInt(_) => invalid("Input should be less than or equal to 2147483647", value),
        _ => invalid("Input should be a valid integer", value),
    }
}

/// A strict `float` (an int is one) within the bound `within` names when it fails.
fn number(value: &Json, within: impl Fn(f64) -> (bool, &'static str)) -> Field<'_> {
    let Some(x) = super::request::float(value) else {
        return invalid("Input should be a valid number", value);
    };
    match within(x) {
        (true, _) => Field::Valid,
        (false, bound) => Field::Invalid(format!("Input should be {bound}"), Some(value)),
    }
}

/// `str | list[TokenId] | list[str] | list[list[TokenId]]`: a value none of them takes is
/// `_invalid`'s prompt message (with the union's first error's input, the whole value).
fn prompt(value: &Json) -> Field<'_> {
    let id = |v: &Json| matches!(v, Json::Int(i) if (0..=MAX_INT).contains(i));
    let ids = |v: &Json| matches!(v, Json::Array(items) if items.iter().all(id));
    let taken = match value {
        Json::Str(_) => true,
        Json::Array(items) => {
            items.iter().all(id)
                || items.iter().all(|v| matches!(v, Json::Str(_)))
                || items.iter().all(ids)
        }
        _ => false,
    };
    if taken {
        Field::Valid
    } else {
        invalid(PROMPT_SHAPES, value)
    }
}

/// Python's `repr` of a value as `json.loads` gives it.
fn repr(value: &Json) -> String {
    match value {
        Json::Null => "None".to_owned(),
        Json::Bool(true) => "True".to_owned(),
        Json::Bool(false) => "False".to_owned(),
        Json::Int(i) => i.to_string(),
        Json::BigInt(digits) => digits.clone(),
        Json::Float(x) => {
            let mut out = Vec::new();
            json::write(&mut out, &Json::Float(*x), PLAIN);
            String::from_utf8(out).expect("a float is written in ASCII")
        }
        Json::Str(s) => repr_str(s),
        Json::Array(items) => {
            let items: Vec<String> = items.iter().map(repr).collect();
            format!("[{}]", items.join(", "))
        }
        Json::Object(pairs) => {
            let pairs: Vec<String> = pairs
                .iter()
                .map(|(k, v)| format!("{}: {}", repr_str(k), repr(v)))
                .collect();
            format!("{{{}}}", pairs.join(", "))
        }
    }
}

const PLAIN: Style = Style {
    ascii: true,
    sort_keys: false,
    compact: true,
};

/// `f"{text:.80}"`: the first `n` characters.
fn truncated(text: &str, n: usize) -> &str {
    text.char_indices()
        .nth(n)
        .map_or(text, |(end, _)| &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::front::decode::read;

    fn first(endpoint: Endpoint, text: &str) -> Option<(String, String)> {
        first_error(endpoint, &read(text.as_bytes()).unwrap())
    }

    // The first failing field in pydantic's order, worded as `_invalid` words it.
    #[test]
    fn first_errors() {
        let chat = |t| first(Endpoint::Chat, t).map(|(m, _)| m);
        assert_eq!(
            chat(r#"{"messages":[],"model":"m","temperature":"x"}"#).as_deref(),
            Some("temperature: Input should be a valid number (got 'x')")
        );
        assert_eq!(
            chat(r#"{"top_p":0}"#).as_deref(),
            Some("model: Field required")
        );
        assert_eq!(
            chat(r#"{"model":"m","messages":"it's"}"#).as_deref(),
            Some(r#"messages: Input should be a valid list (got "it's")"#)
        );
        assert_eq!(
            chat(r#"{"model":"m","messages":[{"role":"u"}],"n":0}"#).as_deref(),
            Some("n: Input should be greater than or equal to 1 (got 0)")
        );
        assert_eq!(
            first(
                Endpoint::Chat,
                r#"{"model":"m","n":0,"messages":[{"role":"u"},{"role":1,"content":5}]}"#
            ),
            Some((
                "messages.1.role: Input should be a valid string (got 1)".to_owned(),
                "messages.1.role".to_owned()
            ))
        );
        assert_eq!(
            chat(r#"{"model":"m","messages":[{"role":"u","content":[{"a":1}, 3]}]}"#).as_deref(),
            Some("messages.0.content: Input should be a valid string (got [{'a': 1}, 3])")
        );
        assert_eq!(
            chat(r#"{"model":"m","messages":[null]}"#).as_deref(),
            Some(
                "messages.0: Input should be a valid dictionary or instance of ChatMessage \
                 (got None)"
            )
        );
        assert_eq!(
            chat(r#"{"model":"m","messages":[],"stop":["a",1]}"#).as_deref(),
            Some("stop: Input should be a valid string (got ['a', 1])")
        );
        assert_eq!(
            first(
                Endpoint::Chat,
                r#"{"model":"m","stream_options":{"continuous_usage_stats":"x","include_usage":2}}"#
            ),
            Some((
                "stream_options.include_usage: Input should be a valid boolean (got 2)".to_owned(),
                "stream_options.include_usage".to_owned()
            ))
        );
        let completions = |t| first(Endpoint::Completions, t).map(|(m, _)| m);
        assert_eq!(
            completions(r#"{"model":"m","prompt":[1,"a",{"k":[null,true,1.5]}]}"#).as_deref(),
            Some(
                "prompt: send text, or token ids (integers from 0 to 2147483647), or a list of \
                 one of either (got [1, 'a', {'k': [None, True, 1.5]}])"
            )
        );
        assert_eq!(
            completions(r#"{"model":"m","prompt":"a","n":null}"#).as_deref(),
            Some("n: Input should be a valid integer (got None)")
        );
    }

    // Valid bodies, nested errors and non-ASCII inputs name no error.
    #[test]
    fn unsure_or_valid() {
        let text = r#"{"model":"m","messages":[{"role":"u"}]}"#;
        assert_eq!(first(Endpoint::Chat, text), None, "{text}");
    }

    // Text shown as Python's `repr` shows it (`pytext.rs`).
    #[test]
    fn non_ascii_input() {
        let body = r#"{"model":"é","stream":"é","messages":[]}"#;
        let (message, _) = first(Endpoint::Chat, body).unwrap();
        assert_eq!(message, "stream: Input should be a valid boolean (got 'é')");
    }

    // Integers past i128 are exact: out of a count's bounds by their sign, a seed, a float
    // while one holds them.
    #[test]
    fn big_integers() {
        let big = "1".repeat(50);
        let body = format!(r#"{{"model":"m","prompt":"p","max_tokens":-{big}}}"#);
        let (message, _) = first(Endpoint::Completions, &body).unwrap();
        assert_eq!(
            message,
            format!("max_tokens: Input should be greater than or equal to 0 (got -{big})")
        );
        let body = format!(r#"{{"model":"m","prompt":"p","n":{big}}}"#);
        let (message, _) = first(Endpoint::Completions, &body).unwrap();
        assert!(
            message.starts_with("n: Input should be less than or equal to 2147483647 (got 1111")
        );
        let huge = "9".repeat(320);
        let body = format!(r#"{{"model":"m","prompt":"p","temperature":{huge}}}"#);
        let (message, _) = first(Endpoint::Completions, &body).unwrap();
        assert!(message.starts_with("temperature: Input should be a valid number (got 999"));
        let body = format!(r#"{{"model":"m","prompt":"p","top_p":{big},"seed":{huge}}}"#);
        let (message, _) = first(Endpoint::Completions, &body).unwrap();
        assert!(message.starts_with("top_p: Input should be less than or equal to 1 (got 1111"));
    }

    // `repr` truncated at 80 characters.
    #[test]
    fn long_inputs_are_cut() {
        let text = format!(r#"{{"model":"m","prompt":["{}", 1]}}"#, "x".repeat(100));
        let (message, param) = first(Endpoint::Completions, &text).unwrap();
        assert_eq!(param, "prompt");
        assert!(
            message.ends_with(&format!("(got ['{})", "x".repeat(78))),
            "{message}"
        );
    }
}
