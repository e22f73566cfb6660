//! Stacks captured elsewhere: the BPF sampler (crate::bpf) copies a thread's control
//! frames, value stack, GVL owner, GC flags and tag table in one pass on the CPU the thread
//! ran on, and this turns that copy into a [`SampledThread`] through the same walker,
//! caches and memo as a snapshot. Only what describes code (iseqs, method entries, names) is
//! read from the target afterwards; nothing of the thread's own state is.
//!
//! A child module of `spy` so that it shares the walker's private machinery; the sampler
//! reaches it through [`Spy::capture`].
use super::batch::gc_state;
use super::leaves::Attempt;
use super::sample::Sampling;
use super::tags::Decoder;
use super::traces::{record_labels, with_labels};
use super::walker::Plan;
use crate::context::otel_thread::Drop;
use crate::context::ownership::copy_trusted;
use crate::context::profiler_state;
use crate::error::Result;
use crate::memory::{word, Memory};
use crate::model::{Dropped, Frame, SampledThread, Tags, ThreadInfo, ThreadState};
use crate::objects::is_heap_object;
use std::sync::Arc;

/// One thread at one tick, as the BPF sampler copied it (crate::bpf::record).
#[derive(Debug, Clone, Copy)]
pub struct Captured<'a> {
    /// The `rb_thread_t *` the sampler's thread map gave for the interrupted native thread.
    pub thread: u64,
    /// `ec->vm_stack`, `ec->vm_stack_size`, `ec->cfp`.
    pub head: [u64; 3],
    pub gvl_owner: u64,
    pub gc_flags: u32,
    /// Control frames from `cfp` outwards.
    pub frames: &'a [u8],
    /// The value stack from `values_from`.
    pub values_from: u64,
    pub values: &'a [u8],
    /// The thread's `ruby_profiler_state` table (0: none) and its words as copied (empty
    /// when it was not copied).
    pub tag_table: u64,
    pub tag_words: &'a [u8],
    /// The thread's OpenTelemetry record (`otel_thread_ctx_v1`, 0: none) and its bytes as
    /// copied; `otel_unread` when it had one that did not read whole.
    pub otel_record: u64,
    pub otel_bytes: &'a [u8],
    pub otel_unread: bool,
    /// The stack was deeper than the sampler copies: its outermost frames are missing.
    pub truncated: bool,
    /// How long ago it was copied.
    pub age: std::time::Duration,
}

/// What the BPF sampler needs of the target's layout and addresses, loaded into the
/// program as read-only globals (core/bpf/sampler.bpf.c).
#[derive(Debug, Clone, Copy)]
pub struct CaptureLayout {
    pub thread_ec: u64,
    /// `th->nt` and the native thread's `thread_id` (its pthread_t, the thread pointer), 0
    /// before 3.2: a thread the program's map names must still run on the native thread
    /// ticked (M:N threads move).
    pub thread_nt: u64,
    pub nt_thread_id: u64,
    pub ec_vm_stack: u64,
    pub cfp_size: u64,
    pub cfp_sp: u64,
    pub cfp_ep: u64,
    pub gvl_owner: u64,
    /// `&rb_objspace.flags`, 0 when not known.
    pub gc_flags: u64,
    /// The offset of `ruby_profiler_state` from the thread pointer, once rbspy_ext is
    /// loaded in the target.
    pub tag_offset: Option<i64>,
    /// The offset of `ruby_profiler_state_owner`, when the extension publishes it.
    pub tag_owner_offset: Option<i64>,
    /// The offset of `otel_thread_ctx_v1` (OpenTelemetry's thread context), when the
    /// extension publishes it.
    pub otel_offset: Option<i64>,
    /// Under M:N threads, the offset of Ruby's `ruby_current_ec` from the thread pointer
    /// (`Capture::ec_tls`), and `ec->thread_ptr`: the program then finds the Ruby
    /// thread a native thread runs through that thread-local, and its thread map is keyed
    /// by `rb_thread_t *`. None: by thread pointer.
    pub ec_tls: Option<(i64, u64)>,
}

/// A Ruby thread as the BPF sampler finds it.
#[derive(Debug, Clone)]
pub struct CaptureThread {
    /// Its `rb_thread_t *`.
    pub thread: u64,
    pub info: Arc<ThreadInfo>,
    /// Its thread pointer (glibc's `pthread_t`), what the program finds it by, when known.
    pub thread_pointer: Option<u64>,
    /// Address of the word naming the thread that holds its Ractor's GVL.
    pub gvl_owner: u64,
}

/// The frame that ends a stack the sampler had to cut.
pub const TRUNCATED_LABEL: &str = "[truncated]";

/// The BPF sampler's side of a spy (`Spy::capture`): what it needs to capture stacks in
/// the kernel, and the captures turned into samples through the spy's walker, caches, thread
/// list and tag reader.
pub struct Capture<'a, M: Memory> {
    pub(super) spy: Sampling<'a, M>,
}

impl<M: Memory> Capture<'_, M> {
    /// The target's layout and addresses as the BPF sampler needs them.
    pub fn layout(&mut self) -> CaptureLayout {
        let l = self.spy.target.layout;
        let objspace = self.spy.sampler.objspace(self.spy.target);
        let (thread_nt, nt_thread_id) = match (l.thread_nt, l.native_thread_pthread) {
            (Some(nt), Some(id)) => (nt as u64, id as u64),
            _ => (0, 0),
        };
        CaptureLayout {
            thread_ec: l.thread_ec as u64,
            thread_nt,
            nt_thread_id,
            ec_vm_stack: l.ec_vm_stack as u64,
            cfp_size: l.cfp_size as u64,
            cfp_sp: l.cfp_sp as u64,
            cfp_ep: l.cfp_ep as u64,
            gvl_owner: self.spy.target.gvl_owner,
            gc_flags: if crate::objects::is_heap_object(objspace) {
                crate::memory::field(objspace, l.objspace_flags)
            } else {
                0
            },
            tag_offset: self.spy.tags.offset(self.spy.target),
            tag_owner_offset: self.spy.tags.owner_offset,
            otel_offset: self.spy.tags.otel_offset,
            ec_tls: None,
        }
    }

    /// The offset of Ruby's `ruby_current_ec` thread-local from the thread pointer (and
    /// `ec->thread_ptr`, the rest of what `CaptureLayout::ec_tls` needs): the word within
    /// 16 KiB below a native thread's thread pointer (where x86-64 keeps the static TLS of the
    /// executable and of the libraries loaded with it) that holds the execution context of a
    /// Ruby thread, at the same offset on every native thread read. Under M:N threads a
    /// native thread runs whichever Ruby thread's turn it is, and one that is idle may hold
    /// none, so every Ruby thread's native thread is read and votes for the offsets it holds
    /// a context at; the offset with the most votes wins, if no other has as many. Read up to
    /// ten times, a millisecond apart. None when no offset wins (libruby's TLS is dynamic).
    pub fn ec_tls(&mut self) -> Option<(i64, u64)> {
        const WINDOW: u64 = 16 << 10;
        const PAGE: u64 = 4096;
        for attempt in 0..10 {
            if attempt > 0 {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            let (ecs, pointers) = self.thread_ecs();
            let t = &*self.spy.target;
            let mut votes: std::collections::BTreeMap<i64, usize> = Default::default();
            // Page by page: the static TLS may start within the window, after memory that is
            // not mapped, and one failed read must not hide the pages that are.
            for tp in pointers {
                // From the thread pointer's own page (mapped: the thread's TCB is there) down,
                // a page at a time, until a page does not read.
                let top = tp & !(PAGE - 1);
                let mut chunks = vec![(top, tp - top)];
                chunks.extend((1..=WINDOW / PAGE).map(|k| (top.wrapping_sub(k * PAGE), PAGE)));
                for (start, len) in chunks.into_iter().filter(|(_, len)| *len > 0) {
                    let Ok(words) = t.mem.read_vec(start, len as usize) else {
                        break;
                    };
                    let offsets = (words.chunks_exact(8).enumerate())
                        .filter(|(_, w)| ecs.contains(&word(w, 0)))
                        .map(|(i, _)| (start + i as u64 * 8) as i64 - tp as i64);
                    for offset in offsets {
                        *votes.entry(offset).or_default() += 1;
                    }
                }
            }
            let best = votes.values().copied().max().unwrap_or(0);
            let mut winners = votes.iter().filter(|(_, &n)| n == best && n > 0);
            if let (Some((&offset, _)), None) = (winners.next(), winners.next()) {
                return Some((offset, t.layout.ec_thread_ptr as u64));
            }
        }
        None
    }

    /// The execution contexts of the Ruby threads now (those that read), and the distinct
    /// thread pointers of the native threads they run on (the main thread's first).
    fn thread_ecs(&mut self) -> (Vec<u64>, Vec<u64>) {
        let main = self.spy.target.main_thread;
        let mut threads = vec![main];
        if self.spy.sampler.fresh_thread_list(self.spy.target).is_ok() {
            threads.extend(self.spy.sampler.threads.iter().map(|l| l.thread));
        }
        let t = &*self.spy.target;
        let ecs = (threads.iter())
            .filter_map(|&th| {
                t.mem
                    .read_u64(crate::memory::field(th, t.layout.thread_ec))
                    .ok()
            })
            .filter(|&ec| ec != 0)
            .collect();
        let mut pointers: Vec<u64> = Vec::new();
        for th in threads.into_iter().take(64) {
            if let Some(tp) = self.spy.tags.thread_pointer(self.spy.target, th) {
                if tp != 0 && !pointers.contains(&tp) {
                    pointers.push(tp);
                }
            }
        }
        (ecs, pointers)
    }

    /// The Ruby threads of every Ractor as last read (re-read when older than 100 ms).
    pub fn threads(&mut self) -> Result<Vec<CaptureThread>> {
        self.spy.sampler.fresh_thread_list(self.spy.target)?;
        let threads = self.spy.sampler.threads.clone();
        Ok(threads
            .into_iter()
            .map(|t| CaptureThread {
                thread_pointer: self.spy.tags.thread_pointer(self.spy.target, t.thread),
                gvl_owner: self
                    .spy
                    .sampler
                    .ractors
                    .get(t.ractor)
                    .map_or(0, |r| r.owner),
                thread: t.thread,
                info: t.info,
            })
            .collect())
    }

    /// One captured thread as a sample: its state from the GVL owner and GC flags copied
    /// with it, its frames through the walker, its tags decoded from the copied table.
    /// `Ok(None)` for a thread with no Ruby stack yet (or any more), which is not a dropped
    /// sample; `Err` gives why it could not be resolved (a drop reason, as `Spy::sample`
    /// has).
    pub fn resolve(
        &mut self,
        info: Arc<ThreadInfo>,
        c: &Captured,
    ) -> std::result::Result<Option<SampledThread>, Dropped> {
        let state = if c.thread == c.gvl_owner {
            gc_state(self.spy.target.layout, c.gc_flags)
        } else {
            ThreadState::NoGvl
        };
        let [vm_stack, _, cfp] = c.head;
        let cfp_size = self.spy.target.layout.cfp_size;
        if vm_stack == 0 || c.frames.is_empty() {
            return Ok(None);
        }
        if c.values.is_empty() {
            return Err(Dropped::ValueStackUnread);
        }
        // A value stack longer than the copy: the frames whose environments lie below it
        // are cut, like frames past the depth cap.
        let cut = c.values_from > vm_stack;
        let whole = c.frames.len() - c.frames.len() % cfp_size;
        let usable = if cut {
            self.frames_with_values(c)
        } else {
            whole
        };
        if usable == 0 {
            return Err(Dropped::ValueStackDeeper);
        }
        let plan = Plan {
            vm_stack,
            cfp,
            count: (usable / cfp_size) as u64,
            guess: 0,
            values_from: c.values_from,
            captured: true,
        };
        let stack = match self
            .spy
            .walker()
            .resolve(plan, &c.frames[..usable], c.values)
        {
            Ok(stack) => stack,
            Err(Attempt::Fatal(_)) => return Err(Dropped::ReadFailed),
            Err(Attempt::Changed(_)) if cut => {
                // A block reaching an environment below the copy: nothing cached is in doubt.
                return Err(Dropped::ValueStackDeeper);
            }
            Err(Attempt::Changed(_)) => {
                // Something cached may be what no longer holds (an escaped environment).
                self.spy.walker().forget_envs();
                self.spy.cache.validated_at = None;
                return Err(Dropped::CapturedUnresolved);
            }
        };
        let (frames, token) = if c.truncated || usable < whole {
            let mut frames = stack.frames.to_vec();
            frames.push(truncated_frame());
            // Tokens are counted up from 1; the top bit names the cut variant of a stack.
            (frames.into(), stack.token | 1 << 63)
        } else {
            (stack.frames, stack.token)
        };
        let tags = self.tags(c);
        Ok(Some(SampledThread {
            info,
            state,
            frames,
            stack_token: token,
            tags,
        }))
    }

    /// Bytes of `c.frames` whose environments lie in the copied value stack or off the
    /// stack (escaped to the heap), innermost first: the frames a cut copy can resolve.
    fn frames_with_values(&self, c: &Captured) -> usize {
        let l = self.spy.target.layout;
        let below = c.head[0]..c.values_from.saturating_add(16);
        c.frames
            .chunks_exact(l.cfp_size)
            .take_while(|f| !below.contains(&word(f, l.cfp_ep)))
            .count()
            * l.cfp_size
    }

    /// Whether the thread publishes the copied table now, with the same words: then the
    /// objects it holds are alive (a freed table's address may hold a new one).
    fn still_published(&mut self, c: &Captured) -> bool {
        let Some((table, words)) = self.spy.tags.published_table(self.spy.target, c.thread) else {
            return false;
        };
        *table == c.tag_table && words.as_slice() == c.tag_words
    }

    /// Starts a batch of captured samples (one drain of the BPF sampler's ring): which table
    /// each thread publishes is read again, once, when a sample needs it.
    pub fn begin_batch(&mut self) {
        self.spy.tags.published_now.clear();
    }

    /// Captured samples whose tags were left out because their table's values may have been
    /// freed before they were read (see `Capture::tags`).
    pub fn tags_expired(&self) -> u64 {
        self.spy.tags.expired
    }

    /// The tags of a captured table, and the labels of its OpenTelemetry record, which the
    /// sampler copied whole (no later read, so no lifetime to mind). The table's words (IDs and VALUEs) were copied in the same pass
    /// as the stack, but what an object value says (a String's text) is read now, up to a
    /// drain period later. The extension keeps a table's values alive only while it is
    /// published and 10 ms after: so a table with object values is decoded only within
    /// `crate::context::ownership::TABLE_WINDOW` of its copy, or while its thread still publishes it; otherwise the
    /// sample gets no tags (counted), never the text of whatever took the freed object's
    /// place. Immediates (Integers, static Symbols, true, false, nil) need no such care.
    fn tags(&mut self, c: &Captured) -> Tags {
        let tags = self.table_tags(c);
        let labels = match (c.otel_record, c.otel_unread) {
            (0, _) => return tags,
            (_, true) => Err(Drop::Unreadable),
            _ => record_labels(c.otel_bytes),
        };
        match labels {
            Ok(labels) => with_labels(tags, &labels),
            Err(reason) => {
                self.spy.tags.otel_drops.add(reason);
                tags
            }
        }
    }

    /// The tags of a captured `ruby_profiler_state` table (see `tags`).
    fn table_tags(&mut self, c: &Captured) -> Tags {
        // One empty set for every sample without tags (a new Arc would be an allocation).
        static NONE: std::sync::LazyLock<Tags> = std::sync::LazyLock::new(Default::default);
        let Some(pairs) = profiler_state::pairs(c.tag_words).filter(|_| c.tag_table != 0) else {
            return NONE.clone();
        };
        let objects = pairs.into_iter().any(|(_, value)| is_heap_object(value));
        if objects && !copy_trusted(c.age) && !self.still_published(c) {
            self.spy.tags.expired += 1;
            return NONE.clone();
        }
        let mut d = Decoder {
            target: self.spy.target,
            cache: self.spy.cache,
        };
        d.decode(c.tag_words).unwrap_or_default()
    }
}

fn truncated_frame() -> Frame {
    let label: Arc<str> = TRUNCATED_LABEL.into();
    Frame {
        label: label.clone(),
        base_label: label,
        path: "".into(),
        absolute_path: None,
        lineno: 0,
        c_function: false,
    }
}
