//! The one stack walker: attach to a process once, then read its current stack as often as
//! needed. Everything that cannot change between samples (addresses, the layout, iseq
//! labels and line tables, method names, class names) is cached in the [`Spy`], so a warm
//! snapshot costs four `process_vm_readv` calls: thread state, control frames, frame
//! environments + iseq headers, and method-entry headers.
use crate::context::ownership::ReadAt;
use crate::error::ObjectError;
use crate::error::{Error, Result};
use crate::memory::word;
use crate::memory::{field, Memory, ProcessMemory};
use crate::model::ThreadState;
use crate::objects::{ClassNames, SymbolTable};
use batch::{Batch, ThreadSampler};
use rustc_hash::FxHashMap;
use std::sync::Arc;
use tags::Decoder;

mod attach;
mod batch;
mod captured;
mod envs;
mod fits;
mod frames;
mod labels;
mod layouts;
mod located;
mod memo;
mod parts;
mod tag_decoder;
mod tags;
mod thread_list;
mod trace_reads;
mod traces;
mod values;
mod view;
mod walker;
mod zjit;
pub use crate::model::{Frame, SampledThread, Tags, ThreadSelection};
pub use captured::{Capture, CaptureLayout, CaptureThread, Captured, TRUNCATED_LABEL};
use envs::Envs;
pub use layouts::LayoutSource;
pub use parts::ImageParts;
pub use view::TargetView;
use walker::{Prefetched, RawFrame, Walker, Wanted};

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
/// - `target` (attach.rs): what attaching found, fixed for the spy's life, with the identity
///   check, the scans of libruby's data and the reads every step makes;
/// - `cache` (frames.rs): iseqs, method entries, class and symbol names, trusted between
///   validations;
/// - `walk` (walker.rs): per-stack state of the walker and the arena of its frame reads;
/// - `memo` (memo.rs): frames already resolved, by raw stack;
/// - `sampler` (batch.rs, `ThreadSampler`): the thread list and a sample's one call: what
///   to read, the read, and each thread's state;
/// - `tags` (tags.rs, `TagReader`): where the target publishes `ruby_profiler_state`, what a
///   sample reads of it, and the last decoding of each thread's table.
///
/// The stack walker is one type, `walker::Walker`, lent the target and the three parts it
/// walks with (`Spy::walker`); its steps are in walker.rs, frames.rs and zjit.rs.
/// `ThreadSampler` and `TagReader` have methods of their own, given the `Target` (and, to
/// decode names, the `Cache`) they need. This file orchestrates a snapshot and a sample of
/// every thread; the BPF sampler's side is `Capture` (captured.rs), the census reads
/// through `TargetView` (view.rs), and a spy over a memory image is made in attach.rs (`over_image`).
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

    /// When the last `sample_threads` read the target (its one call), if it did.
    pub fn sampled_at(&self) -> Option<std::time::Instant> {
        self.sampler.last_call
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
        self.target.check_identity(false)?;
        let mut last = String::new();
        for _ in 0..SNAPSHOT_ATTEMPTS {
            match self.walker().try_snapshot() {
                Ok(stack) => return Ok(stack.frames.to_vec()),
                Err(Attempt::Fatal(e)) => {
                    self.target.check_identity(true)?;
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
        self.target.check_identity(true)?;
        Err(Error::StackChanged {
            pid: self.target.pid,
            attempts: SNAPSHOT_ATTEMPTS,
            last,
        })
    }

    /// The Ruby threads of the target, as last read (re-read when older than 100 ms).
    pub fn threads(&mut self) -> Result<Vec<crate::model::ThreadInfo>> {
        self.sampler.fresh_thread_list(&self.target)?;
        Ok(self
            .sampler
            .threads
            .iter()
            .map(|t| crate::model::ThreadInfo::clone(&t.info))
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
        Capture { spy: self }
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
        let mut d = Decoder {
            target: &self.target,
            cache: &mut self.cache,
        };
        self.tags.thread_tags(&mut d, thread)
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
}

/// Why a sample was dropped when the thread list or a thread's context did not read.
const LIST_CHANGED: &str = "thread list changed";

/// How often one thread's walk is retried when its stack moves while read.
const THREAD_ATTEMPTS: u32 = 3;

/// How a thread's walks ended (`Spy::retry_walk`).
enum Retried {
    Walked((Stack, Tags)),
    /// It finished meanwhile: its context has no VM stack.
    Ended,
    /// Its stack kept moving while read: a dropped sample.
    Moved,
}

impl<M: Memory> Spy<M> {
    /// One sample of the selected threads: each thread's state and stack. Threads whose
    /// stack moved while read are left out and reported in the second list (by reason);
    /// nothing is ever invented.
    pub fn sample_threads(
        &mut self,
        which: ThreadSelection,
    ) -> Result<(Vec<SampledThread>, Vec<&'static str>)> {
        self.target.check_identity(false)?;
        let mut result = self.sample_threads_once(which);
        // A thread that ended between the list and the read of its context fails the whole
        // read: list the threads again at once, rather than drop every thread's sample of
        // this tick. Under thread churn on a busy machine that was 0.7 % of a soak's ticks.
        if matches!(&result, Ok((sampled, dropped)) if sampled.is_empty() && dropped[..] == [LIST_CHANGED])
        {
            result = self.sample_threads_once(which);
        }
        match result {
            // A failed read may be the process gone or replaced (see `check_identity`).
            Err(e) if !matches!(e, Error::PermissionDenied { .. }) => {
                self.target.check_identity(true)?;
                Err(e)
            }
            result => result,
        }
    }

    fn sample_threads_once(
        &mut self,
        which: ThreadSelection,
    ) -> Result<(Vec<SampledThread>, Vec<&'static str>)> {
        self.sampler.fresh_thread_list(&self.target)?;
        let mut batch = self
            .sampler
            .plan_sample(&self.target, &mut self.tags, which);
        if let Err(e) = ThreadSampler::read_sample(&self.target, &mut batch) {
            self.sampler.discard(batch);
            // A stack may have moved away from where it was, a table may have been freed:
            // guess afresh next time.
            self.sampler.forget_stacks();
            self.tags.forget_tables();
            return self.thread_list_changed("reading threads", e);
        }
        let mut chosen = self.sampler.classify(self.target.layout, &batch, which);
        if let Err(e) = self
            .sampler
            .refresh_contexts(&self.target, &mut batch, &chosen)
        {
            self.sampler.discard(batch);
            return self.thread_list_changed("reading execution contexts", e);
        }
        // A thread that has not started running Ruby yet, or has finished, has no VM stack
        // (null `vm_stack` and `cfp`): it has nothing to sample, which is not a dropped sample.
        chosen.retain(|(i, _)| self.walker().ec_fields(&batch.heads[*i])[0] != 0);
        let (sampled, failed) = self.walk_chosen(&mut batch, chosen);
        self.sampler.discard(batch);
        let dropped = self.confirm_drops(failed?)?;
        Ok((sampled, dropped))
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

    /// A thread (or its context) went away while read: forget the list so the next sample
    /// reads it again, and report this sample as dropped (or the process as gone).
    #[allow(clippy::type_complexity)]
    fn thread_list_changed(
        &mut self,
        what: &str,
        e: crate::error::MemoryError,
    ) -> Result<(Vec<SampledThread>, Vec<&'static str>)> {
        self.sampler.read_at = None;
        self.sampler.forget_contexts();
        match self.target.moved(what)(e) {
            Attempt::Fatal(e) => Err(e),
            Attempt::Changed(_) => Ok((Vec::new(), vec![LIST_CHANGED])),
        }
    }

    /// One call for every chosen thread's frames (the prefetched ones mostly read already);
    /// a thread whose stack moved is retried alone. The threads sampled, and those whose
    /// stacks did not read (or the error that ends the sample).
    #[allow(clippy::type_complexity)]
    fn walk_chosen(
        &mut self,
        batch: &mut Batch,
        chosen: Vec<(usize, ThreadState)>,
    ) -> (Vec<SampledThread>, Result<Vec<u64>>) {
        let contexts: Vec<[u64; 3]> = chosen
            .iter()
            .map(|(i, _)| self.walker().ec_fields(&batch.heads[*i]))
            .collect();
        let reads = &batch.reads;
        let pre: Vec<Option<Prefetched>> = chosen
            .iter()
            .map(|(i, _)| {
                batch.threads[*i].prefetch.map(|p| Prefetched {
                    vm_stack: p.vm_stack,
                    from: p.from,
                    frames: reads.get(p.frames),
                    values: reads.get(p.values),
                })
            })
            .collect();
        // Tags before stacks: a table is trusted only when decoded within `TABLE_WINDOW` of
        // the batch's read, and walking every thread with cold caches (a process's first
        // sample) can take longer than that.
        let tags: Vec<Tags> = chosen
            .iter()
            .map(|(i, _)| self.thread_tags_of(batch, *i))
            .collect();
        let calls = self.target.mem.calls();
        let results = self.walker().walk_many(&contexts, pre);
        let walked_late = self.target.mem.calls() != calls;
        let results = self.confirm_tags(batch, &chosen, results, walked_late);
        let mut sampled = Vec::with_capacity(chosen.len());
        let mut failed = Vec::new();
        let chosen = chosen.into_iter().zip(tags);
        for ((((i, state), tags), ec), first) in chosen.zip(contexts).zip(results) {
            let thread = self.sampler.threads[i].thread;
            let (stack, tags) = match self.retry_walk(thread, first, tags) {
                Ok(Retried::Walked(walked)) => walked,
                Ok(not_walked) => {
                    self.sampler.forget_stack(thread);
                    if matches!(not_walked, Retried::Moved) {
                        failed.push(thread);
                    }
                    continue;
                }
                Err(e) => return (sampled, Err(e)),
            };
            let hints = &self.walk.stack_hints;
            self.sampler
                .guess_stack(self.target.layout, hints, thread, ec);
            sampled.push(SampledThread {
                info: self.sampler.threads[i].info.clone(),
                state,
                frames: stack.frames,
                stack_token: stack.token,
                tags,
            });
        }
        (sampled, Ok(failed))
    }

    /// The tags of thread `i` of the batch, from what the batch read.
    fn thread_tags_of(&mut self, batch: &Batch, i: usize) -> Tags {
        let Some(read) = batch.threads[i].tag else {
            return Tags::default();
        };
        let thread = self.sampler.threads[i].thread;
        let nt = batch.nt(i, self.target.layout);
        let mut d = Decoder {
            target: &self.target,
            cache: &mut self.cache,
        };
        self.tags
            .sampled_tags(&mut d, thread, nt, read, &batch.reads, batch.called)
    }

    /// `results` with each walk whose tags may not be the ones its stack ran under turned into
    /// a change, for `retry_walk` to walk again between two readings of the tags. Within the
    /// batch's one call, the pointer is read before and after the thread's stack (the call
    /// copies in order, while the thread runs on), and must read the same. A walk that read
    /// frames of its own (`walked_late`: the guess of where the stack was fell short) saw the
    /// stack later than the batch saw the pointer, and a pointer read late saw it later than
    /// the stack. A thread that entered a request's action in between would show the action's
    /// stack without its tags (or left it, with the tags and another request's stack). So
    /// such a sample counts only if the pointer still holds the same table after the walk:
    /// one more call, only for samples that made calls of their own already. A pointer read
    /// apart from the batch (`tags_read_late`: a thread first seen, or another thread at a
    /// dead one's address) was read after the stack, which no later read can vouch for (a
    /// thread that left its tagged block and ends holds no table at both reads): such a
    /// sample is walked again between two readings of its tags.
    fn confirm_tags(
        &mut self,
        batch: &Batch,
        chosen: &[(usize, ThreadState)],
        mut results: Vec<std::result::Result<Stack, Attempt>>,
        walked_late: bool,
    ) -> Vec<std::result::Result<Stack, Attempt>> {
        // Tags that changed while the one call copied the stack, or were read after it.
        let l = self.target.layout;
        for (k, (i, _)) in chosen.iter().enumerate() {
            let held = batch.threads[*i].tag.is_none_or(|t| t.held(&batch.reads));
            if results[k].is_ok() && (!held || batch.tags_read_late(*i, l)) {
                results[k] = Err(Attempt::Changed("tags changed while read".into()));
            }
        }
        let check: Vec<(usize, (u64, u64, u64))> = chosen
            .iter()
            .enumerate()
            .filter(|(k, (i, _))| {
                results[*k].is_ok() && batch.threads[*i].tag.is_some() && walked_late
            })
            .map(|(k, (i, _))| {
                let thread = self.sampler.threads[*i].thread;
                let (table, record) = (
                    self.tags.sampled_table(thread),
                    self.tags.sampled_record(thread),
                );
                (k, (thread, table, record))
            })
            .collect();
        // Every thread's tags were read at the one published offset.
        let Some(offset) = check
            .first()
            .and_then(|(k, _)| batch.threads[chosen[*k].0].tag)
            .map(|read| read.offset)
        else {
            return results;
        };
        let pairs: Vec<(u64, u64, u64)> = check.iter().map(|(_, pair)| *pair).collect();
        let unchanged = self.tags.tables_unchanged(&self.target, offset, &pairs);
        for ((k, _), same) in check.iter().zip(unchanged) {
            if !same {
                results[*k] = Err(Attempt::Changed("tags changed while read".into()));
            }
        }
        results
    }

    /// The stack from a thread's first walk, with `tags` (decoded from the batch), else from
    /// up to `THREAD_ATTEMPTS - 1` more walks of its own; `Moved` when it kept moving, and
    /// `Ended` when its context has no VM stack any more (a thread that finished since the
    /// batch: nothing to sample, as for one seen so in the batch). A walk of
    /// its own happens later than the batch, so its tags are read afresh around it and the
    /// walk counts only if they read the same before and after: a thread that moved on to
    /// another request meanwhile would otherwise show the new request's stack under the old
    /// one's tags, or under none. Its control frame pointer is read afresh too: frames above
    /// the one the batch saw stay in memory, unchanged, after the thread returns from them,
    /// so a walk from the batch's pointer would show a stack the thread has left (a thread
    /// that ended its tagged block was seen in it, untagged, at both readings).
    fn retry_walk(
        &mut self,
        thread: u64,
        first: std::result::Result<Stack, Attempt>,
        tags: Tags,
    ) -> Result<Retried> {
        let mut result = first.map(|stack| (stack, tags));
        for _ in 1..THREAD_ATTEMPTS {
            if !matches!(result, Err(Attempt::Changed(_))) {
                break;
            }
            self.walker().forget_envs();
            let before = self.thread_tags(thread);
            let ec = self.walker().read_ec_of(thread);
            if matches!(ec, Ok([0, _, _])) {
                return Ok(Retried::Ended);
            }
            result = ec.and_then(|ec| self.walker().walk(ec)).and_then(|stack| {
                let after = self.thread_tags(thread);
                if after == before {
                    Ok((stack, after))
                } else {
                    Err(Attempt::Changed("tags changed while read".into()))
                }
            });
        }
        match result {
            Ok(walked) => Ok(Retried::Walked(walked)),
            Err(Attempt::Fatal(e)) => Err(e),
            Err(Attempt::Changed(_)) => Ok(Retried::Moved),
        }
    }

    /// The thread list is re-read every LIST_TTL, so a thread that ended since is still in
    /// it, and its freed memory may hold anything by now. A thread whose stack did not read
    /// is dropped only if a fresh list still has it; one that ended had nothing to sample.
    fn confirm_drops(&mut self, failed: Vec<u64>) -> Result<Vec<&'static str>> {
        let mut dropped = Vec::new();
        if failed.is_empty() {
            return Ok(dropped);
        }
        self.sampler.read_at = None;
        self.sampler.fresh_thread_list(&self.target)?;
        for thread in failed {
            if self.sampler.threads.iter().any(|t| t.thread == thread) {
                dropped.push("stack changed while read");
            }
        }
        Ok(dropped)
    }
}
