//! `POST /v1/responses`, served by the front alone (the deleted Python path's
//! `gateway/responses.py` is the tests' goldens and, for its checks, a reference model:
//! `tests/gateway/reference/responses.py`).
//!
//! A response generates tokens, so it takes the completions' path (`governed.rs`, the relay,
//! `whole.rs`); only its shapes differ, and this module holds the front's side of them: the
//! checks of `prepare_response` (the `ResponsesRequest` model, streaming on, a known model,
//! `limits.max_tokens`, the context), the prompt estimate (`_input_tokens`), the body vLLM
//! gets, the reply of a client that asked for no stream (`ResponsesParser`: the final
//! `response` object, or `partial` when cut), and the `event: error` frames of a streamed
//! reply the runtime cut. The relay's side (vLLM's events read, tokens counted, frames as
//! vLLM framed them) is `relay::responses`.

use super::json::{self, Json};
use super::prepare::{
    fingerprint, forwarded, refused, set, within_cap, Endpoint, FrontConfig, NotServed, Prepared,
};
use super::prompt::text_tokens;
use super::reply::{frame, in_band_error, notice_for, STARLETTE};
use super::request::MAX_INT;

const PER_ITEM: u64 = 4; // role markers a chat template adds around each input message
/// Fields a client may not set (`responses._STRIPPED`): the core sets priority, KV transfer
/// is the gateway's, a background reply is not governed.
const STRIPPED: [&str; 3] = ["priority", "kv_transfer_params", "background"];

/// `prepare_response` on a body already decoded as an object (`prepare::checked` decodes it).
pub(super) fn checked(body: Json, raw: &[u8], config: &FrontConfig) -> Result<Prepared, NotServed> {
    if let Some((message, param)) = first_error(&body) {
        return Err(refused(400, message, "invalid_request", &param));
    }
    let model = match body.get("model") {
        Some(Json::Str(model)) => model.clone(),
        _ => unreachable!("validated"),
    };
    let stream = matches!(body.get("stream"), Some(Json::Bool(true)));
    if stream && !config.streaming {
        let message = "streaming is disabled on this gateway (streaming.enabled)".to_owned();
        return Err(refused(400, message, "streaming_disabled", "stream"));
    }
    let Some(&context) = config.models.get(&model) else {
        let message = format!("The model `{model}` does not exist.");
        return Err(refused(404, message, "model_not_found", "model"));
    };
    let prompt = input_tokens(&body, config.bytes_per_token);
    let wanted = match body.get("max_output_tokens") {
        Some(Json::Int(i)) => Some(u64::try_from(*i).expect("validated: 1..=MAX_INT")),
        _ => None,
    };
    within_cap("max_output_tokens", wanted, config)?;
    let output = wanted.unwrap_or(0);
    if prompt >= context || prompt + output > context {
        let message = format!(
            "This model's maximum context length is {context} tokens. However, you requested \
             {} tokens ({prompt} in the input, {output} in the output). Please reduce the \
             length of the input or max_output_tokens.",
            prompt + output
        );
        return Err(refused(400, message, "context_length_exceeded", "input"));
    }
    let mut generated = wanted.unwrap_or(context - prompt);
    if let Some(cap) = config.max_tokens {
        generated = generated.min(cap);
    }
    let served = config.aliases.get(&model).cloned().unwrap_or(model.clone());
    let mut upstream = forwarded(body, &STRIPPED, &served);
    set(&mut upstream, "stream", Json::Bool(true));
    // The bound the core planned with holds upstream.
    set(
        &mut upstream,
        "max_output_tokens",
        Json::Int(i128::from(generated)),
    );
    // Forced off: a stored reply outlives the request and holds a tenant's text on the backend.
    set(&mut upstream, "store", Json::Bool(false));
    Ok(Prepared {
        endpoint: Endpoint::Responses,
        asked_model: model,
        model: served,
        stream,
        choices: 1,
        include_usage: false,
        continuous_usage: false,
        prompt_tokens: prompt,
        planned_tokens: generated,
        max_tokens: Some(generated),
        prefix_hashes: None,
        fingerprint: fingerprint(raw, &config.fingerprint_key),
        unstreamed: false,
        body: upstream,
    })
}

/// pydantic's first error on `ResponsesRequest` (strict; its fields in order: `model`,
/// `input`, `instructions`, `max_output_tokens`, `stream`), as `prepare_response` words it:
/// `{loc}: {msg}`, the loc joined with dots (a union member's tag kept: `input.str`).
fn first_error(body: &Json) -> Option<(String, String)> {
    let error =
        |param: &str, message: &str| Some((format!("{param}: {message}"), param.to_owned()));
    match body.get("model") {
        None => return error("model", "Field required"),
        Some(Json::Str(s)) if s.is_empty() => {
            return error("model", "String should have at least 1 character")
        }
        Some(Json::Str(_)) => {}
        Some(_) => return error("model", "Input should be a valid string"),
    }
    match body.get("input") {
        None => return error("input", "Field required"),
        Some(Json::Str(_)) => {}
        Some(Json::Array(items)) if items.iter().all(|i| matches!(i, Json::Object(_))) => {}
        // `str | list[dict]`: the union's first member names the error.
        Some(_) => return error("input.str", "Input should be a valid string"),
    }
    match body.get("instructions") {
        None | Some(Json::Null | Json::Str(_)) => {}
        Some(_) => return error("instructions", "Input should be a valid string"),
    }
    match body.get("max_output_tokens") {
        None | Some(Json::Null | Json::Int(1..=MAX_INT)) => {}
        Some(Json::Int(i)) if *i < 1 => {
            return error(
                "max_output_tokens",
                "Input should be greater than or equal to 1",
            )
        }
        Some(Json::BigInt(digits)) if digits.starts_with('-') => {
            return error(
                "max_output_tokens",
                "Input should be greater than or equal to 1",
            )
        }
        Some(Json::Int(_) | Json::BigInt(_)) => {
            return error(
                "max_output_tokens",
                "Input should be less than or equal to 2147483647",
            )
        }
        Some(_) => return error("max_output_tokens", "Input should be a valid integer"),
    }
    match body.get("stream") {
        None | Some(Json::Null | Json::Bool(_)) => None,
        Some(_) => error("stream", "Input should be a valid boolean"),
    }
}

/// `_input_tokens`: the instructions and the input, text costed as `text_tokens` costs it,
/// each input item 4 more (a list of items at least 1, as there).
fn input_tokens(body: &Json, bytes_per_token: f64) -> u64 {
    let mut total = match body.get("instructions") {
        Some(Json::Str(text)) if !text.is_empty() => text_tokens(text, bytes_per_token),
        _ => 0,
    };
    match body.get("input") {
        Some(Json::Str(text)) => return total + text_tokens(text, bytes_per_token),
        Some(Json::Array(items)) => {
            for item in items {
                total += PER_ITEM;
                match item.get("content") {
                    Some(Json::Str(text)) => total += text_tokens(text, bytes_per_token),
                    Some(Json::Array(parts)) => {
                        for part in parts {
                            if let Some(Json::Str(text)) = part.get("text") {
                                total += text_tokens(text, bytes_per_token);
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
        _ => {}
    }
    total.max(1)
}

/// The reply of a client that asked for no stream, assembled from vLLM's events as
/// `ResponsesParser` keeps them: the latest `response` object an event carried, and the
/// output text so far (for a cut reply).
#[derive(Debug, Clone, Default)]
pub struct Whole {
    response: Option<Json>,
    text: String,
    /// The runtime cut it (`ResponsesSession._cut`): the reply is `partial`.
    cut: Option<String>,
}

impl Whole {
    /// Fold one event in (`ResponsesParser.feed`; the relay has failed the request on an
    /// `error` or `response.failed` event before this sees it).
    ///
    /// # Errors
    /// The payload is not JSON this reader holds as Python's `json.loads` does.
    pub fn feed(&mut self, payload: &[u8]) -> Result<(), super::whole::Unread> {
        let event = json::parse(payload).ok_or(super::whole::Unread)?;
        if !matches!(event, Json::Object(_)) {
            return Ok(()); // `(None, 0)`: not an event
        }
        let kind = event.get("type");
        if matches!(kind, Some(Json::Str(k)) if k == "response.output_text.delta") {
            if let Some(Json::Str(delta)) = event.get("delta") {
                self.text.push_str(delta);
            }
        }
        if let Some(response @ Json::Object(_)) = event.get("response") {
            self.response = Some(response.clone());
        }
        Ok(())
    }

    /// The runtime cut it for `reason` (`ResponsesSession.on_cut`): a stalled client or an
    /// upstream failure ends it as a completion's; any other reason makes the reply `partial`
    /// (marked incomplete, the notice after the text). Returns whether it was truncated.
    pub fn cut(&mut self, reason: &str) -> bool {
        if matches!(reason, "client_stall" | "upstream_error") {
            return false;
        }
        self.cut = Some(reason.to_owned());
        true
    }

    /// `ResponsesSession.response()`, rendered as `JSONResponse` renders it; `end`: the
    /// request's end (`session.end`), which names a reply that never got a response object.
    pub fn body(&self, end: &str) -> Vec<u8> {
        let reply = match (&self.cut, &self.response) {
            (None, Some(response)) => response.clone(),
            (cut, _) => self.partial(cut.as_deref().unwrap_or(end)),
        };
        json::to_vec(&reply, STARLETTE)
    }

    /// `ResponsesParser.partial(reason)`.
    fn partial(&self, reason: &str) -> Json {
        let mut response = self.response.clone().unwrap_or_else(|| {
            Json::Object(vec![(
                "object".to_owned(),
                Json::Str("response".to_owned()),
            )])
        });
        let text = format!("{}{}", self.text, notice_for(reason));
        let content = Json::Object(vec![
            ("type".to_owned(), Json::Str("output_text".to_owned())),
            ("text".to_owned(), Json::Str(text)),
            ("annotations".to_owned(), Json::Array(Vec::new())),
        ]);
        let message = Json::Object(vec![
            ("type".to_owned(), Json::Str("message".to_owned())),
            ("role".to_owned(), Json::Str("assistant".to_owned())),
            ("status".to_owned(), Json::Str("incomplete".to_owned())),
            ("content".to_owned(), Json::Array(vec![content])),
        ]);
        let details = Json::Object(vec![("reason".to_owned(), Json::Str(reason.to_owned()))]);
        set(&mut response, "status", Json::Str("incomplete".to_owned()));
        set(&mut response, "incomplete_details", details);
        set(&mut response, "output", Json::Array(vec![message]));
        response
    }
}

/// The frame that ends a streamed reply the runtime cut (`ResponsesSession.on_cut`): an
/// `error` event whose code is the reason and whose message is the notice.
pub fn cut_frame(reason: &str) -> Vec<u8> {
    let event = Json::Object(vec![
        ("type".to_owned(), Json::Str("error".to_owned())),
        ("code".to_owned(), Json::Str(reason.to_owned())),
        (
            "message".to_owned(),
            Json::Str(notice_for(reason).trim().to_owned()),
        ),
        ("param".to_owned(), Json::Null),
    ]);
    error_frame(&event)
}

/// `_error_frame({"error": in_band_error(exc)})`: a started stream's failure, as an `error`
/// event: `{"type": "error", **error}` (vLLM's own error object when it refused the request;
/// else ours: `message`, `type: bad_gateway`, `code`).
pub fn upstream_error_frame(error: Option<&str>, message: &str, code: &str) -> Vec<u8> {
    let error = in_band_error(error, message, code);
    let mut event = Json::Object(vec![("type".to_owned(), Json::Str("error".to_owned()))]);
    if let Json::Object(pairs) = error {
        for (key, value) in pairs {
            set(&mut event, &key, value);
        }
    }
    error_frame(&event)
}

/// `b"event: error\ndata: " + json.dumps(event, separators=(",", ":")) + b"\n\n"`.
fn error_frame(event: &Json) -> Vec<u8> {
    frame(b"event: error\ndata: ", event)
}

#[cfg(test)]
mod tests;
