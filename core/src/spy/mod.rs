//! The one stack walker: attach to a process once, then read its current stack as often as
//! needed. Everything that cannot change between samples (addresses, the layout, iseq
//! labels and line tables, method names, class names) is cached in the [`Spy`], so a warm
//! snapshot costs four `process_vm_readv` calls: thread state, control frames, frame
//! environments + iseq headers, and method-entry headers.
//!
//! This file is the handle; its rooms stand on floors, each importing only from the floors
//! below it and never from this file (script/check-floors reads this list):
//!
//! - floor 0: `leaves`, `cache`, `envs`, `values`, `located`, `fits`, `layouts`, `parts`, `traces`
//! - floor 1: `attach`, `memo`
//! - floor 2: `walker`, `thread_list`, `tag_decoder`
//! - floor 3: `frames`, `labels`, `zjit`, `tags`, `view`
//! - floor 4: `batch`, `trace_reads`
//! - floor 5: `sample`
//! - floor 6: `captured`
use crate::context::ownership::ReadAt;
use crate::error::{Error, Result};
use crate::memory::{Memory, ProcessMemory};
use crate::model::{Sample, ThreadInfo};
use crate::objects::{ClassNames, SymbolTable};
use crate::vm::VmRoots;
use attach::{Check, Target};
use leaves::Attempt;
use rbspy_ext_bindings::Layout;
use sample::Sampling;
use tags::Decoder;
use walker::Walker;

mod attach;
mod batch;
mod cache;
mod captured;
mod envs;
mod fits;
mod frames;
mod labels;
mod layouts;
mod leaves;
mod located;
mod memo;
mod parts;
mod sample;
mod tag_decoder;
mod tags;
#[cfg(test)]
mod tests;
mod thread_list;
mod trace_reads;
mod traces;
mod values;
mod view;
mod walker;
mod zjit;
pub use crate::model::{Frame, SampledThread, Tags, ThreadSelection};
pub use captured::{Capture, CaptureLayout, CaptureThread, Captured, TRUNCATED_LABEL};
pub use layouts::LayoutSource;
pub use leaves::{Config, Stack, IDENTITY_TTL, SNAPSHOT_ATTEMPTS};
pub use parts::ImageParts;
pub use view::TargetView;

/// A handle on one Ruby process. Each part lives in its own file:
/// - `target` (attach.rs): what attaching found, fixed for the spy's life, with the identity
///   check, the scans of libruby's data and the reads every step makes;
/// - `cache` (cache.rs, filled by frames.rs): iseqs, method entries, class and symbol
///   names, trusted between validations;
/// - `walk` (walker.rs): per-stack state of the walker and the arena of its frame reads;
/// - `memo` (memo.rs): frames already resolved, by raw stack;
/// - `sampler` (batch.rs, `ThreadSampler`): the thread list and a sample's one call: what
///   to read, the read, and each thread's state;
/// - `tags` (tags.rs, `TagReader`): where the target publishes `ruby_profiler_state`, what a
///   sample reads of it, and the last decoding of each thread's table.
///
/// The stack walker is one type, `walker::Walker`, lent the target and the three parts it
/// walks with (`Spy::walker`); its steps are in walker.rs, frames.rs and zjit.rs. A sample
/// of every thread is made by sample.rs, lent every part (`Spy::lend`); the BPF sampler's
/// side is `Capture` (captured.rs), lent the same; the census reads through `TargetView`
/// (view.rs).
pub struct Spy<M: Memory = ProcessMemory> {
    target: Target<M>,
    cache: cache::Cache,
    walk: walker::WalkState,
    memo: memo::StackMemo,
    sampler: batch::ThreadSampler,
    tags: tags::TagReader,
}

impl Spy<ProcessMemory> {
    /// Attaches to a live process: finds libruby, its version and its VM.
    pub fn attach(pid: i32) -> Result<Self> {
        Self::attach_with(pid, &Config::default())
    }

    pub fn attach_with(pid: i32, config: &Config) -> Result<Self> {
        let (target, symbols) = Target::attach(pid, config)?;
        Ok(Spy::over(target, symbols))
    }
}

impl<M: Memory> Spy<M> {
    /// A spy over an attached target, its caches empty (`symbols`: the address of
    /// `rb_symbols_t`, if known).
    fn over(target: Target<M>, symbols: Option<u64>) -> Self {
        let vm = target.vm;
        Spy {
            target,
            cache: cache::Cache {
                symbols: symbols.map(SymbolTable::new),
                classes: ClassNames::for_vm(vm),
                ..Default::default()
            },
            walk: Default::default(),
            memo: Default::default(),
            sampler: Default::default(),
            tags: Default::default(),
        }
    }

    /// A spy over any memory source whose VM is already known: for tests and fuzzing
    /// against memory images (`symbols`: the address of `rb_symbols_t`, if known).
    pub fn with_memory(
        pid: i32,
        mem: M,
        layout: &'static Layout,
        version: &str,
        roots: VmRoots,
        symbols: Option<u64>,
    ) -> Self {
        Spy::over(Target::new(pid, mem, layout, version, roots), symbols)
    }

    /// Where libruby's writable data is, for a spy over a memory image (`with_memory`): the
    /// scans for structs no symbol names look there.
    pub fn with_writable(mut self, segments: Vec<(u64, u64)>) -> Self {
        self.target.writable = segments;
        self
    }

    /// What a spy over a memory image of this target needs besides the memory
    /// (`Spy::over_image`), as attaching and the walks so far found it.
    pub fn image_parts(&mut self) -> ImageParts {
        let tags = self
            .profiler_state_offset()
            .map(|o| (o, self.tags.owner_offset));
        let symbols = self.cache.symbols.as_ref().map(|s| s.addr);
        self.target.image_parts(symbols, tags)
    }

    /// A spy over `mem`, a copy of (some of) the memory of the target `parts` were taken
    /// from (`image::capture`): what attaching found by reading the process (its maps and
    /// ELF files) comes from `parts` instead, and nothing is read from the process's files
    /// afterwards (an image's pid is nobody's).
    pub fn over_image(pid: i32, mem: M, parts: &ImageParts) -> Self {
        let mut spy = Spy::over(Target::over_image(pid, mem, parts), parts.symbols);
        spy.tags.preset(parts.tags);
        spy
    }

    /// One sample of the selected threads (see sample.rs): when it was read, each thread's
    /// state, stack, tags and trace, and the samples dropped, by reason. Err when the
    /// process is gone or replaced, or its memory does not read.
    pub fn sample(&mut self, which: ThreadSelection) -> Result<Sample> {
        self.lend().sample(which)
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

    /// The JIT whose code the target runs now, if any: "YJIT" or "ZJIT" (see `zjit::jit_of`).
    pub fn jit(&self) -> Option<&'static str> {
        zjit::jit_of(&self.target)
    }

    /// Set when the layout came from the newest known release of the same minor series.
    pub fn warning(&self) -> Option<&str> {
        self.target.warning.as_deref()
    }

    /// Where the layout this spy reads with came from (`rubyspy layout`).
    pub fn layout_source(&self) -> &LayoutSource {
        &self.target.layout_source
    }

    /// The layout this spy reads with.
    pub fn layout(&self) -> &'static rbspy_ext_bindings::Layout {
        self.target.layout
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
        self.target.check_identity(Check::WhenDue)?;
        let mut last = String::new();
        for _ in 0..SNAPSHOT_ATTEMPTS {
            match self.walker().try_snapshot() {
                Ok(stack) => return Ok(stack.frames.to_vec()),
                Err(Attempt::Fatal(e)) => {
                    self.target.check_identity(Check::Now)?;
                    return Err(e);
                }
                Err(Attempt::Changed(why)) => {
                    // Forget what may be what changed: the speculative thread and cached
                    // heap environments.
                    self.walk.last_ec = None;
                    self.walker().forget_envs();
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
        self.target.check_identity(Check::Now)?;
        Err(Error::StackChanged {
            pid: self.target.pid,
            attempts: SNAPSHOT_ATTEMPTS,
            last,
        })
    }

    /// The Ruby threads of the target, as last read (re-read when older than 100 ms).
    pub fn threads(&mut self) -> Result<Vec<ThreadInfo>> {
        self.sampler.fresh_thread_list(&self.target)?;
        Ok(self
            .sampler
            .threads
            .iter()
            .map(|t| ThreadInfo::clone(&t.info))
            .collect())
    }

    /// The view of the target a census reads through (see [`TargetView`]).
    pub fn target_view(&mut self) -> TargetView<'_, M> {
        TargetView {
            target: &mut self.target,
            symbols: &mut self.cache.symbols,
            classes: &mut self.cache.classes,
        }
    }

    /// The BPF sampler's side of this spy (see [`Capture`]).
    pub fn capture(&mut self) -> Capture<'_, M> {
        Capture { spy: self.lend() }
    }

    /// Every part of the spy, lent for one sample or one drain (see [`Sampling`]).
    fn lend(&mut self) -> Sampling<'_, M> {
        Sampling {
            target: &mut self.target,
            cache: &mut self.cache,
            walk: &mut self.walk,
            memo: &mut self.memo,
            sampler: &mut self.sampler,
            tags: &mut self.tags,
        }
    }

    /// The stack walker over this spy's target and caches (see [`walker::Walker`]).
    fn walker(&mut self) -> Walker<'_, M> {
        Walker {
            target: &mut self.target,
            cache: &mut self.cache,
            walk: &mut self.walk,
            memo: &mut self.memo,
        }
    }

    /// The offset from a thread pointer to its `ruby_profiler_state`, if the target has
    /// loaded rbspy_ext (looked for again every second until it has).
    pub fn profiler_state_offset(&mut self) -> Option<i64> {
        self.tags.offset(&self.target)
    }

    /// The tags of the fiber a thread is running now: empty when it has none, when the
    /// target has not loaded rbspy_ext, or when the table does not read as one (it may have
    /// been replaced while read; the next sample sees the new one).
    pub fn thread_tags(&mut self, thread: u64) -> Tags {
        self.lend().thread_tags(thread)
    }

    /// OpenTelemetry records (spy/traces.rs) that gave no labels so far, by reason
    /// (`context::otel_thread::Drop::name`), the reasons met only.
    pub fn trace_drops(&self) -> Vec<(&'static str, u64)> {
        self.tags.otel_drops.counts()
    }

    /// Decodes the `Ruby_Profiler_State` table at `table` in the target (0: none), for a
    /// reader that found a table pointer by itself. Empty when it does not read as a table.
    pub fn tags_at(&mut self, table: u64) -> Tags {
        if table == 0 {
            return Tags::default();
        }
        let mut d = Decoder {
            target: &self.target,
            cache: &mut self.cache,
        };
        d.read_table(table, ReadAt(std::time::Instant::now()))
            .map(|(_, tags)| tags)
            .unwrap_or_default()
    }

    /// The tags of the thread the last [`Spy::snapshot`] read (see spy/tags.rs).
    pub fn snapshot_tags(&mut self) -> Tags {
        match self.walk.last_ec {
            Some((thread, _)) => self.thread_tags(thread),
            None => Tags::default(),
        }
    }

    /// Forgets what is known of each thread (the list, contexts, stacks, tag pointers), and
    /// keeps what describes code (iseqs, method entries, names, the memo): for a spy kept
    /// between recordings, whose threads may have come and gone meanwhile.
    pub fn forget_threads(&mut self) {
        self.sampler.read_at = None;
        self.sampler.forget_stacks();
        self.sampler.forget_contexts();
        self.tags.forget_threads();
    }
}
