//! Routing: which backends may take a request (its model's pool), how a pool ranks them, and
//! what each backend is likely to hold in its prefix cache.
//!
//! Pure data and arithmetic, no clock: the governor asks these while it picks a backend.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;

use crate::config::{BackendRole, PolicyConfig, RoutePolicy};
use crate::error::{PolicyError, PolicyResult};

/// The model pools: one per served model name, each the backends that serve it.
#[derive(Debug, Clone)]
pub struct Pools {
    /// Served model names, one per pool; empty when no backend declares its models (then one
    /// pool holds every backend and takes any name).
    names: Vec<String>,
    /// Served names and aliases -> pool.
    lookup: FxHashMap<String, u32>,
    /// Per pool, per backend: whether the backend serves the pool's model.
    members: Vec<Vec<bool>>,
    policies: Vec<RoutePolicy>,
    /// Per pool: its backends are split into prefill and decode instances.
    split: Vec<bool>,
    /// Per backend: its role (`both` unless the config splits its pool).
    roles: Vec<BackendRole>,
    /// Per pool: the backend round robin tries first.
    next: Vec<u32>,
    aliases: BTreeMap<String, String>,
}

impl Pools {
    pub fn new(config: &PolicyConfig) -> Self {
        let names: Vec<String> = config
            .served_models()
            .into_iter()
            .map(str::to_owned)
            .collect();
        let backends = config.backends.len();
        let members: Vec<Vec<bool>> = if names.is_empty() {
            vec![vec![true; backends]]
        } else {
            names
                .iter()
                .map(|m| {
                    config
                        .backends
                        .iter()
                        .map(|b| b.models.contains(m))
                        .collect()
                })
                .collect()
        };
        let mut lookup: FxHashMap<String, u32> = names
            .iter()
            .enumerate()
            .map(|(i, m)| (m.clone(), i as u32))
            .collect();
        for (alias, target) in &config.models {
            if let Some(&pool) = lookup.get(target) {
                lookup.insert(alias.clone(), pool);
            }
        }
        let policies = if names.is_empty() {
            vec![config.routing.policy]
        } else {
            names
                .iter()
                .map(|m| {
                    config
                        .routing
                        .pools
                        .get(m)
                        .copied()
                        .unwrap_or(config.routing.policy)
                })
                .collect()
        };
        let roles: Vec<BackendRole> = config.backends.iter().map(|b| b.role).collect();
        let split = members
            .iter()
            .map(|m| (0..backends).any(|i| m[i] && roles[i] != BackendRole::Both))
            .collect();
        Self {
            next: vec![0; members.len()],
            split,
            roles,
            names,
            lookup,
            members,
            policies,
            aliases: config.models.clone(),
        }
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The pool a request naming `model` (or none) goes to.
    ///
    /// # Errors
    /// `UnknownModel` for a name no backend serves and no alias maps; `ModelRequired` when no
    /// name is given and there is more than one pool to choose from.
    pub fn resolve(&self, model: Option<&str>) -> PolicyResult<u32> {
        if self.names.is_empty() {
            return Ok(0);
        }
        match model {
            Some(name) => self
                .lookup
                .get(name)
                .copied()
                .ok_or_else(|| PolicyError::UnknownModel(name.into(), self.listed())),
            None if self.len() == 1 => Ok(0),
            None => Err(PolicyError::ModelRequired(self.names.clone())),
        }
    }

    /// Every name a client may send: the served models, then the aliases.
    pub fn listed(&self) -> Vec<String> {
        self.names
            .iter()
            .chain(self.aliases.keys())
            .cloned()
            .collect()
    }

    /// Name -> the served model it routes to (a served name maps to itself).
    pub fn table(&self) -> Vec<(String, String)> {
        let served = self.names.iter().map(|m| (m.clone(), m.clone()));
        let aliases = self.aliases.iter().map(|(a, t)| (a.clone(), t.clone()));
        served.chain(aliases).collect()
    }

    /// The served model name of a pool ("" for the one unnamed pool).
    pub fn name(&self, pool: u32) -> &str {
        self.names.get(pool as usize).map_or("", String::as_str)
    }

    /// The backends (their config indices, in config order) that serve a pool's model.
    pub fn members(&self, pool: u32) -> impl Iterator<Item = usize> + '_ {
        self.members[pool as usize]
            .iter()
            .enumerate()
            .filter_map(|(b, &serves)| serves.then_some(b))
    }

    pub fn serves(&self, pool: u32, backend: usize) -> bool {
        self.members[pool as usize][backend]
    }

    /// Whether a pool's requests prefill on one backend and decode on another.
    pub fn is_split(&self, pool: u32) -> bool {
        self.split[pool as usize]
    }

    pub fn role(&self, backend: usize) -> BackendRole {
        self.roles[backend]
    }

    pub fn policy(&self, pool: u32) -> RoutePolicy {
        self.policies[pool as usize]
    }

    /// The backend round robin tries first in a pool.
    pub fn round_robin_next(&self, pool: u32) -> u32 {
        self.next[pool as usize]
    }

    /// A request of the pool started on `backend`: round robin moves past it.
    pub fn started(&mut self, pool: u32, backend: u32) {
        self.next[pool as usize] = backend + 1;
    }
}

/// How much more a backend can take of a request like this one, discounted by how long it
/// would wait for its first token there: larger is better.
///
/// Room is the smaller of the free slots and the free KV blocks over the request's expected
/// peak (how many more requests of its size fit), so a backend with many slots but a nearly
/// full cache ranks low, and a large backend ranks above a small one with the same free share.
/// The wait is the prefill work queued ahead on the backend (prompts started without a first
/// token, and vLLM's own reported waiting requests, counted at this request's size) plus its
/// own prompt, at the backend's measured prefill rate.
pub fn headroom_score(
    free_slots: u32,
    free_blocks: Option<u64>,
    peak_blocks: u64,
    queued_tokens: u64,
    prompt: u64,
    prefill_tps: f64,
) -> f64 {
    let slots = f64::from(free_slots);
    let room = free_blocks.map_or(slots, |free| {
        slots.min(free as f64 / peak_blocks.max(1) as f64)
    });
    let wait_s = (queued_tokens + prompt) as f64 / prefill_tps.max(1.0);
    room / (1.0 + wait_s)
}

/// Chained hashes of `data`'s full chunks of `chunk` bytes (a partial tail gets none), at most
/// `max_blocks`: each covers its parent's hash and its chunk, as vLLM's block hashes cover
/// their parent's and their tokens. FxHash, not a cryptographic hash: a collision only misleads
/// one routing guess. Each is below 2**63, so hosts in any language hold it as a plain integer.
pub fn chain_hashes(data: &[u8], chunk: usize, max_blocks: usize) -> Vec<u64> {
    chain_with(data, chunk, max_blocks, rustc_hash::FxHasher::default)
}

/// [`chain_hashes`], keyed: SipHash-1-3 under this process's random key (std's `RandomState`),
/// so a hash read from a trace file or a log says nothing of the prompt to anyone without the
/// key (FxHash is invertible: a known prefix gives the next block's hash away, and a short
/// secret in a prompt could be found by trying every value). Equal within one process, which
/// is all routing needs; the trace replays the hashes as recorded.
pub fn keyed_chain_hashes(data: &[u8], chunk: usize, max_blocks: usize) -> Vec<u64> {
    use std::hash::BuildHasher;
    static KEY: std::sync::OnceLock<std::collections::hash_map::RandomState> =
        std::sync::OnceLock::new();
    let key = KEY.get_or_init(std::collections::hash_map::RandomState::new);
    chain_with(data, chunk, max_blocks, || key.build_hasher())
}

fn chain_with<H: std::hash::Hasher>(
    data: &[u8],
    chunk: usize,
    max_blocks: usize,
    hasher: impl Fn() -> H,
) -> Vec<u64> {
    let chunk = chunk.max(1);
    let mut parent = 0u64;
    data.chunks_exact(chunk)
        .take(max_blocks)
        .map(|block| {
            let mut h = hasher();
            h.write_u64(parent);
            h.write(block);
            parent = h.finish() >> 1;
            parent
        })
        .collect()
}

/// The block hashes recently routed to one backend: an LRU set standing in for the backend's
/// prefix cache (vLLM keeps freed blocks cached and evicts the least recently used first).
#[derive(Debug, Clone)]
pub struct PrefixMemory {
    capacity: usize,
    /// Hash -> when last used.
    used_at: FxHashMap<u64, u64>,
    /// When last used -> hash: the eviction order.
    by_age: BTreeMap<u64, u64>,
    clock: u64,
}

impl PrefixMemory {
    pub fn new(capacity: u64) -> Self {
        Self {
            capacity: usize::try_from(capacity.max(1)).unwrap_or(usize::MAX),
            used_at: FxHashMap::default(),
            by_age: BTreeMap::new(),
            clock: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.used_at.len()
    }

    pub fn is_empty(&self) -> bool {
        self.used_at.is_empty()
    }

    /// Resize (a backend's KV capacity became known), evicting the oldest beyond it.
    pub fn set_capacity(&mut self, capacity: u64) {
        self.capacity = usize::try_from(capacity.max(1)).unwrap_or(usize::MAX);
        self.evict();
    }

    /// Leading blocks of a chain this backend is likely to hold: the first miss ends the
    /// match, since each block's hash covers every block before it.
    pub fn matched(&self, chain: &[u64]) -> usize {
        chain
            .iter()
            .take_while(|h| self.used_at.contains_key(h))
            .count()
    }

    /// Remember a chain routed here. The last block is touched first and the first block last,
    /// so under pressure the tail of a prefix is forgotten before its head, as vLLM frees a
    /// request's blocks tail first; a shared head stays.
    pub fn remember(&mut self, chain: &[u64]) {
        for &hash in chain.iter().rev() {
            self.clock += 1;
            if let Some(old) = self.used_at.insert(hash, self.clock) {
                self.by_age.remove(&old);
            }
            self.by_age.insert(self.clock, hash);
        }
        self.evict();
    }

    fn evict(&mut self) {
        while self.used_at.len() > self.capacity {
            let Some((_, hash)) = self.by_age.pop_first() else {
                break;
            };
            self.used_at.remove(&hash);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json_backends: &str, extra: &str) -> PolicyConfig {
        let text = format!(
            r#"{{"backends":{json_backends},"tiers":[{{"name":"t"}}],
                "tenants":[{{"name":"a","tier":"t"}}]{extra}}}"#
        );
        PolicyConfig::from_json(&text).unwrap()
    }

    // Without declared models there is one pool that takes any name, or none.
    #[test]
    fn unnamed_pool_takes_anything() {
        let pools = Pools::new(&config(r#"[{"name":"b0"},{"name":"b1"}]"#, ""));
        assert_eq!(pools.resolve(Some("whatever")), Ok(0));
        assert_eq!(pools.resolve(None), Ok(0));
        assert!(pools.serves(0, 1));
    }

    // Names and aliases resolve to their pool; an unknown name lists what is served; with two
    // pools a request must name one.
    #[test]
    fn models_and_aliases_resolve() {
        let pools = Pools::new(&config(
            r#"[{"name":"b0","models":["a"]},{"name":"b1","models":["a","b"]}]"#,
            r#","models":{"fast":"b"}"#,
        ));
        assert_eq!(pools.resolve(Some("a")), Ok(0));
        assert_eq!(pools.resolve(Some("fast")), Ok(1));
        assert!(!pools.serves(1, 0) && pools.serves(1, 1));
        let err = pools.resolve(Some("c")).unwrap_err().to_string();
        assert!(err.contains("`c`") && err.contains("fast"), "{err}");
        assert_eq!(
            pools.resolve(None),
            Err(PolicyError::ModelRequired(vec!["a".into(), "b".into()]))
        );
    }

    // Room is the smaller of free slots and free KV over the request's size; queued prefill
    // work at the measured rate discounts it.
    #[test]
    fn headroom_combines_slots_kv_and_queue() {
        assert!((headroom_score(8, None, 10, 0, 0, 1000.0) - 8.0).abs() < 1e-9);
        assert!((headroom_score(8, Some(30), 10, 0, 0, 1000.0) - 3.0).abs() < 1e-9);
        assert!((headroom_score(8, Some(30), 10, 1000, 1000, 1000.0) - 1.0).abs() < 1e-9);
    }

    // A chain covers full chunks only; equal chunks at different places hash apart (each
    // covers its parent); a shared head gives shared leading hashes.
    #[test]
    fn chained_hashes() {
        let a = chain_hashes(b"abcdabcdab", 4, 100);
        assert_eq!(a.len(), 2);
        assert_ne!(a[0], a[1]);
        assert_eq!(chain_hashes(b"abcdabcdxyzw", 4, 100)[..2], a[..]);
        assert_ne!(chain_hashes(b"Xbcdabcd", 4, 100)[1], a[1]);
        assert_eq!(chain_hashes(b"abcdabcd", 4, 1).len(), 1);
        assert!(a.iter().all(|&h| h < 1 << 63));
    }

    // The match stops at the first block not held; the oldest blocks go first, tails before
    // heads.
    #[test]
    fn prefix_memory_is_lru() {
        let mut m = PrefixMemory::new(3);
        m.remember(&[1, 2, 3]);
        assert_eq!(m.matched(&[1, 2, 3, 4]), 3);
        assert_eq!(m.matched(&[2, 3]), 2);
        m.remember(&[1, 9]); // 9 then 1 are newest; 3 (the oldest tail) goes
        assert_eq!((m.matched(&[1, 2, 3]), m.len()), (2, 3));
        m.set_capacity(1);
        assert_eq!(m.matched(&[1, 2]), 1);
    }
}
