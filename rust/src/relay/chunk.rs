//! The chunk logic of a relayed stream: count new tokens, cut the usage the client did not ask
//! for, hold a finishing chunk for the fingerprint behind it, and coalesce chunks. The Python
//! twin (`gateway/streaming.py`, `ChunkParser`) follows the same rules, and
//! `property_tests/test_stream_frames.py` feeds both the same payloads. A chunk the relay
//! rewrites is written as `encode_event` writes it (`front::json`: its keys in their order,
//! `ensure_ascii`, compact), so the client reads the bytes the Python path sends.

use std::sync::LazyLock;

use memchr::memmem::Finder;
use serde_json::Value;

use super::events::Failure;
use super::sse::find;
use crate::front::json::{self, Json, Style};

/// The last frame of a reply the host cut.
pub enum Ending {
    /// Written as it is (the in-band error).
    Frame(Vec<u8>),
    /// The notice for the choices still open, written only if one is: the host's function
    /// makes its frame from their indexes and the stream's template (`tail_chunk`).
    Notice(NoticeFrame),
}

/// Makes a cut's notice from the open choices' indexes and the template, when one came.
pub type NoticeFrame = Box<dyn FnOnce(&[u64], Option<&str>) -> Vec<u8> + Send>;

impl std::fmt::Debug for Ending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Frame(frame) => write!(f, "Frame({} bytes)", frame.len()),
            Self::Notice(_) => f.write_str("Notice"),
        }
    }
}

/// What one upstream payload becomes.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Shaped {
    /// Frames to send first, each one chunk: the finishing chunks that waited for this one's
    /// fingerprint (`ChunkParser.take_held`).
    pub before: Vec<Vec<u8>>,
    /// The SSE frame for the client (`data: {...}\n\n`), or nothing to forward.
    pub frame: Option<Vec<u8>>,
    /// Tokens generated since the previous payload.
    pub new_tokens: u32,
}

/// Reads one stream's payloads (`ChunkParser`). Upstream is always asked for continuous usage
/// stats, so each chunk states the tokens generated so far (chunks without usage count one
/// token per text delta). A stream of one choice whose client asked for no continuous usage
/// is relayed byte for byte, its usage cut off unparsed (`passthrough`); any other chunk is
/// parsed, shaped and written again.
#[derive(Debug)]
pub struct ChunkShaper {
    include_usage: bool,
    /// The client asked for `stream_options.continuous_usage_stats`: each chunk keeps its usage.
    continuous_usage: bool,
    /// The reply's choices (`n`, times the prompts of a batch).
    choices: u64,
    /// Chunks go through unparsed, their usage cut (`ChunkParser._fast`).
    fast: bool,
    completion_tokens: u64,
    /// Indexes of the choices that sent a `finish_reason` (a cut adds no notice for them).
    finished: Vec<u64>,
    /// `{"id","created","model"}` of the upstream reply, as JSON, once a chunk named them.
    pub template: Option<String>,
    /// The finishing chunks of a client that asked for no usage, held for the usage chunk
    /// behind them: vLLM stamps `system_fingerprint` on a stream's last chunks when no usage
    /// chunk follows, and upstream is always asked for one (`take_held`).
    held: Vec<Json>,
}

/// `encode_event`'s `json.dumps(chunk, separators=(",", ":"))`.
const ENCODE_EVENT: Style = Style {
    ascii: true,
    sort_keys: false,
    compact: true,
};
/// How the template is handed over (any order and escape reads back the same).
const TEMPLATE: Style = Style {
    ascii: false,
    sort_keys: false,
    compact: true,
};
const USAGE_KEY: &[u8] = b",\"usage\":{";
const TOKENS_KEY: &[u8] = b"\"completion_tokens\":";
const TEXT_DELTAS: [&str; 3] = ["content", "reasoning_content", "reasoning"];
// What a chunk's head (all before its usage) is searched for, each searcher made once.
static NO_CHOICES: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"choices\":[]"));
static ERROR: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"error\""));
static FINISHING: LazyLock<Finder<'static>> =
    LazyLock::new(|| Finder::new(b"\"finish_reason\":\""));

impl ChunkShaper {
    /// A stream of one choice without continuous usage; `include_usage`: the client asked for
    /// `stream_options.include_usage` (it then gets the final usage chunk, and no usage key on
    /// the others, as vLLM sends them).
    pub fn new(include_usage: bool) -> Self {
        Self::shaped(include_usage, false, 1)
    }

    /// A stream whose client asked for `include_usage` and `continuous_usage` (each chunk
    /// keeps its usage), of `choices` choices.
    pub fn shaped(include_usage: bool, continuous_usage: bool, choices: u64) -> Self {
        Self {
            include_usage,
            continuous_usage,
            choices,
            fast: choices == 1 && !continuous_usage,
            completion_tokens: 0,
            finished: Vec::new(),
            template: None,
            held: Vec::new(),
        }
    }

    /// Generated tokens counted so far.
    pub fn completion_tokens(&self) -> u64 {
        self.completion_tokens
    }

    /// An unstreamed answer's tokens, all at once (its usage's `completion_tokens`).
    pub fn answered(&mut self, tokens: u64) {
        self.completion_tokens = tokens;
    }

    /// Indexes of the choices that have not sent a finish reason, in order (a cut's notice
    /// names them).
    pub fn open_choices(&self) -> Vec<u64> {
        (0..self.choices)
            .filter(|i| !self.finished.contains(i))
            .collect()
    }

    /// Read one `data:` payload.
    ///
    /// # Errors
    /// The payload is not JSON, or JSON of another shape than a chunk's (502, the message
    /// says what the backend sent: a chunk read wrong would lose its text without a word),
    /// or it is vLLM's in-band error event (`in_band_failure`).
    pub fn feed(&mut self, data: &[u8]) -> Result<Shaped, Failure> {
        if self.fast && self.template.is_some() {
            if let Some(shaped) = self.passthrough(data) {
                return Ok(shaped);
            }
        }
        let chunk = read(data)?;
        let Json::Object(mut pairs) = chunk else {
            return Err(wrong_shape("a chunk that is not a JSON object"));
        };
        if get(&pairs, "error").is_some() {
            let value: Value = serde_json::from_slice(data).unwrap_or_default();
            return Err(in_band_failure(&value["error"], data));
        }
        if let Some(problem) = malformed(&pairs) {
            return Err(wrong_shape(problem));
        }
        if self.template.is_none() && get(&pairs, "id").is_some() {
            // In this order, as `ChunkParser.template` holds it.
            let fields = ["id", "created", "model"]
                .iter()
                .filter_map(|k| get(&pairs, k).map(|v| ((*k).to_owned(), v.clone())))
                .collect();
            let template = json::to_vec(&Json::Object(fields), TEMPLATE);
            self.template = Some(String::from_utf8(template).expect("JSON text is UTF-8"));
        }
        let new_tokens = self.count(&pairs);
        let (finishing, usage_only) = match get(&pairs, "choices") {
            Some(Json::Array(choices)) => {
                let mut finishing = false;
                for choice in choices {
                    if choice
                        .get("finish_reason")
                        .is_some_and(|f| *f != Json::Null)
                    {
                        finishing = true;
                        let index = match choice.get("index") {
                            None => Some(0),
                            Some(Json::Int(i)) => u64::try_from(*i).ok(),
                            Some(_) => None, // a key no `range(n)` index equals
                        };
                        if let Some(i) = index.filter(|i| !self.finished.contains(i)) {
                            self.finished.push(i);
                        }
                    }
                }
                (finishing, choices.is_empty())
            }
            _ => (false, true),
        };
        if usage_only {
            // The usage-only chunk that ends an include_usage stream: the held chunks take its
            // fingerprint and go first.
            let fingerprint = get(&pairs, "system_fingerprint")
                .filter(|f| **f != Json::Null)
                .cloned();
            let before = std::mem::take(&mut self.held)
                .into_iter()
                .map(|mut held| {
                    if let (Some(fingerprint), Json::Object(held)) = (&fingerprint, &mut held) {
                        set(held, "system_fingerprint", fingerprint.clone());
                    }
                    python_frame(&held)
                })
                .collect();
            let frame = self
                .include_usage
                .then(|| python_frame(&Json::Object(pairs)));
            return Ok(Shaped {
                before,
                frame,
                new_tokens,
            });
        }
        if !self.continuous_usage {
            pairs.retain(|(k, _)| k != "usage"); // vLLM sends a chunk no usage key unless asked
        }
        if finishing && !self.include_usage {
            self.held.push(Json::Object(pairs));
            return Ok(Shaped {
                frame: None,
                new_tokens,
                ..Shaped::default()
            });
        }
        Ok(Shaped {
            frame: Some(python_frame(&Json::Object(pairs))),
            new_tokens,
            ..Shaped::default()
        })
    }

    /// The held finishing chunks' frames, one each (the stream ended, or was cut, before the
    /// usage chunk came).
    pub fn take_held(&mut self) -> Vec<Vec<u8>> {
        std::mem::take(&mut self.held)
            .iter()
            .map(python_frame)
            .collect()
    }

    /// The frames that end a cut reply (`StreamSession.on_cut`): the finishing chunks still
    /// held, then the ending (a notice only while a choice is open), and whether a notice
    /// went out.
    pub fn cut(&mut self, ending: Ending) -> (Vec<Vec<u8>>, bool) {
        let mut frames = self.take_held();
        let mut noticed = false;
        match ending {
            Ending::Frame(frame) => frames.push(frame),
            Ending::Notice(notice) => {
                let open = self.open_choices();
                if !open.is_empty() {
                    frames.push(notice(&open, self.template.as_deref()));
                    noticed = true;
                }
            }
        }
        (frames, noticed)
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
        if finishing && !self.finished.contains(&0) {
            self.finished.push(0);
        }
        let tail: &[u8] = b"}";
        let mut frame = Vec::with_capacity(head.len() + tail.len() + 8);
        frame.extend_from_slice(b"data: ");
        frame.extend_from_slice(head);
        frame.extend_from_slice(tail);
        frame.extend_from_slice(b"\n\n");
        Some(Shaped {
            frame: Some(frame),
            new_tokens: u32::try_from(new).unwrap_or(u32::MAX),
            ..Shaped::default()
        })
    }

    fn count(&mut self, chunk: &[(String, Json)]) -> u32 {
        let total = get(chunk, "usage")
            .and_then(|u| u.get("completion_tokens"))
            .and_then(|t| match t {
                Json::Int(i) => u64::try_from(*i).ok(),
                _ => None,
            });
        if let Some(total) = total {
            let new = total.saturating_sub(self.completion_tokens);
            self.completion_tokens = total;
            return u32::try_from(new).unwrap_or(u32::MAX);
        }
        let new = match get(chunk, "choices") {
            Some(Json::Array(choices)) => choices.iter().filter(|c| has_text(c)).count(),
            _ => 0,
        };
        self.completion_tokens += new as u64;
        new as u32
    }
}

/// A payload as Python's `json.loads` holds it (an object's keys in their order); what the
/// strict reader declines (an integer past 64 bits, `-0`, a key twice) is read by serde
/// instead, its keys sorted.
pub(super) fn read(data: &[u8]) -> Result<Json, Failure> {
    if let Some(chunk) = json::parse(data) {
        return Ok(chunk);
    }
    let value: Value = serde_json::from_slice(data).map_err(|e| {
        Failure::backend(
            "backend_error",
            format!("backend sent bad data: {e}"),
            false,
        )
    })?;
    Ok(from_value(value))
}

fn from_value(value: Value) -> Json {
    match value {
        Value::Null => Json::Null,
        Value::Bool(b) => Json::Bool(b),
        Value::Number(n) => n.as_i64().map_or_else(
            || {
                n.as_u64().map_or_else(
                    || Json::Float(n.as_f64().unwrap_or(0.0)),
                    |u| Json::Int(i128::from(u)),
                )
            },
            |i| Json::Int(i128::from(i)),
        ),
        Value::String(s) => Json::Str(s),
        Value::Array(items) => Json::Array(items.into_iter().map(from_value).collect()),
        Value::Object(map) => {
            Json::Object(map.into_iter().map(|(k, v)| (k, from_value(v))).collect())
        }
    }
}

fn get<'a>(pairs: &'a [(String, Json)], key: &str) -> Option<&'a Json> {
    pairs.iter().find(|(k, _)| k == key).map(|(_, v)| v)
}

/// `d[key] = value`: a key it has keeps its place.
fn set(pairs: &mut Vec<(String, Json)>, key: &str, value: Json) {
    match pairs.iter_mut().find(|(k, _)| k == key) {
        Some((_, slot)) => *slot = value,
        None => pairs.push((key.to_owned(), value)),
    }
}

/// `encode_event(chunk)`.
fn python_frame(chunk: &Json) -> Vec<u8> {
    let mut out = b"data: ".to_vec();
    json::write(&mut out, chunk, ENCODE_EVENT);
    out.extend_from_slice(b"\n\n");
    out
}

fn has_text(choice: &Json) -> bool {
    let text = |v: Option<&Json>| matches!(v, Some(Json::Str(s)) if !s.is_empty());
    if let Some(delta) = choice.get("delta") {
        let Json::Object(_) = delta else {
            return false;
        };
        return TEXT_DELTAS.iter().any(|k| text(delta.get(k)));
    }
    text(choice.get("text"))
}

/// What is wrong with a chunk's shape, if anything: `choices` a list of objects whose `delta`
/// (when present) is an object, `usage` an object (`gateway/streaming.py` checks the same).
fn malformed(chunk: &[(String, Json)]) -> Option<&'static str> {
    match get(chunk, "choices") {
        None | Some(Json::Null) => {}
        Some(Json::Array(choices)) => {
            for choice in choices {
                let Json::Object(_) = choice else {
                    return Some("a choice that is not an object");
                };
                if !matches!(
                    choice.get("delta"),
                    None | Some(Json::Null | Json::Object(_))
                ) {
                    return Some("a choice whose delta is not an object");
                }
            }
        }
        Some(_) => return Some("choices that are not a list"),
    }
    match get(chunk, "usage") {
        None | Some(Json::Null | Json::Object(_)) => None,
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

/// Coalesce consecutive frames into as few valid chunks as possible, order kept
/// (`merge_chunks`): with two or more, every frame is read and written again as
/// `encode_event` writes it; a frame that does not read stays as it is.
pub fn merge_frames(frames: Vec<Vec<u8>>) -> Vec<Vec<u8>> {
    if frames.len() < 2 {
        return frames;
    }
    let mut out: Vec<Result<Json, Vec<u8>>> = Vec::with_capacity(frames.len());
    for frame in frames {
        let parsed = frame
            .strip_prefix(b"data: ")
            .and_then(|f| f.strip_suffix(b"\n\n"))
            .and_then(|p| read(p).ok());
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
        .map(|item| item.map_or_else(|raw| raw, |v| python_frame(&v)))
        .collect()
}

/// `_merge_into`: fold chunk `b` into `a` when the result is itself a valid chunk.
fn merge_into(a: &mut Json, b: &Json) -> bool {
    let (Some(Json::Array(ca)), Some(Json::Array(cb))) = (a.get("choices"), b.get("choices"))
    else {
        return false;
    };
    if ca.is_empty()
        || cb.is_empty()
        || a.get("object") != b.get("object")
        || b.get("error").is_some()
    {
        return false;
    }
    // The last choice of an index, as Python's `{index: choice}` keeps it (a chunk naming one
    // index twice is not vLLM's, but the two paths must still agree on it).
    for choice_b in cb {
        if let Some(choice_a) = ca.iter().rev().find(|c| index(c) == index(choice_b)) {
            if !mergeable(choice_a, choice_b) {
                return false;
            }
        }
    }
    let Json::Object(pairs) = a else {
        return false;
    };
    let Some((_, Json::Array(ca))) = pairs.iter_mut().find(|(k, _)| k == "choices") else {
        return false;
    };
    for choice_b in cb {
        match ca.iter_mut().rev().find(|c| index(c) == index(choice_b)) {
            Some(choice_a) => merge_choice(choice_a, choice_b),
            None => ca.push(choice_b.clone()),
        }
    }
    for key in ["usage", "llmflow"] {
        if let Some(v) = b.get(key) {
            set(pairs, key, v.clone());
        }
    }
    true
}

/// `choice.get("index", 0)`.
fn index(choice: &Json) -> Json {
    choice.get("index").cloned().unwrap_or(Json::Int(0))
}

/// `v in (None, "", [])`.
fn empty(v: &Json) -> bool {
    match v {
        Json::Null => true,
        Json::Str(s) => s.is_empty(),
        Json::Array(a) => a.is_empty(),
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

/// `_choice_mergeable`: neither carries more than text (an open choice, no logprobs, no
/// other field, no delta but text and the role).
fn mergeable(ca: &Json, cb: &Json) -> bool {
    let truthy = |c: &Json, key: &str| c.get(key).is_some_and(Json::truthy);
    if ca.get("finish_reason").is_some_and(|f| *f != Json::Null)
        || truthy(ca, "logprobs")
        || truthy(cb, "logprobs")
    {
        return false;
    }
    let keys_ok = |c: &Json| match c {
        Json::Object(pairs) => pairs
            .iter()
            .all(|(k, _)| MERGEABLE_KEYS.contains(&k.as_str())),
        _ => false,
    };
    if !keys_ok(ca) || !keys_ok(cb) {
        return false;
    }
    // A `"delta": null` (not vLLM's) goes out as it came, unmerged, as in Python.
    let delta_ok = |c: &Json| match c.get("delta") {
        Some(Json::Object(delta)) => delta
            .iter()
            .all(|(k, v)| TEXT_DELTAS.contains(&k.as_str()) || k == "role" || empty(v)),
        Some(_) => false,
        None => true,
    };
    delta_ok(ca) && delta_ok(cb)
}

/// `_merge_choice`: `cb`'s text after `ca`'s, its finish and stop reasons.
fn merge_choice(ca: &mut Json, cb: &Json) {
    let Json::Object(a) = ca else {
        return;
    };
    let text_of = |v: Option<&Json>| match v {
        Some(Json::Str(s)) => s.clone(),
        _ => String::new(),
    };
    if cb.get("text").is_some() {
        let joined = text_of(get(a, "text")) + &text_of(cb.get("text"));
        set(a, "text", Json::Str(joined));
    }
    if let Some(delta_b) = cb.get("delta") {
        if !matches!(get(a, "delta"), Some(Json::Object(_))) {
            set(a, "delta", Json::Object(Vec::new()));
        }
        let Some((_, Json::Object(delta))) = a.iter_mut().find(|(k, _)| k == "delta") else {
            unreachable!("set to an object above");
        };
        if let Json::Object(pairs) = delta_b {
            for (key, value) in pairs {
                if TEXT_DELTAS.contains(&key.as_str()) {
                    if let Json::Str(s) = value {
                        let joined = text_of(get(delta, key)) + s;
                        set(delta, key, Json::Str(joined));
                    }
                } else if key == "role" && get(delta, "role").is_none() {
                    delta.push((key.clone(), value.clone()));
                }
            }
        }
    }
    let finish = cb.get("finish_reason").cloned().unwrap_or(Json::Null);
    set(a, "finish_reason", finish);
    if let Some(stop) = cb.get("stop_reason") {
        set(a, "stop_reason", stop.clone());
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
        assert_eq!(s.open_choices(), [0]);
        s.feed(&chunk(4, "d", "\"length\"")).unwrap();
        assert!(s.open_choices().is_empty());
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
        let fed = s.feed(usage).unwrap();
        assert_eq!((fed.before.len(), fed.frame), (1, None)); // the usage chunk is not asked for
        let frame = String::from_utf8(fed.before[0].clone()).unwrap();
        let sent: Value = serde_json::from_str(frame.trim().trim_start_matches("data: ")).unwrap();
        assert_eq!(sent["system_fingerprint"], "fp-1");
        assert_eq!(sent["choices"][0]["finish_reason"], "length");
        assert!(sent.get("usage").is_none());
        assert!(s.take_held().is_empty());
        let mut cut = ChunkShaper::new(false);
        cut.feed(&chunk(1, "a", "\"stop\"")).unwrap();
        assert_eq!(cut.take_held().len(), 1); // a stream that ends without it still sends it
    }

    fn choice_chunk(index: u64, text: &str, finish: &str, done: u64) -> Vec<u8> {
        format!(
            r#"{{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{{"index":{index},"delta":{{"content":"{text}"}},"logprobs":null,"finish_reason":{finish}}}],"usage":{{"prompt_tokens":3,"total_tokens":{},"completion_tokens":{done}}}}}"#,
            done + 3
        )
        .into_bytes()
    }

    // Continuous usage asked: each chunk keeps its usage, written as Python writes it (its
    // keys in their order, non-ASCII escaped).
    #[test]
    fn continuous_usage_keeps_each_chunks_usage_in_pythons_bytes() {
        let mut s = ChunkShaper::shaped(false, true, 1);
        for (i, text) in ["a", r"\u00e9"].iter().enumerate() {
            let raw = choice_chunk(0, text, "null", i as u64 + 1);
            let frame = s.feed(&raw).unwrap().frame.unwrap();
            let mut expected = b"data: ".to_vec();
            expected.extend_from_slice(&raw);
            expected.extend_from_slice(b"\n\n");
            assert_eq!(
                String::from_utf8(frame).unwrap(),
                String::from_utf8(expected).unwrap()
            );
        }
        assert_eq!(s.completion_tokens(), 2);
    }

    // Two choices, no usage asked: a choice that finishes first waits, with the other's, for
    // the usage chunk's fingerprint; a cut names only the choice still open.
    #[test]
    fn several_choices_hold_their_finishing_chunks_and_a_cut_names_the_open_ones() {
        let mut s = ChunkShaper::shaped(false, false, 3);
        assert!(s
            .feed(&choice_chunk(0, "a", "\"stop\"", 1))
            .unwrap()
            .frame
            .is_none());
        let other = s
            .feed(&choice_chunk(1, "b", "null", 2))
            .unwrap()
            .frame
            .unwrap();
        assert!(String::from_utf8(other).unwrap().contains(r#""index":1"#));
        assert_eq!(s.open_choices(), [1, 2]);
        let named = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = std::sync::Arc::clone(&named);
        let notice = move |open: &[u64], template: Option<&str>| {
            assert_eq!(template, Some(r#"{"id":"c1","created":1,"model":"m"}"#));
            seen.lock().unwrap().extend_from_slice(open);
            b"data: notice\n\n".to_vec()
        };
        let (frames, noticed) = s.cut(Ending::Notice(Box::new(notice)));
        assert_eq!(*named.lock().unwrap(), [1, 2]);
        assert_eq!(frames.len(), 2); // the held chunk of choice 0, then the notice
        assert!(noticed);
        assert!(String::from_utf8_lossy(&frames[0]).contains(r#""finish_reason":"stop""#));
        let mut done = ChunkShaper::shaped(false, false, 1);
        done.feed(&choice_chunk(0, "a", "\"stop\"", 1)).unwrap();
        let (cut, noticed) = done.cut(Ending::Notice(Box::new(
            |_: &[u64], _: Option<&str>| unreachable!(),
        )));
        assert_eq!(cut.len(), 1); // every choice finished: no notice
        assert!(!noticed);
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
