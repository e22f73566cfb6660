//! The user-space sampler's loop: wakes at every tick, reads every selected thread of the
//! process (and of its Ruby children) with `process_vm_readv`, and aggregates the samples.
//! Its sibling `bpf.rs` runs the in-kernel sampler; both set up their aggregator through
//! the recorder (`super`).
use super::{new_aggregator, refresh_live, unix_ns, RecordConfig, Run, Timer};
use crate::cost::thread_cpu_ns;
use crate::error::{Error, Result};
use crate::memory::Memory;
use crate::model::{Dropped, Sample};
use crate::process::{descendants, worker_name};
use crate::profile::{Aggregator, Profile};
use crate::spy::Spy;
use std::sync::atomic::Ordering;

use std::time::{Duration, Instant};

/// How often the process tree is scanned for new Ruby children, and the live top list of
/// `Progress` refreshed.
const SCAN_EVERY: Duration = Duration::from_millis(500);
/// One tick in this many measures its own CPU time (`Profile::sampler_work_ns`).
const WORK_EVERY: u64 = 16;
/// A child that is not (yet) Ruby is tried this many times (it may still be exec'ing).
const CHILD_ATTEMPTS: u32 = 6;

/// Samples one process into the aggregator: the sample, or Err only when the process is gone.
fn sample_into<M: Memory>(
    spy: &mut Spy<M>,
    config: &RecordConfig,
    agg: &mut Aggregator,
    started: Instant,
) -> Result<Sample> {
    let mut sample = match spy.sample(config.threads) {
        Ok(sample) => sample,
        Err(
            e @ (Error::ProcessExited { .. }
            | Error::NoSuchProcess { .. }
            | Error::ProcessReplaced { .. }),
        ) => return Err(e),
        Err(Error::StackChanged { .. }) => Sample::dropped(Dropped::ThreadListChanged),
        Err(e) => {
            agg.note(format!("a sample of process {} failed: {e}", spy.pid()));
            Sample::dropped(Dropped::ReadFailed)
        }
    };
    if config.on_cpu {
        sample.keep_on_cpu();
    }
    // The sample's time is when it read the target, not when its tick began: the first tick
    // reads every thread cold, and a busy machine holds the sampler up between the two (both
    // by milliseconds: seen against an app's own spans).
    agg.add(&sample, started);
    Ok(sample)
}

pub(super) fn run<M: Memory>(spy: &mut Spy<M>, run: Run<'_>) -> Profile {
    let (config, notes, stop, progress) = run.into_parts();
    let pid = spy.pid();
    let mut agg = new_aggregator(spy, &config, notes);
    let started = Instant::now();
    // A kept spy (`OWN_SPY`) counts its calls since it attached: this recording's are the rest.
    let calls_before = spy.memory().calls();
    let drops_before = spy.trace_drops();
    let mut timer = Timer::new(config.rate_hz, unix_ns() ^ u64::from(pid as u32));
    let mut next = started;
    let mut children = Children::default();
    let mut last_scan: Option<Instant> = None;
    let (mut work_ns, mut work_ticks) = (0u64, 0u64);
    let mut last = Sample::default();
    loop {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let now = Instant::now();
        if let Some(d) = config.duration {
            if now.duration_since(started) >= d {
                break;
            }
        }
        if last_scan.is_none_or(|t| t.elapsed() >= SCAN_EVERY) {
            last_scan = Some(Instant::now());
            if config.subprocesses {
                children.attach_new(pid, &config, &mut agg, started);
                children.name_workers(pid, &mut agg);
            }
            refresh_live(progress, &agg, config.live);
        }
        next = wait_until(next, now) + timer.next_interval();
        // Every 16th tick, the CPU time from waking up to the end of the sample: the cost of
        // sampling itself, apart from the wake-up, which the kernel charges to the sampler too
        // (and which on some virtual machines costs more than the sample).
        // Not the first tick, which also pays once for reading the target's symbols: over a
        // short recording that one tick, scaled up, would swamp the figure.
        let measured = (agg.profile().ticks + 1).is_multiple_of(WORK_EVERY);
        let woke = if measured { thread_cpu_ns() } else { 0 };
        agg.tick_at(started.elapsed());
        let sample = match sample_into(spy, &config, &mut agg, started) {
            Ok(sample) => sample,
            Err(e) => {
                note_gone(&mut agg, pid, e, started);
                break;
            }
        };
        // The end-of-recording notes read the last sample that read the thread list.
        if sample.read_at.is_some() {
            last = sample;
        }
        children.sample(&config, &mut agg, started);
        if let Ok(mut p) = progress.lock() {
            p.update(agg.profile(), started);
        }
        if measured {
            work_ns += thread_cpu_ns().saturating_sub(woke);
            work_ticks += 1;
        }
    }
    if let Ok(mut p) = progress.lock() {
        p.finished = true;
    }
    if config.subprocesses {
        children.name_workers(pid, &mut agg);
    }
    let last = last_sample(spy, &config, &agg, last);
    super::note_ractors(pid, &last.ractors, &mut agg);
    super::note_trace_drops(spy, &drops_before, &mut agg);
    let ticks = agg.profile().ticks;
    let work = (work_ns as f64 * ticks as f64 / work_ticks.max(1) as f64) as u64;
    agg.set_jit(spy.jit());
    agg.set_cost(
        thread_cpu_ns(),
        work,
        spy.memory().calls() - calls_before + children.calls(),
    );
    agg.finish(started.elapsed().as_nanos() as u64)
}

/// The sample the end-of-recording notes read: `last`, or where the recording saw Ractors
/// besides the main one, a sample whose thread list is read afresh (a tick's list may be
/// 100 ms old, and Ractors that ended since would count as alive).
fn last_sample<M: Memory>(
    spy: &mut Spy<M>,
    config: &RecordConfig,
    agg: &Aggregator,
    last: Sample,
) -> Sample {
    let pid = spy.pid();
    if !agg
        .profile()
        .threads
        .iter()
        .any(|t| t.pid == pid && t.ractor > 1)
    {
        return last;
    }
    spy.forget_threads();
    spy.sample(config.threads).unwrap_or(last)
}

/// Notes that the recorded process ended (or exec'd) during the recording.
fn note_gone(agg: &mut Aggregator, pid: i32, e: Error, started: Instant) {
    let what = match e {
        Error::ProcessReplaced { detail, .. } => detail,
        _ => "exited".to_string(),
    };
    agg.note(format!(
        "process {pid} {what} after {:.1} s; the samples taken until then are kept",
        started.elapsed().as_secs_f64()
    ));
}

/// Sleeps until `next` (it is `now`), and returns when the tick is: `next`, or `now` when far
/// behind (the machine was busy), to skip ahead rather than burst.
fn wait_until(next: Instant, now: Instant) -> Instant {
    if next > now {
        std::thread::sleep(next - now);
    } else if now.duration_since(next) > Duration::from_millis(100) {
        return now;
    }
    next
}

/// The Ruby child processes a recording with `subprocesses: true` follows.
#[derive(Default)]
struct Children {
    spies: Vec<Spy>,
    /// Children whose worker number is known (`Profile::workers`).
    named: Vec<i32>,
    /// Children found not to be Ruby (yet), with how often they were tried.
    not_ruby: rustc_hash::FxHashMap<i32, u32>,
    /// `process_vm_readv` calls of children that have ended.
    ended_calls: u64,
}

impl Children {
    /// Attaches to the descendants of `pid` not followed yet (each tried at most
    /// `CHILD_ATTEMPTS` times: a child may become Ruby only after it execs).
    fn attach_new(
        &mut self,
        pid: i32,
        config: &RecordConfig,
        agg: &mut Aggregator,
        started: Instant,
    ) {
        for child in descendants(pid) {
            let tries = self.not_ruby.get(&child).copied().unwrap_or(0);
            if tries >= CHILD_ATTEMPTS || self.spies.iter().any(|c| c.pid() == child) {
                continue;
            }
            match Spy::attach_with(child, &config.spy) {
                Ok(c) => {
                    agg.note(format!(
                        "child process {child} (Ruby {}) recorded from {:.1} s",
                        c.version(),
                        started.elapsed().as_secs_f64()
                    ));
                    self.spies.push(c);
                }
                Err(_) => {
                    self.not_ruby.insert(child, tries + 1);
                }
            }
        }
    }

    /// Reads the worker number of each child not named yet: a worker sets its title just
    /// after it is forked, so it may have been attached before. The recorded process is the
    /// workers' "master" once one is named.
    fn name_workers(&mut self, root: i32, agg: &mut Aggregator) {
        for child in &self.spies {
            let pid = child.pid();
            if self.named.contains(&pid) {
                continue;
            }
            if let Some(name) = worker_name(pid) {
                agg.name_worker(pid, name);
                self.named.push(pid);
            }
        }
        if !self.named.is_empty() && !agg.profile().workers.contains_key(&root) {
            agg.name_worker(root, "master".into());
        }
    }

    /// One sample of every child; a child that exited or exec'd is noted and let go.
    fn sample(&mut self, config: &RecordConfig, agg: &mut Aggregator, started: Instant) {
        let ended_calls = &mut self.ended_calls;
        self.spies.retain_mut(|child| {
            let what = match sample_into(child, config, agg, started) {
                Ok(_) => return true,
                Err(Error::ProcessReplaced { detail, .. }) => detail,
                Err(_) => "exited".to_string(),
            };
            *ended_calls += child.memory().calls();
            agg.note(format!(
                "child process {} {what} after {:.1} s",
                child.pid(),
                started.elapsed().as_secs_f64()
            ));
            false
        });
    }

    /// Every child's `process_vm_readv` calls so far.
    fn calls(&self) -> u64 {
        self.ended_calls + self.spies.iter().map(|c| c.memory().calls()).sum::<u64>()
    }
}
