//! Finding and checking the Ruby VM (`rb_vm_t`) of a process.
//!
//! With symbols, the VM is `*ruby_current_vm_ptr`. Debian's 3.3 and 3.4 libruby export no
//! such symbol, so the VM is found the way a human would in gdb without symbols: among the
//! pointers stored in libruby's writable data, the one whose target validates as a VM
//! through its own back-pointers (its main thread points back at it; its main ractor names
//! the same main thread). Candidates are checked in batches, a few system calls in all.
use crate::memory::word;
use crate::memory::{field, Memory};
use rbspy_ext_bindings::Layout;

/// What the walker needs from a validated VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VmRoots {
    pub vm: u64,
    pub main_thread: u64,
    /// Address of the word naming the thread that holds the GVL (0 when none does): in the
    /// VM before 3.0, in the main ractor after.
    pub gvl_owner: u64,
    /// Address of the `list_head` of every Ruby thread.
    pub thread_list: u64,
}

/// Most candidate pointers checked in one scan (libruby's data holds a few thousand).
const MAX_CANDIDATES: usize = 1 << 16;

/// Whether `p` can be a pointer to a Ruby structure (aligned, in user space, past page 0).
pub(crate) fn plausible(p: u64) -> bool {
    p > 0x10000 && p & 7 == 0 && p < 0x0000_8000_0000_0000
}

/// Checks `vm` through its back-pointers; None when it is not a VM (or unreadable).
pub fn check_vm<M: Memory>(mem: &M, l: &Layout, vm: u64) -> Option<VmRoots> {
    if !plausible(vm) {
        return None;
    }
    let mut head = vec![0u8; l.vm_main_thread.max(l.vm_main_ractor.unwrap_or(0)) + 8];
    mem.read(vm, &mut head).ok()?;
    let thread = word(&head, l.vm_main_thread);
    if !plausible(thread) || mem.read_u64(field(thread, l.thread_vm)).ok()? != vm {
        return None;
    }
    let ractor = l.vm_main_ractor.map_or(0, |offset| word(&head, offset));
    if let Some(main) = l.ractor_threads_main {
        if !plausible(ractor) || mem.read_u64(field(ractor, main)).ok()? != thread {
            return None;
        }
    }
    let gvl_owner = match (l.vm_gvl_owner, l.ractor_gvl_owner) {
        (Some(offset), _) => field(vm, offset),
        (None, Some(offset)) => field(ractor, offset),
        (None, None) => return None,
    };
    let thread_list = match (l.vm_living_threads, l.ractor_threads_set) {
        (Some(offset), _) => field(vm, offset),
        (None, Some(offset)) => field(ractor, offset),
        (None, None) => return None,
    };
    Some(VmRoots {
        vm,
        main_thread: thread,
        gvl_owner,
        thread_list,
    })
}

/// Scans `segments` (libruby's writable data) for a pointer to a VM. `heap` lists the
/// readable, writable mappings a VM can live in; pointers elsewhere are not candidates.
/// Returns the VM and how many candidates were examined.
pub fn find_vm<M: Memory>(
    mem: &M,
    l: &Layout,
    segments: &[(u64, u64)],
    heap: &[(u64, u64)],
) -> (Option<VmRoots>, usize) {
    let in_heap = |p: u64| heap.iter().any(|(s, e)| (*s..*e).contains(&p));
    let mut candidates: Vec<u64> = Vec::new();
    for &(start, end) in segments {
        let Ok(data) = mem.read_vec(start, end.saturating_sub(start).min(64 << 20) as usize) else {
            continue;
        };
        candidates.extend(
            data.chunks_exact(8)
                .map(|c| word(c, 0))
                .filter(|p| plausible(*p) && in_heap(*p)),
        );
    }
    candidates.sort_unstable();
    candidates.dedup();
    candidates.truncate(MAX_CANDIDATES);
    let examined = candidates.len();
    // Batch 1: each candidate's would-be main thread, which must itself be a heap pointer.
    let threads = read_words(mem, &candidates, l.vm_main_thread as u64);
    let pairs: Vec<(u64, u64)> = candidates
        .iter()
        .zip(threads)
        .filter_map(|(vm, t)| t.filter(|t| plausible(*t) && in_heap(*t)).map(|t| (*vm, t)))
        .collect();
    // Batch 2: that thread's `vm` must point back at the candidate.
    let thread_addrs: Vec<u64> = pairs.iter().map(|(_, t)| *t).collect();
    let back = read_words(mem, &thread_addrs, l.thread_vm as u64);
    let found = pairs
        .iter()
        .zip(back)
        .filter(|((vm, _), b)| *b == Some(*vm))
        .find_map(|((vm, _), _)| check_vm(mem, l, *vm));
    (found, examined)
}

/// Reads the word at `addr + offset` for every address, in batched calls; None where the
/// memory is not readable.
pub(crate) fn read_words<M: Memory>(mem: &M, addrs: &[u64], offset: u64) -> Vec<Option<u64>> {
    let mut bufs = vec![[0u8; 8]; addrs.len()];
    let ok = {
        let mut requests: Vec<(u64, &mut [u8])> = addrs
            .iter()
            .zip(bufs.iter_mut())
            .map(|(a, b)| (a.wrapping_add(offset), &mut b[..]))
            .collect();
        mem.read_each(&mut requests)
    };
    bufs.iter()
        .zip(ok)
        .map(|(b, ok)| ok.then(|| u64::from_le_bytes(*b)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryImage;
    use rbspy_ext_bindings::LAYOUTS;

    /// A fake address space: libruby data holding noise and one pointer to a VM whose main
    /// thread and ractor point back correctly, plus a decoy "VM" whose thread does not.
    #[test]
    fn scan_finds_the_vm_that_validates_and_skips_decoys() {
        for l in LAYOUTS {
            let (data, heap_start) = (0x1000u64, 0x100000u64);
            let (vm, decoy, thread, ractor) = (0x100000, 0x110000, 0x120000, 0x130000);
            let mut mem = MemoryImage::new();
            let mut heap = vec![0u8; 0x40000];
            let put = |heap: &mut Vec<u8>, at: u64, v: u64| {
                let o = (at - heap_start) as usize;
                heap[o..o + 8].copy_from_slice(&v.to_le_bytes());
            };
            put(&mut heap, vm + l.vm_main_thread as u64, thread);
            put(&mut heap, decoy + l.vm_main_thread as u64, thread);
            put(&mut heap, thread + l.thread_vm as u64, vm);
            if let (Some(r), Some(main)) = (l.vm_main_ractor, l.ractor_threads_main) {
                put(&mut heap, vm + r as u64, ractor);
                put(&mut heap, decoy + r as u64, ractor);
                put(&mut heap, ractor + main as u64, thread);
            }
            mem.map(heap_start, heap);
            let mut libdata = Vec::new();
            for w in [0u64, 42, decoy, 0xdead_beef, vm, heap_start + 8] {
                libdata.extend_from_slice(&w.to_le_bytes());
            }
            mem.map(data, libdata);
            let heap_range = [(heap_start, heap_start + 0x40000)];
            let (found, examined) = find_vm(&mem, l, &[(data, data + 48)], &heap_range);
            assert_eq!(found.map(|r| r.vm), Some(vm), "layout {}", l.name);
            assert_eq!(found.unwrap().main_thread, thread);
            assert_eq!(examined, 3);
            assert!(check_vm(&mem, l, decoy).is_none());
        }
    }
}
