//! The walk: a thread's execution context → its control frames and environments → raw
//! frames, memoised by raw stack, with one batched read per step.
use super::attach::Target;
use super::cache::Cache;
use super::envs::Envs;
use super::envs::{slots, Slots};
use super::leaves::{
    Attempt, RawFrame, Stack, MAX_CACHED_ENVS, MAX_EP_DEPTH, MAX_FRAMES, MAX_VALUE_STACK,
    REVALIDATE,
};
use super::memo::StackMemo;
use crate::memory::word;
use crate::memory::{field, recycle, Memory, ReadBatch, Span};
use crate::model::Frame;
use crate::objects::is_heap_object;
use rustc_hash::FxHashMap;
use std::borrow::Cow;
use std::sync::Arc;

/// The one stack walker: what attaching found, the caches, the walk's own state and the
/// memo, lent by the spy for one walk (`Spy::walker`). Its steps are here (the execution
/// context, control frames and environments → raw frames), in frames.rs (raw frames →
/// iseqs and method entries → frames) and in zjit.rs (4.1's compiled frames).
pub(super) struct Walker<'a, M: Memory> {
    pub(super) target: &'a mut Target<M>,
    pub(super) cache: &'a mut Cache,
    pub(super) walk: &'a mut WalkState,
    pub(super) memo: &'a mut StackMemo,
}

/// The walker's state between samples.
#[derive(Debug, Default)]
pub(super) struct WalkState {
    /// The thread and execution context seen last, read speculatively in one call.
    pub(super) last_ec: Option<(u64, u64)>,
    /// Bytes of value stack the last sample of each stack needed, by `vm_stack` address
    /// (see `read_frames`).
    pub(super) stack_hints: FxHashMap<u64, usize>,
    /// Environments that escaped to the heap, by `ep` (see `env_slots`).
    pub(super) heap_envs: FxHashMap<u64, Slots>,
    /// The arena of the walker's own reads of frames, reused from sample to sample.
    pub(super) reads: ReadBatch,
    /// The raw frames of the stack being resolved, reused from stack to stack.
    pub(super) frames: Vec<RawFrame>,
    /// `walk_many`'s plans and buffers, and `Sampling::walk_chosen`'s contexts and
    /// prefetched bytes, reused likewise (see `recycle`).
    pub(super) plans: Vec<std::result::Result<Plan, Attempt>>,
    pub(super) bufs: Vec<FrameBuffers<'static>>,
    pub(super) contexts: Vec<[u64; 3]>,
    pub(super) prefetched: Vec<Option<Prefetched<'static>>>,
}

impl<M: Memory> Walker<'_, M> {
    /// Reads the current thread's execution context: one call that reads the GVL owner
    /// together with the last thread's `ec` field and that ec's stack fields.
    pub(super) fn current_ec(&mut self) -> std::result::Result<[u64; 3], Attempt> {
        let l = self.target.layout;
        let mut owner = [0u8; 8];
        let mut ec_field = [0u8; 8];
        let mut ec_head = [0u8; 24];
        if let Some((thread, ec)) = self.walk.last_ec {
            self.target
                .mem
                .read_many(&mut [
                    (self.target.gvl_owner, &mut owner[..]),
                    (field(thread, l.thread_ec), &mut ec_field[..]),
                    (field(ec, l.ec_vm_stack), &mut ec_head[..]),
                ])
                .map_err(self.target.moved("reading the GVL owner"))?;
            let owner = word(&owner, 0);
            let current = if owner == 0 {
                self.target.main_thread
            } else {
                owner
            };
            if current == thread && word(&ec_field, 0) == ec {
                return Ok(self.ec_fields(&ec_head));
            }
            return self.read_ec_of(current);
        }
        self.target
            .mem
            .read(self.target.gvl_owner, &mut owner)
            .map_err(self.target.moved("reading the GVL owner"))?;
        let owner = word(&owner, 0);
        self.read_ec_of(if owner == 0 {
            self.target.main_thread
        } else {
            owner
        })
    }

    pub(super) fn ec_fields(&self, head: &[u8]) -> [u64; 3] {
        let l = self.target.layout;
        let base = l.ec_vm_stack;
        [
            word(head, l.ec_vm_stack - base),
            word(head, l.ec_vm_stack_size - base),
            word(head, l.ec_cfp - base),
        ]
    }

    pub(super) fn read_ec_of(&mut self, thread: u64) -> std::result::Result<[u64; 3], Attempt> {
        let l = self.target.layout;
        let ec = self.target.read_word(
            thread,
            l.thread_ec,
            "reading the thread's execution context",
        )?;
        let mut head = [0u8; 24];
        self.target
            .mem
            .read(field(ec, l.ec_vm_stack), &mut head)
            .map_err(self.target.moved("reading the execution context"))?;
        self.walk.last_ec = Some((thread, ec));
        Ok(self.ec_fields(&head))
    }

    pub(super) fn try_snapshot(&mut self) -> std::result::Result<Stack, Attempt> {
        let ec = self.current_ec()?;
        self.walk(ec)
    }

    /// Drops the cached heap environments (one may have been freed and its address reused),
    /// and with them every memoized stack that relied on them.
    pub(super) fn forget_envs(&mut self) {
        self.walk.heap_envs.clear();
        self.memo.invalidate();
    }

    /// The frames of one execution context, given its `vm_stack`, `vm_stack_size`, `cfp`.
    pub(super) fn walk(&mut self, ec: [u64; 3]) -> std::result::Result<Stack, Attempt> {
        self.walk_many(&[ec], Vec::new())
            .pop()
            .expect("one result per context")
    }

    /// Where one execution context's control frames are.
    pub(super) fn plan(
        &self,
        [vm_stack, vm_stack_size, cfp]: [u64; 3],
    ) -> std::result::Result<Plan, Attempt> {
        let count = frame_count(
            self.target.layout.cfp_size as u64,
            [vm_stack, vm_stack_size, cfp],
        )
        .map_err(Attempt::Changed)?;
        let hint = self.walk.stack_hints.get(&vm_stack).copied().unwrap_or(0);
        Ok(Plan {
            vm_stack,
            cfp,
            count,
            guess: (hint as u64).min(cfp - vm_stack) as usize,
            values_from: vm_stack,
            captured: false,
        })
    }

    /// The frames of several execution contexts (the threads of one sample). One call reads
    /// every context's control frames and, with them, the used part of its value stack,
    /// where every running frame's environment (`ep[-2..=0]`) lives; the extent is guessed
    /// from the previous sample of that stack (a deeper stack costs one more read). A
    /// context whose frames were already read along with its thread (`prefetched`, see
    /// spy/batch.rs) costs no call at all.
    pub(super) fn walk_many(
        &mut self,
        ecs: &[[u64; 3]],
        prefetched: Vec<Option<Prefetched<'_>>>,
    ) -> Vec<std::result::Result<Stack, Attempt>> {
        let mut plans = std::mem::take(&mut self.walk.plans);
        plans.clear();
        plans.extend(ecs.iter().map(|ec| self.plan(*ec)));
        // The walker's own batch, out of `self` while its bytes are borrowed.
        let mut reads = std::mem::take(&mut self.walk.reads);
        reads.clear();
        let bufs = self.frame_buffers(&plans, prefetched, &mut reads);
        let results = self.read_frames(&plans, &bufs, &mut reads);
        let stacks = plans
            .drain(..)
            .zip(&bufs)
            .zip(results)
            .map(|((plan, buf), read)| match (read, plan) {
                (Ok(()), Ok(plan)) => {
                    self.resolve(plan, buf.cfps.bytes(&reads), buf.values.bytes(&reads))
                }
                (Err(e), _) | (_, Err(e)) => Err(e),
            })
            .collect();
        self.walk.reads = reads;
        self.walk.plans = plans;
        self.walk.bufs = recycle(bufs);
        stacks
    }

    /// Each planned stack's bytes: what `prefetched` already holds when the frames fit in
    /// it, else reads added to `reads` for `read_frames` to make.
    fn frame_buffers<'a>(
        &mut self,
        plans: &[std::result::Result<Plan, Attempt>],
        prefetched: Vec<Option<Prefetched<'a>>>,
        reads: &mut ReadBatch,
    ) -> Vec<FrameBuffers<'a>> {
        let cfp_size = self.target.layout.cfp_size;
        let mut prefetched = prefetched;
        prefetched.resize_with(plans.len(), || None);
        let mut bufs: Vec<FrameBuffers<'a>> = recycle(std::mem::take(&mut self.walk.bufs));
        for (p, pre) in plans.iter().zip(prefetched.drain(..)) {
            let Ok(p) = p else {
                bufs.push(FrameBuffers::done(&[], &[]));
                continue;
            };
            let want = p.count as usize * cfp_size;
            match pre {
                Some(pre)
                    if pre.vm_stack == p.vm_stack
                        && p.cfp >= pre.from
                        && usize::try_from(p.cfp - pre.from)
                            .ok()
                            .and_then(|skip| skip.checked_add(want))
                            .is_some_and(|end| end <= pre.frames.len()) =>
                {
                    let skip = (p.cfp - pre.from) as usize;
                    bufs.push(FrameBuffers::done(
                        &pre.frames[skip..skip + want],
                        pre.values,
                    ));
                }
                _ => bufs.push(FrameBuffers {
                    cfps: Bytes::Read(p.cfp, reads.add(p.cfp, want)),
                    values: Bytes::Read(p.vm_stack, reads.add(p.vm_stack, p.guess)),
                }),
            }
        }
        self.walk.prefetched = recycle(prefetched);
        bufs
    }

    /// One call for the frames and value stacks of every plan not read yet. When it fails
    /// (one stack moved or vanished), the others are read one by one so they still count.
    fn read_frames(
        &mut self,
        plans: &[std::result::Result<Plan, Attempt>],
        bufs: &[FrameBuffers<'_>],
        reads: &mut ReadBatch,
    ) -> Vec<std::result::Result<(), Attempt>> {
        let mut results: Vec<std::result::Result<(), Attempt>> =
            plans.iter().map(|_| Ok(())).collect();
        let Err(e) = reads.read(&self.target.mem) else {
            return results;
        };
        if plans.len() == 1 {
            results[0] = Err(self.target.moved("reading control frames")(e));
            return results;
        }
        for (buf, result) in bufs.iter().zip(results.iter_mut()) {
            let spans = buf.spans();
            if spans.is_empty() {
                continue;
            }
            if let Err(e) = reads.reread(&self.target.mem, &spans) {
                *result = Err(self.target.moved("reading control frames")(e));
            }
        }
        results
    }

    /// Turns one context's control frames and value stack into frames: from the memo when
    /// this raw stack was resolved before in the current epoch, otherwise by resolving it.
    pub(super) fn resolve(
        &mut self,
        plan: Plan,
        cfps: &[u8],
        values: &[u8],
    ) -> std::result::Result<Stack, Attempt> {
        // The walker's frame buffer, out of `self` while the walk borrows it (one allocation
        // kept from stack to stack: at 10 kHz a new one per stack showed in profiles).
        let mut frames = std::mem::take(&mut self.walk.frames);
        let result = self
            .raw_frames(plan, cfps, values, &mut frames)
            .and_then(|envs| self.resolve_raw(&frames, &envs));
        self.walk.frames = frames;
        result
    }

    pub(super) fn resolve_raw(
        &mut self,
        frames: &[RawFrame],
        envs: &Envs,
    ) -> std::result::Result<Stack, Attempt> {
        let due = self
            .cache
            .validated_at
            .is_none_or(|t| t.elapsed() >= REVALIDATE);
        self.memo.sign(frames, envs);
        if !due {
            if let Some(stack) = self.memo.get() {
                return Ok(stack);
            }
        }
        let resolved: Arc<[Frame]> = self.resolve_frames(frames, envs)?.into();
        // `resolve_frames` may have started a new epoch (a full validation).
        let epoch = self.memo.epoch();
        Ok(self.memo.remember(resolved, epoch))
    }

    /// The raw control frames of one context, and the value stack under them (read further
    /// when the frames' environments reach past what was read along with them).
    pub(super) fn raw_frames<'a>(
        &mut self,
        plan: Plan,
        cfps: &[u8],
        values: &'a [u8],
        frames: &mut Vec<RawFrame>,
    ) -> std::result::Result<Envs<'a>, Attempt> {
        let l = self.target.layout;
        let Plan {
            vm_stack,
            cfp,
            values_from: base,
            ..
        } = plan;
        frames.clear();
        frames.extend(cfps.chunks_exact(l.cfp_size).map(|c| RawFrame {
            pc: word(c, l.cfp_pc),
            iseq: word(c, l.cfp_iseq),
            ep: word(c, l.cfp_ep),
        }));
        self.zjit_frames(cfps, frames)?;
        // Checked: a garbage ep near the top of the address space must not wrap around
        // into a plausible (or enormous) length.
        let needed = frames
            .iter()
            .map(|f| f.ep)
            .filter(|ep| {
                *ep >= base.saturating_add(16) && ep.checked_add(8).is_some_and(|e| e <= cfp)
            })
            .map(|ep| (ep + 8 - base) as usize)
            .max()
            .unwrap_or(0);
        if needed > MAX_VALUE_STACK {
            return Err(Attempt::Changed(format!("a value stack of {needed} bytes")));
        }
        let values: Cow<'a, [u8]> = if needed > values.len() && plan.captured {
            // Read now, it would be another moment's stack.
            return Err(Attempt::Changed(
                "an environment above the captured value stack".into(),
            ));
        } else if needed > values.len() {
            // Deeper than read along with the frames: the rest, in a call of its own.
            let have = values.len();
            let mut more = values.to_vec();
            more.resize(needed, 0);
            self.target
                .mem
                .read(field(base, have), &mut more[have..])
                .map_err(self.target.moved("reading the value stack"))?;
            Cow::Owned(more)
        } else {
            Cow::Borrowed(values)
        };
        // Slack so that a slightly deeper stack next time still fits in one read.
        if self.walk.stack_hints.len() >= MAX_CACHED_ENVS {
            self.walk.stack_hints.clear();
        }
        if !plan.captured {
            self.walk
                .stack_hints
                .insert(vm_stack, needed + needed / 4 + 1024);
        }
        Ok(Envs {
            base,
            floor: vm_stack,
            values,
        })
    }

    /// Resolves raw frames into frames (labels, paths, lines), through the caches.
    pub(super) fn resolve_frames(
        &mut self,
        frames: &[RawFrame],
        envs: &Envs,
    ) -> std::result::Result<Vec<Frame>, Attempt> {
        let l = self.target.layout;
        // Which frames are reported, and the candidates for the method entry each needs (for
        // C functions: its name; for Ruby methods and their blocks: the owner's name).
        let mut wanted: Vec<Wanted> = Vec::new();
        for (i, f) in frames.iter().enumerate() {
            if f.iseq != 0 {
                if f.pc == 0 {
                    continue; // IFUNC and dummy frames: Ruby skips them too.
                }
                // An iseq not seen before may belong to a method: collect its chain too.
                let needs_owner = self.cache.iseqs.get(&f.iseq).is_none_or(|x| x.in_method);
                let chain = if needs_owner {
                    self.method_entry_chain(f.ep, envs)?
                } else {
                    Vec::new()
                };
                wanted.push(Wanted {
                    index: i,
                    cfunc: false,
                    chain,
                });
            } else {
                let s = self.env_slots(f.ep, envs)?;
                if s.flags & l.frame_magic_mask != l.frame_magic_cfunc {
                    continue;
                }
                let chain = self.method_entry_chain(f.ep, envs)?;
                wanted.push(Wanted {
                    index: i,
                    cfunc: true,
                    chain,
                });
            }
        }
        let mes = self.read_iseqs_and_method_entries(frames, &wanted)?;
        self.build_frames(frames, wanted, &mes)
    }

    /// The candidates for a frame's method entry, in Ruby's order
    /// (`rb_vm_frame_method_entry`): `ep[-2]` of each environment from the frame's own to the
    /// local one. The first that turns out to be an `imemo_ment` (crefs are skipped) is it;
    /// their headers are read in one batch afterwards.
    pub(super) fn method_entry_chain(
        &mut self,
        ep: u64,
        envs: &Envs,
    ) -> std::result::Result<Vec<u64>, Attempt> {
        let l = self.target.layout;
        let mut ep = ep;
        let mut chain = Vec::new();
        for _ in 0..MAX_EP_DEPTH {
            let s = self.env_slots(ep, envs)?;
            if is_heap_object(s.me_cref) {
                chain.push(s.me_cref);
            }
            if s.flags & l.env_flag_local != 0 {
                return Ok(chain);
            }
            ep = s.specval & !0x3;
        }
        Err(Attempt::Changed("environment chain too long".into()))
    }

    /// `ep[-2..=0]` of an environment: from the value stack copy, or from an environment
    /// that escaped to the heap (a method whose block became a Proc, a block called after
    /// its method returned). Escaped environments do not change, so they are cached; a
    /// failed attempt clears the cache in case one was freed and its address reused.
    pub(super) fn env_slots(
        &mut self,
        ep: u64,
        envs: &Envs,
    ) -> std::result::Result<Slots, Attempt> {
        if let Some(s) = envs.on_stack(ep) {
            return Ok(s);
        }
        // Slots that start below the copy, when it was cut short of the stack's start.
        if envs.base != envs.floor && ep >= envs.floor && ep < envs.base.saturating_add(16) {
            // On this stack but below what was copied of it (a captured stack whose value
            // stack was cut): read now it would be another moment's, and cached as if on
            // the heap it would outlive its frame.
            return Err(Attempt::Changed(
                "an environment below the copied value stack".into(),
            ));
        }
        if let Some(s) = self.walk.heap_envs.get(&ep) {
            return Ok(*s);
        }
        let mut buf = [0u8; 24];
        self.target
            .mem
            .read(ep.wrapping_sub(16), &mut buf)
            .map_err(self.target.moved("reading an environment"))?;
        let s = slots(&buf);
        if self.walk.heap_envs.len() >= MAX_CACHED_ENVS {
            self.forget_envs();
        }
        self.walk.heap_envs.insert(ep, s);
        Ok(s)
    }
}

/// Where one execution context's frames are (see `Spy::plan`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Plan {
    pub(super) vm_stack: u64,
    pub(super) cfp: u64,
    pub(super) count: u64,
    /// Bytes of value stack to read along with the frames.
    pub(super) guess: usize,
    /// Where the value stack given with the frames starts (`vm_stack` unless a captured
    /// copy was cut short).
    pub(super) values_from: u64,
    /// Frames and value stack captured in one pass by the BPF sampler (spy/captured.rs):
    /// nothing may be read later to complete them.
    pub(super) captured: bool,
}

/// A thread's control frames and value stack, read along with the thread on the guess that
/// its stack is where it was last time (see spy/batch.rs).
#[derive(Debug)]
pub(super) struct Prefetched<'a> {
    pub(super) vm_stack: u64,
    /// Address of `frames[0]`: somewhat below the last sample's `cfp`, so a stack a few
    /// frames deeper still fits.
    pub(super) from: u64,
    pub(super) frames: &'a [u8],
    pub(super) values: &'a [u8],
}

/// A frame to report and the candidates for its method entry.
pub(super) struct Wanted {
    pub(super) index: usize,
    pub(super) cfunc: bool,
    pub(super) chain: Vec<u64>,
}

/// One stack's control frames and value stack: read already (prefetched with its thread, or
/// nothing to read), or to be read at an address into the walker's batch.
#[derive(Debug)]
pub(super) struct FrameBuffers<'a> {
    cfps: Bytes<'a>,
    values: Bytes<'a>,
}

#[derive(Debug)]
enum Bytes<'a> {
    Done(&'a [u8]),
    Read(u64, Span),
}

impl<'a> Bytes<'a> {
    fn bytes<'b>(&'b self, reads: &'b ReadBatch) -> &'b [u8]
    where
        'a: 'b,
    {
        match self {
            Bytes::Done(b) => b,
            Bytes::Read(_, span) => reads.get(*span),
        }
    }
}

impl<'a> FrameBuffers<'a> {
    fn done(cfps: &'a [u8], values: &'a [u8]) -> Self {
        FrameBuffers {
            cfps: Bytes::Done(cfps),
            values: Bytes::Done(values),
        }
    }

    /// The reads this stack makes (none when done).
    fn spans(&self) -> Vec<(u64, Span)> {
        [&self.cfps, &self.values]
            .into_iter()
            .filter_map(|b| match b {
                Bytes::Read(addr, span) if !span.is_empty() => Some((*addr, *span)),
                _ => None,
            })
            .collect()
    }
}

/// How many control frames an execution context (`vm_stack`, `vm_stack_size`, `cfp`) holds
/// below its last slot, or why it cannot be a context: the one check both the walk's plan and
/// the next sample's read guess (batch.rs) make, so that no read spans more than MAX_FRAMES
/// frames or wraps. Control frames grow down from the end of the VM stack; the last slot is
/// a dummy frame that Ruby's own backtrace skips.
pub(super) fn frame_count(
    cfp_size: u64,
    [vm_stack, vm_stack_size, cfp]: [u64; 3],
) -> std::result::Result<u64, String> {
    let end = vm_stack.wrapping_add(vm_stack_size.wrapping_mul(8));
    let last = end.wrapping_sub(cfp_size);
    if vm_stack == 0
        || cfp_size == 0
        || vm_stack_size > MAX_FRAMES * 1024
        || cfp < vm_stack
        || cfp > last
        || (last - cfp) % cfp_size != 0
    {
        return Err(format!("control frame pointer {cfp:#x} outside its stack"));
    }
    let count = (last - cfp) / cfp_size;
    if count > MAX_FRAMES {
        return Err(format!("{count} frames"));
    }
    Ok(count)
}
