//! The order of a recording's samples: when each was taken, and which aggregated stack
//! (thread, state, frames, tags) it was. The aggregate alone answers "where does the time
//! go"; the timeline answers "what was each thread doing when" (the `timeline` format).
//!
//! Eight bytes a sample (sixteen at worst while a vector doubles): a sample's time in
//! microseconds since the recording began, and its stack's index. The timeline keeps at most
//! [`MAX_SAMPLES`] samples, and microseconds in a `u32` last 71 minutes: a longer recording
//! keeps its aggregate, whose memory follows the distinct stacks, and stops its timeline.
use serde::{Deserialize, Serialize};

/// Most samples a timeline keeps: 32 MB (64 MB while its vectors last double); at 1 kHz,
/// 40 threads for 100 s.
pub const MAX_SAMPLES: usize = 4_000_000;

/// Samples in the order they were taken (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timeline {
    /// Microseconds since the recording began, one per sample, never decreasing.
    pub at_us: Vec<u32>,
    /// Each sample's stack: an index into `Profile::stacks`.
    pub stacks: Vec<u32>,
}

impl Timeline {
    pub fn len(&self) -> usize {
        self.stacks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.stacks.is_empty()
    }

    /// Adds `n` samples of stack `stack` at `at_us`; false once the timeline is full
    /// ([`MAX_SAMPLES`], or a time or stack index that no longer fits).
    pub fn push(&mut self, at_us: u64, stack: usize, n: u64) -> bool {
        let (Ok(at), Ok(stack)) = (u32::try_from(at_us), u32::try_from(stack)) else {
            return false;
        };
        if n > (MAX_SAMPLES - self.stacks.len().min(MAX_SAMPLES)) as u64 {
            return false;
        }
        for _ in 0..n {
            self.at_us.push(at);
            self.stacks.push(stack);
        }
        true
    }

    /// The samples whose stack `remap` keeps, renumbered: `remap[old]` is the new index.
    pub fn remapped(&self, remap: &[Option<u32>]) -> Timeline {
        let mut kept = Timeline::default();
        for (&at, &stack) in self.at_us.iter().zip(&self.stacks) {
            if let Some(Some(new)) = remap.get(stack as usize) {
                kept.at_us.push(at);
                kept.stacks.push(*new);
            }
        }
        kept
    }

    /// Why this timeline does not fit a profile of `stacks` stacks, if it does not.
    pub fn check(&self, stacks: usize) -> Result<(), String> {
        if self.at_us.len() != self.stacks.len() {
            return Err(format!(
                "timeline has {} times for {} samples",
                self.at_us.len(),
                self.stacks.len()
            ));
        }
        if let Some(bad) = self.stacks.iter().find(|s| **s as usize >= stacks) {
            return Err(format!("timeline names stack {bad} of {stacks}"));
        }
        if self.at_us.windows(2).any(|w| w[1] < w[0]) {
            return Err("timeline times go backwards".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeline_keeps_order_remaps_and_checks() {
        let mut t = Timeline::default();
        assert!(t.push(10, 0, 1));
        assert!(t.push(20, 1, 2));
        assert!(t.push(30, 0, 1));
        assert!(!t.push(u64::from(u32::MAX) + 1, 0, 1)); // past 71 minutes: full
        assert!(!t.clone().push(40, 0, MAX_SAMPLES as u64)); // past the most samples
        assert_eq!(t.len(), 4);
        assert!(t.check(2).is_ok());
        assert!(t.check(1).is_err());
        let kept = t.remapped(&[None, Some(0)]);
        assert_eq!(kept.at_us, [20, 20]);
        assert_eq!(kept.stacks, [0, 0]);
        let mut backwards = t.clone();
        backwards.at_us[0] = 99;
        assert!(backwards.check(2).unwrap_err().contains("backwards"));
    }
}
