//! A sample's one call: what to read for every thread (`ThreadSampler::plan_sample`), the
//! read itself, and each thread's state from it (`classify`). `Sampling::sample`
//! (sample.rs) walks the stacks this read and decodes the tags.
use super::attach::Target;
use super::leaves::{Attempt, SNAPSHOT_ATTEMPTS};
use super::tags::{TagRead, TagReader};
use super::thread_list::{
    read_ractors, thread_info, Listed, RactorEntry, LIST_TTL, MAX_THREADS, RELIST_MIN,
};
use super::walker::frame_count;
use crate::error::MemoryError;
use crate::error::{Error, Result};
use crate::memory::{field, word, Memory, ReadBatch, Span};
use crate::model::{ThreadSelection, ThreadState};
use crate::objects::is_heap_object;
use rbspy_ext_bindings::Layout;
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug, Default)]
pub(super) struct ThreadSampler {
    /// The last reading of the thread lists (thread_list.rs): every thread, and the
    /// Ractors they run in.
    pub(super) threads: Vec<Listed>,
    pub(super) ractors: Vec<RactorEntry>,
    /// Their ids, for each sample (`Sample::ractors`).
    pub(super) ractor_ids: Arc<[u32]>,
    pub(super) read_at: Option<Instant>,
    /// The execution context each thread had when last sampled.
    ecs: FxHashMap<u64, u64>,
    /// Where each thread's stack was when last sampled (see `guess_stack`).
    stacks: FxHashMap<u64, StackGuess>,
    /// The threads that held a GVL (one per Ractor) at the last sample.
    pub(super) last_owners: Vec<u64>,
    /// The GVL owner missing from the list that had it read early last, until every owner
    /// is on the list again (see `relist_for_unlisted_owner`).
    relisted_for: u64,
    /// The main Ractor's `rb_objspace` (read once: it lives as long as the VM), for the BPF
    /// sampler, which reads one objspace's flags.
    pub(super) objspace: Option<u64>,
    /// The arena of a sample's one call, reused from sample to sample (no allocation per
    /// sample in the steady state).
    pub(super) reads: ReadBatch,
    /// The spans of each Ractor's GVL owner word, reused likewise.
    owner_spans: Vec<Span>,
    /// The spans of each Ractor's GC flags, reused likewise.
    gc_flag_spans: Vec<Span>,
    /// Each thread's reads and context fields, reused likewise.
    thread_reads: Vec<ThreadReads>,
    heads: Vec<[u8; 24]>,
    /// The threads `classify` chose, reused likewise (`Sampling::walk_chosen`).
    pub(super) chosen: Vec<(usize, ThreadState)>,
}

#[derive(Debug, Clone, Copy)]
struct StackGuess {
    vm_stack: u64,
    from: u64,
    end: u64,
    values: usize,
}

/// The state of the thread holding the GVL, from the GC's flags (`rb_objspace.flags`: a
/// 2-bit mode at bit 0, `during_gc` at `Layout::objspace_during_gc_bit`).
pub(super) fn gc_state(l: &Layout, flags: u32) -> ThreadState {
    if flags & (1 << l.objspace_during_gc_bit) == 0 {
        return ThreadState::Running;
    }
    match flags & 0x3 {
        1 => ThreadState::GcMarking,
        2 => ThreadState::GcSweeping,
        3 => ThreadState::GcCompacting,
        _ => ThreadState::Gc,
    }
}

/// Whether native thread `tid` of process `pid` still runs (its /proc entry is there).
fn task_lives(pid: i32, tid: i64) -> bool {
    std::path::Path::new(&format!("/proc/{pid}/task/{tid}")).exists()
}

/// The Vec kept in `slot`, emptied, for this sample to fill and hand back (`discard`).
fn emptied<T>(slot: &mut Vec<T>) -> Vec<T> {
    let mut v = std::mem::take(slot);
    v.clear();
    v
}

/// How many frames deeper than last time a stack may be and still be read with its thread.
const PREFETCH_FRAMES: u64 = 16;

/// The steps of a sample that need only the target and the sampler's own state; `Spy`
/// orchestrates them with the walker and the tag reader (sample.rs, `sample_once`).
impl ThreadSampler {
    /// Follows every Ractor's thread list (`vm->living_threads` before 3.0).
    pub(super) fn read_thread_list<M: Memory>(
        &mut self,
        t: &Target<M>,
    ) -> std::result::Result<(), Attempt> {
        let ractors = read_ractors(t)?;
        let node_offset = t.layout.thread_list_node as u64;
        // Under M:N threads (a non-main Ractor's from 3.3) a thread moves between native
        // threads, and one that sleeps holds none (tid 0): it keeps the tid it was first seen
        // on while that native thread lives, or every move or nap would make it a new thread
        // in a profile. (A thread whose first native thread has ended is a new thread that
        // took a dead one's rb_thread_t: it gets its own tid.)
        let known: FxHashMap<(u64, u32), i64> = self
            .threads
            .iter()
            .filter(|t| t.info.tid != 0)
            .map(|t| ((t.thread, t.info.ractor), t.info.tid))
            .collect();
        let mut threads = Vec::new();
        for (index, ractor) in ractors.iter().enumerate() {
            let head = ractor.threads;
            let mut node = t
                .mem
                .read_u64(head)
                .map_err(t.moved("reading the thread list"))?;
            while node != head {
                if threads.len() >= MAX_THREADS || !is_heap_object(node) {
                    return Err(Attempt::Changed("thread list does not close".into()));
                }
                let thread = node - node_offset;
                let mut info = thread_info(t, thread)?;
                info.ractor = ractor.id;
                info.ractor_name = ractor.name.clone();
                if let Some(&first) = known.get(&(thread, ractor.id)) {
                    let moved = info.tid != first;
                    if info.tid == 0 || (moved && task_lives(t.pid, first)) {
                        info.tid = first;
                    }
                }
                threads.push(Listed {
                    thread,
                    info: Arc::new(info),
                    ractor: index,
                });
                node = t
                    .mem
                    .read_u64(node)
                    .map_err(t.moved("reading the thread list"))?;
            }
        }
        self.threads = threads;
        self.ractor_ids = ractors.iter().map(|r| r.id).collect();
        self.ractors = ractors;
        self.read_at = Some(Instant::now());
        Ok(())
    }

    pub(super) fn fresh_thread_list<M: Memory>(&mut self, t: &Target<M>) -> Result<()> {
        let stale = self.read_at.is_none_or(|t| t.elapsed() >= LIST_TTL);
        if !stale {
            return Ok(());
        }
        for _ in 0..SNAPSHOT_ATTEMPTS {
            match self.read_thread_list(t) {
                Ok(()) => return Ok(()),
                Err(Attempt::Fatal(e)) => return Err(e),
                Err(Attempt::Changed(_)) => {}
            }
        }
        Err(Error::StackChanged {
            pid: t.pid,
            attempts: SNAPSHOT_ATTEMPTS,
            last: "the thread list kept changing".into(),
        })
    }

    /// Forgets where stacks were: one may have moved away.
    pub(super) fn forget_stacks(&mut self) {
        self.stacks.clear();
    }

    /// Forgets which context each thread had: the thread list itself may have changed.
    pub(super) fn forget_contexts(&mut self) {
        self.ecs.clear();
    }

    /// Forgets where one thread's stack was (it did not read there).
    pub(super) fn forget_stack(&mut self, thread: u64) {
        self.stacks.remove(&thread);
    }

    /// What one sample reads for every thread, added to one `ReadBatch`: each Ractor's GVL
    /// owner, the GC's flags, for every thread its execution context, status and native
    /// thread (one span of the thread struct), the stack fields of the context it had last
    /// time (a thread's context changes only when it switches fibers), and, on the guess
    /// that its stack is about where it was, its control frames and value stack, plus its
    /// tag pointer and last table. In the steady state that one call is the whole sample.
    pub(super) fn plan_sample<M: Memory>(
        &mut self,
        t: &Target<M>,
        tags: &mut TagReader,
        which: ThreadSelection,
    ) -> Batch {
        let l = t.layout;
        let count = self.threads.len();
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
        let mut reads = std::mem::take(&mut self.reads);
        reads.clear();
        let mut owners = emptied(&mut self.owner_spans);
        owners.extend(self.ractors.iter().map(|r| reads.add(r.owner, 8)));
        // Each Ractor's GC flags (one objspace for all before 4.1).
        let mut gc_flags = emptied(&mut self.gc_flag_spans);
        gc_flags.extend(self.ractors.iter().map(|r| {
            if is_heap_object(r.objspace) {
                reads.add(field(r.objspace, l.objspace_flags), 4)
            } else {
                Span::default()
            }
        }));
        let tag_offset = tags.offset(t);
        let mut threads = emptied(&mut self.thread_reads);
        let mut heads = emptied(&mut self.heads);
        heads.resize(count, [0; 24]);
        for i in 0..count {
            let thread = self.threads[i].thread;
            let wanted = which == ThreadSelection::All || self.last_owners.contains(&thread);
            let mut tag = match tag_offset {
                Some(offset) if wanted => Some(tags.tag_read(thread, offset, &mut reads)),
                _ => None,
            };
            let fields = reads.add(field(thread, span_from), span);
            let guessed = self.ecs.get(&thread).copied().unwrap_or(0);
            let head = match guessed {
                0 => Span::default(),
                ec => reads.add(field(ec, l.ec_vm_stack), 24),
            };
            let prefetch = match self.stacks.get(&thread).copied() {
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
            owners,
            gc_flags,
            threads,
            heads,
            called: Instant::now(),
        }
    }

    /// The GC's `rb_objspace`, read once: it lives as long as the VM. 0 when unreadable (then
    /// GC is simply not told apart).
    pub(super) fn objspace<M: Memory>(&mut self, t: &Target<M>) -> u64 {
        if let Some(o) = self.objspace {
            return o;
        }
        let o = t.main_objspace();
        self.objspace = Some(o);
        o
    }

    /// The sample's one call (see `plan_sample`).
    pub(super) fn read_sample<M: Memory>(
        t: &Target<M>,
        batch: &mut Batch,
    ) -> std::result::Result<(), MemoryError> {
        batch.called = Instant::now();
        batch.reads.read(&t.mem)?;
        for (head, t) in batch.heads.iter_mut().zip(&batch.threads) {
            if !t.head.is_empty() {
                head.copy_from_slice(batch.reads.get(t.head));
            }
        }
        Ok(())
    }

    /// Each thread's state from what the sample read, for the threads `which` wants and
    /// that have an execution context.
    pub(super) fn classify(
        &mut self,
        l: &Layout,
        batch: &Batch,
        which: ThreadSelection,
    ) -> Vec<(usize, ThreadState)> {
        let (status_byte, status_mask) = l.thread_status.unwrap_or((0, 0));
        self.last_owners.clear();
        let owners = batch.owners.iter().map(|o| word(batch.reads.get(*o), 0));
        self.last_owners.extend(owners);
        let runnable = l.thread_status_runnable << status_mask.trailing_zeros();
        let mut chosen = emptied(&mut self.chosen);
        let mut owners_listed = 0;
        for (i, listed) in self.threads.iter().enumerate() {
            let thread = &listed.thread;
            // Each Ractor has its own GVL: a thread runs when it holds its Ractor's.
            let owner = self.last_owners.get(listed.ractor).copied().unwrap_or(0);
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
                owners_listed += 1;
                // Its Ractor's GC flags say whether it is collecting.
                let flags = batch
                    .gc_flags
                    .get(listed.ractor)
                    .map(|s| batch.reads.get(*s));
                gc_state(
                    l,
                    flags
                        .and_then(|f| f.try_into().ok())
                        .map_or(0, u32::from_le_bytes),
                )
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
        let owners = self.last_owners.iter().filter(|&&o| o != 0).count();
        if owners_listed < owners {
            self.relist_for_unlisted_owner();
        } else {
            self.relisted_for = 0;
        }
        chosen
    }

    /// A GVL held by a thread the list does not have: one started since the list was read.
    /// Read it again at the next sample, not after LIST_TTL, or a thread shorter than that
    /// is sampled only if a reading happens to fall in its life. Not again for the same
    /// owner, nor within RELIST_MIN: an owner word that reads as something else (a forced
    /// layout that does not quite fit) would otherwise have the list read at every sample.
    fn relist_for_unlisted_owner(&mut self) {
        let unlisted = (self.last_owners.iter().enumerate())
            .find(|&(r, &o)| {
                o != 0 && !(self.threads.iter()).any(|t| t.ractor == r && t.thread == o)
            })
            .map_or(0, |(_, &o)| o);
        if unlisted != self.relisted_for && self.read_at.is_some_and(|t| t.elapsed() >= RELIST_MIN)
        {
            self.relisted_for = unlisted;
            self.read_at = None;
        }
    }

    /// Contexts that changed since last time (a fiber switch): one more call for their
    /// stack fields.
    pub(super) fn refresh_contexts<M: Memory>(
        &mut self,
        t: &Target<M>,
        batch: &mut Batch,
        chosen: &[(usize, ThreadState)],
    ) -> std::result::Result<(), MemoryError> {
        let l = t.layout;
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
        t.mem.read_many(&mut requests)?;
        for (i, h) in stale.into_iter().zip(fresh) {
            batch.heads[i] = h;
            let thread = self.threads[i].thread;
            self.ecs.insert(thread, batch.ec(i, l));
        }
        Ok(())
    }

    /// Where to read a thread's stack next time, along with the thread: from a little below
    /// where its frames are now to the end of its stack, and as much of the value stack as
    /// its frames used.
    pub(super) fn guess_stack(
        &mut self,
        l: &Layout,
        hints: &FxHashMap<u64, usize>,
        thread: u64,
        [vm_stack, vm_stack_size, cfp]: [u64; 3],
    ) {
        let cfp_size = l.cfp_size as u64;
        // `ec` is the context as first read, which a racing thread (an M:N thread moving to
        // another native thread) can have changed under the walk that succeeded: only a
        // context the walker would plan is kept (a size read mid-change once asked the next
        // sample's read for 756 TB).
        if frame_count(cfp_size, [vm_stack, vm_stack_size, cfp]).is_err() {
            self.stacks.remove(&thread);
            return;
        }
        let end = vm_stack
            .wrapping_add(vm_stack_size.wrapping_mul(8))
            .wrapping_sub(cfp_size);
        let from = cfp.saturating_sub(PREFETCH_FRAMES * cfp_size).max(vm_stack);
        let values = hints.get(&vm_stack).copied().unwrap_or(0);
        let values = values.min((from - vm_stack) as usize);
        if self.stacks.len() >= MAX_THREADS {
            self.stacks.clear();
        }
        self.stacks.insert(
            thread,
            StackGuess {
                vm_stack,
                from,
                end,
                values,
            },
        );
    }

    /// The sample's arena, kept for the next sample; and when its one call was made: the
    /// moment its states, tags and (mostly) stacks were read, the sample's time.
    pub(super) fn discard(&mut self, batch: Batch) -> Instant {
        self.reads = batch.reads;
        self.owner_spans = batch.owners;
        self.gc_flag_spans = batch.gc_flags;
        self.thread_reads = batch.threads;
        self.heads = batch.heads;
        batch.called
    }
}

/// One sample's reads (see `ThreadSampler::plan_sample`), all in one arena.
pub(super) struct Batch {
    pub(super) reads: ReadBatch,
    /// Every thread's span of its struct starts at this field offset.
    pub(super) span_from: usize,
    /// Each Ractor's GVL owner, in `ThreadSampler::ractors` order.
    pub(super) owners: Vec<Span>,
    /// Each Ractor's `rb_objspace.flags`, in `ThreadSampler::ractors` order (empty where
    /// the objspace is unknown).
    pub(super) gc_flags: Vec<Span>,
    pub(super) threads: Vec<ThreadReads>,
    /// The stack fields of each thread's context (`vm_stack`, its size, `cfp`): from the
    /// sample's call for the context it had last time, refreshed for one that changed.
    pub(super) heads: Vec<[u8; 24]>,
    /// When the one call began (see crate::context::ownership::TABLE_WINDOW).
    pub(super) called: Instant,
}

/// What one sample reads for one thread.
#[derive(Debug)]
pub(super) struct ThreadReads {
    /// The span of its `rb_thread_t` (see `Batch::span_from`).
    pub(super) fields: Span,
    /// The context it had last time (0: none yet), and that context's stack fields.
    pub(super) guessed: u64,
    pub(super) head: Span,
    pub(super) prefetch: Option<PrefetchSpans>,
    pub(super) tag: Option<TagRead>,
}

/// A thread's control frames and value stack, read with it where its stack was last time.
#[derive(Debug, Clone, Copy)]
pub(super) struct PrefetchSpans {
    pub(super) vm_stack: u64,
    pub(super) from: u64,
    pub(super) frames: Span,
    pub(super) values: Span,
}

impl Batch {
    /// Thread `i`'s bytes from struct offset `offset` on.
    pub(super) fn field(&self, i: usize, offset: usize) -> &[u8] {
        &self.reads.get(self.threads[i].fields)[offset - self.span_from..]
    }

    /// Thread `i`'s execution context as read.
    pub(super) fn ec(&self, i: usize, l: &Layout) -> u64 {
        word(self.field(i, l.thread_ec), 0)
    }

    /// Thread `i`'s native thread (`th->nt`) as read; 0 before 3.2, which has none.
    pub(super) fn nt(&self, i: usize, l: &Layout) -> u64 {
        l.thread_nt.map_or(0, |off| word(self.field(i, off), 0))
    }

    /// Whether thread `i`'s tag pointer was read apart from the batch, after its stack
    /// (`sampled_tags` reads it afresh when the batch's read was not this thread's).
    pub(super) fn tags_read_late(&self, i: usize, l: &Layout) -> bool {
        let Some(read) = self.threads[i].tag else {
            return false;
        };
        read.read_late(self.nt(i, l), &self.reads)
    }
}

#[cfg(test)]
mod tests {
    use super::super::leaves::MAX_FRAMES;
    use super::*;

    /// A context read while its thread moved (M:N threads) must not become the next sample's
    /// read: a wild size once asked the batch for 756 TB.
    #[test]
    fn a_context_the_walker_would_refuse_is_not_kept_as_a_guess() {
        let l = rbspy_ext_bindings::layout_for_version("3.1.2").expect("3.1.2's layout");
        let cfp_size = l.cfp_size as u64;
        let hints = FxHashMap::default();
        let mut sampler = ThreadSampler::default();
        let vm_stack = 0x7f00_0000_0000u64;
        let words = 128 * 1024; // Ruby's 1 MiB VM stack
        let end = vm_stack + words * 8 - cfp_size;
        let cfp = end - 10 * cfp_size;
        sampler.guess_stack(l, &hints, 1, [vm_stack, words, cfp]);
        let g = sampler.stacks[&1];
        assert!(g.end - g.from <= (PREFETCH_FRAMES + 10) * cfp_size);
        for wild in [
            [vm_stack, u64::MAX / 8, cfp],      // a size read mid-change
            [vm_stack, words, vm_stack - 8],    // below the stack
            [vm_stack, words, end + cfp_size],  // past its end: the span would wrap
            [0, words, cfp],                    // no stack
            [vm_stack, MAX_FRAMES * 2048, cfp], // more than the walker ever plans
        ] {
            sampler.guess_stack(l, &hints, 1, [vm_stack, words, cfp]);
            sampler.guess_stack(l, &hints, 1, wild);
            assert!(!sampler.stacks.contains_key(&1), "{wild:x?} kept");
        }
    }
}
