//! A timeline of every thread: what each was doing when, as speedscope "evented" profiles,
//! one per thread, in the same JSON file format as [`super::speedscope`] (its schema covers
//! both). speedscope's "Time Order" view draws each thread's flame chart along the
//! recording's time.
//!
//! The same timeline opens in the Firefox Profiler with [`super::firefox`], which has
//! markers. speedscope has none, so here root frames carry them, which the flame chart draws
//! as bands over time: the outermost frame names the sample's tags (`request_id=abc
//! user=42`, when it has any), the next its thread's state (`[running]`,
//! `[waiting_for_gvl]`, `[blocked]`, `[gc_marking]`...), then the stack, one frame per
//! function.
//!
//! Each sample holds from its time until the thread's next sample, or for one period when
//! the next is more than two periods away (the thread was not sampled in between: it had
//! not started, or a recording of the GVL holder only left it out). Frames a sample shares
//! with the one before, root first, stay open; the others close and open at its time.
use super::speedscope::{exporter, File, Frame, Shared, SpeedscopeProfile, SCHEMA_URL};
use super::{sample_period_ns, thread_label, FunctionKey, Interner, OutputError};
use crate::profile::{Profile, ThreadState};
use serde::Serialize;
use std::io::Write;

#[derive(Serialize)]
struct Evented {
    events: Vec<Event>,
}

type EventedProfile = SpeedscopeProfile<Evented>;

#[derive(Serialize)]
struct Event {
    #[serde(rename = "type")]
    kind: &'static str,
    frame: usize,
    at: f64,
}

pub fn write(profile: &Profile, out: &mut dyn Write) -> Result<(), OutputError> {
    let by_thread = super::samples_by_thread(profile)?;
    let period_us = sample_period_ns(profile).map_or(1000.0, |ns| ns / 1000.0);
    let mut names = Interner::default();
    let chains = chains(profile, &mut names);
    let duration_ms = profile.duration_ns as f64 / 1e6;
    let mut profiles = Vec::new();
    let mut sizes = Vec::new();
    for (thread, samples) in by_thread.iter().enumerate().filter(|(_, s)| !s.is_empty()) {
        let events = events(samples, &chains, period_us);
        let end = events.last().map_or(0.0, |e| e.at).max(duration_ms);
        // Opens on the thread that was busiest: most samples not blocked.
        let busy = samples
            .iter()
            .filter(|(_, s)| profile.stacks[*s as usize].state != ThreadState::Blocked)
            .count();
        sizes.push(busy);
        profiles.push(EventedProfile {
            kind: "evented",
            name: thread_label(profile, thread as u32),
            unit: "milliseconds",
            start_value: 0.0,
            end_value: end,
            body: Evented { events },
        });
    }
    if profiles.is_empty() {
        profiles.push(EventedProfile {
            kind: "evented",
            name: "No samples".to_string(),
            unit: "milliseconds",
            start_value: 0.0,
            end_value: duration_ms,
            body: Evented { events: Vec::new() },
        });
    }
    let busiest = (0..sizes.len()).max_by_key(|&i| (sizes[i], std::cmp::Reverse(i)));
    let version = match profile.ruby_version.as_str() {
        "" => String::new(),
        v => format!(" (Ruby {v})"),
    };
    let file = File {
        schema: SCHEMA_URL,
        shared: Shared {
            frames: shared_frames(&names),
        },
        profiles,
        name: format!("rbspy_ext timeline: pid {}{version}", profile.pid),
        active_profile_index: busiest.unwrap_or(0),
        exporter: exporter(),
    };
    serde_json::to_writer(&mut *out, &file)?;
    Ok(())
}

/// Each stack's frames as the timeline shows them, root first: its tags, its state, then its
/// functions.
fn chains(profile: &Profile, names: &mut Interner<(String, String)>) -> Vec<Vec<usize>> {
    let tag_frames: Vec<Option<usize>> = profile
        .tag_sets
        .iter()
        .map(|set| {
            let text: Vec<String> = set.iter().map(|(k, v)| format!("{k}={v}")).collect();
            (!set.is_empty()).then(|| names.id((text.join(" "), String::new())))
        })
        .collect();
    let functions: Vec<usize> = profile
        .frames
        .iter()
        .map(|f| {
            let key = FunctionKey::of(f);
            names.id((key.label.to_string(), key.path.to_string()))
        })
        .collect();
    profile
        .stacks
        .iter()
        .map(|s| {
            let mut chain: Vec<usize> = Vec::with_capacity(s.frames.len() + 2);
            chain.extend(tag_frames.get(s.tags as usize).copied().flatten());
            chain.push(names.id((format!("[{}]", s.state.name()), String::new())));
            chain.extend(s.frames.iter().rev().map(|&f| functions[f as usize]));
            chain
        })
        .collect()
}

/// One thread's open and close events from its samples (time in µs, stack), in order.
fn events(samples: &[(u32, u32)], chains: &[Vec<usize>], period_us: f64) -> Vec<Event> {
    let mut events = Vec::new();
    let mut open: &[usize] = &[];
    let mut last_at = 0.0;
    let ms = |us: f64| us / 1000.0;
    for &(at, stack) in samples {
        let at = f64::from(at);
        let chain = &chains[stack as usize][..];
        if !open.is_empty() && at - last_at > 2.0 * period_us {
            close(&mut events, open, 0, ms(last_at + period_us));
            open = &[];
        }
        let shared = open.iter().zip(chain).take_while(|(a, b)| a == b).count();
        close(&mut events, open, shared, ms(at));
        for &frame in &chain[shared..] {
            events.push(Event {
                kind: "O",
                frame,
                at: ms(at),
            });
        }
        open = chain;
        last_at = at;
    }
    close(&mut events, open, 0, ms(last_at + period_us));
    events
}

/// Closes `open[from..]`, innermost first.
fn close(events: &mut Vec<Event>, open: &[usize], from: usize, at: f64) {
    for &frame in open[from..].iter().rev() {
        events.push(Event {
            kind: "C",
            frame,
            at,
        });
    }
}

/// The file's shared frames, as speedscope takes them.
fn shared_frames(names: &Interner<(String, String)>) -> Vec<Frame<'_>> {
    names
        .list
        .iter()
        .map(|(name, file)| Frame {
            name,
            file: (!file.is_empty()).then_some(file.as_str()),
            line: None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use crate::output::{fixture, write, Format, Options};
    use crate::profile::{frame, Aggregator, ThreadState};
    use serde_json::Value;
    use std::time::Duration;

    fn timeline(p: &crate::profile::Profile) -> Value {
        let mut out = Vec::new();
        write(p, Format::Timeline, &mut out, &Options::default()).unwrap();
        serde_json::from_slice(&out).unwrap()
    }

    /// Replays a profile's events: every close matches the innermost open frame, times never
    /// go back, and nothing stays open. Returns (frame name path, from, to) of each leaf span.
    fn replay(doc: &Value, profile: usize) -> Vec<(Vec<String>, f64, f64)> {
        let frames = doc["shared"]["frames"].as_array().unwrap();
        let name = |i: u64| frames[i as usize]["name"].as_str().unwrap().to_string();
        let mut stack: Vec<(u64, f64)> = Vec::new();
        let mut spans = Vec::new();
        let mut last = 0.0;
        for e in doc["profiles"][profile]["events"].as_array().unwrap() {
            let (frame, at) = (e["frame"].as_u64().unwrap(), e["at"].as_f64().unwrap());
            assert!(at >= last, "time went back");
            last = at;
            match e["type"].as_str().unwrap() {
                "O" => stack.push((frame, at)),
                "C" => {
                    let path: Vec<String> = stack.iter().map(|(f, _)| name(*f)).collect();
                    let (top, from) = stack.pop().expect("a close with nothing open");
                    assert_eq!(top, frame, "closed a frame that is not the innermost");
                    if spans
                        .last()
                        .is_none_or(|(_, _, to): &(Vec<String>, f64, f64)| *to <= from)
                    {
                        spans.push((path, from, at));
                    }
                }
                other => panic!("event type {other}"),
            }
        }
        assert!(stack.is_empty(), "frames left open");
        spans
    }

    #[test]
    fn output_timeline_follows_each_thread_in_time_with_states_and_tags() {
        let [main, worker, _] = fixture::threads();
        let mut agg = Aggregator::new(4242, "3.3.0", 1000.0, 0);
        let work = [fixture::work(), fixture::main_rb()];
        let sleep = [fixture::sleep_c(), fixture::work(), fixture::main_rb()];
        let tags: crate::model::Tags = vec![("request_id".into(), "r1".into())].into();
        for ms in 0..10u64 {
            agg.tick_at(Duration::from_millis(ms));
            let state = if ms < 6 {
                ThreadState::Running
            } else {
                ThreadState::Blocked
            };
            let frames: &[_] = if ms < 6 { &work } else { &sleep };
            agg.add_stack(&main, state, ms, frames, &Default::default());
            if ms >= 3 {
                agg.add_stack(
                    &worker,
                    ThreadState::WaitingForGvl,
                    99,
                    &[frame("Foo#bar", "foo.rb", 2, false)],
                    &tags,
                );
            }
        }
        let p = agg.finish(10_000_000);
        assert_eq!(p.timeline.len(), 17);
        let doc = timeline(&p);
        assert_eq!(doc["profiles"].as_array().unwrap().len(), 2);
        assert_eq!(doc["activeProfileIndex"], 1); // the worker: 7 samples not blocked, main 6
        assert_eq!(doc["profiles"][0]["type"], "evented");
        assert_eq!(doc["profiles"][0]["name"], "Thread 4242 (main)");
        let main_spans = replay(&doc, 0);
        let names: Vec<String> = main_spans.iter().map(|(p, _, _)| p.join(";")).collect();
        assert_eq!(
            names,
            [
                "[running];<main>;Object#work",
                "[blocked];<main>;Object#work;Kernel#sleep"
            ]
        );
        // Running from 0 to 6 ms, then blocked until one period past the last sample.
        assert_eq!((main_spans[0].1, main_spans[0].2), (0.0, 6.0));
        assert_eq!((main_spans[1].1, main_spans[1].2), (6.0, 10.0));
        let worker_spans = replay(&doc, 1);
        assert_eq!(worker_spans.len(), 1);
        assert_eq!(
            worker_spans[0].0.join(";"),
            "request_id=r1;[waiting_for_gvl];Foo#bar;[waiting for GVL]"
        );
        assert_eq!((worker_spans[0].1, worker_spans[0].2), (3.0, 10.0));
    }

    #[test]
    fn output_timeline_closes_across_gaps_and_needs_a_timeline() {
        let [main, _, _] = fixture::threads();
        let mut agg = Aggregator::new(1, "3.3.0", 1000.0, 0);
        for ms in [0u64, 1, 50, 51] {
            agg.tick_at(Duration::from_millis(ms));
            agg.add_frames(&main, ThreadState::Running, &[fixture::work()]);
        }
        let doc = timeline(&agg.finish(52_000_000));
        let spans = replay(&doc, 0);
        assert_eq!(spans.len(), 2);
        assert_eq!((spans[0].1, spans[0].2), (0.0, 2.0)); // one period past the sample at 1 ms
        assert_eq!((spans[1].1, spans[1].2), (50.0, 52.0));

        let mut old = fixture::profile();
        old.timeline = Default::default();
        let err = write(&old, Format::Timeline, &mut Vec::new(), &Options::default()).unwrap_err();
        assert!(err.to_string().contains("no timeline"), "{err}");
    }
}
