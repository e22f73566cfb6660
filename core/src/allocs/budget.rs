//! What tracking may spend: at the default settings the cap on samples a second follows
//! what a sample costs, as the tracker measures it, so that tracking spends at most a set
//! share of one core (Datadog's budget, in CPU rather than in samples).
//!
//! A sample costs the same whatever the process does: the timer's wake-ups that bring the
//! hook near its point (4 to 5 a sample; in this project's VM a tick costs the process 25
//! to 35 µs of CPU, on bare metal a few), the two postponed jobs that turn the hook on and
//! off, the allocations the armed hook sends down Ruby's slow path, and the hook itself.
//! The extension's stats count each of these; the job hands their totals to
//! [`Budget::observe`], which prices them and says how many samples a second the share pays
//! for. The cap is then the lower of that and the cap asked for
//! ([`super::points::Points::set_cap`]).
//!
//! What cannot be measured from inside is priced: a wake-up at [`WAKE_PER_ROUND_TRIP`]
//! times what a tick of the timer was timed to take once per process (`signal_ns`,
//! ext/rbspy_ext/src/tracker/arming.rs: the clock's interrupt and the signal's delivery and
//! return), beside the handler's own time, and an allocation on the slow path at
//! [`SLOW_PATH_NS`] beside the time inside the hook.
//!
//! Each sample keeps the rate it was drawn with, so a lower cap costs precision, never
//! bias. There is no floor: the share is what the user allows (`max_cpu:`), and it holds.
//! A floor of 10 samples a second (600 a minute), kept while it cost at most twice the
//! share, bound on every workload here once wake-ups were priced at their cost: tracking
//! then spent 0.75 to 1 % of a core by its own measure, and 0.4 to 1.7 % end to end. In
//! this project's VM the share pays for 6 to 15 samples a second; on bare metal, where a
//! wake-up costs a few µs, for several times that.

/// Ruby's slow path for an allocation while a NEWOBJ hook is on, outside the hook: about
/// 100 ns a call here with an empty hook, of which some 40 are the hook call.
pub const SLOW_PATH_NS: f64 = 60.0;
/// What a wake-up costs the process, in the round trips `signal_ns` times. The round trip is
/// the fastest of 64 ticks in a row, with warm caches: 22 to 24 µs in this project's VM.
/// Under work, a tick every 10 ms or so (the tracker's pace) costs more, as the interrupt,
/// the signal and the handler cool the caches and TLB the work then refills: a scratch timer
/// with an empty handler under bench/alloc_cost.rb's Rack app cost 24 to 95 µs a tick
/// (median near 58) at 1 and 2 ms, on 3.1 and 4.0, and 31 to 34 µs at 200 µs. Priced at one
/// round trip, a wake-up was counted at under half its cost: the tracker measured 0.6 % of
/// a core where the same runs took 0.9 to 2.3 % more CPU end to end. At 300 samples a
/// second, where ticks come every ms, the two agreed within a quarter on 3.1.
pub const WAKE_PER_ROUND_TRIP: f64 = 2.5;
/// Samples a cost estimate is made from: fewer are too noisy (a job's µs vary tenfold)...
const SAMPLES_PER_LOOK: u64 = 32;
/// ...but the first is made sooner: until then the cap asked for holds, and a run of a few
/// seconds would take most of its samples at it.
const SAMPLES_FIRST_LOOK: u64 = 8;

/// Totals of what the tracker's machinery did since tracking started.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Spent {
    pub samples: u64,
    /// Timer signals.
    pub wakes: u64,
    /// ns measured inside the postponed jobs, the hook and the signal handler.
    pub work_ns: u64,
    /// Hook calls: allocations that took Ruby's slow path.
    pub slow_calls: u64,
}

/// ns `spent` cost, a wake-up priced at `signal_ns` (also for a tracker with no budget: its
/// stats say what it spent).
pub fn price(spent: &Spent, signal_ns: f64) -> f64 {
    let wake_ns = signal_ns * WAKE_PER_ROUND_TRIP;
    spent.work_ns as f64 + spent.wakes as f64 * wake_ns + spent.slow_calls as f64 * SLOW_PATH_NS
}

/// The share of a core tracking may spend, and what a sample was found to cost.
#[derive(Debug, Clone)]
pub struct Budget {
    share: f64,
    signal_ns: f64,
    /// ns a sample costs, lately (0: not yet known).
    per_sample_ns: f64,
    /// The totals at the last estimate.
    last: Spent,
}

impl Budget {
    /// At most `share` of one core (0.005: 0.5 %), a wake-up priced at `signal_ns`.
    pub fn new(share: f64, signal_ns: f64) -> Self {
        Budget {
            share,
            signal_ns,
            per_sample_ns: 0.0,
            last: Spent::default(),
        }
    }

    /// The share of a core tracking may spend.
    pub fn share(&self) -> f64 {
        self.share
    }

    /// ns `spent` cost, priced.
    pub fn price(&self, spent: &Spent) -> f64 {
        price(spent, self.signal_ns)
    }

    /// ns a sample costs lately (0 until [`SAMPLES_FIRST_LOOK`] samples were taken).
    pub fn per_sample_ns(&self) -> f64 {
        self.per_sample_ns
    }

    /// The job, with the totals so far: the samples a second the share pays for (None
    /// until a sample's cost is known). What was spent between samples counts towards the
    /// next ones, so an idle process's wake-ups raise the price of its rare samples: it
    /// then takes fewer than the cap allows, and spends no more.
    pub fn observe(&mut self, now: Spent) -> Option<f64> {
        let samples = now.samples.saturating_sub(self.last.samples);
        let needed = match self.per_sample_ns > 0.0 {
            true => SAMPLES_PER_LOOK,
            false => SAMPLES_FIRST_LOOK,
        };
        if samples >= needed {
            let window = Spent {
                samples,
                wakes: now.wakes.saturating_sub(self.last.wakes),
                work_ns: now.work_ns.saturating_sub(self.last.work_ns),
                slow_calls: now.slow_calls.saturating_sub(self.last.slow_calls),
            };
            let cost = self.price(&window) / samples as f64;
            // Falls as fast as it rises: a sample's cost varies with the load, and a cap set
            // by one slow stretch should not hold for long.
            self.per_sample_ns = match self.per_sample_ns {
                p if p > 0.0 => p * 0.5 + cost * 0.5,
                _ => cost,
            };
            self.last = now;
        }
        (self.per_sample_ns > 0.0).then(|| self.share * 1e9 / self.per_sample_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spent(samples: u64, wakes: u64, work_us: u64, slow_calls: u64) -> Spent {
        Spent {
            samples,
            wakes,
            work_ns: work_us * 1000,
            slow_calls,
        }
    }

    /// A budget whose wake-ups cost `wake_ns` each.
    fn budget(share: f64, wake_ns: f64) -> Budget {
        Budget::new(share, wake_ns / WAKE_PER_ROUND_TRIP)
    }

    #[test]
    fn a_wake_up_costs_more_than_its_round_trip() {
        // 10 wake-ups of a 20 µs round trip, 1 µs of work, 100 slow allocations.
        let cost = price(&spent(1, 10, 1, 100), 20_000.0);
        let wakes = 10.0 * 20_000.0 * WAKE_PER_ROUND_TRIP;
        assert!((cost - (wakes + 1_000.0 + 100.0 * SLOW_PATH_NS)).abs() < 1e-6);
    }

    #[test]
    fn nothing_is_said_before_enough_samples_were_costed() {
        let mut b = budget(0.005, 13_000.0);
        assert_eq!(b.observe(spent(5, 60, 300, 3_000)), None);
        assert_eq!(b.per_sample_ns(), 0.0);
    }

    #[test]
    fn the_cap_is_what_the_share_pays_for() {
        // A sample: 6 wake-ups at 13 µs, 40 µs of jobs and hook, 400 slow allocations
        // (24 µs): 142 µs. 0.5 % of a core is 5 ms a second: 35 samples.
        let mut b = budget(0.005, 13_000.0);
        let cap = b.observe(spent(100, 600, 4_000, 40_000)).unwrap();
        assert!((cap - 5e6 / 142_000.0).abs() < 0.1, "{cap}");
        // Cheap signals (bare metal, 2 µs): 76 µs a sample, 66 a second.
        let mut b = budget(0.005, 2_000.0);
        let cap = b.observe(spent(100, 600, 4_000, 40_000)).unwrap();
        assert!((cap - 5e6 / 76_000.0).abs() < 0.1, "{cap}");
    }

    #[test]
    fn the_cost_follows_the_load() {
        let mut b = budget(0.005, 13_000.0);
        b.observe(spent(100, 600, 4_000, 40_000));
        let before = b.per_sample_ns();
        // The next 100 samples cost twice as much: the estimate moves half way.
        b.observe(spent(200, 1_800, 12_000, 120_000));
        assert!((b.per_sample_ns() - before * 1.5).abs() < 1.0);
        // A slow stretch (96 wake-ups a sample): the cap falls to what the share pays for,
        // under 10 a second (the floor there was until 2026-11), and nothing holds it up.
        let cap = b.observe(spent(400, 21_000, 12_000, 120_000)).unwrap();
        assert!((cap - b.share() * 1e9 / b.per_sample_ns()).abs() < 1e-9);
        assert!(cap < 10.0, "{cap}");
    }

    #[test]
    fn wakes_between_samples_count_towards_the_next_ones() {
        let mut b = budget(0.005, 10_000.0);
        b.observe(spent(40, 200, 0, 0));
        assert_eq!(b.per_sample_ns(), 50_000.0);
        // 1,000 wake-ups, mostly idle, over the next 20 samples: too few for an estimate...
        b.observe(spent(60, 1_200, 0, 0));
        assert_eq!(b.per_sample_ns(), 50_000.0);
        // ...then they are priced into the 40 samples since the last one.
        b.observe(spent(80, 1_400, 0, 0));
        assert_eq!(b.per_sample_ns(), 0.5 * 50_000.0 + 0.5 * 300_000.0);
    }
}
