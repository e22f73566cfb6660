//! Every Ruby thread of the target, for the recorder: the thread list, each thread's
//! identity (native tid, `Thread#name`), its state, and its stack.
//!
//! A child module of `spy` so that it shares the walker's private machinery.
use super::{word, Attempt, Frame, Memory, Spy};
use crate::error::{Error, Result};
use crate::objects::{is_heap_object, read_string};
use crate::profile::{ThreadInfo, ThreadState};
use rustc_hash::FxHashMap;
use std::time::{Duration, Instant};

/// Most threads followed along the thread list.
const MAX_THREADS: usize = 4096;
/// How long a thread list is trusted before it is read again (threads come and go).
const LIST_TTL: Duration = Duration::from_millis(100);
/// How often one thread's walk is retried when its stack moves while read.
const THREAD_ATTEMPTS: u32 = 2;

/// Which threads a sample covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ThreadSelection {
    /// Every Ruby thread.
    #[default]
    All,
    /// Only the thread holding the GVL (none when no thread holds it).
    GvlHolder,
}

/// One thread's part of a sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SampledThread {
    pub info: ThreadInfo,
    pub state: ThreadState,
    pub frames: Vec<Frame>,
}

#[derive(Debug, Default)]
pub(super) struct ThreadList {
    threads: Vec<(u64, ThreadInfo)>,
    read_at: Option<Instant>,
    /// The execution context each thread had when last sampled.
    ecs: FxHashMap<u64, u64>,
}

impl<M: Memory> Spy<M> {
    /// Follows the thread list (`vm->living_threads` or `ractor->threads.set`).
    fn read_thread_list(&mut self) -> std::result::Result<(), Attempt> {
        let l = self.layout;
        let node_offset = l.thread_list_node as u64;
        let head = self.thread_list_head;
        let mut node = self
            .mem
            .read_u64(head)
            .map_err(self.moved("reading the thread list"))?;
        let mut threads = Vec::new();
        while node != head {
            if threads.len() >= MAX_THREADS || !is_heap_object(node) {
                return Err(Attempt::Changed("thread list does not close".into()));
            }
            let thread = node - node_offset;
            threads.push((thread, self.thread_info(thread)?));
            node = self
                .mem
                .read_u64(node)
                .map_err(self.moved("reading the thread list"))?;
        }
        let ecs = std::mem::take(&mut self.thread_list.ecs);
        self.thread_list = ThreadList {
            threads,
            read_at: Some(Instant::now()),
            ecs,
        };
        Ok(())
    }

    fn thread_info(&self, thread: u64) -> std::result::Result<ThreadInfo, Attempt> {
        let l = self.layout;
        let name_value = self
            .mem
            .read_u64(thread + l.thread_name as u64)
            .map_err(self.moved("reading a thread"))?;
        let name = if is_heap_object(name_value) {
            read_string(&self.mem, l, name_value).ok()
        } else {
            None
        };
        let tid_addr = match (l.thread_tid, l.thread_nt, l.native_thread_tid) {
            (Some(off), _, _) => Some(thread + off as u64),
            (None, Some(nt), Some(off)) => {
                let nt = self.mem.read_u64(thread + nt as u64).unwrap_or(0);
                is_heap_object(nt).then_some(nt + off as u64)
            }
            _ => None,
        };
        let tid = tid_addr
            .and_then(|a| {
                let mut b = [0u8; 4];
                self.mem
                    .read(a, &mut b)
                    .ok()
                    .map(|_| i32::from_le_bytes(b) as i64)
            })
            .unwrap_or(0);
        Ok(ThreadInfo {
            pid: self.pid,
            tid,
            name,
            ruby_thread: thread,
            main: thread == self.main_thread,
        })
    }

    /// The Ruby threads of the target, as last read (re-read when older than 100 ms).
    pub fn threads(&mut self) -> Result<Vec<ThreadInfo>> {
        self.fresh_thread_list()?;
        Ok(self
            .thread_list
            .threads
            .iter()
            .map(|(_, i)| i.clone())
            .collect())
    }

    fn fresh_thread_list(&mut self) -> Result<()> {
        let stale = self
            .thread_list
            .read_at
            .is_none_or(|t| t.elapsed() >= LIST_TTL);
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
            pid: self.pid,
            attempts: super::SNAPSHOT_ATTEMPTS,
            last: "the thread list kept changing".into(),
        })
    }

    /// A thread (or its context) went away while read: forget the list so the next sample
    /// reads it again, and report this sample as dropped (or the process as gone).
    #[allow(clippy::type_complexity)]
    fn thread_list_changed(
        &mut self,
        what: &str,
        e: crate::error::MemoryError,
    ) -> Result<(Vec<SampledThread>, Vec<&'static str>)> {
        self.thread_list.read_at = None;
        self.thread_list.ecs.clear();
        match self.moved(what)(e) {
            Attempt::Fatal(e) => Err(e),
            Attempt::Changed(_) => Ok((Vec::new(), vec!["thread list changed"])),
        }
    }

    /// One sample of the selected threads: each thread's state and stack. Threads whose
    /// stack moved while read are left out and reported in the second list (by reason);
    /// nothing is ever invented.
    pub fn sample_threads(
        &mut self,
        which: ThreadSelection,
    ) -> Result<(Vec<SampledThread>, Vec<&'static str>)> {
        self.fresh_thread_list()?;
        let l = self.layout;
        let (status_byte, status_mask) = l.thread_status.unwrap_or((0, 0));
        let count = self.thread_list.threads.len();
        // One call: the GVL owner, and every thread's execution context, status, and the stack
        // fields of the context it had last time (a thread's context changes only when it
        // switches fibers, so this is usually all that is needed).
        let mut owner = [0u8; 8];
        let mut ecs = vec![[0u8; 8]; count];
        let mut statuses = vec![[0u8; 1]; count];
        let mut heads = vec![[0u8; 24]; count];
        let guessed: Vec<u64> = self
            .thread_list
            .threads
            .iter()
            .map(|(t, _)| self.thread_list.ecs.get(t).copied().unwrap_or(0))
            .collect();
        {
            let mut requests: Vec<(u64, &mut [u8])> = vec![(self.gvl_owner, &mut owner[..])];
            for ((((thread, _), ec), status), (head, guess)) in self
                .thread_list
                .threads
                .iter()
                .zip(ecs.iter_mut())
                .zip(statuses.iter_mut())
                .zip(heads.iter_mut().zip(&guessed))
            {
                requests.push((thread + l.thread_ec as u64, &mut ec[..]));
                requests.push((thread + status_byte as u64, &mut status[..]));
                if *guess != 0 {
                    requests.push((guess + l.ec_vm_stack as u64, &mut head[..]));
                }
            }
            if let Err(e) = self.mem.read_many(&mut requests) {
                return self.thread_list_changed("reading threads", e);
            }
        }
        let owner = word(&owner, 0);
        let runnable = l.thread_status_runnable << status_mask.trailing_zeros();
        let mut chosen: Vec<(usize, ThreadState)> = Vec::new();
        for (i, (thread, _)) in self.thread_list.threads.iter().enumerate() {
            let status = statuses[i][0] & status_mask;
            let state = if *thread == owner {
                ThreadState::Running
            } else if status_mask == 0 || u64::from(status) == runnable {
                ThreadState::WaitingForGvl
            } else {
                ThreadState::Blocked
            };
            if which == ThreadSelection::GvlHolder && state != ThreadState::Running {
                continue;
            }
            if !is_heap_object(word(&ecs[i], 0)) {
                continue; // a thread not started yet, or already gone
            }
            chosen.push((i, state));
        }
        // Contexts that changed since last time: one more call for their stack fields.
        let stale: Vec<usize> = chosen
            .iter()
            .map(|(i, _)| *i)
            .filter(|i| word(&ecs[*i], 0) != guessed[*i])
            .collect();
        if !stale.is_empty() {
            let mut fresh = vec![[0u8; 24]; stale.len()];
            {
                let mut requests: Vec<(u64, &mut [u8])> = stale
                    .iter()
                    .zip(fresh.iter_mut())
                    .map(|(i, h)| (word(&ecs[*i], 0) + l.ec_vm_stack as u64, &mut h[..]))
                    .collect();
                if let Err(e) = self.mem.read_many(&mut requests) {
                    return self.thread_list_changed("reading execution contexts", e);
                }
            }
            for (i, h) in stale.into_iter().zip(fresh) {
                heads[i] = h;
                let thread = self.thread_list.threads[i].0;
                self.thread_list.ecs.insert(thread, word(&ecs[i], 0));
            }
        }
        // One call for every chosen thread's frames; a thread whose stack moved is retried
        // alone, then counted as dropped.
        let contexts: Vec<[u64; 3]> = chosen
            .iter()
            .map(|(i, _)| self.ec_fields(&heads[*i]))
            .collect();
        let results = self.walk_many(&contexts);
        let mut sampled = Vec::with_capacity(chosen.len());
        let mut dropped = Vec::new();
        for (((i, state), ec), first) in chosen.into_iter().zip(contexts).zip(results) {
            let mut result = match first {
                Ok(frames) => Some(frames),
                Err(Attempt::Fatal(e)) => return Err(e),
                Err(Attempt::Changed(_)) => None,
            };
            for _ in 1..THREAD_ATTEMPTS {
                if result.is_some() {
                    break;
                }
                self.heap_envs.clear();
                match self.walk(ec) {
                    Ok(frames) => result = Some(frames),
                    Err(Attempt::Fatal(e)) => return Err(e),
                    Err(Attempt::Changed(_)) => {}
                }
            }
            match result {
                Some(frames) => sampled.push(SampledThread {
                    info: self.thread_list.threads[i].1.clone(),
                    state,
                    frames,
                }),
                None => dropped.push("stack changed while read"),
            }
        }
        Ok((sampled, dropped))
    }
}
