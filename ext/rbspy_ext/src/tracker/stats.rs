//! What the tracker's own machinery did since tracking started: how often it was woken, how
//! long the NEWOBJ hook was on and how many allocations it saw, what the postponed job and
//! the GC hook cost. `RubySpy::NativeAllocations.stats` returns them; bench/alloc_cost.rb
//! turns them into the cost table of issue 48. Plain relaxed counters: a reader wants
//! magnitudes, and the hook must not pay for more.
use rbspy_ext_core::sync::locked;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Instant;

/// One counter per field of [`Stats::snapshot`], in its order.
pub(super) struct Stats {
    /// Wake-ups of whatever asks for the job (the timer's signals).
    pub wakes: AtomicU64,
    /// Times the timer was set (`timer_settime`): at each tick and each job, one-shot.
    pub timer_sets: AtomicU64,
    /// ns inside the signal handler (reading the count, setting the timer, posting): the
    /// clock's interrupt and the kernel's delivery are priced apart, from ticks timed once
    /// (`signal_ns`).
    pub handler_ns: AtomicU64,
    /// Sample points that passed while the hook was off (paid by the points after them).
    pub missed: AtomicU64,
    /// Postponed jobs run, and the ns they took.
    pub jobs: AtomicU64,
    pub job_ns: AtomicU64,
    /// NEWOBJ hook calls (each an allocation that took Ruby's slow path for us).
    pub hook_calls: AtomicU64,
    /// ns inside the hook, measured on one call in [`HOOK_TIMED_EVERY`] and scaled.
    pub hook_ns: AtomicU64,
    /// Times the hook was turned on, and ns it was on.
    pub arms: AtomicU64,
    pub armed_ns: AtomicU64,
    /// ns the job spent turning the hook on and off.
    pub switch_ns: AtomicU64,
    /// GC_END_MARK hook calls and their ns.
    pub marks: AtomicU64,
    pub mark_ns: AtomicU64,
    /// Samples taken.
    pub samples: AtomicU64,
    /// Live sets published for readers outside (publish.rs), and the ns they took.
    pub publishes: AtomicU64,
    pub publish_ns: AtomicU64,
}

/// The hook is timed on one call in this many: reading the clock on every call would cost
/// as much as the hook itself.
pub(super) const HOOK_TIMED_EVERY: u64 = 16;

pub(super) static STATS: Stats = Stats {
    wakes: AtomicU64::new(0),
    timer_sets: AtomicU64::new(0),
    handler_ns: AtomicU64::new(0),
    missed: AtomicU64::new(0),
    jobs: AtomicU64::new(0),
    job_ns: AtomicU64::new(0),
    hook_calls: AtomicU64::new(0),
    hook_ns: AtomicU64::new(0),
    arms: AtomicU64::new(0),
    armed_ns: AtomicU64::new(0),
    switch_ns: AtomicU64::new(0),
    marks: AtomicU64::new(0),
    mark_ns: AtomicU64::new(0),
    samples: AtomicU64::new(0),
    publishes: AtomicU64::new(0),
    publish_ns: AtomicU64::new(0),
};

/// The totals the CPU budget prices (core's `allocs::budget`).
pub(super) fn spent() -> rbspy_ext_core::allocs::budget::Spent {
    rbspy_ext_core::allocs::budget::Spent {
        samples: STATS.samples.load(Relaxed),
        wakes: STATS.wakes.load(Relaxed),
        work_ns: STATS.job_ns.load(Relaxed)
            + STATS.hook_ns.load(Relaxed)
            + STATS.handler_ns.load(Relaxed),
        slow_calls: STATS.hook_calls.load(Relaxed),
    }
}

/// When the hook was last turned on (None while it is off), and when tracking started.
static ARMED_AT: Mutex<Option<Instant>> = Mutex::new(None);
static STARTED: Mutex<Option<Instant>> = Mutex::new(None);

impl Stats {
    pub fn reset(&self) {
        for c in self.counters() {
            c.store(0, Relaxed);
        }
        *locked(&STARTED) = Some(Instant::now());
        *locked(&ARMED_AT) = None;
    }

    fn counters(&self) -> [&AtomicU64; 16] {
        [
            &self.wakes,
            &self.timer_sets,
            &self.handler_ns,
            &self.missed,
            &self.jobs,
            &self.job_ns,
            &self.hook_calls,
            &self.hook_ns,
            &self.arms,
            &self.armed_ns,
            &self.switch_ns,
            &self.marks,
            &self.mark_ns,
            &self.samples,
            &self.publishes,
            &self.publish_ns,
        ]
    }

    /// The hook was turned on (true) or off.
    pub fn switched(&self, on: bool) {
        let mut at = locked(&ARMED_AT);
        match (on, at.take()) {
            (true, None) => {
                self.arms.fetch_add(1, Relaxed);
                *at = Some(Instant::now());
            }
            (true, Some(since)) => *at = Some(since),
            (false, Some(since)) => {
                self.armed_ns
                    .fetch_add(since.elapsed().as_nanos() as u64, Relaxed);
            }
            (false, None) => {}
        }
    }

    /// (name, value) pairs: the counters, the armed time including a current stretch, and
    /// the seconds since tracking started.
    pub fn snapshot(&self) -> Vec<(&'static str, f64)> {
        const NAMES: [&str; 16] = [
            "wakes",
            "timer_sets",
            "handler_ns",
            "missed",
            "jobs",
            "job_ns",
            "hook_calls",
            "hook_ns",
            "arms",
            "armed_ns",
            "switch_ns",
            "marks",
            "mark_ns",
            "samples",
            "publishes",
            "publish_ns",
        ];
        let mut pairs: Vec<(&'static str, f64)> = NAMES
            .iter()
            .zip(self.counters())
            .map(|(&n, c)| (n, c.load(Relaxed) as f64))
            .collect();
        let current = locked(&ARMED_AT).map_or(0, |since| since.elapsed().as_nanos() as u64);
        if let Some(armed) = pairs.iter_mut().find(|(n, _)| *n == "armed_ns") {
            armed.1 += current as f64;
        }
        let seconds = locked(&STARTED).map_or(0.0, |s| s.elapsed().as_secs_f64());
        pairs.push(("seconds", seconds));
        pairs
    }
}
