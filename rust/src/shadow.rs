//! Shadow mode (`gate.mode: shadow`): every event the forwarding runtime is fed, mirrored to
//! the policy runtime, whose actions are recorded instead of carried out.
//!
//! The forwarding runtime (every limit off) is the one the hosts carry out; the policy runtime
//! is built from the config as written. [`Shadow`] sits inside the forwarding runtime's
//! [`Hosted`], so each event reaches the policy runtime under the same
//! lock, at the same instant and in the same order, whichever host (Python's loop or a native
//! front task) fed it: the verdicts cannot differ between the two paths.
//!
//! What the policy runtime hears is what enforce mode's would, with one difference it cannot
//! avoid: a request it holds in its queue is already running upstream. Its events (started,
//! tokens, done, failed, the window) are kept while it waits (the backlog) and fed, compressed,
//! the moment the policy runtime starts it, at that instant; a client that leaves is told at
//! once, as enforce mode's runtime would hear it; a request it refused or cut hears nothing
//! more. Only the policy hears a client's signals (a client deadline must not refuse what the
//! forwarding runtime carries), and only the policy is told a backend's KV size (the forwarding
//! runtime must never wait for KV). The two runtimes' timers are kept as the host's one timer:
//! the host is armed at the earlier, and each runtime is fed the timer only when its own is due.
//!
//! It decides nothing: every decision is the policy runtime's; this file records them.

use std::collections::{BTreeMap, VecDeque};

use rustc_hash::FxHashMap;

use crate::error::PolicyResult;
use crate::hosted::{Hosted, SharedRuntime};
use crate::runtime::{Action, Event, Reason, Runtime};

/// What the policy runtime did with one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Its arrival is being fed.
    Arriving,
    Queued,
    Started,
    /// Answered with a `Reply` (`reason`, `status`, `retry_after_s`).
    Refused,
    /// Cut with a notice (`reason`).
    Cut,
}

impl Decision {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Arriving => "arriving",
            Self::Queued => "queued",
            Self::Started => "started",
            Self::Refused => "refused",
            Self::Cut => "cut",
        }
    }
}

/// One request's verdict, as the host reads it when the real request ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub decision: Decision,
    /// It waited in the policy's queue first.
    pub queued_first: bool,
    pub reason: Option<Reason>,
    pub status: Option<u16>,
    pub retry_after_s: Option<u32>,
    pub backend: Option<String>,
    /// The `max_tokens` a brownout would have sent.
    pub brownout: Option<u64>,
}

impl Verdict {
    /// The access log's `shadow` cell (see [`summary`]).
    pub fn summary(&self) -> String {
        summary(
            self.decision.as_str(),
            self.queued_first,
            self.reason.map(Reason::as_str),
            self.backend.is_some(),
        )
    }
}

/// The access log's `shadow` cell for a verdict: `start`, `queue>start`, `refuse:queue_full`,
/// `queue>refuse:queue_timeout`, `start>cut:deadline`, or `queue` (still waiting when the real
/// reply ended).
pub fn summary(decision: &str, queued_first: bool, reason: Option<&str>, started: bool) -> String {
    let mut steps: Vec<String> = Vec::new();
    if queued_first || decision == "queued" {
        steps.push("queue".into());
    }
    if decision == "started" || (decision == "cut" && started) {
        steps.push("start".into());
    }
    match decision {
        "refused" => steps.push(format!("refuse:{}", reason.unwrap_or("None"))),
        "cut" => steps.push(format!("cut:{}", reason.unwrap_or("None"))),
        _ => {}
    }
    steps.join(">")
}

/// A request the policy runtime has heard of.
#[derive(Debug)]
struct Held {
    verdict: Verdict,
    tier: usize,
    /// The policy runtime has not ended it.
    live: bool,
    /// Where the real request is: its verdict is the host's to take once it has ended.
    real: Real,
    /// The real request's events while the policy holds it queued, in order.
    backlog: Vec<Event>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Real {
    Running,
    Ended,
    /// Ended, and its host took the verdict.
    Taken,
}

impl Held {
    fn running(&self) -> bool {
        self.live && self.verdict.decision == Decision::Started
    }
}

/// Would-haves counted by kind, tier and reason: the metrics' `llmflow_shadow_*`.
pub type Tally = BTreeMap<(&'static str, String, Option<&'static str>), u64>;

/// The policy runtime and what it did with each request (see the module's doc).
pub struct Shadow {
    policy: SharedRuntime,
    held: FxHashMap<u64, Held>,
    /// Started from the queue in the feed being handled: their backlogs are fed after it.
    waiting: VecDeque<u64>,
    tally: Tally,
    /// The instant each runtime last armed its timer for (None: none held), and the instant
    /// the host's one timer is set for.
    forwarding_at: Option<u64>,
    policy_at: Option<u64>,
    host_at: Option<u64>,
}

impl Shadow {
    pub fn new(policy: SharedRuntime) -> Self {
        Self {
            policy,
            held: FxHashMap::default(),
            waiting: VecDeque::new(),
            tally: Tally::new(),
            forwarding_at: None,
            policy_at: None,
            host_at: None,
        }
    }

    /// The policy runtime, for the hosts' queries (`/api/state`, the gauges, its trace).
    pub fn policy(&self) -> &SharedRuntime {
        &self.policy
    }

    /// Feed `event` to the forwarding runtime (through `forward`) and to the policy, in the
    /// order enforce mode's host would; `out` gets the forwarding runtime's actions to carry
    /// out, its `Arm`s replaced by the host's one timer.
    ///
    /// # Errors
    /// The forwarding runtime (or, for an arrival, the policy) refused the event.
    pub fn feed(
        &mut self,
        now_us: u64,
        event: &Event,
        forward: &mut dyn FnMut(&Event) -> PolicyResult<Vec<Action>>,
        out: &mut Vec<Action>,
    ) -> PolicyResult<()> {
        match event {
            Event::Arrive { id, tenant, .. } => {
                self.arrive(now_us, *id, *tenant, event, forward, out)?;
            }
            Event::Started { .. }
            | Event::Tokens { .. }
            | Event::Done { .. }
            | Event::Failed { .. }
            | Event::ClientGone { .. }
            | Event::WindowFull { .. }
            | Event::WindowDrained { .. } => {
                let actions = forward(event)?;
                self.forwarded(actions, out);
                self.mirror(now_us, event);
            }
            Event::ScrapeOk {
                backend,
                began_us,
                kv_usage,
                running,
                waiting,
                preemptions_total,
                ..
            } => {
                let blind = Event::ScrapeOk {
                    backend: *backend,
                    began_us: *began_us,
                    kv_usage: *kv_usage,
                    running: *running,
                    waiting: *waiting,
                    preemptions_total: *preemptions_total,
                    kv_blocks: None,
                };
                let actions = forward(&blind)?;
                self.forwarded(actions, out);
                let _ = self.feed_policy(now_us, event);
            }
            Event::ScrapeFailed { .. } | Event::Drain => {
                let actions = forward(event)?;
                self.forwarded(actions, out);
                let _ = self.feed_policy(now_us, event);
            }
            Event::Timer => {
                self.host_at = None;
                if self.forwarding_at.is_some_and(|at| at <= now_us) {
                    self.forwarding_at = None;
                    let actions = forward(event)?;
                    self.forwarded(actions, out);
                }
                if self.policy_at.is_some_and(|at| at <= now_us) {
                    self.policy_at = None;
                    let _ = self.feed_policy(now_us, event);
                }
            }
            _ => {
                let actions = forward(event)?;
                self.forwarded(actions, out);
            }
        }
        self.catch_up(now_us);
        let next = self.forwarding_at.into_iter().chain(self.policy_at).min();
        if let Some(at) = next {
            if self.host_at.is_none_or(|held| at < held) {
                self.host_at = Some(at);
                out.push(Action::Arm { at_us: at });
            }
        }
        Ok(())
    }

    /// An arrival: the policy decides first (recorded), then the forwarding runtime starts
    /// it, without the client's signals.
    fn arrive(
        &mut self,
        now_us: u64,
        id: u64,
        tenant: u32,
        event: &Event,
        forward: &mut dyn FnMut(&Event) -> PolicyResult<Vec<Action>>,
        out: &mut Vec<Action>,
    ) -> PolicyResult<()> {
        let tier = self.tier_of(tenant);
        self.held.insert(
            id,
            Held {
                verdict: Verdict {
                    decision: Decision::Arriving,
                    queued_first: false,
                    reason: None,
                    status: None,
                    retry_after_s: None,
                    backend: None,
                    brownout: None,
                },
                tier,
                live: true,
                real: Real::Running,
                backlog: Vec::new(),
            },
        );
        if let Err(e) = self.feed_policy(now_us, event) {
            self.held.remove(&id);
            return Err(e);
        }
        if let Some(held) = self.held.get_mut(&id) {
            if held.verdict.decision == Decision::Arriving {
                held.verdict.decision = Decision::Queued;
                let tier = held.tier;
                self.count("queued", tier, None);
            }
        }
        let mut unsignalled = event.clone();
        if let Event::Arrive {
            retries,
            deadline_ms,
            ..
        } = &mut unsignalled
        {
            (*retries, *deadline_ms) = (None, None);
        }
        match forward(&unsignalled) {
            Ok(actions) => {
                self.forwarded(actions, out);
                Ok(())
            }
            Err(e) => {
                // The policy runtime must not keep what the forwarding one refused.
                self.mirror(now_us, &Event::ClientGone { id });
                self.held.remove(&id);
                Err(e)
            }
        }
    }

    /// The verdict of a real request that has ended, once (None: not one the policy heard).
    pub fn take(&mut self, id: u64) -> Option<Verdict> {
        let held = self.held.get_mut(&id)?;
        if held.real != Real::Ended {
            return None;
        }
        let verdict = held.verdict.clone();
        held.real = Real::Taken; // dropped once the policy is done with it too
        if !held.live {
            self.held.remove(&id);
        }
        Some(verdict)
    }

    /// What the policy runtime would have done, counted so far.
    pub fn tally(&self) -> &Tally {
        &self.tally
    }

    /// Requests whose verdict is still kept (the policy holds them, or their host has not
    /// taken it yet).
    pub fn held(&self) -> usize {
        self.held.len()
    }

    fn forwarded(&mut self, actions: Vec<Action>, out: &mut Vec<Action>) {
        for action in actions {
            match action {
                Action::Arm { at_us } => self.forwarding_at = Some(at_us),
                Action::Reply { id, .. } | Action::Cut { id, .. } | Action::End { id, .. } => {
                    if let Some(held) = self.held.get_mut(&id) {
                        held.real = Real::Ended;
                    }
                    out.push(action);
                }
                _ => out.push(action),
            }
        }
    }

    fn tier_of(&self, tenant: u32) -> usize {
        let policy = Hosted::lock(&self.policy);
        let tiers = &policy.runtime().governor().tenant_tier;
        tiers.get(tenant as usize).copied().unwrap_or(0)
    }

    /// Feed the policy runtime one event, and record its actions.
    fn feed_policy(&mut self, now_us: u64, event: &Event) -> PolicyResult<()> {
        let mut actions = Vec::new();
        let mut backends = Vec::new();
        {
            let mut policy = Hosted::lock(&self.policy);
            policy.feed(now_us, event, |runtime: &Runtime, action| {
                if let Action::Start { backend, .. } = action {
                    backends.push(runtime.governor().backend_name(*backend).to_owned());
                }
                actions.push(action.clone());
            })?;
        }
        let mut backends = backends.into_iter();
        for action in actions {
            self.record(&action, &mut backends);
        }
        Ok(())
    }

    fn record(&mut self, action: &Action, backends: &mut impl Iterator<Item = String>) {
        match action {
            Action::Arm { at_us } => self.policy_at = Some(*at_us),
            Action::Start { id, max_tokens, .. } => {
                let backend = backends.next();
                let Some(held) = self.held.get_mut(id) else {
                    return;
                };
                let v = &mut held.verdict;
                v.queued_first = v.decision == Decision::Queued;
                v.decision = Decision::Started;
                v.backend = backend;
                v.brownout = *max_tokens;
                let (tier, from_queue) = (held.tier, v.queued_first);
                if max_tokens.is_some() {
                    self.count("brownout", tier, None);
                }
                if from_queue {
                    self.waiting.push_back(*id);
                }
            }
            Action::Reply {
                id,
                status,
                reason,
                retry_after_s,
            } => {
                if let Some(held) = self.held.get_mut(id).filter(|_| own(*reason)) {
                    let v = &mut held.verdict;
                    v.queued_first |= v.decision == Decision::Queued;
                    v.decision = Decision::Refused;
                    v.reason = Some(*reason);
                    (v.status, v.retry_after_s) = (Some(*status), *retry_after_s);
                    let tier = held.tier;
                    self.count("refused", tier, Some(reason.as_str()));
                }
                self.ended(*id);
            }
            Action::Cut { id, reason } => {
                if let Some(held) = self.held.get_mut(id).filter(|_| own(*reason)) {
                    held.verdict.decision = Decision::Cut;
                    held.verdict.reason = Some(*reason);
                    let tier = held.tier;
                    self.count("cut", tier, Some(reason.as_str()));
                }
                self.ended(*id);
            }
            Action::End { id, .. } => self.ended(*id),
            // The policy only records: an abort is followed by the end that says why, its
            // health changes are its own, and it holds no leases.
            Action::Queued { .. }
            | Action::Abort { .. }
            | Action::Backend { .. }
            | Action::Lease { .. }
            | Action::Release { .. } => {}
        }
    }

    /// The policy runtime ended request `id`: it hears nothing more.
    fn ended(&mut self, id: u64) {
        let Some(held) = self.held.get_mut(&id) else {
            return;
        };
        held.live = false;
        held.backlog.clear();
        if held.real == Real::Taken {
            self.held.remove(&id);
        }
    }

    fn count(&mut self, what: &'static str, tier: usize, reason: Option<&'static str>) {
        let tier = Hosted::lock(&self.policy)
            .runtime()
            .governor()
            .tier_name(tier)
            .to_owned();
        *self.tally.entry((what, tier, reason)).or_insert(0) += 1;
    }

    /// Mirror a real request's event: through while the policy runs it (a client leaving,
    /// always), kept while it waits, dropped once the policy has ended it.
    fn mirror(&mut self, now_us: u64, event: &Event) {
        let Some(id) = request_of(event) else { return };
        let Some(held) = self.held.get_mut(&id) else {
            return;
        };
        if !held.live {
            return;
        }
        if held.running() || matches!(event, Event::ClientGone { .. }) {
            let _ = self.feed_policy(now_us, event);
        } else {
            held.backlog.push(event.clone());
        }
    }

    /// Feed the backlogs of the requests the policy started from its queue, each compressed,
    /// at this instant (their own events may start more: the loop goes on).
    fn catch_up(&mut self, now_us: u64) {
        while let Some(id) = self.waiting.pop_front() {
            let backlog = match self.held.get_mut(&id) {
                Some(held) => std::mem::take(&mut held.backlog),
                None => continue,
            };
            for event in compressed(id, &backlog) {
                if !self.held.get(&id).is_some_and(Held::running) {
                    break;
                }
                let _ = self.feed_policy(now_us, &event);
            }
        }
    }
}

/// Whether an end is a verdict of the policy's own, not a real failure it repeated.
fn own(reason: Reason) -> bool {
    reason != Reason::UpstreamError
}

fn request_of(event: &Event) -> Option<u64> {
    match event {
        Event::Started { id }
        | Event::Tokens { id, .. }
        | Event::Done { id }
        | Event::Failed { id, .. }
        | Event::ClientGone { id }
        | Event::WindowFull { id }
        | Event::WindowDrained { id } => Some(*id),
        _ => None,
    }
}

/// A backlog as the events to feed at once: started, every token in one count, the last
/// window state when full, the end. (Each as it came, only all at the instant the policy
/// started it.)
fn compressed(id: u64, backlog: &[Event]) -> Vec<Event> {
    let mut events = Vec::new();
    if backlog.iter().any(|e| matches!(e, Event::Started { .. })) {
        events.push(Event::Started { id });
    }
    let tokens: u64 = backlog
        .iter()
        .map(|e| match e {
            Event::Tokens { n, .. } => *n,
            _ => 0,
        })
        .sum();
    if tokens > 0 {
        events.push(Event::Tokens { id, n: tokens });
    }
    let window = backlog
        .iter()
        .rfind(|e| matches!(e, Event::WindowFull { .. } | Event::WindowDrained { .. }));
    if let Some(full @ Event::WindowFull { .. }) = window {
        events.push(full.clone());
    }
    if let Some(end) = backlog.iter().find(|e| {
        matches!(
            e,
            Event::Done { .. } | Event::Failed { .. } | Event::ClientGone { .. }
        )
    }) {
        events.push(end.clone());
    }
    events
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::sample_json;

    const VIP: u32 = 0; // tenant "v": the sample's protected tier

    fn runtime(policy: &str) -> Runtime {
        Runtime::from_json(&format!(r#"{{"policy": {policy}, "lifecycle": {{}}}}"#)).unwrap()
    }

    /// The sample's policy (two slots, four places) over an unlimited forwarding runtime.
    fn shadowed() -> Hosted {
        let unlimited = sample_json()
            .replace(
                r#""max_concurrency_per_gpu":2,"max_waiting":4"#,
                r#""max_concurrency_per_gpu":1000,"max_waiting":1000"#,
            )
            .replace(
                r#""first_token_timeout_ms":3000"#,
                r#""first_token_timeout_ms":null"#,
            );
        let policy = Hosted::new(runtime(&sample_json()), Some(String::new()));
        Hosted::new(runtime(&unlimited), None).with_shadow(policy)
    }

    fn arrive(id: u64) -> Event {
        Event::plain_arrival(id, VIP)
    }

    fn feed(h: &mut Hosted, now: u64, event: &Event) -> Vec<Action> {
        let mut kept = Vec::new();
        h.feed(now, event, |_, a| kept.push(a.clone())).unwrap();
        kept
    }

    fn policy_live(h: &Hosted, id: u64) -> bool {
        Hosted::lock(h.shadow().unwrap().policy())
            .runtime()
            .is_live(id)
    }

    fn tally(h: &Hosted, what: &'static str, reason: Option<&'static str>) -> u64 {
        let key = (what, "vip".to_owned(), reason);
        h.shadow().unwrap().tally().get(&key).copied().unwrap_or(0)
    }

    fn verdict(h: &mut Hosted, id: u64) -> Option<Verdict> {
        h.shadow_mut().unwrap().take(id)
    }

    /// Serve request `id` to its end on the forwarding side: started, tokens, done.
    fn serve(h: &mut Hosted, now: u64, id: u64) {
        feed(h, now, &Event::Started { id });
        feed(h, now, &Event::Tokens { id, n: 10 });
        feed(h, now, &Event::Done { id });
    }

    // The forwarding runtime starts everything; the policy queues the third, keeps its events
    // while it waits, and feeds them (compressed) the moment a slot frees.
    #[test]
    fn a_request_the_policy_queues_hears_its_events_when_it_starts() {
        let mut h = shadowed();
        for id in 1..=3 {
            let kept = feed(&mut h, 1_000 + id, &arrive(id));
            assert!(
                kept.iter()
                    .any(|a| matches!(a, Action::Start { id: i, .. } if *i == id)),
                "{kept:?}"
            );
        }
        assert_eq!(tally(&h, "queued", None), 1);
        feed(&mut h, 2_000, &Event::Started { id: 3 });
        feed(&mut h, 2_000, &Event::Tokens { id: 3, n: 4 });
        feed(&mut h, 2_100, &Event::Done { id: 3 });
        // the real request 3 ended while the policy holds it queued: its verdict says so
        assert_eq!(verdict(&mut h, 3).unwrap().decision, Decision::Queued);
        assert!(policy_live(&h, 3));
        serve(&mut h, 3_000, 1); // a slot frees: the policy starts 3 and hears its backlog
        assert!(!policy_live(&h, 3), "its done, kept, was fed at its start");
        serve(&mut h, 3_100, 2);
        assert_eq!(verdict(&mut h, 1).unwrap().decision, Decision::Started);
        assert_eq!(verdict(&mut h, 2).unwrap().decision, Decision::Started);
        assert_eq!(verdict(&mut h, 3), None, "taken once");
        assert_eq!(h.shadow().unwrap().held(), 0);
        assert_eq!(h.runtime().live(), 0);
        let trace = Hosted::lock(h.shadow().unwrap().policy()).take_trace();
        assert_eq!(
            trace.matches(r#""tokens":{"id":3,"n":4}"#).count(),
            1,
            "{trace}"
        );
    }

    // Past its four places the policy refuses: counted, answered in the verdict, and the
    // refused request hears nothing more while the real one runs on.
    #[test]
    fn a_request_the_policy_refuses_is_counted_and_hears_nothing_more() {
        let mut h = shadowed();
        for id in 1..=7 {
            feed(&mut h, 1_000 + id, &arrive(id));
        }
        assert_eq!(tally(&h, "queued", None), 4);
        assert_eq!(tally(&h, "refused", Some("queue_full")), 1);
        serve(&mut h, 2_000, 7);
        let v = verdict(&mut h, 7).unwrap();
        assert_eq!((v.decision, v.status), (Decision::Refused, Some(429)));
        assert_eq!(v.reason, Some(Reason::QueueFull));
        assert!(v.retry_after_s.is_some_and(|s| s > 0));
        for id in 1..=6 {
            feed(&mut h, 3_000, &Event::ClientGone { id });
            assert!(!policy_live(&h, id), "a client leaving is heard at once");
            verdict(&mut h, id);
        }
        assert_eq!(h.shadow().unwrap().held(), 0);
    }

    // The host holds one timer, at the earlier of the two runtimes'; each runtime hears the
    // timer only when its own is due: the policy's first-token deadline cuts the two it runs
    // (and starts the third), while the forwarding runtime, without one, runs on.
    #[test]
    fn the_two_timers_are_the_hosts_one() {
        let mut h = shadowed();
        let mut armed = Vec::new();
        for id in 1..=3 {
            for a in feed(&mut h, 1_000, &arrive(id)) {
                if let Action::Arm { at_us } = a {
                    armed.push(at_us);
                }
            }
        }
        let at = *armed
            .last()
            .expect("the policy's deadlines arm the host's timer");
        assert!(at > 3_000_000, "the policy's first-token deadline: {at}");
        feed(&mut h, at - 1, &Event::Timer); // early: neither runtime is due, nothing happens
        assert_eq!(tally(&h, "cut", Some("first_token_timeout")), 0);
        let kept = feed(&mut h, at, &Event::Timer);
        assert!(
            kept.iter().all(|a| !a.is_terminal()),
            "forwarding runs on: {kept:?}"
        );
        assert_eq!(tally(&h, "cut", Some("first_token_timeout")), 2);
        assert!(!policy_live(&h, 1) && policy_live(&h, 3));
        assert_eq!(h.runtime().live(), 3);
    }

    // Only the policy hears a client's deadline: it refuses at once a request whose wait it
    // expects to outlast the deadline (counted), while the forwarding runtime starts it.
    #[test]
    fn a_clients_deadline_is_the_policys_alone() {
        let mut h = shadowed();
        feed(&mut h, 1_000, &arrive(1));
        feed(&mut h, 1_000, &arrive(2));
        let mut third = arrive(3);
        if let Event::Arrive { deadline_ms, .. } = &mut third {
            *deadline_ms = Some(2_000);
        }
        let kept = feed(&mut h, 1_000, &third);
        assert!(kept
            .iter()
            .any(|a| matches!(a, Action::Start { id: 3, .. })));
        assert_eq!(tally(&h, "refused", Some("client_deadline")), 1);
        assert_eq!(tally(&h, "queued", None), 0);
        assert!(!policy_live(&h, 3));
        serve(&mut h, 2_000, 3);
        let v = verdict(&mut h, 3).unwrap();
        assert_eq!((v.decision, v.status), (Decision::Refused, Some(429)));
    }

    #[test]
    fn shadow_summaries_name_each_step() {
        assert_eq!(summary("started", false, None, true), "start");
        assert_eq!(summary("started", true, None, true), "queue>start");
        assert_eq!(summary("queued", false, None, false), "queue");
        assert_eq!(
            summary("refused", true, Some("queue_timeout"), false),
            "queue>refuse:queue_timeout"
        );
        assert_eq!(
            summary("cut", false, Some("deadline"), true),
            "start>cut:deadline"
        );
        assert_eq!(
            summary("cut", false, Some("deadline"), false),
            "cut:deadline"
        );
    }
}
