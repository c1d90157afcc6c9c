//! vLLM's Responses event stream (`/v1/responses`), read as the deleted Python path's
//! `ResponsesParser` read it: a reply *kind* of the relay beside the completions' chunks.
//!
//! Each `data:` payload is one event (`{"type": "response.output_text.delta", ...}`). Tokens
//! are counted one per `*.delta` event (text, reasoning, tool-call arguments: vLLM sends one
//! per engine step), and the final `usage.output_tokens` settles the count when it says more.
//! Events go to the client as vLLM framed them (`event: <type>` and `data:` lines), the
//! payload untouched, and the stream ends with the body (no `[DONE]`). An `error` or
//! `response.failed` event fails the request, as vLLM's in-band error fails a completion.

use serde_json::Value;

use super::chunk::{ChunkShaper, Ending, Shaped};
use super::events::Failure;
use crate::front::json::{self, Json, Style};

/// What a stream's upstream replies with, and how the relay reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReplyKind {
    /// Completion chunks (`data: {...}`, then `data: [DONE]`).
    #[default]
    Chunks,
    /// Responses events (`event: ...` and `data: {...}`; the body's end is the reply's).
    Events,
}

const FINAL: [&str; 2] = ["response.completed", "response.incomplete"];
/// How an error object is handed to the host (any order and escape reads back the same).
const TEXT: Style = Style {
    ascii: false,
    sort_keys: false,
    compact: true,
};

/// Reads one Responses stream's events (`ResponsesParser.feed`).
#[derive(Debug, Default)]
pub struct EventReader {
    completion_tokens: u64,
}

impl EventReader {
    /// Generated tokens counted so far.
    pub fn completion_tokens(&self) -> u64 {
        self.completion_tokens
    }

    /// Read one `data:` payload: its frame for the client and the new tokens; nothing for a
    /// payload that is JSON but no object (Python's `(None, 0)`).
    ///
    /// # Errors
    /// The payload is not JSON (502), or it is an `error` / `response.failed` event.
    pub fn feed(&mut self, data: &[u8]) -> Result<Shaped, Failure> {
        let event = super::chunk::read(data)?;
        if !matches!(event, Json::Object(_)) {
            return Ok(Shaped::default());
        }
        let kind = event.get("type").map_or_else(String::new, py_str);
        if kind == "error" || kind == "response.failed" {
            return Err(failure(&event));
        }
        // Python's `kind.endswith(".delta")`: case-sensitive, as vLLM names its events.
        #[allow(clippy::case_sensitive_file_extension_comparisons)]
        let mut new = u64::from(kind.ends_with(".delta"));
        if let (Some(response), true) = (event.get("response"), FINAL.contains(&kind.as_str())) {
            let total = match response.get("usage").and_then(|u| u.get("output_tokens")) {
                Some(Json::Int(i)) => Some(*i),
                Some(Json::Bool(b)) => Some(i128::from(*b)), // Python's bool is an int
                _ => None,
            };
            if let Some(total) = total {
                if total > i128::from(self.completion_tokens + new) {
                    let total = u64::try_from(total).unwrap_or(u64::MAX);
                    new = total - self.completion_tokens;
                }
            }
        }
        self.completion_tokens += new;
        let mut frame = Vec::with_capacity(kind.len() + data.len() + 16);
        frame.extend_from_slice(b"event: ");
        frame.extend_from_slice(kind.as_bytes());
        frame.extend_from_slice(b"\ndata: ");
        frame.extend_from_slice(data);
        frame.extend_from_slice(b"\n\n");
        Ok(Shaped {
            before: Vec::new(),
            frame: Some(frame),
            new_tokens: u32::try_from(new).unwrap_or(u32::MAX),
        })
    }
}

/// `error_event({"error": _error_of(event)})`: the failure an `error` or `response.failed`
/// event reports. Its error object is the event's `error`, else its response's, else one
/// with the event's message; a 4xx `code` is vLLM refusing the request (the client's error,
/// with vLLM's object), anything else the backend failing (502).
fn failure(event: &Json) -> Failure {
    let error = match (event.get("error"), event.get("response")) {
        (Some(error @ Json::Object(_)), _) => error.clone(),
        (_, Some(response)) if matches!(response.get("error"), Some(Json::Object(_))) => {
            response.get("error").cloned().expect("matched")
        }
        _ => {
            let message = event
                .get("message")
                .filter(|m| m.truthy())
                .map_or_else(|| "the backend failed the response".to_owned(), py_str);
            Json::Object(vec![("message".to_owned(), Json::Str(message))])
        }
    };
    let message = error
        .get("message")
        .map_or_else(|| "None".to_owned(), py_str);
    match error.get("code") {
        Some(Json::Int(status)) if (400..500).contains(status) => Failure {
            status: u16::try_from(*status).expect("checked range"),
            code: "backend_rejected",
            message,
            backend_down: false,
            error: Some(String::from_utf8(json::to_vec(&error, TEXT)).expect("JSON is UTF-8")),
        },
        _ => Failure::backend(
            "backend_error",
            format!("backend failed mid-stream: {message}"),
            false,
        ),
    }
}

/// Python's `str()` of a JSON value (exact for text, numbers, booleans and null).
fn py_str(value: &Json) -> String {
    match value {
        Json::Str(s) => s.clone(),
        Json::Null => "None".to_owned(),
        Json::Bool(true) => "True".to_owned(),
        Json::Bool(false) => "False".to_owned(),
        Json::Int(i) => i.to_string(),
        other => {
            let text = json::to_vec(other, TEXT);
            let value: Value = serde_json::from_slice(&text).unwrap_or_default();
            value.to_string()
        }
    }
}

/// A stream's reader, of its reply's kind.
#[derive(Debug)]
pub enum Shaper {
    Chunks(ChunkShaper),
    Events(EventReader),
}

impl Shaper {
    pub fn completion_tokens(&self) -> u64 {
        match self {
            Shaper::Chunks(s) => s.completion_tokens(),
            Shaper::Events(r) => r.completion_tokens(),
        }
    }

    /// An unstreamed answer's tokens (completions only).
    pub fn answered(&mut self, tokens: u64) {
        if let Shaper::Chunks(s) = self {
            s.answered(tokens);
        }
    }

    /// The reply's `{"id","created","model"}` (chunks only).
    pub fn template(&self) -> Option<String> {
        match self {
            Shaper::Chunks(s) => s.template.clone(),
            Shaper::Events(_) => None,
        }
    }

    /// See [`ChunkShaper::feed`] and [`EventReader::feed`].
    ///
    /// # Errors
    /// As theirs.
    pub fn feed(&mut self, data: &[u8]) -> Result<Shaped, Failure> {
        match self {
            Shaper::Chunks(s) => s.feed(data),
            Shaper::Events(r) => r.feed(data),
        }
    }

    /// Frames held for the end (chunks only: events go on as they come).
    pub fn take_held(&mut self) -> Vec<Vec<u8>> {
        match self {
            Shaper::Chunks(s) => s.take_held(),
            Shaper::Events(_) => Vec::new(),
        }
    }

    /// The frames that end a cut reply, and whether it was truncated (events: the ending
    /// as it is; a reply of events has one output, open until its end).
    pub fn cut(&mut self, ending: Ending) -> (Vec<Vec<u8>>, bool) {
        match (self, ending) {
            (Shaper::Chunks(s), ending) => s.cut(ending),
            (Shaper::Events(_), Ending::Frame(frame)) => (vec![frame], false),
            (Shaper::Events(_), Ending::Notice(notice)) => (vec![notice(&[0], None)], true),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delta(text: &str) -> Vec<u8> {
        format!(r#"{{"type":"response.output_text.delta","sequence_number":4,"delta":"{text}"}}"#)
            .into_bytes()
    }

    // One token a delta event, framed as vLLM framed it; other events count none.
    #[test]
    fn deltas_count_one_token_each_and_frames_keep_the_payload() {
        let mut r = EventReader::default();
        let created = br#"{"type":"response.created","response":{"id":"r","usage":null}}"#;
        let shaped = r.feed(created).unwrap();
        assert_eq!(shaped.new_tokens, 0);
        let mut expected = b"event: response.created\ndata: ".to_vec();
        expected.extend_from_slice(created);
        expected.extend_from_slice(b"\n\n");
        assert_eq!(shaped.frame.unwrap(), expected);
        for text in ["a", "b"] {
            assert_eq!(r.feed(&delta(text)).unwrap().new_tokens, 1);
        }
        let reasoning = br#"{"type":"response.reasoning_text.delta","delta":"x"}"#;
        assert_eq!(r.feed(reasoning).unwrap().new_tokens, 1);
        let done = br#"{"type":"response.output_text.done","text":"ab"}"#;
        assert_eq!(r.feed(done).unwrap().new_tokens, 0);
        assert_eq!(r.completion_tokens(), 3);
    }

    /// `deltas` delta events, then an event of `kind` whose response's usage says `output`
    /// tokens: the tokens that event adds, and the count after it.
    fn settled(deltas: usize, kind: &str, output: u64) -> (u32, u64) {
        let mut r = EventReader::default();
        for _ in 0..deltas {
            r.feed(&delta("a")).unwrap();
        }
        let event =
            format!(r#"{{"type":"{kind}","response":{{"usage":{{"output_tokens":{output}}}}}}}"#);
        let new = r.feed(event.as_bytes()).unwrap().new_tokens;
        (new, r.completion_tokens())
    }

    // The final usage settles the count when it says more, never less.
    #[test]
    fn the_final_usage_settles_the_count() {
        assert_eq!(settled(1, "response.completed", 5), (4, 5));
        assert_eq!(settled(3, "response.incomplete", 2), (0, 3));
        // a usage on an event that is not final counts nothing
        assert_eq!(settled(0, "response.in_progress", 9).0, 0);
    }

    // Not an object: nothing to send, nothing counted; not JSON: the backend's failure.
    #[test]
    fn payloads_that_are_no_event() {
        let mut r = EventReader::default();
        assert_eq!(r.feed(b"[1]").unwrap(), Shaped::default());
        let bad = r.feed(b"{").unwrap_err();
        assert_eq!((bad.status, bad.code), (502, "backend_error"));
    }

    // `error` and `response.failed` fail the request: a 4xx code is vLLM's refusal, with its
    // object; anything else is the backend's failure, worded as Python words it.
    #[test]
    fn error_events_fail_the_request() {
        let mut r = EventReader::default();
        let engine = br#"{"type":"error","code":"server_error","message":"boom","param":null}"#;
        let f = r.feed(engine).unwrap_err();
        assert_eq!((f.status, f.code), (502, "backend_error"));
        assert_eq!(f.message, "backend failed mid-stream: boom");
        let refusal =
            br#"{"type":"error","error":{"message":"no","type":"BadRequestError","code":400}}"#;
        let f = r.feed(refusal).unwrap_err();
        assert_eq!(
            (f.status, f.code, f.message.as_str()),
            (400, "backend_rejected", "no")
        );
        assert_eq!(
            f.error.as_deref(),
            Some(r#"{"message":"no","type":"BadRequestError","code":400}"#)
        );
        let failed = br#"{"type":"response.failed","response":{"error":{"code":"server_error","message":"died"}}}"#;
        let f = r.feed(failed).unwrap_err();
        assert_eq!(f.message, "backend failed mid-stream: died");
        let bare = br#"{"type":"response.failed","response":{"error":null}}"#;
        let f = r.feed(bare).unwrap_err();
        assert_eq!(
            f.message,
            "backend failed mid-stream: the backend failed the response"
        );
        assert_eq!(r.completion_tokens(), 0);
    }

    // A type that is not text is framed as Python's `str()` writes it.
    #[test]
    fn a_type_that_is_not_text() {
        let mut r = EventReader::default();
        let shaped = r.feed(br#"{"type":7}"#).unwrap();
        assert!(shaped.frame.unwrap().starts_with(b"event: 7\ndata: "));
        let shaped = r.feed(br#"{"x":1}"#).unwrap();
        assert!(shaped.frame.unwrap().starts_with(b"event: \ndata: "));
    }
}
