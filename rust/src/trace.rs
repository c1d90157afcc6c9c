//! The flight recorder: a runtime's inputs and outputs as JSON lines, and their replay.
//!
//! The first line holds the config the runtime was built from; each further line one event with
//! its time and the actions (or the error) it produced:
//!
//! ```text
//! {"llmflow_trace":1,"config":{"policy":{...},"lifecycle":{...}}}
//! {"t":1200,"ev":{"arrive":{"id":1,"tenant":0,"prompt":12,"max_tokens":64,"stream":true}},"act":[{"start":{...}},{"arm":{"at_us":3001200}}]}
//! ```
//!
//! Replaying feeds every event to a fresh runtime and checks that it answers with the very same
//! actions, floats bit for bit. Since the runtime reads no clock and no randomness, a trace from
//! production (`llmflow serve --trace`) or from a simulation replays offline exactly: this is how
//! "why was this request refused at 14:03?" gets answered.

use serde::Deserialize;
use serde_json::Value;
use std::fmt::Write as _;

use crate::error::{PolicyError, PolicyResult};
use crate::runtime::{Action, Event, Runtime};

/// The trace format's version, in the header line.
pub const VERSION: u32 = 1;

/// The header line for a runtime built from `config_json`.
pub fn header(config_json: &str) -> PolicyResult<String> {
    let config: Value = serde_json::from_str(config_json)
        .map_err(|e| PolicyError::config("(document)", e.to_string()))?;
    Ok(format!(
        "{{\"llmflow_trace\":{VERSION},\"config\":{}}}\n",
        serde_json::to_string(&config).expect("a JSON value serialises")
    ))
}

/// Append the line for one handled event to `out`.
pub fn record(
    out: &mut String,
    now_us: u64,
    event: &Event,
    result: Result<&[Action], &PolicyError>,
) {
    let ev = serde_json::to_string(event).expect("events serialise");
    match result {
        Ok(actions) => {
            let act = serde_json::to_string(actions).expect("actions serialise");
            let _ = writeln!(out, "{{\"t\":{now_us},\"ev\":{ev},\"act\":{act}}}");
        }
        Err(err) => {
            let msg = serde_json::to_string(&err.to_string()).expect("strings serialise");
            let _ = writeln!(out, "{{\"t\":{now_us},\"ev\":{ev},\"error\":{msg}}}");
        }
    }
}

#[derive(Deserialize)]
struct Header {
    llmflow_trace: u32,
    config: Value,
}

#[derive(Deserialize)]
struct Line {
    t: u64,
    ev: Event,
    #[serde(default)]
    act: Option<Value>,
    #[serde(default)]
    error: Option<String>,
}

/// What a successful replay went through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replayed {
    pub events: u64,
    pub actions: u64,
}

/// The first place a replay differs from its trace.
#[derive(Debug, Clone, PartialEq)]
pub struct Mismatch {
    /// 1-based line number in the trace.
    pub line: usize,
    pub expected: String,
    pub got: String,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "line {}: the trace says {} but the runtime answered {}",
            self.line, self.expected, self.got
        )
    }
}

/// Why a replay could not run or did not match.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplayError {
    /// The text is not a trace (bad header or a line that does not parse).
    Format { line: usize, message: String },
    /// The runtime answered differently.
    Mismatch(Mismatch),
}

impl std::fmt::Display for ReplayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Format { line, message } => write!(f, "line {line}: not a trace line: {message}"),
            Self::Mismatch(m) => m.fmt(f),
        }
    }
}

fn format_err(line: usize, message: impl Into<String>) -> ReplayError {
    ReplayError::Format {
        line,
        message: message.into(),
    }
}

/// Feed a trace's events to a fresh runtime and check every action it returns.
pub fn replay(text: &str) -> Result<Replayed, ReplayError> {
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty());
    let (_, first) = lines.next().ok_or_else(|| format_err(1, "empty trace"))?;
    let header: Header =
        serde_json::from_str(first).map_err(|e| format_err(1, format!("header: {e}")))?;
    if header.llmflow_trace != VERSION {
        return Err(format_err(
            1,
            format!(
                "trace version {} (this llmflow reads {VERSION})",
                header.llmflow_trace
            ),
        ));
    }
    let config = serde_json::to_string(&header.config).expect("a JSON value serialises");
    let mut runtime =
        Runtime::from_json(&config).map_err(|e| format_err(1, format!("config: {e}")))?;
    let mut done = Replayed {
        events: 0,
        actions: 0,
    };
    for (i, text) in lines {
        let line_no = i + 1;
        let line: Line =
            serde_json::from_str(text).map_err(|e| format_err(line_no, e.to_string()))?;
        let result = runtime.feed(line.t, &line.ev);
        let result = result.map(|()| runtime.actions());
        let (expected, got) = match (&line.act, &line.error, result) {
            (Some(act), None, Ok(actions)) => {
                let got = serde_json::to_value(actions).expect("actions serialise");
                done.actions += actions.len() as u64;
                if &got == act {
                    done.events += 1;
                    continue;
                }
                (act.to_string(), got.to_string())
            }
            (None, Some(err), Err(got)) if *err == got.to_string() => {
                done.events += 1;
                continue;
            }
            (act, err, got) => (
                act.as_ref()
                    .map_or_else(|| format!("error {err:?}"), Value::to_string),
                match got {
                    Ok(a) => serde_json::to_string(a).expect("actions serialise"),
                    Err(e) => format!("error {:?}", e.to_string()),
                },
            ),
        };
        return Err(ReplayError::Mismatch(Mismatch {
            line: line_no,
            expected,
            got,
        }));
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::sample_json;

    fn traced(events: &[(u64, Event)]) -> String {
        let config = format!(r#"{{"policy": {}}}"#, sample_json());
        let mut rt = Runtime::from_json(&config).unwrap();
        let mut out = header(&config).unwrap();
        for (t, ev) in events {
            let result = rt.handle(*t, ev);
            record(&mut out, *t, ev, result.as_deref());
        }
        out
    }

    fn events() -> Vec<(u64, Event)> {
        let mut evs: Vec<(u64, Event)> = (1..=5)
            .map(|id| {
                (
                    id * 10,
                    Event::Arrive {
                        id,
                        tenant: (id % 2) as u32,
                        prompt: 100 * id,
                        max_tokens: 50,
                        stream: id % 2 == 0,
                        pool: 0,
                        // One request carries block hashes: they go into its trace line and
                        // replay with it.
                        chain: if id == 3 { vec![7, 8] } else { vec![] },
                        fingerprint: id,
                        // One client said it retries and how long it waits: into its line.
                        retries: (id == 4).then_some(1),
                        deadline_ms: (id == 4).then_some(30_000),
                    },
                )
            })
            .collect();
        evs.push((
            100,
            Event::ScrapeOk {
                backend: 0,
                began_us: 90,
                kv_usage: Some(0.123_456_789_012_345_67),
                running: Some(2),
                waiting: Some(0),
                preemptions_total: Some(0),
                kv_blocks: Some(1000),
            },
        ));
        // P/D's hop event (a no-op on this co-located pool): it goes into a line and back.
        evs.push((150, Event::Prefilled { id: 2 }));
        evs.push((200, Event::Tokens { id: 1, n: 7 }));
        evs.push((300, Event::Done { id: 1 }));
        evs.push((400, Event::ClientGone { id: 3 }));
        // Replicas sharing state: another's load and waiting weight, service given elsewhere,
        // a refused lease.
        evs.push((
            500,
            Event::SharedLoad {
                backend: 0,
                elsewhere: 1,
                waiting: 2.5,
                waiting_before: 1.0,
            },
        ));
        evs.push((
            600,
            Event::SharedService {
                tenant: 0,
                cost: 40.0,
            },
        ));
        evs.push((
            650,
            Event::SharedUsage {
                tenant: 0,
                requests: 2.0,
                tokens: 300.0,
            },
        ));
        evs.push((700, Event::LeaseDenied { id: 2 }));
        evs.push((10_000_000, Event::Timer));
        // An unknown backend: an error, recorded and replayed as such.
        evs.push((
            10_000_001,
            Event::ScrapeFailed {
                backend: 9,
                reachable: false,
            },
        ));
        evs
    }

    // A trace replays to exactly its actions, and the count matches.
    #[test]
    fn replays_its_own_trace() {
        let text = traced(&events());
        let done = replay(&text).unwrap();
        assert_eq!(done.events, events().len() as u64);
        assert!(done.actions > 5);
    }

    // A client's signals go into its arrival's line; an arrival without them writes none, and
    // a line written before they existed reads as an arrival without them.
    #[test]
    fn signals_are_written_only_when_said() {
        let text = traced(&events());
        let lines: Vec<&str> = text.lines().filter(|l| l.contains("\"arrive\"")).collect();
        assert_eq!(lines.len(), 5);
        for (i, line) in lines.iter().enumerate() {
            let said = line.contains(r#""retries":1"#) && line.contains(r#""deadline_ms":30000"#);
            assert_eq!(said, i == 3, "{line}");
            assert_eq!(line.contains("retries"), i == 3, "{line}");
        }
        let old = r#"{"arrive":{"id":1,"tenant":0,"prompt":5,"max_tokens":5,"stream":true}}"#;
        let event: Event = serde_json::from_str(old).unwrap();
        assert!(matches!(
            event,
            Event::Arrive {
                retries: None,
                deadline_ms: None,
                ..
            }
        ));
    }

    // A runtime leasing its slots from a shared store: its events and the `lease` and
    // `release` actions go into the trace, and it replays (the config carries the leases).
    #[test]
    fn replays_a_leased_trace() {
        let config = format!(
            r#"{{"policy": {}, "lifecycle": {{"leases": {{"on_loss": "local_share", "replicas": 2}}}}}}"#,
            sample_json()
        );
        let mut rt = Runtime::from_json(&config).unwrap();
        let mut text = header(&config).unwrap();
        let arrive = |id: u64| -> Event {
            let line = format!(
                r#"{{"arrive":{{"id":{id},"tenant":1,"prompt":10,"max_tokens":10,"stream":true}}}}"#
            );
            serde_json::from_str(&line).unwrap()
        };
        let events = [
            (10, arrive(1)),
            (11, arrive(2)),
            (20, Event::LeaseGranted { id: 1 }),
            (21, Event::LeaseDenied { id: 2 }),
            (
                30,
                Event::StoreSynced {
                    backend: 0,
                    live: 1,
                    waiting: 1.0,
                    waiting_before: 0.5,
                },
            ),
            (35, Event::Done { id: 1 }),
            (40, Event::LeaseFailed { id: 2 }),
            (50, Event::StoreLost),
        ];
        for (t, ev) in &events {
            let result = rt.handle(*t, ev);
            record(&mut text, *t, ev, result.as_deref());
        }
        for word in [
            r#"{"lease":{"id":1,"backend":0,"cap":2}}"#,
            r#""lease_granted":{"id":1}"#,
            r#"{"release":{"id":1,"backend":0}}"#,
            r#""store_synced":{"backend":0,"live":1"#,
            r#""lease_failed":{"id":2}"#,
            r#""ev":"store_lost""#,
        ] {
            assert!(text.contains(word), "{word} not in {text}");
        }
        let done = replay(&text).unwrap();
        assert_eq!(done.events, events.len() as u64);
    }

    // Any edited action is found, with its line.
    #[test]
    fn finds_a_changed_action() {
        let text = traced(&events());
        let edited = text.replacen("\"status\":429", "\"status\":503", 1);
        let edited = if edited == text {
            text.replacen("\"priority\":", "\"priority\":1", 1)
        } else {
            edited
        };
        assert_ne!(edited, text);
        let Err(ReplayError::Mismatch(m)) = replay(&edited) else {
            panic!("no mismatch found")
        };
        assert!(m.line > 1);
    }

    // A trace from another version or of another shape is refused with a clear message.
    #[test]
    fn refuses_non_traces() {
        assert!(matches!(
            replay(""),
            Err(ReplayError::Format { line: 1, .. })
        ));
        let text = traced(&events()).replacen("\"llmflow_trace\":1", "\"llmflow_trace\":7", 1);
        let err = replay(&text).unwrap_err().to_string();
        assert!(err.contains("version 7"), "{err}");
    }
}
