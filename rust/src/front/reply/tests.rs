//! The reply renderers' unit tests: the bytes Python writes, case by case.

use super::*;

// A 429 as uvicorn writes it: status line, the server's headers, ours lower-cased in order,
// Starlette's length and type, then the compact body.
#[test]
fn refusal_bytes() {
    let reply = reply_error("queue_full", 429, Some(3), 17);
    let server: &[(&[u8], &[u8])] = &[(b"server", b"uvicorn")];
    let body = concat!(
        r#"{"error":{"message":"the gateway's queue is full; retry after the Retry-After "#,
        r#"header's seconds","type":"rate_limit_error","code":"queue_full","param":null}}"#
    );
    let expected = format!(
        "HTTP/1.1 429 Too Many Requests\r\nserver: uvicorn\r\nx-request-id: llmflow-17\r\n\
         retry-after: 3\r\nx-llmflow-reason: queue_full\r\ncontent-length: {}\r\n\
         content-type: application/json\r\n\r\n{body}",
        body.len()
    );
    assert_eq!(
        String::from_utf8(reply.response_bytes(server, true)).unwrap(),
        expected
    );
    let closing = String::from_utf8(reply.response_bytes(&[], false)).unwrap();
    assert!(closing.contains("application/json\r\nconnection: close\r\n\r\n{"));
}

// A reason without a message of its own is named; no Retry-After when the runtime gave none.
#[test]
fn unknown_reason() {
    let reply = reply_error("some_new_reason", 503, None, 1);
    assert_eq!(reply.message, "request refused: some new reason");
    assert_eq!(reply.headers.len(), 1);
    let text = String::from_utf8(reply.response_bytes(&[], true)).unwrap();
    assert!(text.starts_with("HTTP/1.1 503 Service Unavailable\r\n"));
    assert!(text.contains(r#""type":"service_unavailable""#));
}

// vLLM's own refusal keeps its object (in its order) when the status is kept; else ours.
#[test]
fn upstream_refusal() {
    let error = r#"{"message":"bad é","type":"BadRequestError","param":null,"code":400}"#;
    let own = upstream_reply_error(
        400,
        None,
        2,
        (400, "backend_rejected", "bad é"),
        Some(error),
    );
    let text = String::from_utf8(own.response_bytes(&[], true)).unwrap();
    assert!(text.ends_with(&format!(r#"{{"error":{error}}}"#)), "{text}");
    let ours = upstream_reply_error(502, None, 2, (400, "backend_rejected", "bad"), Some(error));
    assert_eq!(ours.upstream, None);
    assert!(String::from_utf8(ours.response_bytes(&[], true))
        .unwrap()
        .contains(r#""code":"backend_rejected""#));
}

// Status lines of uvicorn's table, and a status it does not name.
#[test]
fn phrases() {
    assert_eq!(phrase(503), "Service Unavailable");
    assert_eq!(phrase(418), "I'm a Teapot");
    assert_eq!(phrase(100), "Continue");
    assert_eq!(phrase(511), "Network Authentication Required");
    assert_eq!(phrase(499), "");
    assert_eq!(phrase(10), "");
}

// The tail of a cut chat: the template's fields in their order, the notice, the marker;
// ASCII escapes as json.dumps writes them.
#[test]
fn cut_chat_frame() {
    let cut = Cut {
        endpoint: Endpoint::Chat,
        model: "m",
        template: Some(r#"{"created":5,"id":"c-é","model":"x"}"#),
        open_choices: &[0],
        reason: "deadline",
        request_id: 3,
        now_s: 99,
    };
    let frame = String::from_utf8(cut_frame(&cut)).unwrap();
    assert_eq!(
        frame,
        concat!(
            r#"data: {"created":5,"id":"c-\u00e9","model":"x","object":"chat.completion.chunk","#,
            r#""choices":[{"index":0,"delta":{"content":"\n\n[llmflow: reply truncated: the "#,
            r#"request reached its total deadline]"},"logprobs":null,"finish_reason":"length"}],"#,
            r#""llmflow":{"truncated":true,"reason":"deadline"}}"#,
            "\n\n"
        )
    );
}

// No template: our id, the clock's `created`, the client's model; a completion's text.
#[test]
fn cut_completion_without_template() {
    let cut = Cut {
        endpoint: Endpoint::Completions,
        model: "alias",
        template: None,
        open_choices: &[0, 2],
        reason: "odd_reason",
        request_id: 8,
        now_s: 1_700_000_000,
    };
    let frame = String::from_utf8(cut_frame(&cut)).unwrap();
    assert!(frame.starts_with(
        r#"data: {"id":"cmpl-llmflow-8","created":1700000000,"model":"alias","object":"text_completion","choices":[{"index":0,"text":"\n\n[llmflow: reply truncated (odd_reason)]""#
    ));
    assert!(frame.contains(r#"{"index":2,"text""#));
}

// The in-band error: vLLM's object as it came, else ours.
#[test]
fn in_band_errors() {
    let own = in_band_error_frame(Some(r#"{"code":400,"message":"no"}"#), "x", "y");
    assert_eq!(
        own,
        b"data: {\"error\":{\"code\":400,\"message\":\"no\"}}\n\n"
    );
    let ours = in_band_error_frame(None, "backend failed mid-stream: boom", "backend_error");
    assert_eq!(
        String::from_utf8(ours).unwrap(),
        "data: {\"error\":{\"message\":\"backend failed mid-stream: boom\",\"type\":\"bad_gateway\",\"code\":\"backend_error\"}}\n\n"
    );
}

// A whole reply goes out as uvicorn writes `JSONResponse(..., headers=reply_headers)`: the
// server's headers, its id, the reason only of a cut that names itself, Starlette's length
// and type, `connection: close` when the connection ends.
#[test]
fn whole_replies() {
    let defaults: [(&[u8], &[u8]); 1] = [(b"server", b"uvicorn")];
    let done = whole_response(b"{}", 5, None, &defaults, true);
    assert_eq!(
        String::from_utf8(done).unwrap(),
        "HTTP/1.1 200 OK\r\nserver: uvicorn\r\nx-request-id: llmflow-5\r\ncontent-length: 2\r\n\
         content-type: application/json\r\n\r\n{}"
    );
    let cut = whole_response(b"{}", 5, Some("deadline"), &defaults, false);
    let cut = String::from_utf8(cut).unwrap();
    assert!(cut.contains("x-request-id: llmflow-5\r\nx-llmflow-reason: deadline\r\n"));
    assert!(cut.ends_with("connection: close\r\n\r\n{}"));
    let quiet = whole_response(b"{}", 5, Some("upstream_error"), &defaults, true);
    assert!(!String::from_utf8(quiet)
        .unwrap()
        .contains("x-llmflow-reason"));
}
