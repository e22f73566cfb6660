//! What a sample is made of, shared by the walker that makes samples (spy/) and the profile
//! that aggregates them (profile.rs): frames, tags, threads and their states. It imports
//! nothing from the crate, so both can build on it without importing each other.
use std::sync::Arc;

/// One frame, innermost first, shaped like `Thread::Backtrace::Location`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Frame {
    /// Qualified the way Ruby 3.4 prints it: `Foo::Bar#baz`, `block in Foo.build`.
    pub label: Arc<str>,
    pub base_label: Arc<str>,
    pub path: Arc<str>,
    pub absolute_path: Option<Arc<str>>,
    pub lineno: i32,
    pub c_function: bool,
}

/// One thread's tags as text, `(key, value)` in table order; empty when it has none.
pub type Tags = Arc<[(Arc<str>, Arc<str>)]>;

/// What a thread was doing when sampled.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum ThreadState {
    /// Holds the GVL and runs Ruby code.
    Running,
    /// Runnable, waiting to take the GVL.
    WaitingForGvl,
    /// Sleeping, in IO, joining, waiting on a mutex or queue: not competing for the GVL.
    Blocked,
    /// The GVL holder is collecting garbage, between phases (starting or finishing a run).
    Gc,
    /// The GVL holder is collecting garbage: marking live objects.
    GcMarking,
    /// The GVL holder is collecting garbage: sweeping dead objects.
    GcSweeping,
    /// The GVL holder is collecting garbage: compacting the heap.
    GcCompacting,
    /// On a CPU without the GVL: C code that released it, a system call, or taking the GVL.
    /// Only the BPF sampler sees it (it samples threads on a CPU; the user-space sampler
    /// sees such a thread as blocked).
    NoGvl,
}

impl ThreadState {
    pub const ALL: [ThreadState; 8] = [
        ThreadState::Running,
        ThreadState::WaitingForGvl,
        ThreadState::Blocked,
        ThreadState::Gc,
        ThreadState::GcMarking,
        ThreadState::GcSweeping,
        ThreadState::GcCompacting,
        ThreadState::NoGvl,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ThreadState::Running => "running",
            ThreadState::WaitingForGvl => "waiting_for_gvl",
            ThreadState::Blocked => "blocked",
            ThreadState::Gc => "gc",
            ThreadState::GcMarking => "gc_marking",
            ThreadState::GcSweeping => "gc_sweeping",
            ThreadState::GcCompacting => "gc_compacting",
            ThreadState::NoGvl => "no_gvl",
        }
    }

    /// Holds the GVL: running Ruby code or collecting garbage.
    pub fn on_cpu(self) -> bool {
        !matches!(
            self,
            ThreadState::WaitingForGvl | ThreadState::Blocked | ThreadState::NoGvl
        )
    }

    /// Collecting garbage, in whatever phase.
    pub fn in_gc(self) -> bool {
        matches!(
            self,
            ThreadState::Gc
                | ThreadState::GcMarking
                | ThreadState::GcSweeping
                | ThreadState::GcCompacting
        )
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// One sampled thread.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ThreadInfo {
    pub pid: i32,
    /// Native thread id (as in /proc/PID/task), 0 when unknown.
    pub tid: i64,
    /// `Thread#name`, if set.
    pub name: Option<String>,
    /// The `rb_thread_t` address: tells threads apart while they live.
    pub ruby_thread: u64,
    /// True for the process's main thread.
    pub main: bool,
    /// The Ractor the thread runs in: its id (`1` for the main Ractor; 0 before Ruby 3.0,
    /// which has none) and the name it was given (`Ractor.new(name: ...)`).
    #[serde(default)]
    pub ractor: u32,
    #[serde(default)]
    pub ractor_name: Option<String>,
}

impl ThreadInfo {
    /// The Ractor as people name it: "ractor 2" or "ractor 2 (name)"; None for the main
    /// Ractor (and before 3.0), which is what every thread ran in before Ractors.
    pub fn ractor_label(&self) -> Option<String> {
        if self.ractor <= 1 {
            return None;
        }
        Some(match &self.ractor_name {
            Some(name) => format!("ractor {} ({name})", self.ractor),
            None => format!("ractor {}", self.ractor),
        })
    }
}

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
    pub info: Arc<ThreadInfo>,
    pub state: ThreadState,
    pub frames: Arc<[Frame]>,
    /// See [`crate::spy::Stack::token`].
    pub stack_token: u64,
    /// The tags of the fiber the thread was running (spy/tags.rs).
    pub tags: Tags,
}

/// Why a thread's sample was not taken: counted in `Profile::errors` by [`Dropped::name`]
/// (the raw format keeps the names), never replaced by a guess.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dropped {
    /// A thread (or its context) went away while the list or the contexts were read.
    ThreadListChanged,
    /// The thread's stack kept moving while read, through every retry.
    StackMoved,
    /// The thread's tags did not read the same around its stack, through every retry.
    TagsChanged,
    /// The target's memory did not read for a reason other than the process ending.
    ReadFailed,
    /// The BPF sampler caught a thread the recorder's thread list does not have.
    NotInThreadList,
    /// The BPF sampler could not read the thread's execution context.
    ContextUnread,
    /// The BPF sampler copied a thread's frames but not its value stack.
    ValueStackUnread,
    /// Every frame the BPF sampler copied has its locals below the value stack it copied.
    ValueStackDeeper,
    /// A stack the BPF sampler copied did not resolve (something it points to moved).
    CapturedUnresolved,
    /// This many BPF samples were lost: the ring buffer was full.
    RingFull(u64),
}

impl Dropped {
    /// The reason as `Profile::errors` and the raw format name it.
    pub fn name(self) -> &'static str {
        match self {
            Dropped::ThreadListChanged => "thread list changed",
            Dropped::StackMoved => "stack changed while read",
            Dropped::TagsChanged => "tags changed while read",
            Dropped::ReadFailed => "read failed",
            Dropped::NotInThreadList => "thread not in the thread list",
            Dropped::ContextUnread => "thread context did not read",
            Dropped::ValueStackUnread => "value stack did not read",
            Dropped::ValueStackDeeper => "value stack deeper than the copy",
            Dropped::CapturedUnresolved => "captured stack did not resolve",
            Dropped::RingFull(_) => "ring buffer full",
        }
    }

    /// How many samples this drop stands for.
    pub fn count(self) -> u64 {
        match self {
            Dropped::RingFull(n) => n,
            _ => 1,
        }
    }
}

/// One read of a process at one tick: the threads it sampled and the samples it dropped.
/// The user-space sampler makes one per tick and process (`Spy::sample`); the BPF sampler one
/// per record it drains (`Capture::resolve`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sample {
    /// When the target was read (a sample's one call), if it was: the time the samples get
    /// on the timeline, which a busy machine can hold up from the tick by milliseconds.
    pub read_at: Option<std::time::Instant>,
    pub threads: Vec<SampledThread>,
    pub dropped: Vec<Dropped>,
    /// The Ractors of the thread list the sample was read against (its ids; `[0]` before
    /// 3.0): which are alive at the end of a recording (empty when no list was read).
    pub ractors: Arc<[u32]>,
}

impl Sample {
    /// A sample of nothing, dropped for `why`.
    pub fn dropped(why: Dropped) -> Self {
        Sample {
            dropped: vec![why],
            ..Sample::default()
        }
    }

    /// Keeps only the threads that held the GVL (`RecordConfig::on_cpu`).
    pub fn keep_on_cpu(&mut self) {
        self.threads.retain(|t| t.state.on_cpu());
    }
}

/// serde for `Profile::frames` (`#[serde(with = ...)]`): `Frame` knows nothing of serde
/// (the walker makes millions of them), so the raw format goes through a mirror struct.
pub(crate) mod frame_serde {
    use super::Frame;
    use serde::{Deserialize, Serialize};
    use std::sync::Arc;

    #[derive(Serialize, Deserialize)]
    struct RawFrame {
        label: String,
        base_label: String,
        path: String,
        absolute_path: Option<String>,
        lineno: i32,
        c_function: bool,
    }

    pub fn serialize<S: serde::Serializer>(frames: &[Frame], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(frames.iter().map(|f| RawFrame {
            label: f.label.to_string(),
            base_label: f.base_label.to_string(),
            path: f.path.to_string(),
            absolute_path: f.absolute_path.as_deref().map(String::from),
            lineno: f.lineno,
            c_function: f.c_function,
        }))
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<Frame>, D::Error> {
        let raw: Vec<RawFrame> = Vec::deserialize(d)?;
        Ok(raw
            .into_iter()
            .map(|f| Frame {
                label: Arc::from(f.label),
                base_label: Arc::from(f.base_label),
                path: Arc::from(f.path),
                absolute_path: f.absolute_path.map(Arc::from),
                lineno: f.lineno,
                c_function: f.c_function,
            })
            .collect())
    }
}
