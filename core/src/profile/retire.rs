//! Threads that ended, merged: a recording of a process that keeps starting threads (a pool
//! that churns, a thread per job) would otherwise keep every thread it ever saw, with its
//! stacks, and grow for as long as it records. Past [`MAX_THREADS`] threads, those not
//! sampled for [`ENDED_AFTER_TICKS`] ticks (every live thread is sampled at every tick,
//! blocked or not, so such a thread has ended) become one thread per process, named "ended
//! threads", whose stacks are their stacks summed. Counts, frames, tags and the timeline
//! (renumbered) are kept; only which of the ended threads a sample came from is lost.
use super::{Aggregator, StackCount, ThreadInfo};
use rustc_hash::FxHashMap;

/// Threads kept apart, at the most, before ended ones are merged.
pub const MAX_THREADS: usize = 256;
/// A thread not sampled for this many ticks has ended.
pub const ENDED_AFTER_TICKS: u64 = 1_000;
/// How often (in ticks) the count of threads is looked at.
const CHECK_EVERY_TICKS: u64 = 256;
/// The name of the thread ended threads are merged into.
pub const ENDED_THREADS: &str = "ended threads";

impl Aggregator {
    /// Notes that thread `index` was sampled at this tick.
    pub(super) fn seen(&mut self, index: u32) {
        let index = index as usize;
        if self.last_seen.len() <= index {
            self.last_seen.resize(index + 1, 0);
        }
        self.last_seen[index] = self.profile.ticks;
    }

    /// From `tick`: merges ended threads once there are more than [`MAX_THREADS`].
    pub(super) fn retire_if_due(&mut self) {
        let ticks = self.profile.ticks;
        if !ticks.is_multiple_of(CHECK_EVERY_TICKS) || self.profile.threads.len() <= MAX_THREADS {
            return;
        }
        let merged: Vec<u32> = self.merged.values().copied().collect();
        let ended: Vec<bool> = (0..self.profile.threads.len())
            .map(|i| {
                let seen = self.last_seen.get(i).copied().unwrap_or(0);
                !merged.contains(&(i as u32)) && ticks.saturating_sub(seen) > ENDED_AFTER_TICKS
            })
            .collect();
        if ended.iter().any(|&e| e) {
            self.merge_threads(&ended);
        }
    }

    /// Merges the threads `ended` marks into their process's "ended threads".
    fn merge_threads(&mut self, ended: &[bool]) {
        let old = std::mem::take(&mut self.profile.threads);
        let mut threads: Vec<ThreadInfo> = Vec::with_capacity(old.len());
        let mut thread_map: Vec<u32> = vec![0; old.len()];
        let mut merged_now = 0u64;
        // The threads kept first, in order: their indexes only shift down.
        for (i, t) in old.iter().enumerate().filter(|(i, _)| !ended[*i]) {
            thread_map[i] = threads.len() as u32;
            threads.push(t.clone());
        }
        let mut merged: FxHashMap<i32, u32> = FxHashMap::default();
        for (&pid, &at) in &self.merged {
            merged.insert(pid, thread_map[at as usize]);
        }
        for (i, t) in old.iter().enumerate().filter(|(i, _)| ended[*i]) {
            let into = *merged.entry(t.pid).or_insert_with(|| {
                threads.push(ThreadInfo {
                    pid: t.pid,
                    tid: 0,
                    name: Some(ENDED_THREADS.to_string()),
                    ruby_thread: 0,
                    main: false,
                    ractor: 0,
                    ractor_name: None,
                });
                (threads.len() - 1) as u32
            });
            thread_map[i] = into;
            merged_now += 1;
        }
        self.retired += merged_now;
        self.merged = merged;
        let mut last_seen = vec![0; threads.len()];
        for (o, &new) in thread_map.iter().enumerate() {
            let seen = self.last_seen.get(o).copied().unwrap_or(0);
            last_seen[new as usize] = last_seen[new as usize].max(seen);
        }
        self.last_seen = last_seen;
        self.profile.threads = threads;
        self.renumber_stacks(&thread_map);
        let gone = |id: &u32| ended.get(*id as usize).copied().unwrap_or(false);
        self.thread_ids.retain(|_, id| !gone(id));
        self.latest_thread.retain(|_, id| !gone(id));
        for id in self
            .thread_ids
            .values_mut()
            .chain(self.latest_thread.values_mut())
        {
            *id = thread_map[*id as usize];
        }
        let note = format!(
            "{} threads that ended were merged into \"{ENDED_THREADS}\" (past {MAX_THREADS} threads)",
            self.retired
        );
        self.profile
            .notes
            .retain(|n| !n.ends_with(&format!("(past {MAX_THREADS} threads)")));
        self.profile.notes.push(note);
    }

    /// The stacks again with threads renumbered by `thread_map`: stacks that now read the
    /// same are summed, and the timeline follows.
    fn renumber_stacks(&mut self, thread_map: &[u32]) {
        let old = std::mem::take(&mut self.profile.stacks);
        let mut remap: Vec<u32> = Vec::with_capacity(old.len());
        self.stack_ids.clear();
        self.stack_by_token.clear();
        for s in old {
            let thread = thread_map[s.thread as usize];
            let key = (thread, s.state, s.frames, s.tags);
            let index = match self.stack_ids.get(&key) {
                Some(&index) => {
                    self.profile.stacks[index].count += s.count;
                    index
                }
                None => {
                    self.profile.stacks.push(StackCount {
                        thread,
                        state: key.1,
                        frames: key.2.clone(),
                        count: s.count,
                        tags: key.3,
                    });
                    let index = self.profile.stacks.len() - 1;
                    self.stack_ids.insert(key, index);
                    index
                }
            };
            remap.push(index as u32);
        }
        // In place: every sample keeps its place, only its stack's number changes.
        for stack in &mut self.timeline.stacks {
            *stack = remap[*stack as usize];
        }
    }
}
