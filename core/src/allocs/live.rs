//! The bookkeeping of the sampled objects still alive, keyed by address: the tracker's live
//! set (ext/rbspy_ext/src/tracker/live.rs says how it learns which are alive, and reads the
//! process's memory for it). Nothing here touches Ruby: an object is an address, and whether
//! it is alive, or where `GC.compact` moved it, is asked of closures, so that `cargo test`
//! drives it with made-up addresses.
use rustc_hash::FxHashMap as HashMap;

/// Bits of the filter (128 KiB).
const FILTER_BITS: usize = 1 << 20;

/// A sampled object: its site, slot bytes, built-in type, how many samples it is (more than
/// one when it paid for points that passed unseen), its sample's id (its weak-map key) and
/// the GC count when it was sampled (it is in use once a GC after that kept it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub site: u32,
    pub size: u32,
    pub type_id: u8,
    pub times: u32,
    /// The rate its point was drawn with (its weight's).
    pub rate: u64,
    pub id: u64,
    pub gc: u64,
}

/// The sampled objects, by address, with a filter that answers "not tracked" for nearly
/// every freed address without a lookup: the tracker asks on every free it sees.
pub struct LiveObjects {
    objects: HashMap<u64, Entry>,
    /// A bit per hash of every address put in `objects` since it was last rebuilt: a new
    /// object whose bit is clear (nearly every one) needs no lookup.
    maybe_live: Vec<u64>,
    filtered: usize,
}

impl Default for LiveObjects {
    fn default() -> Self {
        Self::new()
    }
}

impl LiveObjects {
    pub fn new() -> Self {
        LiveObjects {
            objects: HashMap::default(),
            maybe_live: vec![0; FILTER_BITS / 64],
            filtered: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.objects.len()
    }

    pub fn is_empty(&self) -> bool {
        self.objects.is_empty()
    }

    /// Tracks a new object; returns the one tracked at its address before, which is gone
    /// (its slot was freed, by a GC not yet checked, and reused).
    pub fn insert(&mut self, object: u64, entry: Entry) -> Option<Entry> {
        let old = self.objects.insert(object, entry);
        self.filtered += 1;
        // Rebuilt (to clear the bits of objects gone) after as many insertions as the set
        // holds at the least: a large set would otherwise be rebuilt at every insertion.
        if self.filtered >= (FILTER_BITS / 8).max(2 * self.objects.len()) {
            self.rebuild_filter();
        } else {
            set_bit(&mut self.maybe_live, object);
        }
        old
    }

    /// Every entry, by address.
    pub fn entries(&self) -> impl Iterator<Item = (&u64, &Entry)> {
        self.objects.iter()
    }

    /// Keeps the entries `current` (given each address and entry) finds alive, each under
    /// the address it gives (an object `GC.compact` moved has a new one), and hands the
    /// others to `dead`.
    pub fn follow(
        &mut self,
        mut current: impl FnMut(u64, &Entry) -> Option<u64>,
        mut dead: impl FnMut(Entry),
    ) {
        let entries: Vec<(u64, Entry)> = self.objects.drain().collect();
        for (object, entry) in entries {
            match current(object, &entry) {
                Some(object) => {
                    self.objects.insert(object, entry);
                }
                None => dead(entry),
            }
        }
        self.rebuild_filter();
    }

    /// Keeps, in place, the entries `alive` finds alive at their address, and hands the
    /// others to `dead`: the check at the end of every marking, which must not rehash a
    /// million entries as `follow` would.
    pub fn retain(
        &mut self,
        mut alive: impl FnMut(u64, &Entry) -> bool,
        mut dead: impl FnMut(Entry),
    ) {
        self.objects.retain(|&object, entry| {
            let keep = alive(object, entry);
            if !keep {
                dead(*entry);
            }
            keep
        });
        self.rebuild_filter();
    }

    /// Every object tracked: (address, site, slot bytes, samples, rate).
    pub fn samples(&self) -> Vec<(u64, u32, u32, u32, u64)> {
        (self.objects.iter())
            .map(|(&o, e)| (o, e.site, e.size, e.times, e.rate))
            .collect()
    }

    /// Takes out the object at `object`, if one is tracked there.
    pub fn remove(&mut self, object: u64) -> Option<Entry> {
        if !self.maybe_tracked(object) {
            return None;
        }
        self.objects.remove(&object)
    }

    /// Whether the filter's bit for `object` is set: clear means it is surely not tracked.
    fn maybe_tracked(&self, object: u64) -> bool {
        let bit = filter_bit(object);
        self.maybe_live[bit / 64] & (1 << (bit % 64)) != 0
    }

    /// Stops following every object (tracking stopped: no marking will be checked again,
    /// so the addresses would go stale).
    pub fn clear(&mut self) {
        self.objects.clear();
        self.rebuild_filter();
    }

    fn rebuild_filter(&mut self) {
        self.maybe_live.fill(0);
        for &object in self.objects.keys() {
            set_bit(&mut self.maybe_live, object);
        }
        self.filtered = self.objects.len();
    }
}

fn set_bit(bits: &mut [u64], object: u64) {
    let bit = filter_bit(object);
    bits[bit / 64] |= 1 << (bit % 64);
}

/// The filter bit of an address (slots are at least 40 bytes apart).
fn filter_bit(object: u64) -> usize {
    ((object >> 3).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 44) as usize % FILTER_BITS
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(site: u32) -> Entry {
        Entry {
            site,
            size: 40,
            type_id: 5,
            times: 1,
            rate: 512 * 1024,
            id: u64::from(site),
            gc: 0,
        }
    }

    /// Addresses of 40-byte slots in one heap page, as Ruby hands them out.
    fn slot(i: u64) -> u64 {
        0x7f00_0000_0000 + 40 * i
    }

    /// Ten objects, site i at slot i.
    fn ten() -> LiveObjects {
        let mut live = LiveObjects::new();
        for i in 0..10 {
            live.insert(slot(i), entry(i as u32));
        }
        live
    }

    #[test]
    fn a_reused_address_gives_back_the_object_tracked_there() {
        let mut live = LiveObjects::new();
        assert_eq!(live.insert(slot(1), entry(1)), None);
        assert_eq!(live.insert(slot(1), entry(2)), Some(entry(1)));
        assert_eq!(live.len(), 1);
        assert_eq!(live.remove(slot(1)), Some(entry(2)));
        assert!(live.is_empty());
    }

    #[test]
    fn frees_of_untracked_addresses_are_answered_and_tracked_ones_found() {
        let mut live = LiveObjects::new();
        for i in 0..1000 {
            live.insert(slot(2 * i), entry(i as u32));
        }
        // Every odd slot is untracked: none is found, whatever its filter bit says.
        assert!((0..1000).all(|i| live.remove(slot(2 * i + 1)).is_none()));
        // How many of those the filter answered alone: nearly all, at 1,000 of 2^20 bits.
        let clear = (0..1000)
            .filter(|&i| !live.maybe_tracked(slot(2 * i + 1)))
            .count();
        assert!(clear >= 990, "{clear} of 1000 answered by the filter");
        assert!((0..1000).all(|i| live.remove(slot(2 * i)) == Some(entry(i as u32))));
    }

    #[test]
    fn the_filter_is_rebuilt_without_losing_an_object() {
        let mut live = LiveObjects::new();
        // More insertions than the rebuild threshold, most of them freed again, as a long
        // run does: what is left is still found after the rebuilds.
        let n = (FILTER_BITS / 8) as u64 * 3;
        for i in 0..n {
            live.insert(slot(i), entry(i as u32));
            if i % 100 != 0 {
                assert!(live.remove(slot(i)).is_some());
            }
        }
        assert_eq!(live.len() as u64, n.div_ceil(100));
        assert!(live.filtered <= (FILTER_BITS / 8).max(2 * live.len()));
        assert!((0..n).step_by(100).all(|i| live.remove(slot(i)).is_some()));
        assert!(live.is_empty());
    }

    #[test]
    fn following_moves_the_survivors_and_hands_over_the_dead() {
        let mut live = ten();
        let mut dead = Vec::new();
        // GC.compact: the even ones moved up by 1,000 slots, the odd ones were freed.
        live.follow(
            |object, e| (e.site % 2 == 0).then(|| object + 40 * 1000),
            |e| dead.push(e.site),
        );
        dead.sort();
        assert_eq!(dead, vec![1, 3, 5, 7, 9]);
        for i in (0..10).step_by(2) {
            assert_eq!(live.remove(slot(i)), None, "the old address of {i}");
            assert_eq!(live.remove(slot(i + 1000)), Some(entry(i as u32)));
        }
    }

    #[test]
    fn a_check_keeps_the_marked_in_place() {
        let mut live = ten();
        let mut dead = Vec::new();
        live.retain(|object, _| object < slot(4), |e| dead.push(e.site));
        dead.sort();
        assert_eq!(dead, (4..10).collect::<Vec<_>>());
        let mut kept: Vec<u64> = live.samples().into_iter().map(|s| s.0).collect();
        kept.sort();
        assert_eq!(kept, (0..4).map(slot).collect::<Vec<_>>());
        // The dead ones' filter bits are gone with them.
        assert!((4..10).all(|i| live.remove(slot(i)).is_none()));
        live.clear();
        assert!(live.is_empty() && live.remove(slot(0)).is_none());
    }
}
