//! Every Ruby thread of the target, for the recorder: the thread list, each thread's
//! identity (native tid, `Thread#name`), its state, and its stack.
//!
//! A child module of `spy` so that it shares the walker's private machinery.
use super::tags::TagRead;
use super::{word, Attempt, Frame, Memory, Prefetched, Spy};
use crate::error::{Error, Result};
use crate::objects::{is_heap_object, read_string};
use crate::profile::{ThreadInfo, ThreadState};
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most threads followed along the thread list.
const MAX_THREADS: usize = 4096;
/// How long a thread list is trusted before it is read again (threads come and go).
const LIST_TTL: Duration = Duration::from_millis(100);
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
    /// The tags of the fiber the thread was running (spy_tags.rs).
    pub tags: super::Tags,
}

#[derive(Debug, Default)]
pub(super) struct ThreadList {
    threads: Vec<(u64, Arc<ThreadInfo>)>,
    read_at: Option<Instant>,
    /// The execution context each thread had when last sampled.
    ecs: FxHashMap<u64, u64>,
    /// Where each thread's stack was when last sampled (see `guess_stack`).
    stacks: FxHashMap<u64, StackGuess>,
    /// The thread that held the GVL at the last sample.
    last_owner: u64,
    /// The GC's `rb_objspace` (read once: it lives as long as the VM).
    objspace: Option<u64>,
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
    /// Follows the thread list (`vm->living_threads` or `ractor->threads.set`).
    fn read_thread_list(&mut self) -> std::result::Result<(), Attempt> {
        let l = self.layout;
        let node_offset = l.thread_list_node as u64;
        let head = self.thread_list_head;
        let mut node = self
            .mem
            .read_u64(head)
            .map_err(self.moved("reading the thread list"))?;
        let mut threads = Vec::new();
        while node != head {
            if threads.len() >= MAX_THREADS || !is_heap_object(node) {
                return Err(Attempt::Changed("thread list does not close".into()));
            }
            let thread = node - node_offset;
            threads.push((thread, Arc::new(self.thread_info(thread)?)));
            node = self
                .mem
                .read_u64(node)
                .map_err(self.moved("reading the thread list"))?;
        }
        self.thread_list.threads = threads;
        self.thread_list.read_at = Some(Instant::now());
        Ok(())
    }

    fn thread_info(&self, thread: u64) -> std::result::Result<ThreadInfo, Attempt> {
        let l = self.layout;
        let name_value = self
            .mem
            .read_u64(thread.wrapping_add(l.thread_name as u64))
            .map_err(self.moved("reading a thread"))?;
        let name = if is_heap_object(name_value) {
            read_string(&self.mem, l, name_value).ok()
        } else {
            None
        };
        let tid_addr = match (l.thread_tid, l.thread_nt, l.native_thread_tid) {
            (Some(off), _, _) => Some(thread.wrapping_add(off as u64)),
            (None, Some(nt), Some(off)) => {
                let nt = self
                    .mem
                    .read_u64(thread.wrapping_add(nt as u64))
                    .unwrap_or(0);
                is_heap_object(nt).then_some(nt.wrapping_add(off as u64))
            }
            _ => None,
        };
        let tid = tid_addr
            .and_then(|a| {
                let mut b = [0u8; 4];
                self.mem
                    .read(a, &mut b)
                    .ok()
                    .map(|_| i32::from_le_bytes(b) as i64)
            })
            .unwrap_or(0);
        Ok(ThreadInfo {
            pid: self.pid,
            tid,
            name,
            ruby_thread: thread,
            main: thread == self.main_thread,
        })
    }

    /// The Ruby threads of the target, as last read (re-read when older than 100 ms).
    pub fn threads(&mut self) -> Result<Vec<ThreadInfo>> {
        self.fresh_thread_list()?;
        Ok(self
            .thread_list
            .threads
            .iter()
            .map(|(_, i)| ThreadInfo::clone(i))
            .collect())
    }

    fn fresh_thread_list(&mut self) -> Result<()> {
        let stale = self
            .thread_list
            .read_at
            .is_none_or(|t| t.elapsed() >= LIST_TTL);
        if !stale {
            return Ok(());
        }
        for _ in 0..super::SNAPSHOT_ATTEMPTS {
            match self.read_thread_list() {
                Ok(()) => return Ok(()),
                Err(Attempt::Fatal(e)) => return Err(e),
                Err(Attempt::Changed(_)) => {}
            }
        }
        Err(Error::StackChanged {
            pid: self.pid,
            attempts: super::SNAPSHOT_ATTEMPTS,
            last: "the thread list kept changing".into(),
        })
    }

    /// Where to read a thread's stack next time, along with the thread: from a little below
    /// where its frames are now to the end of its stack, and as much of the value stack as
    /// its frames used.
    fn guess_stack(&mut self, thread: u64, [vm_stack, vm_stack_size, cfp]: [u64; 3]) {
        let cfp_size = self.layout.cfp_size as u64;
        let end = vm_stack + vm_stack_size * 8 - cfp_size;
        let from = cfp.saturating_sub(PREFETCH_FRAMES * cfp_size).max(vm_stack);
        let values = self.stack_hints.get(&vm_stack).copied().unwrap_or(0);
        let values = values.min((from - vm_stack) as usize);
        if self.thread_list.stacks.len() >= MAX_THREADS {
            self.thread_list.stacks.clear();
        }
        self.thread_list.stacks.insert(
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
        self.thread_list.read_at = None;
        self.thread_list.ecs.clear();
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
        let l = self.layout;
        let (status_byte, status_mask) = l.thread_status.unwrap_or((0, 0));
        let count = self.thread_list.threads.len();
        // One call: the GVL owner, and for every thread its execution context and status (one
        // range of the thread struct), the stack fields of the context it had last time (a
        // thread's context changes only when it switches fibers), and, on the guess that its
        // stack is about where it was, its control frames and value stack. In the steady state
        // this one call is the whole sample.
        let fields = [
            l.thread_ec,
            status_byte,
            l.thread_gvl_wait_node,
            l.thread_unblock_func.unwrap_or(l.thread_ec),
            // The native thread, whose thread pointer leads to the tags (3.2+).
            l.thread_nt.unwrap_or(l.thread_ec),
        ];
        let span_from = fields.iter().copied().min().unwrap_or(0);
        let span = fields.iter().copied().max().unwrap_or(0) + 8 - span_from;
        let objspace = match self.thread_list.objspace {
            Some(o) => o,
            None => {
                let o = self
                    .mem
                    .read_u64(self.vm.wrapping_add(l.vm_objspace as u64))
                    .unwrap_or(0); // without it, GC is simply not told apart
                self.thread_list.objspace = Some(o);
                o
            }
        };
        let mut gc_flags = [0u8; 4];
        let mut owner = [0u8; 8];
        let mut spans = vec![0u8; count * span];
        let mut heads = vec![[0u8; 24]; count];
        let guessed: Vec<u64> = self
            .thread_list
            .threads
            .iter()
            .map(|(t, _)| self.thread_list.ecs.get(t).copied().unwrap_or(0))
            .collect();
        let mut prefetched: Vec<Option<Prefetched>> = Vec::with_capacity(count);
        // Each wanted thread's tags pointer, and the table it pointed at last time: in the
        // steady state (tags unchanged) that is all the tags need.
        let mut tag_reads: Vec<Option<TagRead>> = Vec::with_capacity(count);
        let tag_offset = self.profiler_state_offset();
        for i in 0..count {
            let thread = self.thread_list.threads[i].0;
            let wanted = which == ThreadSelection::All || thread == self.thread_list.last_owner;
            tag_reads.push(match tag_offset {
                Some(offset) if wanted => Some(self.tag_read(thread, offset)),
                _ => None,
            });
            let pre = match self.thread_list.stacks.get(&thread).copied() {
                Some(g) if wanted => Some(Prefetched {
                    vm_stack: g.vm_stack,
                    from: g.from,
                    frames: self.buffer((g.end - g.from) as usize),
                    values: self.buffer(g.values),
                }),
                _ => None,
            };
            prefetched.push(pre);
        }
        // When the call reading the tag pointers began (see spy_tags.rs, TABLE_WINDOW).
        let called;
        {
            let mut requests: Vec<(u64, &mut [u8])> = vec![(self.gvl_owner, &mut owner[..])];
            if is_heap_object(objspace) {
                requests.push((
                    objspace.wrapping_add(l.objspace_flags as u64),
                    &mut gc_flags[..],
                ));
            }
            for ((((thread, _), span_buf), (head, guess)), (pre, tag)) in self
                .thread_list
                .threads
                .iter()
                .zip(spans.chunks_exact_mut(span))
                .zip(heads.iter_mut().zip(&guessed))
                .zip(prefetched.iter_mut().zip(tag_reads.iter_mut()))
            {
                if let Some(tag) = tag {
                    // The owner before the pointer: see profiler_state.c.
                    if let Some(owner_slot) = tag.owner_slot {
                        requests.push((owner_slot, &mut tag.owner[..]));
                    }
                    if let Some(slot) = tag.slot {
                        requests.push((slot, &mut tag.pointer[..]));
                    }
                    if let Some((table, bytes)) = &mut tag.last {
                        requests.push((*table, &mut bytes[..]));
                    }
                }
                requests.push((thread.wrapping_add(span_from as u64), span_buf));
                if *guess != 0 {
                    requests.push((guess.wrapping_add(l.ec_vm_stack as u64), &mut head[..]));
                }
                if let Some(pre) = pre {
                    requests.push((pre.from, &mut pre.frames[..]));
                    if !pre.values.is_empty() {
                        requests.push((pre.vm_stack, &mut pre.values[..]));
                    }
                }
            }
            called = Instant::now();
            if let Err(e) = self.mem.read_many(&mut requests) {
                for pre in prefetched.into_iter().flatten() {
                    self.recycle(pre.frames);
                    self.recycle(pre.values);
                }
                for (_, bytes) in tag_reads.into_iter().flatten().filter_map(|t| t.last) {
                    self.recycle(bytes);
                }
                // A stack may have moved away from where it was, a table may have been
                // freed: guess afresh next time.
                self.thread_list.stacks.clear();
                self.forget_tag_tables();
                return self.thread_list_changed("reading threads", e);
            }
        }
        let field = |i: usize, offset: usize| &spans[i * span + offset - span_from..];
        let ecs: Vec<u64> = (0..count).map(|i| word(field(i, l.thread_ec), 0)).collect();
        let statuses: Vec<u8> = (0..count).map(|i| field(i, status_byte)[0]).collect();
        let owner = word(&owner, 0);
        self.thread_list.last_owner = owner;
        let runnable = l.thread_status_runnable << status_mask.trailing_zeros();
        let holder_state = gc_state(u32::from_le_bytes(gc_flags));
        let mut chosen: Vec<(usize, ThreadState)> = Vec::new();
        for (i, (thread, _)) in self.thread_list.threads.iter().enumerate() {
            let status = statuses[i] & status_mask;
            // Queued for the GVL: its node is linked (not null, not pointing at itself).
            // Before 3.3 the node doubles as the ubf-list node of a thread blocked in a
            // blocking region, which has an unblocking function set; one queued has none.
            let node = word(field(i, l.thread_gvl_wait_node), 0);
            let queued = node != 0
                && node != thread.wrapping_add(l.thread_gvl_wait_node as u64)
                && l.thread_unblock_func
                    .is_none_or(|f| word(field(i, f), 0) == 0);
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
            if !is_heap_object(ecs[i]) {
                continue; // a thread not started yet, or already gone
            }
            chosen.push((i, state));
        }
        // Contexts that changed since last time: one more call for their stack fields.
        let stale: Vec<usize> = chosen
            .iter()
            .map(|(i, _)| *i)
            .filter(|i| ecs[*i] != guessed[*i])
            .collect();
        if !stale.is_empty() {
            let mut fresh = vec![[0u8; 24]; stale.len()];
            {
                let mut requests: Vec<(u64, &mut [u8])> = stale
                    .iter()
                    .zip(fresh.iter_mut())
                    .map(|(i, h)| (ecs[*i] + l.ec_vm_stack as u64, &mut h[..]))
                    .collect();
                if let Err(e) = self.mem.read_many(&mut requests) {
                    return self.thread_list_changed("reading execution contexts", e);
                }
            }
            for (i, h) in stale.into_iter().zip(fresh) {
                heads[i] = h;
                let thread = self.thread_list.threads[i].0;
                self.thread_list.ecs.insert(thread, ecs[i]);
            }
        }
        // A thread that has not started running Ruby yet, or has finished, has no VM stack
        // (null `vm_stack` and `cfp`): it has nothing to sample, which is not a dropped sample.
        chosen.retain(|(i, _)| self.ec_fields(&heads[*i])[0] != 0);
        // One call for every chosen thread's frames; a thread whose stack moved is retried
        // alone, then counted as dropped.
        let contexts: Vec<[u64; 3]> = chosen
            .iter()
            .map(|(i, _)| self.ec_fields(&heads[*i]))
            .collect();
        let pre: Vec<Option<Prefetched>> =
            chosen.iter().map(|(i, _)| prefetched[*i].take()).collect();
        for unused in prefetched.into_iter().flatten() {
            self.recycle(unused.frames);
            self.recycle(unused.values);
        }
        let results = self.walk_many(&contexts, pre);
        let mut sampled = Vec::with_capacity(chosen.len());
        let mut failed = Vec::new();
        for (((i, state), ec), first) in chosen.into_iter().zip(contexts).zip(results) {
            let mut result = match first {
                Ok(stack) => Some(stack),
                Err(Attempt::Fatal(e)) => return Err(e),
                Err(Attempt::Changed(_)) => None,
            };
            for _ in 1..THREAD_ATTEMPTS {
                if result.is_some() {
                    break;
                }
                self.forget_envs();
                match self.walk(ec) {
                    Ok(stack) => result = Some(stack),
                    Err(Attempt::Fatal(e)) => return Err(e),
                    Err(Attempt::Changed(_)) => {}
                }
            }
            let thread = self.thread_list.threads[i].0;
            match &result {
                Some(_) => self.guess_stack(thread, ec),
                None => {
                    self.thread_list.stacks.remove(&thread);
                }
            }
            match result {
                Some(stack) => {
                    // Tags only for a sample that is kept: a dropped one decodes nothing.
                    let tags = match tag_reads[i].take() {
                        Some(read) => {
                            let nt = l.thread_nt.map_or(0, |off| word(field(i, off), 0));
                            self.sampled_tags(thread, nt, read, called)
                        }
                        None => super::Tags::default(),
                    };
                    sampled.push(SampledThread {
                        info: self.thread_list.threads[i].1.clone(),
                        state,
                        frames: stack.frames,
                        stack_token: stack.token,
                        tags,
                    })
                }
                None => failed.push(thread),
            }
        }
        for (_, bytes) in tag_reads.into_iter().flatten().filter_map(|t| t.last) {
            self.recycle(bytes);
        }
        // The thread list is re-read every LIST_TTL, so a thread that ended since is still in
        // it, and its freed memory may hold anything by now. A thread whose stack did not read
        // is dropped only if a fresh list still has it; one that ended had nothing to sample.
        let mut dropped = Vec::new();
        if !failed.is_empty() {
            self.thread_list.read_at = None;
            self.fresh_thread_list()?;
            for thread in failed {
                if self.thread_list.threads.iter().any(|(t, _)| *t == thread) {
                    dropped.push("stack changed while read");
                }
            }
        }
        Ok((sampled, dropped))
    }
}
