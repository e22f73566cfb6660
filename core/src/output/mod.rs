//! Every output format of a [`Profile`], and reading the raw one back.
//!
//! ```text
//! write(&profile, Format::from_name("speedscope")?, &mut file, &Options::default())?;
//! let again = read_raw(&mut raw_file)?;
//! ```
//!
//! | name         | what                                                  | module                |
//! |--------------|-------------------------------------------------------|-----------------------|
//! | `flamegraph` | SVG drawn by `inferno` from the collapsed lines       | [`flamegraph`]        |
//! | `speedscope` | speedscope JSON, "sampled": every thread, or per thread | [`speedscope`]      |
//! | `pprof`      | gzipped protobuf `perftools.profiles.Profile`         | [`pprof`]             |
//! | `collapsed`  | Brendan Gregg's folded stacks                         | [`collapsed`]         |
//! | `callgrind`  | callgrind.out, for callgrind_annotate / KCachegrind   | [`callgrind`]         |
//! | `summary`    | text: header, top functions by self and total samples | [`summary`]           |
//! | `lines`      | text: the summary, then top source lines              | [`summary`]           |
//! | `timeline`   | speedscope JSON, each thread's samples in time order  | [`timeline`]          |
//! | `firefox`    | the Firefox Profiler's processed format, gzipped JSON  | [`firefox`]           |
//! | `raw`        | versioned JSON that [`read_raw`] reads back exactly   | [`raw`]               |
//!
//! [`Options`] shape flamegraph, speedscope and collapsed ([`view`]): by default every
//! thread's stacks merge, frames are functions, and blocked (idle) threads' samples are left
//! out (unless there is nothing else), which the flamegraph's subtitle and speedscope's name
//! say; `per_thread`, `lines`, `idle`, `state` and `tag_root` undo each. pprof labels
//! every sample with its thread, state and tags instead (`go tool pprof -tagroot=thread`
//! draws a root per thread).
//!
//! Every format but raw gives a sample that waited for the GVL or ran the GC a leaf frame
//! below the frame it stood in (`[waiting for GVL]`, `[GC marking]`...: [`leaves`]), so that
//! no frame's self time holds waits; `no_state_leaves` takes them away.
//!
//! A *function* (summary, pprof, callgrind, and the default frames of the others) is a
//! label plus a path ([`FunctionKey`]). C functions are the exception: Ruby reports them at
//! their caller's path and line (as its backtraces do), so they are identified by label
//! alone, whatever file calls them; per-line frames (`lines`, and the "lines" summary) keep
//! that caller's path:line.
pub mod callgrind;
pub mod collapsed;
pub mod firefox;
mod firefox_markers;
mod firefox_tables;
pub mod flamegraph;
pub mod leaves;
pub mod pprof;
pub mod raw;
pub mod speedscope;
pub mod summary;
pub mod timeline;
mod view;

pub use raw::read_raw;
pub(crate) use view::view;

use crate::model::{Frame, ThreadInfo};
use crate::profile::Profile;
use std::fmt;
use std::io::Write;

/// An output format. Names are those of [`Format::name`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    Flamegraph,
    Speedscope,
    Pprof,
    Collapsed,
    Callgrind,
    Summary,
    /// The summary followed by the top source lines by self samples.
    Lines,
    /// Each thread's samples in time order, with states and tags.
    Timeline,
    /// Every thread on one timeline, for the Firefox Profiler.
    Firefox,
    Raw,
}

impl Format {
    pub const ALL: [Format; 10] = [
        Format::Flamegraph,
        Format::Speedscope,
        Format::Pprof,
        Format::Collapsed,
        Format::Callgrind,
        Format::Summary,
        Format::Lines,
        Format::Timeline,
        Format::Firefox,
        Format::Raw,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Format::Flamegraph => "flamegraph",
            Format::Speedscope => "speedscope",
            Format::Pprof => "pprof",
            Format::Collapsed => "collapsed",
            Format::Callgrind => "callgrind",
            Format::Summary => "summary",
            Format::Lines => "lines",
            Format::Timeline => "timeline",
            Format::Firefox => "firefox",
            Format::Raw => "raw",
        }
    }

    /// The format called `name` (ASCII case ignored, surrounding blanks trimmed).
    pub fn from_name(name: &str) -> Result<Format, OutputError> {
        let wanted = name.trim();
        Self::ALL
            .into_iter()
            .find(|f| f.name().eq_ignore_ascii_case(wanted))
            .ok_or_else(|| OutputError::UnknownFormat {
                name: name.to_string(),
                valid: Self::ALL.map(Format::name).join(", "),
            })
    }

    /// A conventional file name ending for the format (without the leading dot).
    pub fn extension(self) -> &'static str {
        match self {
            Format::Flamegraph => "svg",
            Format::Speedscope => "speedscope.json",
            Format::Pprof => "pb.gz",
            Format::Collapsed => "collapsed.txt",
            // KCachegrind's file dialog and callgrind_annotate look for "callgrind.out".
            Format::Callgrind => "callgrind.out",
            Format::Summary => "summary.txt",
            Format::Lines => "lines.txt",
            // speedscope opens it like any speedscope file.
            Format::Timeline => "timeline.speedscope.json",
            // profiler.firefox.com opens it gzipped, as Firefox saves its own profiles.
            Format::Firefox => "json.gz",
            // Not ".json": a raw profile is for `Profile.load` / `rubyspy report` only.
            Format::Raw => "raw",
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Format {
    type Err = OutputError;
    fn from_str(s: &str) -> Result<Self, OutputError> {
        Format::from_name(s)
    }
}

/// How flamegraph, speedscope and collapsed shape stacks ([`Options::FORMATS`]; see
/// [`view`]). The defaults merge threads, show functions (not lines) and leave out blocked
/// threads' samples; every other format takes only the defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Options {
    /// A root frame per thread ([`thread_label`]); speedscope: one profile per thread.
    pub per_thread: bool,
    /// A frame per executing line (`label path:line`) instead of per function.
    pub lines: bool,
    /// Keep the samples of blocked threads (idle), which are left out by default.
    pub idle: bool,
    /// A root pseudo frame per thread state (`[running]`, `[waiting_for_gvl]`...).
    pub state: bool,
    /// A root frame `key=value` (`key=-` without the tag) naming the value of this tag,
    /// above the others; speedscope: one profile per value.
    pub tag_root: Option<String>,
    /// No state leaves ([`leaves`]): waits for the GVL and GC pauses billed to the frame the
    /// thread stood in, the shape before leaves. Every format takes it; raw has no leaves
    /// anyway (it keeps each sample's state).
    pub no_state_leaves: bool,
}

impl Options {
    /// The formats that take options other than the defaults.
    pub const FORMATS: [Format; 3] = [Format::Flamegraph, Format::Speedscope, Format::Collapsed];

    /// The first option that is not its default, by its `rubyspy` flag.
    fn first_set(&self) -> Option<&'static str> {
        [
            (self.per_thread, "--per-thread"),
            (self.lines, "--lines"),
            (self.idle, "--idle"),
            (self.state, "--state"),
            (self.tag_root.is_some(), "--by-tag"),
        ]
        .into_iter()
        .find(|(set, _)| *set)
        .map(|(_, flag)| flag)
    }
}

/// The root text of each of the profile's tag sets when grouping by tag `key` (see
/// [`Options::tag_root`]): `key=value`, or `key=-` for a set without that tag; by index.
pub(crate) fn tag_roots(profile: &Profile, key: &str) -> Vec<String> {
    (0..profile.tag_sets.len().max(1))
        .map(|i| {
            let value = profile
                .tag_sets
                .get(i)
                .and_then(|set| set.iter().find(|(k, _)| k == key))
                .map(|(_, v)| v.as_str());
            format!("{key}={}", value.unwrap_or("-"))
        })
        .collect()
}

#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    #[error("unknown output format {name:?}; valid formats are: {valid}")]
    UnknownFormat { name: String, valid: String },
    #[error("{option} applies to flamegraph, speedscope and collapsed only, not to {format}")]
    OptionNotTaken {
        option: &'static str,
        format: Format,
    },
    #[error("the profile has no samples: there is nothing to draw")]
    NoSamples,
    #[error(
        "this profile has no timeline (it was saved by an older rbspy_ext, or is a part of a \
         profile): record it again for the timeline format"
    )]
    NoTimeline,
    #[error("inconsistent profile: {0}")]
    InvalidProfile(String),
    #[error("not an rbspy_ext raw profile: {0}")]
    NotRaw(String),
    #[error(
        "raw profile format version {found} is not supported: this build reads version {supported}"
    )]
    UnsupportedVersion { found: u64, supported: u32 },
    #[error("raw profile is truncated: {0}")]
    Truncated(String),
    #[error("raw profile is corrupt: {0}")]
    Corrupt(String),
    #[error("JSON encoding failed: {0}")]
    Json(#[from] serde_json::Error),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Writes `profile` in `format` to `out`.
pub fn write(
    profile: &Profile,
    format: Format,
    out: &mut dyn Write,
    options: &Options,
) -> Result<(), OutputError> {
    // The writers index frames and threads directly: refuse an inconsistent profile here
    // rather than panic there.
    check(profile).map_err(OutputError::InvalidProfile)?;
    if let Some(option) = options.first_set() {
        if !Options::FORMATS.contains(&format) {
            return Err(OutputError::OptionNotTaken { option, format });
        }
    }
    let leaves = match options.no_state_leaves || format == Format::Raw {
        true => std::borrow::Cow::Borrowed(profile),
        false => leaves::with_state_leaves(profile),
    };
    let profile = &*leaves;
    match format {
        Format::Flamegraph => flamegraph::write(profile, out, options),
        Format::Speedscope => speedscope::write(profile, out, options),
        Format::Pprof => pprof::write(profile, out),
        Format::Collapsed => collapsed::write(profile, out, options),
        Format::Callgrind => callgrind::write(profile, out),
        Format::Summary => summary::write(profile, out, summary::Tables::Functions),
        Format::Lines => summary::write(profile, out, summary::Tables::FunctionsAndLines),
        Format::Timeline => timeline::write(profile, out),
        Format::Firefox => firefox::write(profile, out),
        Format::Raw => raw::write(profile, out),
    }?;
    out.flush()?;
    Ok(())
}

/// Every index in range, and the counts' sum fits a u64 (so writers can add freely).
pub(crate) fn check(profile: &Profile) -> Result<(), String> {
    let mut total: u64 = 0;
    for (i, s) in profile.stacks.iter().enumerate() {
        if s.thread as usize >= profile.threads.len() {
            return Err(format!(
                "stack {i} names thread {} of {}",
                s.thread,
                profile.threads.len()
            ));
        }
        if let Some(f) = s
            .frames
            .iter()
            .find(|f| **f as usize >= profile.frames.len())
        {
            return Err(format!(
                "stack {i} names frame {f} of {}",
                profile.frames.len()
            ));
        }
        total = total
            .checked_add(s.count)
            .ok_or_else(|| "sample counts overflow".to_string())?;
    }
    profile.timeline.check(profile.stacks.len())
}

/// Each thread's samples in time order, from the profile's timeline: (µs, stack index) by
/// thread index, for the formats that draw time (timeline, firefox). NoTimeline when the
/// profile has samples but no timeline (an older file, or a part of a profile).
pub(crate) fn samples_by_thread(profile: &Profile) -> Result<Vec<Vec<(u32, u32)>>, OutputError> {
    if profile.timeline.is_empty() && stack_samples(profile) > 0 {
        return Err(OutputError::NoTimeline);
    }
    let mut by_thread: Vec<Vec<(u32, u32)>> = vec![Vec::new(); profile.threads.len()];
    for (&at, &stack) in profile.timeline.at_us.iter().zip(&profile.timeline.stacks) {
        by_thread[profile.stacks[stack as usize].thread as usize].push((at, stack));
    }
    Ok(by_thread)
}

/// Samples in the stacks (what every format shows; `Profile::samples` should agree).
pub(crate) fn stack_samples(profile: &Profile) -> u64 {
    profile.stacks.iter().map(|s| s.count).sum()
}

/// The root frame naming a thread: "Thread 12345 (main)", "Thread 12346 (worker)",
/// "Thread 0x7f..." when the native id is unknown; a thread of another process than the
/// profiled one (a subprocess) is prefixed "Process N", and one of a Ractor other than the
/// main one ends "in ractor 2 (name)".
pub fn thread_label(profile: &Profile, thread: u32) -> String {
    match profile.threads.get(thread as usize) {
        Some(t) => thread_title(t, profile.pid),
        None => format!("Thread #{thread}"),
    }
}

/// [`thread_label`] of one thread, for a view of process `pid`.
pub fn thread_title(t: &ThreadInfo, pid: i32) -> String {
    let mut label = String::new();
    if t.pid != pid {
        label.push_str(&format!("Process {} ", t.pid));
    }
    if t.tid != 0 {
        label.push_str(&format!("Thread {}", t.tid));
    } else {
        label.push_str(&format!("Thread {:#x}", t.ruby_thread));
    }
    match (&t.name, t.main) {
        (Some(name), _) => label.push_str(&format!(" ({name})")),
        (None, true) => label.push_str(" (main)"),
        (None, false) => {}
    }
    if let Some(ractor) = t.ractor_label() {
        label.push_str(&format!(" in {ractor}"));
    }
    label
}

/// Shown where a stack has no Ruby frame at all (a thread caught before running Ruby code).
pub const NO_FRAMES: &str = "[no Ruby frames]";

/// The file a C function is reported in by formats that need one (callgrind).
pub const C_FUNCTION_FILE: &str = "<C function>";

/// A function as summary, pprof and callgrind count it: label plus path, except C functions,
/// which get an empty path (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct FunctionKey<'a> {
    pub label: &'a str,
    pub path: &'a str,
}

impl<'a> FunctionKey<'a> {
    pub fn of(frame: &'a Frame) -> Self {
        FunctionKey {
            label: &frame.label,
            path: if frame.c_function { "" } else { &frame.path },
        }
    }

    /// A C function, or a state leaf ([`leaves`]): neither has a path of its own.
    pub fn is_c(&self) -> bool {
        self.path.is_empty()
    }

    /// A state leaf (`[waiting for GVL]`...), which names no function of the program.
    pub fn is_leaf(&self) -> bool {
        self.path.is_empty() && leaves::LEAF_LABELS.contains(&self.label)
    }
}

/// Values numbered in the order first seen (the frames a view or a timeline shows).
pub(crate) struct Interner<T> {
    pub list: Vec<T>,
    index: std::collections::HashMap<T, usize>,
}

impl<T> Default for Interner<T> {
    fn default() -> Self {
        Interner {
            list: Vec::new(),
            index: std::collections::HashMap::new(),
        }
    }
}

impl<T: Eq + std::hash::Hash + Clone> Interner<T> {
    /// The number of `value`, given it if new.
    pub fn id(&mut self, value: T) -> usize {
        if let Some(&i) = self.index.get(&value) {
            return i;
        }
        self.list.push(value.clone());
        self.index.insert(value, self.list.len() - 1);
        self.list.len() - 1
    }
}

/// Nanoseconds between samples, when the rate is usable (finite and positive).
pub(crate) fn sample_period_ns(profile: &Profile) -> Option<f64> {
    (profile.rate_hz.is_finite() && profile.rate_hz > 0.0).then(|| 1e9 / profile.rate_hz)
}

#[cfg(test)]
pub(crate) mod fixture {
    //! A profile shared by the format tests: three threads (main, a named worker, one whose
    //! native id is unknown), every state, shared frames, C frames, recursion, an empty stack,
    //! and a label with the collapsed format's separator in it.
    use crate::model::Frame;
    use crate::profile::{frame, Aggregator, Profile, ThreadInfo, ThreadState};

    pub fn threads() -> [ThreadInfo; 3] {
        [
            ThreadInfo {
                pid: 4242,
                tid: 4242,
                name: None,
                ruby_thread: 0x1000,
                main: true,
                ractor: 1,
                ractor_name: None,
            },
            ThreadInfo {
                pid: 4242,
                tid: 4250,
                name: Some("worker".into()),
                ruby_thread: 0x2000,
                main: false,
                ractor: 1,
                ractor_name: None,
            },
            ThreadInfo {
                pid: 4242,
                tid: 0,
                name: None,
                ruby_thread: 0x3000,
                main: false,
                ractor: 1,
                ractor_name: None,
            },
        ]
    }

    pub fn main_rb() -> Frame {
        frame("<main>", "app.rb", 10, false)
    }
    pub fn work() -> Frame {
        frame("Object#work", "lib/work.rb", 5, false)
    }
    pub fn sleep_c() -> Frame {
        frame("Kernel#sleep", "lib/work.rb", 6, true)
    }
    pub fn fib(line: i32) -> Frame {
        frame("Object#fib", "lib/fib.rb", line, false)
    }

    pub fn profile() -> Profile {
        let [main, worker, anon] = threads();
        let mut agg = Aggregator::new(4242, "3.3.0", 100.0, 1_700_000_000_123_456_789);
        let block = frame("block in Object#work", "lib/work.rb", 7, false);
        let times = frame("Integer#times", "lib/work.rb", 7, true);
        let odd = frame("weird;label", "lib/odd dir/odd.rb", 3, false);
        for _ in 0..40 {
            agg.tick();
        }
        // main: running in work, blocked in sleep (a C function), recursion in fib.
        agg.add_count(&main, ThreadState::Running, &[work(), main_rb()], 10);
        agg.add_count(
            &main,
            ThreadState::Blocked,
            &[sleep_c(), work(), main_rb()],
            7,
        );
        agg.add_count(
            &main,
            ThreadState::Running,
            &[fib(3), fib(4), fib(4), main_rb()],
            5,
        );
        agg.add_count(&main, ThreadState::Gc, &[fib(3), fib(4), main_rb()], 2);
        // worker: the same frames through a block and a C iterator, waiting for the GVL.
        agg.add_count(
            &worker,
            ThreadState::WaitingForGvl,
            &[work(), block.clone(), times.clone(), block, main_rb()],
            4,
        );
        agg.add_count(&worker, ThreadState::Running, &[odd, main_rb()], 3);
        // a thread caught before it ran any Ruby code.
        agg.add_count(&anon, ThreadState::Blocked, &[], 1);
        agg.error("stack changed while read");
        agg.error("stack changed while read");
        agg.error("thread exited");
        agg.note("the target exited".into());
        agg.finish(400_000_000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_format_names_round_trip_and_unknown_lists_valid() {
        for f in Format::ALL {
            assert_eq!(Format::from_name(f.name()).unwrap(), f);
            assert_eq!(f.name().parse::<Format>().unwrap(), f);
        }
        assert_eq!(
            Format::from_name(" SpeedScope ").unwrap(),
            Format::Speedscope
        );
        let err = Format::from_name("svg").unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, OutputError::UnknownFormat { .. }));
        assert!(msg.contains("\"svg\""), "{msg}");
        for f in Format::ALL {
            assert!(msg.contains(f.name()), "{msg}");
        }
    }

    #[test]
    fn output_thread_labels() {
        let p = fixture::profile();
        assert_eq!(thread_label(&p, 0), "Thread 4242 (main)");
        assert_eq!(thread_label(&p, 1), "Thread 4250 (worker)");
        assert_eq!(thread_label(&p, 2), "Thread 0x3000");
        let mut other = p.clone();
        other.threads[1].pid = 99;
        assert_eq!(thread_label(&other, 1), "Process 99 Thread 4250 (worker)");
        let mut ractors = p.clone();
        ractors.threads[1].ractor = 3;
        ractors.threads[1].ractor_name = Some("spin".into());
        ractors.threads[2].ractor = 2;
        assert_eq!(
            thread_label(&ractors, 1),
            "Thread 4250 (worker) in ractor 3 (spin)"
        );
        assert_eq!(thread_label(&ractors, 2), "Thread 0x3000 in ractor 2");
        // The main Ractor is not named: every thread ran in it before Ractors.
        assert_eq!(thread_label(&ractors, 0), "Thread 4242 (main)");
    }

    #[test]
    fn output_every_format_writes_and_refuses_inconsistent_profiles() {
        let p = fixture::profile();
        for f in Format::ALL {
            let mut out = Vec::new();
            write(&p, f, &mut out, &Options::default()).unwrap();
            assert!(!out.is_empty(), "{f}");
        }
        let mut bad = p.clone();
        bad.stacks[0].frames.push(999);
        for f in Format::ALL {
            let err = write(&bad, f, &mut Vec::new(), &Options::default()).unwrap_err();
            assert!(matches!(err, OutputError::InvalidProfile(_)), "{f}: {err}");
        }
        let mut bad = p;
        bad.stacks[0].thread = 7;
        assert!(write(&bad, Format::Summary, &mut Vec::new(), &Options::default()).is_err());
    }

    #[test]
    fn output_empty_profile() {
        let p = crate::profile::Aggregator::new(1, "3.3.0", 100.0, 0).finish(0);
        for f in Format::ALL {
            let mut out = Vec::new();
            let r = write(&p, f, &mut out, &Options::default());
            if f == Format::Flamegraph {
                assert!(matches!(r, Err(OutputError::NoSamples)), "{r:?}");
            } else {
                r.unwrap_or_else(|e| panic!("{f}: {e}"));
            }
        }
    }
}
