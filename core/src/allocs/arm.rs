//! When the extension's tracker turns its NEWOBJ hook on, and when its timer wakes: the
//! Ruby-free decisions of ext/rbspy_ext/src/tracker/arming.rs, which owns the timer, its
//! signal and Ruby's postponed job, and asks this module at each job.
//!
//! Any NEWOBJ hook sends every allocation down Ruby's slow path, so the hook is on only
//! around a sample point. The job learns how many objects were allocated since it last ran
//! (`GC.stat(:total_allocated_objects)`), turns them into bytes at the size the hook last
//! saw, and so knows how far the next point is ([`super::points::Points::until`]). Time is
//! what a timer can wait for, so the distance becomes µs at the rate the process lately
//! allocates: the hook is turned on when the point is due within a margin (`ahead_us`),
//! which grows when a point passed while the hook was off (a burst, or a job run late) and
//! shrinks while points are met. The timer is one-shot: each tick, and each job, sets the
//! next one at the time wanted ([`delay_for`]).
//!
//! Under ZJIT (Ruby 4.1), turning a NEWOBJ hook on throws away every compiled method that
//! allocates inline, since its fast path would skip the hook: [`super::hold`] says when
//! the hook stays on for that.
//!
//! The tests drive it with a simulated allocator, a fake clock and the one-shot timer, as
//! the extension runs them, and bound what a sample costs in wake-ups and in allocations
//! taken on the slow path.

/// A point due within the margin (`ahead_us`) turns the hook on: from this long...
pub const MIN_AHEAD_US: f64 = 200.0;
/// ...to this.
pub const MAX_AHEAD_US: f64 = 5_000.0;
pub const MIN_DELAY_US: u64 = 100;
/// The first job after the start looks this soon: the hook is on until then.
pub const FIRST_LOOK_US: u64 = 1_000;
pub const MAX_DELAY_US: u64 = 50_000;
/// The longest wait is the time a burst of this many bytes a µs (50 MB/s) takes to pass one
/// point at the current mean, from 2 ms to [`MAX_DELAY_US`]: each wake-up costs the process
/// about 30 µs of CPU here (the VM's timer interrupt and the signal), so waking every 2 ms
/// cost 1.5 % by itself, while at the default rate, or under the cap's larger means, a
/// burst missed over 10 ms misses one point or two (paid by the points after it). A small
/// rate, asked for its detail, keeps 2 ms: a 2 ms burst of 100 points at 4 KiB passed
/// unseen between two looks 10 ms apart.
pub const BURST_BYTES_PER_US: f64 = 50.0;
pub const SHORTEST_LONGEST_US: u64 = 2_000;
/// The timer aims at this share of the time the next point should take, less the margin.
/// Nearer 1, fewer wake-ups arm the hook (each costs about 30 µs here, see above), but more
/// points are missed when the rate rises, and each miss widens the margin: at 0.95 the hook
/// was on 7 % of the time instead of 2 %, for the same CPU, and misses bill other code.
pub const AIM: f64 = 0.8;
/// At this rate or below the hook stays on, as at rate 1. A point then falls every few
/// hundred allocations, sooner than the shortest margin at the speed Ruby allocates (some
/// 150 MB/s here), so the hook was off only between bursts, and a burst that began then
/// went unseen until the job ran: an RSpec example's 10,000 allocations at 4 KiB, about 100
/// samples' worth, got none in 1 run of 50 with a core busy (bench/alloc_load), and their
/// points were paid by other code's. While the process allocates, the hook was on anyway
/// (100 % of the time on bench/alloc_cost.rb's loop at 4 KiB).
pub const STEADY_RATE_BYTES: u64 = 16 * 1024;

/// The allocation rate after one that was `per_us` saw `rate` (both objects a µs): rises at
/// once, so a burst is met by arming early, and falls slowly. The job's rule, and the
/// signal handler's (`super::gate`).
pub fn next_rate(per_us: f64, rate: f64) -> f64 {
    rate.max(per_us * 0.75 + rate * 0.25)
}

/// The longest the timer waits, for draws at a mean of `mean` bytes (see
/// [`BURST_BYTES_PER_US`]).
pub fn longest_wait_us(mean: u64) -> u64 {
    ((mean as f64 / BURST_BYTES_PER_US) as u64).clamp(SHORTEST_LONGEST_US, MAX_DELAY_US)
}

/// The timer's next tick for a job wanted within `wanted_us`. A one-shot timer, set at
/// every tick: in this project's VM a tick costs the process 25 to 35 µs of CPU, and a
/// `timer_settime` in the handler adds next to nothing to it (the kernel programs the
/// clock's next interrupt after each one anyway). A periodic timer, kept to powers of two
/// so that it was set again only when it had to be, ticked up to four times as often as
/// wanted: 6.9 wake-ups a sample on Rack-like load against 4.2 one-shot (simulated below),
/// 306 a second against 184 on bench/alloc_cost.rb's Rack app.
pub fn delay_for(wanted_us: u64) -> u64 {
    wanted_us.clamp(MIN_DELAY_US, MAX_DELAY_US)
}

use super::hold::Hold;

/// What the postponed job knows of the allocation rate, and whether the hook is on.
#[derive(Debug, Clone)]
pub struct Arm {
    /// The hook stays on: 2.7, or rate 1.
    always: bool,
    on: bool,
    /// The hook found the next point far: the job turns it off.
    off_wanted: bool,
    /// A point due within this long turns the hook on: it grows after a point was missed,
    /// and shrinks while none is, so it follows how late this machine runs the job.
    ahead_us: f64,
    /// A point within this many bytes turns the hook on, and keeps it on.
    within: i64,
    /// Allocations (of every type) and counted bytes the hook saw since the last job.
    pub seen: u64,
    pub seen_bytes: u64,
    bytes_per_allocation: f64,
    /// Whether `bytes_per_allocation` is measured yet (not the first guess).
    learned: bool,
    /// Objects allocated per µs, lately.
    per_us: f64,
    /// `total_allocated_objects`, and the time in µs, at the last job.
    total: u64,
    at_us: u64,
    /// µs between the last two jobs.
    interval_us: u64,
    /// Points that passed while the hook was off.
    pub missed: u64,
    /// Held on while a JIT compiles.
    pub hold: Hold,
}

impl Arm {
    /// The hook starts on (the tracker's `start` turns it on): until the first job has
    /// measured how fast the process allocates, nothing can say when to arm it, and a burst
    /// right after tracking starts would pass unsampled. The first point then turns it off.
    /// `total` objects were allocated so far, at `now_us` on a monotonic clock.
    pub fn new(always: bool, total: u64, now_us: u64) -> Self {
        Arm {
            always,
            on: true,
            off_wanted: false,
            ahead_us: MIN_AHEAD_US * 2.0,
            within: 0,
            seen: 0,
            seen_bytes: 0,
            // A slot before Ruby 3.2; what the hook sees replaces it.
            bytes_per_allocation: 40.0,
            learned: false,
            per_us: 0.0,
            total,
            at_us: now_us,
            interval_us: 0,
            missed: 0,
            hold: Hold::default(),
        }
    }

    /// In the hook, after a sample: whether the next point is far enough to turn it off.
    pub fn far(&mut self, until_sample: i64) -> bool {
        if self.always || until_sample <= self.within {
            return false;
        }
        let first = !self.off_wanted;
        self.off_wanted = true;
        first
    }

    /// The job, first: `total` objects were allocated so far, at `now_us`. Returns the bytes
    /// allocated since the last job while the hook was off (at the bytes an allocation took
    /// while it last watched), which bring the next point nearer (past it when points were
    /// missed).
    pub fn observe(&mut self, total: u64, now_us: u64) -> i64 {
        self.interval_us = now_us.saturating_sub(self.at_us);
        let us = self.interval_us as f64;
        self.at_us = now_us;
        let allocated = total.saturating_sub(self.total);
        self.total = total;
        if us > 0.0 {
            self.per_us = next_rate(self.per_us, allocated as f64 / us);
        }
        // What the hook saw, once it saw enough: kept from job to job until then. A starved
        // process's hook may see a few dozen allocations between two jobs (25 an arming in
        // ci-35, on 3.3): reset at every job, the first guess (a 40-byte slot) stood for
        // 640-byte ones for the whole run, and 94 % of the points never came. The first
        // measure replaces the guess outright.
        if self.seen >= 64 {
            let seen = self.seen_bytes as f64 / self.seen as f64;
            self.bytes_per_allocation = match self.learned {
                true => self.bytes_per_allocation * 0.5 + seen * 0.5,
                false => seen,
            };
            self.learned = true;
            (self.seen, self.seen_bytes) = (0, 0);
        }
        match self.on {
            true => 0,
            false => (allocated as f64 * self.bytes_per_allocation) as i64,
        }
    }

    /// Bytes the process allocates a second, lately (for the budget).
    pub fn bytes_per_second(&self) -> f64 {
        self.per_us * self.bytes_per_allocation * 1e6
    }

    /// µs between the last job and the one before it (the budget's refill).
    pub fn interval_us(&self) -> u64 {
        self.interval_us
    }

    /// Whether the hook is on.
    pub fn is_on(&self) -> bool {
        self.on
    }

    /// The margin, in µs: a point due within it turns the hook on.
    pub fn ahead_us(&self) -> f64 {
        self.ahead_us
    }

    /// Objects allocated a µs, lately.
    pub fn per_us(&self) -> f64 {
        self.per_us
    }

    /// The job, after `observe`: the rate the timer's ticks saw since (`super::gate`), which
    /// the job's own average over a longer interval may hide.
    pub fn heard(&mut self, per_us: f64) {
        self.per_us = self.per_us.max(per_us);
    }

    /// The job, after `observe`: how many methods the JIT has compiled so far (None: no JIT
    /// whose compiled code the hook throws away). Code compiled while the hook was on is
    /// safe, and a sign that the JIT is compiling again what the arming threw away: the hold
    /// goes on. Code compiled while it was off is thrown away at the next arming, which then
    /// holds ([`Hold`]).
    pub fn compiled(&mut self, count: Option<u64>) {
        if let Some(count) = count.filter(|_| !self.always) {
            self.hold.compiled(count, self.on, self.at_us);
        }
    }

    /// The job, after `decide`, for [`super::gate::Gate::open_at`]: how many objects from
    /// now the next point falls (at the size the hook last saw), and the margin in µs
    /// within which it turns the hook on; None while the hook is on, when every tick has
    /// work.
    pub fn until_point(&self, until_sample: i64) -> Option<(u64, f64)> {
        if self.on || self.always {
            return None;
        }
        let objects = until_sample.max(0) as f64 / self.bytes_per_allocation.max(1.0);
        Some(((objects as u64).max(1), self.ahead_us))
    }

    /// The job, then: `missed` points passed while the hook was off (they are owed to the
    /// next allocation); points are drawn at a mean of `mean` bytes. Returns whether to turn
    /// the hook on (Some(true)) or off, and the µs the next job is wanted within.
    pub fn decide(&mut self, until_sample: i64, missed: u64, mean: u64) -> (Option<bool>, u64) {
        if missed > 0 {
            self.missed += missed;
            self.ahead_us = (self.ahead_us * 1.5).min(MAX_AHEAD_US);
        }
        let bytes_per_us = (self.per_us * self.bytes_per_allocation).max(1e-3);
        self.within = (bytes_per_us * self.ahead_us) as i64;
        let held = self.hold.holding(self.at_us);
        // On while the next point is within the margin, whatever turned the hook on: the start,
        // a point found near, or one missed. A point missed widens the margin and is owed to
        // the next point taken. Kept on until then, the hook took a whole interval's
        // allocations down the slow path after each miss, and, at a rate whose first point
        // never came (1 GiB; the hook starts on), every allocation for good.
        let change = if self.always {
            None
        } else if !self.on && until_sample <= self.within {
            self.hold.arming(self.at_us);
            Some(true)
        } else if held {
            None
        } else if self.on && self.off_wanted && until_sample > self.within {
            // A point taken in time: the margin may shrink.
            self.ahead_us = (self.ahead_us * 0.95).max(MIN_AHEAD_US);
            Some(false)
        } else if self.on && self.per_us > 0.0 && until_sample > 2 * self.within {
            // Far with no point taken: the start (once a job has measured the rate), or a
            // miss. Twice the margin, so that a rate estimate that sags on the way to a point
            // does not turn the hook off short of it.
            Some(false)
        } else {
            None
        };
        self.off_wanted = false;
        if let Some(on) = change {
            self.on = on;
        }
        let longest = longest_wait_us(mean);
        let delay = if self.on && self.per_us <= 0.0 {
            // The start: a job soon measures the rate, and the hook goes off once it is known.
            FIRST_LOOK_US
        } else if self.on {
            longest
        } else {
            ((until_sample as f64 / bytes_per_us - self.ahead_us) * AIM) as u64
        };
        (change, delay.min(longest))
    }
}

#[cfg(test)]
mod tests {
    use super::super::gate::{Gate, Tick};
    use super::super::points::Points;
    use super::*;

    /// What a simulated run of the tracker did.
    #[derive(Debug)]
    struct Run {
        samples: u64,
        missed: u64,
        /// The timer's ticks, and the jobs they (or the hook) posted.
        wakes: u64,
        jobs: u64,
        /// Allocations while the hook was on: each took Ruby's slow path.
        slow: u64,
        objects: u64,
    }

    /// `bytes(t)` of a process waiting on IO: it allocates nothing, and Ruby runs jobs.
    const IDLE: u64 = u64::MAX;

    /// A process allocating `bytes(t)` bytes in µs `t`, in objects of 40 (none: a GC, when
    /// Ruby runs no job; [`IDLE`]: waiting, when it does), tracked at `rate` with at most `cap` samples a second for
    /// `seconds`: the hook, the job and the one-shot timer as the extension runs them, the
    /// handler reading the count of allocations (`Gate`) as it does where it can.
    fn simulate(rate: u64, cap: u64, seconds: u64, bytes: impl Fn(u64) -> u64) -> Run {
        simulate_with(true, rate, cap, seconds, bytes)
    }

    /// As `simulate`; `gated: false` as where the handler cannot read the count (4.0), and
    /// every tick posts the job.
    fn simulate_with(
        gated: bool,
        rate: u64,
        cap: u64,
        seconds: u64,
        bytes: impl Fn(u64) -> u64,
    ) -> Run {
        let mut points = Points::new(rate, cap, 7);
        let mut arm = Arm::new(false, 0, 0);
        let gate = Gate::new();
        let mut run = Run {
            samples: 0,
            missed: 0,
            wakes: 0,
            jobs: 0,
            slow: 0,
            objects: 0,
        };
        let mut next_wake = delay_for(0);
        let (mut job_wanted, mut due) = (true, 0);
        for t in 0..seconds * 1_000_000 {
            let (now, idle) = match bytes(t) {
                IDLE => (0, true),
                b => (b, false),
            };
            due += now;
            while due >= 40 {
                due -= 40;
                run.objects += 1;
                if arm.is_on() {
                    run.slow += 1;
                    arm.seen += 1;
                    arm.seen_bytes += 40;
                    if points.counted(40).is_some() {
                        run.samples += 1;
                        job_wanted |= points.owed() == 0 && arm.far(points.until());
                    }
                }
            }
            if t == next_wake {
                run.wakes += 1;
                // Until the job sets it (the handler's fallback, in case the job is late).
                next_wake = t + delay_for(longest_wait_us(points.mean()));
                match gated {
                    true => match gate.tick(run.objects, t, now == 0 && !idle) {
                        Tick::Post => job_wanted = true,
                        Tick::Wait(wanted) => next_wake = t + delay_for(wanted),
                    },
                    false => job_wanted = true,
                }
            }
            if !job_wanted || (now == 0 && !idle) {
                continue;
            }
            job_wanted = false;
            run.jobs += 1;
            let unseen = arm.observe(run.objects, t);
            arm.heard(gate.per_us());
            points.advance(unseen);
            points.budget(arm.bytes_per_second(), arm.interval_us() as f64 / 1e6);
            let missed = points.replay_missed();
            run.missed += missed;
            let (_, wanted) = arm.decide(points.until(), missed, points.mean());
            next_wake = t + delay_for(wanted);
            if gated {
                let point = arm.until_point(points.until());
                let longest = longest_wait_us(points.mean());
                gate.open_at(point, run.objects, t, arm.per_us(), longest);
            }
        }
        run
    }

    /// Rack-like: 5 ms at 60 bytes a µs, then 3.5 ms waiting for the next request.
    fn rack(t: u64) -> u64 {
        if t % 8_500 < 5_000 {
            60
        } else {
            IDLE
        }
    }

    #[test]
    fn reading_the_count_in_the_handler_spares_most_jobs_and_misses_no_more() {
        // Rack-like; 2 ms GCs every 15 ms at 200 MB/s; steady at 100 MB/s.
        let gc = |t: u64| if t % 15_000 < 2_000 { 0 } else { 200 };
        for (load, bytes) in [
            ("rack", rack as fn(u64) -> u64),
            ("gc", gc),
            ("steady", |_| 100),
        ] {
            let gated = simulate(512 * 1024, 100, 4, bytes);
            let every = simulate_with(false, 512 * 1024, 100, 4, bytes);
            let jobs = |run: &Run| run.jobs as f64 / run.samples as f64;
            let also = format!("{load}: {gated:?} against {every:?}");
            assert!(jobs(&every) > 2.0 * jobs(&gated), "{also}");
            assert!(jobs(&gated) < 2.5, "{also}");
            assert!(gated.missed <= every.missed + 2, "{also}");
            assert!(gated.samples * 10 >= every.samples * 9, "{also}");
            assert!(gated.slow <= every.slow * 11 / 10, "{also}");
            assert!(gated.wakes <= every.wakes * 12 / 10, "{also}");
        }
    }

    #[test]
    fn a_steady_allocator_costs_a_few_wakeups_and_the_margin_per_sample() {
        // 100 MB/s at 512 KiB (190 points a second), capped at 100 samples a second: the
        // bucket's second of samples, then about 10 ms between points.
        let run = simulate(512 * 1024, 100, 2, |_| 100);
        assert!((200..=310).contains(&run.samples), "{run:?}");
        assert_eq!(run.missed, 0, "{run:?}");
        let per_sample = |n: u64| n as f64 / run.samples as f64;
        assert!(per_sample(run.wakes) < 5.0, "{run:?}");
        // The margin is 200 to 400 µs at 2.5 objects a µs: about 1,000 slow allocations.
        assert!(per_sample(run.slow) < 1_500.0, "{run:?}");
    }

    #[test]
    fn gc_pauses_miss_few_points() {
        // 200 MB/s, with a 2 ms pause (a GC) every 15 ms.
        let run = simulate(
            512 * 1024,
            100,
            2,
            |t| if t % 15_000 < 2_000 { 0 } else { 200 },
        );
        let points = run.samples + run.missed;
        assert!(run.missed * 10 <= points, "{run:?}");
        assert!((run.slow as f64) < 0.1 * run.objects as f64, "{run:?}");
    }

    #[test]
    fn a_burst_is_paid_for_by_the_points_after_it() {
        // 10 MB/s, with 2 ms bursts at 200 MB/s every 50 ms; no cap.
        let run = simulate(
            512 * 1024,
            0,
            2,
            |t| if t % 50_000 < 2_000 { 200 } else { 10 },
        );
        // Every point is sampled or missed (and paid later): 35.2 MB make about 67.
        let points = run.samples + run.missed;
        assert!((45..=90).contains(&points), "{run:?}");
        assert!(run.missed * 2 < points, "{run:?}");
    }

    #[test]
    fn a_one_shot_timer_ticks_only_when_wanted() {
        assert_eq!(delay_for(0), MIN_DELAY_US);
        assert_eq!(delay_for(1_234), 1_234);
        assert_eq!(delay_for(u64::MAX), MAX_DELAY_US);
        // Rack-like load at about the default cap: a few wake-ups a sample (a periodic
        // timer, set again only when its power-of-two period had to change: 6.9).
        let run = simulate(512 * 1024, 35, 4, rack);
        assert!(run.wakes * 10 < run.samples * 50, "{run:?}");
        assert!(run.missed * 5 < run.samples, "{run:?}");
    }

    #[test]
    fn the_hook_stays_on_while_a_point_is_near_and_goes_off_when_far() {
        let mut arm = Arm::new(false, 0, 0);
        arm.observe(1_000, 1_000);
        // One object of 40 bytes a µs: 4 KB is 100 µs away, within the margin.
        assert_eq!(arm.decide(4_000, 0, 512 * 1024).0, None);
        assert!(arm.is_on());
        // Found far after a sample: off, and the next job aims short of the point.
        assert!(arm.far(400_000));
        let (change, wanted) = arm.decide(400_000, 0, 512 * 1024);
        assert_eq!(change, Some(false));
        assert!((7_000..10_000).contains(&wanted), "{wanted} µs");
    }

    #[test]
    fn a_missed_point_widens_the_margin_and_arms_only_when_the_next_is_near() {
        let mut arm = Arm::new(false, 0, 0);
        arm.observe(1_000, 1_000);
        assert!(arm.far(1_000_000));
        arm.decide(1_000_000, 0, 512 * 1024);
        assert!(!arm.is_on());
        let before = arm.within;
        // The next point is 25 ms away: the hook stays off, with a wider margin.
        assert_eq!(arm.decide(1_000_000, 1, 512 * 1024).0, None);
        assert!(arm.within > before);
        assert_eq!(arm.missed, 1);
        // Near: on.
        assert_eq!(arm.decide(arm.within - 1, 0, 512 * 1024).0, Some(true));
    }

    #[test]
    fn a_rate_never_reached_leaves_the_hook_off_after_the_first_job() {
        // 100 MB/s at 1 GiB: no point in 2 s. The hook starts on; the first job turns it off.
        let run = simulate(1 << 30, 0, 2, |_| 100);
        assert_eq!(run.samples, 0, "{run:?}");
        // The first look only (1 ms; it was every allocation).
        assert!(run.slow * 100 < run.objects, "{run:?}");
        // A wake-up per longest wait (MAX_DELAY_US), no more.
        assert!(run.wakes <= 2_000_000 / MAX_DELAY_US + 2, "{run:?}");
    }

    #[test]
    fn the_size_of_an_allocation_is_learned_from_few_allocations_a_job() {
        // A starved process: the hook sees 25 allocations of 640 bytes between two jobs.
        let mut arm = Arm::new(false, 0, 0);
        for job in 1..=3 {
            arm.seen += 25;
            arm.seen_bytes += 25 * 640;
            arm.observe(job * 1_000, job * 1_000);
        }
        // 75 seen over three jobs: 640 bytes, not the first guess of 40 (nor half way).
        assert_eq!(arm.bytes_per_allocation, 640.0);
        // With the hook off, 1,000 objects since the last job are 640,000 bytes.
        arm.on = false;
        assert_eq!(arm.observe(4_000, 4_000), 640_000);
    }

    #[test]
    fn always_on_never_switches() {
        let mut arm = Arm::new(true, 0, 0);
        arm.observe(1_000, 1_000);
        assert!(!arm.far(1 << 30));
        assert_eq!(arm.decide(1 << 30, 0, 1).0, None);
        assert!(arm.is_on());
    }
}
