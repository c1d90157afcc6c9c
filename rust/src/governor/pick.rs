//! Backend choice: which backend a request starts on (the candidates of its model pool with a
//! slot and KV for it, ranked by the pool's routing policy), and in a split pool which
//! prefill instance its prompt goes to first.

use super::{Governor, Route};
use crate::config::{BackendRole, RoutePolicy};
use crate::routing::headroom_score;

impl Governor {
    /// Where a request starts now, or none: its backend and, in a split pool, the prefill
    /// instance its prompt goes to first (both must have room).
    pub(super) fn pick(
        &self,
        tier_idx: usize,
        route: Route<'_>,
        prompt: u64,
        peak: u64,
        now_us: u64,
    ) -> Option<(u32, Option<u32>)> {
        let prefill = if self.pools.is_split(route.pool) {
            Some(self.pick_prefill(tier_idx, route.pool, prompt, now_us)?)
        } else {
            None
        };
        let backend = self.pick_backend(tier_idx, route, prompt, peak, now_us)?;
        Some((backend, prefill))
    }

    /// The prefill instance of a split pool a prompt goes to now, or none: among the healthy
    /// ones with a slot for its tier, free KV blocks for the prompt and (unprotected tiers)
    /// room under prefill pacing, the one whose queued prefill work clears first at its
    /// measured rate (its own prompt included; ties: the most free slots, then the first).
    /// TTFT is what a prefill instance decides, so the soonest finish is the rank, whatever
    /// the pool's policy for its decode instances.
    fn pick_prefill(&self, tier_idx: usize, pool: u32, prompt: u64, now_us: u64) -> Option<u32> {
        let tier = &self.config.tiers[tier_idx];
        let blocks = self.ledger.blocks_for(prompt);
        let mut best: Option<(f64, u32, usize)> = None;
        for (i, b) in self.backends.iter().enumerate() {
            if !b.healthy || !self.pools.serves(pool, i) {
                continue;
            }
            if self.pools.role(i) != BackendRole::Prefill {
                continue;
            }
            let (total, share) = self.limits(i, tier, now_us);
            if b.running >= total || b.running_by_tier[tier_idx] >= share {
                continue;
            }
            let capacity = b.kv_capacity_blocks;
            let fits = capacity == 0
                || b.running == 0
                || blocks < capacity.saturating_sub(self.kv_used(i, now_us));
            if !tier.protected && (!fits || !self.prefill_paced(i, prompt)) {
                continue;
            }
            let waiting = b.observed.and_then(|o| o.waiting).unwrap_or(0);
            let queued = b.prefill_pending + waiting * prompt + prompt;
            let wait_s = queued as f64 / b.prefill_tps.max(1.0);
            let free = total - b.running;
            if best.is_none_or(|(w, f, _)| wait_s < w || (wait_s == w && free > f)) {
                best = Some((wait_s, free, i));
            }
        }
        best.map(|(_, _, i)| i as u32)
    }

    /// The backend a request starts on now, or none: among the healthy backends serving its
    /// pool's model with a slot for its tier and KV that can take it (`eligible`), the one the
    /// pool's routing policy ranks first.
    pub(super) fn pick_backend(
        &self,
        tier_idx: usize,
        route: Route<'_>,
        prompt: u64,
        peak: u64,
        now_us: u64,
    ) -> Option<u32> {
        let peak_blocks = self.ledger.blocks_for(peak);
        let candidates = || self.eligible(tier_idx, route.pool, prompt, peak_blocks, now_us);
        let least_loaded = || {
            let mut best: Option<(f64, usize)> = None;
            for (i, total) in candidates() {
                let score = self.headroom(i, total, prompt, peak_blocks, now_us);
                if best.is_none_or(|(s, _)| score > s) {
                    best = Some((score, i));
                }
            }
            best.map(|(_, i)| i as u32)
        };
        match self.pools.policy(route.pool) {
            RoutePolicy::FreeSlots => {
                let mut best: Option<(u32, usize)> = None;
                for (i, total) in candidates() {
                    let free = total - self.backends[i].running;
                    if best.is_none_or(|(h, _)| free > h) {
                        best = Some((free, i));
                    }
                }
                best.map(|(_, i)| i as u32)
            }
            RoutePolicy::RoundRobin => {
                // The first candidate at or after the pool's cursor, cyclically.
                let from = self.pools.round_robin_next(route.pool) as usize;
                let n = self.backends.len();
                candidates()
                    .map(|(i, _)| i)
                    .min_by_key(|&i| (i + n - from % n) % n)
                    .map(|i| i as u32)
            }
            RoutePolicy::LeastLoaded => least_loaded(),
            RoutePolicy::Prefix => self
                .prefix_choice(candidates(), route.chain, (prompt, peak_blocks), now_us)
                .or_else(least_loaded),
        }
    }

    /// The backends a request of this tier and pool may start on now, with each one's slot
    /// total for the tier. (A request that does not fit would only wait in vLLM's own FCFS
    /// queue or be preempted there; waiting here keeps the fair queue in charge of who gets the
    /// freed blocks.) `peak_blocks` is the context the request is expected to reach (prompt
    /// plus expected output): with `kv_fit_target` the backend's committed blocks must leave
    /// room for it, so the number of requests running follows the KV capacity, not a fixed
    /// count.
    fn eligible(
        &self,
        tier_idx: usize,
        pool: u32,
        prompt: u64,
        peak_blocks: u64,
        now_us: u64,
    ) -> impl Iterator<Item = (usize, u32)> + '_ {
        let tier = &self.config.tiers[tier_idx];
        // In a split pool a request's home is a decode instance: its prompt is computed on a
        // prefill instance (`pick_prefill`), so prefill pacing does not apply here.
        let split = self.pools.is_split(pool);
        self.backends.iter().enumerate().filter_map(move |(i, b)| {
            if !b.healthy || !self.pools.serves(pool, i) {
                return None;
            }
            if split && self.pools.role(i) != BackendRole::Decode {
                return None;
            }
            let (total, share) = self.limits(i, tier, now_us);
            if b.running >= total || b.running_by_tier[tier_idx] >= share {
                return None;
            }
            if !tier.protected
                && self
                    .config
                    .kv_pressure_threshold
                    .is_some_and(|t| self.backend_kv_usage(i, now_us) > t)
            {
                return None;
            }
            // Protected tiers skip the fit check: vLLM's priority scheduling preempts lower
            // tiers to make room for them, and waiting here would only delay a VIP.
            if !tier.protected
                && (!self.fits(i, prompt, peak_blocks, now_us)
                    || (!split && !self.prefill_paced(i, prompt)))
            {
                return None;
            }
            if tier.best_effort && !self.leaves_headroom(i, peak_blocks) {
                return None;
            }
            Some((i, total))
        })
    }

    /// `routing::headroom_score` of a backend for this request.
    fn headroom(&self, b: usize, total: u32, prompt: u64, peak_blocks: u64, now_us: u64) -> f64 {
        let backend = &self.backends[b];
        let capacity = backend.kv_capacity_blocks;
        let free_blocks = (capacity > 0).then(|| capacity.saturating_sub(self.kv_used(b, now_us)));
        let waiting = backend.observed.and_then(|o| o.waiting).unwrap_or(0);
        let queued = backend.prefill_pending + waiting * prompt;
        headroom_score(
            total.saturating_sub(backend.running),
            free_blocks,
            peak_blocks,
            queued,
            prompt,
            backend.prefill_tps,
        )
    }

    /// The `prefix` policy's pick among the candidates under the load bound (none when every
    /// candidate is past it: the caller then takes the most headroom anywhere, so a request
    /// never goes past the bound while a candidate under it exists).
    ///
    /// Each is scored by the share of the prompt's blocks it likely holds plus its headroom
    /// relative to the roomiest candidate's (both 0..1; ties: the first). A chat's next turn,
    /// which matches almost all its blocks, stays where its history is cached; a prompt that
    /// shares only a system prompt goes where there is room, so one replica does not collect
    /// every chat that opens alike (pure longest-match routing starves the replicas that
    /// happen to hold no popular prefix). Past the bound a backend draws nothing by its cache:
    /// a hot prefix fills its replica to the bound and then spills over.
    fn prefix_choice(
        &self,
        candidates: impl Iterator<Item = (usize, u32)>,
        chain: &[u64],
        (prompt, peak_blocks): (u64, u64),
        now_us: u64,
    ) -> Option<u32> {
        let under: Vec<(usize, f64, usize)> = candidates
            .filter(|&(i, _)| !self.past_prefix_bound(i, now_us))
            .map(|(i, total)| {
                let room = self.headroom(i, total, prompt, peak_blocks, now_us);
                (i, room, self.prefix[i].matched(chain))
            })
            .collect();
        let roomiest = under.iter().map(|&(_, room, _)| room).fold(0.0, f64::max);
        let blocks = chain.len().max(1) as f64;
        let mut best: Option<(f64, usize)> = None;
        for &(i, room, matched) in &under {
            let load = if roomiest > 0.0 { room / roomiest } else { 0.0 };
            let score = matched as f64 / blocks + load;
            if best.is_none_or(|(s, _)| score > s) {
                best = Some((score, i));
            }
        }
        best.map(|(_, i)| i as u32)
    }

    /// The backend's load is at `routing.prefix_load_bound` or beyond, counted as running
    /// over usable slots or as the share of its KV cache in use, whichever is higher: cache
    /// affinity no longer draws requests to it.
    pub(super) fn past_prefix_bound(&self, b: usize, now_us: u64) -> bool {
        let backend = &self.backends[b];
        let bound = self.config.routing.prefix_load_bound;
        f64::from(backend.running) >= bound * f64::from(backend.slots())
            || (backend.kv_capacity_blocks > 0 && self.backend_kv_usage(b, now_us) >= bound)
    }

    /// KV blocks in use on a backend: the larger of its report and the ledger's count.
    fn kv_used(&self, b: usize, now_us: u64) -> u64 {
        let capacity = self.backends[b].kv_capacity_blocks;
        let reported = (self.backend_kv_usage(b, now_us) * capacity as f64).ceil() as u64;
        reported.max(self.ledger.backend_blocks(b as u32))
    }

    /// Whether a backend's free KV blocks hold a prompt plus one block of output and, with
    /// `kv_fit_target`, whether its committed blocks leave room for the request's expected
    /// peak. Unknown capacity, or an idle backend, always fits (vLLM is then the judge).
    fn fits(&self, b: usize, prompt: u64, peak_blocks: u64, now_us: u64) -> bool {
        let backend = &self.backends[b];
        let capacity = backend.kv_capacity_blocks;
        if capacity == 0 || backend.running == 0 {
            return true;
        }
        let used = self.kv_used(b, now_us);
        if self.ledger.blocks_for(prompt) >= capacity.saturating_sub(used) {
            return false;
        }
        self.config.kv_fit_target.is_none_or(|target| {
            backend.committed_blocks + peak_blocks <= (target * capacity as f64) as u64
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::sustained;
    use super::super::{Governor, Route};
    use crate::governor::Arrival;
    use crate::types::{Decision, Outcome, RejectReason};

    fn routed(backends: &str, extra: &str) -> Governor {
        let text = format!(
            r#"{{"backends":{backends},"max_concurrency_per_gpu":2,"max_waiting":50,
                "tiers":[{{"name":"t"}}],"tenants":[{{"name":"a","tier":"t"}}]{extra}}}"#
        );
        Governor::from_json(&text).unwrap()
    }

    fn backend_of(d: Decision) -> Option<u32> {
        match d {
            Decision::Admitted { backend, .. } => Some(backend),
            _ => None,
        }
    }

    // Only backends serving the model are candidates, an alias routes to its model's pool,
    // and a request queued for a busy model never holds back one for an idle model.
    #[test]
    fn model_pools_route_and_queue_apart() {
        let mut g = routed(
            r#"[{"name":"x","models":["m1"]},{"name":"y","models":["m2"]}]"#,
            r#","models":{"fast":"m2"}"#,
        );
        let (m1, m2) = (
            g.pool_of(Some("m1")).unwrap(),
            g.pool_of(Some("fast")).unwrap(),
        );
        let submit = |g: &mut Governor, id, pool| {
            let route = Route {
                pool,
                ..Route::default()
            };
            g.submit(id, Arrival::new(0, 10, 10).with_route(route), 0)
                .unwrap()
        };
        assert_eq!(backend_of(submit(&mut g, 1, m1)), Some(0));
        assert_eq!(backend_of(submit(&mut g, 2, m1)), Some(0));
        assert!(matches!(
            submit(&mut g, 3, m1),
            Decision::Queued { position: 0, .. }
        ));
        // m1's queue head waits for x; m2 starts on y at once, and its own position is 0.
        assert_eq!(backend_of(submit(&mut g, 4, m2)), Some(1));
        assert_eq!(backend_of(submit(&mut g, 5, m2)), Some(1));
        assert!(matches!(
            submit(&mut g, 6, m2),
            Decision::Queued { position: 0, .. }
        ));
        // A slot freed on y goes to m2's waiting request, not to m1's older one.
        g.finish(4, Outcome::Completed, 1);
        let placed: Vec<(u64, u32)> = g
            .dispatch(1)
            .iter()
            .map(|a| (a.request_id, a.backend))
            .collect();
        assert_eq!(placed, vec![(6, 1)]);
        assert!(g.pool_of(Some("m3")).is_err());
        assert!(g.pool_of(None).is_err());
    }

    // The TTFT-SLA estimate counts only the request's own pool: m1's prompts in prefill on x
    // make m1 late, and do not refuse a request for m2, whose backend y is idle.
    #[test]
    fn ttft_sla_looks_at_the_own_pool_only() {
        let mut g = routed(
            r#"[{"name":"x","models":["m1"]},{"name":"y","models":["m2"]}]"#,
            r#","ttft_sla_ms":1500,"prefill_tokens_per_s":1000"#,
        );
        let (m1, m2) = (
            g.pool_of(Some("m1")).unwrap(),
            g.pool_of(Some("m2")).unwrap(),
        );
        let submit = |g: &mut Governor, id, pool| {
            let route = Route {
                pool,
                ..Route::default()
            };
            g.submit(id, Arrival::new(0, 4_000, 10).with_route(route), 0)
                .unwrap()
        };
        sustained(&mut g, 0, 0);
        assert_eq!(backend_of(submit(&mut g, 1, m1)), Some(0));
        // 4,000 tokens in prefill on x at 1,000/s: 4 s ahead of a second m1 request (over
        // both backends' rates, as before pools counted apart, 2 s: late for m2 as well).
        let late = submit(&mut g, 3, m1);
        assert!(
            matches!(
                late,
                Decision::Rejected {
                    reason: RejectReason::TtftSla,
                    ..
                }
            ),
            "{late:?}"
        );
        assert_eq!(backend_of(submit(&mut g, 4, m2)), Some(1));
    }

    // Backends of unequal size: "small" (2 slots, listed first) and "big" (8 slots). First-fit
    // would fill small first; free_slots and least_loaded send the first requests to big.
    // With big's KV nearly full, least_loaded counts the room a request of this size has
    // (free blocks over its peak) and picks small, where free_slots still picks big.
    #[test]
    fn headroom_differs_from_first_fit_and_free_slots() {
        let backends = r#"[{"name":"small","gpus":1,"kv_blocks":1000},{"name":"big","gpus":4,"kv_blocks":1000}]"#;
        for policy in ["free_slots", "least_loaded"] {
            let mut g = routed(backends, &format!(r#","routing":{{"policy":"{policy}"}}"#));
            assert_eq!(
                backend_of(g.submit(1, Arrival::new(0, 100, 100), 0).unwrap()),
                Some(1),
                "{policy}"
            );
        }
        let mut picks = vec![];
        for policy in ["free_slots", "least_loaded"] {
            let mut g = routed(backends, &format!(r#","routing":{{"policy":"{policy}"}}"#));
            // big reports 97% of its cache in use: 30 blocks free; a request of 320 tokens
            // (20 blocks) has room for 1.5 there, for 2 (the free slots) on small.
            g.observe_backend(1, 0, Some(0.97), Some(0), Some(0), None)
                .unwrap();
            picks.push(backend_of(
                g.submit(1, Arrival::new(0, 160, 160), 0).unwrap(),
            ));
        }
        assert_eq!(picks, vec![Some(1), Some(0)]);
    }

    // least_loaded discounts a backend by the prefill work queued ahead at its measured rate.
    #[test]
    fn headroom_counts_the_prefill_queue() {
        let mut g = routed(
            r#"[{"name":"b0","gpus":4},{"name":"b1","gpus":2}]"#,
            r#","routing":{"policy":"least_loaded"},"prefill_tokens_per_s":1000"#,
        );
        // b0 takes a 4,000-token prompt (4 s of prefill ahead); b1, idle, then ranks first
        // although b0 still has more free slots (7 against 4).
        assert_eq!(
            backend_of(g.submit(1, Arrival::new(0, 4000, 10), 0).unwrap()),
            Some(0)
        );
        assert_eq!(
            backend_of(g.submit(2, Arrival::new(0, 100, 10), 0).unwrap()),
            Some(1)
        );
    }

    // Round robin takes each serving backend in turn.
    #[test]
    fn round_robin_turns() {
        let mut g = routed(
            r#"[{"name":"b0"},{"name":"b1"},{"name":"b2"}]"#,
            r#","routing":{"policy":"round_robin"}"#,
        );
        let order: Vec<Option<u32>> = (1..=4)
            .map(|id| backend_of(g.submit(id, Arrival::new(0, 10, 10), 0).unwrap()))
            .collect();
        assert_eq!(order, vec![Some(0), Some(1), Some(2), Some(0)]);
    }

    // Prefix: a request goes where its leading blocks went before, even when another backend
    // has more headroom; once that backend is loaded to the bound, it spills to the headroom
    // choice instead.
    #[test]
    fn prefix_affinity_until_the_bound() {
        let mut g = routed(
            r#"[{"name":"b0","gpus":2},{"name":"b1","gpus":2}]"#,
            r#","routing":{"policy":"prefix","prefix_load_bound":0.75}"#,
        );
        let submit = |g: &mut Governor, id, chain: &[u64]| {
            let route = Route {
                chain,
                ..Route::default()
            };
            backend_of(
                g.submit(id, Arrival::new(0, 64, 10).with_route(route), 0)
                    .unwrap(),
            )
        };
        assert_eq!(submit(&mut g, 1, &[1, 2, 3]), Some(0));
        // Headroom alone would pick b1 (4 free slots against 3); the shared head wins, and the
        // request records the 2 blocks its backend held (the dashboard's prefix hits).
        assert_eq!(submit(&mut g, 2, &[1, 2, 9]), Some(0));
        assert_eq!(g.requests[&2].prefix_hits, Some(2));
        // The longest match wins among candidates.
        assert_eq!(submit(&mut g, 3, &[5, 6]), Some(1));
        assert_eq!(submit(&mut g, 4, &[5, 6, 7]), Some(1));
        assert_eq!(submit(&mut g, 5, &[1, 2, 3, 4]), Some(0));
        // b0 runs 3 of 4 slots: at the 0.75 bound, so the hot prefix spills to b1.
        assert_eq!(submit(&mut g, 6, &[1, 2, 3, 4]), Some(1));
        assert!(g.past_prefix_bound(0, 0) && g.past_prefix_bound(1, 0));
    }

    fn split_pool() -> Governor {
        // Two prefill instances of one GPU (2 slots each), one decode instance of two (4).
        routed(
            r#"[{"name":"p0","role":"prefill"},{"name":"p1","role":"prefill"},
                {"name":"d","gpus":2,"role":"decode"}]"#,
            "",
        )
    }

    fn running(g: &Governor) -> Vec<u32> {
        g.backends.iter().map(|b| b.running).collect()
    }

    // In a split pool a request decodes on a decode instance and goes first to a prefill
    // instance, whose slot it holds only until its prefill hop answers.
    #[test]
    fn split_pool_picks_prefill_and_decode() {
        let mut g = split_pool();
        let d = g.submit(1, Arrival::new(0, 100, 10), 0).unwrap();
        assert!(
            matches!(
                d,
                Decision::Admitted {
                    backend: 2,
                    prefill: Some(0),
                    ..
                }
            ),
            "{d:?}"
        );
        assert_eq!(g.request_backend(1), Some(0)); // upstream at the prefill instance now
        assert_eq!(g.backends[0].prefill_pending, 100);
        assert_eq!(g.backends[2].prefill_pending, 0);
        // The second goes to the prefill instance with less prefill work queued.
        let d = g.submit(2, Arrival::new(0, 100, 10), 0).unwrap();
        assert!(
            matches!(
                d,
                Decision::Admitted {
                    prefill: Some(1),
                    ..
                }
            ),
            "{d:?}"
        );
        assert_eq!(running(&g), [1, 1, 2]);
        assert!(g.prefilled(1, 10));
        assert!(!g.prefilled(1, 11), "a hop answers once");
        assert_eq!(running(&g), [0, 1, 2]);
        assert_eq!(g.request_backend(1), Some(2));
        assert_eq!(g.backends[0].prefill_pending, 0);
        // A first token without a reported hop still frees the prefill instance.
        assert!(g.on_tokens(2, 1, 20));
        assert_eq!(running(&g), [0, 0, 2]);
        assert_eq!(g.backends[2].decoding, 1);
        assert!(g.finish(1, Outcome::Completed, 30) && g.finish(2, Outcome::Completed, 30));
        assert_eq!(running(&g), [0, 0, 0]);
        assert_eq!(g.backends[2].decoding, 0);
    }

    // The decode instance's slots bound the requests in flight; prefill slots bound the
    // prefill hops. A request ending during its hop frees both sides.
    #[test]
    fn split_pool_needs_both_slots() {
        let mut g = split_pool();
        for id in 1..=4 {
            let d = g.submit(id, Arrival::new(0, 100, 10), 0).unwrap();
            assert!(matches!(d, Decision::Admitted { .. }), "{id}: {d:?}");
        }
        // Prefill and decode slots are all busy; the hops answer and free the prefill side.
        for id in 1..=4 {
            g.prefilled(id, 1);
        }
        assert_eq!(running(&g), [0, 0, 4]);
        let d = g.submit(5, Arrival::new(0, 100, 10), 2).unwrap();
        assert!(
            matches!(d, Decision::Queued { .. }),
            "decode is full: {d:?}"
        );
        g.finish(1, Outcome::Cancelled, 3);
        let placed = g.dispatch(3);
        assert_eq!((placed[0].request_id, placed[0].backend), (5, 2));
        assert!(placed[0].prefill.is_some());
        // Decode room but no prefill room: the prefill slots hold new requests back.
        let mut g = split_pool();
        g.backends[0].healthy = false;
        g.backends[1].healthy = false;
        let d = g.submit(1, Arrival::new(0, 100, 10), 0).unwrap();
        assert!(
            matches!(
                d,
                Decision::Rejected {
                    reason: RejectReason::NoHealthyBackend,
                    ..
                }
            ),
            "no prefill instance is up: {d:?}"
        );
        // Ending during the hop frees both sides and leaves nothing behind.
        let mut g = split_pool();
        g.submit(1, Arrival::new(0, 100, 10), 0).unwrap();
        assert!(g.finish(1, Outcome::Cancelled, 1));
        assert_eq!(running(&g), [0, 0, 0]);
        assert!(g
            .backends
            .iter()
            .all(|b| b.prefill_pending == 0 && b.committed_blocks == 0));
    }
}
