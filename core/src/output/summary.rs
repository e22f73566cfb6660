//! Text summaries. `summary`: a header (pid, Ruby version, duration, samples and rate,
//! dropped samples by reason, notes, threads with their state breakdown), then the top
//! [`TOP`] functions by self samples (innermost frame) and by total samples (anywhere in the
//! stack, counted once per sample however deep the recursion). `lines` adds the top [`TOP`]
//! source lines (path:line, label) by self samples; a C function's line is its caller's.
//!
//! A function is a label plus a path; C functions are one function whatever calls them and
//! are shown "label (C function)". Percentages are of all samples; ties sort by name.
use super::leaves::leaf_label;
use super::{stack_samples, thread_label, FunctionKey, OutputError};
use crate::model::Frame;
use crate::profile::{Profile, ThreadState};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;

/// Rows in each table.
pub const TOP: usize = 20;

/// What a summary lists besides its function tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tables {
    /// The functions by self and by total samples (`--format summary`).
    Functions,
    /// Those and the source lines by self samples (`--format lines`).
    FunctionsAndLines,
}

/// The summary of `profile` (see [`Tables`]).
pub fn write(profile: &Profile, out: &mut dyn Write, tables: Tables) -> Result<(), OutputError> {
    let total = stack_samples(profile);
    header(profile, total, out)?;

    let (self_samples, total_samples) = function_samples(profile);
    let mut line_samples: HashMap<(&str, i32, &str), u64> = HashMap::new();
    for stack in &profile.stacks {
        let Some(&leaf) = stack.frames.first() else {
            continue;
        };
        let leaf = &profile.frames[leaf as usize];
        *line_samples
            .entry((&leaf.path, leaf.lineno, &leaf.label))
            .or_default() += stack.count;
    }

    let function_name = |f: &FunctionKey| {
        if f.is_leaf() {
            f.label.to_string()
        } else if f.is_c() {
            format!("{} (C function)", f.label)
        } else {
            format!("{} - {}", f.label, f.path)
        }
    };
    let table = |title: &str, rows: Vec<(String, u64)>, out: &mut dyn Write| {
        writeln!(out)?;
        writeln!(out, "{title}")?;
        writeln!(out, "{:>7}  {:>9}  function", "%", "samples")?;
        if rows.is_empty() {
            writeln!(out, "  (none)")?;
        }
        for (name, n) in rows {
            writeln!(out, "{:>7}  {:>9}  {name}", percent(n, total), n)?;
        }
        Ok::<(), std::io::Error>(())
    };
    table(
        &format!("Top {TOP} functions by self samples (innermost frame)"),
        top(&self_samples, |f| function_name(f)),
        out,
    )?;
    table(
        &format!("Top {TOP} functions by total samples (anywhere in the stack)"),
        top(&total_samples, |f| function_name(f)),
        out,
    )?;
    if tables == Tables::FunctionsAndLines {
        let rows = top(&line_samples, |(path, line, label)| match path.is_empty() {
            true => label.to_string(), // a state leaf: no line of the program
            false => format!("{path}:{line} {label}"),
        });
        writeln!(out)?;
        writeln!(out, "Top {TOP} source lines by self samples")?;
        writeln!(out, "{:>7}  {:>9}  path:line label", "%", "samples")?;
        if rows.is_empty() {
            writeln!(out, "  (none)")?;
        }
        for (name, n) in rows {
            writeln!(out, "{:>7}  {:>9}  {name}", percent(n, total), n)?;
        }
    }
    Ok(())
}

type Counts<'a> = HashMap<FunctionKey<'a>, u64>;

/// Samples by function: with it innermost (self), and with it anywhere in the stack (total,
/// counted once per sample however deep it recurses).
fn function_samples(profile: &Profile) -> (Counts<'_>, Counts<'_>) {
    let self_samples = self_samples(profile, |_, _| None);
    let mut total_samples = Counts::new();
    let mut in_stack: HashSet<FunctionKey> = HashSet::new();
    for stack in &profile.stacks {
        in_stack.clear();
        in_stack.extend(
            stack
                .frames
                .iter()
                .map(|&f| FunctionKey::of(&profile.frames[f as usize])),
        );
        for f in &in_stack {
            *total_samples.entry(*f).or_default() += stack.count;
        }
    }
    (self_samples, total_samples)
}

/// Samples by the function innermost in them: a stack's innermost frame's, or the leaf
/// `leaf` gives a stack (a state leaf, for a profile not given its leaves yet: see
/// `top_self`). Stacks are grouped by innermost frame first, so many stacks cost one lookup
/// each.
fn self_samples(
    profile: &Profile,
    leaf: impl Fn(ThreadState, Option<&Frame>) -> Option<&'static str>,
) -> Counts<'_> {
    let mut by_frame: HashMap<(u32, Option<&'static str>), u64> = HashMap::new();
    for s in &profile.stacks {
        if let Some(&innermost) = s.frames.first() {
            let leaf = leaf(s.state, profile.frames.get(innermost as usize));
            *by_frame.entry((innermost, leaf)).or_insert(0) += s.count;
        }
    }
    let mut counts = Counts::new();
    for ((frame, leaf), n) in by_frame {
        let key = match leaf {
            Some(label) => FunctionKey { label, path: "" },
            None => FunctionKey::of(&profile.frames[frame as usize]),
        };
        *counts.entry(key).or_insert(0) += n;
    }
    counts
}

/// The `n` (at most [`TOP`]) functions with the most self samples (label, samples), as the
/// summary's first table ranks them: what `rubyspy top` shows live.
/// A wait for the GVL or a GC pause counts as its state leaf, as in every view, without the
/// copy of the profile `leaves::with_state_leaves` makes (this runs twice a second).
pub fn top_self(profile: &Profile, n: usize) -> Vec<(String, u64)> {
    let mut rows = top(&self_samples(profile, leaf_label), |f| f.label.to_string());
    rows.truncate(n);
    rows
}

/// One function's samples (see [`functions`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FunctionSamples {
    pub label: String,
    /// "" for a C function (see the module docs of `output`).
    pub path: String,
    /// The line its frames were seen at most (for a C function, its callers' line).
    pub line: i32,
    pub self_samples: u64,
    pub total_samples: u64,
    /// A state leaf (`[waiting for GVL]`...: [`super::leaves`]), not a function.
    pub state_leaf: bool,
}

/// Every function of the profile, as the summary counts them: most self samples first, then
/// most total samples, then by label and path. `RubySpy::Profile#functions` is this list.
pub fn functions(profile: &Profile) -> Vec<FunctionSamples> {
    let (self_samples, total_samples) = function_samples(profile);
    let mut at_line: HashMap<(FunctionKey, i32), u64> = HashMap::new();
    for stack in &profile.stacks {
        for &f in &stack.frames {
            let frame = &profile.frames[f as usize];
            *at_line
                .entry((FunctionKey::of(frame), frame.lineno))
                .or_default() += stack.count;
        }
    }
    // The most seen line of each function; ties go to the first line.
    let mut line: HashMap<FunctionKey, (u64, i32)> = HashMap::new();
    for ((f, l), n) in at_line {
        let best = line.entry(f).or_insert((0, l));
        if (n, std::cmp::Reverse(l)) > (best.0, std::cmp::Reverse(best.1)) {
            *best = (n, l);
        }
    }
    let mut rows: Vec<FunctionSamples> = total_samples
        .iter()
        .map(|(f, total)| FunctionSamples {
            label: f.label.to_string(),
            path: f.path.to_string(),
            line: line.get(f).map_or(0, |(_, l)| *l),
            self_samples: self_samples.get(f).copied().unwrap_or(0),
            total_samples: *total,
            state_leaf: f.is_leaf(),
        })
        .collect();
    rows.sort_by(|a, b| {
        (b.self_samples, b.total_samples)
            .cmp(&(a.self_samples, a.total_samples))
            .then_with(|| (&a.label, &a.path).cmp(&(&b.label, &b.path)))
    });
    rows
}

fn header(profile: &Profile, total: u64, out: &mut dyn Write) -> std::io::Result<()> {
    let ruby = if profile.ruby_version.is_empty() {
        "unknown"
    } else {
        &profile.ruby_version
    };
    writeln!(
        out,
        "rbspy_ext profile of pid {} (Ruby {ruby})",
        profile.pid
    )?;
    writeln!(
        out,
        "Duration: {:.2} s, started at Unix time {}.{:09}",
        profile.duration_ns as f64 / 1e9,
        profile.start_unix_ns / 1_000_000_000,
        profile.start_unix_ns % 1_000_000_000
    )?;
    writeln!(
        out,
        "Samples: {total} thread stacks from {} ticks at {} Hz",
        profile.ticks, profile.rate_hz
    )?;
    cost_lines(out, profile)?;
    let dropped: u64 = profile.errors.values().sum();
    if dropped == 0 {
        writeln!(out, "Dropped samples: none")?;
    } else {
        writeln!(out, "Dropped samples: {dropped}")?;
        for (reason, n) in &profile.errors {
            writeln!(out, "  {n:>9}  {reason}")?;
        }
    }
    if !profile.notes.is_empty() {
        writeln!(out, "Notes:")?;
        for note in &profile.notes {
            writeln!(out, "  - {note}")?;
        }
    }
    // Per thread: samples, then each state's share of that thread's samples.
    let mut per_thread: BTreeMap<u32, BTreeMap<ThreadState, u64>> = BTreeMap::new();
    for s in &profile.stacks {
        *per_thread
            .entry(s.thread)
            .or_default()
            .entry(s.state)
            .or_default() += s.count;
    }
    writeln!(out, "Threads: {}", profile.threads.len())?;
    for t in 0..profile.threads.len() as u32 {
        let states = per_thread.remove(&t).unwrap_or_default();
        let n: u64 = states.values().sum();
        let breakdown: Vec<String> = states
            .iter()
            .map(|(s, c)| format!("{} {}% ({c})", s.name(), percent(*c, n)))
            .collect();
        writeln!(
            out,
            "  {}: {n} samples ({}% of all){}{}",
            thread_label(profile, t),
            percent(n, total),
            if breakdown.is_empty() { "" } else { ": " },
            breakdown.join(", ")
        )?;
    }
    Ok(())
}

/// The `TOP` heaviest keys, named, heaviest first; ties by name.
fn top<K>(counts: &HashMap<K, u64>, name: impl Fn(&K) -> String) -> Vec<(String, u64)> {
    let mut rows: Vec<(String, u64)> = counts.iter().map(|(k, n)| (name(k), *n)).collect();
    rows.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    rows.truncate(TOP);
    rows
}

fn percent(n: u64, total: u64) -> String {
    if total == 0 {
        "0.00".to_string()
    } else {
        format!("{:.2}", n as f64 * 100.0 / total as f64)
    }
}

/// What the recording cost the profiler, when it was measured.
fn cost_lines(out: &mut dyn std::io::Write, profile: &Profile) -> std::io::Result<()> {
    if let (Some(k), true) = (profile.kernel, profile.ticks > 0) {
        writeln!(
            out,
            "Profiler cost (BPF): {:.1} us per sample in the kernel ({} runs of {:.2} us, \
             other processes' ticks included), {:.1} us per sample in the recorder, {} \
             wake-ups, {} process_vm_readv calls",
            k.bpf_run_ns as f64 / 1e3 / profile.ticks as f64,
            k.bpf_runs,
            k.us_per_run(),
            profile.sampler_cpu_ns as f64 / 1e3 / profile.ticks as f64,
            k.wakeups,
            profile.read_calls
        )?;
    } else if profile.sampler_cpu_ns > 0 && profile.ticks > 0 {
        writeln!(
            out,
            "Profiler cost: {:.1} ms of CPU ({:.1} us per tick, {:.1} us of it sampling, \
             the rest waking up), {} process_vm_readv calls",
            profile.sampler_cpu_ns as f64 / 1e6,
            profile.sampler_cpu_ns as f64 / 1e3 / profile.ticks as f64,
            profile.sampler_work_ns as f64 / 1e3 / profile.ticks as f64,
            profile.read_calls
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::TOP;
    use crate::output::{fixture, write, Format, Options};
    use crate::profile::{frame, Aggregator, ThreadState};

    fn text(p: &crate::profile::Profile, format: Format) -> String {
        let mut out = Vec::new();
        write(p, format, &mut out, &Options::default()).unwrap();
        String::from_utf8(out).unwrap()
    }

    /// The rows of the table whose title starts with `title`: (percent, samples, name).
    fn rows(text: &str, title: &str) -> Vec<(f64, u64, String)> {
        text.lines()
            .skip_while(|l| !l.starts_with(title))
            .skip(2)
            .take_while(|l| !l.is_empty())
            .map(|l| {
                let mut parts = l.split_whitespace();
                let pct = parts.next().unwrap().parse().unwrap();
                let n = parts.next().unwrap().parse().unwrap();
                (pct, n, parts.collect::<Vec<_>>().join(" "))
            })
            .collect()
    }

    #[test]
    fn output_summary_header_and_tables() {
        let p = fixture::profile();
        let s = text(&p, Format::Summary);
        assert!(
            s.starts_with("rbspy_ext profile of pid 4242 (Ruby 3.3.0)\n"),
            "{s}"
        );
        assert!(s.contains("Duration: 0.40 s"));
        assert!(s.contains("Samples: 32 thread stacks from 40 ticks at 100 Hz"));
        assert!(s.contains("Dropped samples: 3\n"));
        assert!(s.contains("        2  stack changed while read\n"));
        assert!(s.contains("  - the target exited\n"));
        assert!(
            s.contains(
                "  Thread 4242 (main): 24 samples (75.00% of all): running 62.50% (15), \
             blocked 29.17% (7), gc 8.33% (2)\n"
            ),
            "{s}"
        );
        assert!(
            s.contains(
                "  Thread 4250 (worker): 7 samples (21.88% of all): running 42.86% (3), \
                 waiting_for_gvl 57.14% (4)\n"
            ),
            "{s}"
        );
        assert!(!s.contains("source lines"));

        // The worker's 4 samples waiting for the GVL in Object#work, and main's 2 in GC in
        // fib, are their leaves' self samples, not the frames'.
        let by_self = rows(&s, "Top 20 functions by self samples");
        assert_eq!(
            by_self[0],
            (31.25, 10, "Object#work - lib/work.rb".to_string())
        );
        assert_eq!(
            by_self[1],
            (21.88, 7, "Kernel#sleep (C function)".to_string())
        );
        assert_eq!(
            by_self[2],
            (15.62, 5, "Object#fib - lib/fib.rb".to_string())
        );
        assert_eq!(by_self[3], (12.5, 4, "[waiting for GVL]".to_string()));
        assert!(by_self.contains(&(6.25, 2, "[GC]".to_string())));
        // The empty stack counts in the total, not in any function.
        assert_eq!(by_self.iter().map(|r| r.1).sum::<u64>(), p.samples - 1);
        // Without leaves, the old shape: waits billed to the frame they stood in.
        let mut out = Vec::new();
        let bare = Options {
            no_state_leaves: true,
            ..Options::default()
        };
        write(&p, Format::Summary, &mut out, &bare).unwrap();
        let bare = rows(&String::from_utf8(out).unwrap(), "Top 20 functions by self");
        assert_eq!(
            bare[0],
            (43.75, 14, "Object#work - lib/work.rb".to_string())
        );
        assert!(bare.iter().all(|r| !r.2.starts_with('[')));

        let by_total = rows(&s, "Top 20 functions by total samples");
        assert_eq!(by_total[0], (96.88, 31, "<main> - app.rb".to_string()));
        assert_eq!(
            by_total[1],
            (65.62, 21, "Object#work - lib/work.rb".to_string())
        );
        // Recursion counted once per sample.
        assert!(by_total.contains(&(21.88, 7, "Object#fib - lib/fib.rb".to_string())));
        assert!(by_total.contains(&(12.5, 4, "block in Object#work - lib/work.rb".to_string())));
    }

    #[test]
    fn output_functions_as_the_summary_counts_them() {
        let p = fixture::profile();
        let rows = super::functions(&p);
        let find = |label: &str| rows.iter().find(|r| r.label == label).unwrap();
        let work = find("Object#work");
        assert_eq!(
            (work.path.as_str(), work.self_samples, work.total_samples),
            ("lib/work.rb", 14, 21)
        );
        assert_eq!(work.line, 5);
        // fib: line 4 in 12 samples (5 + 5 + 2, a frame each), line 3 in 7.
        assert_eq!(find("Object#fib").line, 4);
        let sleep = find("Kernel#sleep");
        assert_eq!(
            (sleep.path.as_str(), sleep.self_samples, sleep.total_samples),
            ("", 7, 7)
        );
        // Recursion counts once in total.
        assert_eq!(
            (
                find("Object#fib").self_samples,
                find("Object#fib").total_samples
            ),
            (7, 7)
        );
        assert_eq!(rows[0].label, "Object#work");
        let self_sum: u64 = rows.iter().map(|r| r.self_samples).sum();
        assert_eq!(self_sum, p.samples - 1); // the stack without frames has no function
        for pair in rows.windows(2) {
            assert!(pair[0].self_samples >= pair[1].self_samples);
        }
    }

    #[test]
    fn output_lines_summary() {
        let p = fixture::profile();
        let s = text(&p, Format::Lines);
        assert!(s.starts_with(&text(&p, Format::Summary)));
        let lines = rows(&s, "Top 20 source lines by self samples");
        assert_eq!(
            lines[0],
            (31.25, 10, "lib/work.rb:5 Object#work".to_string())
        );
        assert!(lines.contains(&(21.88, 7, "lib/work.rb:6 Kernel#sleep".to_string())));
        assert!(lines.contains(&(15.62, 5, "lib/fib.rb:3 Object#fib".to_string())));
        assert!(lines.contains(&(12.5, 4, "[waiting for GVL]".to_string())));
        assert!(lines.contains(&(9.38, 3, "lib/odd dir/odd.rb:3 weird;label".to_string())));
    }

    #[test]
    fn output_summary_keeps_the_top_rows() {
        let [main, ..] = fixture::threads();
        let mut agg = Aggregator::new(1, "3.3.0", 100.0, 0);
        for i in 0..30u64 {
            let f = frame(&format!("F#m{i:02}"), "f.rb", i as i32 + 1, false);
            agg.add_count(&main, ThreadState::Running, &[f, fixture::main_rb()], i + 1);
        }
        let s = text(&agg.finish(1), Format::Lines);
        let by_self = rows(&s, "Top 20 functions by self samples");
        assert_eq!(by_self.len(), TOP);
        assert_eq!(by_self[0].2, "F#m29 - f.rb");
        assert_eq!(by_self[19].2, "F#m10 - f.rb");
        assert_eq!(
            rows(&s, "Top 20 functions by total samples")[0].2,
            "<main> - app.rb"
        );
        assert_eq!(rows(&s, "Top 20 source lines").len(), TOP);
    }
}
