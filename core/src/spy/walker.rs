//! The walk: a thread's execution context → its control frames and environments → raw
//! frames, memoised by raw stack, with one batched read per step.
use super::*;
use crate::memory::Memory;
use crate::objects::word;
use std::sync::Arc;

impl<M: Memory> Spy<M> {
    /// Reads the current thread's execution context: one call that reads the GVL owner
    /// together with the last thread's `ec` field and that ec's stack fields.
    pub(super) fn current_ec(&mut self) -> std::result::Result<[u64; 3], Attempt> {
        let l = self.layout;
        let mut owner = [0u8; 8];
        let mut ec_field = [0u8; 8];
        let mut ec_head = [0u8; 24];
        if let Some((thread, ec)) = self.last_ec {
            self.mem
                .read_many(&mut [
                    (self.gvl_owner, &mut owner[..]),
                    (thread.wrapping_add(l.thread_ec as u64), &mut ec_field[..]),
                    (ec.wrapping_add(l.ec_vm_stack as u64), &mut ec_head[..]),
                ])
                .map_err(self.moved("reading the GVL owner"))?;
            let owner = word(&owner, 0);
            let current = if owner == 0 { self.main_thread } else { owner };
            if current == thread && word(&ec_field, 0) == ec {
                return Ok(self.ec_fields(&ec_head));
            }
            return self.read_ec_of(current);
        }
        self.mem
            .read(self.gvl_owner, &mut owner)
            .map_err(self.moved("reading the GVL owner"))?;
        let owner = word(&owner, 0);
        self.read_ec_of(if owner == 0 { self.main_thread } else { owner })
    }

    pub(super) fn ec_fields(&self, head: &[u8]) -> [u64; 3] {
        let l = self.layout;
        let base = l.ec_vm_stack;
        [
            word(head, l.ec_vm_stack - base),
            word(head, l.ec_vm_stack_size - base),
            word(head, l.ec_cfp - base),
        ]
    }

    pub(super) fn read_ec_of(&mut self, thread: u64) -> std::result::Result<[u64; 3], Attempt> {
        let l = self.layout;
        let ec = self
            .mem
            .read_u64(thread.wrapping_add(l.thread_ec as u64))
            .map_err(self.moved("reading the thread's execution context"))?;
        let mut head = [0u8; 24];
        self.mem
            .read(ec.wrapping_add(l.ec_vm_stack as u64), &mut head)
            .map_err(self.moved("reading the execution context"))?;
        self.last_ec = Some((thread, ec));
        Ok(self.ec_fields(&head))
    }

    pub(super) fn try_snapshot(&mut self) -> std::result::Result<Stack, Attempt> {
        let ec = self.current_ec()?;
        self.walk(ec)
    }

    /// Drops the cached heap environments (one may have been freed and its address reused),
    /// and with them every memoized stack that relied on them.
    pub(super) fn forget_envs(&mut self) {
        self.heap_envs.clear();
        self.epoch += 1;
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
        let cfp_size = self.layout.cfp_size as u64;
        // Control frames grow down from the end of the VM stack; the last slot is a dummy
        // frame that Ruby's own backtrace skips.
        let end = vm_stack.wrapping_add(vm_stack_size.wrapping_mul(8));
        let last = end.wrapping_sub(cfp_size);
        if vm_stack == 0
            || vm_stack_size > MAX_FRAMES * 1024
            || cfp < vm_stack
            || cfp > last
            || (last - cfp) % cfp_size != 0
        {
            return Err(Attempt::Changed(format!(
                "control frame pointer {cfp:#x} outside its stack"
            )));
        }
        let count = (last - cfp) / cfp_size;
        if count > MAX_FRAMES {
            return Err(Attempt::Changed(format!("{count} frames")));
        }
        let hint = self.stack_hints.get(&vm_stack).copied().unwrap_or(0);
        Ok(Plan {
            vm_stack,
            cfp,
            count,
            guess: (hint as u64).min(cfp - vm_stack) as usize,
        })
    }

    /// The frames of several execution contexts (the threads of one sample). One call reads
    /// every context's control frames and, with them, the used part of its value stack,
    /// where every running frame's environment (`ep[-2..=0]`) lives; the extent is guessed
    /// from the previous sample of that stack (a deeper stack costs one more read). A
    /// context whose frames were already read along with its thread (`prefetched`, see
    /// spy/threads.rs) costs no call at all.
    pub(super) fn walk_many(
        &mut self,
        ecs: &[[u64; 3]],
        prefetched: Vec<Option<Prefetched>>,
    ) -> Vec<std::result::Result<Stack, Attempt>> {
        let plans: Vec<_> = ecs.iter().map(|ec| self.plan(*ec)).collect();
        let mut bufs = self.frame_buffers(&plans, prefetched);
        let reads = self.read_frames(&plans, &mut bufs);
        plans
            .into_iter()
            .zip(bufs)
            .zip(reads)
            .map(|((plan, buf), read)| {
                let result = match (read, plan) {
                    (Ok(()), Ok(plan)) => self.resolve(plan, &buf.cfps, buf.values),
                    (Err(e), _) | (_, Err(e)) => {
                        self.recycle(buf.values);
                        Err(e)
                    }
                };
                self.recycle(buf.cfps);
                result
            })
            .collect()
    }

    /// Each planned stack's buffers: what `prefetched` already holds when the frames fit in
    /// it, else pooled buffers for `read_frames` to fill.
    fn frame_buffers(
        &mut self,
        plans: &[std::result::Result<Plan, Attempt>],
        prefetched: Vec<Option<Prefetched>>,
    ) -> Vec<FrameBuffers> {
        let cfp_size = self.layout.cfp_size;
        let mut prefetched = prefetched;
        prefetched.resize_with(plans.len(), || None);
        let mut bufs = Vec::with_capacity(plans.len());
        for (p, pre) in plans.iter().zip(prefetched) {
            let want = p.as_ref().map_or(0, |p| p.count as usize * cfp_size);
            let fits = |pre: &Prefetched, p: &Plan| {
                pre.vm_stack == p.vm_stack
                    && p.cfp >= pre.from
                    && (p.cfp - pre.from) as usize + want <= pre.frames.len()
            };
            match (p, pre) {
                (Ok(p), Some(mut pre)) if fits(&pre, p) => {
                    pre.frames.drain(..(p.cfp - pre.from) as usize);
                    pre.frames.truncate(want);
                    bufs.push(FrameBuffers::read(pre.frames, pre.values));
                }
                (p, pre) => {
                    if let Some(pre) = pre {
                        self.recycle(pre.frames);
                        self.recycle(pre.values);
                    }
                    bufs.push(match p {
                        Ok(p) => FrameBuffers::to_read(self.buffer(want), self.buffer(p.guess)),
                        Err(_) => FrameBuffers::read(Vec::new(), Vec::new()),
                    });
                }
            }
        }
        bufs
    }

    /// One call for the frames and value stacks of every plan not read yet. When it fails
    /// (one stack moved or vanished), the others are read one by one so they still count.
    fn read_frames(
        &mut self,
        plans: &[std::result::Result<Plan, Attempt>],
        bufs: &mut [FrameBuffers],
    ) -> Vec<std::result::Result<(), Attempt>> {
        let mut results: Vec<std::result::Result<(), Attempt>> =
            plans.iter().map(|_| Ok(())).collect();
        let all = {
            let mut requests: Vec<(u64, &mut [u8])> = Vec::new();
            for (plan, buf) in plans.iter().zip(bufs.iter_mut()) {
                if let (Ok(p), false) = (plan, buf.done) {
                    buf.requests(p, &mut requests);
                }
            }
            if requests.is_empty() {
                return results;
            }
            self.mem.read_many(&mut requests)
        };
        let Err(e) = all else {
            return results;
        };
        if plans.len() == 1 {
            results[0] = Err(self.moved("reading control frames")(e));
            return results;
        }
        for ((plan, buf), result) in plans.iter().zip(bufs.iter_mut()).zip(results.iter_mut()) {
            if let (Ok(p), false) = (plan, buf.done) {
                let mut requests: Vec<(u64, &mut [u8])> = Vec::new();
                buf.requests(p, &mut requests);
                if let Err(e) = self.mem.read_many(&mut requests) {
                    *result = Err(self.moved("reading control frames")(e));
                }
            }
        }
        results
    }

    /// A zeroed buffer of `len` bytes, reusing one from an earlier sample when there is one
    /// (a sample then allocates nothing for its reads).
    pub(super) fn buffer(&mut self, len: usize) -> Vec<u8> {
        let mut b = self.spare.pop().unwrap_or_default();
        b.clear();
        b.resize(len, 0);
        b
    }

    pub(super) fn recycle(&mut self, b: Vec<u8>) {
        if self.spare.len() < 16 && b.capacity() <= 1 << 20 {
            self.spare.push(b);
        }
    }

    /// Turns one context's control frames and value stack into frames: from the memo when
    /// this raw stack was resolved before in the current epoch, otherwise by resolving it.
    pub(super) fn resolve(
        &mut self,
        plan: Plan,
        cfps: &[u8],
        values: Vec<u8>,
    ) -> std::result::Result<Stack, Attempt> {
        let (frames, envs) = match self.raw_frames(plan, cfps, values) {
            Ok(x) => x,
            Err((e, values)) => {
                self.recycle(values);
                return Err(e);
            }
        };
        let result = self.resolve_raw(&frames, &envs);
        self.recycle(envs.values);
        result
    }

    pub(super) fn resolve_raw(
        &mut self,
        frames: &[RawFrame],
        envs: &Envs,
    ) -> std::result::Result<Stack, Attempt> {
        let due = self.validated_at.is_none_or(|t| t.elapsed() >= REVALIDATE);
        self.sign(frames, envs);
        if !due {
            if let Some(m) = self.memo.get(&self.signature[..]) {
                if m.epoch == self.epoch {
                    return Ok(m.stack.clone());
                }
            }
        }
        let resolved: Arc<[Frame]> = self.resolve_frames(frames, envs)?.into();
        // `resolve_frames` may have started a new epoch (a full validation).
        let epoch = self.epoch;
        if self.memo.len() >= MAX_MEMO || self.memo_bytes >= MAX_MEMO_BYTES {
            self.memo.clear();
            self.memo_bytes = 0;
        }
        // Keep the token while the frames stay the same, so a stack keeps one name.
        let token = match self.memo.get(&self.signature[..]) {
            Some(m) if m.stack.frames == resolved => m.stack.token,
            _ => {
                self.tokens += 1;
                self.tokens
            }
        };
        let stack = Stack {
            frames: resolved,
            token,
        };
        self.memo_bytes += self.signature.len() * 8
            + stack.frames.len() * std::mem::size_of::<Frame>()
            + std::mem::size_of::<Memo>();
        self.memo.insert(
            self.signature.as_slice().into(),
            Memo {
                stack: stack.clone(),
                epoch,
            },
        );
        Ok(stack)
    }

    /// What the frames of a raw stack depend on besides the walker's caches: each frame's
    /// iseq, pc and environment address, and the environment's slots when it lives on the
    /// value stack (method entry or cref, block handler or parent, flags).
    pub(super) fn sign(&mut self, frames: &[RawFrame], envs: &Envs) {
        let sig = &mut self.signature;
        sig.clear();
        for f in frames {
            sig.extend_from_slice(&[f.iseq, f.pc, f.ep]);
            if let Some(s) = envs.on_stack(f.ep) {
                sig.extend_from_slice(&[s.me_cref, s.specval, s.flags]);
            }
        }
    }

    /// The raw control frames of one context, and the value stack under them (read further
    /// when the frames' environments reach past what was read along with them).
    pub(super) fn raw_frames(
        &mut self,
        plan: Plan,
        cfps: &[u8],
        mut values: Vec<u8>,
    ) -> std::result::Result<(Vec<RawFrame>, Envs), (Attempt, Vec<u8>)> {
        let l = self.layout;
        let Plan { vm_stack, cfp, .. } = plan;
        let frames: Vec<RawFrame> = cfps
            .chunks_exact(l.cfp_size)
            .map(|c| RawFrame {
                pc: word(c, l.cfp_pc),
                iseq: word(c, l.cfp_iseq),
                ep: word(c, l.cfp_ep),
            })
            .collect();
        // Checked: a garbage ep near the top of the address space must not wrap around
        // into a plausible (or enormous) length.
        let needed = frames
            .iter()
            .map(|f| f.ep)
            .filter(|ep| {
                *ep >= vm_stack.saturating_add(16) && ep.checked_add(8).is_some_and(|e| e <= cfp)
            })
            .map(|ep| (ep + 8 - vm_stack) as usize)
            .max()
            .unwrap_or(0);
        if needed > MAX_VALUE_STACK {
            return Err((
                Attempt::Changed(format!("a value stack of {needed} bytes")),
                values,
            ));
        }
        if needed > values.len() {
            let have = values.len();
            values.resize(needed, 0);
            if let Err(e) = self
                .mem
                .read(vm_stack.wrapping_add(have as u64), &mut values[have..])
            {
                return Err((self.moved("reading the value stack")(e), values));
            }
        }
        // Slack so that a slightly deeper stack next time still fits in one read.
        if self.stack_hints.len() >= MAX_CACHED_ENVS {
            self.stack_hints.clear();
        }
        self.stack_hints
            .insert(vm_stack, needed + needed / 4 + 1024);
        let envs = Envs {
            base: vm_stack,
            values,
        };
        Ok((frames, envs))
    }

    /// Resolves raw frames into frames (labels, paths, lines), through the caches.
    pub(super) fn resolve_frames(
        &mut self,
        frames: &[RawFrame],
        envs: &Envs,
    ) -> std::result::Result<Vec<Frame>, Attempt> {
        let l = self.layout;
        // Which frames are reported, and the candidates for the method entry each needs (for
        // C functions: its name; for Ruby methods and their blocks: the owner's name).
        let mut wanted: Vec<Wanted> = Vec::new();
        for (i, f) in frames.iter().enumerate() {
            if f.iseq != 0 {
                if f.pc == 0 {
                    continue; // IFUNC and dummy frames: Ruby skips them too.
                }
                // An iseq not seen before may belong to a method: collect its chain too.
                let needs_owner = self.iseqs.get(&f.iseq).is_none_or(|x| x.in_method);
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
        if let Some(s) = self.heap_envs.get(&ep) {
            return Ok(*s);
        }
        let mut buf = [0u8; 24];
        self.mem
            .read(ep.wrapping_sub(16), &mut buf)
            .map_err(self.moved("reading an environment"))?;
        let s = slots(&buf);
        if self.heap_envs.len() >= MAX_CACHED_ENVS {
            self.forget_envs();
        }
        self.heap_envs.insert(ep, s);
        Ok(s)
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) struct RawFrame {
    pub(super) pc: u64,
    pub(super) iseq: u64,
    pub(super) ep: u64,
}

/// `ep[-2]`, `ep[-1]`, `ep[0]` of one environment.
#[derive(Debug, Clone, Copy)]
pub(super) struct Slots {
    pub(super) me_cref: u64,
    pub(super) specval: u64,
    pub(super) flags: u64,
}

pub(super) fn slots(buf: &[u8; 24]) -> Slots {
    Slots {
        me_cref: word(buf, 0),
        specval: word(buf, 8),
        flags: word(buf, 16),
    }
}

/// The environments of one sample: a copy of the value stack `[base, base + len)`.
#[derive(Debug, Default)]
pub(super) struct Envs {
    pub(super) base: u64,
    pub(super) values: Vec<u8>,
}

impl Envs {
    pub(super) fn on_stack(&self, ep: u64) -> Option<Slots> {
        let start = ep.checked_sub(16)?.checked_sub(self.base)? as usize;
        let bytes: &[u8; 24] = self.values.get(start..start + 24)?.try_into().ok()?;
        Some(slots(bytes))
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
}

/// A thread's control frames and value stack, read along with the thread on the guess that
/// its stack is where it was last time (see spy/threads.rs).
#[derive(Debug)]
pub(super) struct Prefetched {
    pub(super) vm_stack: u64,
    /// Address of `frames[0]`: somewhat below the last sample's `cfp`, so a stack a few
    /// frames deeper still fits.
    pub(super) from: u64,
    pub(super) frames: Vec<u8>,
    pub(super) values: Vec<u8>,
}

/// A frame to report and the candidates for its method entry.
pub(super) struct Wanted {
    pub(super) index: usize,
    pub(super) cfunc: bool,
    pub(super) chain: Vec<u64>,
}

/// One stack's control frames and value stack, and whether they hold what was read already
/// (prefetched with the thread, or nothing to read).
pub(super) struct FrameBuffers {
    cfps: Vec<u8>,
    values: Vec<u8>,
    done: bool,
}

impl FrameBuffers {
    fn read(cfps: Vec<u8>, values: Vec<u8>) -> Self {
        FrameBuffers {
            cfps,
            values,
            done: true,
        }
    }

    fn to_read(cfps: Vec<u8>, values: Vec<u8>) -> Self {
        FrameBuffers {
            cfps,
            values,
            done: false,
        }
    }

    /// The reads that fill these buffers for `plan`.
    fn requests<'a>(&'a mut self, plan: &Plan, requests: &mut Vec<(u64, &'a mut [u8])>) {
        requests.push((plan.cfp, &mut self.cfps[..]));
        if !self.values.is_empty() {
            requests.push((plan.vm_stack, &mut self.values[..]));
        }
    }
}
