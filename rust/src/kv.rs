//! The KV ledger: how many paged-KV blocks each live request holds, and for how long.
//!
//! A request's footprint is `ceil((prompt + generated) / block_size)` blocks, as vLLM's paged
//! allocator rounds it, and grows as tokens stream. The ledger also integrates occupancy over
//! time (block-seconds) per request and per tenant, which is what a long request "costs" the
//! others. It holds nothing once every request has ended.

use rustc_hash::FxHashMap;

/// One live request's entry.
#[derive(Debug, Clone)]
pub struct KvEntry {
    pub tenant: u32,
    pub backend: u32,
    pub tokens: u64,
    pub blocks: u64,
    /// Block-microseconds accumulated up to `since_us`.
    pub block_us: f64,
    pub since_us: u64,
}

impl KvEntry {
    fn advance(&mut self, now_us: u64) {
        self.block_us += self.blocks as f64 * now_us.saturating_sub(self.since_us) as f64;
        self.since_us = self.since_us.max(now_us);
    }
}

/// Per-tenant totals; the integral runs over every request the tenant ever had.
#[derive(Debug, Clone, Default)]
pub struct TenantKv {
    pub blocks: u64,
    pub block_us: f64,
    pub since_us: u64,
}

impl TenantKv {
    fn advance(&mut self, now_us: u64) {
        self.block_us += self.blocks as f64 * now_us.saturating_sub(self.since_us) as f64;
        self.since_us = self.since_us.max(now_us);
    }
}

#[derive(Debug, Clone)]
pub struct KvLedger {
    block_size: u64,
    entries: FxHashMap<u64, KvEntry>,
    tenants: Vec<TenantKv>,
    backends: Vec<u64>,
    total: u64,
}

impl KvLedger {
    pub fn new(block_size: u32, tenants: usize, backends: usize) -> Self {
        Self {
            block_size: u64::from(block_size.max(1)),
            entries: FxHashMap::default(),
            tenants: vec![TenantKv::default(); tenants],
            backends: vec![0; backends],
            total: 0,
        }
    }

    /// Blocks a context of `tokens` occupies.
    #[inline]
    pub fn blocks_for(&self, tokens: u64) -> u64 {
        tokens.div_ceil(self.block_size)
    }

    /// Start accounting a request that just got a slot, holding its prompt.
    pub fn open(&mut self, id: u64, tenant: u32, backend: u32, tokens: u64, now_us: u64) {
        let blocks = self.blocks_for(tokens);
        let entry = KvEntry {
            tenant,
            backend,
            tokens,
            blocks,
            block_us: 0.0,
            since_us: now_us,
        };
        self.add(tenant, backend, blocks, now_us);
        if let Some(old) = self.entries.insert(id, entry) {
            // Callers never open twice; if they did, drop the old footprint rather than leak it.
            self.remove_blocks(old.tenant, old.backend, old.blocks, now_us);
        }
    }

    /// Grow a request's context by `n` generated tokens. Returns its blocks now.
    pub fn grow(&mut self, id: u64, n: u64, now_us: u64) -> Option<u64> {
        let block_size = self.block_size;
        let entry = self.entries.get_mut(&id)?;
        entry.tokens += n;
        let blocks = entry.tokens.div_ceil(block_size);
        let added = blocks - entry.blocks;
        if added > 0 {
            entry.advance(now_us);
            entry.blocks = blocks;
            let (tenant, backend) = (entry.tenant, entry.backend);
            self.add(tenant, backend, added, now_us);
        }
        Some(blocks)
    }

    /// Stop accounting a request; returns its final entry (with block-seconds up to `now_us`).
    pub fn close(&mut self, id: u64, now_us: u64) -> Option<KvEntry> {
        let mut entry = self.entries.remove(&id)?;
        entry.advance(now_us);
        self.remove_blocks(entry.tenant, entry.backend, entry.blocks, now_us);
        Some(entry)
    }

    /// (blocks now, block-seconds so far) of a live request.
    pub fn usage(&self, id: u64, now_us: u64) -> Option<(u64, f64)> {
        let e = self.entries.get(&id)?;
        let live = e.blocks as f64 * now_us.saturating_sub(e.since_us) as f64;
        Some((e.blocks, (e.block_us + live) / 1e6))
    }

    pub fn total_blocks(&self) -> u64 {
        self.total
    }

    pub fn backend_blocks(&self, backend: u32) -> u64 {
        self.backends[backend as usize]
    }

    pub fn tenant_blocks(&self, tenant: u32) -> u64 {
        self.tenants[tenant as usize].blocks
    }

    /// Block-seconds a tenant has held so far, over all its requests.
    pub fn tenant_block_seconds(&self, tenant: u32, now_us: u64) -> f64 {
        let t = &self.tenants[tenant as usize];
        (t.block_us + t.blocks as f64 * now_us.saturating_sub(t.since_us) as f64) / 1e6
    }

    pub fn live(&self) -> usize {
        self.entries.len()
    }

    pub fn entries(&self) -> impl Iterator<Item = (&u64, &KvEntry)> {
        self.entries.iter()
    }

    fn add(&mut self, tenant: u32, backend: u32, blocks: u64, now_us: u64) {
        let t = &mut self.tenants[tenant as usize];
        t.advance(now_us);
        t.blocks += blocks;
        self.backends[backend as usize] += blocks;
        self.total += blocks;
    }

    fn remove_blocks(&mut self, tenant: u32, backend: u32, blocks: u64, now_us: u64) {
        let t = &mut self.tenants[tenant as usize];
        t.advance(now_us);
        t.blocks -= blocks;
        self.backends[backend as usize] -= blocks;
        self.total -= blocks;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // A prompt rounds up to whole blocks, as vLLM's paged allocator does.
    #[test]
    fn footprint_rounds_up() {
        let mut l = KvLedger::new(16, 1, 1);
        l.open(1, 0, 0, 17, 0);
        assert_eq!(l.usage(1, 0).unwrap().0, 2);
        assert_eq!(l.total_blocks(), 2);
    }

    // Generated tokens grow the footprint only when they cross a block boundary.
    #[test]
    fn grows_with_tokens() {
        let mut l = KvLedger::new(16, 1, 1);
        l.open(1, 0, 0, 16, 0);
        assert_eq!(l.grow(1, 1, 10), Some(2));
        assert_eq!(l.grow(1, 15, 20), Some(2));
        assert_eq!(l.grow(1, 1, 30), Some(3));
        assert_eq!(l.backend_blocks(0), 3);
    }

    // Block-seconds integrate the footprint over time: 1 block for 1 s then 2 blocks for 1 s.
    #[test]
    fn block_seconds_integrate() {
        let mut l = KvLedger::new(16, 1, 1);
        l.open(1, 0, 0, 16, 0);
        l.grow(1, 1, 1_000_000);
        let (_, bs) = l.usage(1, 2_000_000).unwrap();
        assert!((bs - 3.0).abs() < 1e-9, "{bs}");
        let closed = l.close(1, 2_000_000).unwrap();
        assert!((closed.block_us / 1e6 - 3.0).abs() < 1e-9);
        assert!((l.tenant_block_seconds(0, 5_000_000) - 3.0).abs() < 1e-9);
    }

    // Closing every request returns all totals to zero.
    #[test]
    fn returns_to_zero() {
        let mut l = KvLedger::new(8, 2, 2);
        l.open(1, 0, 0, 100, 0);
        l.open(2, 1, 1, 5, 0);
        l.grow(2, 50, 1);
        l.close(1, 2);
        l.close(2, 3);
        assert_eq!((l.total_blocks(), l.live()), (0, 0));
        assert_eq!((l.backend_blocks(0), l.backend_blocks(1)), (0, 0));
        assert_eq!((l.tenant_blocks(0), l.tenant_blocks(1)), (0, 0));
    }

    // Unknown ids are ignored rather than corrupting the totals.
    #[test]
    fn unknown_ids() {
        let mut l = KvLedger::new(16, 1, 1);
        assert!(l.grow(9, 1, 0).is_none());
        assert!(l.close(9, 0).is_none());
    }
}
