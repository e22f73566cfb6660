//! Allocations in the views a recording has: a [`Profile`] whose stacks count objects or
//! bytes instead of samples of time, each ending in a leaf that names the class allocated
//! (`(String)`), so the flamegraph, speedscope and collapsed writers draw them as they draw
//! time; and a text summary of its own (the recording's speaks of threads and Hz).
use super::{AllocProfile, SiteCounts};
use crate::model::Frame;
use crate::profile::{frame, Profile, StackCount, ThreadInfo, ThreadState};
use rustc_hash::FxHashMap as HashMap;
use std::fmt::Write as _;

/// What a view of allocations counts: Go's four sample types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measure {
    AllocObjects,
    AllocSpace,
    InuseObjects,
    InuseSpace,
}

impl Measure {
    pub const ALL: [Measure; 4] = [
        Measure::AllocObjects,
        Measure::AllocSpace,
        Measure::InuseObjects,
        Measure::InuseSpace,
    ];

    /// Its pprof name: `alloc_objects`, `alloc_space`, `inuse_objects`, `inuse_space`.
    pub fn name(self) -> &'static str {
        match self {
            Measure::AllocObjects => "alloc_objects",
            Measure::AllocSpace => "alloc_space",
            Measure::InuseObjects => "inuse_objects",
            Measure::InuseSpace => "inuse_space",
        }
    }

    pub fn parse(name: &str) -> Result<Measure, String> {
        Measure::ALL
            .into_iter()
            .find(|m| m.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Measure::ALL.iter().map(|m| m.name()).collect();
                format!("unknown measure {name:?}: one of {}", names.join(", "))
            })
    }

    /// What one count is: "objects" or "bytes".
    pub fn unit(self) -> &'static str {
        match self {
            Measure::AllocObjects | Measure::InuseObjects => "objects",
            Measure::AllocSpace | Measure::InuseSpace => "bytes",
        }
    }

    fn of(self, site: &SiteCounts) -> u64 {
        let e = site.estimates();
        match self {
            Measure::AllocObjects => e.alloc_objects,
            Measure::AllocSpace => e.alloc_space,
            Measure::InuseObjects => e.inuse_objects,
            Measure::InuseSpace => e.inuse_space,
        }
    }
}

/// The label of a class leaf: `(String)`, or `(hidden T_ARRAY)` for an object without one.
fn class_leaf(site: &SiteCounts) -> String {
    if site.class.is_empty() {
        format!("(hidden {})", site.type_name)
    } else {
        format!("({})", site.class)
    }
}

/// The allocations as a profile whose stacks count `measure` (estimates, scaled): one thread,
/// every stack running, each ending in its class's leaf. `rate_hz` is 0 (no time) and
/// `count_name` the unit, which the writers show instead of "samples".
pub fn as_profile(allocs: &AllocProfile, measure: Measure) -> Profile {
    let allocs = &*allocs.frameless_named();
    let mut frames: Vec<Frame> = allocs.frames.clone();
    let mut leaves: HashMap<String, u32> = HashMap::default();
    let mut stacks: Vec<StackCount> = Vec::new();
    for site in &allocs.sites {
        let count = measure.of(site);
        if count == 0 {
            continue;
        }
        let label = class_leaf(site);
        let leaf = *leaves.entry(label.clone()).or_insert_with(|| {
            frames.push(frame(&label, "", 0, true));
            (frames.len() - 1) as u32
        });
        let mut ids = Vec::with_capacity(site.frames.len() + 1);
        ids.push(leaf);
        ids.extend_from_slice(&site.frames);
        stacks.push(StackCount {
            thread: 0,
            state: ThreadState::Running,
            frames: ids,
            count,
            tags: 0,
        });
    }
    let samples = stacks.iter().map(|s| s.count).sum();
    Profile {
        pid: allocs.pid,
        ruby_version: allocs.ruby_version.clone(),
        start_unix_ns: allocs.start_unix_ns,
        duration_ns: allocs.duration_ns,
        ticks: samples,
        samples,
        notes: allocs.notes.clone(),
        threads: vec![ThreadInfo {
            pid: allocs.pid,
            tid: 0,
            name: Some(format!("{} ({})", measure.name(), measure.unit())),
            ruby_thread: 0,
            main: true,
            ractor: 0,
            ractor_name: None,
        }],
        frames,
        stacks,
        count_name: Some(measure.unit().to_string()),
        ..Profile::default()
    }
}

/// Rows in each table of [`summary`].
pub const TOP: usize = 20;

/// The allocations as text: totals, then the top sites by function (the innermost frame),
/// by source line and by class, each by `measure`.
pub fn summary(allocs: &AllocProfile, measure: Measure) -> String {
    let t = allocs.totals();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "rbspy_ext allocations of pid {} (Ruby {}), {:.2} s, one sample every {} bytes",
        allocs.pid,
        allocs.ruby_version,
        allocs.duration_ns as f64 / 1e9,
        allocs.rate_bytes
    );
    let _ = writeln!(
        out,
        "Allocated: {} objects, {} bytes; in use: {} objects, {} bytes (estimates)",
        t.alloc_objects, t.alloc_space, t.inuse_objects, t.inuse_space
    );
    for note in &allocs.notes {
        let _ = writeln!(out, "Note: {note}");
    }
    let mut by_function: HashMap<String, u64> = HashMap::default();
    let mut by_line: HashMap<String, u64> = HashMap::default();
    let mut by_class: HashMap<String, u64> = HashMap::default();
    for site in &allocs.sites {
        let n = measure.of(site);
        let innermost = site.frames.first().map(|&f| &allocs.frames[f as usize]);
        let (function, line) = match innermost {
            Some(f) if f.c_function => (
                format!("{} (C function)", f.label),
                format!("{}:{} {}", f.path, f.lineno, f.label),
            ),
            Some(f) => (
                format!("{} - {}", f.label, f.path),
                format!("{}:{} {}", f.path, f.lineno, f.label),
            ),
            None => ("(no Ruby frame)".to_string(), "(no Ruby frame)".to_string()),
        };
        *by_function.entry(function).or_default() += n;
        *by_line.entry(line).or_default() += n;
        *by_class.entry(class_leaf(site)).or_default() += n;
    }
    let total: u64 = by_class.values().sum();
    for (title, rows) in [
        ("functions (innermost frame)", by_function),
        ("source lines", by_line),
        ("classes", by_class),
    ] {
        let _ = writeln!(out, "\nTop {TOP} {title} by {}", measure.name());
        let _ = writeln!(out, "{:>7}  {:>12}  name", "%", measure.unit());
        let mut rows: Vec<(String, u64)> = rows.into_iter().filter(|(_, n)| *n > 0).collect();
        rows.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        if rows.is_empty() {
            let _ = writeln!(out, "  (none)");
        }
        for (name, n) in rows.into_iter().take(TOP) {
            let share = if total == 0 {
                0.0
            } else {
                100.0 * n as f64 / total as f64
            };
            let _ = writeln!(out, "{share:>6.2}%  {n:>12}  {name}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::{write, Format, Options};

    fn allocs() -> AllocProfile {
        let frames = vec![
            frame("Class#new", "/app/a.rb", 3, true),
            frame("A.make", "/app/a.rb", 3, false),
            frame("<main>", "/app/a.rb", 9, false),
        ];
        let mut kept = SiteCounts {
            frames: vec![0, 1, 2],
            class: "Widget".into(),
            type_name: "T_OBJECT".into(),
            ..SiteCounts::default()
        };
        let mut strings = SiteCounts {
            frames: vec![1, 2],
            class: "String".into(),
            type_name: "T_STRING".into(),
            ..SiteCounts::default()
        };
        for _ in 0..30 {
            kept.add(40, 1);
        }
        for _ in 0..10 {
            strings.add(80, 1);
            strings.free(80, 1);
        }
        AllocProfile {
            pid: 7,
            ruby_version: "3.3.8".into(),
            rate_bytes: 1,
            start_unix_ns: 0,
            duration_ns: 1_000_000_000,
            frames,
            sites: vec![kept, strings],
            notes: vec![],
        }
    }

    #[test]
    fn allocs_view_counts_each_measure_under_a_class_leaf() {
        let a = allocs();
        let objects = as_profile(&a, Measure::AllocObjects);
        let mut folded = Vec::new();
        write(
            &objects,
            Format::Collapsed,
            &mut folded,
            &Options::default(),
        )
        .unwrap();
        let folded = String::from_utf8(folded).unwrap();
        assert!(
            folded.contains("<main> /app/a.rb;A.make /app/a.rb;Class#new;(Widget) 30"),
            "{folded}"
        );
        assert!(folded.contains("A.make /app/a.rb;(String) 10"), "{folded}");
        // In use: the Strings are gone, so their stack is not drawn at all.
        let inuse = as_profile(&a, Measure::InuseSpace);
        assert_eq!(inuse.stacks.len(), 1);
        assert_eq!(inuse.stacks[0].count, 1200);
        let mut svg = Vec::new();
        write(&inuse, Format::Flamegraph, &mut svg, &Options::default()).unwrap();
        assert!(String::from_utf8(svg).unwrap().contains("1,200 bytes"));
    }

    #[test]
    fn allocs_summary_ranks_functions_lines_and_classes() {
        let text = summary(&allocs(), Measure::AllocSpace);
        assert!(text.contains("Allocated: 40 objects, 2000 bytes; in use: 30 objects, 1200 bytes"));
        let functions = text.split("Top 20 functions").nth(1).unwrap();
        let first = functions.lines().nth(2).unwrap();
        assert!(
            first.contains("1200") && first.contains("Class#new (C function)"),
            "{text}"
        );
        assert!(text.contains("/app/a.rb:3 A.make"), "{text}");
        let classes = text.split("Top 20 classes").nth(1).unwrap();
        assert!(
            classes.lines().nth(2).unwrap().contains("(Widget)"),
            "{text}"
        );
        assert!(Measure::parse("cpu").unwrap_err().contains("alloc_objects"));
    }
}
