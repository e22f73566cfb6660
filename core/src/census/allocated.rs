//! Where a Ruby keeps its count of the objects it allocated (`GC.stat`'s
//! `total_allocated_objects`): words in its objspace, private to gc.c and measured per
//! release (`rbspy_ext_bindings::Allocated`). The allocation tracker reads them in its own
//! process, from its timer's signal handler, to see a sample point coming without running
//! a job (ext/rbspy_ext/src/tracker/arming.rs); read from outside, they give the count that
//! core/tests/live_ruby.rs compares with the target's own `GC.stat`.
use super::heaps::objspaces;
use crate::error::{Error, MemoryError, Result};
use crate::memory::{field, Memory};
use crate::spy::TargetView;
use rbspy_ext_bindings::{heap_layout_for_version, HeapLayout};

/// The words whose sum is the count of objects allocated, in the VM's objspace (or, where
/// each Ractor owns its heap, the main Ractor's: the first the GC lists), and on 4.0 in the
/// main Ractor's newobj cache, which holds back up to 1,023 a heap (another Ractor's cache
/// is not read: its allocations show in steps).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocatedCounters {
    pub addresses: Vec<u64>,
    /// The same objspace's GC flags (a 32-bit word), and the bit set while a GC runs: no
    /// allocation then, which a reader of the count must not take for a slow process.
    pub gc_flags: u64,
    pub during_gc_bit: u32,
}

impl AllocatedCounters {
    /// The words of the target's heap.
    pub fn find<M: Memory>(t: &TargetView<'_, M>) -> Result<Self> {
        let h = heap_layout(t)?;
        let first = objspaces(t, h)?.into_iter().next().ok_or(Error::Corrupt {
            pid: t.pid(),
            what: "objspace list (empty)",
            addr: t.vm(),
        })?;
        let a = h.allocated;
        let mut addresses: Vec<u64> = (0..a.count)
            .map(|i| field(first.address, a.at + i * a.stride))
            .collect();
        if let Some(p) = a.pending {
            let cache = main_ractor_cache(t, p.cache)?;
            addresses.extend((0..a.count).map(|i| field(cache, p.at + i * p.stride)));
        }
        Ok(AllocatedCounters {
            addresses,
            gc_flags: field(first.address, t.layout().objspace_flags),
            during_gc_bit: t.layout().objspace_during_gc_bit,
        })
    }

    /// Their sum, read through `mem`.
    pub fn read<M: Memory>(&self, mem: &M) -> std::result::Result<u64, MemoryError> {
        self.addresses
            .iter()
            .try_fold(0u64, |sum, &at| Ok(sum.wrapping_add(mem.read_u64(at)?)))
    }
}

/// The main Ractor's newobj cache (`vm->ractor.main_ractor->newobj_cache`, at `cache` in
/// the Ractor), which lives as long as the process.
fn main_ractor_cache<M: Memory>(t: &TargetView<'_, M>, cache: usize) -> Result<u64> {
    let unsupported = || Error::UnsupportedVersion {
        pid: t.pid(),
        version: t.version().to_string(),
        detail: "where the main Ractor is was not measured".into(),
    };
    let at = t.layout().vm_main_ractor.ok_or_else(unsupported)?;
    let memory = |e| t.memory_error("reading the main Ractor's newobj cache", e);
    let ractor = t.mem().read_u64(field(t.vm(), at)).map_err(memory)?;
    let cache = t.mem().read_u64(field(ractor, cache)).map_err(memory)?;
    match cache {
        0 => Err(Error::Corrupt {
            pid: t.pid(),
            what: "main Ractor's newobj cache (none)",
            addr: ractor,
        }),
        cache => Ok(cache),
    }
}

/// The target's heap layout: from its own debug information where it has some, else
/// measured from its release's gc.c.
pub(super) fn heap_layout<M: Memory>(target: &TargetView<'_, M>) -> Result<&'static HeapLayout> {
    let measured = || heap_layout_for_version(target.version());
    target
        .debug_heap_layout()
        .or_else(measured)
        .ok_or_else(|| Error::UnsupportedVersion {
            pid: target.pid(),
            version: target.version().to_string(),
            detail: "no heap layout measured for this series".into(),
        })
}
