//! A recording by the BPF sampler: the recorder thread sleeps (`Recording::period`), drains the ring
//! and resolves each record through the spy. The thread map is refreshed from the spy's
//! thread list every `REFRESH_EVERY`, and sooner when the program saw a thread it did not
//! know.
use super::{new_aggregator, refresh_live, RecordConfig, Run};
use crate::bpf::{
    BpfSampler, Record, Stats, DRAIN_EVERY, DRAIN_LONGEST, DRAIN_SHORTEST, MAX_FRAMES, RING_BYTES,
};
use crate::cost::{clock_ns, thread_cpu_ns, KernelCost};
use crate::memory::Memory;
use crate::model::{Dropped, Sample};
use crate::profile::{Aggregator, Profile, ThreadInfo};
use crate::spy::{Spy, TRUNCATED_LABEL};
use rustc_hash::{FxHashMap, FxHashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often the thread map follows the thread list when nothing says it changed.
const REFRESH_EVERY: Duration = Duration::from_millis(500);
/// The drain period while tags are being lost to later drains: within the 8 ms in which a
/// copied table's objects are sure to be alive (`crate::context::ownership::TABLE_WINDOW`).
const DRAIN_FOR_TAGS: Duration = Duration::from_millis(6);
/// How long the short period lasts after the last drain that lost tags.
const KEEP_DRAINING_FOR_TAGS: Duration = Duration::from_secs(2);
/// The soonest a refresh follows another when a thread the map does not know was sampled.
const REFRESH_SOONEST: Duration = Duration::from_millis(100);

/// What one recording keeps between drains.
struct Recording {
    agg: Aggregator,
    threads: FxHashMap<u64, Arc<ThreadInfo>>,
    /// CLOCK_MONOTONIC at the start, to place records on the timeline.
    mono_start: u64,
    truncated: u64,
    /// Ticks of threads the map did not know, and the tids among them seen since the last
    /// refresh: a new one asks for a refresh (it may be a new Ruby thread); one seen before
    /// is a native thread that runs no Ruby, and does not ask again.
    unknown: u64,
    unknown_tids: FxHashSet<u32>,
    refresh_wanted: bool,
    /// Whether the last refresh found threads of Ractors besides the main one: from 3.3 they
    /// take turns on shared native threads, so a tid that ran no Ruby thread a moment ago
    /// may run one now, and every unknown tick asks for a refresh (`REFRESH_SOONEST` apart).
    shared_natives: bool,
    /// The time of the last sample on the timeline, and when the recording began.
    last_at: Duration,
    started: Instant,
    /// The Ractors of the last thread list (`Sample::ractors`).
    ractors: Arc<[u32]>,
    /// Samples whose tag table was larger than the program copies, and whose value stack was.
    tags_cut: u64,
    values_cut: u64,
    /// Samples whose tags were left out (`Capture::tags_expired`), and until when to
    /// drain every `DRAIN_FOR_TAGS` since a drain last left some out.
    expired_tags: u64,
    tags_expiring: Option<Instant>,
    /// When the ring was last drained, and the bytes a second its records came at then.
    drained_at: Instant,
    ring_rate: Option<f64>,
}

pub(crate) fn run<M: Memory>(spy: &mut Spy<M>, mut bpf: BpfSampler, run: Run<'_>) -> Profile {
    let (config, notes, stop, progress) = run.into_parts();
    let pid = spy.pid();
    let mut rec = Recording::new(spy, &config, notes);
    let started = rec.started;
    let calls_before = spy.memory().calls();
    let cpu_before = thread_cpu_ns();
    let stats_before = bpf.stats();
    let expired_before = spy.capture().tags_expired();
    let drops_before = spy.trace_drops();
    let mut refreshed: Option<Instant> = None;
    let mut wakeups = 0u64;
    loop {
        let now = Instant::now();
        let over = config.duration.is_some_and(|d| now - started >= d);
        if stop.load(Ordering::Relaxed) || over {
            break;
        }
        // Threads that move between shared native threads are found again at the next drain.
        let soonest = if rec.shared_natives {
            Duration::ZERO
        } else {
            REFRESH_SOONEST
        };
        let due = refreshed.is_none_or(|t| {
            t.elapsed() >= REFRESH_EVERY || (rec.refresh_wanted && t.elapsed() >= soonest)
        });
        if due {
            refreshed = Some(Instant::now());
            rec.refresh_wanted = false;
            // Tids still unknown after this refresh run no Ruby: they do not ask again.
            if rec.unknown_tids.len() > 4096 {
                rec.unknown_tids.clear();
            }
            if !refresh_threads(spy, &mut bpf, &mut rec) {
                note_exit(&mut rec.agg, pid, started);
                break;
            }
            refresh_live(progress, &rec.agg, config.live);
        }
        let left = config.duration.map(|d| d.saturating_sub(now - started));
        // Parked rather than asleep: `Recorder::stop` unparks it, so a stop never waits for
        // the rest of a long period.
        std::thread::park_timeout(rec.period(now, left));
        wakeups += 1;
        let expired = spy.capture().tags_expired();
        drain(spy, &mut bpf, &config, &mut rec);
        if spy.capture().tags_expired() > expired {
            rec.tags_expiring = Some(Instant::now() + KEEP_DRAINING_FOR_TAGS);
        }
        if let Ok(mut p) = progress.lock() {
            p.elapsed = started.elapsed();
            p.ticks = rec.agg.profile().ticks;
            p.samples = rec.agg.profile().samples;
        }
        // A target that exits is seen by the next refresh (its memory no longer reads).
    }
    drain(spy, &mut bpf, &config, &mut rec);
    super::note_ractors(pid, &rec.ractors, &mut rec.agg);
    super::note_trace_drops(spy, &drops_before, &mut rec.agg);
    rec.expired_tags = spy.capture().tags_expired() - expired_before;
    let stats = bpf.stats();
    // Detach and unload before the profile is handed over.
    drop(bpf);
    if let Ok(mut p) = progress.lock() {
        p.finished = true;
    }
    finish(rec, stats, stats_before, wakeups, started, |agg| {
        let cpu = thread_cpu_ns().saturating_sub(cpu_before);
        agg.set_cost(cpu, cpu, spy.memory().calls() - calls_before);
        agg.set_jit(spy.jit());
    })
}

impl Recording {
    fn new<M: Memory>(spy: &Spy<M>, config: &RecordConfig, notes: Vec<String>) -> Recording {
        Recording {
            agg: new_aggregator(spy, config, notes),
            threads: FxHashMap::default(),
            mono_start: monotonic_ns(),
            truncated: 0,
            unknown: 0,
            unknown_tids: FxHashSet::default(),
            refresh_wanted: false,
            shared_natives: false,
            last_at: Duration::ZERO,
            started: Instant::now(),
            ractors: Arc::from([]),
            tags_cut: 0,
            values_cut: 0,
            expired_tags: 0,
            tags_expiring: None,
            drained_at: Instant::now(),
            ring_rate: None,
        }
    }

    /// How long to sleep before the next drain (at most `left` of the recording). While
    /// samples lose their tags to a late drain (tables of objects replaced faster than the
    /// drain period), drain within the window their values live.
    fn period(&self, now: Instant, left: Option<Duration>) -> Duration {
        // Otherwise as seldom as half the ring holds what comes meanwhile: a drain's wake-up
        // costs the same whatever it drains (at 1 kHz, drains 50 ms apart were most of the
        // recorder's CPU), and the other half is room for a burst of deeper stacks. Not
        // once tags have been lost to a drain: then never more than `DRAIN_EVERY` apart,
        // or each return to long periods would lose a long period's tags again.
        let period = match self.ring_rate {
            _ if self.tags_expiring.is_some_and(|until| now < until) => DRAIN_FOR_TAGS,
            _ if self.tags_expiring.is_some() => DRAIN_EVERY,
            None => DRAIN_EVERY,
            Some(rate) => Duration::from_secs_f64((RING_BYTES / 2) as f64 / rate.max(1.0))
                .clamp(DRAIN_SHORTEST, DRAIN_LONGEST),
        };
        left.map_or(period, |l| l.min(period))
    }
}

fn finish(
    mut rec: Recording,
    stats: Stats,
    before: Stats,
    wakeups: u64,
    started: Instant,
    cost: impl FnOnce(&mut Aggregator),
) -> Profile {
    cost(&mut rec.agg);
    rec.agg.set_kernel_cost(KernelCost {
        bpf_run_ns: stats.run_ns.saturating_sub(before.run_ns),
        bpf_runs: stats.runs.saturating_sub(before.runs),
        wakeups,
    });
    rec.agg.note(
        "sampled in the kernel (BPF): each sample is a thread on a CPU, so this is a CPU \
         profile; threads that sleep or wait are not sampled, and no_gvl marks C code or \
         system calls running without the GVL"
            .into(),
    );
    if rec.truncated > 0 {
        rec.agg.note(format!(
            "{} samples had stacks deeper than {MAX_FRAMES} frames: their innermost \
             {MAX_FRAMES} are kept, and a [truncated] frame stands for the rest",
            rec.truncated
        ));
    }
    if rec.expired_tags > 0 {
        rec.agg.note(format!(
            "{} samples were recorded without their tags: their table held objects \
             (Strings...) and was no longer published when the recorder read it, so the \
             objects may have been freed",
            rec.expired_tags
        ));
    }
    if rec.values_cut > 0 {
        rec.agg.note(format!(
            "{} samples had a value stack longer than the BPF sampler copies (128 KiB): their \
             frames whose locals it missed are cut, and a [truncated] frame stands for them",
            rec.values_cut
        ));
    }
    if rec.tags_cut > 0 {
        rec.agg.note(format!(
            "{} samples were recorded without their tags: their table had more than 64 slots \
             (32 tags), more than the BPF sampler copies",
            rec.tags_cut
        ));
    }
    let unknown = rec.unknown;
    if unknown > 0 {
        rec.agg.note(format!(
            "{unknown} ticks came on native threads that run no Ruby (C extensions' threads, \
             Ruby's timer thread) or on Ruby threads started since the last refresh: not \
             recorded"
        ));
    }
    let lost = stats.ring_full.saturating_sub(before.ring_full);
    if lost > 0 {
        rec.agg
            .note(format!("{lost} samples lost: the ring buffer was full"));
        rec.agg
            .add(&Sample::dropped(Dropped::RingFull(lost)), rec.started);
    }
    rec.agg.finish(started.elapsed().as_nanos() as u64)
}

/// Points the program's thread map at the Ruby threads of now; false when the process is
/// gone.
fn refresh_threads<M: Memory>(spy: &mut Spy<M>, bpf: &mut BpfSampler, rec: &mut Recording) -> bool {
    let list = match spy.capture().threads() {
        Ok(list) => list,
        Err(
            crate::Error::ProcessExited { .. }
            | crate::Error::NoSuchProcess { .. }
            | crate::Error::ProcessReplaced { .. },
        ) => return false,
        Err(_) => return true, // the list moved while read: next time
    };
    if let Err(e) = bpf.set_threads(&list) {
        rec.agg
            .note(format!("the thread map could not be updated: {e}"));
    }
    rec.shared_natives = list.iter().any(|t| t.info.ractor > 1);
    let mut ractors: Vec<u32> = list.iter().map(|t| t.info.ractor).collect();
    ractors.sort_unstable();
    ractors.dedup();
    rec.ractors = ractors.into();
    rec.threads = list.into_iter().map(|t| (t.thread, t.info)).collect();
    true
}

fn drain<M: Memory>(
    spy: &mut Spy<M>,
    bpf: &mut BpfSampler,
    config: &RecordConfig,
    rec: &mut Recording,
) {
    spy.capture().begin_batch();
    // Every record of a drain was taken before it began: their ages are counted from then.
    let now = monotonic_ns();
    let since = rec.drained_at.elapsed();
    rec.drained_at = Instant::now();
    // One sample for every record, emptied each time (no allocation per record).
    let mut sample = Sample::default();
    let (_, bytes) = bpf.drain(|r: &Record| {
        if r.unknown {
            rec.unknown += 1;
            rec.refresh_wanted |= rec.unknown_tids.insert(r.tid) || rec.shared_natives;
            return;
        }
        // A record enters the ring when its program ends, so one that started earlier on
        // another CPU can follow a later one: the timeline's times never go back.
        let at = Duration::from_nanos(r.time_ns.saturating_sub(rec.mono_start)).max(rec.last_at);
        rec.last_at = at;
        rec.agg.tick_at(at);
        sample.read_at = Some(rec.started + at);
        sample.threads.clear();
        sample.dropped.clear();
        match rec.threads.get(&r.captured.thread).cloned() {
            None => sample.dropped.push(Dropped::NotInThreadList),
            Some(_) if r.unreadable => sample.dropped.push(Dropped::ContextUnread),
            Some(info) => {
                rec.tags_cut += u64::from(r.tags_cut);
                let mut captured = r.captured;
                captured.age = Duration::from_nanos(now.saturating_sub(r.time_ns));
                match spy.capture().resolve(info, &captured) {
                    Ok(None) => {}
                    Ok(Some(t)) if config.on_cpu && !t.state.on_cpu() => {}
                    Ok(Some(t)) => {
                        rec.truncated += u64::from(r.captured.truncated);
                        let cut = t
                            .frames
                            .last()
                            .is_some_and(|f| &*f.label == TRUNCATED_LABEL);
                        rec.values_cut += u64::from(cut && !r.captured.truncated);
                        sample.threads.push(t);
                    }
                    Err(why) => sample.dropped.push(why),
                }
            }
        }
        rec.agg.add(&sample, rec.started);
    });
    // A drain just after another (the last one) says little of the rate.
    if since >= Duration::from_millis(5) {
        rec.ring_rate = Some(bytes as f64 / since.as_secs_f64());
    }
}

fn note_exit(agg: &mut Aggregator, pid: i32, started: Instant) {
    agg.note(format!(
        "process {pid} exited after {:.1} s; the samples taken until then are kept",
        started.elapsed().as_secs_f64()
    ));
}

/// CLOCK_MONOTONIC, the clock of `bpf_ktime_get_ns`.
fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}
