//! `responses.rs`' unit tests: each check of `prepare_response`, the body vLLM gets, the
//! reply of a client that asked for no stream, and the frames of a cut.

use std::collections::{HashMap, HashSet};

use super::*;
use crate::front::prepare::{checked as check_body, prepare};
use crate::front::reply::FRAME;

fn config() -> FrontConfig {
    FrontConfig {
        models: HashMap::from([("m".to_owned(), 100), ("alias".to_owned(), 100)]),
        aliases: HashMap::from([("alias".to_owned(), "m".to_owned())]),
        prefix_models: HashSet::new(),
        block_size: 4,
        bytes_per_token: 4.0,
        streaming: true,
        max_messages: 3,
        max_n: 4,
        max_tokens: Some(50),
        fingerprint_key: vec![7; 32],
    }
}

fn refusal(body: &str) -> (u16, String, String, Option<String>) {
    match check_body(Endpoint::Responses, body.as_bytes(), &config()) {
        Err(NotServed::Refused(e)) => (e.status, e.message, e.code, e.param),
        other => panic!("not refused: {other:?}"),
    }
}

fn text(body: &Json) -> String {
    String::from_utf8(json::to_vec(body, FRAME)).unwrap()
}

// A streamed request: its values, and the body vLLM gets (stripped fields gone, the served
// model, streamed, the planned bound, not stored; the client's key order kept).
#[test]
fn a_streamed_request_and_its_upstream_body() {
    let p = prepare(
        Endpoint::Responses,
        br#"{"background":true,"model":"alias","input":"12345678","stream":true,"priority":3,"temperature":0.5}"#,
        &config(),
    )
    .unwrap();
    assert_eq!((p.asked_model.as_str(), p.model.as_str()), ("alias", "m"));
    assert!(p.stream);
    assert_eq!((p.prompt_tokens, p.planned_tokens, p.choices), (2, 50, 1));
    assert_eq!(
        text(&p.body),
        r#"{"model":"m","input":"12345678","stream":true,"temperature":0.5,"max_output_tokens":50,"store":false}"#
    );
}

// `_input_tokens`: instructions and text, 4 an item, the text parts of a list; at least 1.
#[test]
fn the_prompt_estimate() {
    let tokens = |body: &str| {
        prepare(Endpoint::Responses, body.as_bytes(), &config())
            .unwrap()
            .prompt_tokens
    };
    assert_eq!(tokens(r#"{"model":"m","input":""}"#), 0); // text: no floor of 1, as in Python
    assert_eq!(tokens(r#"{"model":"m","input":[]}"#), 1);
    assert_eq!(
        tokens(r#"{"model":"m","input":"abcde","instructions":"abcd"}"#),
        3
    );
    assert_eq!(
        tokens(
            r#"{"model":"m","input":[{"role":"user","content":"abcd"},
            {"role":"user","content":[{"type":"input_text","text":"abcdefgh"},{"type":"input_image"}]},
            {"type":"function_call_output"}]}"#
        ),
        4 + 1 + 4 + 2 + 4
    );
    // the output bound: as asked, else what the context leaves, under the gateway's cap
    let bound = |body: &str| {
        prepare(Endpoint::Responses, body.as_bytes(), &config())
            .unwrap()
            .planned_tokens
    };
    assert_eq!(
        bound(r#"{"model":"m","input":"x","max_output_tokens":7}"#),
        7
    );
    let mut open = config();
    open.max_tokens = None;
    let p = prepare(
        Endpoint::Responses,
        br#"{"model":"m","input":"abcd"}"#,
        &open,
    )
    .unwrap();
    assert_eq!(p.planned_tokens, 99);
}

// Each field's error, as pydantic's first error is worded by `prepare_response`.
#[test]
fn validation_errors_are_worded_as_python_words_them() {
    for (body, message) in [
        ("{}", "model: Field required"),
        (
            r#"{"model":1,"input":5}"#,
            "model: Input should be a valid string",
        ),
        (
            r#"{"model":""}"#,
            "model: String should have at least 1 character",
        ),
        (r#"{"model":"m"}"#, "input: Field required"),
        (
            r#"{"model":"m","input":5}"#,
            "input.str: Input should be a valid string",
        ),
        (
            r#"{"model":"m","input":[{},1]}"#,
            "input.str: Input should be a valid string",
        ),
        (
            r#"{"model":"m","input":null}"#,
            "input.str: Input should be a valid string",
        ),
        (
            r#"{"model":"m","input":"x","instructions":1}"#,
            "instructions: Input should be a valid string",
        ),
        (
            r#"{"model":"m","input":"x","max_output_tokens":0}"#,
            "max_output_tokens: Input should be greater than or equal to 1",
        ),
        (
            r#"{"model":"m","input":"x","max_output_tokens":99999999999}"#,
            "max_output_tokens: Input should be less than or equal to 2147483647",
        ),
        (
            r#"{"model":"m","input":"x","max_output_tokens":true}"#,
            "max_output_tokens: Input should be a valid integer",
        ),
        (
            r#"{"model":"m","input":"x","stream":1}"#,
            "stream: Input should be a valid boolean",
        ),
    ] {
        let (status, got, code, param) = refusal(body);
        assert_eq!(
            (status, got.as_str(), code.as_str()),
            (400, message, "invalid_request")
        );
        assert_eq!(param.as_deref(), message.split(':').next(), "{body}");
    }
}

// The checks after validation, in Python's order.
#[test]
fn the_other_refusals() {
    let (status, message, code, _) = refusal(r#"{"model":"nope","input":"x","stream":"x"}"#);
    assert_eq!(
        (status, code.as_str()),
        (400, "invalid_request"),
        "{message}"
    );
    let (status, message, code, param) = refusal(r#"{"model":"nope","input":"x"}"#);
    assert_eq!((status, code.as_str()), (404, "model_not_found"));
    assert_eq!(message, "The model `nope` does not exist.");
    assert_eq!(param.as_deref(), Some("model"));
    let (_, message, code, param) = refusal(r#"{"model":"m","input":"x","max_output_tokens":51}"#);
    assert_eq!(code, "max_tokens_too_large");
    assert_eq!(param.as_deref(), Some("max_output_tokens"));
    assert_eq!(
        message,
        "max_output_tokens is 51, over this gateway's limit of 50 (limits.max_tokens): ask for at most 50"
    );
    let long = format!(
        r#"{{"model":"m","input":"{}","max_output_tokens":10}}"#,
        "x".repeat(364)
    );
    let (_, message, code, param) = refusal(&long);
    assert_eq!(
        (code.as_str(), param.as_deref()),
        ("context_length_exceeded", Some("input"))
    );
    assert_eq!(
        message,
        "This model's maximum context length is 100 tokens. However, you requested 101 tokens \
         (91 in the input, 10 in the output). Please reduce the length of the input or \
         max_output_tokens."
    );
    let mut off = config();
    off.streaming = false;
    match check_body(
        Endpoint::Responses,
        br#"{"model":"m","input":"x","stream":true}"#,
        &off,
    ) {
        Err(NotServed::Refused(e)) => assert_eq!(e.code, "streaming_disabled"),
        other => panic!("{other:?}"),
    }
}

// The reply of a client that asked for no stream: the final response object; cut, the
// partial one (`ResponsesParser.partial`), the text so far and the notice.
#[test]
fn whole_replies_and_partial_ones() {
    let mut whole = Whole::default();
    whole
        .feed(br#"{"type":"response.created","response":{"id":"r","object":"response","status":"in_progress","output":[],"usage":null}}"#)
        .unwrap();
    whole
        .feed(br#"{"type":"response.output_text.delta","delta":"h\u00e9"}"#)
        .unwrap();
    let mut done = whole.clone();
    done.feed(br#"{"type":"response.completed","response":{"id":"r","status":"completed"}}"#)
        .unwrap();
    assert_eq!(
        String::from_utf8(done.body("completed")).unwrap(),
        r#"{"id":"r","status":"completed"}"#
    );
    assert!(whole.cut("deadline"));
    assert_eq!(
        String::from_utf8(whole.body("deadline")).unwrap(),
        r#"{"id":"r","object":"response","status":"incomplete","output":[{"type":"message","role":"assistant","status":"incomplete","content":[{"type":"output_text","text":"hé\n\n[llmflow: reply truncated: the request reached its total deadline]","annotations":[]}]}],"usage":null,"incomplete_details":{"reason":"deadline"}}"#
    );
    // cut before any response object: a bare one
    let mut bare = Whole::default();
    assert!(bare.cut("shutdown"));
    assert!(String::from_utf8(bare.body("shutdown"))
        .unwrap()
        .starts_with(r#"{"object":"response","status":"incomplete","incomplete_details""#));
    assert!(!Whole::default().cut("client_stall"));
}

// The `error` events that end a streamed reply: a cut's, an upstream failure's.
#[test]
fn error_frames() {
    assert_eq!(
        String::from_utf8(cut_frame("deadline")).unwrap(),
        "event: error\ndata: {\"type\":\"error\",\"code\":\"deadline\",\"message\":\"[llmflow: reply truncated: the request reached its total deadline]\",\"param\":null}\n\n"
    );
    assert_eq!(
        String::from_utf8(upstream_error_frame(None, "backend stream broke", "backend_error"))
            .unwrap(),
        "event: error\ndata: {\"type\":\"bad_gateway\",\"message\":\"backend stream broke\",\"code\":\"backend_error\"}\n\n"
    );
    assert_eq!(
        String::from_utf8(upstream_error_frame(
            Some(r#"{"message":"no","type":"BadRequestError","param":"x","code":400}"#),
            "no",
            "backend_rejected"
        ))
        .unwrap(),
        "event: error\ndata: {\"type\":\"BadRequestError\",\"message\":\"no\",\"param\":\"x\",\"code\":400}\n\n"
    );
}
