//! The target's Ruby threads: following every Ractor's thread list and naming each thread
//! (native tid, `Thread#name`, its Ractor). Re-read every `LIST_TTL`, or at once when a
//! sample finds it changed.
//!
//! Before 3.0 the VM keeps one list. From 3.0 every Ractor keeps its own, with its own GVL
//! (`threads.sched.running`, or `threads.gvl.owner` before 3.2), and the VM links the
//! Ractors in `vm->ractor.set`, the main one first. A process that never starts a Ractor has
//! one entry there, so the list costs it two reads per `LIST_TTL` and nothing per sample.
use super::{field, Attempt, Memory, Spy};
use crate::error::{Error, Result};
use crate::memory::{word, word32};
use crate::model::ThreadInfo;
use crate::objects::{is_heap_object, read_string};
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most threads followed along the thread lists, all Ractors together.
pub(super) const MAX_THREADS: usize = 4096;
/// Most Ractors followed along the VM's list.
const MAX_RACTORS: usize = 1024;
/// How long a thread list is trusted before it is read again (threads come and go).
const LIST_TTL: Duration = Duration::from_millis(100);

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
}

impl<M: Memory> Spy<M> {
    /// Follows every Ractor's thread list (`vm->living_threads` before 3.0).
    pub(super) fn read_thread_list(&mut self) -> std::result::Result<(), Attempt> {
        let ractors = self.read_ractors()?;
        let node_offset = self.target.layout.thread_list_node as u64;
        // Under M:N threads (a non-main Ractor's from 3.3) a thread that sleeps holds no
        // native thread, so it reads tid 0; it keeps the tid it was last seen on, or every
        // nap would make it a new thread in a profile.
        let known: FxHashMap<(u64, u32), i64> = self
            .sampler
            .threads
            .iter()
            .filter(|t| t.info.tid != 0)
            .map(|t| ((t.thread, t.info.ractor), t.info.tid))
            .collect();
        let mut threads = Vec::new();
        for (index, ractor) in ractors.iter().enumerate() {
            let head = ractor.threads;
            let mut node = self
                .target
                .mem
                .read_u64(head)
                .map_err(self.moved("reading the thread list"))?;
            while node != head {
                if threads.len() >= MAX_THREADS || !is_heap_object(node) {
                    return Err(Attempt::Changed("thread list does not close".into()));
                }
                let thread = node - node_offset;
                let mut info = self.thread_info(thread)?;
                info.ractor = ractor.id;
                info.ractor_name = ractor.name.clone();
                if info.tid == 0 {
                    info.tid = known.get(&(thread, ractor.id)).copied().unwrap_or(0);
                }
                threads.push(Listed {
                    thread,
                    info: Arc::new(info),
                    ractor: index,
                });
                node = self
                    .target
                    .mem
                    .read_u64(node)
                    .map_err(self.moved("reading the thread list"))?;
            }
        }
        self.sampler.threads = threads;
        self.sampler.ractors = ractors;
        self.sampler.read_at = Some(Instant::now());
        Ok(())
    }

    /// Every Ractor along `vm->ractor.set`, each read in one call (its list node, id and
    /// name); before 3.0, the VM's one thread list as the only "Ractor".
    fn read_ractors(&self) -> std::result::Result<Vec<RactorEntry>, Attempt> {
        let l = self.target.layout;
        let main = RactorEntry {
            id: u32::from(l.vm_ractor_set.is_some()),
            name: None,
            threads: self.target.thread_list_head,
            owner: self.target.gvl_owner,
        };
        let (Some(set), Some(threads), Some(owner)) =
            (l.vm_ractor_set, l.ractor_threads_set, l.ractor_gvl_owner)
        else {
            return Ok(vec![main]);
        };
        let head = field(self.target.vm, set);
        let offsets = [l.ractor_list_node, l.ractor_id, l.ractor_name];
        let from = offsets.iter().copied().min().unwrap_or(0);
        let span = offsets.iter().copied().max().unwrap_or(0) + 8 - from;
        let mut ractors = Vec::new();
        let mut node = self.read_word(head, 0, "reading the ractor list")?;
        while node != head {
            if ractors.len() >= MAX_RACTORS || !is_heap_object(node) {
                return Err(Attempt::Changed("ractor list does not close".into()));
            }
            let ractor = node.wrapping_sub(l.ractor_list_node as u64);
            let bytes = self
                .target
                .mem
                .read_vec(field(ractor, from), span)
                .map_err(self.moved("reading a ractor"))?;
            let name = word(&bytes, l.ractor_name - from);
            ractors.push(RactorEntry {
                id: word32(&bytes, l.ractor_id - from),
                name: is_heap_object(name)
                    .then(|| read_string(&self.target.mem, l, name).ok())
                    .flatten(),
                threads: field(ractor, threads),
                owner: field(ractor, owner),
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

    pub(super) fn thread_info(&self, thread: u64) -> std::result::Result<ThreadInfo, Attempt> {
        let l = self.target.layout;
        let name_value = self.read_word(thread, l.thread_name, "reading a thread")?;
        let name = if is_heap_object(name_value) {
            read_string(&self.target.mem, l, name_value).ok()
        } else {
            None
        };
        let tid_addr = match (l.thread_tid, l.thread_nt, l.native_thread_tid) {
            (Some(off), _, _) => Some(field(thread, off)),
            (None, Some(nt), Some(off)) => {
                let nt = self.target.mem.read_u64(field(thread, nt)).unwrap_or(0);
                is_heap_object(nt).then_some(field(nt, off))
            }
            _ => match (l.thread_pthread, self.target.pthread_tid) {
                // 2.7 and 3.0: the tid glibc keeps in the thread's `struct pthread`.
                (Some(pthread), Some(off)) => {
                    let p = self
                        .target
                        .mem
                        .read_u64(field(thread, pthread))
                        .unwrap_or(0);
                    is_heap_object(p).then_some(p.wrapping_add(off))
                }
                _ => None,
            },
        };
        let tid = tid_addr
            .and_then(|a| {
                let mut b = [0u8; 4];
                self.target
                    .mem
                    .read(a, &mut b)
                    .ok()
                    .map(|_| i32::from_le_bytes(b) as i64)
            })
            .unwrap_or(0);
        Ok(ThreadInfo {
            pid: self.target.pid,
            tid,
            name,
            ruby_thread: thread,
            main: thread == self.target.main_thread,
            ractor: 0,
            ractor_name: None,
        })
    }

    /// The Ruby threads of the target, as last read (re-read when older than 100 ms).
    pub fn threads(&mut self) -> Result<Vec<ThreadInfo>> {
        self.fresh_thread_list()?;
        Ok(self
            .sampler
            .threads
            .iter()
            .map(|t| ThreadInfo::clone(&t.info))
            .collect())
    }

    pub(super) fn fresh_thread_list(&mut self) -> Result<()> {
        let stale = self.sampler.read_at.is_none_or(|t| t.elapsed() >= LIST_TTL);
        if !stale {
            return Ok(());
        }
        for _ in 0..super::SNAPSHOT_ATTEMPTS {
            match self.read_thread_list() {
                Ok(()) => return Ok(()),
                Err(Attempt::Fatal(e)) => return Err(e),
                Err(Attempt::Changed(_)) => {}
            }
        }
        Err(Error::StackChanged {
            pid: self.target.pid,
            attempts: super::SNAPSHOT_ATTEMPTS,
            last: "the thread list kept changing".into(),
        })
    }
}
