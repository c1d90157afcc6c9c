use super::*;

fn fold(endpoint: Endpoint, chunks: &[&str]) -> Whole {
    let mut whole = Whole::new(endpoint, "m", 1);
    for chunk in chunks {
        whole
            .feed(chunk.as_bytes())
            .expect("a chunk the fold takes");
    }
    whole
}

fn text(whole: &Whole, now_s: u64) -> String {
    String::from_utf8(whole.body(now_s)).unwrap()
}

// The expected bodies below are what `JSONResponse(Accumulator(...).response(usage))` renders
// for the same chunks (Python 3.11, this tree's `streaming.py`).

// Text deltas join, the last usage object and the usage chunk's fingerprint reach the reply,
// and every field vLLM's unstreamed reply has is there, in its order, non-ASCII unescaped.
#[test]
fn a_chat_stream_folds_into_vllms_unstreamed_reply() {
    let whole = fold(
        Endpoint::Chat,
        &[
            r#"{"id":"c1","object":"chat.completion.chunk","created":5,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"usage":{"prompt_tokens":3,"total_tokens":3,"completion_tokens":0}}"#,
            r#"{"id":"c1","object":"chat.completion.chunk","created":5,"model":"m","choices":[{"index":0,"delta":{"content":"h\u00e9"},"logprobs":null,"finish_reason":null}],"usage":{"prompt_tokens":3,"total_tokens":4,"completion_tokens":1}}"#,
            r#"{"id":"c1","object":"chat.completion.chunk","created":5,"model":"m","choices":[{"index":0,"delta":{"content":"!"},"logprobs":null,"finish_reason":"stop","stop_reason":null}],"usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2}}"#,
            r#"{"id":"c1","object":"chat.completion.chunk","created":5,"model":"m","choices":[],"usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2},"system_fingerprint":"fp"}"#,
        ],
    );
    let expected = r#"{"id":"c1","object":"chat.completion","created":5,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hé!","refusal":null,"annotations":null,"audio":null,"function_call":null,"reasoning":null},"logprobs":null,"finish_reason":"stop","stop_reason":null,"token_ids":null,"routed_experts":null}],"service_tier":null,"system_fingerprint":"fp","usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2,"prompt_tokens_details":null,"completion_tokens_details":null},"prompt_logprobs":null,"prompt_token_ids":null,"prompt_text":null,"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}"#;
    assert_eq!(text(&whole, 0), expected);
}

// Tool calls assemble by their index (sorted), each `function` with its arguments first and
// `id`/`type` in the order they first came; reasoning, logprobs and token ids join too.
#[test]
fn tool_calls_reasoning_logprobs_and_token_ids_are_assembled() {
    let whole = fold(
        Endpoint::Chat,
        &[
            r#"{"id":"c2","created":5,"model":"m","choices":[{"index":0,"delta":{"reasoning_content":"think"}}]}"#,
            r#"{"id":"c2","created":5,"model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"type":"function","function":{"name":"g","arguments":"{"}}]}}]}"#,
            r#"{"id":"c2","created":5,"model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"t0","function":{"name":"f","arguments":"{}"}},{"index":1,"id":"t1","function":{"arguments":"}"}}]}}]}"#,
            r#"{"id":"c2","created":5,"model":"m","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls","token_ids":[1,2],"logprobs":{"content":[{"token":"a","logprob":-0.5}]}}]}"#,
        ],
    );
    let expected = r#"{"id":"c2","object":"chat.completion","created":5,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"","refusal":null,"annotations":null,"audio":null,"function_call":null,"reasoning":"think","tool_calls":[{"function":{"arguments":"{}","name":"f"},"id":"t0"},{"function":{"arguments":"{}","name":"g"},"type":"function","id":"t1"}]},"logprobs":{"content":[{"token":"a","logprob":-0.5}]},"finish_reason":"tool_calls","stop_reason":null,"token_ids":[1,2],"routed_experts":null}],"service_tier":null,"system_fingerprint":null,"usage":null,"prompt_logprobs":null,"prompt_token_ids":null,"prompt_text":null,"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}"#;
    assert_eq!(text(&whole, 0), expected);
}

// A cut appends the notice to the open choice, finishes it with `length` and marks the reply;
// a choice's own fields (`prompt_token_ids`) keep their place.
#[test]
fn a_cut_ends_the_open_choice_with_the_notice_and_the_marker() {
    let mut whole = fold(
        Endpoint::Completions,
        &[
            r#"{"id":"k","object":"text_completion","created":9,"model":"m","choices":[{"index":0,"text":"ab","logprobs":null,"finish_reason":null,"prompt_token_ids":[4,5]}],"usage":{"prompt_tokens":2,"total_tokens":3,"completion_tokens":1}}"#,
        ],
    );
    assert!(whole.cut("deadline", 7, 0));
    let expected = r#"{"id":"k","object":"text_completion","created":9,"model":"m","choices":[{"index":0,"text":"ab\n\n[llmflow: reply truncated: the request reached its total deadline]","logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":null,"prompt_logprobs":null,"prompt_token_ids":[4,5],"routed_experts":null}],"service_tier":null,"system_fingerprint":null,"usage":{"prompt_tokens":2,"total_tokens":3,"completion_tokens":1,"prompt_tokens_details":null,"completion_tokens_details":null},"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null,"llmflow":{"truncated":true,"reason":"deadline"}}"#;
    assert_eq!(text(&whole, 0), expected);
}

// Cut before any chunk: the notice alone, under the gateway's own id and the cut's clock.
#[test]
fn a_cut_before_any_chunk_is_the_notice_alone() {
    let mut whole = Whole::new(Endpoint::Completions, "m", 1);
    assert!(whole.cut("first_token_timeout", 7, 1_796_484_309));
    let expected = r#"{"id":"cmpl-llmflow-7","object":"text_completion","created":1796484309,"model":"m","choices":[{"index":0,"text":"[llmflow: the model did not start answering in time; please retry]","logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":null,"prompt_logprobs":null,"prompt_token_ids":null,"routed_experts":null}],"service_tier":null,"system_fingerprint":null,"usage":null,"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null,"llmflow":{"truncated":true,"reason":"first_token_timeout"}}"#;
    assert_eq!(text(&whole, 0), expected);
}

// A choice that finished takes no notice: the reply is whole, unmarked.
#[test]
fn a_cut_after_the_finish_changes_nothing() {
    let mut whole = fold(
        Endpoint::Chat,
        &[r#"{"id":"c","choices":[{"index":0,"delta":{"content":"x"},"finish_reason":"stop"}]}"#],
    );
    let before = whole.body(3);
    assert!(!whole.cut("deadline", 1, 3));
    assert_eq!(whole.body(3), before);
}

// What the Python fold raises on, or would hold otherwise, is unread and changes nothing. (A
// chunk of the wrong shape never gets here: the relay's shaper fails the stream on it first,
// `relay::chunk`'s tests and `property_tests/test_whole_reply.py` through the seam.)
#[test]
fn bad_chunks_are_refused_and_change_nothing() {
    let mut whole = Whole::new(Endpoint::Chat, "m", 1);
    for raw in [
        r#"{"id":"a","choices":[{"index":"0","delta":{"content":"x"}}]}"#,
        r#"{"id":"a","choices":[{"delta":{"content":"x","tool_calls":"call"}}]}"#,
        r#"{"id":"a","choices":[{"delta":{"content":"x","tool_calls":[{"function":{"arguments":3}}]}}]}"#,
        r#"{"id":"a","choices":[{"delta":{"content":"x","tool_calls":[{"function":"f"}]}}]}"#,
        r#"{"id":"a","big":18446744073709551616}"#,
    ] {
        assert_eq!(whole.feed(raw.as_bytes()), Err(Unread), "{raw}");
    }
    assert_eq!(
        text(&whole, 4),
        text(&Whole::new(Endpoint::Chat, "m", 1), 4)
    );
}
