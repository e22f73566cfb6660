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
//! What cannot be measured from inside is priced: a wake-up at what a tick of the timer was
//! timed to cost once per process (`signal_ns`, ext/rbspy_ext/src/tracker/arming.rs: the
//! clock's interrupt and the signal's delivery and return), beside the handler's own time,
//! and an allocation on the slow path at [`SLOW_PATH_NS`] beside the time inside the hook.
//!
//! Each sample keeps the rate it was drawn with, so a lower cap costs precision, never
//! bias; [`MIN_PER_SECOND`] keeps the estimates of a heavy allocator's main sites usable
//! on a machine whose signals are slow.

/// Ruby's slow path for an allocation while a NEWOBJ hook is on, outside the hook: about
/// 100 ns a call here with an empty hook, of which some 40 are the hook call.
pub const SLOW_PATH_NS: f64 = 60.0;
/// The budget never caps below this many samples a second: 600 a minute, some 60 for a
/// site that allocates a tenth of the bytes. It was 25, when a wake-up was priced at a
/// tenth of its cost in this VM; priced at its cost, a sample costs 270 to 480 µs here and
/// 25 a second cost 0.7 to 1.4 % of a core by the tracker's own measure, the floor and
/// not the budget setting what tracking spent. On bare metal, where a wake-up costs a few
/// µs, the budget's share pays for more.
pub const MIN_PER_SECOND: f64 = 10.0;
/// ...unless the floor would cost more than this many times the share: a sample under 4.1's
/// ZJIT costs 0.7 to 2 ms here (each arming throws compiled code away, and finishes the
/// GC's sweeping), and 10 a second cost 2 % of a core.
pub const FLOOR_AT_MOST: f64 = 2.0;
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
    spent.work_ns as f64 + spent.wakes as f64 * signal_ns + spent.slow_calls as f64 * SLOW_PATH_NS
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
        (self.per_sample_ns > 0.0).then(|| {
            let pays = self.share * 1e9 / self.per_sample_ns;
            pays.max(MIN_PER_SECOND.min(pays * FLOOR_AT_MOST))
        })
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

    #[test]
    fn nothing_is_said_before_enough_samples_were_costed() {
        let mut b = Budget::new(0.005, 13_000.0);
        assert_eq!(b.observe(spent(5, 60, 300, 3_000)), None);
        assert_eq!(b.per_sample_ns(), 0.0);
    }

    #[test]
    fn the_cap_is_what_the_share_pays_for() {
        // A sample: 6 wake-ups at 13 µs, 40 µs of jobs and hook, 400 slow allocations
        // (24 µs): 142 µs. 0.5 % of a core is 5 ms a second: 35 samples.
        let mut b = Budget::new(0.005, 13_000.0);
        let cap = b.observe(spent(100, 600, 4_000, 40_000)).unwrap();
        assert!((cap - 5e6 / 142_000.0).abs() < 0.1, "{cap}");
        // Cheap signals (bare metal, 2 µs): 76 µs a sample, 66 a second.
        let mut b = Budget::new(0.005, 2_000.0);
        let cap = b.observe(spent(100, 600, 4_000, 40_000)).unwrap();
        assert!((cap - 5e6 / 76_000.0).abs() < 0.1, "{cap}");
    }

    #[test]
    fn the_cost_follows_the_load_and_the_floor_holds() {
        let mut b = Budget::new(0.005, 13_000.0);
        b.observe(spent(100, 600, 4_000, 40_000));
        let before = b.per_sample_ns();
        // The next 100 samples cost twice as much: the estimate moves half way.
        b.observe(spent(200, 1_800, 12_000, 120_000));
        assert!((b.per_sample_ns() - before * 1.5).abs() < 1.0);
        // A slow stretch: the cap stays at the floor...
        let cap = b.observe(spent(400, 21_000, 12_000, 120_000)).unwrap();
        assert!(b.share() * 1e9 / b.per_sample_ns() < MIN_PER_SECOND);
        assert_eq!(cap, MIN_PER_SECOND);
        // ...until the floor would cost more than twice the share: then twice the share.
        let cap = b.observe(spent(500, 100_000, 12_000, 120_000)).unwrap();
        let pays = b.share() * 1e9 / b.per_sample_ns();
        assert!(pays * FLOOR_AT_MOST < MIN_PER_SECOND);
        assert!((cap - pays * FLOOR_AT_MOST).abs() < 1e-9);
    }

    #[test]
    fn wakes_between_samples_count_towards_the_next_ones() {
        let mut b = Budget::new(0.005, 10_000.0);
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
