//! The gateway's per-request tally: what `/metrics` counts of each request and the access log's
//! row, kept once for both paths.
//!
//! The native front counts its requests here itself (at the first token and at the end, from
//! its tokio tasks), and the Python path's sessions call the same methods through PyO3: one
//! set of counts, one access-log file, one writer. `/metrics` reads the counts at scrape time
//! (`Tally::families`) and renders them with the gauges (`gateway/metrics.py`).
//!
//! The access log (`server.access_log`) has one CSV row per request, written (one `write`) when
//! it ends, so a crash loses none. Its columns are the simulator's per-request rows
//! (`llmflow.request_log.COLUMNS`), so that a real day can sit beside a simulated one and be
//! replayed in the simulator (`arrival: {kind: trace, path: access.csv}`). Times are Unix
//! seconds; `class` is the tenant's tier; `attempts` is 1 (a client's retry is a request of its
//! own); `prompt_tokens` is the count the core planned with (exact for token ids, estimated for
//! text). The outcome follows the simulator's vocabulary (`log_outcome`), from the runtime's
//! terminal action. The cells are `csv.writer`'s of `request_log.format_row`, byte for byte.
//!
//! It decides nothing: every decision is the runtime's; this file counts and writes them.

use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::Path;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::front::owner::now_us;

/// `llmflow_ttft_seconds`' and `llmflow_queue_wait_seconds`' bucket bounds.
pub const TTFT_BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// `llmflow_e2e_seconds`' bucket bounds.
pub const E2E_BUCKETS: [f64; 13] = [
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// The access log's columns (`llmflow.request_log.COLUMNS`).
pub const COLUMNS: [&str; 14] = [
    "request",
    "class",
    "tenant",
    "arrival_s",
    "attempts",
    "admitted_s",
    "first_token_s",
    "end_s",
    "prompt_tokens",
    "max_tokens",
    "output_tokens",
    "outcome",
    "reason",
    "backend",
];

/// How a request ended, in the runtime's words, to `llmflow_requests`' outcome label.
pub fn metric_outcome(end: &str) -> &'static str {
    match end {
        "completed" => "completed",
        "error" | "upstream_error" => "error",
        // its client's deadline passed while it waited (`client_deadline`) is a timeout too
        "deadline" | "first_token_timeout" | "queue_timeout" | "client_deadline" | "timeout" => {
            "timeout"
        }
        "displaced" => "rejected",
        _ => "cancelled",
    }
}

/// An error status to the access log's outcome: a refusal (429, or a 503 that refused rather
/// than expired), a wait that ran out (503, 504), or a failure.
pub fn by_status(status: u16, reason: &str) -> &'static str {
    if status == 429 || (status == 503 && matches!(reason, "draining" | "no_healthy_backend")) {
        return "rejected";
    }
    if matches!(status, 503 | 504) {
        return "timed_out";
    }
    "failed"
}

/// A request's outcome in the simulator's words (`completed`, `rejected`, `timed_out`,
/// `truncated`, `cancelled`, `failed`) and its reason (the access log's, the span's): from how
/// it ended (`end`), the status of the error it was answered with (if any), and the tokens it
/// was sent.
pub fn log_outcome(end: &str, error_status: Option<u16>, tokens: u64) -> (&'static str, bool) {
    let outcome = match (end, error_status) {
        ("completed", _) => return ("completed", false),
        (_, Some(status)) => by_status(status, end),
        ("deadline" | "shutdown", None) if tokens > 0 => "truncated", // partial text, a notice
        ("deadline" | "first_token_timeout" | "queue_timeout" | "timeout", None) => "timed_out",
        ("upstream_error" | "error", None) => "failed",
        _ => "cancelled",
    };
    (outcome, true)
}

/// A request that ended, as its host saw it. Times are monotonic seconds (the runtime's clock,
/// Python's `time.monotonic()`).
#[derive(Debug, Clone, Default)]
pub struct Ended {
    /// Its `X-Request-Id` (`llmflow-<id>`), when it has one.
    pub request: Option<String>,
    pub tier: String,
    pub tenant: String,
    pub arrived_s: f64,
    /// Its wait in the queue, when it was started upstream (the runtime's `Start` said it).
    pub queue_wait_s: Option<f64>,
    pub first_token_s: Option<f64>,
    /// None: now.
    pub ended_s: Option<f64>,
    pub prompt_tokens: u64,
    pub max_tokens: Option<u64>,
    pub completion_tokens: u64,
    /// How it ended, in the runtime's words: `completed`, or the reason of its `Reply`, `Cut`
    /// or `End`.
    pub end: String,
    /// The status of the error it was answered with, when it was.
    pub error_status: Option<u16>,
    pub backend: Option<String>,
    /// Shadow mode: the verdict's summary (`shadow_summary`).
    pub shadow: Option<String>,
}

/// A request refused as it arrived (never admitted).
#[derive(Debug, Clone, Default)]
pub struct Refused {
    pub request: Option<String>,
    pub tier: String,
    pub tenant: String,
    pub arrived_s: f64,
    /// When it was answered (monotonic seconds); None: now.
    pub at_s: Option<f64>,
    pub prompt_tokens: u64,
    pub max_tokens: Option<u64>,
    pub status: u16,
    /// The error's code (`queue_full`, `rate_limited`, ...).
    pub code: String,
}

/// One labelled counter: its value and when it was first touched (Unix seconds, the
/// `_created` sample prometheus_client exports).
#[derive(Debug, Clone, PartialEq)]
pub struct Count {
    pub value: f64,
    pub created: f64,
}

/// One labelled histogram: per-bucket (not cumulative) counts, the last one +Inf's, the sum,
/// and when it was first touched.
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    pub counts: Vec<u64>,
    pub sum: f64,
    pub created: f64,
}

impl Histogram {
    fn observe(&mut self, bounds: &[f64], value: f64) {
        // prometheus_client's rule: the first bound the value does not exceed
        let at = bounds
            .iter()
            .position(|b| value <= *b)
            .unwrap_or(bounds.len());
        self.counts[at] += 1;
        self.sum += value;
    }
}

/// Every per-request family, as `/metrics` renders it. Label sets in first-touched order (as
/// prometheus_client keeps its children).
#[derive(Debug, Clone, Default)]
pub struct Counts {
    /// (tier, outcome, reason)
    pub requests: Vec<((String, String, String), Count)>,
    pub ttft: Vec<(String, Histogram)>,
    pub e2e: Vec<(String, Histogram)>,
    pub queue_wait: Vec<(String, Histogram)>,
    pub tokens: Vec<(String, Count)>,
    pub truncations: Vec<(String, Count)>,
    pub aborts: Vec<(String, Count)>,
}

/// The count of the label set `is` finds, made (`key()`, created now) on its first count: the
/// label sets are few, and a request's count allocates nothing once its labels exist.
fn count<K>(
    family: &mut Vec<(K, Count)>,
    is: impl Fn(&K) -> bool,
    key: impl FnOnce() -> K,
    created: f64,
) -> &mut Count {
    let at = family.iter().position(|(k, _)| is(k)).unwrap_or_else(|| {
        family.push((
            key(),
            Count {
                value: 0.0,
                created,
            },
        ));
        family.len() - 1
    });
    &mut family[at].1
}

fn requests<'a>(
    counts: &'a mut Counts,
    tier: &str,
    outcome: &str,
    reason: &str,
    created: f64,
) -> &'a mut Count {
    count(
        &mut counts.requests,
        |(t, o, r)| t == tier && o == outcome && r == reason,
        || (tier.to_owned(), outcome.to_owned(), reason.to_owned()),
        created,
    )
}

fn histogram<'a>(
    family: &'a mut Vec<(String, Histogram)>,
    tier: &str,
    bounds: &[f64],
    created: f64,
) -> &'a mut Histogram {
    let at = family
        .iter()
        .position(|(k, _)| k == tier)
        .unwrap_or_else(|| {
            let fresh = Histogram {
                counts: vec![0; bounds.len() + 1],
                sum: 0.0,
                created,
            };
            family.push((tier.to_owned(), fresh));
            family.len() - 1
        });
    &mut family[at].1
}

/// The access log's file, opened for appending.
struct Log {
    file: File,
    shadow: bool,
}

/// The gateway's per-request counts and its access log (see the module's doc).
pub struct Tally {
    counts: Mutex<Counts>,
    log: Mutex<Option<Log>>,
    /// Unix seconds at monotonic zero: the hosts' monotonic stamps to the access log's times.
    epoch: f64,
}

impl Default for Tally {
    fn default() -> Self {
        Self::new()
    }
}

impl Tally {
    pub fn new() -> Self {
        Self {
            counts: Mutex::new(Counts::default()),
            log: Mutex::new(None),
            epoch: unix_now() - now_us() as f64 / 1e6,
        }
    }

    /// Write the access log to `path` from now on (the header first, when the file is new;
    /// `shadow`: shadow mode, whose last column, `shadow`, says what the policy would have
    /// done).
    ///
    /// # Errors
    /// The file (or its folder) cannot be created or opened.
    pub fn open_log(&self, path: &Path, shadow: bool) -> std::io::Result<()> {
        if let Some(folder) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(folder)?;
        }
        let mut file = OpenOptions::new().append(true).create(true).open(path)?;
        if file.metadata()?.len() == 0 {
            let mut header = csv_row(COLUMNS.iter().copied());
            if shadow {
                header.truncate(header.len() - 2);
                header.push_str(",shadow\r\n");
            }
            file.write_all(header.as_bytes())?;
        }
        *self.log.lock().unwrap() = Some(Log { file, shadow });
        Ok(())
    }

    /// Stop writing the access log (and close its file).
    pub fn close_log(&self) {
        self.log.lock().unwrap().take();
    }

    /// A request's first token, `ttft_s` after its arrival.
    pub fn first_token(&self, tier: &str, ttft_s: f64) {
        let created = unix_now();
        let mut counts = self.counts.lock().unwrap();
        histogram(&mut counts.ttft, tier, &TTFT_BUCKETS, created).observe(&TTFT_BUCKETS, ttft_s);
    }

    /// A reply cut with a visible notice.
    pub fn truncated(&self, reason: &str) {
        let created = unix_now();
        let mut counts = self.counts.lock().unwrap();
        count(
            &mut counts.truncations,
            |k| k == reason,
            || reason.to_owned(),
            created,
        )
        .value += 1.0;
    }

    /// An upstream request closed before it finished.
    pub fn upstream_aborted(&self, reason: &str) {
        let created = unix_now();
        let mut counts = self.counts.lock().unwrap();
        count(
            &mut counts.aborts,
            |k| k == reason,
            || reason.to_owned(),
            created,
        )
        .value += 1.0;
    }

    /// A request refused as it arrived: counted as `rejected` with its code, and logged.
    pub fn refused(&self, r: &Refused) {
        let created = unix_now();
        {
            let mut counts = self.counts.lock().unwrap();
            requests(&mut counts, &r.tier, "rejected", &r.code, created).value += 1.0;
        }
        self.write(|epoch| {
            let at = r.at_s.map_or(created, |at| at + epoch);
            Row {
                request: r.request.as_deref(),
                tier: &r.tier,
                tenant: &r.tenant,
                arrival: r.arrived_s + epoch,
                admitted: None,
                first_token: None,
                end: at,
                prompt_tokens: r.prompt_tokens,
                max_tokens: r.max_tokens,
                output_tokens: 0,
                outcome: by_status(r.status, &r.code),
                reason: Some(&r.code),
                backend: None,
                shadow: None,
            }
        });
    }

    /// A request that ended (served, cut, refused from the queue, or left by its client):
    /// counted by outcome and reason, its tokens, its wait and (completed) its duration; and
    /// logged.
    pub fn ended(&self, e: &Ended) {
        let created = unix_now();
        let outcome = metric_outcome(&e.end);
        {
            let mut counts = self.counts.lock().unwrap();
            requests(&mut counts, &e.tier, outcome, &e.end, created).value += 1.0;
            if e.completion_tokens > 0 {
                let tier = &e.tier;
                count(&mut counts.tokens, |k| k == tier, || tier.clone(), created).value +=
                    e.completion_tokens as f64;
            }
            if e.backend.is_some() {
                let wait = e.queue_wait_s.unwrap_or(0.0);
                histogram(&mut counts.queue_wait, &e.tier, &TTFT_BUCKETS, created)
                    .observe(&TTFT_BUCKETS, wait);
            }
            if outcome == "completed" {
                let ended = e.ended_s.unwrap_or_else(|| now_us() as f64 / 1e6);
                histogram(&mut counts.e2e, &e.tier, &E2E_BUCKETS, created)
                    .observe(&E2E_BUCKETS, ended - e.arrived_s);
            }
        }
        self.write(|epoch| {
            let (outcome, has_reason) = log_outcome(&e.end, e.error_status, e.completion_tokens);
            let admitted = e
                .backend
                .as_ref()
                .map(|_| e.arrived_s + e.queue_wait_s.unwrap_or(0.0));
            Row {
                request: e.request.as_deref(),
                tier: &e.tier,
                tenant: &e.tenant,
                arrival: e.arrived_s + epoch,
                admitted: admitted.map(|t| t + epoch),
                first_token: e.first_token_s.map(|t| t + epoch),
                end: e.ended_s.map_or(created, |t| t + epoch),
                prompt_tokens: e.prompt_tokens,
                max_tokens: e.max_tokens,
                output_tokens: e.completion_tokens,
                outcome,
                reason: has_reason.then_some(e.end.as_str()),
                backend: e.backend.as_deref(),
                shadow: e.shadow.as_deref(),
            }
        });
    }

    /// Every per-request family, as it stands.
    pub fn counts(&self) -> Counts {
        self.counts.lock().unwrap().clone()
    }

    /// The access log's row, when it is on: one `write`, in the file when the request has
    /// ended. A failed write is lost (the request has been served); the file stays open.
    fn write<'a>(&self, row: impl FnOnce(f64) -> Row<'a>) {
        let mut log = self.log.lock().unwrap();
        let Some(log) = log.as_mut() else {
            return;
        };
        let line = row(self.epoch).csv(log.shadow);
        let _ = log.file.write_all(line.as_bytes());
    }
}

/// One access-log row, in `COLUMNS` order (times Unix seconds).
#[derive(Debug, Clone, Copy)]
pub struct Row<'a> {
    pub request: Option<&'a str>,
    pub tier: &'a str,
    pub tenant: &'a str,
    pub arrival: f64,
    pub admitted: Option<f64>,
    pub first_token: Option<f64>,
    pub end: f64,
    pub prompt_tokens: u64,
    pub max_tokens: Option<u64>,
    pub output_tokens: u64,
    pub outcome: &'a str,
    pub reason: Option<&'a str>,
    pub backend: Option<&'a str>,
    pub shadow: Option<&'a str>,
}

impl Row<'_> {
    /// The row's CSV line (`\r\n` ended): `request_log.format_row`'s cells (times to the
    /// microsecond, a moment that never came as an empty cell) as `csv.writer` writes them,
    /// with the `shadow` cell last in shadow mode.
    pub fn csv(&self, shadow: bool) -> String {
        let attempts = "1";
        let cells = [
            self.request.unwrap_or("").to_owned(),
            self.tier.to_owned(),
            self.tenant.to_owned(),
            time_cell(Some(self.arrival)),
            attempts.to_owned(),
            time_cell(self.admitted),
            time_cell(self.first_token),
            time_cell(Some(self.end)),
            self.prompt_tokens.to_string(),
            self.max_tokens.map_or_else(String::new, |n| n.to_string()),
            self.output_tokens.to_string(),
            self.outcome.to_owned(),
            self.reason.unwrap_or("").to_owned(),
            self.backend.unwrap_or("").to_owned(),
        ];
        let last = shadow.then(|| self.shadow.unwrap_or("").to_owned());
        csv_row(cells.iter().map(String::as_str).chain(last.as_deref()))
    }
}

/// A time cell: `f"{t:.6f}"`, NaN and None empty.
fn time_cell(t: Option<f64>) -> String {
    match t {
        Some(t) if !t.is_nan() => format!("{t:.6}"),
        _ => String::new(),
    }
}

/// Cells as `csv.writer` (the excel dialect) writes them: comma separated, a cell quoted when
/// it holds a comma, a quote, `\r` or `\n` (its quotes doubled), `\r\n` at the end.
pub fn csv_row<'a>(cells: impl Iterator<Item = &'a str>) -> String {
    let mut line = String::new();
    for (i, cell) in cells.enumerate() {
        if i > 0 {
            line.push(',');
        }
        if cell.contains([',', '"', '\r', '\n']) {
            let _ = write!(line, "\"{}\"", cell.replace('"', "\"\""));
        } else {
            line.push_str(cell);
        }
    }
    line.push_str("\r\n");
    line
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> Row<'static> {
        Row {
            request: Some("llmflow-7"),
            tier: "vip",
            tenant: "alpha",
            arrival: 1_765_000_000.25,
            admitted: None,
            first_token: None,
            end: 1_765_000_001.5,
            prompt_tokens: 37,
            max_tokens: None,
            output_tokens: 0,
            outcome: "rejected",
            reason: Some("queue_full"),
            backend: None,
            shadow: None,
        }
    }

    #[test]
    fn metric_outcomes_follow_the_runtime_words() {
        // the mapping the Python path's `_OUTCOME` held, unknown ends cancelled
        for (end, want) in [
            ("completed", "completed"),
            ("error", "error"),
            ("upstream_error", "error"),
            ("deadline", "timeout"),
            ("first_token_timeout", "timeout"),
            ("queue_timeout", "timeout"),
            ("client_deadline", "timeout"),
            ("timeout", "timeout"),
            ("displaced", "rejected"),
            ("client_gone", "cancelled"),
            ("client_stall", "cancelled"),
            ("shutdown", "cancelled"),
        ] {
            assert_eq!(metric_outcome(end), want, "{end}");
        }
    }

    #[test]
    fn log_outcomes_read_the_error_status_first() {
        assert_eq!(log_outcome("completed", Some(500), 3), ("completed", false));
        // a 429 and the 503s that refuse are rejections; other 503s and 504s ran out
        assert_eq!(log_outcome("queue_full", Some(429), 0), ("rejected", true));
        assert_eq!(log_outcome("draining", Some(503), 0), ("rejected", true));
        assert_eq!(
            log_outcome("no_healthy_backend", Some(503), 0),
            ("rejected", true)
        );
        assert_eq!(
            log_outcome("queue_timeout", Some(503), 0),
            ("timed_out", true)
        );
        assert_eq!(log_outcome("deadline", Some(504), 0), ("timed_out", true));
        assert_eq!(
            log_outcome("upstream_error", Some(502), 0),
            ("failed", true)
        );
        // without an error: a deadline or a shutdown after some text is a truncation
        assert_eq!(log_outcome("deadline", None, 4), ("truncated", true));
        assert_eq!(log_outcome("shutdown", None, 4), ("truncated", true));
        assert_eq!(log_outcome("shutdown", None, 0), ("cancelled", true));
        assert_eq!(log_outcome("deadline", None, 0), ("timed_out", true));
        assert_eq!(
            log_outcome("first_token_timeout", None, 0),
            ("timed_out", true)
        );
        assert_eq!(log_outcome("error", None, 2), ("failed", true));
        assert_eq!(log_outcome("client_gone", None, 2), ("cancelled", true));
    }

    #[test]
    fn a_refusal_row_has_empty_cells_for_what_never_came() {
        assert_eq!(
            row().csv(false),
            "llmflow-7,vip,alpha,1765000000.250000,1,,,1765000001.500000,37,,0,rejected,\
             queue_full,\r\n"
        );
        // shadow mode: one more cell, empty without a verdict
        assert!(row().csv(true).ends_with(",queue_full,,\r\n"));
    }

    #[test]
    fn times_are_written_to_the_microsecond_as_python_rounds() {
        let mut r = row();
        r.admitted = Some(0.007_812_5); // a tie: rounded to even, as `f"{t:.6f}"`
        r.first_token = Some(1.000_000_5); // not a tie in binary: up
        r.end = f64::NAN; // NaN: an empty cell
        let line = r.csv(false);
        let cells: Vec<&str> = line.trim_end().split(',').collect();
        assert_eq!(&cells[5..8], ["0.007812", "1.000001", ""]);
    }

    #[test]
    fn a_tenant_with_a_comma_or_a_quote_is_quoted() {
        let mut r = row();
        r.tenant = "acme, inc";
        assert!(r.csv(false).contains(",\"acme, inc\","));
        r.tenant = "the \"big\" one";
        assert!(r.csv(false).contains(",\"the \"\"big\"\" one\","));
        r.tenant = "two\nlines";
        assert!(r.csv(false).contains(",\"two\nlines\","));
        r.shadow = Some("queue>refuse:queue_full");
        assert!(r.csv(true).ends_with(",queue>refuse:queue_full\r\n"));
    }

    #[test]
    fn the_log_has_its_header_once_and_a_line_per_request() {
        let dir = std::env::temp_dir().join(format!("llmflow-tally-{}", std::process::id()));
        let path = dir.join("logs").join("access.csv");
        let _ = std::fs::remove_dir_all(&dir);
        let tally = Tally::new();
        tally.open_log(&path, true).unwrap(); // its folder made, the shadow column named
        let refused = Refused {
            request: Some("llmflow-1".into()),
            tier: "vip".into(),
            tenant: "a,b".into(),
            status: 429,
            code: "queue_full".into(),
            ..Refused::default()
        };
        tally.refused(&refused);
        tally.close_log();
        tally.refused(&refused); // closed: counted, not written
        tally.open_log(&path, true).unwrap(); // the file exists: no second header
        tally.ended(&Ended {
            request: Some("llmflow-2".into()),
            end: "client_gone".into(),
            shadow: Some("queue".into()),
            ..Ended::default()
        });
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.split_terminator("\r\n").collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert_eq!(lines[0], format!("{},shadow", COLUMNS.join(",")));
        assert!(
            lines[1].starts_with("llmflow-1,vip,\"a,b\","),
            "{}",
            lines[1]
        );
        assert!(lines[1].ends_with(",rejected,queue_full,,"), "{}", lines[1]);
        assert!(
            lines[2].ends_with(",0,cancelled,client_gone,,queue"),
            "{}",
            lines[2]
        );
        assert_eq!(tally.counts().requests[0].1.value, 2.0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn ends_count_by_outcome_and_observe_what_happened() {
        let tally = Tally::new();
        let served = Ended {
            tier: "vip".into(),
            end: "completed".into(),
            arrived_s: 10.0,
            ended_s: Some(10.3),
            queue_wait_s: Some(0.02),
            backend: Some("b0".into()),
            completion_tokens: 5,
            ..Ended::default()
        };
        tally.ended(&served);
        tally.ended(&Ended {
            end: "client_gone".into(),
            backend: None,
            completion_tokens: 0,
            ..served.clone()
        });
        tally.first_token("vip", 0.005); // on a bound: counted in it
        let counts = tally.counts();
        let keys: Vec<_> = counts
            .requests
            .iter()
            .map(|(k, c)| (k.clone(), c.value))
            .collect();
        assert_eq!(
            keys,
            [
                (("vip".into(), "completed".into(), "completed".into()), 1.0),
                (
                    ("vip".into(), "cancelled".into(), "client_gone".into()),
                    1.0
                )
            ]
        );
        assert_eq!(counts.tokens[0].1.value, 5.0); // the one that left sent none: no count
        assert_eq!(counts.queue_wait[0].1.counts.iter().sum::<u64>(), 1); // started once
        assert_eq!(counts.queue_wait[0].1.counts[2], 1); // 0.02 <= 0.025
        assert_eq!(counts.e2e[0].1.counts[2], 1); // 0.3 s: <= 0.5
        assert_eq!(counts.ttft[0].1.counts[0], 1);
    }
}
