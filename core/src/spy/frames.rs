//! Raw frames → Frames: iseqs and method entries, read in batches and cached between
//! validations, then labels, paths and line numbers the way Ruby prints them.
use super::cache::{IseqInfo, MethodInfo};
use super::leaves::RawFrame;
use super::leaves::{Attempt, REVALIDATE};
use super::located::{Located, INTERNAL_PATH};
use super::walker::{Walker, Wanted};
use crate::lines::LineTable;
use crate::memory::{field, Memory, ReadBatch, Span};
use crate::memory::{word, word32};
use crate::model::Frame;
use crate::objects::{imemo_type, is_heap_object, label_module, read_array_entry, read_string};
use rustc_hash::FxHashMap;
use std::sync::Arc;

/// What a sample's validation reads (`Walker::to_validate`): the iseqs to check or load,
/// every candidate method entry of the frames, and the candidates not known yet.
struct ToRead {
    iseqs: Vec<u64>,
    candidates: Vec<u64>,
    methods: Vec<u64>,
}

impl<M: Memory> Walker<'_, M> {
    /// Iseqs and method entries the frames need. What is cached is trusted between full
    /// validations (every [`REVALIDATE`]): an iseq while the frame's pc lies inside its
    /// instructions, a method entry while it defines the frame's method (checked in
    /// `build_frames`). A full validation, and anything not cached, costs one batched read:
    /// the header of every iseq and of its cached body (same body, instructions, size) and
    /// the header of every candidate method entry. New ones are loaded on the cold path.
    pub(super) fn read_iseqs_and_method_entries(
        &mut self,
        frames: &[RawFrame],
        wanted: &[Wanted],
    ) -> std::result::Result<FxHashMap<u64, MethodInfo>, Attempt> {
        let l = self.target.layout;
        let full = self
            .cache
            .validated_at
            .is_none_or(|t| t.elapsed() >= REVALIDATE);
        let ToRead {
            iseqs: iseq_addrs,
            candidates,
            methods: me_addrs,
        } = self.to_validate(frames, wanted, full);
        // Read again on a full validation; one that has become a method entry since is a
        // change (an address reused).
        let were_not_methods = if full {
            std::mem::take(&mut self.cache.not_methods)
        } else {
            Default::default()
        };
        let head_len = l.me_owner.max(l.me_def).max(l.svar_cref_or_me) + 8;
        // The cache's batch, out of `self` while its bytes are borrowed.
        let mut reads = std::mem::take(&mut self.cache.reads);
        reads.clear();
        let iseq_spans: Vec<(Span, Span)> = iseq_addrs
            .iter()
            .map(|addr| {
                let header = reads.add(*addr, 24);
                // A body not cached yet is read on the cold path (`load_iseq`).
                let (body, len) = self.cache.iseqs.get(addr).map_or((0, 0), |i| (i.body, 16));
                (header, reads.add(body, len))
            })
            .collect();
        let me_spans: Vec<Span> = me_addrs.iter().map(|a| reads.add(*a, head_len)).collect();
        let read = reads
            .read(&self.target.mem)
            .map_err(self.target.moved("reading iseqs and method entries"))
            .and_then(|()| self.refresh_iseqs(&iseq_addrs, &reads, &iseq_spans))
            .and_then(|()| self.method_entries(&me_addrs, &reads, &me_spans));
        self.cache.reads = reads;
        let mut mes = read?;
        self.cache.changed |= mes.keys().any(|a| were_not_methods.contains(a));
        for addr in &me_addrs {
            if !mes.contains_key(addr) {
                self.cache.not_methods.insert(*addr);
            }
        }
        for addr in candidates {
            if let Some(info) = self.cache.methods.get(&addr) {
                mes.entry(addr).or_insert_with(|| info.clone());
            }
        }
        if full {
            self.cache.validated_at = Some(std::time::Instant::now());
            // Stacks resolved from caches that held are resolved again to the same frames
            // (other stacks' iseqs are trusted on their pc either way, memo or not): only a
            // change starts a new epoch. Re-resolving every stack every 100 ms would cost
            // a full resolution per distinct pc, which at 1 kHz was most of a sample's cost.
            if std::mem::take(&mut self.cache.changed) {
                self.memo.invalidate();
            }
        }
        Ok(mes)
    }

    /// What a sample must read: the iseqs of `frames` not cached or not trusted (every one on
    /// a `full` validation), every candidate method entry of `wanted`, and those of them not
    /// known yet (every one on a full validation).
    fn to_validate(&self, frames: &[RawFrame], wanted: &[Wanted], full: bool) -> ToRead {
        let mut iseq_addrs: Vec<u64> = frames
            .iter()
            .filter(|f| f.iseq != 0 && f.pc != 0)
            .filter(|f| {
                full || self.cache.iseqs.get(&f.iseq).is_none_or(|i| {
                    f.pc < i.encoded || f.pc > i.encoded.saturating_add(u64::from(i.size) * 8)
                })
            })
            .map(|f| f.iseq)
            .collect();
        iseq_addrs.sort_unstable();
        iseq_addrs.dedup();
        let candidates: Vec<u64> = wanted
            .iter()
            .flat_map(|w| w.chain.iter().copied())
            .collect();
        let mut me_addrs: Vec<u64> = candidates
            .iter()
            .copied()
            .filter(|a| {
                full || !(self.cache.methods.contains_key(a) || self.cache.not_methods.contains(a))
            })
            .collect();
        me_addrs.sort_unstable();
        me_addrs.dedup();
        ToRead {
            iseqs: iseq_addrs,
            candidates,
            methods: me_addrs,
        }
    }

    /// Checks each iseq header read (and its cached body's) against the cache, loading the
    /// iseqs that changed or are new.
    fn refresh_iseqs(
        &mut self,
        iseq_addrs: &[u64],
        reads: &ReadBatch,
        spans: &[(Span, Span)],
    ) -> std::result::Result<(), Attempt> {
        let l = self.target.layout;
        for (addr, (header, body)) in iseq_addrs.iter().zip(spans) {
            let (ibuf, bbuf) = (reads.get(*header), reads.get(*body));
            if imemo_type(l, word(ibuf, l.rbasic_flags)) != Some(l.imemo_iseq) {
                return Err(Attempt::Changed(format!(
                    "iseq at {addr:#x} is not an iseq"
                )));
            }
            let body = word(ibuf, l.iseq_body);
            let valid = self.cache.iseqs.get(addr).is_some_and(|info| {
                info.body == body
                    && word32(bbuf, l.body_iseq_size) == info.size
                    && word(bbuf, l.body_iseq_encoded) == info.encoded
            });
            if !valid {
                self.cache.changed |= self.cache.iseqs.contains_key(addr);
                self.cache.iseqs.remove(addr);
                let info = self.load_iseq(body)?;
                self.cache.iseqs.insert(*addr, info);
            }
        }
        Ok(())
    }

    /// Reads and decodes everything an iseq's frames need (cold path, once per iseq).
    pub(super) fn load_iseq(&mut self, body: u64) -> std::result::Result<IseqInfo, Attempt> {
        let l = self.target.layout;
        let b = self
            .target
            .mem
            .read_vec(body, l.body_read_size)
            .map_err(self.target.moved("reading an iseq body"))?;
        let strings = |spy: &Self, v: u64| {
            read_string(&spy.target.mem, l, v)
                .map_err(|e| spy.target.object_moved("reading an iseq label", e))
        };
        let kind = word32(&b, l.body_type);
        let mut label = strings(self, word(&b, l.body_location_label))?;
        if l.labels_clauses_as_their_code() {
            label = self.clause_label(&b, label)?;
        }
        let label: Arc<str> = label.into();
        let (path, absolute_path) = self.read_pathobj(word(&b, l.body_location_pathobj))?;
        let size = word32(&b, l.body_iseq_size);
        let lines = LineTable::read(
            &self.target.mem,
            l,
            word(&b, l.body_insns_info_body),
            word32(&b, l.body_insns_info_size) as u64,
            word(&b, l.body_insns_info_succ_index_table),
            size as u64,
        )
        .map_err(|e| self.target.object_moved("reading a line table", e))?;
        let local = word(&b, l.body_local_iseq);
        let local_body = match local {
            0 => None,
            _ => Some(
                self.target
                    .read_word(local, l.iseq_body, "reading a local iseq")?,
            ),
        };
        let in_method = match local_body {
            None => false,
            Some(local_body) => {
                let mut t = [0u8; 4];
                self.target
                    .mem
                    .read(field(local_body, l.body_type), &mut t)
                    .map_err(self.target.moved("reading a local iseq"))?;
                u32::from_le_bytes(t) == l.iseq_type_method
            }
        };
        let base_label = self.base_label(&b, body, local_body, &label)?;
        Ok(IseqInfo {
            body,
            encoded: word(&b, l.body_iseq_encoded),
            size,
            path,
            absolute_path,
            label,
            base_label,
            in_method,
            local_iseq: local,
            is_method: kind == l.iseq_type_method,
            kind,
            c_trace: l.is_c_traced(&b),
            lines,
            qualified: FxHashMap::default(),
        })
    }

    /// An iseq's `pathobj` is either the path String or a frozen [path, realpath] Array.
    pub(super) fn read_pathobj(
        &self,
        pathobj: u64,
    ) -> std::result::Result<(Arc<str>, Option<Arc<str>>), Attempt> {
        let l = self.target.layout;
        let fail = |e| self.target.object_moved("reading an iseq path", e);
        let flags = self
            .target
            .mem
            .read_u64(pathobj)
            .map_err(self.target.moved("reading an iseq path"))?;
        match flags & l.t_mask {
            t if t == l.t_string => {
                let p: Arc<str> = read_string(&self.target.mem, l, pathobj)
                    .map_err(fail)?
                    .into();
                Ok((p.clone(), Some(p)))
            }
            t if t == l.t_array => {
                let path = read_array_entry(&self.target.mem, l, pathobj, 0).map_err(fail)?;
                let real = read_array_entry(&self.target.mem, l, pathobj, 1).map_err(fail)?;
                let path: Arc<str> = read_string(&self.target.mem, l, path).map_err(fail)?.into();
                let real = if is_heap_object(real) {
                    Some(read_string(&self.target.mem, l, real).map_err(fail)?.into())
                } else {
                    None
                };
                Ok((path, real))
            }
            _ => Err(Attempt::Changed(format!(
                "pathobj at {pathobj:#x} is neither String nor Array"
            ))),
        }
    }

    pub(super) fn build_frames(
        &mut self,
        frames: &[RawFrame],
        wanted: Vec<Wanted>,
        mes: &FxHashMap<u64, MethodInfo>,
    ) -> std::result::Result<Vec<Frame>, Attempt> {
        let l = self.target.layout;
        let mut out = Located::with_capacity(wanted.len());
        // Ruby 3.4 shows a rescue/ensure frame in place of the frame it belongs to, which it
        // then leaves out (vm_backtrace.c, skip_next_frame).
        let merges_clauses = l.labels_clauses_as_their_code();
        let hides_internal = l.locates_internal_frames_at_their_caller();
        let mut skip_next = false;
        for Wanted {
            index,
            cfunc: is_cfunc,
            chain,
        } in wanted
        {
            let f = &frames[index];
            let me = chain.into_iter().find(|m| mes.contains_key(m));
            if is_cfunc {
                let info = me
                    .and_then(|m| mes.get(&m))
                    .filter(|m| m.def_type == l.method_type_cfunc)
                    .ok_or_else(|| Attempt::Changed("C frame without a C method entry".into()))?;
                let (label, base_label) = self.cfunc_label(me.expect("checked"), info)?;
                out.push_cfunc(Frame {
                    base_label,
                    label,
                    path: Arc::from(""),
                    absolute_path: None,
                    lineno: 0,
                    c_function: true,
                });
                continue;
            }
            let info = &self.cache.iseqs[&f.iseq];
            let is_clause = info.kind == l.iseq_type_rescue || info.kind == l.iseq_type_ensure;
            if merges_clauses && std::mem::replace(&mut skip_next, is_clause) {
                continue;
            }
            // The entry must define the method this frame runs; otherwise the environment we
            // read belonged to a frame pushed or popped meanwhile.
            let owner = me
                .and_then(|m| mes.get(&m))
                .filter(|m| !info.in_method || m.iseqs.contains(&info.local_iseq))
                .map(|m| m.label_owner);
            if owner.is_none() && info.is_method {
                // Every method frame has a method entry: not finding one means the frame
                // was being pushed or popped while we read it, or that cached entries are
                // stale (a compaction moves iseqs and rewrites each definition in place,
                // leaving the `def` and `owner` they are validated by): read them again.
                if me.is_some() {
                    for m in mes.keys() {
                        self.cache.methods.remove(m);
                    }
                    self.cache.changed = true;
                }
                return Err(Attempt::Changed(
                    "method frame without a method entry".into(),
                ));
            }
            let (is_method, c_trace) = (info.is_method, info.c_trace);
            let frame = self.iseq_frame(f, owner)?;
            if c_trace {
                out.push_c_traced(frame);
            } else if hides_internal && frame.path.starts_with(INTERNAL_PATH) {
                out.push_internal(frame, is_method);
            } else {
                out.push_ruby(frame);
            }
        }
        Ok(out.frames)
    }

    /// Third batched read: headers of every method entry the frames point at. Cached entries
    /// are kept only while their `def` and `owner` still match.
    pub(super) fn method_entries(
        &mut self,
        addrs: &[u64],
        reads: &ReadBatch,
        spans: &[Span],
    ) -> std::result::Result<FxHashMap<u64, MethodInfo>, Attempt> {
        let l = self.target.layout;
        let mut out = FxHashMap::default();
        for (addr, span) in addrs.iter().zip(spans) {
            let mut head = reads.get(*span).to_vec();
            let mut imemo = imemo_type(l, word(&head, l.rbasic_flags));
            if imemo == Some(l.imemo_svar) {
                // Rare (methods using $~): one more read to reach the entry inside.
                let inner = word(&head, l.svar_cref_or_me);
                if !is_heap_object(inner) {
                    continue;
                }
                self.target
                    .mem
                    .read(inner, &mut head)
                    .map_err(self.target.moved("reading a method entry"))?;
                imemo = imemo_type(l, word(&head, l.rbasic_flags));
            }
            if imemo != Some(l.imemo_ment) {
                continue; // a cref: the frame has no method entry of its own
            }
            let def = word(&head, l.me_def);
            let owner = word(&head, l.me_owner);
            let cached = self
                .cache
                .methods
                .get(addr)
                .filter(|m| m.def == def && m.owner == owner)
                .cloned();
            let info = match cached {
                Some(info) => info,
                None => {
                    self.cache.changed |= self.cache.methods.contains_key(addr);
                    self.load_method(def, owner)?
                }
            };
            self.cache.methods.insert(*addr, info.clone());
            out.insert(*addr, info);
        }
        Ok(out)
    }

    /// Reads a method definition (cold path, once per method entry).
    pub(super) fn load_method(
        &self,
        def: u64,
        owner: u64,
    ) -> std::result::Result<MethodInfo, Attempt> {
        let l = self.target.layout;
        let d = self
            .target
            .mem
            .read_vec(
                def,
                l.me_def_original_id
                    .max(l.me_def_iseqptr)
                    .max(l.me_def_original_module.unwrap_or(0))
                    + 8,
            )
            .map_err(self.target.moved("reading a method definition"))?;
        let label_owner = match l.me_def_original_module {
            Some(at) => label_module(&self.target.mem, l, owner, word(&d, at))
                .map_err(|e| self.target.object_moved("reading a method's module", e))?,
            None => owner,
        };
        let def_type = (word(&d, 0) & l.me_def_type_mask) >> l.me_def_type_shift;
        let mut iseqs = [0, 0];
        if def_type == l.method_type_iseq {
            iseqs[0] = word(&d, l.me_def_iseqptr);
            if let Some(mandatory_only) = l.body_mandatory_only_iseq {
                let body =
                    self.target
                        .read_word(iseqs[0], l.iseq_body, "reading a method's iseq")?;
                iseqs[1] = self
                    .target
                    .mem
                    .read_u64(field(body, mandatory_only))
                    .map_err(self.target.moved("reading a method's iseq"))?;
            }
        }
        Ok(MethodInfo {
            def,
            owner,
            label_owner,
            def_type,
            original_id: word(&d, l.me_def_original_id),
            iseqs,
            cfunc_label: None,
            name: None,
        })
    }

    /// (qualified label, bare name) of a C function's method entry.
    pub(super) fn cfunc_label(
        &mut self,
        me: u64,
        info: &MethodInfo,
    ) -> std::result::Result<(Arc<str>, Arc<str>), Attempt> {
        if let (Some(label), Some(name)) = (&info.cfunc_label, &info.name) {
            return Ok((label.clone(), name.clone()));
        }
        let l = self.target.layout;
        let id = info.original_id;
        let symbols = self.target.symbol_table(&mut self.cache.symbols)?;
        let name = symbols
            .name(&self.target.mem, l, id)
            .map_err(|_| Attempt::Changed(format!("method name ID {id:#x} does not resolve")))?;
        let label: Arc<str> = self
            .cache
            .classes
            .qualify(&self.target.mem, l, symbols, info.label_owner, &name)
            .into();
        if let Some(m) = self.cache.methods.get_mut(&me) {
            m.cfunc_label = Some(label.clone());
            m.name = Some(name.clone());
        }
        Ok((label, name))
    }

    pub(super) fn iseq_frame(
        &mut self,
        f: &RawFrame,
        owner: Option<u64>,
    ) -> std::result::Result<Frame, Attempt> {
        let l = self.target.layout;
        let info = self
            .cache
            .iseqs
            .get(&f.iseq)
            .expect("loaded in read_iseqs_and_method_entries");
        let n = (f.pc.wrapping_sub(info.encoded) / 8) as usize;
        if f.pc < info.encoded || n > info.size as usize {
            return Err(Attempt::Changed("pc outside its iseq".into()));
        }
        // The pc points at the next instruction (Ruby's calc_pos uses pos - 1).
        let pos = n.saturating_sub(1);
        let lineno = info
            .lines
            .line_at(pos)
            .ok_or_else(|| Attempt::Changed("pc outside the line table".into()))?;
        let label = match owner {
            Some(owner) if info.in_method => {
                if let Some(q) = info.qualified.get(&owner) {
                    q.clone()
                } else {
                    let (label, base) = (info.label.clone(), info.base_label.clone());
                    let symbols = self.target.symbol_table(&mut self.cache.symbols)?;
                    let qualified =
                        self.cache
                            .classes
                            .qualify(&self.target.mem, l, symbols, owner, &base);
                    // "block (2 levels) in foo" → "block (2 levels) in Foo#foo".
                    let q: Arc<str> = match label.strip_suffix(&*base) {
                        Some(prefix) => format!("{prefix}{qualified}").into(),
                        None => label.clone(),
                    };
                    let info = self.cache.iseqs.get_mut(&f.iseq).expect("present");
                    info.qualified.insert(owner, q.clone());
                    q
                }
            }
            _ => info.label.clone(),
        };
        let info = &self.cache.iseqs[&f.iseq];
        Ok(Frame {
            label,
            base_label: info.base_label.clone(),
            path: info.path.clone(),
            absolute_path: info.absolute_path.clone(),
            lineno,
            c_function: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::attach::Target;
    use super::super::cache::{Cache, IseqInfo};
    use super::super::memo::StackMemo;
    use super::super::walker::{WalkState, Walker, Wanted};
    use super::*;
    use crate::memory::MemoryImage;
    use crate::vm::VmRoots;

    /// What `to_validate` asks of `frames` and `wanted` with a cache that has an iseq at
    /// 0x1000 whose instructions are 0x5000..0x5000 + 10 words, and a cref at 0x8000.
    fn asked(frames: &[RawFrame], chain: Vec<u64>, full: bool) -> (Vec<u64>, Vec<u64>) {
        let l = rbspy_ext_bindings::layout_for_version("3.3.8").expect("3.3.8's layout");
        let mut target = Target::new(1, MemoryImage::new(), l, l.name, VmRoots::default());
        let (mut cache, mut walk, mut memo) =
            (Cache::default(), WalkState::default(), StackMemo::default());
        let iseq = IseqInfo {
            body: 0x2000,
            encoded: 0x5000,
            size: 10,
            ..Default::default()
        };
        cache.iseqs.insert(0x1000, iseq);
        cache.not_methods.insert(0x8000);
        let w = Walker {
            target: &mut target,
            cache: &mut cache,
            walk: &mut walk,
            memo: &mut memo,
        };
        let wanted = [Wanted {
            index: 0,
            cfunc: false,
            chain,
        }];
        let r = w.to_validate(frames, &wanted, full);
        assert_eq!(r.candidates, wanted[0].chain, "every candidate is checked");
        (r.iseqs, r.methods)
    }

    fn frame(iseq: u64, pc: u64) -> RawFrame {
        RawFrame { pc, iseq, ep: 0 }
    }

    #[test]
    fn a_cached_iseq_is_trusted_while_the_pc_lies_in_its_instructions() {
        let (inside, past, below) = (0x5000 + 9 * 8, 0x5000 + 11 * 8, 0x4ff8);
        // Not cached, or a full validation: read (once each); no pc or no iseq: never.
        let (cached, other) = (|pc| frame(0x1000, pc), |pc| frame(0x3000, pc));
        let mixed = [other(1), cached(inside), other(2), frame(0x4000, 0)];
        let cases: [(&[RawFrame], bool, &[u64]); 6] = [
            (&[frame(0x1000, inside)], false, &[]),
            (&[frame(0x1000, past)], false, &[0x1000]),
            (&[frame(0x1000, below)], false, &[0x1000]),
            (&mixed, false, &[0x3000]),
            (&mixed, true, &[0x1000, 0x3000]),
            (&[frame(0, inside)], true, &[]),
        ];
        for (frames, full, read) in cases {
            let got = asked(frames, vec![], full).0;
            assert_eq!(got, read, "{frames:x?}, full: {full}");
        }
    }

    #[test]
    fn method_entries_known_either_way_are_read_again_only_on_a_full_validation() {
        let chain = vec![0x9000, 0x8000, 0x9000];
        assert_eq!(asked(&[], chain.clone(), false).1, [0x9000]);
        assert_eq!(asked(&[], chain, true).1, [0x8000, 0x9000]);
    }
}
