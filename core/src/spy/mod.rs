//! The one stack walker: attach to a process once, then read its current stack as often as
//! needed. Everything that cannot change between samples (addresses, the layout, iseq
//! labels and line tables, method names, class names) is cached in the [`Spy`], so a warm
//! snapshot costs four `process_vm_readv` calls: thread state, control frames, frame
//! environments + iseq headers, and method-entry headers.
use crate::error::ObjectError;
use crate::error::{Error, MemoryError, Result};
use crate::memory::word;
use crate::memory::{field, Memory, ProcessMemory};
use crate::objects::{ClassNames, SymbolTable};
use rustc_hash::FxHashMap;
use std::sync::Arc;

mod attach;
mod batch;
mod captured;
mod frames;
mod located;
mod memo;
mod tags;
mod thread_list;
mod threads;
mod walker;
mod zjit;
pub use crate::model::{Frame, SampledThread, Tags, ThreadSelection};
pub use attach::TargetView;
pub use captured::{CaptureLayout, CaptureThread, Captured, TRUNCATED_LABEL};
use walker::{Envs, Prefetched, RawFrame, Wanted};

/// Most frames one stack may have: Ruby's default VM stack (1 MiB) holds fewer.
const MAX_FRAMES: u64 = 65_536;
/// Most environments followed from a block frame to its method frame.
const MAX_EP_DEPTH: usize = 256;
/// Most bytes of one thread's value stack read (Ruby's default VM stack is 1 MiB; the
/// fuzz test found garbage frames asking for far more).
const MAX_VALUE_STACK: usize = 64 << 20;
/// How long cached iseqs and method entries are trusted without reading their headers.
const REVALIDATE: std::time::Duration = std::time::Duration::from_millis(100);
/// How often a spy makes sure its pid still holds the process it attached to.
pub const IDENTITY_TTL: std::time::Duration = std::time::Duration::from_millis(100);
/// Most escaped environments cached between samples.
const MAX_CACHED_ENVS: usize = 4096;
/// How often a snapshot is retried when the stack changes under it.
pub const SNAPSHOT_ATTEMPTS: u32 = 8;

/// Options for [`Spy::attach_with`].
#[derive(Debug, Clone, Default)]
pub struct Config {
    /// Use this version's layout instead of the one the process reports.
    pub force_version: Option<String>,
    /// Find the VM by scanning libruby's data even when `ruby_current_vm_ptr` is exported
    /// (what stripped 3.3+ builds need; lets tests exercise the scan on any Ruby).
    pub scan_for_vm: bool,
}

/// A handle on one Ruby process. Each part lives in its own file:
/// - `target` (attach.rs): what attaching found, fixed for the spy's life, and the
///   symbol-table scan;
/// - `cache` (frames.rs): iseqs, method entries, class and symbol names, trusted between
///   validations;
/// - `walk` (walker.rs): per-stack state of the walker and the arena of its frame reads;
/// - `memo` (memo.rs): frames already resolved, by raw stack;
/// - `sampler` (batch.rs, `ThreadSampler`): the thread list and a sample's one call: what
///   to read, the read, and each thread's state;
/// - `tags` (tags.rs, `TagReader`): where the target publishes `ruby_profiler_state`, what a
///   sample reads of it, and the last decoding of each thread's table.
///
/// `ThreadSampler` and `TagReader` have methods of their own, given the `Target` (and, to
/// decode names, the `Cache`) they need. The walker's steps (walker.rs, frames.rs) are
/// `impl Spy` blocks, because each uses the target, the cache, the walk state and the memo
/// together. This file orchestrates a snapshot; threads.rs orchestrates a sample of every
/// thread.
pub struct Spy<M: Memory = ProcessMemory> {
    target: attach::Target<M>,
    cache: frames::Cache,
    walk: walker::WalkState,
    memo: memo::StackMemo,
    sampler: batch::ThreadSampler,
    tags: tags::TagReader,
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

/// A failure inside one attempt: either the stack moved (retry) or a real error.
enum Attempt {
    Changed(String),
    Fatal(Error),
}

impl From<Error> for Attempt {
    fn from(e: Error) -> Self {
        Attempt::Fatal(e)
    }
}

impl<M: Memory> Spy<M> {
    pub fn pid(&self) -> i32 {
        self.target.pid
    }

    /// The Ruby version the target reports (e.g. "3.1.2").
    pub fn version(&self) -> &str {
        &self.target.version
    }

    /// Set when the layout came from the newest known release of the same minor series.
    pub fn warning(&self) -> Option<&str> {
        self.target.warning.as_deref()
    }

    pub fn memory(&self) -> &M {
        &self.target.mem
    }

    /// The memory source, writable: tests rewrite a memory image between samples.
    pub fn memory_mut(&mut self) -> &mut M {
        &mut self.target.mem
    }

    /// The address of the target's `rb_vm_t`.
    pub fn vm_address(&self) -> u64 {
        self.target.vm
    }

    /// The stack of the thread holding the GVL (the main thread when none does), innermost
    /// frame first. Retries a bounded number of times if the stack changes while read.
    pub fn snapshot(&mut self) -> Result<Vec<Frame>> {
        self.target.check_identity(false)?;
        let mut last = String::new();
        for _ in 0..SNAPSHOT_ATTEMPTS {
            match self.try_snapshot() {
                Ok(stack) => return Ok(stack.frames.to_vec()),
                Err(Attempt::Fatal(e)) => {
                    self.target.check_identity(true)?;
                    return Err(e);
                }
                Err(Attempt::Changed(why)) => {
                    // Forget what may be what changed: the speculative thread and cached
                    // heap environments.
                    self.walk.last_ec = None;
                    self.forget_envs();
                    self.cache.validated_at = None;
                    last = why;
                }
            }
        }
        // A process that vanished between attempts reports as exited, not as a moving stack;
        // one that ran exec, or whose pid was taken by another, as replaced.
        if !std::path::Path::new(&format!("/proc/{}", self.target.pid)).exists() {
            return Err(Error::ProcessExited {
                pid: self.target.pid,
            });
        }
        self.target.check_identity(true)?;
        Err(Error::StackChanged {
            pid: self.target.pid,
            attempts: SNAPSHOT_ATTEMPTS,
            last,
        })
    }

    /// The tags of the thread the last [`Spy::snapshot`] read (see spy/tags.rs).
    pub fn snapshot_tags(&mut self) -> Tags {
        match self.walk.last_ec {
            Some((thread, _)) => self.thread_tags(thread),
            None => Tags::default(),
        }
    }

    /// Maps a read failure during a walk: the process being gone or unreadable is fatal,
    /// an unmapped address means the stack moved under us.
    fn moved(&self, what: &str) -> impl Fn(MemoryError) -> Attempt + '_ {
        let what = what.to_string();
        move |e| match e {
            MemoryError::Gone => Attempt::Fatal(Error::ProcessExited {
                pid: self.target.pid,
            }),
            MemoryError::Denied => Attempt::Fatal(Error::PermissionDenied {
                pid: self.target.pid,
            }),
            other => Attempt::Changed(format!("{what}: {other}")),
        }
    }

    /// The word at `base + offset` in the target (wrapping); a failed read is `moved(what)`.
    fn read_word(&self, base: u64, offset: usize, what: &str) -> std::result::Result<u64, Attempt> {
        self.target
            .mem
            .read_u64(field(base, offset))
            .map_err(self.moved(what))
    }

    fn object_moved(&self, what: &str, e: ObjectError) -> Attempt {
        match e {
            ObjectError::Memory(m) => self.moved(what)(m),
            ObjectError::Shape(kind, addr) => {
                Attempt::Changed(format!("{what}: {kind} at {addr:#x} does not validate"))
            }
        }
    }
}
