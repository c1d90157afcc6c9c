//! The bytes of the runtime's answers on the native path, as the Python path writes them.
//!
//! A refusal: `session.reply_error` (our message for the reason, `X-Request-Id`,
//! `Retry-After`) rendered as `GatewayError.response()` (OpenAI's error body, the
//! `x-llmflow-reason` header) and written as uvicorn writes it (its
//! status line, the server's default headers, Starlette's `content-length` and
//! `content-type`, `connection: close` when the connection ends). A cut: the tail chunk with
//! its notice (`streaming.tail_chunk`), or the in-band error (`session.in_band_error`), as
//! one SSE frame (`streaming.encode_event`). The JSON is byte for byte Python's: Starlette's
//! `ensure_ascii=False` for a response body, `json.dumps`' ASCII escapes for a frame.

use super::json::{self, Json, Style};
use super::prepare::Endpoint;

// The tail of the refusals that carry Retry-After (`session._LATER`).
macro_rules! later {
    () => {
        "; retry after the Retry-After header's seconds"
    };
}

/// What each refusal says to the client (`session._MESSAGES`); the status and Retry-After
/// are the runtime's.
fn message(reason: &str) -> Option<&'static str> {
    Some(match reason {
        "queue_full" => concat!("the gateway's queue is full", later!()),
        "tier_shed" => {
            concat!(
                "the queue is too full for this API key's tier (tiers[].shed_at)",
                later!()
            )
        }
        "kv_pressure" => {
            concat!(
                "the backends' KV cache is nearly full (kv.pressure_threshold)",
                later!()
            )
        }
        "ttft_sla" => concat!(
            "the work queued ahead would make this request miss its first-token target ",
            "(sla.ttft_ms)",
            later!()
        ),
        "preemption_breaker" => concat!(
            "the backends are preempting requests: fewer are let wait (preemption)",
            later!()
        ),
        "no_healthy_backend" => concat!("no healthy backend serves this model", later!()),
        "draining" => concat!(
            "the gateway is shutting down and takes no new requests; retry elsewhere or ",
            "after the Retry-After header's seconds"
        ),
        "displaced" => concat!(
            "request displaced from the queue by a more important request or by a tenant ",
            "holding less than its fair share of the waiting places; retry later"
        ),
        "queue_timeout" => "queue wait expired (queue_timeout)",
        "rate_limited" => concat!(
            "over this API key's rate limit (requests per second or tokens per minute); ",
            "retry after the Retry-After header's seconds"
        ),
        "deadline" => "queue wait expired (deadline)",
        "first_token_timeout" => "no first token within the first-token timeout",
        "shutdown" => "the gateway is shutting down",
        "client_deadline" => concat!(
            "the queue ahead would not start this request before the client's own deadline ",
            "(x-llmflow-deadline-ms, or the SDK's timeout; signals.min_deadline_ms)",
            later!(),
            ", or allow a longer deadline"
        ),
        _ => return None,
    })
}

/// An error to answer with: `GatewayError`'s fields.
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorReply {
    pub status: u16,
    pub message: String,
    pub code: String,
    pub param: Option<String>,
    /// Its own headers, in order (`Retry-After`, `X-Request-Id`, ...).
    pub headers: Vec<(String, String)>,
    /// vLLM's own error object, when it refused the request: the body is that object.
    pub upstream: Option<Json>,
}

impl ErrorReply {
    /// `GatewayError(status, message, code, param=param)`: an error the checks answer before
    /// the runtime hears of the request (no headers of its own but the reason).
    pub fn checks(status: u16, message: String, code: &str, param: Option<&str>) -> Self {
        ErrorReply {
            status,
            message,
            code: code.to_owned(),
            param: param.map(str::to_owned),
            headers: Vec::new(),
            upstream: None,
        }
    }

    /// `auth._unauthorized(message)`: a 401 that asks for a bearer key.
    pub fn unauthorized(message: String) -> Self {
        let mut error = Self::checks(401, message, "invalid_api_key", None);
        error.headers = vec![("WWW-Authenticate".to_owned(), "Bearer".to_owned())];
        error
    }
}

/// `session.reply_error` for a runtime `Reply` of the native path (no upstream failure).
pub fn reply_error(
    reason: &str,
    status: u16,
    retry_after_s: Option<u64>,
    request_id: u64,
) -> ErrorReply {
    let message = message(reason).map_or_else(
        || format!("request refused: {}", reason.replace('_', " ")),
        str::to_owned,
    );
    ErrorReply {
        status,
        message,
        code: reason.to_owned(),
        param: None,
        headers: reply_headers(retry_after_s, request_id),
        upstream: None,
    }
}

/// `session.reply_error` for a `Reply` with reason `upstream_error`: the backend's failure
/// (`status`, `code`, `message`, and vLLM's error object as JSON text when it refused the
/// request), vLLM's object as the body when the reply keeps its status.
pub fn upstream_reply_error(
    reply_status: u16,
    retry_after_s: Option<u64>,
    request_id: u64,
    failure: (u16, &str, &str),
    error: Option<&str>,
) -> ErrorReply {
    let (status, code, message) = failure;
    // The text is the relay's (serde's): no key twice, no integer past 64 bits, so the strict
    // reader holds it as Python's `json.loads` does.
    let own = if reply_status == status {
        error.and_then(|e| json::parse(e.as_bytes()))
    } else {
        None
    };
    ErrorReply {
        status: reply_status,
        message: message.to_owned(),
        code: code.to_owned(),
        param: None,
        headers: reply_headers(retry_after_s, request_id),
        upstream: own,
    }
}

fn reply_headers(retry_after_s: Option<u64>, request_id: u64) -> Vec<(String, String)> {
    let mut headers = vec![("X-Request-Id".to_owned(), format!("llmflow-{request_id}"))];
    if let Some(seconds) = retry_after_s {
        headers.push(("Retry-After".to_owned(), seconds.to_string()));
    }
    headers
}

/// `errors._TYPES`: the OpenAI error type of a status.
pub(super) fn error_type(status: u16) -> &'static str {
    match status {
        400 | 405 | 413 | 415 | 431 => "invalid_request_error",
        401 => "authentication_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        499 => "client_closed_request",
        502 => "bad_gateway",
        503 => "service_unavailable",
        504 => "timeout_error",
        s if s >= 500 => "server_error",
        _ => "invalid_request_error",
    }
}

impl ErrorReply {
    /// The JSON body (`GatewayError.body`).
    pub fn body(&self) -> Json {
        let error = self.upstream.clone().unwrap_or_else(|| {
            let param = self.param.clone().map_or(Json::Null, Json::Str);
            Json::Object(vec![
                ("message".to_owned(), Json::Str(self.message.clone())),
                (
                    "type".to_owned(),
                    Json::Str(error_type(self.status).to_owned()),
                ),
                ("code".to_owned(), Json::Str(self.code.clone())),
                ("param".to_owned(), param),
            ])
        });
        Json::Object(vec![("error".to_owned(), error)])
    }

    /// The whole response as uvicorn writes `response()` (`test_front_replies.py`'s
    /// `_reply_bytes`):
    /// `default_headers` are the server's own (`server`, `date`), in order.
    pub fn response_bytes(&self, default_headers: &[(&[u8], &[u8])], keep_alive: bool) -> Vec<u8> {
        let body = json::to_vec(&self.body(), STARLETTE);
        let own: Vec<(&str, &str)> = self
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .chain(std::iter::once(("x-llmflow-reason", self.code.as_str())))
            .collect();
        json_response(self.status, &own, &body, default_headers, keep_alive)
    }
}

/// A `JSONResponse` as uvicorn writes it: its status line, the server's `default_headers`
/// (`date`, `server`), the response's own headers (lower-cased, Latin-1), Starlette's
/// `content-length` and `content-type`, `connection: close` when the connection ends, the
/// body.
pub fn json_response(
    status: u16,
    own: &[(&str, &str)],
    body: &[u8],
    default_headers: &[(&[u8], &[u8])],
    keep_alive: bool,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 256);
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(phrase(status).as_bytes());
    out.extend_from_slice(b"\r\n");
    let length = body.len().to_string();
    let starlette = [
        ("content-length", length.as_str()),
        ("content-type", "application/json"),
    ];
    let mut header = |name: &[u8], value: &[u8]| {
        out.extend_from_slice(name);
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    };
    for (name, value) in default_headers {
        header(name, value);
    }
    for (name, value) in own.iter().chain(&starlette) {
        header(name.to_ascii_lowercase().as_bytes(), &latin1(value));
    }
    if !keep_alive {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
    out
}

/// The non-streamed reply's bytes (`JSONResponse(session.response(),
/// headers=session.reply_headers)`): 200, its id, and `x-llmflow-reason` when the runtime cut
/// it with a reason that names itself in a cut reply (`contract.REFUSALS[...].cut`).
pub fn whole_response(
    body: &[u8],
    request_id: u64,
    cut: Option<&str>,
    default_headers: &[(&[u8], &[u8])],
    keep_alive: bool,
) -> Vec<u8> {
    let id = format!("llmflow-{request_id}");
    let mut own = vec![("X-Request-Id", id.as_str())];
    if let Some(reason) = cut.filter(|r| names_itself_when_cut(r)) {
        own.push(("x-llmflow-reason", reason));
    }
    json_response(200, &own, body, default_headers, keep_alive)
}

/// `contract.REFUSALS[reason].cut`: the reasons that may end a started reply in-band.
pub fn names_itself_when_cut(reason: &str) -> bool {
    matches!(
        reason,
        "deadline" | "shutdown" | "first_token_timeout" | "backend_error" | "client_stall"
    )
}

/// `JSONResponse`'s rendering of a body (Starlette's `ensure_ascii=False`).
pub(super) const STARLETTE: Style = Style {
    ascii: false,
    sort_keys: false,
    compact: true,
};
/// An SSE frame's JSON (`json.dumps` with its ASCII escapes, compact).
pub(super) const FRAME: Style = Style {
    ascii: true,
    sort_keys: false,
    compact: true,
};

/// A header value as Starlette encodes it (`latin-1`; the values here are ASCII).
fn latin1(value: &str) -> Vec<u8> {
    value
        .chars()
        .map(|c| u8::try_from(u32::from(c)).unwrap_or(b'?'))
        .collect()
}

/// The reason phrase uvicorn puts on a status line (`http.HTTPStatus`, Python 3.11); none
/// for a status it does not name.
fn phrase(status: u16) -> &'static str {
    const PHRASES: &str = "100 Continue|101 Switching Protocols|102 Processing|103 Early Hints|\
        200 OK|201 Created|202 Accepted|203 Non-Authoritative Information|204 No Content|\
        205 Reset Content|206 Partial Content|207 Multi-Status|208 Already Reported|226 IM Used|\
        300 Multiple Choices|301 Moved Permanently|302 Found|303 See Other|304 Not Modified|\
        305 Use Proxy|307 Temporary Redirect|308 Permanent Redirect|400 Bad Request|\
        401 Unauthorized|402 Payment Required|403 Forbidden|404 Not Found|\
        405 Method Not Allowed|406 Not Acceptable|407 Proxy Authentication Required|\
        408 Request Timeout|409 Conflict|410 Gone|411 Length Required|412 Precondition Failed|\
        413 Request Entity Too Large|414 Request-URI Too Long|415 Unsupported Media Type|\
        416 Requested Range Not Satisfiable|417 Expectation Failed|418 I'm a Teapot|\
        421 Misdirected Request|422 Unprocessable Entity|423 Locked|424 Failed Dependency|\
        425 Too Early|426 Upgrade Required|428 Precondition Required|429 Too Many Requests|\
        431 Request Header Fields Too Large|451 Unavailable For Legal Reasons|\
        500 Internal Server Error|501 Not Implemented|502 Bad Gateway|503 Service Unavailable|\
        504 Gateway Timeout|505 HTTP Version Not Supported|506 Variant Also Negotiates|\
        507 Insufficient Storage|508 Loop Detected|510 Not Extended|\
        511 Network Authentication Required";
    let code = status.to_string();
    PHRASES
        .split('|')
        .find_map(|entry| entry.strip_prefix(code.as_str())?.strip_prefix(' '))
        .unwrap_or("")
}

/// `streaming.notice_for`: the visible text a cut reply ends with.
pub fn notice_for(reason: &str) -> String {
    match reason {
        "deadline" => {
            "\n\n[llmflow: reply truncated: the request reached its total deadline]".into()
        }
        "first_token_timeout" => {
            "[llmflow: the model did not start answering in time; please retry]".into()
        }
        "shutdown" => "\n\n[llmflow: reply truncated: the gateway is shutting down]".into(),
        _ => format!("\n\n[llmflow: reply truncated ({reason})]"),
    }
}

/// What a cut reply is: `tail_chunk`'s arguments. `template`: the upstream reply's
/// `{"id", "created", "model"}` as JSON text (the relay's), when a chunk arrived; `now_s`:
/// the clock's whole seconds, for the `created` of a reply that had none.
#[derive(Debug, Clone, Copy)]
pub struct Cut<'a> {
    pub endpoint: Endpoint,
    pub model: &'a str,
    pub template: Option<&'a str>,
    pub open_choices: &'a [u64],
    pub reason: &'a str,
    pub request_id: u64,
    pub now_s: u64,
}

/// The relay's ending for a reply the runtime cut for `reason`: its notice, made when the
/// relay knows which choices are still open and the stream's template.
pub fn cut_notice(
    endpoint: Endpoint,
    model: String,
    reason: String,
    request_id: u64,
    now_s: u64,
) -> crate::relay::Ending {
    crate::relay::Ending::Notice(Box::new(
        move |open_choices: &[u64], template: Option<&str>| {
            cut_frame(&Cut {
                endpoint,
                model: &model,
                template,
                open_choices,
                reason: &reason,
                request_id,
                now_s,
            })
        },
    ))
}

/// `encode_event(tail_chunk(...))`: the SSE frame that ends a reply the runtime cut.
pub fn cut_frame(cut: &Cut<'_>) -> Vec<u8> {
    // `template or {...}`: an empty template is none (`json.loads` of the text, in its order;
    // the relay's text, which the strict reader holds as Python does).
    let base = match cut.template.and_then(|t| json::parse(t.as_bytes())) {
        Some(Json::Object(pairs)) if !pairs.is_empty() => Some(pairs),
        _ => None,
    };
    frame(b"data: ", &tail_chunk(cut, base))
}

/// `tail_chunk(...)`: the chunk that ends a reply the runtime cut, on `base` (the template as
/// an ordered object, when there is one; `cut.template` is not read).
pub fn tail_chunk(cut: &Cut<'_>, base: Option<Vec<(String, Json)>>) -> Json {
    let chat = cut.endpoint == Endpoint::Chat;
    let notice = Json::Str(notice_for(cut.reason));
    let mut chunk = base.unwrap_or_else(|| {
        vec![
            (
                "id".to_owned(),
                Json::Str(format!(
                    "{}-llmflow-{}",
                    if chat { "chatcmpl" } else { "cmpl" },
                    cut.request_id
                )),
            ),
            ("created".to_owned(), Json::Int(i128::from(cut.now_s))),
            ("model".to_owned(), Json::Str(cut.model.to_owned())),
        ]
    });
    let choices = cut
        .open_choices
        .iter()
        .map(|&i| {
            let text = if chat {
                (
                    "delta".to_owned(),
                    Json::Object(vec![("content".to_owned(), notice.clone())]),
                )
            } else {
                ("text".to_owned(), notice.clone())
            };
            Json::Object(vec![
                ("index".to_owned(), Json::Int(i128::from(i))),
                text,
                ("logprobs".to_owned(), Json::Null),
                ("finish_reason".to_owned(), Json::Str("length".to_owned())),
            ])
        })
        .collect();
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let marker = vec![
        ("truncated".to_owned(), Json::Bool(true)),
        ("reason".to_owned(), Json::Str(cut.reason.to_owned())),
    ];
    for (key, value) in [
        ("object", Json::Str(object.to_owned())),
        ("choices", Json::Array(choices)),
        ("llmflow", Json::Object(marker)),
    ] {
        // `{**base, key: ...}`: a key the template had keeps its place.
        match chunk.iter_mut().find(|(k, _)| k == key) {
            Some((_, slot)) => *slot = value,
            None => chunk.push((key.to_owned(), value)),
        }
    }
    Json::Object(chunk)
}

/// `encode_event({"error": in_band_error(...)})`: a started stream's failure, in-band.
pub fn in_band_error_frame(error: Option<&str>, message: &str, code: &str) -> Vec<u8> {
    let error = in_band_error(error, message, code);
    frame(b"data: ", &Json::Object(vec![("error".to_owned(), error)]))
}

/// `session.in_band_error`: vLLM's own error object (JSON text), when it refused the request;
/// else ours (`message`, `type: bad_gateway`, `code`). A streamed completion's in-band error
/// and a response's `error` event both carry it.
pub(super) fn in_band_error(error: Option<&str>, message: &str, code: &str) -> Json {
    error
        .and_then(|e| json::parse(e.as_bytes()))
        .unwrap_or_else(|| {
            Json::Object(vec![
                ("message".to_owned(), Json::Str(message.to_owned())),
                ("type".to_owned(), Json::Str("bad_gateway".to_owned())),
                ("code".to_owned(), Json::Str(code.to_owned())),
            ])
        })
}

/// An SSE frame: its `lead` (`data: `, as `encode_event` writes it, or an event's line before
/// it), the JSON as `json.dumps` writes it (ASCII, compact), a blank line.
pub(super) fn frame(lead: &[u8], value: &Json) -> Vec<u8> {
    let mut out = lead.to_vec();
    json::write(&mut out, value, FRAME);
    out.extend_from_slice(b"\n\n");
    out
}

#[cfg(test)]
mod tests;
