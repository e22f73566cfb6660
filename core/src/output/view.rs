//! The profile as flamegraph, speedscope and collapsed draw it, shaped by [`Options`].
//!
//! By default frames are functions ([`FunctionKey`]: label and path without a line; a C
//! function by label alone, whoever calls it), and samples of blocked threads (sleeping,
//! in IO, waiting on a lock or a queue: idle) are left out, as py-spy leaves out idle
//! threads; what was left out is counted so that the output can say so. `lines` keeps one
//! frame per executing line, `idle` keeps the blocked samples, and `state` gives every
//! stack a root pseudo frame naming the thread's state (`[running]`, `[waiting_for_gvl]`,
//! `[gc_marking]`...). Thread roots and tag roots are the writers' (they name threads and
//! tag sets, which stay as they are).
use super::{FunctionKey, Interner, Options};
use crate::model::Frame;
use crate::profile::{Profile, StackCount, ThreadState};
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

/// `profile` as `options` shape it (borrowed when they change nothing), and what the output
/// should say about idle samples: how many were left out, or that they were kept because
/// there was nothing else (a recording of a thread stuck in IO is about where it is stuck).
pub(crate) fn view<'a>(
    profile: &'a Profile,
    options: &Options,
) -> (Cow<'a, Profile>, Option<String>) {
    let blocked: u64 = profile
        .stacks
        .iter()
        .filter(|s| s.state == ThreadState::Blocked)
        .map(|s| s.count)
        .sum();
    let only_idle = blocked > 0 && blocked == super::stack_samples(profile);
    let (idle, note) = match (options.idle, blocked, only_idle) {
        (true, _, _) | (false, 0, _) => (true, None),
        (false, _, true) => (
            true,
            Some(format!(
                "all {blocked} samples are of blocked (idle) threads: shown"
            )),
        ),
        (false, n, false) => (
            false,
            Some(format!(
                "{n} idle samples (blocked threads) left out; --idle or idle: true shows them"
            )),
        ),
    };
    if options.lines && idle && !options.state {
        return (Cow::Borrowed(profile), note);
    }
    // Frames are interned as kept stacks use them: a frame only idle stacks had is not shown.
    let mut frames: Interner<Frame> = Interner::default();
    let mut remap: Vec<Option<u32>> = vec![None; profile.frames.len()];
    let shape = |f: u32, frames: &mut Interner<Frame>, remap: &mut Vec<Option<u32>>| {
        *remap[f as usize].get_or_insert_with(|| {
            let frame = &profile.frames[f as usize];
            frames.id(match options.lines {
                true => frame.clone(),
                false => function_frame(frame),
            }) as u32
        })
    };
    let mut stacks: Vec<StackCount> = Vec::new();
    let mut index: HashMap<(u32, ThreadState, Vec<u32>, u32), usize> = HashMap::new();
    for s in &profile.stacks {
        if !idle && s.state == ThreadState::Blocked {
            continue;
        }
        let mut shaped: Vec<u32> = s
            .frames
            .iter()
            .map(|&f| shape(f, &mut frames, &mut remap))
            .collect();
        if options.state {
            shaped.push(frames.id(state_frame(s.state)) as u32);
        }
        // Frames that differed only in their lines are one function now: their stacks merge.
        match index.entry((s.thread, s.state, shaped, s.tags)) {
            std::collections::hash_map::Entry::Occupied(e) => stacks[*e.get()].count += s.count,
            std::collections::hash_map::Entry::Vacant(e) => {
                let (thread, state, frames, tags) = e.key().clone();
                e.insert(stacks.len());
                stacks.push(StackCount {
                    thread,
                    state,
                    frames,
                    count: s.count,
                    tags,
                });
            }
        }
    }
    (Cow::Owned(profile.with_stacks(frames.list, stacks)), note)
}

/// A frame as the function it runs in (see [`FunctionKey`]): no line, and no path for a C
/// function, whose path is its caller's.
fn function_frame(f: &Frame) -> Frame {
    let key = FunctionKey::of(f);
    Frame {
        label: f.label.clone(),
        base_label: f.base_label.clone(),
        path: if key.is_c() {
            Arc::from("")
        } else {
            f.path.clone()
        },
        absolute_path: if key.is_c() {
            None
        } else {
            f.absolute_path.clone()
        },
        lineno: 0,
        c_function: f.c_function,
    }
}

/// The pseudo frame naming a thread state: `[running]`, `[blocked]`, `[gc_marking]`...
fn state_frame(state: ThreadState) -> Frame {
    super::leaves::pseudo_frame(&format!("[{}]", state.name()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::fixture;

    fn labels(p: &Profile, s: &StackCount) -> Vec<String> {
        s.frames
            .iter()
            .map(|&f| {
                let f = &p.frames[f as usize];
                format!("{} {}:{}", f.label, f.path, f.lineno)
            })
            .collect()
    }

    #[test]
    fn view_defaults_merge_lines_into_functions_and_leave_out_blocked_samples() {
        let p = fixture::profile();
        let (v, note) = view(&p, &Options::default());
        let blocked: u64 = p
            .stacks
            .iter()
            .filter(|s| s.state == ThreadState::Blocked)
            .map(|s| s.count)
            .sum();
        assert_eq!(note.unwrap(), format!("{blocked} idle samples (blocked threads) left out; --idle or idle: true shows them"));
        assert_eq!(v.samples + blocked, p.samples);
        assert!(v.stacks.iter().all(|s| s.state != ThreadState::Blocked));
        assert!(v.frames.iter().all(|f| f.lineno == 0));
        // fib(3) and fib(4) are one function: its recursion reads as the same frame twice.
        let fib = v
            .frames
            .iter()
            .filter(|f| &*f.label == "Object#fib")
            .count();
        assert_eq!(fib, 1);
        assert!(v.stacks.iter().any(|s| {
            labels(&v, s).starts_with(&[
                "Object#fib lib/fib.rb:0".into(),
                "Object#fib lib/fib.rb:0".into(),
            ])
        }));
    }

    #[test]
    fn view_idle_lines_and_state() {
        let p = fixture::profile();
        let all = Options {
            idle: true,
            lines: true,
            ..Options::default()
        };
        let (v, note) = view(&p, &all);
        assert!(matches!(v, Cow::Borrowed(_)));
        assert_eq!(note, None);
        let (v, _) = view(&p, &Options { state: true, ..all });
        assert_eq!(v.samples, p.samples);
        for s in &v.stacks {
            let root = &v.frames[*s.frames.last().unwrap() as usize];
            assert_eq!(&*root.label, format!("[{}]", s.state.name()));
        }
        // A C function keeps no path as a function.
        let (v, _) = view(
            &p,
            &Options {
                idle: true,
                ..Options::default()
            },
        );
        let sleep = v
            .frames
            .iter()
            .find(|f| &*f.label == "Kernel#sleep")
            .unwrap();
        assert_eq!(&*sleep.path, "");
    }

    #[test]
    fn view_keeps_idle_samples_when_there_is_nothing_else() {
        let p = fixture::profile().filtered(|s| s.state == ThreadState::Blocked);
        let (v, note) = view(&p, &Options::default());
        assert_eq!(v.samples, p.samples);
        assert_eq!(
            note.unwrap(),
            format!(
                "all {} samples are of blocked (idle) threads: shown",
                p.samples
            )
        );
    }
}
