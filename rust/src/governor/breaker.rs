//! The preemption breaker: a burst of preemptions vLLM reports raises the shed level (each
//! level halves the slots of unprotected tiers, and tightens their waiting places); it cools
//! down one level per cool-down period.

/// Levels beyond this shed nothing more that matters (an eighth of the slots).
const MAX_LEVEL: u8 = 3;

#[derive(Debug, Clone, Default)]
pub(crate) struct Breaker {
    /// 0: closed (nothing shed).
    pub level: u8,
    /// When the level next drops by one (meaningful while `level > 0`).
    until_us: u64,
}

impl Breaker {
    /// Preemptions were seen at `now_us`: one level up, cooling down from now.
    pub fn trip(&mut self, now_us: u64, cooldown_us: u64) {
        self.level = (self.level + 1).min(MAX_LEVEL);
        self.until_us = now_us + cooldown_us;
    }

    /// Cool down one level per elapsed cool-down period.
    pub fn cool(&mut self, now_us: u64, cooldown_us: u64) {
        while self.level > 0 && now_us >= self.until_us {
            self.level -= 1;
            self.until_us += cooldown_us;
        }
    }

    /// `cool` would lower the level at `now_us`.
    pub fn cooldown_due(&self, now_us: u64) -> bool {
        self.level > 0 && now_us >= self.until_us
    }

    /// When the level drops next, while it is open.
    pub fn next_cooldown_us(&self) -> Option<u64> {
        (self.level > 0).then_some(self.until_us)
    }

    /// Seconds until the level drops next (0 when due).
    pub fn remaining_s(&self, now_us: u64) -> f64 {
        self.until_us.saturating_sub(now_us) as f64 / 1e6
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Each trip raises the level up to the cap and restarts the cool-down; each elapsed
    // period then lowers it by one.
    #[test]
    fn trips_and_cools_level_by_level() {
        let mut b = Breaker::default();
        assert_eq!(b.next_cooldown_us(), None);
        for now in 0..5 {
            b.trip(now, 100);
        }
        assert_eq!((b.level, b.next_cooldown_us()), (MAX_LEVEL, Some(104)));
        assert!(!b.cooldown_due(103));
        assert_eq!(b.remaining_s(54), 50e-6);
        b.cool(204, 100); // two periods elapsed
        assert_eq!((b.level, b.next_cooldown_us()), (1, Some(304)));
        b.cool(1_000, 100);
        assert_eq!(
            (b.level, b.next_cooldown_us(), b.cooldown_due(1_000)),
            (0, None, false)
        );
    }
}
