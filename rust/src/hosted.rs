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
//! Decisions stay in the runtime: this file routes actions and keeps time monotonic across
//! hosts; it decides nothing.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::PolicyResult;
use crate::runtime::{Action, Event, Runtime};
use crate::trace;

/// Where the actions of the requests another host serves go.
pub trait Divert: Send {
    /// Take `action` (true) when another host carries it out; false leaves it to the caller.
    fn divert(&mut self, action: &Action) -> bool;

    /// Every action of one event has been offered.
    fn batch_end(&mut self) {}
}

/// The runtime shared by the hosts of one process, its trace, and who carries out what.
pub struct Hosted {
    runtime: Runtime,
    trace: Option<String>,
    /// The latest instant fed: with two hosts reading the clock on different threads, an event
    /// may be stamped a few microseconds before one already fed.
    last_us: u64,
    divert: Option<Box<dyn Divert>>,
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
        }
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
        mut keep: impl FnMut(&Runtime, &Action),
    ) -> PolicyResult<()> {
        // One host alone keeps its own clock (tests feed what they like); shared, the clock
        // of whichever host fed last must not run backwards for the other.
        let now_us = if self.divert.is_some() {
            now_us.max(self.last_us)
        } else {
            now_us
        };
        self.last_us = self.last_us.max(now_us);
        let result = self.runtime.feed(now_us, event);
        if let Some(buf) = self.trace.as_mut() {
            let actions = self.runtime.actions();
            trace::record(buf, now_us, event, result.as_ref().map(|&()| actions));
        }
        result?;
        for action in self.runtime.actions() {
            let taken = self.divert.as_mut().is_some_and(|d| d.divert(action));
            if !taken {
                keep(&self.runtime, action);
            }
        }
        if let Some(divert) = self.divert.as_mut() {
            divert.batch_end();
        }
        Ok(())
    }

    /// The trace lines recorded since the last call ("" when not tracing).
    pub fn take_trace(&mut self) -> String {
        self.trace.as_mut().map(std::mem::take).unwrap_or_default()
    }

    pub fn tracing(&self) -> bool {
        self.trace.is_some()
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
