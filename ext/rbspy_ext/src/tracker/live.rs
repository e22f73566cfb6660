//! How the tracker knows which sampled objects are still alive, by reading this process's
//! memory; their bookkeeping (by address, never marked) is core's `allocs::live`.
//!
//! Two ways to know which are alive, by how the tracker samples (mod.rs):
//! - Sampling (a rate above `STEADY_RATE_BYTES`, 16 KiB, with a timer): each sampled
//!   object is put in an `ObjectSpace::WeakMap` under its sample's id by the postponed job
//!   right after the sample, and looked up there when a snapshot is made (weak.rs). No GC
//!   hook is on: before Ruby 3.3 any internal GC hook sends every allocation down the slow
//!   path (+6 % of CPU on a request loop on 3.1), and one per sample is all this costs.
//! - The hook always on (rate 1, a rate of 16 KiB or less, or 2.7 with no timer): a million
//!   weak-map entries would cost more than the allocations, so liveness is read from the
//!   GC's mark bits at the end of each marking (the GC_END_MARK hook), before the sweep
//!   frees anything: a sampled object is alive when it is marked. A FREEOBJ hook would tell
//!   the same, but any FREEOBJ hook costs Ruby a call on every object it frees (+42 % on
//!   bench/allocs.rb).
//!
//! The check reads this process's memory directly while it can be sure every tracked
//! address is in a heap page: when it saw the end of every GC's marking since the objects
//! were sampled. After a GC it did not see (a GC run inside another internal hook, or on a
//! thread with no frame, gets no hook), a dead object's page may have been freed, so that
//! check reads through `process_vm_readv`, which answers an unmapped address with an error.
use rb_sys::VALUE;
use rbspy_ext_core::allocs::live::{Entry, LiveObjects};
use rbspy_ext_core::allocs::marks::{MarkBits, Unreadable};

/// After `GC.compact` moved objects: every key follows its object (`rb_gc_location`). An
/// address that no longer reads (its page freed by a GC whose marking was not checked) is
/// handed to `dead`: `rb_gc_location` would read it and fault.
pub(super) fn moved(live: &mut LiveObjects, dead: impl FnMut(Entry)) {
    live.follow(
        |object, _| {
            read_word(object).ok()?;
            // SAFETY: in the reference-updating phase, on a mapped slot: a live object, or
            // a freed slot, which rb_gc_location returns as it is.
            Some(unsafe { rb_sys::rb_gc_location(object) })
        },
        dead,
    );
}

/// At the end of a marking: drops every object not marked, handing each to `dead`.
/// `direct`: every GC's marking since the last check was seen (see the module docs).
pub(super) fn check(
    live: &mut LiveObjects,
    marks: &MarkBits,
    direct: bool,
    dead: impl FnMut(Entry),
) {
    live.retain(
        |object, entry| {
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
            alive == Ok(true)
        },
        dead,
    );
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
