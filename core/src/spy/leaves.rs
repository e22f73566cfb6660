//! What every room of spy/ shares, on its lowest floor: the limits of a walk, an attempt's
//! outcome, a walked stack and how a spy is asked to attach. Importing nothing of spy/, it
//! lets each room stand on the rooms below it and never on the handle (mod.rs) above.
use crate::error::Error;
use crate::model::Frame;
use std::sync::Arc;
use std::time::Duration;

/// Most frames one stack may have: Ruby's default VM stack (1 MiB) holds fewer.
pub(super) const MAX_FRAMES: u64 = 65_536;
/// Most environments followed from a block frame to its method frame.
pub(super) const MAX_EP_DEPTH: usize = 256;
/// Most bytes of one thread's value stack read (Ruby's default VM stack is 1 MiB; the
/// fuzz test found garbage frames asking for far more).
pub(super) const MAX_VALUE_STACK: usize = 64 << 20;
/// How long cached iseqs and method entries are trusted without reading their headers.
pub(super) const REVALIDATE: Duration = Duration::from_millis(100);
/// How often a spy makes sure its pid still holds the process it attached to.
pub const IDENTITY_TTL: Duration = Duration::from_millis(100);
/// Most escaped environments cached between samples.
pub(super) const MAX_CACHED_ENVS: usize = 4096;
/// How often a snapshot is retried when the stack changes under it.
pub const SNAPSHOT_ATTEMPTS: u32 = 8;
/// How often one thread's walk is retried, within a sample, when its stack moves while read.
pub(super) const THREAD_ATTEMPTS: u32 = 3;

/// Options for `Spy::attach_with`.
#[derive(Debug, Clone, Default)]
pub struct Config {
    /// Use this version's layout instead of the one the process reports.
    pub force_version: Option<String>,
    /// Find the VM by scanning libruby's data even when `ruby_current_vm_ptr` is exported
    /// (what stripped 3.3+ builds need; lets tests exercise the scan on any Ruby).
    pub scan_for_vm: bool,
}

/// One walked stack, innermost frame first.
#[derive(Debug, Clone)]
pub struct Stack {
    pub frames: Arc<[Frame]>,
    /// Names these exact frames for as long as this spy lives: two stacks with the same token
    /// have equal frames (equal frames may still come with different tokens). Lets the
    /// aggregator count a repeated stack without looking at its frames.
    pub token: u64,
}

/// One control frame as the walker reads it, before it is resolved into a [`Frame`].
#[derive(Debug, Clone, Copy)]
pub(super) struct RawFrame {
    pub(super) pc: u64,
    pub(super) iseq: u64,
    pub(super) ep: u64,
}

/// A failure inside one attempt: either the stack moved (retry) or a real error.
#[derive(Debug)]
pub(super) enum Attempt {
    Changed(String),
    Fatal(Error),
}

impl From<Error> for Attempt {
    fn from(e: Error) -> Self {
        Attempt::Fatal(e)
    }
}
