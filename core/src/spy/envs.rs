//! Environments as the walker reads them: `ep[-2..=0]` of a frame (its method entry or
//! cref, the previous ep, its flags), and the copy of a value stack they are read from
//! (`Walker::env_slots` and `method_entry_chain` in walker.rs follow them).
use crate::memory::word;
use std::borrow::Cow;

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

/// The environments of one sample: the value stack `[base, base + len)` as read, out of the
/// whole stack from `floor` (`vm_stack`; equal to `base` unless the copy was cut).
#[derive(Debug, Default)]
pub(super) struct Envs<'a> {
    pub(super) base: u64,
    pub(super) floor: u64,
    pub(super) values: Cow<'a, [u8]>,
}

impl Envs<'_> {
    pub(super) fn on_stack(&self, ep: u64) -> Option<Slots> {
        let start = ep.checked_sub(16)?.checked_sub(self.base)? as usize;
        let bytes: &[u8; 24] = self
            .values
            .get(start..start.checked_add(24)?)?
            .try_into()
            .ok()?;
        Some(slots(bytes))
    }
}
