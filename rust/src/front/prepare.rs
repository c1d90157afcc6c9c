//! `CompletionService.prepare` (`gateway/serving.py`) for the native front: a body checked
//! completely, without touching a backend, into the values the runtime and the upstream get.
//!
//! The native path serves a request only when this says yes, so yes must mean Python's
//! `prepare` takes the same body with the same values: every check it makes (the strict
//! decoder, the request models, `stream_options`, streaming on, a known model, the limits,
//! the context) is made here. A body it would refuse is refused here with Python's error
//! (`NotServed::Refused`: the front answers it, byte for byte as the app would). The body is
//! read as pydantic-core reads it (`decode.rs`) and every field as pydantic judges it, so the
//! checks are sure of every body the property tests draw (`tests/gateway/test_front_checks.py`
//! fails on an unsure one); `NotServed::Unsure` is left for the two walks of a body
//! (`request.rs` and `invalid.rs`) disagreeing: a bug, which the front answers with a 500.

use std::collections::{HashMap, HashSet};

use super::json::{self, Json, Style};
use super::prompt;
use super::reply::ErrorReply;
use super::request::{self, Request};

/// Why the checks do not serve a request.
#[derive(Debug, Clone, PartialEq)]
pub enum NotServed {
    /// Python refuses it with this error (`GatewayError`), before the runtime hears of it.
    Refused(Box<ErrorReply>),
    /// The strict reading refused a field that pydantic's walk (`invalid.rs`) passes, or an
    /// estimate overflowed: none is known; the front answers it with a 500.
    Unsure,
}

/// The governed routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
    /// The Responses API (`responses.rs`): vLLM's events, not chunks.
    Responses,
}

impl Endpoint {
    /// The path vLLM serves it on (`serving._PATHS`).
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Responses => "/v1/responses",
        }
    }
}

/// What `prepare` reads of the config: `CompletionService`'s arguments.
#[derive(Debug, Clone)]
pub struct FrontConfig {
    /// Served model name (and alias) -> context length, the smallest among its backends.
    pub models: HashMap<String, u64>,
    /// Alias -> the served model it routes to.
    pub aliases: HashMap<String, String>,
    /// Served models whose pool routes by prefix (their requests carry block hashes).
    pub prefix_models: HashSet<String>,
    /// Tokens per KV block (`kv.block_size`).
    pub block_size: u64,
    /// UTF-8 bytes per token of the prompt estimate (`server.bytes_per_token`).
    pub bytes_per_token: f64,
    /// `streaming.enabled`.
    pub streaming: bool,
    /// `limits.max_messages`, `limits.max_n`, `limits.max_tokens`.
    pub max_messages: u64,
    pub max_n: u64,
    pub max_tokens: Option<u64>,
    /// The key of the body fingerprint: the Python process's own, so both paths agree.
    pub fingerprint_key: Vec<u8>,
}

/// A checked request: every value of Python's `Prepared` and `ClientOptions` but the
/// identity (tenant and tier come from the API key, `auth.rs`) and the signals.
#[derive(Debug, Clone, PartialEq)]
#[allow(clippy::struct_excessive_bools)] // Python's fields, one for one
pub struct Prepared {
    pub endpoint: Endpoint,
    /// The model the client named (an alias stays an alias in the reply).
    pub asked_model: String,
    /// The served model it routes to.
    pub model: String,
    pub stream: bool,
    /// Choices in all: `n` for each prompt of a batch.
    pub choices: u64,
    pub include_usage: bool,
    pub continuous_usage: bool,
    /// Every prompt's tokens together (`Prepared.prompt_tokens`).
    pub prompt_tokens: u64,
    /// What the batch may generate at its peak, which the core plans KV for
    /// (`Prepared.max_tokens`).
    pub planned_tokens: u64,
    /// The request's own output bound, after the gateway's cap (`limits.max_tokens`).
    pub max_tokens: Option<u64>,
    /// Block hashes of the prompt, for a model whose pool routes by prefix.
    pub prefix_hashes: Option<Vec<u64>>,
    pub fingerprint: u64,
    /// Sent as the client sent it, unstreamed (it asks for prompt logprobs).
    pub unstreamed: bool,
    /// The body vLLM gets, as an ordered object (`Prepared.body`).
    pub body: Json,
}

impl Prepared {
    /// The upstream body's bytes, as `json.dumps(body).encode()` writes Python's.
    pub fn body_bytes(&self) -> Vec<u8> {
        json::to_vec(&self.body, PYTHON_DUMPS)
    }

    /// `session.upstream_body`'s bytes (see `upstream_body`).
    pub fn upstream_bytes(&self, priority: Option<i64>, max_tokens: Option<u64>) -> Vec<u8> {
        dumps(&self.upstream_body(priority, max_tokens))
    }

    /// `session.upstream_body`: the body with the core's `priority` (a backend scheduling by
    /// priority) and its brownout bound, on the first output bound the body names.
    pub fn upstream_body(&self, priority: Option<i64>, max_tokens: Option<u64>) -> Json {
        let mut body = self.body.clone();
        if let Some(priority) = priority {
            set(&mut body, "priority", Json::Int(i128::from(priority)));
        }
        if let Some(bound) = max_tokens {
            let key = ["max_output_tokens", "max_completion_tokens"]
                .into_iter()
                .find(|k| body.get(k).is_some())
                .unwrap_or("max_tokens");
            set(&mut body, key, Json::Int(i128::from(bound)));
        }
        body
    }
}

/// A body's bytes as Python's upstream client writes them (`json.dumps(body).encode()`).
pub fn dumps(body: &Json) -> Vec<u8> {
    json::to_vec(body, PYTHON_DUMPS)
}

const PYTHON_DUMPS: Style = Style {
    ascii: true,
    sort_keys: false,
    compact: false,
};
// Fields a client may not set (`serving._STRIPPED`): the core computes the priority, and
// kv_transfer_params would pin KV blocks or name a host for the connector to reach.
const STRIPPED: [&str; 2] = ["priority", "kv_transfer_params"];

/// Check a body as `CompletionService.prepare` does; `None` where Python would refuse it
/// (or where this reading is unsure it would not).
pub fn prepare(endpoint: Endpoint, raw: &[u8], config: &FrontConfig) -> Option<Prepared> {
    checked(endpoint, raw, config).ok()
}

/// `prepare`, with Python's error where the reading is sure Python refuses the body.
pub fn checked(
    endpoint: Endpoint,
    raw: &[u8],
    config: &FrontConfig,
) -> Result<Prepared, NotServed> {
    // One JSON object of finite numbers, as `decode_json` takes it, or its 400.
    let body = super::decode::read(raw).map_err(|message| {
        let error = ErrorReply::checks(400, message, "invalid_json", None);
        NotServed::Refused(Box::new(error))
    })?;
    if endpoint == Endpoint::Responses {
        return super::responses::checked(body, raw, config);
    }
    let checked = check(endpoint, &body, config)?;
    let mut upstream = forwarded(body, &STRIPPED, &checked.model);
    if !checked.unstreamed {
        set(&mut upstream, "stream", Json::Bool(true));
        let usage = vec![
            ("include_usage".to_owned(), Json::Bool(true)),
            ("continuous_usage_stats".to_owned(), Json::Bool(true)),
        ];
        set(&mut upstream, "stream_options", Json::Object(usage));
    }
    let longest = checked.prompts.iter().copied().max();
    let (context, longest) = (checked.context, longest.ok_or(NotServed::Unsure)?);
    let mut max_tokens = checked.max_tokens;
    if let (None, Some(cap)) = (max_tokens, config.max_tokens) {
        if cap < context - longest {
            max_tokens = Some(cap); // the gateway's bound holds upstream too
            set(&mut upstream, "max_tokens", Json::Int(i128::from(cap)));
        }
    }
    // KV for the batch at its peak: each prompt's `n` choices up to their bound, clamped to
    // the context the prompt leaves, at least the one token vLLM counts for an echo alone.
    let mut planned = 0u64;
    for p in &checked.prompts {
        let left = context - p;
        let each = max_tokens.map_or(left, |m| m.min(left)).max(1);
        let choices = checked.n.checked_mul(each);
        planned = choices
            .and_then(|c| planned.checked_add(c))
            .ok_or(NotServed::Unsure)?;
    }
    Ok(Prepared {
        endpoint,
        asked_model: checked.asked_model,
        model: checked.model,
        stream: checked.stream,
        choices: checked.choices,
        include_usage: checked.options.is_some_and(|o| o.include_usage),
        continuous_usage: checked.options.is_some_and(|o| o.continuous_usage_stats),
        prompt_tokens: checked.prompts.iter().sum(),
        planned_tokens: planned,
        max_tokens,
        prefix_hashes: checked.hashes,
        fingerprint: fingerprint(raw, &config.fingerprint_key),
        unstreamed: checked.unstreamed,
        body: upstream,
    })
}

/// What the checks derive from a body, before it moves upstream.
struct Checked {
    asked_model: String,
    model: String,
    stream: bool,
    options: Option<request::StreamOptions>,
    n: u64,
    choices: u64,
    max_tokens: Option<u64>,
    context: u64,
    prompts: Vec<u64>,
    hashes: Option<Vec<u64>>,
    unstreamed: bool,
}

/// Every refusal of `prepare`, in its order: the messages' count (before validation, which
/// a million messages would cost), the model's fields, stream options without a stream,
/// streaming off, an unknown model, no output without echo, the limits, the context.
fn check(endpoint: Endpoint, body: &Json, config: &FrontConfig) -> Result<Checked, NotServed> {
    use NotServed::Unsure;
    if !matches!(body, Json::Object(_)) {
        return Err(Unsure);
    }
    if let Some(Json::Array(messages)) = body.get("messages") {
        let limit = config.max_messages;
        if messages.len() as u64 > limit {
            let message = format!(
                "messages has {} entries, over this gateway's limit of {limit} \
                 (limits.max_messages): send fewer, or merge them",
                messages.len()
            );
            return Err(refused(400, message, "too_many_messages", "messages"));
        }
    }
    let parsed = match endpoint {
        Endpoint::Chat => request::chat(body),
        Endpoint::Completions => request::completion(body),
        Endpoint::Responses => unreachable!("checked by `responses::checked`"),
    };
    let Some(request): Option<Request<'_>> = parsed else {
        // pydantic's first error, where this reading is sure of it (`serving._invalid`).
        return Err(super::invalid::first_error(endpoint, body)
            .map_or(Unsure, |(message, param)| {
                refused(400, message, "invalid_request", &param)
            }));
    };
    // vLLM's own check: options only with `stream` (`{}` passes).
    if body.get("stream_options").is_some_and(Json::truthy) && !request.stream {
        let message = "Stream options can only be defined when `stream=True`.".to_owned();
        return Err(refused(400, message, "invalid_request", "stream_options"));
    }
    if request.stream && !config.streaming {
        let message = "streaming is disabled on this gateway (streaming.enabled)".to_owned();
        return Err(refused(400, message, "streaming_disabled", "stream"));
    }
    let Some(&context) = config.models.get(request.model) else {
        let message = format!("The model `{}` does not exist.", request.model);
        return Err(refused(404, message, "model_not_found", "model"));
    };
    let model = config
        .aliases
        .get(request.model)
        .map_or(request.model, String::as_str);
    if endpoint == Endpoint::Completions && request.max_tokens == Some(0) && !request.echo {
        // no output is a request for the echoed prompt alone
        let message = "max_tokens must be at least 1, got 0 (0 is allowed only with echo)";
        return Err(refused(
            400,
            message.to_owned(),
            "invalid_request",
            "max_tokens",
        ));
    }
    let prompts = prompt::prompt_tokens(&request.prompt, config.bytes_per_token);
    let choices = request.n.checked_mul(prompts.len() as u64).ok_or(Unsure)?;
    limits(choices, prompts.len() as u64, request.max_tokens, config)?;
    let longest = prompts.iter().copied().max().unwrap_or(0);
    within_context(longest, request.max_tokens, context)?;
    let hashes = config
        .prefix_models
        .contains(model)
        .then(|| prompt::prefix_hashes(&request.prompt, config.block_size, config.bytes_per_token));
    Ok(Checked {
        asked_model: request.model.to_owned(),
        model: model.to_owned(),
        stream: request.stream,
        options: request.stream_options,
        n: request.n,
        choices,
        max_tokens: request.max_tokens,
        context,
        prompts,
        hashes,
        unstreamed: !request.stream && wants_prompt_logprobs(body),
    })
}

/// The body vLLM gets, before the endpoint's own settings: the client's (moved, no copy of
/// its messages), less the fields it may not set (`stripped`), naming the model the backend
/// serves.
pub(super) fn forwarded(body: Json, stripped: &[&str], model: &str) -> Json {
    let Json::Object(pairs) = body else {
        unreachable!("checked as an object")
    };
    let mut upstream = Json::Object(
        pairs
            .into_iter()
            .filter(|(k, _)| !stripped.contains(&k.as_str()))
            .collect(),
    );
    set(&mut upstream, "model", Json::Str(model.to_owned()));
    upstream
}

/// `GatewayError(status, message, code, param=param)`, Python's refusal of the body.
pub(super) fn refused(status: u16, message: String, code: &str, param: &str) -> NotServed {
    NotServed::Refused(Box::new(ErrorReply::checks(
        status,
        message,
        code,
        Some(param),
    )))
}

/// `serving._check_limits`: the choices of the batch, then the output bound, against the
/// gateway's limits.
fn limits(
    choices: u64,
    prompts: u64,
    max_tokens: Option<u64>,
    config: &FrontConfig,
) -> Result<(), NotServed> {
    let limit = config.max_n;
    if choices > limit {
        let asked = if prompts == 1 {
            format!("n is {choices}")
        } else {
            format!(
                "{prompts} prompts x n {} make {choices} choices",
                choices / prompts
            )
        };
        let message = format!(
            "{asked}, over this gateway's limit of {limit} choices per request (limits.max_n): \
             ask for fewer, or send several requests"
        );
        return Err(refused(400, message, "n_too_large", "n"));
    }
    within_cap("max_tokens", max_tokens, config)
}

/// The output bound a request asks for in `field`, against the gateway's `limits.max_tokens`
/// (`serving._check_limits`; `responses.prepare_response` for `max_output_tokens`).
pub(super) fn within_cap(
    field: &str,
    asked: Option<u64>,
    config: &FrontConfig,
) -> Result<(), NotServed> {
    if let (Some(cap), Some(asked)) = (config.max_tokens, asked) {
        if asked > cap {
            let message = format!(
                "{field} is {asked}, over this gateway's limit of {cap} (limits.max_tokens): \
                 ask for at most {cap}"
            );
            return Err(refused(400, message, "max_tokens_too_large", field));
        }
    }
    Ok(())
}

/// `serving._check_context` (vLLM's rule): a prompt must leave room for one token, and the
/// output bound may not pass the context.
fn within_context(prompt: u64, max_tokens: Option<u64>, context: u64) -> Result<(), NotServed> {
    if prompt >= context {
        let message = format!(
            "This model's maximum context length is {context} tokens. However, your prompt \
             contains about {prompt} tokens, which leaves no room for output. Please reduce the \
             length of the input prompt."
        );
        return Err(refused(
            400,
            message,
            "context_length_exceeded",
            "input_tokens",
        ));
    }
    if let Some(asked) = max_tokens.filter(|&m| m > context) {
        let message = format!(
            "max_tokens={asked} cannot be greater than this model's maximum context length of \
             {context} tokens. Please request fewer output tokens."
        );
        return Err(refused(
            400,
            message,
            "context_length_exceeded",
            "max_tokens",
        ));
    }
    Ok(())
}

/// `session.body_fingerprint`: 64 bits of BLAKE2b keyed with the process's key, read
/// little-endian, never 0 (which means none).
pub fn fingerprint(raw: &[u8], key: &[u8]) -> u64 {
    let hash = blake2b_simd::Params::new()
        .hash_length(8)
        .key(key)
        .hash(raw);
    let bytes: [u8; 8] = hash.as_bytes().try_into().expect("an 8-byte digest");
    u64::from_le_bytes(bytes).max(1)
}

/// `serving._wants_prompt_logprobs`: prompt logprobs asked (`prompt_logprobs` neither null,
/// false nor 0), or the prompt's own logprobs (`echo` with `logprobs`).
fn wants_prompt_logprobs(body: &Json) -> bool {
    let echoed = body.get("echo").is_some_and(Json::truthy)
        && body.get("logprobs").is_some_and(|v| *v != Json::Null);
    let asked = match body.get("prompt_logprobs") {
        None | Some(Json::Null | Json::Bool(false)) => false,
        Some(Json::Int(i)) => *i != 0,
        Some(Json::Float(f)) => *f != 0.0,
        Some(_) => true,
    };
    echoed || asked
}

/// `dict[key] = value`: in place when present (its position kept), else at the end.
pub(crate) fn set(object: &mut Json, key: &str, value: Json) {
    let Json::Object(pairs) = object else {
        unreachable!("an object")
    };
    match pairs.iter_mut().find(|(k, _)| k == key) {
        Some((_, slot)) => *slot = value,
        None => pairs.push((key.to_owned(), value)),
    }
}

#[cfg(test)]
mod tests;
