//! Rust work called from Ruby, in one place: run with the GVL held or released, its error
//! raised as the `RubySpy::Error` subclass that names it, and a panic caught and raised as
//! one too, so that nothing unwinds across FFI.
use crate::{errors, nogvl::nogvl};
use magnus::{Error, Ruby};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Whether the work runs with the GVL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gvl {
    /// Kept: work on the calling process itself, which must not wait for a GVL it holds.
    Keep,
    /// Released while it runs: other Ruby threads go on while another process is read.
    Release,
}

impl Gvl {
    /// Kept when `pid` is the calling process, released otherwise.
    pub(crate) fn for_pid(pid: i32) -> Gvl {
        match pid as u32 == std::process::id() {
            true => Gvl::Keep,
            false => Gvl::Release,
        }
    }
}

/// Runs `work` (`what` names it in the error a panic becomes).
pub(crate) fn guarded<T>(
    ruby: &Ruby,
    gvl: Gvl,
    what: &str,
    work: impl FnOnce() -> rbspy_ext_core::Result<T>,
) -> Result<T, Error> {
    let result = match gvl {
        Gvl::Keep => catch_unwind(AssertUnwindSafe(work)),
        Gvl::Release => nogvl(work),
    };
    match result {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(errors::to_ruby(ruby, e)),
        Err(_) => Err(errors::panicked(ruby, what)),
    }
}
