//! Brendan Gregg's folded ("collapsed") stacks: one line per distinct stack, frames root
//! first separated by `;`, then a space and the sample count:
//!
//! ```text
//! Thread 4242 (main);<main> app.rb:10;Object#work lib/work.rb:5;Kernel#sleep lib/work.rb:6 7
//! ```
//!
//! A frame is written `label path:line`: `label path` when the line is unknown (0), `label`
//! alone when the path is empty. C functions carry their caller's path and line, as in Ruby's
//! own backtraces. With [`Options::group_by_thread`] the root frame is [`thread_label`]; with
//! [`Options::show_state`] a pseudo frame `[running]`, `[waiting_for_gvl]`, `[blocked]` or
//! `[gc]` follows the innermost frame (it becomes the leaf). A stack with no frame at all is
//! written [`NO_FRAMES`]. Stacks that read the same (the same stack in two threads without
//! grouping, say) are summed into one line; lines are sorted, so output is deterministic.
//!
//! `;` inside a frame would split it, and a line break would split the line: both are
//! replaced (by `,` and a space) — labels and paths practically never contain them.
use super::{thread_label, Options, OutputError, NO_FRAMES};
use crate::profile::{Profile, ThreadState};
use crate::spy::Frame;
use std::collections::BTreeMap;
use std::io::Write;

pub fn write(profile: &Profile, out: &mut dyn Write, options: &Options) -> Result<(), OutputError> {
    for (stack, count) in folded(profile, options) {
        writeln!(out, "{stack} {count}")?;
    }
    Ok(())
}

/// Folded stack (without its count) → samples.
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
        if options.group_by_thread {
            parts.push(&thread_labels[stack.thread as usize]);
        }
        parts.extend(
            stack
                .frames
                .iter()
                .rev()
                .map(|&f| frame_texts[f as usize].as_str()),
        );
        if options.show_state {
            parts.push(state_frame(stack.state));
        }
        if parts.is_empty() {
            parts.push(NO_FRAMES);
        }
        *lines.entry(parts.join(";")).or_insert(0) += stack.count;
    }
    lines
}

/// The pseudo frame of a thread state.
pub fn state_frame(state: ThreadState) -> &'static str {
    match state {
        ThreadState::Running => "[running]",
        ThreadState::WaitingForGvl => "[waiting_for_gvl]",
        ThreadState::Blocked => "[blocked]",
        ThreadState::Gc => "[gc]",
        ThreadState::GcMarking => "[gc_marking]",
        ThreadState::GcSweeping => "[gc_sweeping]",
        ThreadState::GcCompacting => "[gc_compacting]",
    }
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

    #[test]
    fn output_collapsed_lines_resum_to_the_profile() {
        let p = fixture::profile();
        let text = collapsed(&Options::default());
        let stacks = parse(&text);
        assert_eq!(stacks.len(), p.stacks.len());
        assert_eq!(stacks.values().sum::<u64>(), p.samples);
        let key = |s: &[&str]| s.iter().map(|s| s.to_string()).collect::<Vec<_>>();
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
    fn output_collapsed_without_threads_merges_and_states_split_leaves() {
        let p = fixture::profile();
        let flat = parse(&collapsed(&Options {
            group_by_thread: false,
            show_state: false,
            tag_root: None,
        }));
        // Without thread roots, the thread with no Ruby frame gets the placeholder frame.
        assert_eq!(flat.values().sum::<u64>(), p.samples);
        assert_eq!(flat[&vec![NO_FRAMES.to_string()]], 1);
        assert!(flat.keys().all(|k| !k[0].starts_with("Thread")));

        let states = parse(&collapsed(&Options {
            group_by_thread: true,
            show_state: true,
            tag_root: None,
        }));
        assert_eq!(states.values().sum::<u64>(), p.samples);
        for stack in states.keys() {
            let leaf = stack.last().unwrap();
            assert!(leaf.starts_with('[') && leaf.ends_with(']'), "{stack:?}");
        }
        let gc: u64 = states
            .iter()
            .filter(|(k, _)| k.last().unwrap() == "[gc]")
            .map(|(_, c)| c)
            .sum();
        assert_eq!(gc, 2);
        assert_eq!(
            states[&vec!["Thread 0x3000".to_string(), "[blocked]".to_string()]],
            1
        );
    }

    #[test]
    fn output_collapsed_identical_stacks_in_two_threads_sum_without_grouping() {
        use crate::profile::{Aggregator, ThreadState};
        let [a, b, _] = fixture::threads();
        let mut agg = Aggregator::new(4242, "3.3.0", 100.0, 0);
        let stack = [frame("Foo#bar", "foo.rb", 2, false), fixture::main_rb()];
        agg.add_count(&a, ThreadState::Running, &stack, 2);
        agg.add_count(&b, ThreadState::Blocked, &stack, 3);
        let p = agg.finish(1);
        let mut out = Vec::new();
        let opts = Options {
            group_by_thread: false,
            show_state: false,
            tag_root: None,
        };
        write_format(&p, Format::Collapsed, &mut out, &opts).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "<main> app.rb:10;Foo#bar foo.rb:2 5\n"
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
