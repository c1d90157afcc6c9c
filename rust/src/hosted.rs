//! One runtime, fed by more than one host in the same process.
//!
//! The gateway's Python event loop (WebSocket sessions, the Responses API, what the native front
//! passes on) and the native front's tasks (`front/`) feed the same [`Runtime`], so the cap, the
//! fair queue and the KV ledger stay global. [`Hosted`] is that runtime with its trace buffer,
//! behind one lock held only for `handle`: a host locks it, feeds one event, takes the actions,
//! and lets go. Which host carries out an action is the [`Divert`]'s to say: the front claims
//! the actions of the requests it serves (and the one timer); every other action goes to the
//! host that fed the event, or, when a front task fed it, to Python's inbox.
//!
//! In shadow mode the runtime is the forwarding one and each `feed` goes through its
//! [`Shadow`], which mirrors the event to the policy runtime (`shadow.rs`), so both hosts'
//! events reach it in the one order the lock gives them.
//!
//! Decisions stay in the runtime: this file routes actions and keeps time monotonic across
//! hosts; it decides nothing.

use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::PolicyResult;
use crate::runtime::{Action, Event, Runtime};
use crate::shadow::Shadow;
use crate::trace;

/// Where the actions of the requests another host serves go.
pub trait Divert: Send {
    /// Take `action` (true) when another host carries it out; false leaves it to the caller.
    fn divert(&mut self, action: &Action) -> bool;

    /// Every action of one event has been offered. Returns the gates of what it took that must
    /// wait for the caller's share to be carried out first (see [`Gate`]), and what the
    /// caller's own `Start`s of the event must wait for first (the aborts it took before them).
    fn batch_end(&mut self) -> BatchEnd {
        BatchEnd::default()
    }
}

/// Held by the host that carries out an `Abort` another host's `Start` must wait for: dropped
/// (or sent on) once the abort has reached its socket, which lets the `Start` go upstream.
pub type Gate = std::sync::mpsc::SyncSender<()>;

/// What one event's routing leaves the hosts to wait for (see [`Divert::batch_end`]).
#[derive(Default)]
pub struct BatchEnd {
    pub gates: Vec<Gate>,
    /// The caller's `Start`s go upstream only once these are heard.
    pub caller_waits: Vec<Arc<Ack>>,
}

/// Heard once, by any number of waiters: an abort that reached its socket, or a gate that
/// opened. Every `Start` after it in its event waits for it, whichever host carries it out, so
/// vLLM hears of the slot freed before the request that takes it.
pub struct Ack(Mutex<Option<Receiver<()>>>);

impl Ack {
    pub fn new(heard: Receiver<()>) -> Arc<Self> {
        Arc::new(Self(Mutex::new(Some(heard))))
    }

    /// Block until it is heard (its sender sent or dropped), or `deadline` passes.
    pub fn wait(&self, deadline: Instant) {
        let mut heard = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(rx) = heard.as_ref() {
            let _ = rx.recv_timeout(deadline.saturating_duration_since(Instant::now()));
        }
        *heard = None; // heard, or given up on: later waiters need not wait again
    }
}

/// The longest a `Start` waits for the aborts before it to reach their sockets (a relay
/// stream's task carries an abort out within microseconds; Python, within a loop turn).
pub const ABORT_WAIT: Duration = Duration::from_millis(100);

/// Wait for every one of `acks`, `limit` in all.
pub fn wait_all(acks: &[Arc<Ack>], limit: Duration) {
    let deadline = Instant::now() + limit;
    for ack in acks {
        ack.wait(deadline);
    }
}

/// The runtime shared by the hosts of one process, its trace, and who carries out what.
pub struct Hosted {
    runtime: Runtime,
    trace: Option<String>,
    /// The latest instant fed: with two hosts reading the clock on different threads, an event
    /// may be stamped a few microseconds before one already fed.
    last_us: u64,
    divert: Option<Box<dyn Divert>>,
    /// Gates of the last event fed (`take_gates`), and those Python holds until it has carried
    /// out what it was given (`python_carried`).
    gates: Vec<Gate>,
    python_gates: Vec<Gate>,
    /// What the caller's `Start`s of the last event fed wait for (`take_caller_waits`).
    caller_waits: Vec<Arc<Ack>>,
    /// Shadow mode: the policy runtime every event is mirrored to (`shadow.rs`); this one is
    /// then the forwarding runtime, and the trace is the policy's.
    shadow: Option<Shadow>,
}

/// A [`Hosted`] runtime behind its lock.
pub type SharedRuntime = Arc<Mutex<Hosted>>;

impl Hosted {
    pub fn new(runtime: Runtime, trace: Option<String>) -> Self {
        Self {
            runtime,
            trace,
            last_us: 0,
            divert: None,
            gates: Vec::new(),
            python_gates: Vec::new(),
            caller_waits: Vec::new(),
            shadow: None,
        }
    }

    /// Shadow mode: this runtime forwards, and every event it is fed is mirrored to `policy`
    /// (see `shadow.rs`), whichever host feeds it.
    #[must_use]
    pub fn with_shadow(mut self, policy: Hosted) -> Self {
        self.shadow = Some(Shadow::new(policy.shared()));
        self
    }

    /// Shadow mode's recorder of the policy runtime, when on.
    pub fn shadow(&self) -> Option<&Shadow> {
        self.shadow.as_ref()
    }

    pub fn shadow_mut(&mut self) -> Option<&mut Shadow> {
        self.shadow.as_mut()
    }

    pub fn shared(self) -> SharedRuntime {
        Arc::new(Mutex::new(self))
    }

    /// Lock a shared runtime; a host that panicked while holding it left the runtime as its
    /// last complete `feed` left it, so the lock is taken anyway.
    pub fn lock(shared: &SharedRuntime) -> MutexGuard<'_, Self> {
        shared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    /// Whether another host shares this runtime (a divert is set).
    pub fn is_shared(&self) -> bool {
        self.divert.is_some()
    }

    /// Let another host claim actions from now on (see [`Divert`]).
    pub fn set_divert(&mut self, divert: Box<dyn Divert>) {
        self.divert = Some(divert);
    }

    /// Feed one event, record it when tracing, and hand each action either to the divert or
    /// to `keep`, in order.
    ///
    /// # Errors
    /// The runtime refused the event (nothing was done; the trace records the refusal).
    pub fn feed(
        &mut self,
        now_us: u64,
        event: &Event,
        keep: impl FnMut(&Runtime, &Action),
    ) -> PolicyResult<()> {
        // One host alone keeps its own clock (tests feed what they like); shared, the clock
        // of whichever host fed last must not run backwards for the other.
        let now_us = if self.divert.is_some() {
            now_us.max(self.last_us)
        } else {
            now_us
        };
        self.last_us = self.last_us.max(now_us);
        if self.shadow.is_some() {
            return self.feed_shadowed(now_us, event, keep);
        }
        let result = self.runtime.feed(now_us, event);
        if let Some(buf) = self.trace.as_mut() {
            let actions = self.runtime.actions();
            trace::record(buf, now_us, event, result.as_ref().map(|&()| actions));
        }
        result?;
        route(
            &self.runtime,
            &mut self.divert,
            self.runtime.actions(),
            keep,
        );
        self.end_batch();
        Ok(())
    }

    /// `feed` in shadow mode: the forwarding runtime (untraced) is fed through the shadow,
    /// which mirrors the event to the policy runtime and hands back the actions to route.
    fn feed_shadowed(
        &mut self,
        now_us: u64,
        event: &Event,
        keep: impl FnMut(&Runtime, &Action),
    ) -> PolicyResult<()> {
        let mut shadow = self.shadow.take().expect("shadow mode");
        let runtime = &mut self.runtime;
        let mut actions = Vec::new();
        let result = shadow.feed(
            now_us,
            event,
            &mut |event| {
                runtime.feed(now_us, event)?;
                Ok(runtime.actions().to_vec())
            },
            &mut actions,
        );
        self.shadow = Some(shadow);
        result?;
        route(&self.runtime, &mut self.divert, &actions, keep);
        self.end_batch();
        Ok(())
    }

    /// After a feed's actions are routed: the divert's gates for the caller to hold.
    fn end_batch(&mut self) {
        if let Some(divert) = self.divert.as_mut() {
            let end = divert.batch_end();
            self.gates = end.gates;
            self.caller_waits = end.caller_waits;
        }
    }

    /// The gates of the last event fed: the caller holds them until it has carried out its
    /// own actions of that event (Python: `hold_for_python`).
    pub fn take_gates(&mut self) -> Vec<Gate> {
        std::mem::take(&mut self.gates)
    }

    /// What the caller's own `Start`s of the last event fed must wait for before going
    /// upstream (`wait_all`, outside the lock).
    pub fn take_caller_waits(&mut self) -> Vec<Arc<Ack>> {
        std::mem::take(&mut self.caller_waits)
    }

    /// Gates Python holds until it has carried out what it was handed (`python_carried`).
    pub fn hold_for_python(&mut self, gates: Vec<Gate>) {
        self.python_gates.extend(gates);
    }

    /// Python has carried out every action it was handed: the `Start`s waiting on them go.
    pub fn python_carried(&mut self) {
        self.python_gates.clear();
    }

    /// The trace lines recorded since the last call ("" when not tracing).
    pub fn take_trace(&mut self) -> String {
        if let Some(shadow) = &self.shadow {
            return Hosted::lock(shadow.policy()).take_trace();
        }
        self.trace.as_mut().map(std::mem::take).unwrap_or_default()
    }

    pub fn tracing(&self) -> bool {
        match &self.shadow {
            Some(shadow) => Hosted::lock(shadow.policy()).tracing(),
            None => self.trace.is_some(),
        }
    }
}

impl std::fmt::Debug for Hosted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hosted")
            .field("live", &self.runtime.live())
            .field("shared", &self.is_shared())
            .finish_non_exhaustive()
    }
}

/// A feed's actions to their host: the divert takes the other host's, `keep` the rest.
fn route<'a>(
    runtime: &Runtime,
    divert: &mut Option<Box<dyn Divert>>,
    actions: impl IntoIterator<Item = &'a Action>,
    mut keep: impl FnMut(&Runtime, &Action),
) {
    for action in actions {
        let taken = divert.as_mut().is_some_and(|d| d.divert(action));
        if !taken {
            keep(runtime, action);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::sample_json;

    fn hosted() -> Hosted {
        let json = format!(r#"{{"policy": {}, "lifecycle": {{}}}}"#, sample_json());
        Hosted::new(Runtime::from_json(&json).unwrap(), Some(String::new()))
    }

    fn arrive(id: u64) -> Event {
        Event::plain_arrival(id, 0)
    }

    /// Claims the timer and the actions of one request, as the front's owner does.
    struct Claim {
        id: u64,
        taken: Arc<Mutex<Vec<Action>>>,
        batches: Arc<Mutex<u32>>,
    }

    impl Divert for Claim {
        fn divert(&mut self, action: &Action) -> bool {
            let mine = match action {
                Action::Arm { .. } => true,
                Action::Start { id, .. } | Action::Queued { id, .. } => *id == self.id,
                _ => false,
            };
            if mine {
                self.taken.lock().unwrap().push(action.clone());
            }
            mine
        }

        fn batch_end(&mut self) -> BatchEnd {
            *self.batches.lock().unwrap() += 1;
            BatchEnd::default()
        }
    }

    fn feed(h: &mut Hosted, now: u64, event: &Event) -> Vec<Action> {
        let mut kept = Vec::new();
        h.feed(now, event, |_, a| kept.push(a.clone())).unwrap();
        kept
    }

    #[test]
    fn alone_every_action_is_the_callers_and_its_clock_is_its_own() {
        let mut h = hosted();
        let kept = feed(&mut h, 5_000, &arrive(1));
        assert!(kept
            .iter()
            .any(|a| matches!(a, Action::Start { id: 1, .. })));
        assert!(kept.iter().any(|a| matches!(a, Action::Arm { .. })));
        // a host alone may feed an earlier instant (tests do): it is not moved
        feed(&mut h, 1_000, &Event::Started { id: 1 });
        assert!(h.take_trace().contains("\"t\":1000"));
    }

    #[test]
    fn a_divert_takes_its_requests_and_the_timer_and_the_rest_stays_with_the_caller() {
        let mut h = hosted();
        let taken = Arc::new(Mutex::new(Vec::new()));
        let batches = Arc::new(Mutex::new(0));
        h.set_divert(Box::new(Claim {
            id: 7,
            taken: Arc::clone(&taken),
            batches: Arc::clone(&batches),
        }));
        let kept = feed(&mut h, 10_000, &arrive(7));
        assert!(
            kept.is_empty(),
            "all of request 7's actions and the Arm: {kept:?}"
        );
        let kept = feed(&mut h, 11_000, &arrive(8));
        assert!(kept
            .iter()
            .any(|a| matches!(a, Action::Start { id: 8, .. })));
        assert!(!kept.iter().any(|a| matches!(a, Action::Arm { .. })));
        let taken = taken.lock().unwrap();
        assert!(taken
            .iter()
            .any(|a| matches!(a, Action::Start { id: 7, .. })));
        assert!(taken
            .iter()
            .all(|a| !matches!(a, Action::Start { id: 8, .. })));
        assert_eq!(*batches.lock().unwrap(), 2, "one batch end per event fed");
    }

    #[test]
    fn shared_the_clock_never_runs_back_for_the_other_host() {
        let mut h = hosted();
        h.set_divert(Box::new(Claim {
            id: 0,
            taken: Arc::default(),
            batches: Arc::default(),
        }));
        feed(&mut h, 20_000, &arrive(1));
        // stamped a moment before the event another host fed: fed at that host's instant
        feed(&mut h, 19_990, &Event::Started { id: 1 });
        let trace = h.take_trace();
        assert!(!trace.contains("\"t\":19990"), "{trace}");
        assert_eq!(trace.matches("\"t\":20000").count(), 2, "{trace}");
    }
}
