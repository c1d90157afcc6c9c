//! One request's values as it arrives, carried whole from the host's event to the decision.
//!
//! `submit` and the refusal query take an `Arrival` rather than loose fields, and a request
//! handed back by a refused slot lease comes back as an `OwnedArrival`, so the same values
//! travel through every signature that decides a request (and none of them can drift apart).

/// Where a request may go: its model's pool (`Pools::resolve`), and its prompt's chained block
/// hashes (each covers its parent's hash and its own block's tokens; full blocks only), which
/// a `prefix` pool routes on; and who it is: the host's fingerprint of the request (0: none),
/// by which a client's retry is known (`retries`). The default: the first pool, no hashes, no
/// fingerprint.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Route<'a> {
    pub pool: u32,
    pub chain: &'a [u64],
    pub fingerprint: u64,
}

/// What a client says about a request (its headers, as the host read them), bounded by the
/// config before anything uses it (`Governor::honoured`). `None`: not said.
///
/// `retries`: how many times it sent this request before (the OpenAI and Anthropic SDKs'
/// `x-stainless-retry-count`, Envoy's `x-envoy-attempt-count` less one); a retry is judged
/// from its first arrival (`retries`). `deadline_us`: how long after arriving it gives up
/// waiting (the SDKs' `x-stainless-timeout`, or `x-llmflow-deadline-ms`); a request whose
/// client will have given up is never started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Signals {
    pub retries: Option<u32>,
    pub deadline_us: Option<u64>,
}

/// A request as the governor decides it: its tenant (index), prompt tokens, the most tokens it
/// may generate, its route, and what its client said about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arrival<'a> {
    pub tenant: u32,
    pub prompt: u64,
    pub max_tokens: u64,
    pub route: Route<'a>,
    pub signals: Signals,
}

impl Arrival<'static> {
    /// A request of the first pool, with no block hashes and no fingerprint.
    pub fn new(tenant: u32, prompt: u64, max_tokens: u64) -> Self {
        Self {
            tenant,
            prompt,
            max_tokens,
            route: Route::default(),
            signals: Signals::default(),
        }
    }

    /// The same request, going where `route` says.
    #[must_use]
    pub fn with_route(self, route: Route<'_>) -> Arrival<'_> {
        Arrival {
            tenant: self.tenant,
            prompt: self.prompt,
            max_tokens: self.max_tokens,
            route,
            signals: self.signals,
        }
    }
}

impl Arrival<'_> {
    /// The same request, with what its client said about it.
    #[must_use]
    pub fn with_signals(self, signals: Signals) -> Self {
        Self { signals, ..self }
    }

    /// The same request with `max_tokens` clamped (a brownout).
    #[must_use]
    pub(super) fn clamped(self, max_tokens: u64) -> Self {
        Self { max_tokens, ..self }
    }
}

/// An `Arrival` that owns its block hashes: what a started request handed back by a refused
/// slot lease is decided again with (`Governor::lease_denied`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnedArrival {
    pub tenant: u32,
    pub prompt: u64,
    pub max_tokens: u64,
    pub pool: u32,
    pub chain: Vec<u64>,
    pub fingerprint: u64,
    pub signals: Signals,
}

impl OwnedArrival {
    pub fn arrival(&self) -> Arrival<'_> {
        Arrival {
            tenant: self.tenant,
            prompt: self.prompt,
            max_tokens: self.max_tokens,
            route: Route {
                pool: self.pool,
                chain: &self.chain,
                fingerprint: self.fingerprint,
            },
            signals: self.signals,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // An owned arrival lends back exactly the values it was built from.
    #[test]
    fn owned_arrival_round_trips() {
        let owned = OwnedArrival {
            tenant: 2,
            prompt: 30,
            max_tokens: 40,
            pool: 1,
            chain: vec![7, 8],
            fingerprint: 99,
            signals: Signals {
                retries: Some(1),
                deadline_us: Some(5),
            },
        };
        let route = Route {
            pool: 1,
            chain: &[7, 8],
            fingerprint: 99,
        };
        let signals = owned.signals;
        let arrival = Arrival::new(2, 30, 40).with_route(route);
        assert_eq!(owned.arrival(), arrival.with_signals(signals));
    }

    // A clamp changes the tokens it may generate and nothing else.
    #[test]
    fn clamped_keeps_the_rest() {
        let a = Arrival::new(1, 10, 100);
        assert_eq!(a.clamped(5), Arrival { max_tokens: 5, ..a });
    }
}
