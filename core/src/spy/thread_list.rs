//! The target's Ruby threads: following the thread list and naming each thread (native tid,
//! `Thread#name`). Re-read every `LIST_TTL`, or at once when a sample finds it changed.
use super::{field, Attempt, Memory, Spy};
use crate::error::{Error, Result};
use crate::model::ThreadInfo;
use crate::objects::{is_heap_object, read_string};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most threads followed along the thread list.
pub(super) const MAX_THREADS: usize = 4096;
/// How long a thread list is trusted before it is read again (threads come and go).
const LIST_TTL: Duration = Duration::from_millis(100);

impl<M: Memory> Spy<M> {
    /// Follows the thread list (`vm->living_threads` or `ractor->threads.set`).
    pub(super) fn read_thread_list(&mut self) -> std::result::Result<(), Attempt> {
        let l = self.target.layout;
        let node_offset = l.thread_list_node as u64;
        let head = self.target.thread_list_head;
        let mut node = self
            .target
            .mem
            .read_u64(head)
            .map_err(self.moved("reading the thread list"))?;
        let mut threads = Vec::new();
        while node != head {
            if threads.len() >= MAX_THREADS || !is_heap_object(node) {
                return Err(Attempt::Changed("thread list does not close".into()));
            }
            let thread = node - node_offset;
            threads.push((thread, Arc::new(self.thread_info(thread)?)));
            node = self
                .target
                .mem
                .read_u64(node)
                .map_err(self.moved("reading the thread list"))?;
        }
        self.sampler.threads = threads;
        self.sampler.read_at = Some(Instant::now());
        Ok(())
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
        })
    }

    /// The Ruby threads of the target, as last read (re-read when older than 100 ms).
    pub fn threads(&mut self) -> Result<Vec<ThreadInfo>> {
        self.fresh_thread_list()?;
        Ok(self
            .sampler
            .threads
            .iter()
            .map(|(_, i)| ThreadInfo::clone(i))
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
