//! Prefill/decode disaggregation on the native front: the two hops' bodies and what the
//! prefill hop's answer gives the decode hop. The twin of `gateway/disagg.py`, value for value.
//!
//! A `Start` naming a prefill instance sends the request twice, as vLLM's own P/D proxy does:
//! the prefill hop (not streamed, one token, `kv_transfer_params` asking for a remote decode),
//! then the decode hop, the client's body plus the `kv_transfer_params` the prefill instance
//! answered. `governed.rs` sends them (the prefill hop as a relay hop, `Streams::hop`); this
//! module only shapes the bodies and reads the answer.

use super::json::{self, Json};
use super::prepare::set;

/// Fields a prefill-only request must not carry (`disagg._DECODE_ONLY`: they concern the
/// answer, which the decode instance writes).
const DECODE_ONLY: [&str; 3] = ["stream_options", "min_tokens", "min_completion_tokens"];

/// What a prefill instance is asked for (`disagg._REMOTE_DECODE`): compute the prompt, keep
/// its KV for a remote decode.
fn remote_decode() -> Json {
    let null = |k: &str| (k.to_owned(), Json::Null);
    Json::Object(vec![
        ("do_remote_decode".to_owned(), Json::Bool(true)),
        ("do_remote_prefill".to_owned(), Json::Bool(false)),
        null("remote_engine_id"),
        null("remote_block_ids"),
        null("remote_host"),
        null("remote_port"),
    ])
}

/// `disagg.prefill_body`: the prefill hop's body from the decode's own (`body`, an object):
/// not streamed, one token, remote decode.
pub fn prefill_body(body: &Json) -> Json {
    let Json::Object(pairs) = body else {
        return body.clone();
    };
    let mut out = Json::Object(
        pairs
            .iter()
            .filter(|(k, _)| !DECODE_ONLY.contains(&k.as_str()))
            .cloned()
            .collect(),
    );
    set(&mut out, "stream", Json::Bool(false));
    set(&mut out, "max_tokens", Json::Int(1));
    set(&mut out, "kv_transfer_params", remote_decode());
    if out.get("max_completion_tokens").is_some() {
        set(&mut out, "max_completion_tokens", Json::Int(1));
    }
    out
}

/// `disagg.decode_body`: the decode hop's body, the client's (`body`) with the prefill's KV
/// transfer parameters (none: the decode instance computes the prompt). Only the prefill
/// instance's answer sets them, never the client.
pub fn decode_body(body: Json, kv_transfer_params: Option<Json>) -> Json {
    let Json::Object(pairs) = body else {
        return body;
    };
    let mut out: Vec<(String, Json)> = pairs
        .into_iter()
        .filter(|(k, _)| k != "kv_transfer_params")
        .collect();
    if let Some(params) = kv_transfer_params {
        out.push(("kv_transfer_params".to_owned(), params));
    }
    Json::Object(out)
}

/// What `disagg.prefill_hop` returns of the prefill instance's answer (its raw JSON): its
/// `kv_transfer_params` when that is an object, else None (the answer is not an object, or
/// names none: the host warns, and the decode instance computes the prompt again).
///
/// An answer this tree cannot hold as Python does (an integer past 64 bits, `-0`, a key twice
/// in one object; `json.rs`) is read as one without parameters.
pub fn kv_transfer_params(answer: &[u8]) -> Option<Json> {
    match json::parse(answer)? {
        Json::Object(pairs) => pairs
            .into_iter()
            .find(|(k, _)| k == "kv_transfer_params")
            .map(|(_, v)| v)
            .filter(|v| matches!(v, Json::Object(_))),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::front::prepare::dumps;

    fn read(text: &str) -> Json {
        json::parse(text.as_bytes()).unwrap()
    }

    fn written(body: &Json) -> String {
        String::from_utf8(dumps(body)).unwrap()
    }

    const REMOTE: &str = "{\"do_remote_decode\": true, \"do_remote_prefill\": false, \
        \"remote_engine_id\": null, \"remote_block_ids\": null, \"remote_host\": null, \
        \"remote_port\": null}";

    // Each expected body is what `disagg.prefill_body`/`decode_body` gave `json.dumps` for the
    // same input: the same keys in the same places, byte for byte.
    #[test]
    fn the_prefill_hop_asks_one_token_unstreamed_for_a_remote_decode() {
        let body = read(
            r#"{"model":"m","messages":[{"role":"user","content":"h\u00e9"}],"stream":true,
            "stream_options":{"include_usage":true,"continuous_usage_stats":true},
            "max_tokens":20,"min_tokens":5,"priority":3}"#,
        );
        let expected = format!(
            "{{\"model\": \"m\", \"messages\": [{{\"role\": \"user\", \"content\": \"h\\u00e9\"}}], \
             \"stream\": false, \"max_tokens\": 1, \"priority\": 3, \"kv_transfer_params\": {REMOTE}}}"
        );
        assert_eq!(written(&prefill_body(&body)), expected);
    }

    #[test]
    fn a_max_completion_tokens_is_one_too_and_stream_and_max_tokens_are_added_last() {
        let body = read(
            r#"{"model":"m","prompt":"x","max_completion_tokens":7,"min_completion_tokens":2,
            "temperature":0.5,"stream":false}"#,
        );
        let expected = format!(
            "{{\"model\": \"m\", \"prompt\": \"x\", \"max_completion_tokens\": 1, \
             \"temperature\": 0.5, \"stream\": false, \"max_tokens\": 1, \
             \"kv_transfer_params\": {REMOTE}}}"
        );
        assert_eq!(written(&prefill_body(&body)), expected);
    }

    #[test]
    fn a_kv_transfer_params_already_there_is_replaced_in_its_place() {
        let body = read(r#"{"model":"m","prompt":"x","kv_transfer_params":{"a":1}}"#);
        let expected = format!(
            "{{\"model\": \"m\", \"prompt\": \"x\", \"kv_transfer_params\": {REMOTE}, \
             \"stream\": false, \"max_tokens\": 1}}"
        );
        assert_eq!(written(&prefill_body(&body)), expected);
    }

    #[test]
    fn the_decode_hop_is_the_body_with_the_prefills_parameters_last() {
        let body = read(r#"{"model":"m","prompt":"x","kv_transfer_params":{"a":1}}"#);
        let params = read(
            r#"{"do_remote_prefill":true,"remote_block_ids":[1,2],"remote_port":8001,"x":1.5}"#,
        );
        assert_eq!(
            written(&decode_body(body.clone(), Some(params))),
            "{\"model\": \"m\", \"prompt\": \"x\", \"kv_transfer_params\": \
             {\"do_remote_prefill\": true, \"remote_block_ids\": [1, 2], \"remote_port\": 8001, \
             \"x\": 1.5}}"
        );
        // None: the client's own are dropped all the same.
        assert_eq!(
            written(&decode_body(body, None)),
            "{\"model\": \"m\", \"prompt\": \"x\"}"
        );
        let streamed = read(r#"{"model":"m","stream":true,"max_tokens":20}"#);
        assert_eq!(
            written(&decode_body(streamed, Some(Json::Object(vec![])))),
            "{\"model\": \"m\", \"stream\": true, \"max_tokens\": 20, \"kv_transfer_params\": {}}"
        );
    }

    #[test]
    fn the_answers_parameters_are_read_only_from_an_object() {
        let answer =
            br#"{"id":"c","choices":[],"kv_transfer_params":{"remote_host":"h","remote_port":1}}"#;
        assert_eq!(
            kv_transfer_params(answer).map(|p| written(&p)).as_deref(),
            Some("{\"remote_host\": \"h\", \"remote_port\": 1}")
        );
        for none in [
            &br#"{"id":"c"}"#[..],
            br#"{"kv_transfer_params":null}"#,
            br#"{"kv_transfer_params":[1]}"#,
            br#"[{"kv_transfer_params":{}}]"#,
            b"not json",
        ] {
            assert_eq!(kv_transfer_params(none), None);
        }
    }
}
