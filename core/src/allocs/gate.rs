//! What the timer's signal handler decides by itself, where it can read the process's count
//! of allocations from memory (`crate::census::AllocatedCounters`): whether the postponed job
//! has work to do, or only the timer needs setting again.
//!
//! The job ([`super::arm::Arm::decide`]) turns the hook on when the next sample point is
//! within a margin, and leaves it off otherwise; until the count reaches the point less
//! that margin, a job finds nothing to do but to set the timer for a nearer look. On
//! Rack-like load that was 7 jobs a sample, each a Ruby interrupt and a `GC.stat` call with
//! the GVL. So the job leaves here the count from which it has work ([`Gate::open_at`]),
//! and the handler, reading the count at each tick, posts the job only from there (or
//! after [`MAX_QUIET_US`], for the job's other chores), and otherwise aims the timer at the
//! gate itself, as the job would have: at [`super::arm::AIM`] of the time the count should
//! take to reach it, at the rate the ticks see.
//!
//! Every field is an atomic: the handler may run on any thread, beside the job on the
//! thread holding the GVL, and two handlers may overlap. A race costs at most one tick's
//! rate estimate or one needless job, never a missed gate: the gate and the count are only
//! compared, never derived from one another here.
use super::arm::{next_rate, AIM, MIN_DELAY_US};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Longest the handler holds the job back: the job also refills the sample budget,
/// publishes the live set for readers outside and learns the size of an allocation.
pub const MAX_QUIET_US: u64 = 200_000;

/// The job's gate, and the handler's view of the allocation rate.
#[derive(Debug, Default)]
pub struct Gate {
    /// The count at which the next sample point falls; 0: every tick posts the job (the
    /// hook is on, or no job set the gate yet).
    point: AtomicU64,
    /// A point due within this many µs, at the rate the ticks see, turns the hook on (the
    /// job's margin), as f64 bits.
    ahead_us: AtomicU64,
    /// A tick at this time (µs) or after posts the job anyway.
    deadline_us: AtomicU64,
    /// The longest the timer waits (the job's, which follows the mean of the draws).
    longest_us: AtomicU64,
    /// The count and time of the last tick or job.
    count: AtomicU64,
    at_us: AtomicU64,
    /// Objects allocated a µs, lately, as f64 bits.
    per_us: AtomicU64,
}

/// What a tick does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Tick {
    /// Post the job.
    Post,
    /// Nothing for the job: the next tick is wanted within this many µs.
    Wait(u64),
}

impl Gate {
    pub const fn new() -> Self {
        Gate {
            point: AtomicU64::new(0),
            ahead_us: AtomicU64::new(0),
            deadline_us: AtomicU64::new(0),
            longest_us: AtomicU64::new(0),
            count: AtomicU64::new(0),
            at_us: AtomicU64::new(0),
            per_us: AtomicU64::new(0),
        }
    }

    /// The job: `count` objects allocated at `now_us`, lately `per_us` a µs; the next
    /// point is `point.0` objects on, and due within `point.1` µs turns the hook on (None:
    /// every tick has work); the timer waits at most `longest_us`.
    pub fn open_at(
        &self,
        point: Option<(u64, f64)>,
        count: u64,
        now_us: u64,
        per_us: f64,
        longest_us: u64,
    ) {
        self.count.store(count, Relaxed);
        self.at_us.store(now_us, Relaxed);
        self.per_us.store(per_us.to_bits(), Relaxed);
        self.longest_us.store(longest_us, Relaxed);
        self.deadline_us
            .store(now_us.saturating_add(MAX_QUIET_US), Relaxed);
        let (objects, ahead_us) = point.unwrap_or((0, 0.0));
        self.ahead_us.store(ahead_us.to_bits(), Relaxed);
        let at = match point {
            Some(_) => count.saturating_add(objects),
            None => 0,
        };
        self.point.store(at, Relaxed);
    }

    /// Every tick posts the job again (tracking stopped or started anew).
    pub fn close(&self) {
        self.point.store(0, Relaxed);
    }

    /// The longest the timer waits, as the job last said (0: no job yet).
    pub fn longest_us(&self) -> u64 {
        self.longest_us.load(Relaxed)
    }

    /// The rate the ticks saw lately, in objects a µs.
    pub fn per_us(&self) -> f64 {
        f64::from_bits(self.per_us.load(Relaxed))
    }

    /// The handler: the count read is `count` at `now_us`, while a GC runs or not.
    /// Async-signal-safe: atomics and arithmetic only.
    pub fn tick(&self, count: u64, now_us: u64, in_gc: bool) -> Tick {
        let point = self.point.load(Relaxed);
        if point == 0 || count >= point || now_us >= self.deadline_us.load(Relaxed) {
            return Tick::Post;
        }
        let mut per_us = self.per_us();
        // A GC stops allocation for a few ms, and the process goes on at its rate after:
        // a tick inside one learns nothing of the rate (read as a slow one, it set long
        // waits that ended past the point: 33 points missed in 470 with 2 ms GCs every
        // 15 ms, against 2 when the job ran at each tick, after the GC). A process that
        // waits on IO is slow indeed, and the ticks thin out as the job's did.
        if !in_gc {
            let last = self.count.swap(count, Relaxed);
            let last_us = self.at_us.swap(now_us, Relaxed);
            per_us = self.learn(
                per_us,
                count.saturating_sub(last),
                now_us.saturating_sub(last_us),
            );
        }
        let longest = self.longest_us.load(Relaxed).max(MIN_DELAY_US);
        if per_us <= 0.0 {
            return Tick::Wait(longest);
        }
        // As `Arm::decide`: the hook goes on once the point is due within the margin, at
        // the rate seen now; until then the timer aims short of that.
        let due_us = (point - count) as f64 / per_us - f64::from_bits(self.ahead_us.load(Relaxed));
        if due_us <= 0.0 {
            return Tick::Post;
        }
        Tick::Wait(((due_us * AIM) as u64).min(longest))
    }

    /// The rate after `objects` were allocated in `us`, by the job's rule
    /// ([`super::arm::next_rate`]).
    fn learn(&self, per_us: f64, objects: u64, us: u64) -> f64 {
        if us == 0 {
            return per_us;
        }
        let rate = objects as f64 / us as f64;
        let per_us = next_rate(per_us, rate);
        self.per_us.store(per_us.to_bits(), Relaxed);
        per_us
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tick_short_of_the_margin_aims_the_timer_at_it() {
        let gate = Gate::new();
        assert_eq!(gate.tick(10, 10, false), Tick::Post, "no gate yet");
        // 1 object a µs; the point 11,000 objects on, a margin of 1 ms.
        gate.open_at(Some((11_000, 1_000.0)), 1_000, 1_000, 1.0, 20_000);
        // Still 1 a µs: due in 6 ms, less the margin; aimed at 80 % of 5 ms.
        assert_eq!(gate.tick(6_000, 6_000, false), Tick::Wait(4_000));
        // Twice as fast (rises at once): due in 2 ms, less the margin.
        assert_eq!(gate.tick(8_000, 7_000, false), Tick::Wait(800));
        // Within the margin at that rate: the job turns the hook on.
        assert_eq!(gate.tick(10_500, 8_000, false), Tick::Post);
    }

    #[test]
    fn an_idle_process_still_runs_the_job_now_and_then() {
        let gate = Gate::new();
        gate.open_at(Some((1_000_000, 200.0)), 0, 0, 0.0, 20_000);
        // Nothing allocated: the timer waits its longest.
        assert_eq!(gate.tick(0, 20_000, false), Tick::Wait(20_000));
        assert_eq!(gate.tick(0, MAX_QUIET_US - 1, false), Tick::Wait(20_000));
        assert_eq!(gate.tick(0, MAX_QUIET_US, false), Tick::Post);
    }

    #[test]
    fn a_gc_keeps_the_rate_and_a_wait_on_io_lowers_it() {
        let gate = Gate::new();
        gate.open_at(Some((10_000, 200.0)), 0, 0, 1.0, 20_000);
        let Tick::Wait(before) = gate.tick(1_000, 1_000, false) else {
            panic!("posted")
        };
        // 3 ms of GC: nothing allocated, the same aim.
        assert_eq!(gate.tick(1_000, 4_000, true), Tick::Wait(before));
        assert_eq!(gate.per_us(), 1.0);
        // Then 3 ms waiting on IO, from the last tick outside the GC: the rate falls.
        let Tick::Wait(after) = gate.tick(1_000, 4_000, false) else {
            panic!("posted")
        };
        assert!(after > before, "{after} µs after, {before} µs before");
        assert_eq!(gate.per_us(), 0.75);
    }

    #[test]
    fn with_the_hook_on_or_the_gate_closed_every_tick_posts() {
        let gate = Gate::new();
        gate.open_at(None, 0, 0, 1.0, 20_000);
        assert_eq!(gate.tick(1, 1, false), Tick::Post);
        gate.open_at(Some((1_000_000, 200.0)), 0, 0, 1.0, 20_000);
        gate.close();
        assert_eq!(gate.tick(1, 1, false), Tick::Post);
    }
}
