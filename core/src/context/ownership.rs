//! When a table read through a thread's `ruby_profiler_state` pointer is that thread's, and
//! the one it published: the rules every reader follows (spy/tags.rs for samples and
//! snapshots, spy/captured.rs for the BPF sampler's copies, spy/mod.rs when it confirms a
//! sample's tags), written once.
//!
//! - **Owner.** With M:N threads (Ruby 3.3+) Ruby threads take turns on native threads, so
//!   a native thread's pointer may still be the previous Ruby thread's. The extension
//!   clears `ruby_profiler_state_owner`, stores the pointer, then sets the owner
//!   (profiler_state.c); a reader reads the owner, the pointer, the owner again, and takes
//!   the pointer only when both owner reads name the thread it reads for ([`PointerRead`]).
//! - **Time.** A table that stops being published stays alive, with its values, at least
//!   [`UNPUBLISHED_ALIVE`] (ext/rbspy_ext/src/state.rs keeps it so). A table decoded within
//!   [`TABLE_WINDOW`] of reading its pointer is therefore the one that was published, never
//!   freed memory; and a table whose pointer still holds it when read again within
//!   [`UNPUBLISHED_ALIVE`] of the first read was the same table all along ([`ReadAt`]).
use std::time::{Duration, Instant};

/// How soon after reading a table's pointer the table must have been read and decoded: a
/// sample takes well under a millisecond, and one whose reader was held up longer
/// (descheduled) gets no tags for that thread rather than doubtful ones. Below
/// [`UNPUBLISHED_ALIVE`], leaving room for the writer's coarse clock.
pub const TABLE_WINDOW: Duration = Duration::from_millis(8);
/// How long the extension keeps a table alive after it stops publishing it, at the least.
pub const UNPUBLISHED_ALIVE: Duration = Duration::from_millis(10);

/// What a reader read of one native thread, in this order: the owner word (None where the
/// extension publishes none: before it had the word), the pointer, the owner word again. An
/// owner word that could not be read is read as 0, which names no thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PointerRead {
    pub owner_before: Option<u64>,
    pub pointer: u64,
    pub owner_after: Option<u64>,
}

impl PointerRead {
    /// The table this read gives Ruby thread `thread` (its `rb_thread_t *`): the pointer
    /// when both owner reads name the thread, else 0 (none). Reading the owner once is not
    /// enough: it can be the old thread's while the pointer read after it is already the
    /// new thread's.
    pub fn table_for(&self, thread: u64) -> u64 {
        let owns = |owner: Option<u64>| owner.is_none_or(|o| o == thread);
        if owns(self.owner_before) && owns(self.owner_after) {
            self.pointer
        } else {
            0
        }
    }
}

/// When a reader read a pointer: what it may still trust of the table behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadAt(pub Instant);

impl ReadAt {
    /// Whether a table whose decoding ended at `now` is the one published when the pointer
    /// was read.
    pub fn decoded_in_time(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.0) <= TABLE_WINDOW
    }

    /// Whether a table the pointer still holds when read again at `now` is the table read
    /// the first time: it could not have been freed and its address reused in between.
    pub fn still_same_at(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.0) < UNPUBLISHED_ALIVE
    }
}

/// Whether a copy of a table made `age` ago (the BPF sampler copies it with the stack) may
/// be decoded without asking whether the thread still publishes it: its values were alive
/// when copied, and are for [`TABLE_WINDOW`] after.
pub fn copy_trusted(age: Duration) -> bool {
    age <= TABLE_WINDOW
}

#[cfg(test)]
mod tests {
    use super::*;

    const THREAD: u64 = 0x7f00_1000;
    const OTHER: u64 = 0x7f00_2000;

    fn read(before: Option<u64>, after: Option<u64>) -> PointerRead {
        PointerRead {
            owner_before: before,
            pointer: 0xabc0,
            owner_after: after,
        }
    }

    #[test]
    fn the_pointer_is_a_threads_only_when_both_owner_reads_name_it() {
        assert_eq!(read(Some(THREAD), Some(THREAD)).table_for(THREAD), 0xabc0);
        // An extension from before the owner word: the pointer is the native thread's.
        assert_eq!(read(None, None).table_for(THREAD), 0xabc0);
        // Switched between the reads (cleared, then the new thread's), or another's.
        for (before, after) in [
            (Some(THREAD), Some(0)),
            (Some(0), Some(THREAD)),
            (Some(OTHER), Some(THREAD)),
            (Some(THREAD), Some(OTHER)),
            (Some(OTHER), Some(OTHER)),
        ] {
            assert_eq!(
                read(before, after).table_for(THREAD),
                0,
                "{before:?} {after:?}"
            );
        }
        assert_eq!(read(Some(OTHER), Some(OTHER)).table_for(OTHER), 0xabc0);
    }

    #[test]
    fn a_table_is_trusted_within_the_window_and_found_again_within_its_life() {
        // A fake clock: instants at chosen distances from the pointer's read.
        let start = Instant::now();
        let at = |ms: u64, us: u64| start + Duration::from_millis(ms) + Duration::from_micros(us);
        let read = ReadAt(start);
        assert!(read.decoded_in_time(at(0, 300)));
        assert!(read.decoded_in_time(at(8, 0)));
        assert!(!read.decoded_in_time(at(8, 1)));
        assert!(read.still_same_at(at(9, 999)));
        assert!(!read.still_same_at(at(10, 0)));
        // A clock read before the pointer's (another thread's Instant) is no later.
        assert!(ReadAt(at(5, 0)).decoded_in_time(start));
        assert!(copy_trusted(Duration::from_millis(8)));
        assert!(!copy_trusted(Duration::from_micros(8_001)));
        // The window leaves the writer's coarse clock a margin below the table's life.
        assert!(TABLE_WINDOW < UNPUBLISHED_ALIVE);
    }
}
