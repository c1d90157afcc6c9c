//! llmflow's policy core: admission, fair queueing and KV-cache accounting for LLM serving.
//!
//! The domain modules (`governor`, `fair_queue`, `kv`, `backend`, `capacity`) know nothing of
//! Python and read no clock; `python` is the only PyO3 seam (the `llmflow._core` module).

pub mod backend;
pub mod capacity;
pub mod config;
pub mod error;
pub mod fair_queue;
#[cfg(feature = "relay")]
pub mod front;
pub mod governor;
pub mod hosted;
pub mod kv;
pub mod light;
#[cfg(feature = "relay")]
pub mod relay;
pub mod routing;
pub mod runtime;
pub mod shadow;
pub mod snapshot;
#[cfg(feature = "relay")]
pub mod tally;
pub mod trace;
pub mod types;

#[cfg(feature = "python")]
mod python;

pub use config::PolicyConfig;
pub use error::{PolicyError, PolicyResult};
pub use governor::{Arrival, Governor, Route, Signals};
pub use runtime::{Action, Event, Runtime};
pub use types::{Admission, Decision, Expired, ExpiryReason, Outcome, RejectReason};
