//! The recorder: a native thread that samples a process at a jittered rate and aggregates
//! what it sees into a [`Profile`]. It never touches Ruby (it may run inside the process it
//! profiles, whose threads keep running) and never sends signals.
//!
//! It owns the configuration, the choice of sampler and its preflight (`mode.rs`), and
//! the aggregator set-up both samplers share; the loops are its children: `user.rs` (reads
//! memory at every tick) and `bpf.rs` (drains the in-kernel sampler's ring). `crate::bpf`
//! keeps the program and its loading and does not import the recorder.
#[cfg(feature = "bpf")]
mod bpf;
mod mode;
mod user;
use crate::error::{Error, Result};
use crate::memory::Memory;
use crate::output::summary::top_self;
use crate::profile::{Aggregator, Profile};
use crate::spy::{Config, Spy, ThreadSelection};
use mode::{kernel_mode, Mode};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Highest sampling rate accepted.
pub const MAX_RATE_HZ: f64 = 100_000.0;

/// How a recording runs; `RecordConfig::default()` is 99 Hz, every thread, until stopped.
#[derive(Debug, Clone)]
pub struct RecordConfig {
    pub rate_hz: f64,
    /// Stop by itself after this long.
    pub duration: Option<Duration>,
    pub threads: ThreadSelection,
    /// Keep only samples of threads that hold the GVL (running Ruby code or collecting
    /// garbage).
    pub on_cpu: bool,
    /// Also record Ruby processes descending from the target (preforking servers); new
    /// ones are picked up within `SCAN_EVERY`.
    pub subprocesses: bool,
    /// Keep a copy of the profile so far in [`Progress::profile`], refreshed every
    /// `SCAN_EVERY` (for live views such as `rubyspy top`).
    pub live: bool,
    /// Sample in the kernel (crate::bpf): a BPF program on a CPU-clock event per CPU.
    pub bpf: bool,
    pub spy: Config,
}

impl Default for RecordConfig {
    fn default() -> Self {
        RecordConfig {
            rate_hz: 99.0,
            duration: None,
            threads: ThreadSelection::All,
            on_cpu: false,
            subprocesses: false,
            live: false,
            bpf: false,
            spy: Config::default(),
        }
    }
}

impl RecordConfig {
    /// Rejects what cannot be honoured, before any work is done.
    pub fn validate(&self) -> Result<()> {
        if !(self.rate_hz.is_finite() && self.rate_hz > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "rate must be a positive number of samples per second, got {}",
                self.rate_hz
            )));
        }
        if self.rate_hz > MAX_RATE_HZ {
            return Err(Error::InvalidArgument(format!(
                "rate {} Hz is above the maximum of {MAX_RATE_HZ} Hz",
                self.rate_hz
            )));
        }
        if self.duration == Some(Duration::ZERO) {
            return Err(Error::InvalidArgument("duration must be positive".into()));
        }
        if self.bpf && self.subprocesses {
            return Err(Error::InvalidArgument(
                "the BPF sampler records one process: record child processes without it".into(),
            ));
        }
        Ok(())
    }
}

/// Jittered intervals with the requested mean: uniform between half and one and a half
/// periods, so no periodic work in the target can line up with the samples (aliasing), while
/// no gap is ever longer than 1.5 periods. Exponential (Poisson) intervals would alias no
/// better and leave long gaps: at 999 Hz, one 5 ms block in eight would get fewer than three
/// samples.
pub struct Timer {
    mean: Duration,
    state: u64,
}

impl Timer {
    pub fn new(rate_hz: f64, seed: u64) -> Self {
        Timer {
            mean: Duration::from_secs_f64(1.0 / rate_hz),
            state: seed | 1,
        }
    }

    /// The next interval.
    pub fn next_interval(&mut self) -> Duration {
        // xorshift64*: plenty for jitter, and no dependency.
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        let r = self.state.wrapping_mul(0x2545_f491_4f6c_dd1d);
        let u = (r >> 11) as f64 / (1u64 << 53) as f64; // [0, 1)
        self.mean.mul_f64(0.5 + u)
    }
}

/// Live figures of a running recording (for progress displays).
#[derive(Debug, Clone, Default)]
pub struct Progress {
    pub elapsed: Duration,
    pub ticks: u64,
    pub samples: u64,
    pub finished: bool,
    /// The functions most often on top of a stack so far (label, samples), refreshed
    /// every half second.
    pub top: Vec<(String, u64)>,
    /// With [`RecordConfig::live`]: the profile so far, refreshed every half second.
    pub profile: Option<Arc<Profile>>,
}

impl Progress {
    fn update(&mut self, profile: &Profile, started: Instant) {
        self.elapsed = started.elapsed();
        self.ticks = profile.ticks;
        self.samples = profile.samples;
    }
}

/// A recording in progress. Dropping it stops the sampler thread.
pub struct Recorder {
    stop: Arc<AtomicBool>,
    progress: Arc<Mutex<Progress>>,
    thread: Option<JoinHandle<Profile>>,
    /// The process that started the sampler thread. A child forked from it has a copy of
    /// this value but no such thread (fork copies only the calling thread), and the progress
    /// lock may have been copied held: it must neither lock nor join (see `in_forked_child`).
    owner: u32,
}

/// The calling process's own spy, kept warm between its recordings of itself. Attaching and
/// a first sample with cold caches (libruby's symbols, the symbol table, every iseq on the
/// stacks) take 15–20 ms, longer than a 5 ms block or a 10 ms example: with the spy kept,
/// only the first recording of a process pays that, and it pays it in `start`, before the
/// recorded code runs.
static OWN_SPY: Mutex<Option<Spy>> = Mutex::new(None);

/// The kept spy, when it is this process's: a child forked after it was kept has a copy of
/// its parent's, which it drops. The lock is only ever tried (here and in `Recorder::start`):
/// a child forked while its parent's sampler held it finds it locked for good, and then
/// attaches anew for each recording rather than waiting forever.
fn take_own_spy() -> Option<Spy> {
    let spy = OWN_SPY.try_lock().ok()?.take()?;
    (spy.pid() as u32 == std::process::id()).then_some(spy)
}

impl Recorder {
    /// Attaches to `pid` (errors surface here, before any work is lost) and starts sampling
    /// on a new native thread. For the calling process itself, the spy of its last
    /// recording is taken up again (see `OWN_SPY`), or a new one warmed up with one sample
    /// that is not kept, so that the first tick is as quick as every other.
    pub fn start(pid: i32, config: RecordConfig) -> Result<Recorder> {
        config.validate()?;
        // Said before attaching: attaching may fail for a reason of its own (ptrace rules)
        // that would hide why --bpf cannot work.
        mode::preflight(&config)?;
        let own = pid as u32 == std::process::id()
            && config.spy.force_version.is_none()
            && !config.spy.scan_for_vm;
        let mut spy = match own.then(take_own_spy).flatten() {
            Some(spy) => spy,
            None => {
                let mut spy = Spy::attach_with(pid, &config.spy)?;
                if own {
                    let _ = spy.sample(ThreadSelection::All);
                }
                spy
            }
        };
        let mode = kernel_mode(&mut spy, &config)?;
        let keep = move |mut spy: Spy| {
            if own {
                spy.forget_threads();
                if let Ok(mut kept) = OWN_SPY.try_lock() {
                    *kept = Some(spy);
                }
            }
        };
        Ok(Self::spawn(spy, config, keep, mode))
    }

    /// Starts the sampler thread, which hands the spy to `done` when the recording ends.
    fn spawn<M: Memory + Send + 'static>(
        mut spy: Spy<M>,
        config: RecordConfig,
        done: impl FnOnce(Spy<M>) + Send + 'static,
        mode: Mode,
    ) -> Recorder {
        let stop = Arc::new(AtomicBool::new(false));
        let progress = Arc::new(Mutex::new(Progress::default()));
        let (s, p) = (stop.clone(), progress.clone());
        let thread = std::thread::Builder::new()
            .name("rbspy_ext sampler".into())
            .spawn(move || {
                let run = Run {
                    config,
                    notes: mode.notes,
                    stop: &s,
                    progress: &p,
                };
                let profile = match mode.kernel {
                    #[cfg(feature = "bpf")]
                    Some(k) => bpf::run(&mut spy, k, run),
                    #[cfg(not(feature = "bpf"))]
                    Some(k) => match k {},
                    None => user::run(&mut spy, run),
                };
                done(spy);
                profile
            })
            .expect("spawning the sampler thread");
        Recorder {
            stop,
            progress,
            thread: Some(thread),
            owner: std::process::id(),
        }
    }

    /// True in a process forked from the one that started this recording: its sampler
    /// thread runs on in the parent only.
    pub fn in_forked_child(&self) -> bool {
        std::process::id() != self.owner
    }

    pub fn progress(&self) -> Progress {
        if self.in_forked_child() {
            return Progress {
                finished: true,
                ..Progress::default()
            };
        }
        self.progress.lock().map(|p| p.clone()).unwrap_or_default()
    }

    /// True once the recording ended by itself (duration reached, target exited).
    pub fn finished(&self) -> bool {
        self.progress().finished
    }

    /// Stops (if still running) and returns the profile.
    /// In a forked child it returns at once an empty profile that says why.
    pub fn stop(mut self) -> Profile {
        if self.in_forked_child() {
            self.forget_thread();
            return Profile {
                notes: vec![format!(
                    "this recording was started in process {}, and process {} is a child \
                     forked from it: the sampler runs on in the parent only, so this profile \
                     is empty (start a new recording in the child to record it)",
                    self.owner,
                    std::process::id()
                )],
                ..Profile::default()
            };
        }
        self.stop.store(true, Ordering::Relaxed);
        let thread = self.thread.take().expect("stop is called once");
        // The BPF recorder parks between drains (record/bpf.rs).
        thread.thread().unpark();
        thread.join().unwrap_or_else(|_| Profile {
            notes: vec!["the sampler thread failed; the profile is empty".into()],
            ..Profile::default()
        })
    }
}

impl Recorder {
    /// Drops the handle of a sampler thread this process does not have, without joining or
    /// detaching it (either would act on a thread id that means nothing here).
    fn forget_thread(&mut self) {
        if let Some(t) = self.thread.take() {
            std::mem::forget(t);
        }
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        if self.in_forked_child() {
            self.forget_thread();
            return;
        }
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

pub(crate) fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// What the recorder hands the sampler loop it runs (user.rs or bpf.rs): the configuration,
/// the notes its choice of sampler left, and the flag and progress it shares with the
/// `Recorder`.
pub(crate) struct Run<'a> {
    config: RecordConfig,
    notes: Vec<String>,
    stop: &'a AtomicBool,
    progress: &'a Mutex<Progress>,
}

impl<'a> Run<'a> {
    fn into_parts(
        self,
    ) -> (
        RecordConfig,
        Vec<String>,
        &'a AtomicBool,
        &'a Mutex<Progress>,
    ) {
        (self.config, self.notes, self.stop, self.progress)
    }
}

/// A recording's aggregator, with the notes it starts with and the spy's warning.
pub(crate) fn new_aggregator<M: Memory>(
    spy: &Spy<M>,
    config: &RecordConfig,
    notes: Vec<String>,
) -> Aggregator {
    let mut agg = Aggregator::new(spy.pid(), spy.version(), config.rate_hz, unix_ns());
    notes
        .into_iter()
        .chain(spy.warning().map(str::to_string))
        .chain(spy.layout_source().note())
        .for_each(|n| agg.note(n));
    agg
}

/// Notes the OpenTelemetry records (`otel_thread_ctx_v1`, spy/traces.rs) that gave no
/// labels during a recording, by reason: `before` is the spy's count when it began (a kept
/// spy counts from when it attached).
pub(crate) fn note_trace_drops<M: Memory>(
    spy: &Spy<M>,
    before: &[(&'static str, u64)],
    agg: &mut Aggregator,
) {
    let counted = |reason: &str| {
        before
            .iter()
            .find(|(r, _)| *r == reason)
            .map_or(0, |(_, n)| *n)
    };
    let drops: Vec<String> = (spy.trace_drops().into_iter())
        .map(|(reason, n)| (reason, n - counted(reason)))
        .filter(|(_, n)| *n > 0)
        .map(|(reason, n)| format!("{n} {reason}"))
        .collect();
    if !drops.is_empty() {
        agg.note(format!(
            "samples whose OpenTelemetry record gave no trace labels: {} (the samples are kept, \
             without those labels)",
            drops.join(", ")
        ));
    }
}

/// Notes the Ractors besides the main one that the recording sampled, and how many of them
/// had ended by its end (their samples are kept): Ractors that come and go are the rule in
/// a Ractor pool, and a reader should know the short-lived ones are in the profile. No note
/// for a process that started none. `live`: the Ractors of the last thread list read (none:
/// unknown).
pub(crate) fn note_ractors(pid: i32, live: &[u32], agg: &mut Aggregator) {
    let seen: std::collections::BTreeSet<u32> = agg
        .profile()
        .threads
        .iter()
        .filter(|t| t.pid == pid && t.ractor > 1)
        .map(|t| t.ractor)
        .collect();
    if seen.is_empty() {
        return;
    }
    let note = if live.is_empty() {
        format!("{} Ractors besides the main one were sampled", seen.len())
    } else {
        let ended = seen.iter().filter(|r| !live.contains(r)).count();
        format!(
            "{} Ractors besides the main one were sampled; {ended} of them ended during \
             the recording (their samples are kept)",
            seen.len()
        )
    };
    agg.note(note);
}

/// Refreshes what a live display reads: the top functions, and with `live` the profile so
/// far.
pub(crate) fn refresh_live(progress: &Mutex<Progress>, agg: &Aggregator, live: bool) {
    if let Ok(mut p) = progress.lock() {
        p.top = top_self(agg.profile(), 10);
        if live {
            p.profile = Some(Arc::new(agg.profile().clone()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timer_intervals_average_the_period_and_vary() {
        let mut t = Timer::new(1000.0, 42);
        let n = 100_000;
        let v: Vec<f64> = (0..n).map(|_| t.next_interval().as_secs_f64()).collect();
        let mean = v.iter().sum::<f64>() / n as f64;
        assert!((mean - 0.001).abs() < 0.00002, "mean {mean}");
        let distinct = v
            .iter()
            .map(|x| (x * 1e7) as u64)
            .collect::<std::collections::HashSet<_>>();
        assert!(distinct.len() > 1000);
        // Never longer than 1.5 periods, never shorter than half of one.
        assert!(v.iter().all(|x| (0.0005..0.0015).contains(x)));
    }

    #[test]
    fn bad_rates_are_rejected_before_any_work() {
        for rate in [0.0, -5.0, f64::NAN, 100_001.0] {
            let c = RecordConfig {
                rate_hz: rate,
                ..RecordConfig::default()
            };
            assert!(c.validate().is_err(), "{rate}");
        }
        assert!(RecordConfig::default().validate().is_ok());
    }
}
