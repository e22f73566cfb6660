//! The sampled objects still alive, keyed by address and held weakly (never marked).
//!
//! Two ways to know which are alive, by how the tracker samples (mod.rs):
//! - Sampling (a rate above 1, with a timer): each sampled object is put in an
//!   `ObjectSpace::WeakMap` under its sample's id by the postponed job right after the
//!   sample, and looked up there when a snapshot is made (weak.rs). No GC hook is on: before
//!   Ruby 3.3 any internal GC hook sends every allocation down the slow path (+6 % of CPU on
//!   a request loop on 3.1), and one per sample is all this costs.
//! - Every allocation (rate 1, or 2.7 with no timer): a million weak-map entries would cost
//!   more than the allocations, so liveness is read from the GC's mark bits at the end of
//!   each marking (the GC_END_MARK hook), before the sweep frees anything: a sampled object
//!   is alive when it is marked. A FREEOBJ hook would tell the same, but any FREEOBJ hook
//!   costs Ruby a call on every object it frees (+42 % on bench/allocs.rb).
//!
//! The check reads this process's memory directly while it can be sure every tracked
//! address is in a heap page: when it saw the end of every GC's marking since the objects
//! were sampled. After a GC it did not see (a GC run inside another internal hook, or on a
//! thread with no frame, gets no hook), a dead object's page may have been freed, so that
//! check reads through `process_vm_readv`, which answers an unmapped address with an error.
use rb_sys::VALUE;
use rbspy_ext_core::allocs::marks::{MarkBits, Unreadable};
use rustc_hash::FxHashMap as HashMap;

/// Bits of the filter (128 KiB).
const FILTER_BITS: usize = 1 << 20;

/// A sampled object: its site, slot bytes, built-in type, how many samples it is (more than
/// one when it paid for points that passed unseen), its sample's id (its weak-map key) and
/// `rb_gc_count()` when it was sampled (it is in use once a GC after that kept it).
#[derive(Clone, Copy)]
pub(super) struct Entry {
    pub site: u32,
    pub size: u32,
    pub type_id: u8,
    pub times: u32,
    /// The rate its point was drawn with (its weight's).
    pub rate: u64,
    pub id: u64,
    pub gc: u64,
}

pub(super) struct LiveSet {
    objects: HashMap<VALUE, Entry>,
    /// A bit per hash of every address put in `objects` since it was last rebuilt: a new
    /// object whose bit is clear (nearly every one) needs no lookup.
    maybe_live: Vec<u64>,
    filtered: usize,
}

impl LiveSet {
    pub fn new() -> Self {
        LiveSet {
            objects: HashMap::default(),
            maybe_live: vec![0; FILTER_BITS / 64],
            filtered: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.objects.len()
    }

    /// Tracks a new object; returns the one tracked at its address before, which is gone
    /// (its slot was freed, by a GC not yet checked, and reused).
    pub fn insert(&mut self, object: VALUE, entry: Entry) -> Option<Entry> {
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
    pub fn entries(&self) -> impl Iterator<Item = (&VALUE, &Entry)> {
        self.objects.iter()
    }

    /// Keeps the entries `current` (given each address and entry) finds alive, each under
    /// the address it gives (an object `GC.compact` moved has a new one), and hands the
    /// others to `dead`.
    pub fn follow(
        &mut self,
        mut current: impl FnMut(VALUE, &Entry) -> Option<VALUE>,
        mut dead: impl FnMut(Entry),
    ) {
        let entries: Vec<(VALUE, Entry)> = self.objects.drain().collect();
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

    /// Every object tracked: (address, site, slot bytes, samples, rate).
    pub fn samples(&self) -> Vec<(u64, u32, u32, u32, u64)> {
        (self.objects.iter())
            .map(|(&o, e)| (o, e.site, e.size, e.times, e.rate))
            .collect()
    }

    /// Takes out the object at `object`, if one is tracked there.
    pub fn remove(&mut self, object: VALUE) -> Option<Entry> {
        let bit = filter_bit(object);
        if self.maybe_live[bit / 64] & (1 << (bit % 64)) == 0 {
            return None;
        }
        self.objects.remove(&object)
    }

    fn rebuild_filter(&mut self) {
        self.maybe_live.fill(0);
        for &object in self.objects.keys() {
            set_bit(&mut self.maybe_live, object);
        }
        self.filtered = self.objects.len();
    }

    /// After `GC.compact` moved objects: every key follows its object (`rb_gc_location`).
    /// An address that no longer reads (its page freed by a GC whose marking was not
    /// checked) is handed to `dead`: `rb_gc_location` would read it and fault.
    pub fn moved(&mut self, mut dead: impl FnMut(Entry)) {
        let moved: Vec<(VALUE, Entry)> = self.objects.drain().collect();
        for (object, entry) in moved {
            if read_word(object).is_err() {
                dead(entry);
                continue;
            }
            // SAFETY: in the reference-updating phase, on a mapped slot: a live object, or
            // a freed slot, which rb_gc_location returns as it is.
            let to = unsafe { rb_sys::rb_gc_location(object) };
            self.objects.insert(to, entry);
        }
        self.rebuild_filter();
    }

    /// Stops following every object (tracking stopped: no marking will be checked again,
    /// so the addresses would go stale).
    pub fn clear(&mut self) {
        self.objects.clear();
        self.rebuild_filter();
    }

    /// At the end of a marking: drops every object not marked, handing each to `dead`.
    /// `direct`: every GC's marking since the last check was seen (see the module docs).
    pub fn check(&mut self, marks: &MarkBits, direct: bool, mut dead: impl FnMut(Entry)) {
        self.objects.retain(|&object, entry| {
            let alive = if direct {
                // SAFETY: every tracked object was alive at the last marking this checked,
                // so its page has not been freed since.
                marks.alive(
                    object,
                    entry.type_id,
                    |a| Ok(unsafe { *(a as *const u64) }),
                    |a| Ok(unsafe { *(a as *const u16) }),
                )
            } else {
                marks.alive(object, entry.type_id, read_word, |a| {
                    read_word(a).map(|w| w as u16)
                })
            };
            if alive != Ok(true) {
                dead(*entry);
            }
            alive == Ok(true)
        });
        self.rebuild_filter();
    }
}

fn set_bit(bits: &mut [u64], object: VALUE) {
    let bit = filter_bit(object);
    bits[bit / 64] |= 1 << (bit % 64);
}

/// The filter bit of an address (slots are at least 40 bytes apart).
fn filter_bit(object: VALUE) -> usize {
    ((object >> 3).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 44) as usize % FILTER_BITS
}

/// Whether the slot at `object` still holds an object of this class word and type: read
/// through `process_vm_readv`, since a GC may have freed its page.
pub(super) fn same_header(object: VALUE, klass: VALUE, type_id: u8) -> bool {
    let flags = read_word(object);
    let word = read_word(object + 8);
    matches!((flags, word), (Ok(f), Ok(k)) if (f & 0x1f) as u8 == type_id && k == klass)
}

/// 8 bytes of this process, or `Unreadable` where nothing is mapped.
fn read_word(at: u64) -> Result<u64, Unreadable> {
    let mut word = 0u64;
    let local = libc::iovec {
        iov_base: &mut word as *mut u64 as *mut libc::c_void,
        iov_len: 8,
    };
    let remote = libc::iovec {
        iov_base: at as *mut libc::c_void,
        iov_len: 8,
    };
    // SAFETY: reads 8 bytes of our own process into a local word; an unmapped address
    // fails the call instead of faulting.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    (n == 8).then_some(word).ok_or(Unreadable)
}
