//! The Firefox Profiler's own file format (profiler.firefox.com, "Load a profile from file"):
//! every thread of the process on one timeline, each sample with its time and whole stack,
//! thread states as categories and markers, tags and traces as markers over the time they
//! cover, gzipped JSON.
//!
//! The format is the profiler's *processed* profile, written at version [`VERSION`]: the
//! profiler upgrades any older version it is given through its own upgraders (its promise
//! to files saved at any point in the past), and from this version every thread shares one
//! string, stack, frame and function table (`profile.shared`), which keeps a recording of
//! many threads as small as the format allows. Sample times are deltas (`timeDeltas`), which
//! gzip packs well.
//!
//! | what | where |
//! |---|---|
//! | a Ruby function (label and file) | a function with `isJS` set and its file in `shared.sources` |
//! | a C function | a function without `isJS` (the profiler's "native"), `relevantForJS` so JS-only views keep it, category `C function` |
//! | a frame's line | the frame's `line` (a C function's is its caller's, so it has none) |
//! | waiting for the GVL, GC phases | the state leaf ([`super::leaves`]) in category `GVL wait` / `GC` (subcategory per phase), and a marker per run of such samples ([`markers`]) |
//! | blocked | the leaf frame in category `Idle`, which the profiler leaves out of CPU views unless asked |
//! | on a CPU without the GVL (BPF) | the leaf frame in category `Without GVL` |
//! | tags, traces | markers over each run of a thread's samples with the same tags or span |
//! | pid, Ruby version, rate, sampler, drops | `meta` (`product`, `interval`) and `meta.extra`, the profile info panel |
//!
//! A sample holds from its time until its thread's next sample, or for one period when the
//! next is more than two periods away (as in [`super::timeline`]); markers follow the same
//! rule.
use super::firefox_markers::{
    self as markers, state_category, CATEGORIES, C_FUNCTION, OTHER, RUBY,
};
use super::firefox_tables::{Shared, Tables};
use super::{sample_period_ns, thread_label, FunctionKey, OutputError, NO_FRAMES};
use crate::profile::Profile;
use serde::Serialize;
use serde_json::{json, Value};
use std::io::Write;

/// The processed format's version this writer writes (the first with tables shared by every
/// thread).
pub const VERSION: u32 = 60;

/// One thread: who it is, its samples and its markers.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Thread {
    name: String,
    is_main_thread: bool,
    process_type: &'static str,
    process_name: String,
    process_startup_time: f64,
    process_shutdown_time: Option<f64>,
    register_time: f64,
    unregister_time: Option<f64>,
    paused_ranges: [u8; 0],
    pid: String,
    tid: Value,
    samples: Samples,
    markers: Value,
}

/// The whole file.
#[derive(Serialize)]
struct Document {
    meta: Value,
    libs: [u8; 0],
    pages: [u8; 0],
    threads: Vec<Thread>,
    shared: Shared,
}

/// Each of the profile's stacks as a stack of the shared table: its frames root first, the
/// leaf drawn in its state's category.
fn stack_indexes(profile: &Profile, tables: &mut Tables) -> Vec<u32> {
    let no_frames = [crate::profile::frame(NO_FRAMES, "", 0, false)];
    profile
        .stacks
        .iter()
        .map(|s| {
            let frames: Vec<&crate::model::Frame> = match s.frames.is_empty() {
                true => no_frames.iter().collect(),
                false => s
                    .frames
                    .iter()
                    .map(|&f| &profile.frames[f as usize])
                    .collect(),
            };
            let mut prefix = None;
            let last = frames.len() - 1;
            for (depth, frame) in frames.iter().rev().enumerate() {
                let key = FunctionKey::of(frame);
                // A state leaf is always innermost, so the state's category covers it.
                let own = match (frame.label.as_ref() == NO_FRAMES, key.is_c()) {
                    (true, _) => (OTHER, 0),
                    (false, true) => (C_FUNCTION, 0),
                    (false, false) => (RUBY, 0),
                };
                let category = match depth == last {
                    true => state_category(s.state).unwrap_or(own),
                    false => own,
                };
                let line = u32::try_from(frame.lineno).ok().filter(|&l| l > 0);
                let index = tables.frame(key, line, category);
                prefix = Some(tables.push(prefix, index));
            }
            prefix.expect("a stack has a frame")
        })
        .collect()
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Samples {
    length: usize,
    stack: Vec<u32>,
    time_deltas: Vec<f64>,
    /// µs of CPU since the thread's previous sample, from the states: the time between the
    /// two samples when the thread was on a CPU (running, in GC, without the GVL), else 0.
    #[serde(rename = "threadCPUDelta")]
    thread_cpu_delta: Vec<u32>,
    weight: Option<Vec<u32>>,
    weight_type: &'static str,
}

/// Writes `profile` (with its state leaves) gzipped in the profiler's processed format.
pub fn write(profile: &Profile, out: &mut dyn Write) -> Result<(), OutputError> {
    let by_thread = super::samples_by_thread(profile)?;
    let period_us = sample_period_ns(profile).map_or(1000.0, |ns| ns / 1000.0);
    let mut tables = Tables::default();
    let stacks = stack_indexes(profile, &mut tables);
    let mut threads = Vec::new();
    for (index, samples) in by_thread.iter().enumerate() {
        if samples.is_empty() {
            continue;
        }
        let info = &profile.threads[index];
        let mut last = 0;
        let table = Samples {
            length: samples.len(),
            stack: samples.iter().map(|&(_, s)| stacks[s as usize]).collect(),
            // In whole µs, then ms: "1.003", not the float error of a difference of ms.
            time_deltas: samples
                .iter()
                .map(|&(at, _)| {
                    let delta = at - last;
                    last = at;
                    f64::from(delta) / 1000.0
                })
                .collect(),
            thread_cpu_delta: cpu_deltas(profile, samples),
            weight: None,
            weight_type: "samples",
        };
        let marks = markers::thread_markers(profile, samples, period_us)
            .into_json(|name| tables.string(name));
        let first_ms = f64::from(samples[0].0) / 1000.0;
        threads.push(Thread {
            name: thread_name(profile, index),
            is_main_thread: info.main && info.pid == profile.pid,
            process_type: "default",
            process_name: format!("ruby {}", info.pid),
            process_startup_time: 0.0,
            process_shutdown_time: None,
            register_time: first_ms,
            unregister_time: None,
            paused_ranges: [],
            pid: info.pid.to_string(),
            tid: match info.tid {
                0 => json!(format!("{:#x}", info.ruby_thread)),
                tid => json!(tid),
            },
            samples: table,
            markers: marks,
        });
    }
    let document = Document {
        meta: meta(profile, period_us),
        libs: [],
        pages: [],
        threads,
        shared: tables.shared(),
    };
    let gz = flate2::write::GzEncoder::new(out, flate2::Compression::default());
    // serde_json writes a token at a time; the compressor, fed that small, spent a third of
    // the time setting up each call.
    let mut buffered = std::io::BufWriter::with_capacity(1 << 16, gz);
    serde_json::to_writer(&mut buffered, &document)?;
    let gz = buffered.into_inner().map_err(|e| e.into_error())?;
    gz.finish()?;
    Ok(())
}

/// Each sample's [`Samples::thread_cpu_delta`]. The first sample has no previous one: 0.
fn cpu_deltas(profile: &Profile, samples: &[(u32, u32)]) -> Vec<u32> {
    let mut previous = None;
    samples
        .iter()
        .map(|&(at, stack)| {
            let state = profile.stacks[stack as usize].state;
            let on_cpu = state.on_cpu() || state == crate::model::ThreadState::NoGvl;
            let delta = previous.map_or(0, |p| at.saturating_sub(p));
            previous = Some(at);
            if on_cpu {
                delta
            } else {
                0
            }
        })
        .collect()
}

/// A thread's name as Ruby names it (`Thread#name`, or "main"), then what tells it apart:
/// its native id, its Ractor. Threads merged once ended ("ended threads") have no id.
fn thread_name(profile: &Profile, index: usize) -> String {
    let t = &profile.threads[index];
    let label = thread_label(profile, index as u32);
    match (&t.name, t.main) {
        (Some(name), _) if t.tid == 0 && t.ruby_thread == 0 => match t.pid == profile.pid {
            true => name.clone(),
            false => format!("{name} (Process {})", t.pid),
        },
        (Some(name), _) => format!("{name} ({})", label.replace(&format!(" ({name})"), "")),
        (None, true) => format!("main ({})", label.replace(" (main)", "")),
        (None, false) => label,
    }
}

/// The profile's metadata: the profiler's fields, and what it does not have a field for in
/// `extra`, which its profile info panel lists.
fn meta(profile: &Profile, period_us: f64) -> Value {
    let sampler = match profile.kernel {
        Some(_) => "BPF (in the kernel)",
        None => "user space (process_vm_readv)",
    };
    let dropped: u64 = profile.errors.values().sum();
    let mut entries = vec![
        json!({"label": "pid", "format": "string", "value": profile.pid.to_string()}),
        json!({"label": "Ruby", "format": "string", "value": profile.ruby_version}),
        json!({"label": "JIT", "format": "string", "value": profile.jit.as_deref().unwrap_or("none seen")}),
        json!({"label": "Rate", "format": "string", "value": format!("{} Hz", profile.rate_hz)}),
        json!({"label": "Sampler", "format": "string", "value": sampler}),
        json!({"label": "Samples", "format": "integer", "value": profile.samples}),
        json!({"label": "Dropped samples", "format": "integer", "value": dropped}),
    ];
    for (reason, n) in &profile.errors {
        entries
            .push(json!({"label": format!("Dropped: {reason}"), "format": "integer", "value": n}));
    }
    for (i, note) in profile.notes.iter().enumerate() {
        entries
            .push(json!({"label": format!("Note {}", i + 1), "format": "string", "value": note}));
    }
    let categories: Vec<Value> = CATEGORIES
        .iter()
        .map(|(name, color, subs)| json!({"name": name, "color": color, "subcategories": subs}))
        .collect();
    json!({
        "interval": period_us / 1000.0,
        "startTime": profile.start_unix_ns as f64 / 1e6,
        "profilingStartTime": 0,
        "profilingEndTime": profile.duration_ns as f64 / 1e6,
        "processType": 0,
        "product": format!(
            "Ruby {}{} (pid {}), rbspy_ext",
            profile.ruby_version,
            profile.jit.as_deref().map_or(String::new(), |j| format!(" +{j}")),
            profile.pid
        ),
        "stackwalk": 0,
        "version": 24,
        "preprocessedProfileVersion": VERSION,
        "symbolicated": true,
        "platform": "Linux",
        "oscpu": "Linux",
        "categories": categories,
        "markerSchema": markers::schema(),
        "sampleUnits": {"time": "ms", "eventDelay": "ms", "threadCPUDelta": "µs"},
        "usesOnlyOneStackType": true,
        "sourceCodeIsNotOnSearchfox": true,
        "extra": [{"label": "Recording", "entries": entries}],
        "configuration": {
            "threads": [],
            "features": [sampler],
            "capacity": 0,
            "duration": profile.duration_ns as f64 / 1e9,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::{fixture, write as write_format, Format, Options};
    use crate::profile::{frame, Aggregator, ThreadState};
    use std::time::Duration;

    /// The file, gunzipped and parsed.
    fn document(profile: &Profile) -> Value {
        let mut out = Vec::new();
        write_format(profile, Format::Firefox, &mut out, &Options::default()).unwrap();
        let json = flate2::read::GzDecoder::new(&out[..]);
        serde_json::from_reader(json).unwrap()
    }

    /// Thread `t`'s samples: time in ms, frame labels root first, the leaf's category name.
    fn samples(doc: &Value, t: usize) -> Vec<(f64, Vec<String>, String)> {
        let shared = &doc["shared"];
        let strings = shared["stringArray"].as_array().unwrap();
        let column = |table: &str, key: &str, i: u64| shared[table][key][i as usize].clone();
        let thread = &doc["threads"][t]["samples"];
        let mut at = 0.0;
        let mut out = Vec::new();
        for (i, stack) in thread["stack"].as_array().unwrap().iter().enumerate() {
            at += thread["timeDeltas"][i].as_f64().unwrap();
            let mut labels = Vec::new();
            let mut node = stack.as_u64();
            let leaf = column(
                "frameTable",
                "category",
                column("stackTable", "frame", node.unwrap())
                    .as_u64()
                    .unwrap(),
            );
            while let Some(n) = node {
                let frame = column("stackTable", "frame", n).as_u64().unwrap();
                let func = column("frameTable", "func", frame).as_u64().unwrap();
                let name = column("funcTable", "name", func).as_u64().unwrap();
                labels.push(strings[name as usize].as_str().unwrap().to_string());
                node = column("stackTable", "prefix", n).as_u64();
            }
            labels.reverse();
            let category = CATEGORIES[leaf.as_u64().unwrap() as usize].0.to_string();
            out.push((at, labels, category));
        }
        out
    }

    /// Thread `t`'s markers: name, start, end (ms), samples.
    fn markers(doc: &Value, t: usize) -> Vec<(String, f64, f64, u64)> {
        let strings = doc["shared"]["stringArray"].as_array().unwrap();
        let m = &doc["threads"][t]["markers"];
        (0..m["length"].as_u64().unwrap() as usize)
            .map(|i| {
                let name = strings[m["name"][i].as_u64().unwrap() as usize]
                    .as_str()
                    .unwrap();
                (
                    name.to_string(),
                    m["startTime"][i].as_f64().unwrap(),
                    m["endTime"][i].as_f64().unwrap(),
                    m["data"][i]["samples"].as_u64().unwrap(),
                )
            })
            .collect()
    }

    /// Main runs, collects garbage, sleeps; the worker waits for the GVL then runs, in a
    /// traced request, from 3 ms; 1 kHz, 10 ms.
    fn recording() -> Profile {
        let [main, worker, _] = fixture::threads();
        let mut agg = Aggregator::new(4242, "3.3.0", 1000.0, 1_700_000_000_000_000_000);
        let work = [fixture::work(), fixture::main_rb()];
        let sleep = [fixture::sleep_c(), fixture::work(), fixture::main_rb()];
        let traced: crate::model::Tags = vec![
            ("request_id".into(), "r1".into()),
            ("endpoint".into(), "orders#show".into()),
            ("trace id".into(), "0af7651916cd43dd8448eb211c80319c".into()),
            ("span id".into(), "b7ad6b7169203331".into()),
            ("trace endpoint".into(), "OrdersController#show".into()),
        ]
        .into();
        for ms in 0..10u64 {
            agg.tick_at(Duration::from_millis(ms));
            let (state, frames): (_, &[_]) = match ms {
                0..=3 => (ThreadState::Running, &work),
                4..=5 => (ThreadState::GcMarking, &work),
                _ => (ThreadState::Blocked, &sleep),
            };
            agg.add_stack(&main, state, ms, frames, &Default::default());
            if ms >= 3 {
                let state = match ms {
                    3..=6 => ThreadState::WaitingForGvl,
                    _ => ThreadState::Running,
                };
                let bar = [frame("Foo#bar", "foo.rb", 2, false)];
                agg.add_stack(&worker, state, 99 + ms, &bar, &traced);
            }
        }
        agg.finish(10_000_000)
    }

    #[test]
    fn output_firefox_every_thread_with_times_stacks_and_states() {
        let doc = document(&recording());
        assert_eq!(doc["meta"]["preprocessedProfileVersion"], VERSION);
        assert_eq!(doc["meta"]["interval"], 1.0);
        assert_eq!(doc["meta"]["startTime"], 1_700_000_000_000.0);
        let threads = doc["threads"].as_array().unwrap();
        assert_eq!(threads.len(), 2); // the third thread has no samples
        assert_eq!(threads[0]["name"], "main (Thread 4242)");
        assert_eq!(threads[0]["isMainThread"], true);
        assert_eq!(threads[1]["name"], "worker (Thread 4250)");
        assert_eq!(threads[1]["tid"], 4250);

        let main_samples = samples(&doc, 0);
        assert_eq!(main_samples.len(), 10);
        let at: Vec<f64> = main_samples.iter().map(|s| s.0).collect();
        assert_eq!(at, (0..10).map(f64::from).collect::<Vec<_>>());
        assert_eq!(main_samples[0].1, ["<main>", "Object#work"]);
        assert_eq!(main_samples[0].2, "Ruby");
        assert_eq!(main_samples[4].1, ["<main>", "Object#work", "[GC marking]"]);
        assert_eq!(main_samples[4].2, "GC");
        assert_eq!(main_samples[9].1, ["<main>", "Object#work", "Kernel#sleep"]);
        assert_eq!(main_samples[9].2, "Idle");
        let worker_samples = samples(&doc, 1);
        assert_eq!(worker_samples[0].1, ["Foo#bar", "[waiting for GVL]"]);
        assert_eq!(worker_samples[0].2, "GVL wait");
        assert_eq!(worker_samples[6].1, ["Foo#bar"]);
    }

    #[test]
    fn output_firefox_markers_cover_runs_of_states_spans_and_tags() {
        let doc = document(&recording());
        // One marker per run, from its first sample to the end of its last.
        assert_eq!(
            markers(&doc, 0),
            [
                ("GC marking".to_string(), 4.0, 6.0, 2),
                ("Blocked".to_string(), 6.0, 10.0, 4),
            ]
        );
        let worker_markers = markers(&doc, 1);
        assert!(worker_markers.contains(&("GVL wait".to_string(), 3.0, 7.0, 4)));
        assert!(worker_markers.contains(&("OrdersController#show".to_string(), 3.0, 10.0, 7)));
        assert!(worker_markers.contains(&("orders#show".to_string(), 3.0, 10.0, 7)));
        assert_eq!(worker_markers.len(), 3);
    }

    #[test]
    fn output_firefox_functions_have_files_and_frames_lines() {
        let doc = document(&recording());
        // Functions: a Ruby function has its file, a C function none; frames carry lines.
        let shared = &doc["shared"];
        let strings = shared["stringArray"].as_array().unwrap();
        let funcs = &shared["funcTable"];
        let name_of = |i: usize| {
            strings[funcs["name"][i].as_u64().unwrap() as usize]
                .as_str()
                .unwrap()
        };
        let sleep_func = (0..funcs["length"].as_u64().unwrap() as usize)
            .find(|&i| name_of(i) == "Kernel#sleep")
            .unwrap();
        assert_eq!(funcs["isJS"][sleep_func], false);
        assert!(funcs["source"][sleep_func].is_null());
        let work_func = (0..funcs["length"].as_u64().unwrap() as usize)
            .find(|&i| name_of(i) == "Object#work")
            .unwrap();
        assert_eq!(funcs["isJS"][work_func], true);
        let source = funcs["source"][work_func].as_u64().unwrap() as usize;
        let file = shared["sources"]["filename"][source].as_u64().unwrap() as usize;
        assert_eq!(strings[file], "lib/work.rb");
        let frames = &shared["frameTable"];
        let lines: Vec<u64> = (0..frames["length"].as_u64().unwrap() as usize)
            .filter(|&i| frames["func"][i] == work_func)
            .map(|i| frames["line"][i].as_u64().unwrap())
            .collect();
        assert_eq!(lines, [5]);
    }

    #[test]
    fn output_firefox_needs_a_timeline() {
        let mut old = fixture::profile();
        old.timeline = Default::default();
        let err =
            write_format(&old, Format::Firefox, &mut Vec::new(), &Options::default()).unwrap_err();
        assert!(err.to_string().contains("no timeline"), "{err}");
    }
}
