//! The live set published for readers outside the process (`rubyspy heap --by site`): the
//! exported header `rbspy_ext_allocations_state` points at a blob that allocs.rs makes
//! (names need Ruby calls) and this module stores. The format and the reader are
//! `rbspy_ext_core::allocs::published`; docs/allocations-state.md describes both.
//!
//! When: from the postponed job, at most once every [`EVERY`] and only when the tracker
//! changed (a sample, a GC that freed some), and once more when tracking stops. Making the
//! blob names only the frames it has not named before (allocs.rs keeps them), so a
//! publication costs about its JSON: well under a millisecond for thousands of sites. A
//! larger one (every allocation tracked in a big heap: up to a million live samples, some
//! 70 MB of JSON) waits [`SPACING`] times as long as it took, so publishing never takes more
//! than 0.1 % of the process's time; two blobs are kept, the current one and the one before.
use rbspy_ext_core::allocs::published::MAGIC;
use rbspy_ext_core::sync::locked;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How often at most the job publishes a changed live set.
pub const EVERY: Duration = Duration::from_secs(1);
/// The time to the next publication, at the least, in publications' own durations. At 100
/// (1 %), a Rack app's publication of 35 sites, which took 1 to 4 ms with cold caches,
/// went out every second: 0.1 to 0.4 % of a core, most of what allocation tracking spent
/// beside its samples. A reader now sees a set 1 to 4 s old there.
const SPACING: u32 = 1000;

/// The header: magic, sequence (odd while it is rewritten), blob address, blob length.
#[repr(C)]
pub struct Header {
    magic: AtomicU64,
    seq: AtomicU64,
    data: AtomicU64,
    len: AtomicU64,
}

/// What an outside reader finds by name in the extension's dynamic symbols.
#[no_mangle]
#[used]
#[allow(non_upper_case_globals)]
pub static rbspy_ext_allocations_state: Header = Header {
    magic: AtomicU64::new(MAGIC),
    seq: AtomicU64::new(0),
    data: AtomicU64::new(0),
    len: AtomicU64::new(0),
};

/// The blob published and the one before it: a reader that read the header just before a
/// publication still reads mapped bytes (and then sees the sequence change and retries).
static KEPT: Mutex<VecDeque<Vec<u8>>> = Mutex::new(VecDeque::new());
/// When the job last published, the tracker's change count then, and how long that
/// publication took.
static LAST: Mutex<Option<(Instant, u64, Duration)>> = Mutex::new(None);
/// What makes and stores a blob (allocs.rs), with the GVL.
static PUBLISHER: OnceLock<fn()> = OnceLock::new();
/// True while the publisher runs: the NEWOBJ hook does not count the profiler's own
/// allocations (names, JSON) against the application's code.
pub static QUIET: AtomicBool = AtomicBool::new(false);

/// Runs `f` with the hook ignoring allocations (`QUIET`), as it was before afterwards: the
/// publisher calls the weak-map lookups, which are quiet too, and must stay quiet after them.
pub fn quietly<T>(f: impl FnOnce() -> T) -> T {
    let before = QUIET.swap(true, Ordering::Relaxed);
    let value = f();
    QUIET.store(before, Ordering::Relaxed);
    value
}

/// When `store` last published (Unix ms; 0: never).
static STORED_AT_MS: AtomicU64 = AtomicU64::new(0);

/// When the live set was last published (Unix ms), if ever.
pub fn published_at_ms() -> Option<u64> {
    Some(STORED_AT_MS.load(Ordering::Acquire)).filter(|&ms| ms > 0)
}

/// Registers the function that makes and stores a blob (allocs.rs, at load).
pub fn set_publisher(f: fn()) {
    let _ = PUBLISHER.set(f);
}

/// From the job: publishes when the tracker changed (`changes`) and [`EVERY`] has passed.
pub fn when_due(changes: u64) {
    let due = {
        let mut last = locked(&LAST);
        let due = match *last {
            None => changes > 0,
            Some((at, seen, took)) => seen != changes && at.elapsed() >= EVERY.max(took * SPACING),
        };
        if due {
            *last = Some((Instant::now(), changes, Duration::ZERO));
        }
        due
    };
    if due {
        let started = Instant::now();
        now();
        if let Some(last) = locked(&LAST).as_mut() {
            last.2 = started.elapsed();
        }
    }
}

/// Publishes now (with the GVL, outside any hook).
pub fn now() {
    if let Some(f) = PUBLISHER.get() {
        let at = Instant::now();
        quietly(f);
        let stats = &super::stats::STATS;
        stats.publishes.fetch_add(1, Ordering::Relaxed);
        let ns = at.elapsed().as_nanos() as u64;
        stats.publish_ns.fetch_add(ns, Ordering::Relaxed);
    }
}

/// A new tracking run: what the last one published is due again at its first change.
pub fn reset() {
    *locked(&LAST) = None;
}

/// Points the header at `blob`, keeping the two before it alive.
pub fn store(blob: Vec<u8>) {
    let mut kept = locked(&KEPT);
    let h = &rbspy_ext_allocations_state;
    h.seq.fetch_add(1, Ordering::AcqRel);
    h.data.store(blob.as_ptr() as u64, Ordering::Release);
    h.len.store(blob.len() as u64, Ordering::Release);
    h.seq.fetch_add(1, Ordering::AcqRel);
    kept.push_back(blob);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_millis() as u64);
    STORED_AT_MS.store(now, Ordering::Release);
    while kept.len() > 2 {
        kept.pop_front();
    }
}
