//! The request models of `gateway/protocol.py`, as a subset: a body passes here only if
//! pydantic's strict validation of `ChatCompletionRequest` / `CompletionRequest` passes it.
//!
//! Strict means what it does there: no coercion (a string is never a number, a bool never
//! an int, a float never an int; an int is a float), `null` only where the model says
//! `| None`, bounds as its `Field`s set them. Unknown fields pass (`extra="allow"`), whatever
//! they hold: vLLM's own extensions go through. Whatever pydantic would refuse is `None`, and
//! so is what it might take but this reading is unsure of (an empty token list).

use super::json::Json;

/// Largest token or choice count a request may name (`protocol.MAX_INT`, vLLM's int32).
pub const MAX_INT: i128 = 2_147_483_647;

/// The fields the gateway reads of a chat or completion body, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Request<'a> {
    pub model: &'a str,
    pub stream: bool,
    /// `stream_options` was given as an object (even `{}`).
    pub stream_options: Option<StreamOptions>,
    /// Chat: `max_completion_tokens` or else `max_tokens`; completions: `max_tokens`.
    pub max_tokens: Option<u64>,
    pub n: u64,
    pub echo: bool,
    pub prompt: Prompt<'a>,
}

/// `stream_options`, validated (`StreamOptions`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StreamOptions {
    pub include_usage: bool,
    pub continuous_usage_stats: bool,
}

/// What the request asks the model to continue.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt<'a> {
    /// Chat: each message's role and content (`ChatMessage`).
    Chat(Vec<Message<'a>>),
    /// Completions: one prompt, or each of a batch (`CompletionRequest.prompts`).
    Texts(Vec<&'a str>),
    Ids(Vec<&'a [Json]>),
}

/// One chat message.
#[derive(Debug, Clone, PartialEq)]
pub struct Message<'a> {
    pub role: &'a str,
    pub content: Content<'a>,
}

/// A message's `content`: none, text, or typed parts (each an object).
#[derive(Debug, Clone, PartialEq)]
pub enum Content<'a> {
    None,
    Text(&'a str),
    Parts(&'a [Json]),
}

/// A `/v1/chat/completions` body as `ChatCompletionRequest` validates it.
pub fn chat(body: &Json) -> Option<Request<'_>> {
    let messages = match body.get("messages")? {
        Json::Array(items) if !items.is_empty() => items,
        _ => return None,
    };
    let messages = messages.iter().map(message).collect::<Option<Vec<_>>>()?;
    let max_completion = opt_int(body.get("max_completion_tokens"), 1).ok()?;
    let max_tokens = opt_int(body.get("max_tokens"), 1).ok()?;
    let n = match body.get("n") {
        None | Some(Json::Null) => 1, // `request.n or 1`
        Some(value) => count(value, 1)?,
    };
    sampling(body)?;
    Some(Request {
        model: model(body)?,
        stream: opt_bool(body.get("stream"))?,
        stream_options: stream_options(body.get("stream_options")).ok()?,
        max_tokens: max_completion.or(max_tokens),
        n,
        echo: false,
        prompt: Prompt::Chat(messages),
    })
}

/// A `/v1/completions` body as `CompletionRequest` validates it.
pub fn completion(body: &Json) -> Option<Request<'_>> {
    let prompt = prompt(body.get("prompt")?)?;
    let n = match body.get("n") {
        None => 1,
        Some(value) => count(value, 1)?, // not nullable here
    };
    sampling(body)?;
    Some(Request {
        model: model(body)?,
        stream: opt_bool(body.get("stream"))?,
        stream_options: stream_options(body.get("stream_options")).ok()?,
        max_tokens: opt_int(body.get("max_tokens"), 0).ok()?,
        n,
        echo: opt_bool(body.get("echo"))?,
        prompt,
    })
}

fn model(body: &Json) -> Option<&str> {
    match body.get("model")? {
        Json::Str(s) if !s.is_empty() => Some(s),
        _ => None,
    }
}

/// The shared sampling fields the gateway checks but does not read: `temperature >= 0`,
/// `0 < top_p <= 1`, `stop` text or up to 4 texts, `seed` an int, `user` text.
fn sampling(body: &Json) -> Option<()> {
    let number = |key: &str, ok: fn(f64) -> bool| match body.get(key) {
        None | Some(Json::Null) => true,
        Some(value) => float(value).is_some_and(ok),
    };
    let stop = match body.get("stop") {
        None | Some(Json::Null | Json::Str(_)) => true,
        Some(Json::Array(items)) => {
            items.len() <= 4 && items.iter().all(|s| matches!(s, Json::Str(_)))
        }
        Some(_) => false,
    };
    let seed = matches!(
        body.get("seed"),
        None | Some(Json::Null | Json::Int(_) | Json::BigInt(_))
    );
    let user = matches!(body.get("user"), None | Some(Json::Null | Json::Str(_)));
    let ok = number("temperature", |x| x >= 0.0) && number("top_p", |x| x > 0.0 && x <= 1.0);
    (ok && stop && seed && user).then_some(())
}

/// A strict `float` as pydantic reads it: a float, or an int as the nearest float (Python's
/// `float(int)`, correctly rounded as Rust's conversions are), None past the largest float.
pub fn float(value: &Json) -> Option<f64> {
    match value {
        Json::Float(x) => Some(*x),
        Json::Int(i) => Some(*i as f64),
        Json::BigInt(digits) => digits.parse::<f64>().ok().filter(|x| x.is_finite()),
        _ => None,
    }
}

fn message(value: &Json) -> Option<Message<'_>> {
    let Json::Str(role) = value.get("role")? else {
        return None;
    };
    let content = match value.get("content") {
        None | Some(Json::Null) => Content::None,
        Some(Json::Str(text)) => Content::Text(text),
        Some(Json::Array(parts)) if parts.iter().all(|p| matches!(p, Json::Object(_))) => {
            Content::Parts(parts)
        }
        Some(_) => return None,
    };
    Some(Message { role, content })
}

/// `str | list[TokenId] | list[str] | list[list[TokenId]]`, read as `prompts` reads it. An
/// empty list is one prompt of no ids, as pydantic takes it (vLLM answers that it is empty).
fn prompt(value: &Json) -> Option<Prompt<'_>> {
    match value {
        Json::Str(text) => Some(Prompt::Texts(vec![text])),
        Json::Array(items) if items.is_empty() => Some(Prompt::Ids(vec![items.as_slice()])),
        Json::Array(items) => match &items[0] {
            Json::Str(_) => items
                .iter()
                .map(|p| {
                    if let Json::Str(s) = p {
                        Some(s.as_str())
                    } else {
                        None
                    }
                })
                .collect::<Option<Vec<_>>>()
                .map(Prompt::Texts),
            Json::Array(_) => items
                .iter()
                .map(|p| match p {
                    Json::Array(ids) if token_ids(ids) => Some(ids.as_slice()),
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()
                .map(Prompt::Ids),
            _ => token_ids(items).then(|| Prompt::Ids(vec![items.as_slice()])),
        },
        _ => None,
    }
}

fn token_ids(ids: &[Json]) -> bool {
    ids.iter()
        .all(|id| matches!(id, Json::Int(i) if (0..=MAX_INT).contains(i)))
}

/// `bool | None = False`.
fn opt_bool(value: Option<&Json>) -> Option<bool> {
    match value {
        None | Some(Json::Null) => Some(false),
        Some(Json::Bool(b)) => Some(*b),
        Some(_) => None,
    }
}

/// A field pydantic refuses.
struct Invalid;

/// `int | None = Field(None, ge=least, le=MAX_INT)`.
fn opt_int(value: Option<&Json>, least: i128) -> Result<Option<u64>, Invalid> {
    match value {
        None | Some(Json::Null) => Ok(None),
        Some(value) => count(value, least).map(Some).ok_or(Invalid),
    }
}

fn count(value: &Json, least: i128) -> Option<u64> {
    match value {
        Json::Int(i) if (least..=MAX_INT).contains(i) => u64::try_from(*i).ok(),
        _ => None,
    }
}

/// `StreamOptions | None`.
fn stream_options(value: Option<&Json>) -> Result<Option<StreamOptions>, Invalid> {
    match value {
        None | Some(Json::Null) => Ok(None),
        Some(options @ Json::Object(_)) => Ok(Some(StreamOptions {
            include_usage: opt_bool(options.get("include_usage")).ok_or(Invalid)?,
            continuous_usage_stats: opt_bool(options.get("continuous_usage_stats"))
                .ok_or(Invalid)?,
        })),
        Some(_) => Err(Invalid),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::front::decode::read;

    fn chat_of(text: &str) -> Option<Request<'static>> {
        let body = Box::leak(Box::new(read(text.as_bytes()).unwrap()));
        chat(body)
    }

    fn completion_of(text: &str) -> Option<Request<'static>> {
        let body = Box::leak(Box::new(read(text.as_bytes()).unwrap()));
        completion(body)
    }

    const MSG: &str = r#""messages":[{"role":"user","content":"hi"}]"#;

    // A plain chat body: its values read; `n: null` is 1; max_completion_tokens wins.
    #[test]
    fn chat_reads_its_fields() {
        let r = chat_of(&format!(
            r#"{{"model":"m",{MSG},"stream":true,"stream_options":{{"include_usage":true}},
            "n":null,"max_tokens":7,"max_completion_tokens":9,"temperature":0,"top_p":1,
            "stop":["a","b"],"seed":-3,"user":"u","tools":[{{"x":1}}]}}"#
        ))
        .unwrap();
        assert_eq!(
            (r.model, r.stream, r.n, r.max_tokens),
            ("m", true, 1, Some(9))
        );
        assert!(r.stream_options.unwrap().include_usage);
    }

    // Strict types, bounds and required fields, each refused as pydantic refuses it.
    #[test]
    fn chat_refuses_what_pydantic_refuses() {
        for extra in [
            r#""model":"""#,
            r#""model":1"#,
            r#""model":"m","n":0"#,
            r#""model":"m","n":true"#,
            r#""model":"m","n":1.0"#,
            r#""model":"m","max_tokens":0"#,
            r#""model":"m","max_tokens":2147483648"#,
            r#""model":"m","temperature":-0.5"#,
            r#""model":"m","temperature":"1""#,
            r#""model":"m","top_p":0"#,
            r#""model":"m","stop":["a","b","c","d","e"]"#,
            r#""model":"m","seed":1.5"#,
            r#""model":"m","stream":"yes""#,
            r#""model":"m","stream_options":{"include_usage":1}"#,
            r#""model":"m","stream_options":[]"#,
        ] {
            assert!(chat_of(&format!("{{{extra},{MSG}}}")).is_none(), "{extra}");
        }
        assert!(chat_of(r#"{"model":"m","messages":[]}"#).is_none());
        assert!(chat_of(r#"{"model":"m","messages":[{"content":"x"}]}"#).is_none());
        assert!(chat_of(r#"{"model":"m","messages":[{"role":"u","content":["x"]}]}"#).is_none());
    }

    // The prompt shapes, read as `CompletionRequest.prompts` reads them.
    #[test]
    fn completion_prompt_shapes() {
        let texts = completion_of(r#"{"model":"m","prompt":["a","b"],"echo":true}"#).unwrap();
        assert_eq!(texts.prompt, Prompt::Texts(vec!["a", "b"]));
        assert!(texts.echo);
        let ids = completion_of(r#"{"model":"m","prompt":[1,2],"max_tokens":0}"#).unwrap();
        assert!(matches!(ids.prompt, Prompt::Ids(ref p) if p.len() == 1 && p[0].len() == 2));
        let batch = completion_of(r#"{"model":"m","prompt":[[1],[2,3]]}"#).unwrap();
        assert!(matches!(batch.prompt, Prompt::Ids(ref p) if p.len() == 2));
        for bad in [
            r#"[1,"a"]"#,
            r#"["a",1]"#,
            r#"[[1],"a"]"#,
            "[-1]",
            "[2147483648]",
            "[true]",
            "null",
            "1",
            "[1.0]",
        ] {
            assert!(
                completion_of(&format!(r#"{{"model":"m","prompt":{bad}}}"#)).is_none(),
                "{bad}"
            );
        }
        assert!(completion_of(r#"{"model":"m","prompt":"a","n":null}"#).is_none());
        // An empty list is one prompt of no ids; in a batch, a prompt of none.
        for (empty, lengths) in [("[]", vec![0]), ("[[]]", vec![0]), ("[[],[7]]", vec![0, 1])] {
            let read = completion_of(&format!(r#"{{"model":"m","prompt":{empty}}}"#)).unwrap();
            let Prompt::Ids(prompts) = read.prompt else {
                panic!("{empty}: not ids");
            };
            let read: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
            assert_eq!(read, lengths, "{empty}");
        }
    }
}
