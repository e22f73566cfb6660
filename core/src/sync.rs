//! Locks that outlive a panic. A thread that panicked while holding one of the crate's
//! mutexes (caught at the FFI boundary, or in the sampler's thread) leaves data that is still
//! whole: every value behind them is replaced whole or counted, never left half-written. So a
//! poisoned lock is taken as it is rather than turned into a second panic.
use std::sync::{Mutex, MutexGuard};

/// `m` locked, poisoned or not.
pub fn locked<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
