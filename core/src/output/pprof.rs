//! pprof: a gzipped protobuf `perftools.profiles.Profile` (google/pprof's
//! proto/profile.proto), as read by `go tool pprof`, pprof's web UI and most profiling UIs.
//!
//! - sample types `samples/count` and `wall/nanoseconds` (count × period);
//!   period type `wall/nanoseconds`, period = 1e9 / rate; `time_nanos`, `duration_nanos`;
//! - one sample per aggregated stack, locations leaf first, labelled `thread` (its
//!   [`thread_label`]), `thread_id` (native id), `state` and `pid`, `ractor` (its id) and
//!   `ractor_name` (if it has one) once the profile holds more than the main Ractor's
//!   threads, `worker` (a preforking server's worker number, or `master`) in a profile
//!   of a server and its workers, and its tags; threads are
//!   labels only (`go tool pprof -tagroot=thread` draws a root per thread), since a fleet
//!   backend merges profiles of many processes, whose thread ids differ;
//! - a function per label + path (`name` = label, `system_name` = base label, `filename` =
//!   path; C functions have no file, see the module docs of `output`), a location per
//!   function + line; no mappings (Ruby code has no binary addresses). Where the base label
//!   is the label itself, `system_name` is empty: pprof takes a function whose name equals
//!   its system name for a C++ symbol still to simplify, and cuts the name at its first `<`
//!   or `(`, so `<main>`, `<top (required)>` and `<class:Foo>` would show as nameless;
//! - comments: the exporter, Ruby version, pid, dropped samples and notes.
//!
//! The messages are written by hand with `prost`'s derive (no protoc, no build script); only
//! the fields we write (and the `Mapping` message, for decoders' sake) are declared.
use super::{sample_period_ns, thread_label, FunctionKey, OutputError};
use crate::profile::{Profile, StackCount};
use flate2::write::GzEncoder;
use prost::Message;
use std::collections::HashMap;
use std::io::Write;

/// The messages of perftools.profiles (field numbers as in profile.proto).
pub mod proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Profile {
        #[prost(message, repeated, tag = "1")]
        pub sample_type: Vec<ValueType>,
        #[prost(message, repeated, tag = "2")]
        pub sample: Vec<Sample>,
        #[prost(message, repeated, tag = "3")]
        pub mapping: Vec<Mapping>,
        #[prost(message, repeated, tag = "4")]
        pub location: Vec<Location>,
        #[prost(message, repeated, tag = "5")]
        pub function: Vec<Function>,
        #[prost(string, repeated, tag = "6")]
        pub string_table: Vec<String>,
        #[prost(int64, tag = "7")]
        pub drop_frames: i64,
        #[prost(int64, tag = "8")]
        pub keep_frames: i64,
        #[prost(int64, tag = "9")]
        pub time_nanos: i64,
        #[prost(int64, tag = "10")]
        pub duration_nanos: i64,
        #[prost(message, optional, tag = "11")]
        pub period_type: Option<ValueType>,
        #[prost(int64, tag = "12")]
        pub period: i64,
        #[prost(int64, repeated, tag = "13")]
        pub comment: Vec<i64>,
        #[prost(int64, tag = "14")]
        pub default_sample_type: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ValueType {
        #[prost(int64, tag = "1")]
        pub r#type: i64,
        #[prost(int64, tag = "2")]
        pub unit: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Sample {
        #[prost(uint64, repeated, tag = "1")]
        pub location_id: Vec<u64>,
        #[prost(int64, repeated, tag = "2")]
        pub value: Vec<i64>,
        #[prost(message, repeated, tag = "3")]
        pub label: Vec<Label>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Label {
        #[prost(int64, tag = "1")]
        pub key: i64,
        #[prost(int64, tag = "2")]
        pub str: i64,
        #[prost(int64, tag = "3")]
        pub num: i64,
        #[prost(int64, tag = "4")]
        pub num_unit: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Mapping {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(uint64, tag = "2")]
        pub memory_start: u64,
        #[prost(uint64, tag = "3")]
        pub memory_limit: u64,
        #[prost(uint64, tag = "4")]
        pub file_offset: u64,
        #[prost(int64, tag = "5")]
        pub filename: i64,
        #[prost(int64, tag = "6")]
        pub build_id: i64,
        #[prost(bool, tag = "7")]
        pub has_functions: bool,
        #[prost(bool, tag = "8")]
        pub has_filenames: bool,
        #[prost(bool, tag = "9")]
        pub has_line_numbers: bool,
        #[prost(bool, tag = "10")]
        pub has_inline_frames: bool,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Location {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(uint64, tag = "2")]
        pub mapping_id: u64,
        #[prost(uint64, tag = "3")]
        pub address: u64,
        #[prost(message, repeated, tag = "4")]
        pub line: Vec<Line>,
        #[prost(bool, tag = "5")]
        pub is_folded: bool,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Line {
        #[prost(uint64, tag = "1")]
        pub function_id: u64,
        #[prost(int64, tag = "2")]
        pub line: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Function {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(int64, tag = "2")]
        pub name: i64,
        #[prost(int64, tag = "3")]
        pub system_name: i64,
        #[prost(int64, tag = "4")]
        pub filename: i64,
        #[prost(int64, tag = "5")]
        pub start_line: i64,
    }
}

/// The string table: index 0 is "" as the format requires.
pub(crate) struct Strings {
    pub(crate) table: Vec<String>,
    index: HashMap<String, i64>,
}

impl Strings {
    pub(crate) fn new() -> Self {
        Strings {
            table: vec![String::new()],
            index: HashMap::from([(String::new(), 0)]),
        }
    }

    pub(crate) fn id(&mut self, s: &str) -> i64 {
        if let Some(&i) = self.index.get(s) {
            return i;
        }
        let i = self.table.len() as i64;
        self.table.push(s.to_string());
        self.index.insert(s.to_string(), i);
        i
    }
}

/// pprof's functions and locations, each interned: one function per (name, system name,
/// file), one location per (function, line).
#[derive(Default)]
pub(crate) struct Locations {
    pub(crate) functions: Vec<proto::Function>,
    function_ids: HashMap<(String, String, String), u64>,
    pub(crate) locations: Vec<proto::Location>,
    location_ids: HashMap<(u64, i64), u64>,
}

impl Locations {
    fn id(
        &mut self,
        strings: &mut Strings,
        name: &str,
        system_name: &str,
        file: &str,
        line: i64,
    ) -> u64 {
        let system_name = if system_name == name { "" } else { system_name };
        let key = (name.to_string(), system_name.to_string(), file.to_string());
        let function_id = match self.function_ids.get(&key) {
            Some(&id) => id,
            None => {
                let id = self.functions.len() as u64 + 1;
                self.functions.push(proto::Function {
                    id,
                    name: strings.id(name),
                    system_name: strings.id(system_name),
                    filename: strings.id(file),
                    start_line: 0,
                });
                self.function_ids.insert(key, id);
                id
            }
        };
        let locations = &mut self.locations;
        *self
            .location_ids
            .entry((function_id, line))
            .or_insert_with(|| {
                let id = locations.len() as u64 + 1;
                locations.push(proto::Location {
                    id,
                    line: vec![proto::Line { function_id, line }],
                    ..Default::default()
                });
                id
            })
    }
}

/// One location per frame (several frames may share one), by frame index: a function per
/// label and path ([`FunctionKey`]), at the frame's line.
pub(crate) fn frame_locations(
    frames: &[crate::model::Frame],
    strings: &mut Strings,
    locations: &mut Locations,
) -> Vec<u64> {
    frames
        .iter()
        .map(|f| {
            let key = FunctionKey::of(f);
            // A C function's line is its caller's: kept by the caller's own location.
            let line = if key.is_c() { 0 } else { f.lineno as i64 };
            locations.id(strings, key.label, &f.base_label, key.path, line)
        })
        .collect()
}

/// Builds the message, before encoding (tests decode and compare against it).
pub fn build(profile: &Profile) -> proto::Profile {
    let mut strings = Strings::new();
    let mut locations = Locations::default();
    // Threads are labels, not root frames: a fleet backend merges profiles of many
    // processes, whose thread ids differ.
    let frame_locations = frame_locations(&profile.frames, &mut strings, &mut locations);
    let thread_labels: Vec<String> = (0..profile.threads.len() as u32)
        .map(|t| thread_label(profile, t))
        .collect();
    // A process that never started a Ractor keeps the labels it always had.
    let ractors = profile.threads.iter().any(|t| t.ractor > 1);
    let period = sample_period_ns(profile).map_or(0, |ns| ns.round() as i64);
    let [samples, count, wall, nanoseconds] =
        ["samples", "count", "wall", "nanoseconds"].map(|s| strings.id(s));
    let sample = profile
        .stacks
        .iter()
        .map(|stack| {
            let location_id: Vec<u64> = stack
                .frames
                .iter()
                .map(|&f| frame_locations[f as usize])
                .collect();
            let n = i64::try_from(stack.count).unwrap_or(i64::MAX);
            proto::Sample {
                location_id,
                value: vec![n, n.saturating_mul(period)],
                label: labels(&mut strings, profile, stack, &thread_labels, ractors),
            }
        })
        .collect();
    let comment = comments(profile).iter().map(|c| strings.id(c)).collect();
    proto::Profile {
        sample_type: vec![
            proto::ValueType {
                r#type: samples,
                unit: count,
            },
            proto::ValueType {
                r#type: wall,
                unit: nanoseconds,
            },
        ],
        sample,
        location: locations.locations,
        function: locations.functions,
        time_nanos: i64::try_from(profile.start_unix_ns).unwrap_or(i64::MAX),
        duration_nanos: i64::try_from(profile.duration_ns).unwrap_or(i64::MAX),
        period_type: Some(proto::ValueType {
            r#type: wall,
            unit: nanoseconds,
        }),
        period,
        comment,
        // Open on wall time (pprof's default would be the last type anyway).
        default_sample_type: wall,
        string_table: strings.table,
        ..Default::default()
    }
}

/// A sample's labels: its thread (label and tid), state and pid, its Ractor (when `ractors`),
/// then the fiber's tags (RubySpy.tag), one label each.
fn labels(
    strings: &mut Strings,
    profile: &Profile,
    stack: &StackCount,
    thread_labels: &[String],
    ractors: bool,
) -> Vec<proto::Label> {
    let thread = &profile.threads[stack.thread as usize];
    let text = |strings: &mut Strings, key: &str, value: &str| proto::Label {
        key: strings.id(key),
        str: strings.id(value),
        ..Default::default()
    };
    let number = |strings: &mut Strings, key: &str, num: i64| proto::Label {
        key: strings.id(key),
        num,
        ..Default::default()
    };
    let mut labels = vec![
        text(strings, "thread", &thread_labels[stack.thread as usize]),
        number(strings, "thread_id", thread.tid),
        text(strings, "state", stack.state.name()),
        number(strings, "pid", thread.pid as i64),
    ];
    if let Some(worker) = profile.workers.get(&thread.pid) {
        // Text, for the same reason as `ractor`.
        labels.push(text(strings, "worker", worker));
    }
    if ractors && thread.ractor > 0 {
        // Text, not a number: fleet backends (Pyroscope) index string labels only.
        labels.push(text(strings, "ractor", &thread.ractor.to_string()));
        if let Some(name) = &thread.ractor_name {
            labels.push(text(strings, "ractor_name", name));
        }
    }
    for (k, v) in profile.tags_of(stack).iter() {
        labels.push(text(strings, k, v));
    }
    labels
}

/// The profile's comments: who wrote it, for which process, what was dropped, the notes.
fn comments(profile: &Profile) -> Vec<String> {
    let mut comments = vec![
        format!("rbspy_ext {}", env!("CARGO_PKG_VERSION")),
        format!("pid {}", profile.pid),
    ];
    if !profile.ruby_version.is_empty() {
        comments.push(format!("Ruby {}", profile.ruby_version));
    }
    for (reason, n) in &profile.errors {
        comments.push(format!("dropped {n} samples: {reason}"));
    }
    comments.extend(profile.notes.iter().cloned());
    comments
}

pub fn write(profile: &Profile, out: &mut dyn Write) -> Result<(), OutputError> {
    let bytes = build(profile).encode_to_vec();
    let mut gz = GzEncoder::new(out, flate2::Compression::default());
    gz.write_all(&bytes)?;
    gz.finish()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::{fixture, write as write_format, Format, Options};
    use std::collections::BTreeMap;
    use std::io::Read;

    fn decode() -> proto::Profile {
        let mut out = Vec::new();
        let options = Options::default();
        write_format(&fixture::profile(), Format::Pprof, &mut out, &options).unwrap();
        assert_eq!(&out[..2], &[0x1f, 0x8b], "gzip magic");
        let mut bytes = Vec::new();
        flate2::read::GzDecoder::new(&out[..])
            .read_to_end(&mut bytes)
            .unwrap();
        proto::Profile::decode(&bytes[..]).unwrap()
    }

    #[test]
    fn output_pprof_decodes_back_with_the_profile_totals() {
        let p = fixture::profile();
        let decoded = decode();
        assert_eq!(
            decoded,
            build(&crate::output::leaves::with_state_leaves(&p))
        );
        let s = |i: i64| decoded.string_table[i as usize].as_str();
        assert_eq!(s(0), "");
        let types: Vec<(&str, &str)> = decoded
            .sample_type
            .iter()
            .map(|t| (s(t.r#type), s(t.unit)))
            .collect();
        assert_eq!(types, [("samples", "count"), ("wall", "nanoseconds")]);
        let period_type = decoded.period_type.as_ref().unwrap();
        assert_eq!(
            (s(period_type.r#type), s(period_type.unit)),
            ("wall", "nanoseconds")
        );
        assert_eq!(decoded.period, 10_000_000);
        assert_eq!(decoded.duration_nanos, 400_000_000);
        assert_eq!(decoded.time_nanos, 1_700_000_000_123_456_789);

        let total: i64 = decoded.sample.iter().map(|x| x.value[0]).sum();
        assert_eq!(total as u64, p.samples);
        let wall: i64 = decoded.sample.iter().map(|x| x.value[1]).sum();
        assert_eq!(wall, total * 10_000_000);

        // Ids are unique, nonzero and resolve.
        let functions: BTreeMap<u64, &proto::Function> =
            decoded.function.iter().map(|f| (f.id, f)).collect();
        let locations: BTreeMap<u64, &proto::Location> =
            decoded.location.iter().map(|l| (l.id, l)).collect();
        assert_eq!(functions.len(), decoded.function.len());
        assert_eq!(locations.len(), decoded.location.len());
        assert!(!functions.contains_key(&0) && !locations.contains_key(&0));
    }

    #[test]
    fn output_pprof_labels_threads_and_states_and_names_functions() {
        let decoded = decode();
        let s = |i: i64| decoded.string_table[i as usize].as_str();
        let functions: BTreeMap<u64, &proto::Function> =
            decoded.function.iter().map(|f| (f.id, f)).collect();
        let locations: BTreeMap<u64, &proto::Location> =
            decoded.location.iter().map(|l| (l.id, l)).collect();
        // Per-thread and per-state totals through the labels; stacks leaf first.
        let mut by_thread: BTreeMap<String, i64> = BTreeMap::new();
        let mut by_state: BTreeMap<String, i64> = BTreeMap::new();
        for sample in &decoded.sample {
            let label = |k: &str| sample.label.iter().find(|l| s(l.key) == k).unwrap();
            *by_thread
                .entry(s(label("thread").str).to_string())
                .or_default() += sample.value[0];
            *by_state
                .entry(s(label("state").str).to_string())
                .or_default() += sample.value[0];
            assert_eq!(label("pid").num, 4242);
            let names: Vec<&str> = sample
                .location_id
                .iter()
                .map(|id| s(functions[&locations[id].line[0].function_id].name))
                .collect();
            if names.first() == Some(&"Kernel#sleep") {
                assert_eq!(names, ["Kernel#sleep", "Object#work", "<main>"]);
                assert_eq!(label("thread_id").num, 4242);
                assert_eq!(s(label("state").str), "blocked");
            }
            // A wait's leaf is its innermost location, and it has one only when it waited.
            let leaf = match s(label("state").str) {
                "waiting_for_gvl" => Some("[waiting for GVL]"),
                "gc" => Some("[GC]"),
                _ => None,
            };
            assert_eq!(names.first().filter(|n| n.starts_with('[')), leaf.as_ref());
        }
        assert_eq!(by_thread["Thread 4242 (main)"], 24);
        assert_eq!(by_thread["Thread 4250 (worker)"], 7);
        assert_eq!(by_thread["Thread 0x3000"], 1);
        assert_eq!(by_state["waiting_for_gvl"], 4);
        assert_eq!(by_state["gc"], 2);

        // A C function is one function with no file; Ruby functions carry label, base label
        // and path; fib's two lines are two locations of one function.
        let function = |name: &str| {
            decoded
                .function
                .iter()
                .filter(|f| s(f.name) == name)
                .collect::<Vec<_>>()
        };
        assert_eq!(s(function("Kernel#sleep")[0].filename), "");
        let work = function("Object#work");
        assert_eq!(work.len(), 1);
        assert_eq!(
            (s(work[0].system_name), s(work[0].filename)),
            ("work", "lib/work.rb")
        );
        // A label that is its own base label gets no system name (pprof would cut it at "<").
        let main = function("<main>");
        assert_eq!((main.len(), s(main[0].system_name)), (1, ""));
        let fib = function("Object#fib")[0].id;
        let fib_lines: Vec<i64> = decoded
            .location
            .iter()
            .filter(|l| l.line[0].function_id == fib)
            .map(|l| l.line[0].line)
            .collect();
        assert_eq!(fib_lines, [3, 4]);
        assert!(decoded
            .comment
            .iter()
            .any(|&c| s(c) == "dropped 2 samples: stack changed while read"));
    }

    #[test]
    fn output_pprof_has_no_thread_roots() {
        let decoded = decode();
        let s = |i: i64| decoded.string_table[i as usize].as_str();
        assert!(decoded
            .function
            .iter()
            .all(|f| !s(f.name).starts_with("Thread")));
        // The thread still labels each sample.
        assert!(decoded
            .sample
            .iter()
            .all(|x| x.label.iter().any(|l| s(l.key) == "thread")));
        // The thread with no Ruby frame: a sample without locations.
        assert!(decoded.sample.iter().any(|x| x.location_id.is_empty()));
        // One Ractor: no ractor label at all.
        assert!(decoded
            .sample
            .iter()
            .all(|x| x.label.iter().all(|l| !s(l.key).starts_with("ractor"))));
    }

    #[test]
    fn output_pprof_labels_ractors_once_there_are_several() {
        let mut p = fixture::profile();
        p.threads[1].ractor = 2;
        p.threads[1].ractor_name = Some("spin-a".into());
        let decoded = build(&p);
        let s = |i: i64| decoded.string_table[i as usize].as_str();
        let label = |x: &proto::Sample, key: &str| {
            x.label
                .iter()
                .find(|l| s(l.key) == key)
                .map(|l| s(l.str).to_string())
        };
        for x in &decoded.sample {
            let in_worker = label(x, "thread").is_some_and(|t| t.contains("(worker)"));
            let (ractor, name) = (label(x, "ractor"), label(x, "ractor_name"));
            if in_worker {
                assert_eq!(
                    (ractor.as_deref(), name.as_deref()),
                    (Some("2"), Some("spin-a"))
                );
            } else {
                assert_eq!(name, None);
                assert_eq!(ractor.as_deref(), Some("1"));
            }
        }
    }
}
