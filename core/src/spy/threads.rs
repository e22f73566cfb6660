//! Every Ruby thread of the target, for the recorder: the thread list, each thread's
//! identity (native tid, `Thread#name`), its state, and its stack.
//!
//! A child module of `spy` so that it shares the walker's private machinery.
use super::tags::TagRead;
use super::thread_list::MAX_THREADS;
use super::{word, Attempt, Frame, Memory, Prefetched, Spy, Stack};
use crate::error::MemoryError;
use crate::error::{Error, Result};
use crate::memory::{field, ReadBatch, Span};
use crate::objects::is_heap_object;
use crate::profile::{ThreadInfo, ThreadState};
use rbspy_ext_bindings::Layout;
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::time::Instant;

/// How often one thread's walk is retried when its stack moves while read.
const THREAD_ATTEMPTS: u32 = 2;

/// Which threads a sample covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ThreadSelection {
    /// Every Ruby thread.
    #[default]
    All,
    /// Only the thread holding the GVL (none when no thread holds it).
    GvlHolder,
}

/// One thread's part of a sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SampledThread {
    pub info: Arc<ThreadInfo>,
    pub state: ThreadState,
    pub frames: Arc<[Frame]>,
    /// See [`super::Stack::token`].
    pub stack_token: u64,
    /// The tags of the fiber the thread was running (spy/tags.rs).
    pub tags: super::Tags,
}

#[derive(Debug, Default)]
pub(super) struct ThreadSampler {
    /// The last reading of the thread list (thread_list.rs).
    pub(super) threads: Vec<(u64, Arc<ThreadInfo>)>,
    pub(super) read_at: Option<Instant>,
    /// The execution context each thread had when last sampled.
    ecs: FxHashMap<u64, u64>,
    /// Where each thread's stack was when last sampled (see `guess_stack`).
    stacks: FxHashMap<u64, StackGuess>,
    /// The thread that held the GVL at the last sample.
    last_owner: u64,
    /// The GC's `rb_objspace` (read once: it lives as long as the VM).
    objspace: Option<u64>,
    /// The arena of a sample's one call, reused from sample to sample.
    pub(super) reads: ReadBatch,
}

#[derive(Debug, Clone, Copy)]
struct StackGuess {
    vm_stack: u64,
    from: u64,
    end: u64,
    values: usize,
}

/// The state of the thread holding the GVL, from the GC's flags (`rb_objspace.flags`: a
/// 2-bit mode at bit 0, `during_gc` at bit 5; see `Layout::objspace_flags`).
fn gc_state(flags: u32) -> ThreadState {
    if flags & (1 << 5) == 0 {
        return ThreadState::Running;
    }
    match flags & 0x3 {
        1 => ThreadState::GcMarking,
        2 => ThreadState::GcSweeping,
        3 => ThreadState::GcCompacting,
        _ => ThreadState::Gc,
    }
}

/// How many frames deeper than last time a stack may be and still be read with its thread.
const PREFETCH_FRAMES: u64 = 16;

impl<M: Memory> Spy<M> {
    /// Where to read a thread's stack next time, along with the thread: from a little below
    /// where its frames are now to the end of its stack, and as much of the value stack as
    /// its frames used.
    fn guess_stack(&mut self, thread: u64, [vm_stack, vm_stack_size, cfp]: [u64; 3]) {
        let cfp_size = self.target.layout.cfp_size as u64;
        let end = vm_stack
            .wrapping_add(vm_stack_size.wrapping_mul(8))
            .wrapping_sub(cfp_size);
        let from = cfp.saturating_sub(PREFETCH_FRAMES * cfp_size).max(vm_stack);
        let values = self.walk.stack_hints.get(&vm_stack).copied().unwrap_or(0);
        let values = values.min((from - vm_stack) as usize);
        if self.sampler.stacks.len() >= MAX_THREADS {
            self.sampler.stacks.clear();
        }
        self.sampler.stacks.insert(
            thread,
            StackGuess {
                vm_stack,
                from,
                end,
                values,
            },
        );
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
        self.sampler.ecs.clear();
        match self.moved(what)(e) {
            Attempt::Fatal(e) => Err(e),
            Attempt::Changed(_) => Ok((Vec::new(), vec!["thread list changed"])),
        }
    }

    /// One sample of the selected threads: each thread's state and stack. Threads whose
    /// stack moved while read are left out and reported in the second list (by reason);
    /// nothing is ever invented.
    pub fn sample_threads(
        &mut self,
        which: ThreadSelection,
    ) -> Result<(Vec<SampledThread>, Vec<&'static str>)> {
        self.check_identity(false)?;
        match self.sample_threads_once(which) {
            // A failed read may be the process gone or replaced (see `check_identity`).
            Err(e) if !matches!(e, Error::PermissionDenied { .. }) => {
                self.check_identity(true)?;
                Err(e)
            }
            result => result,
        }
    }

    fn sample_threads_once(
        &mut self,
        which: ThreadSelection,
    ) -> Result<(Vec<SampledThread>, Vec<&'static str>)> {
        self.fresh_thread_list()?;
        let mut batch = self.plan_sample(which);
        if let Err(e) = self.read_sample(&mut batch) {
            self.discard(batch);
            // A stack may have moved away from where it was, a table may have been freed:
            // guess afresh next time.
            self.sampler.stacks.clear();
            self.forget_tag_tables();
            return self.thread_list_changed("reading threads", e);
        }
        let mut chosen = self.classify(&batch, which);
        if let Err(e) = self.refresh_contexts(&mut batch, &chosen) {
            self.discard(batch);
            return self.thread_list_changed("reading execution contexts", e);
        }
        // A thread that has not started running Ruby yet, or has finished, has no VM stack
        // (null `vm_stack` and `cfp`): it has nothing to sample, which is not a dropped sample.
        chosen.retain(|(i, _)| self.ec_fields(&batch.heads[*i])[0] != 0);
        let (sampled, failed) = self.walk_chosen(&mut batch, chosen);
        self.discard(batch);
        let dropped = self.confirm_drops(failed?)?;
        Ok((sampled, dropped))
    }

    /// What one sample reads for every thread, added to one `ReadBatch`: the GVL
    /// owner, the GC's flags, for every thread its execution context, status and native
    /// thread (one span of the thread struct), the stack fields of the context it had last
    /// time (a thread's context changes only when it switches fibers), and, on the guess
    /// that its stack is about where it was, its control frames and value stack, plus its
    /// tag pointer and last table. In the steady state that one call is the whole sample.
    fn plan_sample(&mut self, which: ThreadSelection) -> Batch {
        let l = self.target.layout;
        let count = self.sampler.threads.len();
        let fields = [
            l.thread_ec,
            l.thread_status.map_or(0, |(byte, _)| byte),
            l.thread_gvl_wait_node,
            l.thread_unblock_func.unwrap_or(l.thread_ec),
            // The native thread, whose thread pointer leads to the tags (3.2+).
            l.thread_nt.unwrap_or(l.thread_ec),
        ];
        let span_from = fields.iter().copied().min().unwrap_or(0);
        let span = fields.iter().copied().max().unwrap_or(0) + 8 - span_from;
        let objspace = self.objspace();
        let mut reads = std::mem::take(&mut self.sampler.reads);
        reads.clear();
        let owner = reads.add(self.target.gvl_owner, 8);
        let gc_flags = if is_heap_object(objspace) {
            reads.add(field(objspace, l.objspace_flags), 4)
        } else {
            Span::default()
        };
        let tag_offset = self.profiler_state_offset();
        let mut threads = Vec::with_capacity(count);
        for i in 0..count {
            let thread = self.sampler.threads[i].0;
            let wanted = which == ThreadSelection::All || thread == self.sampler.last_owner;
            let mut tag = match tag_offset {
                Some(offset) if wanted => Some(self.tag_read(thread, offset, &mut reads)),
                _ => None,
            };
            let fields = reads.add(field(thread, span_from), span);
            let guessed = self.sampler.ecs.get(&thread).copied().unwrap_or(0);
            let head = match guessed {
                0 => Span::default(),
                ec => reads.add(field(ec, l.ec_vm_stack), 24),
            };
            let prefetch = match self.sampler.stacks.get(&thread).copied() {
                Some(g) if wanted => Some(PrefetchSpans {
                    vm_stack: g.vm_stack,
                    from: g.from,
                    frames: reads.add(g.from, (g.end - g.from) as usize),
                    values: reads.add(g.vm_stack, g.values),
                }),
                _ => None,
            };
            // The pointer again after the stack: the two bracket what the call copied.
            if let Some(tag) = &mut tag {
                tag.reread_pointer(&mut reads);
            }
            threads.push(ThreadReads {
                fields,
                guessed,
                head,
                prefetch,
                tag,
            });
        }
        Batch {
            reads,
            span_from,
            owner,
            gc_flags,
            threads,
            heads: vec![[0; 24]; count],
            called: Instant::now(),
        }
    }

    /// The GC's `rb_objspace`, read once: it lives as long as the VM. 0 when unreadable (then
    /// GC is simply not told apart).
    fn objspace(&mut self) -> u64 {
        if let Some(o) = self.sampler.objspace {
            return o;
        }
        let addr = field(self.target.vm, self.target.layout.vm_objspace);
        let o = self.target.mem.read_u64(addr).unwrap_or(0);
        self.sampler.objspace = Some(o);
        o
    }

    /// The sample's one call (see `plan_sample`).
    fn read_sample(&mut self, batch: &mut Batch) -> std::result::Result<(), MemoryError> {
        batch.called = Instant::now();
        batch.reads.read(&self.target.mem)?;
        for (head, t) in batch.heads.iter_mut().zip(&batch.threads) {
            if !t.head.is_empty() {
                head.copy_from_slice(batch.reads.get(t.head));
            }
        }
        Ok(())
    }

    /// Each thread's state from what the sample read, for the threads `which` wants and
    /// that have an execution context.
    fn classify(&mut self, batch: &Batch, which: ThreadSelection) -> Vec<(usize, ThreadState)> {
        let l = self.target.layout;
        let (status_byte, status_mask) = l.thread_status.unwrap_or((0, 0));
        let owner = word(batch.reads.get(batch.owner), 0);
        self.sampler.last_owner = owner;
        let runnable = l.thread_status_runnable << status_mask.trailing_zeros();
        let gc_flags = batch.reads.get(batch.gc_flags);
        let holder_state = gc_state(gc_flags.try_into().map_or(0, u32::from_le_bytes));
        let mut chosen = Vec::new();
        for (i, (thread, _)) in self.sampler.threads.iter().enumerate() {
            let status = batch.field(i, status_byte)[0] & status_mask;
            // Queued for the GVL: its node is linked (not null, not pointing at itself).
            // Before 3.3 the node doubles as the ubf-list node of a thread blocked in a
            // blocking region, which has an unblocking function set; one queued has none.
            let node = word(batch.field(i, l.thread_gvl_wait_node), 0);
            let queued = node != 0
                && node != field(*thread, l.thread_gvl_wait_node)
                && l.thread_unblock_func
                    .is_none_or(|f| word(batch.field(i, f), 0) == 0);
            let state = if *thread == owner {
                holder_state
            } else if queued || status_mask == 0 || u64::from(status) == runnable {
                ThreadState::WaitingForGvl
            } else {
                ThreadState::Blocked
            };
            if which == ThreadSelection::GvlHolder && !state.on_cpu() {
                continue;
            }
            if !is_heap_object(batch.ec(i, l)) {
                continue; // a thread not started yet, or already gone
            }
            chosen.push((i, state));
        }
        chosen
    }

    /// Contexts that changed since last time (a fiber switch): one more call for their
    /// stack fields.
    fn refresh_contexts(
        &mut self,
        batch: &mut Batch,
        chosen: &[(usize, ThreadState)],
    ) -> std::result::Result<(), MemoryError> {
        let l = self.target.layout;
        let stale: Vec<usize> = chosen
            .iter()
            .map(|(i, _)| *i)
            .filter(|i| batch.ec(*i, l) != batch.threads[*i].guessed)
            .collect();
        if stale.is_empty() {
            return Ok(());
        }
        let mut fresh = vec![[0u8; 24]; stale.len()];
        let mut requests: Vec<(u64, &mut [u8])> = stale
            .iter()
            .zip(fresh.iter_mut())
            .map(|(i, h)| (field(batch.ec(*i, l), l.ec_vm_stack), &mut h[..]))
            .collect();
        self.target.mem.read_many(&mut requests)?;
        for (i, h) in stale.into_iter().zip(fresh) {
            batch.heads[i] = h;
            let thread = self.sampler.threads[i].0;
            self.sampler.ecs.insert(thread, batch.ec(i, l));
        }
        Ok(())
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
            .map(|(i, _)| self.ec_fields(&batch.heads[*i]))
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
        let tags: Vec<super::Tags> = chosen
            .iter()
            .map(|(i, _)| self.thread_tags_of(batch, *i))
            .collect();
        let calls = self.target.mem.calls();
        let results = self.walk_many(&contexts, pre);
        let walked_late = self.target.mem.calls() != calls;
        let results = self.confirm_tags(batch, &chosen, results, walked_late);
        let mut sampled = Vec::with_capacity(chosen.len());
        let mut failed = Vec::new();
        let chosen = chosen.into_iter().zip(tags);
        for ((((i, state), tags), ec), first) in chosen.zip(contexts).zip(results) {
            let thread = self.sampler.threads[i].0;
            let (stack, tags) = match self.retry_walk(thread, ec, first, tags) {
                Ok(Some(walked)) => walked,
                Ok(None) => {
                    self.sampler.stacks.remove(&thread);
                    failed.push(thread);
                    continue;
                }
                Err(e) => return (sampled, Err(e)),
            };
            self.guess_stack(thread, ec);
            sampled.push(SampledThread {
                info: self.sampler.threads[i].1.clone(),
                state,
                frames: stack.frames,
                stack_token: stack.token,
                tags,
            });
        }
        (sampled, Ok(failed))
    }

    /// The tags of thread `i` of the batch, from what the batch read.
    fn thread_tags_of(&mut self, batch: &Batch, i: usize) -> super::Tags {
        let Some(read) = batch.threads[i].tag else {
            return super::Tags::default();
        };
        let thread = self.sampler.threads[i].0;
        let nt = batch.nt(i, self.target.layout);
        self.sampled_tags(thread, nt, read, &batch.reads, batch.called)
    }

    /// Whether thread `i`'s tag pointer was read apart from the batch (`sampled_tags` reads
    /// it afresh when the batch could not: the native thread was not known, or changed).
    fn tags_read_late(&self, batch: &Batch, i: usize) -> bool {
        let Some(read) = batch.threads[i].tag else {
            return false;
        };
        let nt = batch.nt(i, self.target.layout);
        read.pointer.is_none() || nt != read.nt
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
    /// one more call, only for samples that made calls of their own already.
    fn confirm_tags(
        &mut self,
        batch: &Batch,
        chosen: &[(usize, ThreadState)],
        mut results: Vec<std::result::Result<Stack, Attempt>>,
        walked_late: bool,
    ) -> Vec<std::result::Result<Stack, Attempt>> {
        // Tags that changed while the one call copied the stack.
        for (k, (i, _)) in chosen.iter().enumerate() {
            let held = batch.threads[*i].tag.is_none_or(|t| t.held(&batch.reads));
            if results[k].is_ok() && !held {
                results[k] = Err(Attempt::Changed("tags changed while read".into()));
            }
        }
        let check: Vec<(usize, (u64, u64))> = chosen
            .iter()
            .enumerate()
            .filter(|(k, (i, _))| {
                results[*k].is_ok()
                    && batch.threads[*i].tag.is_some()
                    && (walked_late || self.tags_read_late(batch, *i))
            })
            .map(|(k, (i, _))| {
                let thread = self.sampler.threads[*i].0;
                (k, (thread, self.sampled_table(thread)))
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
        let pairs: Vec<(u64, u64)> = check.iter().map(|(_, pair)| *pair).collect();
        for ((k, _), same) in check.iter().zip(self.tables_unchanged(offset, &pairs)) {
            if !same {
                results[*k] = Err(Attempt::Changed("tags changed while read".into()));
            }
        }
        results
    }

    /// The stack from a thread's first walk, with `tags` (decoded from the batch), else from
    /// up to `THREAD_ATTEMPTS - 1` more walks of its own; None when it kept moving. A walk of
    /// its own happens later than the batch, so its tags are read afresh around it and the
    /// walk counts only if they read the same before and after: a thread that moved on to
    /// another request meanwhile would otherwise show the new request's stack under the old
    /// one's tags, or under none.
    fn retry_walk(
        &mut self,
        thread: u64,
        ec: [u64; 3],
        first: std::result::Result<Stack, Attempt>,
        tags: super::Tags,
    ) -> Result<Option<(Stack, super::Tags)>> {
        let mut result = first.map(|stack| (stack, tags));
        for _ in 1..THREAD_ATTEMPTS {
            if !matches!(result, Err(Attempt::Changed(_))) {
                break;
            }
            self.forget_envs();
            let before = self.thread_tags(thread);
            result = self.walk(ec).and_then(|stack| {
                let after = self.thread_tags(thread);
                if after == before {
                    Ok((stack, after))
                } else {
                    Err(Attempt::Changed("tags changed while read".into()))
                }
            });
        }
        match result {
            Ok(walked) => Ok(Some(walked)),
            Err(Attempt::Fatal(e)) => Err(e),
            Err(Attempt::Changed(_)) => Ok(None),
        }
    }

    /// The sample's arena, kept for the next sample.
    fn discard(&mut self, batch: Batch) {
        self.sampler.reads = batch.reads;
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
        self.fresh_thread_list()?;
        for thread in failed {
            if self.sampler.threads.iter().any(|(t, _)| *t == thread) {
                dropped.push("stack changed while read");
            }
        }
        Ok(dropped)
    }
}

/// One sample's reads (see `Spy::plan_sample`), all in one arena.
struct Batch {
    reads: ReadBatch,
    /// Every thread's span of its struct starts at this field offset.
    span_from: usize,
    owner: Span,
    /// `rb_objspace.flags` (empty when the objspace is unknown).
    gc_flags: Span,
    threads: Vec<ThreadReads>,
    /// The stack fields of each thread's context (`vm_stack`, its size, `cfp`): from the
    /// sample's call for the context it had last time, refreshed for one that changed.
    heads: Vec<[u8; 24]>,
    /// When the one call began (see spy/tags.rs, TABLE_WINDOW).
    called: Instant,
}

/// What one sample reads for one thread.
struct ThreadReads {
    /// The span of its `rb_thread_t` (see `Batch::span_from`).
    fields: Span,
    /// The context it had last time (0: none yet), and that context's stack fields.
    guessed: u64,
    head: Span,
    prefetch: Option<PrefetchSpans>,
    tag: Option<TagRead>,
}

/// A thread's control frames and value stack, read with it where its stack was last time.
#[derive(Clone, Copy)]
struct PrefetchSpans {
    vm_stack: u64,
    from: u64,
    frames: Span,
    values: Span,
}

impl Batch {
    /// Thread `i`'s bytes from struct offset `offset` on.
    fn field(&self, i: usize, offset: usize) -> &[u8] {
        &self.reads.get(self.threads[i].fields)[offset - self.span_from..]
    }

    /// Thread `i`'s execution context as read.
    fn ec(&self, i: usize, l: &Layout) -> u64 {
        word(self.field(i, l.thread_ec), 0)
    }

    /// Thread `i`'s native thread (`th->nt`) as read; 0 before 3.2, which has none.
    fn nt(&self, i: usize, l: &Layout) -> u64 {
        l.thread_nt.map_or(0, |off| word(self.field(i, off), 0))
    }
}
