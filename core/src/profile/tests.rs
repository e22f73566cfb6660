//! Tests of profile.rs (kept apart to keep that file short).
use super::*;

#[test]
fn split_by_and_filtered_keep_each_part_with_its_own_timeline() {
    let p = crate::output::fixture::profile();
    let parts = p.split_by(|s| s.thread);
    assert_eq!(parts.iter().map(|(t, _)| *t).collect::<Vec<_>>(), [0, 1, 2]);
    assert_eq!(parts.iter().map(|(_, q)| q.samples).sum::<u64>(), p.samples);
    for (thread, part) in &parts {
        assert!(part.stacks.iter().all(|s| s.thread == *thread));
        assert_eq!(part.timeline.len() as u64, part.samples);
        part.timeline.check(part.stacks.len()).unwrap();
        let alone = p.filtered(|s| s.thread == *thread);
        assert_eq!(&alone, part);
    }
}

#[test]
fn with_tag_names_every_sample_and_keeps_tags_already_there() {
    let p = crate::output::fixture::profile();
    let mut tagged_before = p.clone();
    tagged_before.tag_sets = vec![Vec::new(), vec![("example".into(), "other".into())]];
    tagged_before.stacks[0].tags = 1;
    let t = tagged_before.with_tag("example", "mine");
    assert_eq!(t.tag_sets[0], Vec::<(String, String)>::new()); // index 0 stays the empty set
    assert_eq!(t.tag_value(&t.stacks[0], "example"), Some("other"));
    for s in &t.stacks[1..] {
        assert_eq!(t.tag_value(s, "example"), Some("mine"));
    }
    assert_eq!(t.samples, p.samples);
    // A hand-built profile without tag sets gets them.
    let bare = Profile {
        tag_sets: Vec::new(),
        ..p
    };
    let t = bare.with_tag("k", "v");
    assert!(t.stacks.iter().all(|s| t.tag_value(s, "k") == Some("v")));
}

#[test]
fn identical_stacks_aggregate_and_memory_follows_distinct_stacks() {
    let main = ThreadInfo {
        pid: 1,
        tid: 1,
        name: None,
        ruby_thread: 0x10,
        main: true,
        ractor: 1,
        ractor_name: None,
    };
    let mut agg = Aggregator::new(1, "3.1.2", 99.0, 0);
    let a = [
        frame("Kernel#sleep", "a.rb", 3, true),
        frame("<main>", "a.rb", 3, false),
    ];
    let b = [
        frame("Foo#bar", "a.rb", 7, false),
        frame("<main>", "a.rb", 9, false),
    ];
    for i in 0..10_000 {
        agg.add_frames(&main, ThreadState::Blocked, &a);
        if i % 2 == 0 {
            agg.add_frames(&main, ThreadState::Running, &b);
        }
    }
    let p = agg.finish(1);
    assert_eq!(p.samples, 15_000);
    assert_eq!(p.stacks.len(), 2);
    assert_eq!(p.frames.len(), 4);
    assert_eq!(p.threads.len(), 1);
    assert_eq!(p.stacks[0].count, 10_000);
    assert_eq!(p.stacks[1].state, ThreadState::Running);
}

#[test]
fn a_thread_seen_without_its_tid_is_the_same_thread_and_a_new_tid_a_new_one() {
    let spinner = |tid| ThreadInfo {
        pid: 1,
        tid,
        name: Some("spinner-b".into()),
        ruby_thread: 0x20,
        main: false,
        ractor: 3,
        ractor_name: Some("spin-b".into()),
    };
    let mut agg = Aggregator::new(1, "3.4.1", 99.0, 0);
    let work = [frame("Spinners.spin_b", "s.rb", 40, false)];
    // An M:N thread asleep reads tid 0 before and after it is seen on a native thread.
    for tid in [0, 0, 42, 0, 42] {
        agg.add_frames(&spinner(tid), ThreadState::Running, &work);
    }
    let p = agg.profile();
    assert_eq!(p.threads.len(), 1);
    assert_eq!(p.threads[0].tid, 42);
    assert_eq!(p.stacks.iter().map(|s| s.count).sum::<u64>(), 5);
    // Another tid at the same address: a thread that began where an ended one was.
    agg.add_frames(&spinner(43), ThreadState::Running, &work);
    let p = agg.finish(1);
    assert_eq!(
        p.threads.iter().map(|t| t.tid).collect::<Vec<_>>(),
        [42, 43]
    );
}

#[test]
fn threads_that_ended_are_merged_past_the_bound_with_every_sample_kept() {
    let mut agg = Aggregator::new(1, "3.3.8", 1000.0, 0);
    let main = ThreadInfo {
        pid: 1,
        tid: 1,
        name: None,
        ruby_thread: 0x1000,
        main: true,
        ractor: 1,
        ractor_name: None,
    };
    let work = [frame("Job#run", "job.rb", 3, false)];
    let idle = [frame("Kernel#sleep", "", 0, true)];
    let mut tick = 0u64;
    // 2,000 short-lived threads, each sampled for 3 ticks beside the main thread.
    for n in 0..2_000u64 {
        let worker = ThreadInfo {
            tid: 100 + n as i64,
            ruby_thread: 0x10_0000 + n * 0x100,
            main: false,
            name: Some(format!("job-{}", n % 7)),
            ..main.clone()
        };
        for _ in 0..3 {
            tick += 1;
            agg.tick_at(std::time::Duration::from_micros(tick * 1000));
            agg.add_frames(&main, ThreadState::Blocked, &idle);
            agg.add_frames(&worker, ThreadState::Running, &work);
        }
    }
    let p = agg.finish(tick * 1_000_000);
    // Kept apart: those ended within ENDED_AFTER_TICKS, and those since the last look (256
    // ticks), at a thread every 3 ticks; then main and "ended threads".
    let bound = (retire::ENDED_AFTER_TICKS as usize + 256) / 3 + 2;
    assert!(p.threads.len() <= bound, "{} threads", p.threads.len());
    assert_eq!(p.samples, 2 * 3 * 2_000);
    assert_eq!(p.timeline.len() as u64, p.samples);
    p.timeline.check(p.stacks.len()).unwrap();
    // The timeline and the aggregate agree, stack by stack.
    let mut counted = vec![0u64; p.stacks.len()];
    for &s in &p.timeline.stacks {
        counted[s as usize] += 1;
    }
    assert_eq!(
        counted,
        p.stacks.iter().map(|s| s.count).collect::<Vec<_>>()
    );
    let ended = p
        .threads
        .iter()
        .position(|t| t.name.as_deref() == Some(ENDED_THREADS))
        .expect("an ended-threads thread") as u32;
    let merged: u64 = p
        .stacks
        .iter()
        .filter(|s| s.thread == ended)
        .map(|s| s.count)
        .sum();
    let running = p.stacks.iter().filter(|s| s.state == ThreadState::Running);
    assert_eq!(running.map(|s| s.count).sum::<u64>(), 3 * 2_000);
    assert!(merged >= 3 * (2_000 - bound as u64), "{merged}");
    // Ended threads' stacks are summed: one stack of Job#run, not one per thread.
    assert_eq!(p.stacks.iter().filter(|s| s.thread == ended).count(), 1);
    // The main thread is never merged.
    assert_eq!(p.threads.iter().filter(|t| t.main).count(), 1);
    assert!(
        p.notes.iter().any(|n| n.contains("ended were merged")),
        "{:?}",
        p.notes
    );
}
