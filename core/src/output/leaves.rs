//! State leaves: a sample whose thread was not running its own code gets a leaf frame of its
//! own below the frame it stood in, so that no view bills a wait or a GC pause as that
//! frame's self time.
//!
//! | state | leaf |
//! |---|---|
//! | waiting for the GVL | `[waiting for GVL]` |
//! | GC, between phases | `[GC]` |
//! | GC marking, sweeping, compacting | `[GC marking]`, `[GC sweeping]`, `[GC compacting]` |
//! | on a CPU without the GVL (BPF), standing in a Ruby frame | `[waiting for GVL]` |
//! | running, blocked, on a CPU without the GVL in a C function | none |
//!
//! Why some states have none:
//! - A blocked thread (sleep, IO, a mutex, a queue) always stands in the C function that
//!   blocks (`Kernel#sleep`, `IO#read`, `Thread::Queue#pop`): that frame already says what
//!   it waits for, and the views leave blocked samples out unless asked (`idle`).
//! - A thread on a CPU without the GVL (only the BPF sampler sees it) in a C function is that
//!   function's own work: C code that released the GVL (zlib, a digest, a system call). Ruby
//!   code cannot run without the GVL, so the same state in a Ruby frame is the thread taking
//!   the GVL back after giving it up at an interrupt check: a wait, on a CPU.
//!
//! Leaves are a view: the profile keeps each sample's state (`Profile::stacks`), so a raw
//! profile has none and each rendering adds them (or not, with `no_state_leaves`).
use crate::model::{Frame, ThreadState};
use crate::profile::Profile;
use std::borrow::Cow;
use std::sync::Arc;

/// Every leaf label, so that a frame can be told for a leaf by its label alone.
pub const LEAF_LABELS: [&str; 5] = [
    "[waiting for GVL]",
    "[GC]",
    "[GC marking]",
    "[GC sweeping]",
    "[GC compacting]",
];

/// The leaf a sample of a thread in `state`, standing in `innermost` (None: no Ruby frame),
/// gets; None when it gets none (see the module docs).
pub fn leaf_label(state: ThreadState, innermost: Option<&Frame>) -> Option<&'static str> {
    let [waiting, gc, marking, sweeping, compacting] = LEAF_LABELS;
    match state {
        ThreadState::Running | ThreadState::Blocked => None,
        ThreadState::WaitingForGvl => Some(waiting),
        ThreadState::Gc => Some(gc),
        ThreadState::GcMarking => Some(marking),
        ThreadState::GcSweeping => Some(sweeping),
        ThreadState::GcCompacting => Some(compacting),
        ThreadState::NoGvl => match innermost {
            Some(f) if f.c_function => None,
            _ => Some(waiting),
        },
    }
}

/// Whether `frame` is a state leaf: a known leaf label on a frame with no path that is not a
/// C function, which no frame of Ruby's is (a Ruby frame has its file, a C function is
/// marked as one).
pub fn is_state_leaf(frame: &Frame) -> bool {
    !frame.c_function && frame.path.is_empty() && LEAF_LABELS.contains(&&*frame.label)
}

/// A frame that names no code of the program (a state leaf, or `view`'s state root): a
/// label, no path, no line, not a C function.
pub(crate) fn pseudo_frame(label: &str) -> Frame {
    let label: Arc<str> = Arc::from(label);
    Frame {
        label: label.clone(),
        base_label: label,
        path: Arc::from(""),
        absolute_path: None,
        lineno: 0,
        c_function: false,
    }
}

/// `profile` with each stack's state leaf below its innermost frame (borrowed when no stack
/// gets one). Stacks keep their index (the timeline's samples still point at them) and their
/// state, so the views can still leave out or root by state.
pub fn with_state_leaves(profile: &Profile) -> Cow<'_, Profile> {
    let leaf_of = |s: &crate::profile::StackCount| {
        let innermost = s
            .frames
            .first()
            .and_then(|&f| profile.frames.get(f as usize));
        leaf_label(s.state, innermost)
    };
    if profile.stacks.iter().all(|s| leaf_of(s).is_none()) {
        return Cow::Borrowed(profile);
    }
    let mut leaves = profile.clone();
    let mut ids: [Option<u32>; LEAF_LABELS.len()] = [None; LEAF_LABELS.len()];
    for (s, shaped) in profile.stacks.iter().zip(&mut leaves.stacks) {
        let Some(label) = leaf_of(s) else { continue };
        let slot = LEAF_LABELS.iter().position(|l| *l == label).unwrap_or(0);
        let id = *ids[slot].get_or_insert_with(|| {
            leaves.frames.push(pseudo_frame(label));
            (leaves.frames.len() - 1) as u32
        });
        shaped.frames.insert(0, id);
    }
    Cow::Owned(leaves)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::fixture;
    use crate::profile::frame;

    #[test]
    fn leaves_go_below_the_innermost_frame_of_waits_and_gc_only() {
        let p = fixture::profile();
        let v = with_state_leaves(&p);
        assert_eq!(v.stacks.len(), p.stacks.len());
        assert_eq!(v.samples, p.samples);
        assert_eq!(v.timeline, p.timeline);
        for (before, after) in p.stacks.iter().zip(&v.stacks) {
            assert_eq!(
                (before.state, before.count, before.thread),
                (after.state, after.count, after.thread)
            );
            let Some(&innermost) = after.frames.first() else {
                assert!(before.frames.is_empty());
                continue;
            };
            let leaf = &v.frames[innermost as usize];
            match before.state {
                ThreadState::Running | ThreadState::Blocked => {
                    assert_eq!(after.frames, before.frames);
                    assert!(!is_state_leaf(leaf));
                }
                ThreadState::WaitingForGvl => {
                    assert_eq!(&*leaf.label, "[waiting for GVL]");
                    assert_eq!(after.frames[1..], before.frames[..]);
                }
                ThreadState::Gc => assert_eq!(&*leaf.label, "[GC]"),
                other => panic!("the fixture has no {other:?}"),
            }
        }
        // One frame per leaf, however many stacks use it.
        let leaf_frames = v.frames.iter().filter(|f| is_state_leaf(f)).count();
        assert_eq!(leaf_frames, 2);
        assert!(p.frames.iter().all(|f| !is_state_leaf(f)));
    }

    #[test]
    fn leaves_of_a_thread_on_a_cpu_without_the_gvl_depend_on_where_it_stands() {
        let ruby = frame("Object#spin", "spin.rb", 3, false);
        let c = frame("Zlib::Deflate#deflate", "spin.rb", 3, true);
        assert_eq!(
            leaf_label(ThreadState::NoGvl, Some(&ruby)),
            Some("[waiting for GVL]")
        );
        assert_eq!(
            leaf_label(ThreadState::NoGvl, None),
            Some("[waiting for GVL]")
        );
        assert_eq!(leaf_label(ThreadState::NoGvl, Some(&c)), None);
        for (state, label) in [
            (ThreadState::GcMarking, "[GC marking]"),
            (ThreadState::GcSweeping, "[GC sweeping]"),
            (ThreadState::GcCompacting, "[GC compacting]"),
        ] {
            assert_eq!(leaf_label(state, Some(&c)), Some(label));
            assert!(is_state_leaf(&pseudo_frame(label)));
        }
        // A Ruby frame or a C function with a leaf's label is no leaf.
        assert!(!is_state_leaf(&frame("[GC]", "x.rb", 1, false)));
        assert!(!is_state_leaf(&frame("[GC]", "", 0, true)));
    }

    #[test]
    fn leaves_leave_a_profile_without_waits_or_gc_borrowed() {
        let p = fixture::profile().filtered(|s| s.state == ThreadState::Running);
        assert!(matches!(with_state_leaves(&p), Cow::Borrowed(_)));
    }
}
