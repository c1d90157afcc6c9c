//! The runtime's owner when the native front serves beside Python: who carries out each action.
//!
//! Every host feeds the one [`Hosted`] runtime under its lock. The owner's [`Divert`] sends the
//! actions of a request the front serves to that request's task, keeps the runtime's one timer
//! on tokio (`Arm`), and lets Python carry out the rest: directly, when Python fed the event
//! (the actions come back from its call), or through Python's inbox and its wake-up pipe, when
//! a front task fed it. An `Abort` of a relayed stream is handed to the relay at once, and a
//! `Start` in the same batch waits until it has reached the socket, so vLLM hears of the slot
//! freed before the request that takes it.
//!
//! It decides nothing: every decision is the runtime's.

use std::fs::File;
use std::io::Write;
use std::mem;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rustc_hash::FxHashMap;
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::watch;

use crate::error::PolicyResult;
use crate::hosted::{wait_all, Ack, BatchEnd, Divert, Gate, Hosted, SharedRuntime, ABORT_WAIT};
use crate::relay::{Control, Streams};
use crate::runtime::{Action, Event, Runtime};

use super::record::Record;
use crate::tally::Tally;

/// An action for a front task, with the aborts it must wait for before going upstream.
pub struct Order {
    pub action: Action,
    pub after: Vec<Arc<Ack>>,
}

/// What Python must hear from the front: actions of its own requests that a front task's
/// event caused, and the records of the requests it has work with (spans, a warning).
#[derive(Default)]
struct Inbox {
    actions: Vec<Action>,
    records: Vec<Record>,
    gates: Vec<Gate>,
    /// What Python's `Start`s among `actions` wait for (front aborts before them).
    waits: Vec<Arc<Ack>>,
    /// A wake-up byte is on its way and Python has not taken the inbox since.
    woken: bool,
}

/// A request the front serves, as `/api/state` lists it among the live streams.
#[derive(Debug, Clone, Default)]
pub struct Live {
    pub tenant: String,
    pub tier: String,
    pub arrived_us: u64,
    /// Where it was started (None: it waits).
    pub backend: Option<String>,
    /// Its first token has gone out.
    pub streaming: bool,
}

/// The runtime, the front's requests, the timer, and Python's inbox.
pub struct Owner {
    runtime: SharedRuntime,
    tasks: Arc<Mutex<FxHashMap<u64, UnboundedSender<Order>>>>,
    live: Mutex<FxHashMap<u64, Live>>,
    inbox: Mutex<Inbox>,
    notify: Mutex<File>,
    next_id: AtomicU64,
    /// Shadow mode: each request's end record carries the policy runtime's verdict.
    shadowed: bool,
    /// Where the front counts its requests and writes their access-log rows.
    tally: Arc<Tally>,
}

/// The owner's part inside the runtime's lock.
struct FrontDivert {
    tasks: Arc<Mutex<FxHashMap<u64, UnboundedSender<Order>>>>,
    timer: watch::Sender<Option<u64>>,
    streams: Streams,
    /// Aborts handed to the relay in the batch being routed.
    aborts: Vec<Arc<Ack>>,
    /// An `Abort` the caller carries out (a request Python serves) came in this batch: the
    /// front's `Start`s after it wait behind a gate until it has.
    caller_aborts: bool,
    /// That gate, opened once the caller has carried out its actions.
    gate: Option<Arc<Ack>>,
    gates: Vec<Gate>,
    /// The relay's aborts the caller's own `Start`s of this batch wait for.
    caller_waits: Vec<Arc<Ack>>,
}

impl Divert for FrontDivert {
    fn divert(&mut self, action: &Action) -> bool {
        match action {
            Action::Arm { at_us } => {
                self.timer.send_replace(Some(*at_us));
                return true;
            }
            // Whatever ends a relayed stream early stops its upstream request here, at once, and a
            // `Start` of the same event waits until it has (the stream's own task then writes
            // the notice or the error): vLLM never runs more than the runtime let in.
            Action::Abort { id }
            | Action::Cut { id, .. }
            | Action::Reply { id, .. }
            | Action::End { id, .. } => {
                if let Some(acked) = self.streams.control_acked(*id, Control::Abort) {
                    self.aborts.push(Ack::new(acked));
                }
            }
            _ => {}
        }
        let Some(id) = request_of(action) else {
            return false;
        };
        let tasks = self.tasks.lock().unwrap();
        let Some(task) = tasks.get(&id) else {
            // A request Python serves: its `Start` goes once the relay's aborts before it have
            // reached their sockets; whatever ends it closes its upstream socket there.
            if matches!(action, Action::Start { .. }) {
                self.caller_waits.clone_from(&self.aborts);
            }
            self.caller_aborts |= matches!(
                action,
                Action::Abort { .. }
                    | Action::Cut { .. }
                    | Action::Reply { .. }
                    | Action::End { .. }
            );
            return false;
        };
        let after = if matches!(action, Action::Start { .. }) {
            let mut after = self.aborts.clone();
            if self.caller_aborts {
                let gates = &mut self.gates;
                let gate = self.gate.get_or_insert_with(|| {
                    let (gate, opened) = std::sync::mpsc::sync_channel(1);
                    gates.push(gate);
                    Ack::new(opened)
                });
                after.push(Arc::clone(gate));
            }
            after
        } else {
            Vec::new()
        };
        // A task that is gone ended its request already; nothing is left to carry out.
        let _ = task.send(Order {
            action: action.clone(),
            after,
        });
        true
    }

    fn batch_end(&mut self) -> BatchEnd {
        self.aborts.clear();
        self.caller_aborts = false;
        self.gate = None;
        BatchEnd {
            gates: mem::take(&mut self.gates),
            caller_waits: mem::take(&mut self.caller_waits),
        }
    }
}

/// The request an action is for (None: the timer, a backend's health).
fn request_of(action: &Action) -> Option<u64> {
    match action {
        Action::Start { id, .. }
        | Action::Queued { id, .. }
        | Action::Abort { id }
        | Action::Reply { id, .. }
        | Action::Cut { id, .. }
        | Action::End { id, .. }
        | Action::Lease { id, .. }
        | Action::Release { id, .. } => {
            // Leases are Python's I/O (the shared store) whoever serves the request.
            (!matches!(action, Action::Lease { .. } | Action::Release { .. })).then_some(*id)
        }
        Action::Arm { .. } | Action::Backend { .. } => None,
    }
}

impl Owner {
    /// Take over `runtime`'s routing: from now on the front's requests, and the timer, are
    /// carried out here. `notify` is the write end of Python's wake-up pipe.
    pub fn attach(
        runtime: SharedRuntime,
        streams: Streams,
        notify: File,
        tally: Arc<Tally>,
    ) -> Arc<Self> {
        let (timer, mut armed) = watch::channel(None::<u64>);
        let tasks: Arc<Mutex<FxHashMap<u64, UnboundedSender<Order>>>> = Arc::default();
        let handle = streams.handle().clone();
        let shadowed = {
            let mut hosted = Hosted::lock(&runtime);
            // Python's host keeps its own counter from 1; the front's ids start far above it,
            // so each stays unique in the one runtime and the trace.
            hosted.set_divert(Box::new(FrontDivert {
                tasks: Arc::clone(&tasks),
                timer,
                streams,
                aborts: Vec::new(),
                caller_aborts: false,
                gate: None,
                gates: Vec::new(),
                caller_waits: Vec::new(),
            }));
            hosted.shadow().is_some()
        };
        let owner = Arc::new(Self {
            runtime,
            tasks,
            live: Mutex::default(),
            inbox: Mutex::default(),
            notify: Mutex::new(notify),
            next_id: AtomicU64::new(FRONT_IDS),
            shadowed,
            tally,
        });
        let weak = Arc::downgrade(&owner);
        handle.spawn(async move {
            // The one timer: sleep until the instant last armed; a re-arm wakes the wait.
            loop {
                let at = *armed.borrow_and_update();
                let fired = if let Some(at_us) = at {
                    let wait = at_us.saturating_sub(now_us());
                    let sleep = tokio::time::sleep(std::time::Duration::from_micros(wait));
                    tokio::select! {
                        () = sleep => true,
                        changed = armed.changed() => {
                            if changed.is_err() {
                                return;
                            }
                            false
                        }
                    }
                } else {
                    if armed.changed().await.is_err() {
                        return;
                    }
                    false
                };
                if fired {
                    let Some(owner) = weak.upgrade() else { return };
                    armed.borrow_and_update();
                    let _ = owner.feed(&Event::Timer);
                }
            }
        });
        owner
    }

    /// A fresh request id for a request the front serves.
    pub fn new_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Serve request `id` here: its actions go to `task`.
    pub fn register(&self, id: u64, task: UnboundedSender<Order>, live: Live) {
        self.live.lock().unwrap().insert(id, live);
        self.tasks.lock().unwrap().insert(id, task);
    }

    /// The request has ended; nothing more is routed to its task.
    pub fn unregister(&self, id: u64) {
        self.tasks.lock().unwrap().remove(&id);
        self.live.lock().unwrap().remove(&id);
    }

    /// Note what happened to a live request (its start, its first token).
    pub fn update(&self, id: u64, f: impl FnOnce(&mut Live)) {
        if let Some(live) = self.live.lock().unwrap().get_mut(&id) {
            f(live);
        }
    }

    /// The requests the front serves now, for `/api/state`.
    pub fn streams(&self) -> Vec<(u64, Live)> {
        let live = self.live.lock().unwrap();
        let mut out: Vec<(u64, Live)> = live.iter().map(|(&id, l)| (id, l.clone())).collect();
        out.sort_unstable_by_key(|&(id, _)| id);
        out
    }

    /// Feed an event from a front task now; actions of Python's requests go to its inbox.
    ///
    /// # Errors
    /// The runtime refused the event.
    pub fn feed(&self, event: &Event) -> PolicyResult<()> {
        let mut python = Vec::new();
        let (gates, waits) = {
            let mut hosted = Hosted::lock(&self.runtime);
            hosted.feed(now_us(), event, |_, action| python.push(action.clone()))?;
            (hosted.take_gates(), hosted.take_caller_waits())
        };
        if !python.is_empty() {
            let mut inbox = self.inbox.lock().unwrap();
            inbox.actions.append(&mut python);
            inbox.gates.extend(gates);
            inbox.waits.extend(waits);
            self.wake(&mut inbox);
        }
        Ok(())
    }

    /// Read the runtime (ids of names, the model table) under its lock.
    pub fn read<T>(&self, f: impl FnOnce(&Runtime) -> T) -> T {
        f(Hosted::lock(&self.runtime).runtime())
    }

    /// A request's record: counted in the tally (and its access-log row written) here, at
    /// once; kept for Python only when Python has work with it (its spans, while telemetry is
    /// on; the warning of a prefill hop that answered no KV transfer parameters), and then
    /// Python is woken (one byte until it next takes the inbox, however many end meanwhile).
    /// With telemetry off and no split pool nothing is kept, and a burst wakes nobody.
    pub fn record(&self, mut record: Record) {
        if record.first_token_only {
            let first = record.first_token_us.unwrap_or(record.arrived_us);
            let ttft_s = first as f64 / 1e6 - record.arrived_us as f64 / 1e6;
            self.tally.first_token(&record.tier, ttft_s);
            return;
        }
        if self.shadowed {
            // Shadow mode: the verdict, final now that the real request has ended.
            let mut hosted = Hosted::lock(&self.runtime);
            record.shadow = hosted.shadow_mut().and_then(|s| s.take(record.id));
        }
        record.count(&self.tally);
        if record.trace.is_some() || record.prefill_unread.is_some() {
            let mut inbox = self.inbox.lock().unwrap();
            inbox.records.push(record);
            self.wake(&mut inbox);
        }
    }

    /// Everything Python must carry out or count, oldest first. The gates of those actions
    /// are Python's to hold until it has carried them out (`Runtime.carried`). It returns once
    /// the relay's aborts that Python's `Start`s among them follow have reached their sockets
    /// (call it without the GIL).
    pub fn take(&self) -> (Vec<Action>, Vec<Record>) {
        let (actions, records, gates, waits) = {
            let mut inbox = self.inbox.lock().unwrap();
            inbox.woken = false;
            (
                mem::take(&mut inbox.actions),
                mem::take(&mut inbox.records),
                mem::take(&mut inbox.gates),
                mem::take(&mut inbox.waits),
            )
        };
        if !gates.is_empty() {
            Hosted::lock(&self.runtime).hold_for_python(gates);
        }
        wait_all(&waits, ABORT_WAIT);
        (actions, records)
    }

    pub fn runtime(&self) -> &SharedRuntime {
        &self.runtime
    }

    /// Requests the front serves now.
    pub fn live(&self) -> usize {
        self.tasks.lock().unwrap().len()
    }

    fn wake(&self, inbox: &mut Inbox) {
        if !inbox.woken {
            inbox.woken = true;
            // A full pipe already holds a wake-up; any other error means Python is gone.
            let _ = self.notify.lock().unwrap().write(&[1]);
        }
    }
}

/// The first id the front gives a request (Python's host counts from 1).
pub const FRONT_IDS: u64 = 1 << 40;

/// The clock every host of the runtime reads: monotonic microseconds, as Python's
/// `time.monotonic_ns() // 1000` (both `CLOCK_MONOTONIC`).
pub fn now_us() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut ts) };
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1000
}
