//! A recorded profile: samples aggregated as they arrive, so memory grows with the number of
//! distinct (thread, state, stack) combinations, not with the recording's length. Output
//! formats live in `crate::output`.
use crate::model::{Frame, Sample, Tags};
/// Where the profile's thread states and identities are defined (re-exported for its users).
pub use crate::model::{ThreadInfo, ThreadState};
use crate::timeline::Timeline;
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Version of the raw profile format (`output::raw`); bump on incompatible changes.
pub const RAW_FORMAT_VERSION: u32 = 1;

/// One aggregated stack.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StackCount {
    /// Index into `Profile::threads`.
    pub thread: u32,
    pub state: ThreadState,
    /// Indexes into `Profile::frames`, innermost first.
    pub frames: Vec<u32>,
    pub count: u64,
    /// Index into `Profile::tag_sets`: the tags of the fiber the thread was running
    /// (0: none).
    #[serde(default)]
    pub tags: u32,
}

/// One set of tags, `(key, value)` as text.
pub type TagSet = Vec<(String, String)>;

/// A whole recording.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Profile {
    pub pid: i32,
    pub ruby_version: String,
    /// Requested sampling rate.
    pub rate_hz: f64,
    /// Wall-clock start (Unix epoch, nanoseconds) and length of the recording.
    pub start_unix_ns: u64,
    pub duration_ns: u64,
    /// Sample ticks attempted, and thread stacks recorded.
    pub ticks: u64,
    pub samples: u64,
    /// Samples dropped, by reason (e.g. "stack changed while read").
    pub errors: BTreeMap<String, u64>,
    /// Things the user should know (the target exited, a subprocess appeared...).
    pub notes: Vec<String>,
    pub threads: Vec<ThreadInfo>,
    /// `Frame` is not serde-aware; the raw format converts it through a mirror struct.
    #[serde(with = "crate::model::frame_serde")]
    pub frames: Vec<Frame>,
    pub stacks: Vec<StackCount>,
    /// What the recording cost: CPU time of the sampler thread and `process_vm_readv`
    /// calls made (0 when unknown, e.g. in files written before these existed).
    #[serde(default)]
    pub sampler_cpu_ns: u64,
    /// The part of `sampler_cpu_ns` spent sampling, from each wake-up to the end of its
    /// sample (measured on every 16th tick and scaled); the rest is waking up and sleeping.
    #[serde(default)]
    pub sampler_work_ns: u64,
    #[serde(default)]
    pub read_calls: u64,
    /// With the BPF sampler: the program's run time and the recorder's wake-ups.
    #[serde(default)]
    pub kernel: Option<crate::cost::KernelCost>,
    /// Every distinct set of tags seen; `tag_sets[0]` is the empty set.
    #[serde(default = "no_tags")]
    pub tag_sets: Vec<TagSet>,
    /// The samples in the order they were taken (empty in files written before it existed,
    /// and in profiles shaped for a view).
    #[serde(default)]
    pub timeline: Timeline,
    /// The worker number of each process a preforking server forked ("0", "1"...), and
    /// "master" for the recorded process when it has any (`process::worker_name`); pprof
    /// labels samples with it. Empty for a profile of a single process.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub workers: BTreeMap<i32, String>,
    /// What a stack's count is when not a sample of time: "objects" or "bytes" for a view
    /// of allocations (`allocs::view`), which the flamegraph shows in place of "samples".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count_name: Option<String>,
    /// The JIT whose code the target ran at the end of the recording ("YJIT", "ZJIT"), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jit: Option<String>,
}

fn no_tags() -> Vec<TagSet> {
    vec![Vec::new()]
}

impl Profile {
    /// The tags of one aggregated stack.
    pub fn tags_of(&self, stack: &StackCount) -> &[(String, String)] {
        self.tag_sets
            .get(stack.tags as usize)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// The value of tag `key` on one aggregated stack.
    pub fn tag_value(&self, stack: &StackCount, key: &str) -> Option<&str> {
        self.tags_of(stack)
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The same recording with other frames and stacks; `samples` is recounted.
    pub fn with_stacks(&self, frames: Vec<Frame>, stacks: Vec<StackCount>) -> Profile {
        Profile {
            pid: self.pid,
            ruby_version: self.ruby_version.clone(),
            rate_hz: self.rate_hz,
            start_unix_ns: self.start_unix_ns,
            duration_ns: self.duration_ns,
            ticks: self.ticks,
            samples: stacks.iter().map(|s| s.count).sum(),
            errors: self.errors.clone(),
            notes: self.notes.clone(),
            threads: self.threads.clone(),
            frames,
            stacks,
            sampler_cpu_ns: self.sampler_cpu_ns,
            kernel: self.kernel,
            sampler_work_ns: self.sampler_work_ns,
            read_calls: self.read_calls,
            tag_sets: self.tag_sets.clone(),
            timeline: Timeline::default(),
            workers: self.workers.clone(),
            count_name: self.count_name.clone(),
            jit: self.jit.clone(),
        }
    }

    /// The same recording with tag `key` = `value` on every sample that does not carry `key`
    /// already: a recording of one example names the example on every thread's samples,
    /// those of threads started before it (a server thread) included.
    pub fn with_tag(&self, key: &str, value: &str) -> Profile {
        let mut sets: Vec<TagSet> = vec![Vec::new()];
        let mut index: FxHashMap<TagSet, u32> = FxHashMap::default();
        index.insert(Vec::new(), 0);
        let mut intern = |mut set: TagSet| {
            if !set.iter().any(|(k, _)| k == key) {
                set.push((key.to_string(), value.to_string()));
            }
            *index.entry(set.clone()).or_insert_with(|| {
                sets.push(set);
                (sets.len() - 1) as u32
            })
        };
        let remap: Vec<u32> = self.tag_sets.iter().cloned().map(&mut intern).collect();
        let untagged = intern(Vec::new());
        let mut tagged = self.clone();
        for s in &mut tagged.stacks {
            s.tags = remap.get(s.tags as usize).copied().unwrap_or(untagged);
        }
        tagged.tag_sets = sets;
        tagged
    }

    /// A profile of only the stacks `keep` accepts (frames and threads are kept whole, so
    /// indexes stay valid); `samples` is recounted.
    pub fn filtered(&self, keep: impl Fn(&StackCount) -> bool) -> Profile {
        let mut kept = Vec::new();
        let remap: Vec<Option<u32>> = self
            .stacks
            .iter()
            .map(|s| {
                keep(s).then(|| {
                    kept.push(s.clone());
                    (kept.len() - 1) as u32
                })
            })
            .collect();
        let mut part = self.with_stacks(self.frames.clone(), kept);
        part.timeline = self.timeline.remapped(&remap);
        part
    }

    /// The profile split by `key` of each stack, in first-seen order of the keys: one pass
    /// over the stacks and one over the timeline, however many parts (a suite split by
    /// example has thousands).
    pub fn split_by<K: Eq + std::hash::Hash + Clone>(
        &self,
        key: impl Fn(&StackCount) -> K,
    ) -> Vec<(K, Profile)> {
        let mut keys: Vec<K> = Vec::new();
        let mut index: FxHashMap<K, usize> = FxHashMap::default();
        let mut parts: Vec<(Vec<StackCount>, Timeline)> = Vec::new();
        let place: Vec<(usize, u32)> = self
            .stacks
            .iter()
            .map(|s| {
                let k = key(s);
                let g = *index.entry(k.clone()).or_insert_with(|| {
                    keys.push(k);
                    parts.push(Default::default());
                    parts.len() - 1
                });
                parts[g].0.push(s.clone());
                (g, (parts[g].0.len() - 1) as u32)
            })
            .collect();
        for (&at, &stack) in self.timeline.at_us.iter().zip(&self.timeline.stacks) {
            if let Some(&(g, i)) = place.get(stack as usize) {
                parts[g].1.at_us.push(at);
                parts[g].1.stacks.push(i);
            }
        }
        keys.into_iter()
            .zip(parts)
            .map(|(k, (stacks, timeline))| {
                let mut part = self.with_stacks(self.frames.clone(), stacks);
                part.timeline = timeline;
                (k, part)
            })
            .collect()
    }
}

/// Builds a [`Profile`] sample by sample.
#[derive(Debug, Default)]
pub struct Aggregator {
    profile: Profile,
    frame_ids: FxHashMap<Frame, u32>,
    frame_ids_by_address: FxHashMap<(usize, usize, i32, bool), u32>,
    keep_alive: Vec<Frame>,
    thread_ids: FxHashMap<(i32, u64, i64), u32>,
    /// The newest thread index of each (pid, Ruby thread), for samples whose tid is unknown.
    latest_thread: FxHashMap<(i32, u64), u32>,
    stack_ids: FxHashMap<(u32, ThreadState, Vec<u32>, u32), usize>,
    /// Stack index by (pid, walker token, Ruby thread, tid, state, tag set); see `add_stack`.
    stack_by_token: FxHashMap<(i32, u64, u64, i64, ThreadState, u32), usize>,
    tag_ids: FxHashMap<Tags, u32>,
    /// The samples in order, kept apart until `finish` (a live copy of the profile, made
    /// every half second, need not copy it); and the current tick's time.
    timeline: Timeline,
    tick_us: u64,
    timeline_full: bool,
    /// By thread index: the tick it was last sampled at (profile/retire.rs).
    last_seen: Vec<u64>,
    /// By process: the index of its "ended threads", once it has one.
    merged: FxHashMap<i32, u32>,
    /// Threads merged into "ended threads" so far.
    retired: u64,
}

/// Most walker tokens remembered by the aggregator.
const MAX_TOKENS: usize = 65_536;

impl Aggregator {
    pub fn new(pid: i32, ruby_version: &str, rate_hz: f64, start_unix_ns: u64) -> Self {
        Aggregator {
            profile: Profile {
                pid,
                tag_sets: no_tags(),
                ruby_version: ruby_version.to_string(),
                rate_hz,
                start_unix_ns,
                ..Profile::default()
            },
            ..Aggregator::default()
        }
    }

    /// Records one sample: each thread's stack at the time the sample was read (`started`:
    /// when the recording began; a sample read before the tick began counts at the tick),
    /// and the samples it dropped, by reason. What both samplers' loops hand over.
    pub fn add(&mut self, sample: &Sample, started: std::time::Instant) {
        if let Some(read) = sample.read_at {
            self.read_at(read.saturating_duration_since(started));
        }
        for t in &sample.threads {
            self.add_stack(&t.info, t.state, t.stack_token, &t.frames, &t.tags);
        }
        for why in &sample.dropped {
            self.errors(why.name(), why.count());
        }
    }

    /// Records one thread's stack (innermost frame first), outside any sample: for tests
    /// and for profiles built from other sources.
    pub fn add_frames(&mut self, thread: &ThreadInfo, state: ThreadState, frames: &[Frame]) {
        self.add_count(thread, state, frames, 1);
    }

    pub fn add_count(&mut self, thread: &ThreadInfo, state: ThreadState, frames: &[Frame], n: u64) {
        let index = self.stack_index(thread, state, frames, 0);
        self.count(index, thread, n);
    }

    /// The index of a set of tags in `Profile::tag_sets`, added if new.
    fn tag_id(&mut self, tags: &Tags) -> u32 {
        if tags.is_empty() {
            return 0;
        }
        if let Some(id) = self.tag_ids.get(tags) {
            return *id;
        }
        let sets = &mut self.profile.tag_sets;
        if sets.is_empty() {
            sets.push(Vec::new());
        }
        sets.push(
            tags.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        let id = (sets.len() - 1) as u32;
        self.tag_ids.insert(tags.clone(), id);
        id
    }

    /// Records one thread's stack as the walker handed it out: a stack whose token was seen
    /// before for this thread and state is counted without looking at its frames.
    pub fn add_stack(
        &mut self,
        thread: &ThreadInfo,
        state: ThreadState,
        token: u64,
        frames: &[Frame],
        tags: &Tags,
    ) {
        let tag_id = self.tag_id(tags);
        let key = (
            thread.pid,
            token,
            thread.ruby_thread,
            thread.tid,
            state,
            tag_id,
        );
        let index = match self.stack_by_token.get(&key) {
            Some(index) => *index,
            None => {
                let index = self.stack_index(thread, state, frames, tag_id);
                // Only a shortcut: forgetting it costs one lookup by frames.
                if self.stack_by_token.len() >= MAX_TOKENS {
                    self.stack_by_token.clear();
                }
                self.stack_by_token.insert(key, index);
                index
            }
        };
        self.count(index, thread, 1);
    }

    fn count(&mut self, index: usize, thread: &ThreadInfo, n: u64) {
        self.profile.stacks[index].count += n;
        self.profile.samples += n;
        if !self.timeline_full && !self.timeline.push(self.tick_us, index, n) {
            self.timeline_full = true;
            self.note(format!(
                "the timeline stops after {} samples or 71 minutes; the aggregate goes on",
                crate::timeline::MAX_SAMPLES
            ));
        }
        let thread_index = self.profile.stacks[index].thread;
        self.seen(thread_index);
        // A thread may be named after it was first seen.
        let recorded = &mut self.profile.threads[thread_index as usize];
        if thread.name.is_some() && recorded.name != thread.name {
            recorded.name = thread.name.clone();
        }
    }

    /// The index of a thread not seen with this tid. A Ruby thread's address is reused once
    /// it ends, so the tid tells a new thread from an old one; but an M:N thread (a non-main
    /// Ractor's from 3.3) asleep holds no native thread and reads tid 0, and one seen before
    /// the spy knew its tid learns it later: both are the thread already there.
    fn new_thread_id(&mut self, thread: &ThreadInfo) -> u32 {
        let key = (thread.pid, thread.ruby_thread, thread.tid);
        let threads = &mut self.profile.threads;
        let same = self
            .latest_thread
            .get(&(thread.pid, thread.ruby_thread))
            .copied()
            .filter(|i| thread.tid == 0 || threads[*i as usize].tid == 0);
        let id = match same {
            Some(id) => {
                if thread.tid != 0 {
                    threads[id as usize].tid = thread.tid;
                }
                id
            }
            None => {
                threads.push(thread.clone());
                (threads.len() - 1) as u32
            }
        };
        self.thread_ids.insert(key, id);
        self.latest_thread
            .insert((thread.pid, thread.ruby_thread), id);
        id
    }

    /// The index of this thread's stack in the profile, added if new.
    fn stack_index(
        &mut self,
        thread: &ThreadInfo,
        state: ThreadState,
        frames: &[Frame],
        tags: u32,
    ) -> usize {
        let key = (thread.pid, thread.ruby_thread, thread.tid);
        let thread_id = match self.thread_ids.get(&key) {
            Some(id) => *id,
            None => self.new_thread_id(thread),
        };
        let ids: Vec<u32> = frames.iter().map(|f| self.frame_id(f)).collect();
        let key = (thread_id, state, ids, tags);
        match self.stack_ids.get(&key) {
            Some(index) => *index,
            None => {
                self.profile.stacks.push(StackCount {
                    thread: thread_id,
                    state,
                    frames: key.2.clone(),
                    count: 0,
                    tags,
                });
                let index = self.profile.stacks.len() - 1;
                self.stack_ids.insert(key, index);
                index
            }
        }
    }

    fn frame_id(&mut self, frame: &Frame) -> u32 {
        // The walker hands out the same shared strings for the same frame, so the string
        // addresses identify a frame without hashing its text. They cannot be reused for
        // other text while the profile holds a clone of the frame.
        let key = (
            Arc::as_ptr(&frame.label) as *const u8 as usize,
            Arc::as_ptr(&frame.path) as *const u8 as usize,
            frame.lineno,
            frame.c_function,
        );
        if let Some(id) = self.frame_ids_by_address.get(&key) {
            return *id;
        }
        let id = match self.frame_ids.get(frame) {
            Some(id) => *id,
            None => {
                let id = self.profile.frames.len() as u32;
                self.profile.frames.push(frame.clone());
                self.frame_ids.insert(frame.clone(), id);
                id
            }
        };
        // Keep the strings this key points at alive (the frame above may be an equal copy).
        self.keep_alive.push(frame.clone());
        self.frame_ids_by_address.insert(key, id);
        id
    }

    /// Counts one sample tick (attempted, whatever its outcome).
    pub fn tick(&mut self) {
        self.profile.ticks += 1;
        self.retire_if_due();
    }

    /// Counts one sample tick taken `since_start` into the recording: the time its samples
    /// get in the timeline.
    pub fn tick_at(&mut self, since_start: std::time::Duration) {
        self.tick();
        self.tick_us = u64::try_from(since_start.as_micros()).unwrap_or(u64::MAX);
    }

    /// Moves the time this tick's samples get to `since_start`, when its reads were made
    /// (never before the tick's own time, nor before an earlier sample's).
    pub fn read_at(&mut self, since_start: std::time::Duration) {
        let us = u64::try_from(since_start.as_micros()).unwrap_or(u64::MAX);
        self.tick_us = self.tick_us.max(us);
    }

    /// Counts a dropped sample.
    pub fn error(&mut self, reason: &str) {
        self.errors(reason, 1);
    }

    /// Counts `n` dropped samples.
    pub fn errors(&mut self, reason: &str, n: u64) {
        *self.profile.errors.entry(reason.to_string()).or_insert(0) += n;
    }

    /// Names process `pid` as a worker (see `Profile::workers`).
    pub fn name_worker(&mut self, pid: i32, name: String) {
        self.profile.workers.insert(pid, name);
    }

    pub fn note(&mut self, note: String) {
        if !self.profile.notes.contains(&note) {
            self.profile.notes.push(note);
        }
    }

    /// The profile so far.
    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    pub fn finish(mut self, duration_ns: u64) -> Profile {
        self.profile.duration_ns = duration_ns;
        self.profile.timeline = self.timeline;
        self.profile
    }

    /// Records what the recording cost (see [`Profile::sampler_cpu_ns`]).
    pub fn set_cost(&mut self, sampler_cpu_ns: u64, sampler_work_ns: u64, read_calls: u64) {
        self.profile.sampler_cpu_ns = sampler_cpu_ns;
        self.profile.sampler_work_ns = sampler_work_ns;
        self.profile.read_calls = read_calls;
    }

    /// Notes the JIT the target ran (`Spy::jit`).
    pub fn set_jit(&mut self, jit: Option<&str>) {
        self.profile.jit = jit.map(str::to_string);
    }

    pub fn set_kernel_cost(&mut self, cost: crate::cost::KernelCost) {
        self.profile.kernel = Some(cost);
    }
}

/// A frame for tests and examples.
pub fn frame(label: &str, path: &str, lineno: i32, c_function: bool) -> Frame {
    let base = label.rsplit(['#', '.', ' ']).next().unwrap_or(label);
    Frame {
        label: Arc::from(label),
        base_label: Arc::from(base),
        path: Arc::from(path),
        absolute_path: None,
        lineno,
        c_function,
    }
}

mod retire;
pub use retire::{ENDED_THREADS, MAX_THREADS};

#[cfg(test)]
mod tests;
