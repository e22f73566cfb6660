//! Where the allocation tracker's sample points fall, and what each sample weighs: the
//! Ruby-free part of the extension's tracker (ext/rbspy_ext/src/tracker/), which calls it
//! from the NEWOBJ hook (`counted`) and the postponed job (`advance`, `replay_missed`,
//! `budget`).
//!
//! Points are Go's: the bytes to the next one are exponential with the rate as mean, and
//! the object whose slot crosses it is the sample, weighing [`super::weight`] objects at the
//! rate its interval was drawn with.
//!
//! **The budget.** With `max_per_second`, samples are paid from a bucket that holds one
//! second's worth and refills at that many a second. While it is full the draws keep the
//! rate asked for; by the time it is half spent their mean has risen to what keeps a heavy
//! allocator at the cap (`budget`, from the bytes a second the job measures). It never
//! falls below the rate asked for. A short burst so keeps its samples: priced at the rate
//! the job last measured, a 20 ms burst of 8 MB right after tracking started was drawn at
//! a mean of 4 MB, and got no sample at all 4 times in 100 on a busy machine. Each sample
//! keeps the rate
//! its interval was drawn with, and the weights use it, so the estimates stay unbiased: the
//! rate only changes between draws, where an exponential draw has no memory of the past.
//! What a user gives up at the cap is samples, so precision: a site allocating 1 % of the
//! bytes gets one sample a second at 100 a second.
//!
//! **Missed points.** A point the job finds passed while the hook was off (`replay_missed`)
//! is owed, and paid by the points after it, each counting its object once more
//! ([`OWED_PER_POINT`], or [`OWED_SPREAD`]'s share of a large debt).

/// A point missed while the hook was off is paid by a later point, which counts its object
/// once more for it: each point pays one...
pub const OWED_PER_POINT: u32 = 1;
/// ...or, when much is owed, this fraction of it, so that a debt of any size is paid within
/// a few thousand points.
pub const OWED_SPREAD: u32 = 256;

/// A sample the hook takes: the rate its interval was drawn with, and how many samples it
/// counts for (more than one when it pays for missed points).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Take {
    pub rate: u64,
    pub times: u32,
}

#[derive(Debug, Clone)]
pub struct Points {
    rate: u64,
    max_per_second: u64,
    /// The mean of the next draws: the rate, or more under the budget.
    draw_rate: u64,
    /// The mean the interval to the current point was drawn with.
    point_rate: u64,
    /// Bytes still to allocate before the point.
    until: i64,
    rng: u64,
    owed: u32,
    /// The highest mean drawn with (notes say when the budget raised it).
    highest_rate: u64,
    /// Samples the cap has left: at most `max_per_second`.
    tokens: f64,
}

impl Points {
    /// Points at a mean of `rate` bytes (1: every allocation), at most `max_per_second`
    /// samples a second (0: no cap), drawn from a generator seeded with `seed`.
    pub fn new(rate: u64, max_per_second: u64, seed: u64) -> Self {
        let rate = rate.max(1);
        let mut p = Points {
            rate,
            max_per_second,
            draw_rate: rate,
            point_rate: rate,
            until: 0,
            rng: seed | 1,
            owed: 0,
            highest_rate: rate,
            tokens: max_per_second as f64,
        };
        p.until = p.draw();
        p
    }

    pub fn rate(&self) -> u64 {
        self.rate
    }

    /// Bytes until the next point (0 or less: due).
    pub fn until(&self) -> i64 {
        self.until
    }

    /// The mean the next points are drawn with (the rate, or more under the cap).
    pub fn mean(&self) -> u64 {
        self.draw_rate
    }

    /// Points missed and not yet paid.
    pub fn owed(&self) -> u32 {
        self.owed
    }

    /// The highest mean the budget drew with (the rate when it never rose).
    pub fn highest_rate(&self) -> u64 {
        self.highest_rate
    }

    /// Draws the bytes to the next point at the current mean (0 at rate 1, so that every
    /// allocation is sampled).
    fn draw(&mut self) -> i64 {
        self.point_rate = self.draw_rate;
        if self.draw_rate <= 1 {
            return 0;
        }
        // xorshift64*: a generator of our own, so the hook calls nothing it does not need.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        let bits = self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11;
        let u = (bits as f64 + 1.0) / (1u64 << 53) as f64; // (0, 1]
        (-u.ln() * self.draw_rate as f64).min(i64::MAX as f64 / 2.0) as i64
    }

    /// The hook: an object of `size` bytes was allocated. At a point it is the sample:
    /// one sample however many points its slot spans (Go's weight counts on it), and more
    /// while points are owed.
    pub fn counted(&mut self, size: u64) -> Option<Take> {
        self.until -= size as i64;
        if self.until > 0 {
            return None;
        }
        let rate = self.point_rate;
        self.until = self.draw();
        // Paid a few at a time, so that the code allocating then stands for the missed
        // points over about as many bytes as they took: all at one object, they billed a
        // whole burst to whichever line happened to allocate next.
        let paid = self.owed.min(OWED_PER_POINT.max(self.owed / OWED_SPREAD));
        self.owed -= paid;
        self.tokens -= 1.0;
        Some(Take {
            rate,
            times: 1 + paid,
        })
    }

    /// The job: `bytes` were allocated while the hook was off.
    pub fn advance(&mut self, bytes: i64) {
        self.until -= bytes;
    }

    /// The job, after `advance`: each point passed while the hook was off is owed to the
    /// points that follow. Returns how many.
    pub fn replay_missed(&mut self) -> u64 {
        let mut missed = 0;
        while self.until <= 0 && self.rate > 1 && missed < 1_000_000 {
            missed += 1;
            let next = self.draw().max(1);
            self.until += next;
        }
        self.owed = self.owed.saturating_add(missed as u32);
        missed
    }

    /// The cap, now `per_second` (from the CPU budget, `super::budget`): the bucket holds
    /// no more than a second of it.
    pub fn set_cap(&mut self, per_second: u64) {
        self.max_per_second = per_second;
        self.tokens = self.tokens.min(per_second as f64);
    }

    /// The job, `seconds` after the last one: the process allocates about
    /// `bytes_per_second`; under a cap, the bucket refills and the next draws' mean follows
    /// what it holds.
    pub fn budget(&mut self, bytes_per_second: f64, seconds: f64) {
        if self.max_per_second == 0 || self.rate <= 1 {
            return;
        }
        let cap = self.max_per_second as f64;
        self.tokens = (self.tokens + seconds.max(0.0) * cap).clamp(0.0, cap);
        // Full: the rate asked for. Half empty or less: the mean that spends the cap, so a
        // steady allocator settles there at the cap. Never above it: a debt paid by a
        // higher mean made samples of very unequal weights (80 MB beside 512 KiB), and the
        // total's error grew past what the sample count promises.
        let spare = (2.0 * self.tokens / cap - 1.0).clamp(0.0, 1.0);
        let needed = bytes_per_second / cap * (1.0 - spare);
        self.draw_rate = (needed.min(u64::MAX as f64 / 4.0) as u64).max(self.rate);
        self.highest_rate = self.highest_rate.max(self.draw_rate);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocs::weight;

    /// Allocates `n` objects of `size` bytes, and returns the estimated objects and the
    /// samples taken.
    fn estimate(p: &mut Points, n: u64, size: u64) -> (f64, u64) {
        let (mut objects, mut samples) = (0.0, 0);
        for _ in 0..n {
            if let Some(take) = p.counted(size) {
                objects += weight(size, take.rate) * take.times as f64;
                samples += 1;
            }
        }
        (objects, samples)
    }

    #[test]
    fn draws_average_the_rate() {
        let mut p = Points::new(4096, 0, 7);
        let n = 20_000;
        let sum: i64 = (0..n).map(|_| p.draw()).sum();
        let mean = sum as f64 / n as f64;
        // The mean of 20,000 exponentials is within 3 % (4 standard deviations) of the rate.
        assert!((mean / 4096.0 - 1.0).abs() < 0.03, "mean {mean}");
    }

    #[test]
    fn rate_one_samples_every_allocation_at_weight_one() {
        let mut p = Points::new(1, 100, 1);
        p.budget(1e12, 1.0);
        assert_eq!(estimate(&mut p, 1000, 40), (1000.0, 1000));
    }

    #[test]
    fn estimates_are_within_the_sampling_error() {
        let mut p = Points::new(32 * 1024, 0, 11);
        let n = 2_000_000;
        let (objects, samples) = estimate(&mut p, n, 40);
        // About 2,441 samples: 4 standard deviations is 8 %.
        let sigma = n as f64 / (samples as f64).sqrt();
        assert!(
            (objects - n as f64).abs() < 4.0 * sigma,
            "{objects} of {n} in {samples}"
        );
    }

    /// Allocates `seconds` of `bytes_per_second` in objects of 40 bytes, with a job (the
    /// budget) every 10 ms.
    fn steady(p: &mut Points, bytes_per_second: f64, seconds: u64) -> (f64, u64) {
        let per_job = (bytes_per_second / 100.0 / 40.0) as u64;
        let (mut objects, mut samples) = (0.0, 0);
        for _ in 0..seconds * 100 {
            p.budget(bytes_per_second, 0.01);
            let (o, s) = estimate(p, per_job, 40);
            (objects, samples) = (objects + o, samples + s);
        }
        (objects, samples)
    }

    #[test]
    fn the_budget_holds_a_steady_allocator_to_the_cap_and_the_weights_follow() {
        let mut p = Points::new(4096, 100, 3);
        // 10 MB a second at most 100 samples a second: 100 KB between samples, once the
        // bucket's second of samples is spent.
        let seconds = 20;
        let (objects, samples) = steady(&mut p, 10e6, seconds);
        let n = 10e6 / 40.0 * seconds as f64;
        assert!(samples <= 100 * (seconds + 1) + 30, "{samples} samples");
        let sigma = n / (samples as f64).sqrt();
        assert!((objects - n).abs() < 4.0 * sigma, "{objects} of {n}");
        assert!(
            (100_000..=250_000).contains(&p.highest_rate()),
            "{}",
            p.highest_rate()
        );
        // It never falls below the rate asked for.
        p.budget(1.0, 10.0);
        p.counted(1 << 40);
        assert_eq!(p.counted(1 << 40).map(|t| t.rate), Some(4096));
    }

    #[test]
    fn a_burst_shorter_than_a_second_keeps_its_samples_under_the_cap() {
        // 8 MB in 20 ms (400 MB a second) right after the start, at 512 KiB: about 15
        // points. Priced at the burst's rate it would have had 2.
        let mut p = Points::new(512 * 1024, 100, 9);
        p.budget(400e6, 0.0001);
        let (_, samples) = estimate(&mut p, 200_000, 40);
        assert!(samples >= 6, "{samples} samples");
        // The bucket is spent by a burst that lasts: a second of it takes about 2 seconds'
        // worth of samples, then the cap's.
        let (_, samples) = steady(&mut p, 400e6, 3);
        assert!(samples <= 100 * 4 + 30, "{samples} samples");
    }

    #[test]
    fn no_cap_keeps_the_rate() {
        let mut p = Points::new(4096, 0, 3);
        p.budget(1e12, 1.0);
        p.counted(1 << 40);
        assert_eq!(p.counted(1 << 40).map(|t| t.rate), Some(4096));
    }

    #[test]
    fn missed_points_are_owed_and_paid_so_the_total_stays() {
        let mut p = Points::new(4096, 0, 5);
        let n = 2_000_000u64;
        // A quarter of the allocations happen with the hook off.
        let (mut objects, _) = estimate(&mut p, n * 3 / 8, 40);
        p.advance((n / 4 * 40) as i64);
        let missed = p.replay_missed();
        assert!(missed > 2000, "{missed}");
        assert_eq!(p.owed() as u64, missed);
        let (rest, samples) = estimate(&mut p, n * 3 / 8, 40);
        objects += rest;
        assert_eq!(p.owed(), 0, "paid within {samples} samples");
        let sigma = n as f64 / (2.0 * samples as f64).sqrt();
        assert!((objects - n as f64).abs() < 4.0 * sigma, "{objects} of {n}");
    }
}
