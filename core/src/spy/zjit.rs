//! Ruby 4.1's ZJIT: a compiled frame keeps its iseq and pc in a JITFrame rather than in
//! its control frame (zjit.h, `CFP_ISEQ` and `CFP_PC`). And which JIT a target runs, for a
//! profile's metadata ([`jit_of`]).
use super::attach::Target;
use super::leaves::{Attempt, RawFrame};
use super::walker::Walker;
use crate::memory::{word, Memory};
use crate::vm::read_words;

impl<M: Memory> Walker<'_, M> {
    /// 4.1 under ZJIT: a frame whose `jit_return` is set takes its iseq and pc from its
    /// JITFrame (zjit.h's `CFP_ISEQ`/`CFP_PC`), since ZJIT leaves `cfp->_iseq` and `pc`
    /// unwritten. Two batched reads: the JITFrame addresses, then the JITFrames. A JITFrame
    /// describes compiled code and does not change, so a captured stack (the BPF sampler)
    /// is resolved the same way a moment later.
    pub(super) fn zjit_frames(
        &mut self,
        cfps: &[u8],
        frames: &mut [RawFrame],
    ) -> std::result::Result<(), Attempt> {
        let l = self.target.layout;
        let Some(jit_return_at) = l.cfp_jit_return else {
            return Ok(());
        };
        if !self.zjit_on() {
            return Ok(());
        }
        let mut pending: Vec<(usize, u64)> = Vec::new();
        for (i, c) in cfps.chunks_exact(l.cfp_size).enumerate() {
            match word(c, jit_return_at) {
                0 => {}
                r if r == l.zjit_return_c_frame => {
                    frames[i].iseq = 0;
                    frames[i].pc = 0;
                }
                r => pending.push((i, r.wrapping_sub(8))),
            }
        }
        if pending.is_empty() {
            return Ok(());
        }
        let slots: Vec<u64> = pending.iter().map(|(_, a)| *a).collect();
        // A slot that does not read is a frame popped meanwhile: read the stack again.
        let records = read_words(&self.target.mem, &slots, 0)
            .into_iter()
            .collect::<Option<Vec<u64>>>()
            .ok_or_else(|| Attempt::Changed("a ZJIT frame slot does not read".into()))?;
        let size = l.zjit_frame_pc.max(l.zjit_frame_iseq) + 8;
        let mut bufs = vec![0u8; size * records.len()];
        {
            let mut requests: Vec<(u64, &mut [u8])> = records
                .iter()
                .copied()
                .zip(bufs.chunks_exact_mut(size))
                .collect();
            self.target
                .mem
                .read_many(&mut requests)
                .map_err(self.target.moved("reading ZJIT frames"))?;
        }
        for ((i, _), b) in pending.iter().zip(bufs.chunks_exact(size)) {
            frames[*i].pc = word(b, l.zjit_frame_pc);
            frames[*i].iseq = word(b, l.zjit_frame_iseq);
        }
        Ok(())
    }

    /// Whether ZJIT is on in the target (`rb_zjit_entry` set). Once on it stays on; while
    /// off it is looked at again every second (`RubyVM::ZJIT.enable` can turn it on late).
    fn zjit_on(&mut self) -> bool {
        let Some(entry) = self.target.zjit_entry else {
            return false;
        };
        if let Some((on, at)) = self.target.zjit_on {
            if on || at.elapsed() < std::time::Duration::from_secs(1) {
                return on;
            }
        }
        let on = self.target.mem.read_u64(entry).is_ok_and(|v| v != 0);
        self.target.zjit_on = Some((on, std::time::Instant::now()));
        on
    }
}

/// Which JIT the target runs, when one is on: by the binary's own flags when it names them
/// (`rb_zjit_entry` set: ZJIT; `rb_yjit_enabled_p`: YJIT), else (a shared libruby, which
/// exports neither) YJIT from 3.1 when the process has code no file backs, which YJIT
/// writes into anonymous executable pages as it compiles (MJIT, before 3.3, compiled to
/// shared objects, which files back). None: no JIT on, or nothing readable says.
pub(super) fn jit_of<M: Memory>(target: &Target<M>) -> Option<&'static str> {
    let [zjit, yjit] = target.jit_flags;
    if zjit.is_some_and(|at| target.mem.read_u64(at).is_ok_and(|v| v != 0)) {
        return Some("ZJIT");
    }
    if let Some(at) = yjit {
        let mut flag = [0u8; 1];
        let on = target.mem.read(at, &mut flag).is_ok() && flag[0] != 0;
        return on.then_some("YJIT");
    }
    let maps = crate::process::read_maps(target.pid).ok()?;
    let mut version = target
        .version
        .split('.')
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let yjit_era = (version.next(), version.next()) >= (Some(3), Some(1));
    (yjit_era && crate::process::anonymous_code_bytes(&maps) > 0).then_some("YJIT")
}
