//! The target's Ruby threads: following every Ractor's thread list and naming each thread
//! (native tid, `Thread#name`, its Ractor). Re-read every `LIST_TTL`, or at the next sample
//! when a sample finds it changed or a GVL held by a thread it does not have.
//!
//! Before 3.0 the VM keeps one list. From 3.0 every Ractor keeps its own, with its own GVL
//! (`threads.sched.running`, or `threads.gvl.owner` before 3.2), and the VM links the
//! Ractors in `vm->ractor.set`, the main one first. A process that never starts a Ractor has
//! one entry there, so the list costs it two reads per `LIST_TTL` and nothing per sample.
use super::attach::Target;
use super::leaves::Attempt;
use crate::memory::{field, word, word32, Memory};
use crate::model::ThreadInfo;
use crate::objects::{is_heap_object, read_string};
use std::sync::Arc;
use std::time::Duration;

/// Most threads followed along the thread lists, all Ractors together.
pub(super) const MAX_THREADS: usize = 4096;
/// Most Ractors followed along the VM's list.
const MAX_RACTORS: usize = 1024;
/// How long a thread list is trusted before it is read again (threads come and go).
pub(super) const LIST_TTL: Duration = Duration::from_millis(100);
/// The least time between readings caused by a GVL owner the list does not have.
pub(super) const RELIST_MIN: Duration = Duration::from_millis(2);

/// A Ruby thread as the list last read it.
#[derive(Debug, Clone)]
pub(super) struct Listed {
    /// Its `rb_thread_t`.
    pub(super) thread: u64,
    pub(super) info: Arc<ThreadInfo>,
    /// Its Ractor's index in `ThreadSampler::ractors`.
    pub(super) ractor: usize,
}

/// A Ractor as the list last read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RactorEntry {
    /// `pub.id` (1 for the main Ractor; 0 before 3.0) and `name`.
    pub(super) id: u32,
    pub(super) name: Option<String>,
    /// Address of its thread list's head.
    pub(super) threads: u64,
    /// Address of the word naming its thread that holds its GVL (0 when none does).
    pub(super) owner: u64,
    /// The `rb_objspace` whose flags say whether its threads are in GC: its own where each
    /// Ractor owns a heap (`r->objspace`), else the VM's (0 when unknown).
    pub(super) objspace: u64,
}

/// Every Ractor along `vm->ractor.set`, each read in one call (its list node, id and
/// name); before 3.0, the VM's one thread list as the only "Ractor".
pub(super) fn read_ractors<M: Memory>(
    t: &Target<M>,
) -> std::result::Result<Vec<RactorEntry>, Attempt> {
    let l = t.layout;
    let main = RactorEntry {
        id: u32::from(l.vm_ractor_set.is_some()),
        name: None,
        threads: t.thread_list_head,
        owner: t.gvl_owner,
        objspace: t.main_objspace(),
    };
    let (Some(set), Some(threads), Some(owner)) =
        (l.vm_ractor_set, l.ractor_threads_set, l.ractor_gvl_owner)
    else {
        return Ok(vec![main]);
    };
    let head = field(t.vm, set);
    let offsets = [l.ractor_list_node, l.ractor_id, l.ractor_name]
        .into_iter()
        .chain(l.ractor_objspace);
    let from = offsets.clone().min().unwrap_or(0);
    let span = offsets.max().unwrap_or(0) + 8 - from;
    let mut ractors = Vec::new();
    let mut node = t.read_word(head, 0, "reading the ractor list")?;
    while node != head {
        if ractors.len() >= MAX_RACTORS || !is_heap_object(node) {
            return Err(Attempt::Changed("ractor list does not close".into()));
        }
        let ractor = node.wrapping_sub(l.ractor_list_node as u64);
        let bytes = t
            .mem
            .read_vec(field(ractor, from), span)
            .map_err(t.moved("reading a ractor"))?;
        let name = word(&bytes, l.ractor_name - from);
        ractors.push(RactorEntry {
            id: word32(&bytes, l.ractor_id - from),
            name: is_heap_object(name)
                .then(|| read_string(&t.mem, l, name).ok())
                .flatten(),
            threads: field(ractor, threads),
            owner: field(ractor, owner),
            objspace: l
                .ractor_objspace
                .map_or(main.objspace, |o| word(&bytes, o - from)),
        });
        node = word(&bytes, l.ractor_list_node - from);
    }
    // The main Ractor is on the list from the start; one missing means a list read while
    // it changed (or not a list at all).
    if !ractors.iter().any(|r| r.threads == main.threads) {
        return Err(Attempt::Changed("ractor list lacks the main ractor".into()));
    }
    Ok(ractors)
}

pub(super) fn thread_info<M: Memory>(
    t: &Target<M>,
    thread: u64,
) -> std::result::Result<ThreadInfo, Attempt> {
    let l = t.layout;
    let name_value = t.read_word(thread, l.thread_name, "reading a thread")?;
    let name = if is_heap_object(name_value) {
        read_string(&t.mem, l, name_value).ok()
    } else {
        None
    };
    let tid_addr = match (l.thread_tid, l.thread_nt, l.native_thread_tid) {
        (Some(off), _, _) => Some(field(thread, off)),
        (None, Some(nt), Some(off)) => {
            let nt = t.mem.read_u64(field(thread, nt)).unwrap_or(0);
            is_heap_object(nt).then_some(field(nt, off))
        }
        _ => match (l.thread_pthread, t.pthread_tid) {
            // 2.7 and 3.0: the tid glibc keeps in the thread's `struct pthread`.
            (Some(pthread), Some(off)) => {
                let p = t.mem.read_u64(field(thread, pthread)).unwrap_or(0);
                is_heap_object(p).then_some(p.wrapping_add(off))
            }
            _ => None,
        },
    };
    let tid = tid_addr
        .and_then(|a| {
            let mut b = [0u8; 4];
            t.mem
                .read(a, &mut b)
                .ok()
                .map(|_| i32::from_le_bytes(b) as i64)
        })
        .unwrap_or(0);
    Ok(ThreadInfo {
        pid: t.pid,
        tid,
        name,
        ruby_thread: thread,
        main: thread == t.main_thread,
        ractor: 0,
        ractor_name: None,
    })
}
