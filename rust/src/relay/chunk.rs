//! The chunk logic of a relayed stream: count new tokens, cut the usage the client did not ask
//! for, and coalesce chunks. The Python twin for the paths the relay does not take (several
//! choices, continuous usage, non-streaming replies) is `gateway/streaming.py`; both follow the
//! same rules, and `tests/gateway/test_relay_chunks.py` feeds both the same payloads.

use std::sync::LazyLock;

use memchr::memmem::Finder;
use serde_json::{Map, Value};

use super::events::Failure;
use super::sse::find;

/// What one upstream payload becomes.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Shaped {
    /// The SSE frame for the client (`data: {...}\n\n`), or nothing to forward.
    pub frame: Option<Vec<u8>>,
    /// Tokens generated since the previous payload.
    pub new_tokens: u32,
}

/// Reads one single-choice stream's payloads. Upstream is always asked for continuous usage
/// stats, so each chunk states the tokens generated so far (chunks without usage count one
/// token per text delta).
#[derive(Debug)]
pub struct ChunkShaper {
    include_usage: bool,
    completion_tokens: u64,
    /// The choice sent a `finish_reason` (a cut adds no notice after it).
    pub finished: bool,
    /// `{"id","created","model"}` of the upstream reply, as JSON, once a chunk named them.
    pub template: Option<String>,
    /// The finishing chunk of a client that asked for no usage, held for the usage chunk
    /// right behind it: vLLM stamps `system_fingerprint` on a stream's last chunk when no
    /// usage chunk follows, and upstream is always asked for one (`take_held`).
    held: Option<Map<String, Value>>,
}

const USAGE_KEY: &[u8] = b",\"usage\":{";
const TOKENS_KEY: &[u8] = b"\"completion_tokens\":";
const TEXT_DELTAS: [&str; 3] = ["content", "reasoning_content", "reasoning"];
// What a chunk's head (all before its usage) is searched for, each searcher made once.
static NO_CHOICES: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"choices\":[]"));
static ERROR: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"error\""));
static FINISHING: LazyLock<Finder<'static>> =
    LazyLock::new(|| Finder::new(b"\"finish_reason\":\""));

impl ChunkShaper {
    /// `include_usage`: the client asked for `stream_options.include_usage` (it then gets
    /// the final usage chunk, and no usage key on the others, as vLLM sends them).
    pub fn new(include_usage: bool) -> Self {
        Self {
            include_usage,
            completion_tokens: 0,
            finished: false,
            template: None,
            held: None,
        }
    }

    /// Generated tokens counted so far.
    pub fn completion_tokens(&self) -> u64 {
        self.completion_tokens
    }

    /// Read one `data:` payload.
    ///
    /// # Errors
    /// The payload is not JSON, or JSON of another shape than a chunk's (502, the message
    /// says what the backend sent: a chunk read wrong would lose its text without a word),
    /// or it is vLLM's in-band error event (`in_band_failure`).
    pub fn feed(&mut self, data: &[u8]) -> Result<Shaped, Failure> {
        if self.template.is_some() && self.held.is_none() {
            if let Some(shaped) = self.passthrough(data) {
                return Ok(shaped);
            }
        }
        let value: Value = serde_json::from_slice(data).map_err(|e| {
            Failure::backend(
                "backend_error",
                format!("backend sent bad data: {e}"),
                false,
            )
        })?;
        let Value::Object(mut chunk) = value else {
            return Err(wrong_shape("a chunk that is not a JSON object"));
        };
        if let Some(error) = chunk.get("error") {
            return Err(in_band_failure(error, data));
        }
        if let Some(problem) = malformed(&chunk) {
            return Err(wrong_shape(problem));
        }
        if self.template.is_none() && chunk.contains_key("id") {
            // In this order, as `ChunkParser.template` holds it (a `Map` would sort the keys).
            let fields: Vec<String> = ["id", "created", "model"]
                .iter()
                .filter_map(|key| chunk.get(*key).map(|v| format!("\"{key}\":{v}")))
                .collect();
            self.template = Some(format!("{{{}}}", fields.join(",")));
        }
        let new_tokens = self.count(&chunk);
        let choices = chunk.get("choices").and_then(Value::as_array);
        let finishing = choices.is_some_and(|cs| cs.iter().any(|c| !c["finish_reason"].is_null()));
        let usage_only = choices.is_none_or(Vec::is_empty);
        self.finished |= finishing;
        if usage_only {
            if let Some(mut held) = self.held.take() {
                if let Some(fingerprint) = chunk.get("system_fingerprint") {
                    held.insert("system_fingerprint".to_owned(), fingerprint.clone());
                }
                let frame = Some(frame_of(&Value::Object(held)));
                return Ok(Shaped { frame, new_tokens });
            }
            let frame = self.include_usage.then(|| frame_of(&Value::Object(chunk)));
            return Ok(Shaped { frame, new_tokens });
        }
        chunk.remove("usage");
        let mut frame = self.take_held().unwrap_or_default();
        if finishing && !self.include_usage {
            self.held = Some(chunk);
            return Ok(Shaped {
                frame: (!frame.is_empty()).then_some(frame),
                new_tokens,
            });
        }
        frame.extend_from_slice(&frame_of(&Value::Object(chunk)));
        Ok(Shaped {
            frame: Some(frame),
            new_tokens,
        })
    }

    /// The held finishing chunk's frame, if one waits (the stream ended or was cut first).
    pub fn take_held(&mut self) -> Option<Vec<u8>> {
        self.held.take().map(|h| frame_of(&Value::Object(h)))
    }

    /// vLLM puts continuous usage last: cut it off without parsing the chunk.
    fn passthrough(&mut self, data: &[u8]) -> Option<Shaped> {
        let cut = rfind(data, USAGE_KEY)?;
        if !data.ends_with(b"}}") || find(&data[cut..], b"}")? + cut != data.len() - 2 {
            return None;
        }
        let head = &data[..cut];
        if NO_CHOICES.find(head).is_some() || ERROR.find(head).is_some() {
            return None;
        }
        let finishing = FINISHING.find(head).is_some();
        if !self.include_usage && finishing {
            return None; // the last chunk waits for the fingerprint (`held`)
        }
        let at = find(&data[cut..], TOKENS_KEY)? + cut + TOKENS_KEY.len();
        let digits = trim_spaces(&data[at..]);
        let end = digits
            .iter()
            .position(|b| !b.is_ascii_digit())
            .unwrap_or(digits.len());
        if end == 0 {
            return None;
        }
        let total: u64 = std::str::from_utf8(&digits[..end]).ok()?.parse().ok()?;
        let new = total.saturating_sub(self.completion_tokens);
        self.completion_tokens = total;
        self.finished |= finishing;
        let tail: &[u8] = b"}";
        let mut frame = Vec::with_capacity(head.len() + tail.len() + 8);
        frame.extend_from_slice(b"data: ");
        frame.extend_from_slice(head);
        frame.extend_from_slice(tail);
        frame.extend_from_slice(b"\n\n");
        Some(Shaped {
            frame: Some(frame),
            new_tokens: u32::try_from(new).unwrap_or(u32::MAX),
        })
    }

    fn count(&mut self, chunk: &Map<String, Value>) -> u32 {
        if let Some(total) = chunk
            .get("usage")
            .and_then(|u| u.get("completion_tokens"))
            .and_then(Value::as_u64)
        {
            let new = total.saturating_sub(self.completion_tokens);
            self.completion_tokens = total;
            return u32::try_from(new).unwrap_or(u32::MAX);
        }
        let new = chunk
            .get("choices")
            .and_then(Value::as_array)
            .map_or(0, |cs| cs.iter().filter(|c| has_text(c)).count());
        self.completion_tokens += new as u64;
        new as u32
    }
}

fn has_text(choice: &Value) -> bool {
    if let Some(delta) = choice.get("delta") {
        let Some(delta) = delta.as_object() else {
            return false;
        };
        return TEXT_DELTAS.iter().any(|k| {
            delta
                .get(*k)
                .and_then(Value::as_str)
                .is_some_and(|s| !s.is_empty())
        });
    }
    choice
        .get("text")
        .and_then(Value::as_str)
        .is_some_and(|s| !s.is_empty())
}

/// What is wrong with a chunk's shape, if anything: `choices` a list of objects whose `delta`
/// (when present) is an object, `usage` an object (`gateway/streaming.py` checks the same).
fn malformed(chunk: &Map<String, Value>) -> Option<&'static str> {
    match chunk.get("choices") {
        None | Some(Value::Null) => {}
        Some(Value::Array(choices)) => {
            for choice in choices {
                let Value::Object(choice) = choice else {
                    return Some("a choice that is not an object");
                };
                if !matches!(
                    choice.get("delta"),
                    None | Some(Value::Null | Value::Object(_))
                ) {
                    return Some("a choice whose delta is not an object");
                }
            }
        }
        Some(_) => return Some("choices that are not a list"),
    }
    match chunk.get("usage") {
        None | Some(Value::Null | Value::Object(_)) => None,
        Some(_) => Some("usage that is not an object"),
    }
}

fn wrong_shape(problem: &str) -> Failure {
    Failure::backend(
        "backend_error",
        format!("backend sent {problem} in its stream"),
        false,
    )
}

/// vLLM's in-band error event (`data: {"error": {...}}`, then `[DONE]`): the request failed.
/// A 4xx `code` is vLLM refusing the request (a parameter it checks only once the stream has
/// begun, e.g. `logprobs` over its maximum): the client's error, with vLLM's object; anything
/// else is the backend failing (502).
fn in_band_failure(error: &Value, data: &[u8]) -> Failure {
    let message = error
        .get("message")
        .and_then(Value::as_str)
        .map_or_else(|| error.to_string(), str::to_owned);
    let status = error.get("code").and_then(Value::as_u64).unwrap_or(500);
    if (400..500).contains(&status) && error.is_object() {
        return Failure {
            status: u16::try_from(status).expect("checked range"),
            code: "backend_rejected",
            message,
            backend_down: false,
            error: raw_error(data),
        };
    }
    Failure::backend(
        "backend_error",
        format!("backend failed mid-stream: {message}"),
        false,
    )
}

/// The `error` object of a body or an event (`{"error": {...}}`), as the backend wrote it: its
/// keys in their order (the client hears vLLM's object as Python's `json.loads` keeps it).
pub fn raw_error(raw: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Body<'a> {
        #[serde(borrow)]
        error: Option<&'a serde_json::value::RawValue>,
    }
    let error = serde_json::from_slice::<Body<'_>>(raw).ok()?.error?.get();
    error.starts_with('{').then(|| error.to_owned())
}

/// `data: {json}\n\n`, compact.
pub fn frame_of(chunk: &Value) -> Vec<u8> {
    let mut out = b"data: ".to_vec();
    serde_json::to_writer(&mut out, chunk).expect("a JSON value serializes");
    out.extend_from_slice(b"\n\n");
    out
}

/// Coalesce consecutive frames into as few valid chunks as possible (order kept). Frames
/// that do not parse, or cannot merge (tool calls, a finished choice, errors), stay as they
/// are.
pub fn merge_frames(frames: Vec<Vec<u8>>) -> Vec<Vec<u8>> {
    if frames.len() < 2 {
        return frames;
    }
    let mut out: Vec<Result<Value, Vec<u8>>> = Vec::with_capacity(frames.len());
    for frame in frames {
        let parsed = frame
            .strip_prefix(b"data: ")
            .and_then(|f| f.strip_suffix(b"\n\n"))
            .and_then(|p| serde_json::from_slice::<Value>(p).ok());
        match parsed {
            Some(b) => {
                let merged = match out.last_mut() {
                    Some(Ok(a)) => merge_into(a, &b),
                    _ => false,
                };
                if !merged {
                    out.push(Ok(b));
                }
            }
            None => out.push(Err(frame)),
        }
    }
    out.into_iter()
        .map(|item| item.map_or_else(|raw| raw, |v| frame_of(&v)))
        .collect()
}

fn merge_into(a: &mut Value, b: &Value) -> bool {
    let (Some(ca), Some(cb)) = (
        a.get("choices").and_then(Value::as_array),
        b.get("choices").and_then(Value::as_array),
    ) else {
        return false;
    };
    if ca.is_empty()
        || cb.is_empty()
        || a.get("object") != b.get("object")
        || b.get("error").is_some()
    {
        return false;
    }
    let index = |c: &Value| c.get("index").and_then(Value::as_u64).unwrap_or(0);
    for choice_b in cb {
        if let Some(choice_a) = ca.iter().find(|c| index(c) == index(choice_b)) {
            if !mergeable(choice_a, choice_b) {
                return false;
            }
        }
    }
    let b_choices = cb.clone();
    let a_obj = a.as_object_mut().expect("has choices, so an object");
    let ca = a_obj
        .get_mut("choices")
        .and_then(Value::as_array_mut)
        .expect("checked above");
    for choice_b in b_choices {
        match ca.iter_mut().find(|c| index(c) == index(&choice_b)) {
            Some(choice_a) => merge_choice(choice_a, &choice_b),
            None => ca.push(choice_b),
        }
    }
    for key in ["usage", "llmflow"] {
        if let Some(v) = b.get(key) {
            a_obj.insert(key.to_owned(), v.clone());
        }
    }
    true
}

fn empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

const MERGEABLE_KEYS: [&str; 6] = [
    "index",
    "delta",
    "text",
    "finish_reason",
    "logprobs",
    "stop_reason",
];

fn mergeable(ca: &Value, cb: &Value) -> bool {
    if !ca["finish_reason"].is_null() || !empty(&ca["logprobs"]) || !empty(&cb["logprobs"]) {
        return false;
    }
    let keys_ok = |c: &Value| {
        c.as_object()
            .is_some_and(|o| o.keys().all(|k| MERGEABLE_KEYS.contains(&k.as_str())))
    };
    if !keys_ok(ca) || !keys_ok(cb) {
        return false;
    }
    let delta_ok = |c: &Value| {
        c.get("delta").and_then(Value::as_object).is_none_or(|d| {
            d.iter()
                .all(|(k, v)| TEXT_DELTAS.contains(&k.as_str()) || k == "role" || empty(v))
        })
    };
    delta_ok(ca) && delta_ok(cb)
}

fn merge_choice(ca: &mut Value, cb: &Value) {
    let a = ca.as_object_mut().expect("a choice is an object");
    if let Some(text) = cb.get("text") {
        let joined = format!(
            "{}{}",
            a.get("text").and_then(Value::as_str).unwrap_or(""),
            text.as_str().unwrap_or("")
        );
        a.insert("text".to_owned(), Value::String(joined));
    }
    if let Some(delta_b) = cb.get("delta") {
        let delta = a
            .entry("delta")
            .or_insert_with(|| Value::Object(Map::new()));
        if !delta.is_object() {
            *delta = Value::Object(Map::new());
        }
        let delta = delta.as_object_mut().expect("made an object");
        for (key, value) in delta_b.as_object().into_iter().flatten() {
            if TEXT_DELTAS.contains(&key.as_str()) {
                if let Some(s) = value.as_str() {
                    let joined = format!(
                        "{}{s}",
                        delta.get(key).and_then(Value::as_str).unwrap_or("")
                    );
                    delta.insert(key.clone(), Value::String(joined));
                }
            } else if key == "role" && !delta.contains_key("role") {
                delta.insert(key.clone(), value.clone());
            }
        }
    }
    a.insert(
        "finish_reason".to_owned(),
        cb.get("finish_reason").cloned().unwrap_or(Value::Null),
    );
    if let Some(stop) = cb.get("stop_reason") {
        a.insert("stop_reason".to_owned(), stop.clone());
    }
}

/// Where `needle` last starts in `haystack` (as `sse::find`, from the end).
fn rfind(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    let (&first, rest) = needle.split_first()?;
    let mut end = haystack.len();
    while let Some(at) = memchr::memrchr(first, &haystack[..end]) {
        if haystack[at + 1..].starts_with(rest) {
            return Some(at);
        }
        end = at;
    }
    None
}

fn trim_spaces(mut s: &[u8]) -> &[u8] {
    while let [b' ', rest @ ..] = s {
        s = rest;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_of_the_wrong_shape_fails_the_stream() {
        for bad in [
            br#"{"choices": 5}"#.as_slice(),
            br#"{"choices": [7]}"#,
            br#"{"choices": [{"index": 0, "delta": "text"}]}"#,
            br#"{"choices": [], "usage": "lots"}"#,
            br"[1, 2]",
        ] {
            let mut shaper = ChunkShaper::new(false);
            let failure = shaper.feed(bad).expect_err("a wrong shape is a failure");
            assert!(
                failure.message.contains("backend sent"),
                "{}",
                failure.message
            );
        }
    }

    fn chunk(i: u64, text: &str, finish: &str) -> Vec<u8> {
        format!(
            r#"{{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{{"index":0,"delta":{{"content":"{text}"}},"logprobs":null,"finish_reason":{finish}}}],"usage":{{"prompt_tokens":3,"total_tokens":{},"completion_tokens":{i}}}}}"#,
            i + 3
        )
        .into_bytes()
    }

    #[test]
    fn first_chunk_parsed_then_passthrough_counts_and_cuts_usage() {
        let mut s = ChunkShaper::new(false);
        let a = s.feed(&chunk(1, "a", "null")).unwrap();
        assert_eq!(a.new_tokens, 1);
        // the template's fields in ChunkParser's order, not sorted
        assert_eq!(
            s.template.as_deref(),
            Some(r#"{"id":"c1","created":1,"model":"m"}"#)
        );
        assert!(!String::from_utf8(a.frame.unwrap())
            .unwrap()
            .contains("usage"));
        let b = s.feed(&chunk(3, "bc", "null")).unwrap();
        assert_eq!(b.new_tokens, 2);
        let frame = String::from_utf8(b.frame.unwrap()).unwrap();
        assert!(
            frame.starts_with("data: {\"id\":\"c1\"") && frame.ends_with("null}]}\n\n"),
            "{frame}"
        );
        assert!(!s.finished);
        s.feed(&chunk(4, "d", "\"length\"")).unwrap();
        assert!(s.finished);
        assert_eq!(s.completion_tokens(), 4);
    }

    #[test]
    fn include_usage_keeps_only_the_final_usage_chunk() {
        let mut s = ChunkShaper::new(true);
        let a = s.feed(&chunk(1, "a", "null")).unwrap();
        assert!(!String::from_utf8(a.frame.unwrap())
            .unwrap()
            .contains("\"usage\""));
        let b = s.feed(&chunk(2, "b", "null")).unwrap();
        assert!(!String::from_utf8(b.frame.unwrap())
            .unwrap()
            .contains("\"usage\""));
        let last = br#"{"id":"c1","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#;
        let c = s.feed(last).unwrap();
        assert_eq!(c.new_tokens, 0);
        assert!(String::from_utf8(c.frame.unwrap())
            .unwrap()
            .contains("\"completion_tokens\":2"));
        let mut plain = ChunkShaper::new(false);
        assert_eq!(plain.feed(last).unwrap().frame, None);
    }

    // With no usage asked for, vLLM puts `system_fingerprint` on the last chunk; upstream
    // sends it on the usage chunk behind it, which the client does not get.
    #[test]
    fn the_last_chunk_takes_the_fingerprint_of_the_usage_chunk_behind_it() {
        let mut s = ChunkShaper::new(false);
        s.feed(&chunk(1, "a", "null")).unwrap();
        let last = s.feed(&chunk(2, "b", "\"length\"")).unwrap();
        assert_eq!((last.frame, last.new_tokens), (None, 1));
        let usage = br#"{"id":"c1","choices":[],"usage":{"completion_tokens":2},"system_fingerprint":"fp-1"}"#;
        let frame = String::from_utf8(s.feed(usage).unwrap().frame.unwrap()).unwrap();
        let sent: Value = serde_json::from_str(frame.trim().trim_start_matches("data: ")).unwrap();
        assert_eq!(sent["system_fingerprint"], "fp-1");
        assert_eq!(sent["choices"][0]["finish_reason"], "length");
        assert!(sent.get("usage").is_none());
        assert!(s.take_held().is_none());
        let mut cut = ChunkShaper::new(false);
        cut.feed(&chunk(1, "a", "\"stop\"")).unwrap();
        assert!(cut.take_held().is_some()); // a stream that ends without it still sends it
    }

    // vLLM's in-band error event is the stream's failure, not a chunk to pass on.
    #[test]
    fn an_in_band_error_event_is_a_failure() {
        let mut s = ChunkShaper::new(false);
        let err = s
            .feed(br#"{"error":{"message":"engine died","code":500}}"#)
            .unwrap_err();
        assert!(err.message.contains("engine died"), "{err:?}");
        assert_eq!((err.status, err.error), (502, None));
    }

    // A 4xx in-band error is vLLM refusing the request: its status and object go on.
    #[test]
    fn an_in_band_4xx_is_the_backends_refusal_with_its_object() {
        let mut s = ChunkShaper::new(false);
        let raw = br#"{"error":{"message":"too many logprobs","type":"BadRequestError","param":"logprobs","code":400}}"#;
        let err = s.feed(raw).unwrap_err();
        assert_eq!((err.status, err.code), (400, "backend_rejected"));
        assert_eq!(err.message, "too many logprobs");
        // vLLM's object as it wrote it, its keys in their order
        assert_eq!(
            err.error.unwrap(),
            r#"{"message":"too many logprobs","type":"BadRequestError","param":"logprobs","code":400}"#
        );
    }

    #[test]
    fn no_usage_counts_text_deltas_and_bad_json_is_an_error() {
        let mut s = ChunkShaper::new(false);
        let role =
            br#"{"id":"x","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#;
        assert_eq!(s.feed(role).unwrap().new_tokens, 0);
        let text = br#"{"id":"x","choices":[{"index":0,"text":"hi","finish_reason":null}]}"#;
        assert_eq!(s.feed(text).unwrap().new_tokens, 1);
        assert!(s
            .feed(b"{not json")
            .unwrap_err()
            .message
            .contains("bad data"));
    }

    #[test]
    fn merge_joins_text_and_keeps_unmergeable_apart() {
        let f = |t: &str, fin: &str| {
            format!(r#"data: {{"object":"chat.completion.chunk","choices":[{{"index":0,"delta":{{"content":"{t}"}},"finish_reason":{fin}}}]}}"#).into_bytes().into_iter().chain(*b"\n\n").collect::<Vec<u8>>()
        };
        let merged = merge_frames(vec![f("a", "null"), f("b", "null"), f("c", "\"stop\"")]);
        assert_eq!(merged.len(), 1);
        let text = String::from_utf8(merged[0].clone()).unwrap();
        assert!(
            text.contains("\"content\":\"abc\"") && text.contains("\"stop\""),
            "{text}"
        );
        let after_finish = merge_frames(vec![f("a", "\"stop\""), f("b", "null")]);
        assert_eq!(after_finish.len(), 2);
        let raw = merge_frames(vec![b"data: nope\n\n".to_vec(), f("a", "null")]);
        assert_eq!(raw[0], b"data: nope\n\n");
    }
}
