//! Brendan Gregg's folded ("collapsed") stacks: one line per distinct stack, frames root
//! first separated by `;`, then a space and the sample count:
//!
//! ```text
//! <main> app.rb;Object#work lib/work.rb;Kernel#sleep 7
//! ```
//!
//! Stacks are shaped by [`Options`] first ([`super::view`]): by default a frame is a function
//! (`label path`; a C function is its `label` alone) and blocked threads' samples are left
//! out. With `lines` a frame is `label path:line` (`label path` when the line is unknown), C
//! functions at their caller's path and line, as in Ruby's own backtraces. Root frames come
//! in this order: the tag's value with `tag_root`, the state with `state` (`[running]`...),
//! the thread with `per_thread` ([`thread_label`]). A stack with no frame at all is written
//! [`NO_FRAMES`]. Stacks that read the same (the same stack in two threads, say) are summed
//! into one line; lines are sorted, so output is deterministic.
//!
//! `;` inside a frame would split it, and a line break would split the line: both are
//! replaced (by `,` and a space) — labels and paths practically never contain them.
use super::{thread_label, view, Options, OutputError, NO_FRAMES};
use crate::model::Frame;
use crate::profile::Profile;
use std::collections::BTreeMap;
use std::io::Write;

pub fn write(profile: &Profile, out: &mut dyn Write, options: &Options) -> Result<(), OutputError> {
    let (shaped, _) = view(profile, options);
    for (stack, count) in folded(&shaped, options) {
        writeln!(out, "{stack} {count}")?;
    }
    Ok(())
}

/// Folded stack (without its count) → samples, for a profile already shaped by [`view`]
/// (whose state pseudo frame is the root of each stack's frames): the roots `view` leaves to
/// the writers (tag, thread) are added here.
pub(crate) fn folded(profile: &Profile, options: &Options) -> BTreeMap<String, u64> {
    let frame_texts: Vec<String> = profile.frames.iter().map(frame_text).collect();
    let mut lines: BTreeMap<String, u64> = BTreeMap::new();
    let mut parts: Vec<&str> = Vec::new();
    // One root text per tag set (`key=value`), when grouping by a tag.
    let tag_roots: Vec<String> = match &options.tag_root {
        Some(key) => super::tag_roots(profile, key)
            .iter()
            .map(|r| clean(r))
            .collect(),
        None => Vec::new(),
    };
    let thread_labels: Vec<String> = (0..profile.threads.len() as u32)
        .map(|t| clean(&thread_label(profile, t)))
        .collect();
    for stack in &profile.stacks {
        parts.clear();
        if let Some(root) = tag_roots.get(stack.tags as usize) {
            parts.push(root);
        }
        let mut frames = stack
            .frames
            .iter()
            .rev()
            .map(|&f| frame_texts[f as usize].as_str());
        // The state's pseudo frame is the stack's root: it stays above the thread's.
        if options.state {
            parts.extend(frames.next());
        }
        if options.per_thread {
            parts.push(&thread_labels[stack.thread as usize]);
        }
        parts.extend(frames);
        if parts.is_empty() {
            parts.push(NO_FRAMES);
        }
        *lines.entry(parts.join(";")).or_insert(0) += stack.count;
    }
    lines
}

/// `label path:line` (see the module docs).
pub fn frame_text(frame: &Frame) -> String {
    let text = match (frame.path.is_empty(), frame.lineno > 0) {
        (true, _) => frame.label.to_string(),
        (false, true) => format!("{} {}:{}", frame.label, frame.path, frame.lineno),
        (false, false) => format!("{} {}", frame.label, frame.path),
    };
    clean(&text)
}

fn clean(text: &str) -> String {
    if text.contains([';', '\n', '\r']) {
        text.replace(';', ",").replace(['\n', '\r'], " ")
    } else {
        text.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::{fixture, write as write_format, Format};
    use crate::profile::frame;

    /// Parses collapsed text back into stack → count, checking every line's shape.
    pub(crate) fn parse(text: &str) -> BTreeMap<Vec<String>, u64> {
        let mut stacks = BTreeMap::new();
        for line in text.lines() {
            let (stack, count) = line.rsplit_once(' ').expect("a count after a space");
            let count: u64 = count.parse().expect("a numeric count");
            let frames: Vec<String> = stack.split(';').map(String::from).collect();
            assert!(frames.iter().all(|f| !f.is_empty()), "{line}");
            assert!(
                stacks.insert(frames, count).is_none(),
                "duplicate line {line}"
            );
        }
        stacks
    }

    fn collapsed(options: &Options) -> String {
        let mut out = Vec::new();
        write_format(&fixture::profile(), Format::Collapsed, &mut out, options).unwrap();
        String::from_utf8(out).unwrap()
    }

    /// What the formats showed before they had defaults of their own.
    fn every_line_per_thread() -> Options {
        Options {
            per_thread: true,
            lines: true,
            idle: true,
            ..Options::default()
        }
    }

    fn key(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn output_collapsed_lines_resum_to_the_profile() {
        let p = fixture::profile();
        let text = collapsed(&every_line_per_thread());
        let stacks = parse(&text);
        assert_eq!(stacks.len(), p.stacks.len());
        assert_eq!(stacks.values().sum::<u64>(), p.samples);
        assert_eq!(
            stacks[&key(&[
                "Thread 4242 (main)",
                "<main> app.rb:10",
                "Object#work lib/work.rb:5",
                "Kernel#sleep lib/work.rb:6"
            ])],
            7
        );
        assert_eq!(
            stacks[&key(&[
                "Thread 4250 (worker)",
                "<main> app.rb:10",
                "weird,label lib/odd dir/odd.rb:3"
            ])],
            3
        );
        assert_eq!(stacks[&key(&["Thread 0x3000"])], 1);
        // Per thread, the lines add up to that thread's samples.
        let main: u64 = stacks
            .iter()
            .filter(|(k, _)| k[0] == "Thread 4242 (main)")
            .map(|(_, c)| c)
            .sum();
        assert_eq!(main, 24);
    }

    #[test]
    fn output_collapsed_defaults_merge_threads_into_functions_without_idle_samples() {
        let p = fixture::profile();
        let stacks = parse(&collapsed(&Options::default()));
        let blocked = 7 + 1; // Kernel#sleep in main, and the thread with no Ruby frame
        assert_eq!(stacks.values().sum::<u64>(), p.samples - blocked);
        assert!(stacks.keys().all(|k| !k[0].starts_with("Thread")));
        assert!(stacks.keys().flatten().all(|f| !f.contains("Kernel#sleep")));
        assert_eq!(
            stacks[&key(&["<main> app.rb", "Object#work lib/work.rb"])],
            10
        );
        // Lines 3 and 4 of fib are one function: running 5, in GC 2 (below its leaf).
        let fib = |n: usize, leaf: Option<&str>| {
            let mut k = key(&["<main> app.rb"]);
            k.extend(std::iter::repeat_n("Object#fib lib/fib.rb".to_string(), n));
            k.extend(leaf.map(String::from));
            stacks[&k]
        };
        assert_eq!((fib(3, None), fib(2, Some("[GC]"))), (5, 2));
        // The worker waited for the GVL in Object#work.
        let waited = key(&[
            "<main> app.rb",
            "block in Object#work lib/work.rb",
            "Integer#times",
            "block in Object#work lib/work.rb",
            "Object#work lib/work.rb",
            "[waiting for GVL]",
        ]);
        assert_eq!(stacks[&waited], 4);
        // A C function is its label alone.
        let with_idle = parse(&collapsed(&Options {
            idle: true,
            ..Options::default()
        }));
        assert_eq!(
            with_idle[&key(&["<main> app.rb", "Object#work lib/work.rb", "Kernel#sleep"])],
            7
        );
        assert_eq!(with_idle[&key(&[NO_FRAMES])], 1);
    }

    #[test]
    fn output_collapsed_state_roots_above_thread_roots() {
        let p = fixture::profile();
        let states = parse(&collapsed(&Options {
            state: true,
            ..every_line_per_thread()
        }));
        assert_eq!(states.values().sum::<u64>(), p.samples);
        for stack in states.keys() {
            let root = &stack[0];
            assert!(root.starts_with('[') && root.ends_with(']'), "{stack:?}");
            assert!(stack[1].starts_with("Thread "), "{stack:?}");
        }
        let gc: u64 = states
            .iter()
            .filter(|(k, _)| k[0] == "[gc]")
            .map(|(_, c)| c)
            .sum();
        assert_eq!(gc, 2);
        assert_eq!(states[&key(&["[blocked]", "Thread 0x3000"])], 1);
    }

    #[test]
    fn output_collapsed_identical_stacks_in_two_threads_sum_without_grouping_or_leaves() {
        use crate::profile::{Aggregator, ThreadState};
        let [a, b, _] = fixture::threads();
        let mut agg = Aggregator::new(4242, "3.3.0", 100.0, 0);
        let stack = [frame("Foo#bar", "foo.rb", 2, false), fixture::main_rb()];
        agg.add_count(&a, ThreadState::Running, &stack, 2);
        agg.add_count(&b, ThreadState::WaitingForGvl, &stack, 3);
        let p = agg.finish(1);
        let mut out = Vec::new();
        let opts = Options {
            lines: true,
            no_state_leaves: true,
            ..Options::default()
        };
        write_format(&p, Format::Collapsed, &mut out, &opts).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "<main> app.rb:10;Foo#bar foo.rb:2 5\n"
        );
        // With its leaf, the wait is a stack of its own.
        let mut out = Vec::new();
        let opts = Options {
            no_state_leaves: false,
            ..opts
        };
        write_format(&p, Format::Collapsed, &mut out, &opts).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "<main> app.rb:10;Foo#bar foo.rb:2 2\n\
             <main> app.rb:10;Foo#bar foo.rb:2;[waiting for GVL] 3\n"
        );
    }

    #[test]
    fn output_collapsed_frame_text() {
        assert_eq!(frame_text(&frame("a", "b.rb", 3, false)), "a b.rb:3");
        assert_eq!(frame_text(&frame("a", "b.rb", 0, false)), "a b.rb");
        assert_eq!(frame_text(&frame("a", "", 0, true)), "a");
        assert_eq!(
            frame_text(&frame("x;y\nz", "p;q.rb", 1, false)),
            "x,y z p,q.rb:1"
        );
    }
}
