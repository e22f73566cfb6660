//! The heaps a census reads (walk.rs): the VM's one objspace, or, where each Ractor owns its
//! heap (the master of 2026-08), every objspace the GC itself walks
//! (`rb_gc_vm_each_objspace`): each living Ractor's, a child's while it is created (its
//! heap fills before it joins the VM's list), and terminated Ractors' (zombies) until a
//! living heap absorbs their pages. Nothing outside names them all: no objspace points to
//! its Ractor, and the global page index is a static of gc.c that stripped builds do not
//! name; so the census starts from the VM.
use super::RactorHeap;
use crate::error::{Error, Result};
use crate::memory::{field, word, word32, Memory};
use crate::objects::{is_heap_object, read_string};
use crate::spy::TargetView;
use rbspy_ext_bindings::{HeapLayout, RactorHeaps};

/// Reads of the Ractor list before a census gives up on one that keeps changing.
const LIST_ATTEMPTS: usize = 8;
/// More terminated heaps than this awaiting absorption means the count did not read right.
const MAX_ZOMBIES: u64 = 4096;

/// One heap (`rb_objspace_t`) to count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Objspace {
    pub(super) address: u64,
    /// Its Ractor, where each Ractor owns its heap: the census's row for it, counts at 0.
    pub(super) ractor: Option<RactorHeap>,
}

/// The addresses of `spaces`: the set a pass read, compared with the set after it.
pub(super) fn addresses(spaces: &[Objspace]) -> Vec<u64> {
    spaces.iter().map(|s| s.address).collect()
}

/// The heaps' compactions so far (a global compaction counts in each), and whether one
/// runs now.
pub(super) fn gc_state<M: Memory>(
    t: &TargetView<'_, M>,
    h: &HeapLayout,
    spaces: &[Objspace],
) -> Result<(u64, bool)> {
    let mem = t.mem();
    let memory = |e| t.memory_error("reading the GC's state", e);
    let (mut count, mut running) = (0u64, false);
    for space in spaces {
        let compacted = mem.read_u64(field(space.address, h.compact_count));
        count = count.wrapping_add(compacted.map_err(memory)?);
        let (at, mask) = h.during_compacting;
        let mut flag = [0u8];
        mem.read(field(space.address, at), &mut flag)
            .map_err(memory)?;
        running |= flag[0] & mask != 0;
    }
    Ok((count, running))
}

/// Every heap of the target, each once, in `rb_gc_vm_each_objspace`'s order.
pub(super) fn objspaces<M: Memory>(t: &TargetView<'_, M>, h: &HeapLayout) -> Result<Vec<Objspace>> {
    let (l, mem, vm) = (t.layout(), t.mem(), t.vm());
    let memory = |context| move |e| t.memory_error(context, e);
    if let Some(at) = l.vm_objspace {
        let address = mem
            .read_u64(field(vm, at))
            .map_err(memory("reading the VM's objspace"))?;
        return Ok(vec![Objspace {
            address,
            ractor: None,
        }]);
    }
    let (Some(_), Some(r)) = (l.ractor_objspace, h.ractor_heaps) else {
        return Err(Error::UnsupportedVersion {
            pid: t.pid(),
            version: t.version().to_string(),
            detail: "each Ractor owns its heap here, and where its heaps are was not measured"
                .into(),
        });
    };
    let ractors = (0..LIST_ATTEMPTS)
        .find_map(|_| t.ractors().transpose())
        .transpose()?
        .ok_or(Error::Corrupt {
            pid: t.pid(),
            what: "Ractor list (it kept changing)",
            addr: vm,
        })?;
    let mut spaces = Vec::new();
    for ractor in &ractors {
        // 0 while a Ractor shares its parent's heap: that heap is counted as the parent's.
        if ractor.objspace != 0 {
            let heap = row(Some(ractor.id), ractor.name.clone(), "running");
            spaces.push((ractor.objspace, heap));
        }
        let child = mem
            .read_u64(field(ractor.address, r.creating_child))
            .map_err(memory("reading a Ractor"))?;
        if child != 0 {
            spaces.push((child, row(None, None, "creating")));
        }
    }
    spaces.extend(zombies(t, &r)?);
    let mut seen = Vec::new();
    Ok(spaces
        .into_iter()
        .filter(|(address, _)| {
            *address != 0 && !seen.contains(address) && {
                seen.push(*address);
                true
            }
        })
        .map(|(address, ractor)| Objspace { address, ractor })
        .collect())
}

/// A heap's row in `Census::ractors`.
fn row(id: Option<u32>, name: Option<String>, state: &str) -> Option<RactorHeap> {
    Some(RactorHeap {
        id,
        name,
        state: state.into(),
        ..RactorHeap::default()
    })
}

/// The terminated Ractors' heaps (`vm->gc.zombie_objspaces`), with their Ractor's id and
/// name while its object lives.
fn zombies<M: Memory>(
    t: &TargetView<'_, M>,
    r: &RactorHeaps,
) -> Result<Vec<(u64, Option<RactorHeap>)>> {
    let (l, mem, vm) = (t.layout(), t.mem(), t.vm());
    let memory = |context| move |e| t.memory_error(context, e);
    let count = mem
        .read_u64(field(vm, r.zombie_count))
        .map_err(memory("reading the VM's terminated heaps"))?;
    let array = mem
        .read_u64(field(vm, r.zombies))
        .map_err(memory("reading the VM's terminated heaps"))?;
    // A count past the bound, or an array that does not read, was read while a Ractor
    // ended (the array grows by realloc): the set read after the pass differs, and the
    // census takes the pass again.
    let zombies = (count > 0 && count <= MAX_ZOMBIES)
        .then(|| mem.read_vec(array, count as usize * r.zombie_size).ok())
        .flatten()
        .unwrap_or_default();
    Ok(zombies
        .chunks_exact(r.zombie_size)
        .map(|entry| {
            let owner = word(entry, r.zombie_owner);
            // The owner is NULL once the terminated Ractor's object was collected.
            let (id, name) = if is_heap_object(owner) {
                let id = mem.read_vec(field(owner, l.ractor_id), 4).ok();
                let name = mem.read_u64(field(owner, l.ractor_name)).unwrap_or(0);
                (
                    id.map(|b| word32(&b, 0)),
                    is_heap_object(name)
                        .then(|| read_string(mem, l, name).ok())
                        .flatten(),
                )
            } else {
                (None, None)
            };
            (word(entry, 0), row(id, name, "terminated"))
        })
        .collect())
}
