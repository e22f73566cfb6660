//! speedscope's JSON file format (<https://www.speedscope.app/file-format-schema.json>, shipped
//! in the `speedscope` npm package as `dist/release/file-format-schema.json`).
//!
//! Stacks are shaped by [`Options`] first ([`super::view`]: functions of every thread, idle
//! samples left out, by default). Frames are shared (`name` = label, `file` = path, `line`
//! with `lines`), one per distinct (label, path, line). All threads share one "sampled"
//! profile, or with `per_thread` each thread has its own (speedscope names each in its
//! profile menu, so no thread root frame is added), or with `tag_root` each value of the tag.
//! Samples are frame indexes root first, one sample per distinct stack, weighted by its
//! duration: count × 1000 / rate milliseconds (unit "milliseconds"), or by its count (unit
//! "none") when the rate is unknown. With `state` each stack's root is its state's pseudo
//! frame. The file's name says how many idle samples were left out.
//!
//! The samples are aggregated, not in time order: speedscope's "Time Order" view shows them
//! in the order first seen; "Left Heavy" and "Sandwich" are the meaningful views.
use super::{sample_period_ns, thread_label, view, Options, OutputError};
use crate::profile::Profile;
use serde::Serialize;
use std::collections::HashMap;
use std::io::Write;

pub const SCHEMA_URL: &str = "https://www.speedscope.app/file-format-schema.json";

/// A speedscope file: its profiles are "sampled" here, "evented" in the timeline format.
#[derive(Serialize)]
pub(crate) struct File<'a, P> {
    #[serde(rename = "$schema")]
    pub schema: &'static str,
    pub shared: Shared<'a>,
    pub profiles: Vec<P>,
    pub name: String,
    #[serde(rename = "activeProfileIndex")]
    pub active_profile_index: usize,
    pub exporter: String,
}

#[derive(Serialize)]
pub(crate) struct Shared<'a> {
    pub frames: Vec<Frame<'a>>,
}

#[derive(Serialize)]
pub(crate) struct Frame<'a> {
    pub name: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub line: Option<i32>,
}

/// What `exporter` says in every speedscope file.
pub(crate) fn exporter() -> String {
    format!("rbspy_ext {}", env!("CARGO_PKG_VERSION"))
}

/// One profile of a speedscope file: "sampled" (`Sampled` samples and weights) here,
/// "evented" (open and close events) in the timeline format.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct SpeedscopeProfile<B> {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub name: String,
    pub unit: &'static str,
    pub start_value: f64,
    pub end_value: f64,
    #[serde(flatten)]
    pub body: B,
}

#[derive(Serialize, Default)]
struct Sampled {
    samples: Vec<Vec<usize>>,
    weights: Vec<f64>,
}

type SampledProfile = SpeedscopeProfile<Sampled>;

impl SampledProfile {
    fn new(name: String, unit: &'static str) -> Self {
        SpeedscopeProfile {
            kind: "sampled",
            name,
            unit,
            start_value: 0.0,
            end_value: 0.0,
            body: Sampled::default(),
        }
    }
}

pub fn write(profile: &Profile, out: &mut dyn Write, options: &Options) -> Result<(), OutputError> {
    let (shaped, note) = view(profile, options);
    let profile = &*shaped;
    let (frames, remap) = shared_frames(profile);
    let (unit, ms_per_sample) = match sample_period_ns(profile) {
        Some(ns) => ("milliseconds", ns / 1e6),
        None => ("none", 1.0),
    };
    let (names, group_of) = groups(profile, options);
    let mut profiles: Vec<SampledProfile> = names
        .into_iter()
        .map(|name| SampledProfile::new(name, unit))
        .collect();
    let mut counts = vec![0u64; profiles.len()];
    for (stack, &g) in profile.stacks.iter().zip(&group_of) {
        let p = &mut profiles[g];
        let root_first = stack.frames.iter().rev().map(|&f| remap[f as usize]);
        p.body.samples.push(root_first.collect());
        p.body.weights.push(stack.count as f64 * ms_per_sample);
        counts[g] += stack.count;
    }
    for (p, count) in profiles.iter_mut().zip(&counts) {
        // Multiplied once rather than summed: endValue is exactly the weights' total unless
        // floating point rounding says otherwise by an ulp, which speedscope ignores.
        p.end_value = *count as f64 * ms_per_sample;
    }
    // Drop threads without samples (none from an Aggregator, but a hand-built profile may
    // have them); open on the busiest thread.
    let mut kept: Vec<(SampledProfile, u64)> = profiles
        .into_iter()
        .zip(counts)
        .filter(|(_, c)| *c > 0 || !(options.per_thread || options.tag_root.is_some()))
        .collect();
    if kept.is_empty() {
        kept.push((SampledProfile::new("No samples".to_string(), unit), 0));
    }
    let active_profile_index = kept
        .iter()
        .enumerate()
        .max_by_key(|(i, (_, c))| (*c, std::cmp::Reverse(*i)))
        .map(|(i, _)| i)
        .unwrap_or(0);
    let version = if profile.ruby_version.is_empty() {
        String::new()
    } else {
        format!(" (Ruby {})", profile.ruby_version)
    };
    let file = File {
        schema: SCHEMA_URL,
        shared: Shared { frames },
        profiles: kept.into_iter().map(|(p, _)| p).collect(),
        name: match note {
            None => format!("rbspy_ext: pid {}{version}", profile.pid),
            Some(note) => format!("rbspy_ext: pid {}{version}; {note}", profile.pid),
        },
        active_profile_index,
        exporter: exporter(),
    };
    serde_json::to_writer(&mut *out, &file)?;
    Ok(())
}

/// speedscope's shared frames, and for each profile frame its index among them: frames
/// differing only in their absolute path or C-ness would look identical in speedscope, so
/// they share one entry.
fn shared_frames(profile: &Profile) -> (Vec<Frame<'_>>, Vec<usize>) {
    let mut frames: Vec<Frame> = Vec::new();
    let mut index_of: HashMap<(&str, &str, i32), usize> = HashMap::new();
    let remap = profile
        .frames
        .iter()
        .map(|f| {
            *index_of
                .entry((&f.label, &f.path, f.lineno))
                .or_insert_with(|| {
                    frames.push(Frame {
                        name: &f.label,
                        file: (!f.path.is_empty()).then_some(&*f.path),
                        line: (f.lineno > 0).then_some(f.lineno),
                    });
                    frames.len() - 1
                })
        })
        .collect();
    (frames, remap)
}

/// The profiles' names and each stack's profile, in the order first seen: one for all
/// threads; with `per_thread` one per thread; with `tag_root` one per value of that tag
/// ("endpoint=orders#show", "endpoint=-"); with both, one per value and thread
/// ("endpoint=orders#show · Thread 12 (puma srv tp 001)").
fn groups(profile: &Profile, options: &Options) -> (Vec<String>, Vec<usize>) {
    let roots = options
        .tag_root
        .as_ref()
        .map(|key| super::tag_roots(profile, key));
    let threads: Vec<String> = match options.per_thread {
        true => (0..profile.threads.len() as u32)
            .map(|t| thread_label(profile, t))
            .collect(),
        false => Vec::new(),
    };
    let name = |stack: &crate::profile::StackCount| {
        let tag = roots
            .as_ref()
            .map(|r| r.get(stack.tags as usize).cloned().unwrap_or_default());
        let thread = threads.get(stack.thread as usize).cloned();
        match (tag, thread) {
            (Some(tag), Some(thread)) => format!("{tag} · {thread}"),
            (Some(tag), None) => tag,
            (None, Some(thread)) => thread,
            (None, None) => "All threads".to_string(),
        }
    };
    let mut names: Vec<String> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    let group_of = profile
        .stacks
        .iter()
        .map(|stack| {
            *index.entry(name(stack)).or_insert_with_key(|n| {
                names.push(n.clone());
                names.len() - 1
            })
        })
        .collect();
    if names.is_empty() {
        names.push("All threads".to_string());
    }
    (names, group_of)
}

#[cfg(test)]
mod tests {
    use super::SCHEMA_URL;
    use crate::output::{fixture, write, Format, Options};
    use serde_json::Value;
    use std::collections::BTreeMap;

    fn speedscope(options: &Options) -> Value {
        let mut out = Vec::new();
        write(&fixture::profile(), Format::Speedscope, &mut out, options).unwrap();
        serde_json::from_slice(&out).expect("valid JSON")
    }

    /// The schema's requirements, checked by hand. spec/viewer_spec.rb validates what a
    /// recording of a live Ruby writes against the schema the speedscope app ships.
    fn check_structure(doc: &Value) {
        assert_eq!(doc["$schema"], SCHEMA_URL);
        assert!(doc["name"].is_string() && doc["exporter"].is_string());
        let frames = doc["shared"]["frames"].as_array().unwrap();
        for f in frames {
            assert!(f["name"].is_string());
            assert!(f.get("file").is_none_or(Value::is_string));
            assert!(f.get("line").is_none_or(Value::is_number));
        }
        let profiles = doc["profiles"].as_array().unwrap();
        assert!(doc["activeProfileIndex"].as_u64().unwrap() < profiles.len() as u64);
        for p in profiles {
            assert_eq!(p["type"], "sampled");
            assert!(p["name"].is_string());
            assert!(["none", "milliseconds"].contains(&p["unit"].as_str().unwrap()));
            assert_eq!(p["startValue"], 0.0);
            let samples = p["samples"].as_array().unwrap();
            let weights = p["weights"].as_array().unwrap();
            assert_eq!(samples.len(), weights.len());
            for s in samples {
                for i in s.as_array().unwrap() {
                    assert!(i.as_u64().unwrap() < frames.len() as u64);
                }
            }
            let total: f64 = weights.iter().map(|w| w.as_f64().unwrap()).sum();
            assert!((total - p["endValue"].as_f64().unwrap()).abs() < 1e-6);
        }
    }

    #[test]
    fn output_speedscope_matches_the_schema_and_the_profile() {
        let p = fixture::profile();
        let doc = speedscope(&Options {
            per_thread: true,
            lines: true,
            idle: true,
            ..Options::default()
        });
        check_structure(&doc);
        let profiles = doc["profiles"].as_array().unwrap();
        assert_eq!(profiles.len(), 3);
        assert_eq!(profiles[0]["name"], "Thread 4242 (main)");
        assert_eq!(profiles[0]["unit"], "milliseconds");
        assert_eq!(doc["activeProfileIndex"], 0);
        // 100 Hz: 10 ms a sample.
        assert_eq!(profiles[0]["endValue"], 240.0);
        let total: f64 = profiles
            .iter()
            .map(|p| p["endValue"].as_f64().unwrap())
            .sum();
        assert_eq!(total, p.samples as f64 * 10.0);

        // Re-read the stacks through the shared frames: root first, as in the profile.
        let frames = doc["shared"]["frames"].as_array().unwrap();
        let name = |i: &Value| {
            let f = &frames[i.as_u64().unwrap() as usize];
            format!(
                "{} {}:{}",
                f["name"].as_str().unwrap(),
                f["file"].as_str().unwrap_or(""),
                f["line"]
            )
        };
        let mut read: BTreeMap<Vec<String>, f64> = BTreeMap::new();
        for (s, w) in profiles[0]["samples"]
            .as_array()
            .unwrap()
            .iter()
            .zip(profiles[0]["weights"].as_array().unwrap())
        {
            *read
                .entry(s.as_array().unwrap().iter().map(name).collect())
                .or_default() += w.as_f64().unwrap();
        }
        let sleep = vec![
            "<main> app.rb:10".to_string(),
            "Object#work lib/work.rb:5".to_string(),
            "Kernel#sleep lib/work.rb:6".to_string(),
        ];
        assert_eq!(read[&sleep], 70.0);
        // Frames are shared between threads: "<main>" appears once.
        assert_eq!(frames.iter().filter(|f| f["name"] == "<main>").count(), 1);
        // An empty stack is an empty sample.
        assert_eq!(profiles[2]["samples"], serde_json::json!([[]]));
    }

    #[test]
    fn output_speedscope_by_tag_and_by_thread_together() {
        use crate::profile::{Aggregator, ThreadState};
        let [main, worker, _] = fixture::threads();
        let mut agg = Aggregator::new(4242, "3.3.0", 100.0, 0);
        let job: crate::model::Tags = vec![("job".into(), "report".into())].into();
        let frames = [fixture::work()];
        agg.add_stack(&main, ThreadState::Running, 1, &frames, &job);
        agg.add_stack(&worker, ThreadState::Running, 1, &frames, &job);
        agg.add_stack(
            &worker,
            ThreadState::Running,
            1,
            &frames,
            &Default::default(),
        );
        let p = agg.finish(1);
        let names = |options: &Options| -> Vec<String> {
            let mut out = Vec::new();
            write(&p, Format::Speedscope, &mut out, options).unwrap();
            let doc: Value = serde_json::from_slice(&out).unwrap();
            check_structure(&doc);
            doc["profiles"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p["name"].as_str().unwrap().to_string())
                .collect()
        };
        let by_tag = Options {
            tag_root: Some("job".into()),
            ..Options::default()
        };
        assert_eq!(names(&by_tag), ["job=report", "job=-"]);
        let both = Options {
            per_thread: true,
            ..by_tag
        };
        assert_eq!(
            names(&both),
            [
                "job=report · Thread 4242 (main)",
                "job=report · Thread 4250 (worker)",
                "job=- · Thread 4250 (worker)"
            ]
        );
    }

    #[test]
    fn output_speedscope_one_profile_without_grouping_and_none_unit_without_rate() {
        let doc = speedscope(&Options::default());
        check_structure(&doc);
        assert_eq!(doc["profiles"].as_array().unwrap().len(), 1);
        // 32 samples, 8 of them idle (blocked): left out, and the name says so.
        assert_eq!(doc["profiles"][0]["endValue"], 240.0);
        let name = doc["name"].as_str().unwrap();
        assert!(name.contains("8 idle samples"), "{name}");
        let frames = doc["shared"]["frames"].as_array().unwrap();
        assert!(frames.iter().all(|f| f.get("line").is_none()));
        assert!(frames.iter().all(|f| f["name"] != "Kernel#sleep"));

        let doc = speedscope(&Options {
            idle: true,
            state: true,
            ..Options::default()
        });
        check_structure(&doc);
        assert_eq!(doc["profiles"][0]["endValue"], 320.0);
        let frames = doc["shared"]["frames"].as_array().unwrap();
        for s in doc["profiles"][0]["samples"].as_array().unwrap() {
            let root = &frames[s[0].as_u64().unwrap() as usize]["name"];
            assert!(root.as_str().unwrap().starts_with('['), "{root}");
        }

        let mut p = fixture::profile();
        p.rate_hz = 0.0;
        let mut out = Vec::new();
        let idle = Options {
            idle: true,
            ..Options::default()
        };
        write(&p, Format::Speedscope, &mut out, &idle).unwrap();
        let doc: Value = serde_json::from_slice(&out).unwrap();
        check_structure(&doc);
        assert_eq!(doc["profiles"][0]["unit"], "none");
        assert_eq!(doc["profiles"][0]["endValue"], 32.0);
    }
}
