//! `prepare`'s unit tests: each check of `CompletionService.prepare`, and the values of a
//! request it takes.

use super::*;

fn config() -> FrontConfig {
    FrontConfig {
        models: HashMap::from([
            ("m".to_owned(), 100),
            ("alias".to_owned(), 100),
            ("p".to_owned(), 1000),
        ]),
        aliases: HashMap::from([("alias".to_owned(), "m".to_owned())]),
        prefix_models: HashSet::from(["p".to_owned()]),
        block_size: 4,
        bytes_per_token: 4.0,
        streaming: true,
        max_messages: 3,
        max_n: 4,
        max_tokens: None,
        fingerprint_key: vec![7; 32],
    }
}

fn chat(body: &str) -> Option<Prepared> {
    prepare(Endpoint::Chat, body.as_bytes(), &config())
}

fn completion(body: &str) -> Option<Prepared> {
    prepare(Endpoint::Completions, body.as_bytes(), &config())
}

// A streamed chat: its values, and the body vLLM gets (stripped fields gone, stream options
// forced, the key order of the client's body kept, new keys at the end).
#[test]
fn streamed_chat() {
    let p = chat(
        r#"{"priority":9,"model":"alias","stream":true,"messages":[{"role":"user","content":"12345678"}],
        "stream_options":{"include_usage":true},"temperature":0.5}"#,
    )
    .unwrap();
    assert_eq!((p.asked_model.as_str(), p.model.as_str()), ("alias", "m"));
    assert!(p.stream && p.include_usage && !p.continuous_usage && !p.unstreamed);
    assert_eq!(
        (p.choices, p.prompt_tokens, p.planned_tokens, p.max_tokens),
        (1, 9, 91, None)
    );
    assert_eq!(p.prefix_hashes, None);
    assert_eq!(
        String::from_utf8(p.body_bytes()).unwrap(),
        r#"{"model": "m", "stream": true, "messages": [{"role": "user", "content": "12345678"}], "stream_options": {"include_usage": true, "continuous_usage_stats": true}, "temperature": 0.5}"#
    );
}

// The core's priority and brownout bound go on as `upstream_body` puts them.
#[test]
fn upstream_edits() {
    let p = chat(r#"{"model":"m","messages":[{"role":"u"}],"max_completion_tokens":5}"#).unwrap();
    let body = String::from_utf8(p.upstream_bytes(Some(-2), Some(3))).unwrap();
    assert!(body.ends_with(r#""max_completion_tokens": 3, "stream": true, "stream_options": {"include_usage": true, "continuous_usage_stats": true}, "priority": -2}"#), "{body}");
}

// A batch of prompts: n choices each, planned KV per prompt, the cap put upstream when it
// binds; the fingerprint is keyed BLAKE2b of the raw bytes.
#[test]
fn completion_batch_and_cap() {
    let raw = r#"{"model":"m","prompt":["abcd","abcdefgh"],"n":2}"#;
    let mut capped = config();
    capped.max_tokens = Some(10);
    let p = prepare(Endpoint::Completions, raw.as_bytes(), &capped).unwrap();
    assert_eq!(
        (p.choices, p.prompt_tokens, p.max_tokens, p.planned_tokens),
        (4, 3, Some(10), 40)
    );
    assert!(String::from_utf8(p.body_bytes())
        .unwrap()
        .ends_with(r#""max_tokens": 10}"#));
    assert_eq!(p.fingerprint, fingerprint(raw.as_bytes(), &[7; 32]));
    assert_ne!(p.fingerprint, fingerprint(raw.as_bytes(), &[8; 32]));
    // A cap the context already binds is not sent.
    capped.max_tokens = Some(99);
    let p = prepare(Endpoint::Completions, raw.as_bytes(), &capped).unwrap();
    assert_eq!((p.max_tokens, p.planned_tokens), (None, 2 * 99 + 2 * 98));
}

// Prompt logprobs, asked directly or through echo with logprobs, go upstream unstreamed.
#[test]
fn unstreamed_when_prompt_logprobs() {
    for extra in [
        r#""prompt_logprobs":1"#,
        r#""prompt_logprobs":"x""#,
        r#""echo":true,"logprobs":0"#,
    ] {
        let p = completion(&format!(r#"{{"model":"m","prompt":"a",{extra}}}"#)).unwrap();
        assert!(p.unstreamed, "{extra}");
        assert!(!String::from_utf8(p.body_bytes())
            .unwrap()
            .contains("stream"));
    }
    for extra in [
        r#""prompt_logprobs":0"#,
        r#""prompt_logprobs":false"#,
        r#""echo":true"#,
    ] {
        let p = completion(&format!(r#"{{"model":"m","prompt":"a",{extra}}}"#)).unwrap();
        assert!(!p.unstreamed, "{extra}");
    }
}

// A prefix-routed model carries its prompt's hashes (empty when shorter than a block).
#[test]
fn prefix_model_hashes() {
    let p = completion(r#"{"model":"p","prompt":"0123456789abcdefXYZ"}"#).unwrap();
    assert_eq!(p.prefix_hashes.unwrap().len(), 1);
    let p = completion(r#"{"model":"p","prompt":"short"}"#).unwrap();
    assert_eq!(p.prefix_hashes, Some(vec![]));
}

// Every refusal of `prepare`, declined here.
#[test]
fn declines_what_python_refuses() {
    let msg = r#""messages":[{"role":"u","content":"x"}]"#;
    for body in [
        "[]".to_owned(),
        "{".to_owned(),
        format!(r#"{{"model":"nope",{msg}}}"#),
        format!(r#"{{"model":"m",{msg},"stream_options":{{"include_usage":true}}}}"#),
        format!(r#"{{"model":"m",{msg},"n":5}}"#),
        format!(r#"{{"model":"m",{msg},"max_tokens":101}}"#),
        format!(
            r#"{{"model":"m","messages":[{{"role":"u","content":"{}"}}]}}"#,
            "x".repeat(400)
        ),
        r#"{"model":"m","messages":[{"role":"u"},{"role":"u"},{"role":"u"},{"role":"u"}]}"#
            .to_owned(),
    ] {
        assert!(chat(&body).is_none(), "{body}");
    }
    assert!(chat(&format!(r#"{{"model":"m",{msg},"stream_options":{{}}}}"#)).is_some());
    let mut off = config();
    off.streaming = false;
    let streamed = format!(r#"{{"model":"m",{msg},"stream":true}}"#);
    assert!(prepare(Endpoint::Chat, streamed.as_bytes(), &off).is_none());
    assert!(completion(r#"{"model":"m","prompt":"a","max_tokens":0}"#).is_none());
    assert!(completion(r#"{"model":"m","prompt":"a","max_tokens":0,"echo":true}"#).is_some());
    assert!(completion(r#"{"model":"m","prompt":["a","b","c"],"n":2}"#).is_none());
    let mut capped = config();
    capped.max_tokens = Some(10);
    let over = r#"{"model":"m","prompt":"a","max_tokens":11}"#;
    assert!(prepare(Endpoint::Completions, over.as_bytes(), &capped).is_none());
}
