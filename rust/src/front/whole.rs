//! A non-streamed reply assembled from the upstream stream, as the deleted Python path did.
//!
//! The gateway always streams upstream; a client that asked for one JSON object gets the
//! stream's chunks folded into the shape vLLM gives an unstreamed request. This is the twin of
//! that path's `Accumulator` (kept as the tests' reference model,
//! `tests/gateway/reference/whole.py`) fed as its session fed it (every chunk that is not an
//! error, the tail of a cut, `response(parser.usage)`); `ChunkParser.feed`'s shape checks are
//! the relay's (`relay::chunk::ChunkShaper`, which sees every payload before this does), and
//! its bytes are those of `JSONResponse`: Python's key order, `ensure_ascii=False`, compact
//! separators. `property_tests/test_whole_reply.py` holds it against that reference on random
//! streams.
//!
//! What the Python fold would hold in a way this tree cannot (an index that is not an integer,
//! a number or key `json.rs` declines), and what makes the Python fold raise (a tool call that
//! is not an object, arguments that are not text), is [`Unread`]: the request fails as the
//! Python path fails a reply it could not read (502).

use super::json::{self, Json};
use super::prepare::Endpoint;
use super::reply::{tail_chunk, Cut, STARLETTE};

/// vLLM's non-streamed reply, field by field and in its order (`streaming._TOP`, `_CHOICE`,
/// `_MESSAGE`, `_USAGE`).
const TOP_COMPLETIONS: &[&str] = &[
    "id",
    "object",
    "created",
    "model",
    "choices",
    "service_tier",
    "system_fingerprint",
    "usage",
    "kv_transfer_params",
    "ec_transfer_params",
    "metrics",
];
const TOP_CHAT: &[&str] = &[
    "id",
    "object",
    "created",
    "model",
    "choices",
    "service_tier",
    "system_fingerprint",
    "usage",
    "prompt_logprobs",
    "prompt_token_ids",
    "prompt_text",
    "kv_transfer_params",
    "ec_transfer_params",
    "metrics",
];
const CHOICE_COMPLETIONS: &[&str] = &[
    "index",
    "text",
    "logprobs",
    "finish_reason",
    "stop_reason",
    "token_ids",
    "prompt_logprobs",
    "prompt_token_ids",
    "routed_experts",
];
const CHOICE_CHAT: &[&str] = &[
    "index",
    "message",
    "logprobs",
    "finish_reason",
    "stop_reason",
    "token_ids",
    "routed_experts",
];
const MESSAGE: &[&str] = &[
    "role",
    "content",
    "refusal",
    "annotations",
    "audio",
    "function_call",
    "reasoning",
];
const USAGE: &[&str] = &[
    "prompt_tokens",
    "total_tokens",
    "completion_tokens",
    "prompt_tokens_details",
    "completion_tokens_details",
];
/// A chunk's fields the fold reads itself (`_FRAME`); the others are the reply's own.
const FRAME: &[&str] = &[
    "id", "object", "created", "model", "choices", "usage", "llmflow",
];
/// A choice's fields the fold reads itself (`_FOLDED`, and `stop_reason`).
const FOLDED: &[&str] = &[
    "index",
    "text",
    "delta",
    "logprobs",
    "finish_reason",
    "token_ids",
    "stop_reason",
];

/// A chunk the fold cannot take as the Python path takes it: the request fails (502).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unread;

impl Unread {
    /// The failure's message (`StreamSession._read`'s).
    pub fn message(&self) -> String {
        "the gateway could not read the backend's reply".to_owned()
    }
}

/// A reply assembled whole, of its endpoint's kind: completion chunks folded ([`Whole`]), or
/// Responses events kept (`responses::Whole`: the final `response` object).
#[derive(Debug, Clone)]
pub enum Assembled {
    Chunks(Whole),
    Events(super::responses::Whole),
}

impl Assembled {
    /// See [`Whole::new`].
    pub fn new(endpoint: Endpoint, model: &str, n: u64) -> Self {
        match endpoint {
            Endpoint::Responses => Self::Events(super::responses::Whole::default()),
            _ => Self::Chunks(Whole::new(endpoint, model, n)),
        }
    }

    /// Fold one upstream payload in.
    ///
    /// # Errors
    /// As [`Whole::feed`].
    pub fn feed(&mut self, payload: &[u8]) -> Result<(), Unread> {
        match self {
            Self::Chunks(whole) => whole.feed(payload),
            Self::Events(whole) => whole.feed(payload),
        }
    }

    /// The runtime cut it for `reason`: returns whether the reply was truncated.
    pub fn cut(&mut self, reason: &str, request_id: u64, now_s: u64) -> bool {
        match self {
            Self::Chunks(whole) => whole.cut(reason, request_id, now_s),
            Self::Events(whole) => whole.cut(reason),
        }
    }

    /// The reply's JSON body; `end`: how the request ended (a Responses reply without its
    /// `response` object is marked incomplete with it).
    pub fn body(&self, now_s: u64, end: &str) -> Vec<u8> {
        match self {
            Self::Chunks(whole) => whole.body(now_s),
            Self::Events(whole) => whole.body(end),
        }
    }
}

/// The body of vLLM's answer to a request sent unstreamed, as `JSONResponse(answer)` renders
/// it (the Python path's `json.loads`, then Starlette's rendering); an answer this reader does
/// not hold as Python does (a key twice, an integer past 64 bits) goes as vLLM wrote it.
pub fn answer_body(answer: &[u8]) -> Vec<u8> {
    json::parse(answer).map_or_else(|| answer.to_vec(), |a| json::to_vec(&a, STARLETTE))
}

/// One tool call being assembled: `{"function": {"arguments", "name"?}, "id"?, "type"?}`.
#[derive(Debug, Clone, Default)]
struct Tool {
    arguments: String,
    name: Option<Json>,
    /// `id` and `type`, in the order they first came.
    rest: Vec<(String, Json)>,
}

/// One choice being assembled (`Accumulator._choices`' values).
#[derive(Debug, Clone, Default)]
struct Choice {
    text: String,
    /// Text of the reasoning deltas, once one came (an empty one counts).
    reasoning: Option<String>,
    tools: Vec<(i128, Tool)>,
    logprobs: Option<Vec<(String, Vec<Json>)>>,
    token_ids: Option<Vec<Json>>,
    finish_reason: Option<Json>,
    stop_reason: Option<Json>,
    /// The fields a choice carried that the fold does not read (`prompt_token_ids`, newer).
    extra: Vec<(String, Json)>,
}

/// The reply being assembled from one stream's chunks.
#[derive(Debug, Clone)]
pub struct Whole {
    endpoint: Endpoint,
    /// The model the client named (the reply's, when no chunk named one).
    model: String,
    /// The choices asked for (`n`, times the prompts of a batch): the reply has each.
    n: u64,
    choices: Vec<(i128, Choice)>,
    /// `{"id","created","model"}` of the first chunk that had an id, in its order.
    template: Option<Vec<(String, Json)>>,
    marker: Option<Json>,
    /// Top-level fields the stream carried (`system_fingerprint`, ...).
    extra: Vec<(String, Json)>,
    /// The last usage object the stream carried (`ChunkParser.usage`).
    usage: Option<Json>,
    /// Indexes of choices that sent a finish reason (`ChunkParser.finished`).
    finished: Vec<i128>,
}

impl Whole {
    /// `n`: the choices asked for (`ClientOptions.n`).
    pub fn new(endpoint: Endpoint, model: &str, n: u64) -> Self {
        Self {
            endpoint,
            model: model.to_owned(),
            n,
            choices: Vec::new(),
            template: None,
            marker: None,
            extra: Vec::new(),
            usage: None,
            finished: Vec::new(),
        }
    }

    /// Fold one upstream payload in (`ChunkParser.feed`, then `Accumulator.add`).
    ///
    /// # Errors
    /// The payload is not a chunk the Python path folds the same way ([`Unread`]).
    pub fn feed(&mut self, payload: &[u8]) -> Result<(), Unread> {
        let chunk = json::parse(payload).ok_or(Unread)?;
        if chunk.get("error").is_some() {
            return Err(Unread); // the relay fails a stream on its in-band error first
        }
        self.add(&chunk)
    }

    /// A cut: the tail chunk with the notice and the marker folded in, for the choices still
    /// open (`StreamSession.on_cut` for a reply not streamed). Returns whether one was.
    pub fn cut(&mut self, reason: &str, request_id: u64, now_s: u64) -> bool {
        let open: Vec<u64> = (0..self.n)
            .filter(|&i| !self.finished.contains(&i128::from(i)))
            .collect();
        if open.is_empty() {
            return false;
        }
        let cut = Cut {
            endpoint: self.endpoint,
            model: &self.model,
            template: None,
            open_choices: &open,
            reason,
            request_id,
            now_s,
        };
        let tail = tail_chunk(&cut, self.template.clone());
        self.add(&tail)
            .expect("the tail chunk is one the fold takes");
        true
    }

    /// The reply's JSON body, as `JSONResponse(Accumulator.response(usage))` writes it;
    /// `now_s`: the clock's whole seconds, for the `created` of a reply no chunk named.
    pub fn body(&self, now_s: u64) -> Vec<u8> {
        json::to_vec(&self.response(now_s), STARLETTE)
    }

    fn add(&mut self, chunk: &Json) -> Result<(), Unread> {
        let Json::Object(pairs) = chunk else {
            return Err(Unread);
        };
        let choices = match chunk.get("choices") {
            Some(Json::Array(choices)) => choices.as_slice(),
            _ => &[],
        };
        // Check every index first: a chunk the Python fold would raise on changes nothing here.
        let mut indexes = Vec::with_capacity(choices.len());
        for choice in choices {
            indexes.push(index_of(choice)?);
            check_tools(choice)?;
        }
        if self.template.is_none() && chunk.get("id").is_some() {
            let template = ["id", "created", "model"]
                .iter()
                .filter_map(|k| chunk.get(k).map(|v| ((*k).to_owned(), v.clone())))
                .collect();
            self.template = Some(template);
        }
        if let Some(usage @ Json::Object(_)) = chunk.get("usage") {
            self.usage = Some(usage.clone());
        }
        for (choice, &index) in choices.iter().zip(&indexes) {
            if choice
                .get("finish_reason")
                .is_some_and(|f| *f != Json::Null)
                && !self.finished.contains(&index)
            {
                self.finished.push(index);
            }
        }
        if let Some(marker) = chunk.get("llmflow") {
            self.marker = Some(marker.clone());
        }
        for (key, value) in pairs {
            if !FRAME.contains(&key.as_str()) && *value != Json::Null {
                set(&mut self.extra, key, value.clone());
            }
        }
        for (choice, index) in choices.iter().zip(indexes) {
            let slot = entry(&mut self.choices, index);
            fold(slot, choice)?;
        }
        Ok(())
    }

    /// `Accumulator.response(usage)`.
    fn response(&self, now_s: u64) -> Json {
        let chat = self.endpoint == Endpoint::Chat;
        let base = self.template.clone().unwrap_or_else(|| {
            vec![
                ("id".to_owned(), Json::Str("llmflow".to_owned())),
                ("created".to_owned(), Json::Int(i128::from(now_s))),
                ("model".to_owned(), Json::Str(self.model.clone())),
            ]
        });
        // `sorted(set(self._choices) | set(range(n)))`
        let mut indexes: Vec<i128> = self.choices.iter().map(|(i, _)| *i).collect();
        indexes.extend((0..self.n).map(i128::from));
        indexes.sort_unstable();
        indexes.dedup();
        let empty = Choice::default();
        let choices = indexes
            .iter()
            .map(|&i| {
                let acc = self
                    .choices
                    .iter()
                    .find(|(at, _)| *at == i)
                    .map_or(&empty, |(_, c)| c);
                finish_choice(i, acc, chat)
            })
            .collect();
        let usage = self.usage.as_ref().map_or(Json::Null, |usage| {
            let mut out: Vec<(String, Json)> = USAGE
                .iter()
                .map(|k| ((*k).to_owned(), usage.get(k).cloned().unwrap_or(Json::Null)))
                .collect();
            if let Json::Object(pairs) = usage {
                for (key, value) in pairs {
                    set(&mut out, key, value.clone());
                }
            }
            Json::Object(out)
        });
        let object = if chat {
            "chat.completion"
        } else {
            "text_completion"
        };
        let mut known = self.extra.clone();
        for (key, value) in base {
            set(&mut known, &key, value);
        }
        set(&mut known, "object", Json::Str(object.to_owned()));
        set(&mut known, "choices", Json::Array(choices));
        set(&mut known, "usage", usage);
        let mut body = ordered(known, if chat { TOP_CHAT } else { TOP_COMPLETIONS });
        if let Some(marker) = self.marker.as_ref().filter(|m| **m != Json::Null) {
            set(&mut body, "llmflow", marker.clone());
        }
        Json::Object(body)
    }
}

/// `choice.get("index", 0)`, where it is an integer (Python would key a float or a string
/// as itself, and fail to sort a mix).
fn index_of(item: &Json) -> Result<i128, Unread> {
    match item.get("index") {
        None => Ok(0),
        Some(Json::Int(i)) => Ok(*i),
        Some(_) => Err(Unread),
    }
}

/// Whether `_fold` takes this choice's tool calls without raising.
fn check_tools(choice: &Json) -> Result<(), Unread> {
    let Some(calls) = choice.get("delta").and_then(|d| d.get("tool_calls")) else {
        return Ok(());
    };
    if !calls.truthy() {
        return Ok(()); // `delta.get("tool_calls") or ()`
    }
    let Json::Array(calls) = calls else {
        return Err(Unread);
    };
    for call in calls {
        if !matches!(call, Json::Object(_)) {
            return Err(Unread);
        }
        index_of(call)?;
        if let Some(function) = call.get("function").filter(|f| f.truthy()) {
            if !matches!(function, Json::Object(_)) {
                return Err(Unread);
            }
            match function.get("arguments") {
                Some(Json::Str(_)) | None => {}
                Some(other) if !other.truthy() => {}
                Some(_) => return Err(Unread), // `str += <not str>`
            }
        }
    }
    Ok(())
}

/// `_fold`: one choice of a chunk into its slot (its tool calls checked already).
fn fold(acc: &mut Choice, choice: &Json) -> Result<(), Unread> {
    let delta = choice.get("delta").filter(|d| **d != Json::Null);
    if delta.is_none() {
        if let Some(Json::Str(text)) = choice.get("text") {
            acc.text.push_str(text);
        }
    }
    if let Some(delta) = delta {
        if let Some(Json::Str(content)) = delta.get("content") {
            acc.text.push_str(content);
        }
        for key in ["reasoning", "reasoning_content"] {
            if let Some(Json::Str(text)) = delta.get(key) {
                acc.reasoning.get_or_insert_with(String::new).push_str(text);
            }
        }
        if let Some(Json::Array(calls)) = delta.get("tool_calls") {
            for call in calls {
                fold_tool(acc, call)?;
            }
        }
    }
    if let Some(Json::Object(logprobs)) = choice.get("logprobs") {
        let merged = acc.logprobs.get_or_insert_with(Vec::new);
        for (key, value) in logprobs {
            let items = entry(merged, key.clone());
            match value {
                Json::Array(values) => items.extend(values.iter().cloned()),
                other => items.push(other.clone()),
            }
        }
    }
    if let Some(Json::Array(ids)) = choice.get("token_ids") {
        acc.token_ids
            .get_or_insert_with(Vec::new)
            .extend(ids.iter().cloned());
    }
    if let Some(reason) = choice.get("finish_reason").filter(|f| **f != Json::Null) {
        acc.finish_reason = Some(reason.clone());
    }
    if let Some(stop) = choice.get("stop_reason") {
        acc.stop_reason = Some(stop.clone());
    }
    if let Json::Object(pairs) = choice {
        for (key, value) in pairs {
            if !FOLDED.contains(&key.as_str()) && *value != Json::Null {
                set(&mut acc.extra, key, value.clone());
            }
        }
    }
    Ok(())
}

/// One tool call delta into its slot (by its index).
fn fold_tool(acc: &mut Choice, call: &Json) -> Result<(), Unread> {
    let index = index_of(call)?;
    let slot = entry(&mut acc.tools, index);
    for key in ["id", "type"] {
        if let Some(value) = call.get(key).filter(|v| v.truthy()) {
            set(&mut slot.rest, key, value.clone());
        }
    }
    let function = call.get("function").filter(|f| f.truthy());
    if let Some(name) = function.and_then(|f| f.get("name")).filter(|n| n.truthy()) {
        slot.name = Some(name.clone());
    }
    if let Some(Json::Str(arguments)) = function.and_then(|f| f.get("arguments")) {
        slot.arguments.push_str(arguments);
    }
    Ok(())
}

/// `_finish_choice`: one choice of the reply.
fn finish_choice(index: i128, acc: &Choice, chat: bool) -> Json {
    let mut known = acc.extra.clone();
    let logprobs = acc.logprobs.as_ref().map_or(Json::Null, |merged| {
        Json::Object(
            merged
                .iter()
                .map(|(k, v)| (k.clone(), Json::Array(v.clone())))
                .collect(),
        )
    });
    let or_null = |v: &Option<Json>| v.clone().unwrap_or(Json::Null);
    set(&mut known, "index", Json::Int(index));
    set(&mut known, "logprobs", logprobs);
    set(&mut known, "finish_reason", or_null(&acc.finish_reason));
    set(&mut known, "stop_reason", or_null(&acc.stop_reason));
    let token_ids = acc.token_ids.clone().map_or(Json::Null, Json::Array);
    set(&mut known, "token_ids", token_ids);
    if chat {
        let mut message: Vec<(String, Json)> = MESSAGE
            .iter()
            .map(|k| ((*k).to_owned(), Json::Null))
            .collect();
        set(&mut message, "role", Json::Str("assistant".to_owned()));
        set(&mut message, "content", Json::Str(acc.text.clone()));
        if let Some(reasoning) = &acc.reasoning {
            set(&mut message, "reasoning", Json::Str(reasoning.clone()));
        }
        if !acc.tools.is_empty() {
            let mut tools: Vec<&(i128, Tool)> = acc.tools.iter().collect();
            tools.sort_by_key(|(i, _)| *i);
            let calls = tools.into_iter().map(|(_, t)| tool_json(t)).collect();
            set(&mut message, "tool_calls", Json::Array(calls));
        }
        set(&mut known, "message", Json::Object(message));
    } else {
        set(&mut known, "text", Json::Str(acc.text.clone()));
    }
    Json::Object(ordered(
        known,
        if chat {
            CHOICE_CHAT
        } else {
            CHOICE_COMPLETIONS
        },
    ))
}

fn tool_json(tool: &Tool) -> Json {
    let mut function = vec![("arguments".to_owned(), Json::Str(tool.arguments.clone()))];
    if let Some(name) = &tool.name {
        function.push(("name".to_owned(), name.clone()));
    }
    let mut out = vec![("function".to_owned(), Json::Object(function))];
    out.extend(tool.rest.iter().cloned());
    Json::Object(out)
}

/// `{key: known.get(key) for key in fields}`, then the rest of `known` in its order.
fn ordered(known: Vec<(String, Json)>, fields: &[&str]) -> Vec<(String, Json)> {
    let mut out: Vec<(String, Json)> = fields
        .iter()
        .map(|k| {
            let value = known
                .iter()
                .find(|(key, _)| key == k)
                .map_or(Json::Null, |(_, v)| v.clone());
            ((*k).to_owned(), value)
        })
        .collect();
    out.extend(
        known
            .into_iter()
            .filter(|(key, _)| !fields.contains(&key.as_str())),
    );
    out
}

/// `d.setdefault(key, default)` on an ordered map.
fn entry<K: PartialEq, V: Default>(items: &mut Vec<(K, V)>, key: K) -> &mut V {
    let at = items
        .iter()
        .position(|(k, _)| *k == key)
        .unwrap_or_else(|| {
            items.push((key, V::default()));
            items.len() - 1
        });
    &mut items[at].1
}

/// `d[key] = value` on an ordered object: a key it has keeps its place.
fn set(pairs: &mut Vec<(String, Json)>, key: &str, value: Json) {
    match pairs.iter_mut().find(|(k, _)| k == key) {
        Some((_, slot)) => *slot = value,
        None => pairs.push((key.to_owned(), value)),
    }
}

#[cfg(test)]
mod tests;
