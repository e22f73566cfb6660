//! Keeping the allocation tracker's NEWOBJ hook on while a JIT compiles: a part of
//! [`super::arm`]'s decisions, apart because it concerns one JIT (ZJIT, Ruby 4.1). The
//! job tells it what the JIT compiled ([`Hold::compiled`]) and when it arms the hook
//! ([`Hold::arming`]); [`Hold::holding`] keeps the hook from going off.

/// A hold ([`Hold`]) lasts until the JIT has compiled nothing for this long: a method needs
/// 30 calls after it was thrown away before ZJIT compiles it again (its call threshold), so
/// one called 300 times a second is compiled again within the hold.
pub const HOLD_QUIET_US: u64 = 100_000;
/// Holds may take this share of the time, and this long at once: the hook sends every
/// allocation down Ruby's slow path while it is on (about 30 % of a Rack app's CPU), so a
/// JIT that never stops compiling holds it 2 s, then 1 part in 20 of the time. A JIT that
/// compiles a method now and then gets a hold each time (a bucket of time, not a spacing
/// between holds: spaced 19 times a hold's length, the holds a newly hot method needed were
/// refused, and it left compiled code 12,000 times a second as before).
pub const MAX_HOLD_US: u64 = 2_000_000;
/// See [`MAX_HOLD_US`].
pub const HOLD_SHARE: f64 = 0.05;

/// Keeping the hook on while a JIT compiles, so that what it compiles is never thrown away.
///
/// ZJIT (Ruby 4.1) compiles an allocation as an inline fast path that skips Ruby's
/// allocator, and so the NEWOBJ hook. It may do so only while no NEWOBJ hook is on: turning
/// one on throws away every method compiled that way (`rb_zjit_invalidate_newobj_hook`). A
/// thrown-away method is compiled again after 30 more calls, at most 4 times; after that,
/// each of its allocations leaves compiled code (a side exit) for good. Arming the hook 25
/// times a second did that to a Rack app's per-request methods within a second: 17,000
/// side exits a second, and +3.8 to +5.4 % of CPU.
///
/// What ZJIT compiles while a NEWOBJ hook is on calls Ruby's allocator instead, which sees
/// the hook, and is never thrown away. So when the JIT compiled code while the hook was off
/// (the count of compiled methods the job reads grew), the next arming holds the hook on
/// until the JIT has compiled nothing for [`HOLD_QUIET_US`]: the methods it threw away are
/// compiled again meanwhile, and later armings throw nothing away. At the start the hook is
/// on, and what was compiled before is thrown away, so tracking starts with a hold. What a
/// hold costs is the slow path for every allocation while it lasts, mostly at the start
/// (under 200 ms in the Rack app of bench/alloc_cost.rb); the methods compiled under it call
/// Ruby's allocator instead of the inline path for good.
///
/// Without a hold, only methods called often enough to be compiled again within the short
/// time the hook is on (30 calls in some 200 µs to 5 ms) were spared: a Rack app's
/// per-request methods were not (17,000 side exits a second).
#[derive(Debug, Clone)]
pub struct Hold {
    /// The JIT's count of compiled methods at the last job (None: no such JIT).
    compiled: Option<u64>,
    /// The JIT compiled while the hook was off: the next arming throws that code away.
    fresh: bool,
    /// A hold started at `started_us` and lasts until `until_us`.
    open: bool,
    started_us: u64,
    until_us: u64,
    /// The µs of holding left ([`HOLD_SHARE`]), as of `at_us` (None: not started).
    left_us: f64,
    at_us: Option<u64>,
    /// Holds begun, and the µs those that ended lasted (for the stats).
    pub holds: u64,
    pub held_us: u64,
}

impl Hold {
    /// Whether the hook is held on at `now_us`.
    pub fn holding(&mut self, now_us: u64) -> bool {
        let at = *self.at_us.get_or_insert(now_us);
        let since = now_us.saturating_sub(at) as f64;
        self.at_us = Some(now_us);
        self.left_us += since * HOLD_SHARE;
        if self.open {
            self.left_us -= since;
        }
        self.left_us = self.left_us.min(MAX_HOLD_US as f64);
        if self.open && (self.until_us <= now_us || self.left_us <= 0.0) {
            self.open = false;
            self.held_us += self.until_us.min(now_us) - self.started_us;
        }
        self.open
    }

    /// The job: the JIT has compiled `count` methods so far, the hook being `on` since the
    /// last job, at `now_us`.
    pub fn compiled(&mut self, count: u64, on: bool, now_us: u64) {
        // At the first look, what was compiled before tracking started was thrown away when
        // the hook went on.
        let grew = self.compiled.map_or(count > 0, |before| count > before);
        self.compiled = Some(count);
        match (grew, on) {
            (false, _) => {}
            (true, true) => self.extend(now_us),
            (true, false) => self.fresh = true,
        }
    }

    /// The job turns the hook on at `now_us`: a hold begins if the JIT compiled while it was
    /// off.
    pub fn arming(&mut self, now_us: u64) {
        if std::mem::take(&mut self.fresh) {
            self.extend(now_us);
        }
    }

    /// Holds the hook on from `now_us`, or longer: until the JIT is quiet, while holding
    /// time is left.
    fn extend(&mut self, now_us: u64) {
        if !self.holding(now_us) {
            if self.left_us < HOLD_QUIET_US as f64 {
                return;
            }
            self.open = true;
            self.started_us = now_us;
            self.holds += 1;
        }
        self.until_us = now_us + HOLD_QUIET_US;
    }
}

impl Default for Hold {
    fn default() -> Self {
        Hold {
            compiled: None,
            fresh: false,
            open: false,
            started_us: 0,
            until_us: 0,
            left_us: MAX_HOLD_US as f64,
            at_us: None,
            holds: 0,
            held_us: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::arm::Arm;
    use super::*;

    /// The job at `t` µs of a process allocating an object a µs, the next point `until`
    /// bytes away, the JIT having compiled `compiled` methods: what it turns the hook to.
    fn job(arm: &mut Arm, t: u64, until: i64, compiled: Option<u64>) -> Option<bool> {
        arm.observe(t, t);
        arm.compiled(compiled);
        arm.decide(until, 0, 512 * 1024).0
    }

    const FAR: i64 = 1 << 40;

    #[test]
    fn code_compiled_while_the_hook_was_off_holds_the_next_arming_until_the_jit_is_quiet() {
        let mut arm = Arm::new(false, 0, 0);
        // Nothing compiled yet: the start's hook goes off at the first job.
        assert_eq!(job(&mut arm, 1_000, FAR, Some(0)), Some(false));
        // Compiled with the hook off: nothing happens until a point is near.
        assert_eq!(job(&mut arm, 2_000, FAR, Some(5)), None);
        assert_eq!(job(&mut arm, 3_000, 0, Some(5)), Some(true));
        // The point was taken; the hook would go off, but the hold keeps it on...
        arm.far(FAR);
        assert_eq!(job(&mut arm, 4_000, FAR, Some(5)), None);
        // ...and the JIT compiling again (under the hook) keeps it on longer.
        assert_eq!(job(&mut arm, 50_000, FAR, Some(9)), None);
        assert_eq!(job(&mut arm, 149_000, FAR, Some(9)), None);
        assert_eq!(job(&mut arm, 151_000, FAR, Some(9)), Some(false));
        assert_eq!((arm.hold.holds, arm.hold.held_us), (1, 147_000));
        // Later armings, with nothing compiled meanwhile, hold nothing.
        assert_eq!(job(&mut arm, 160_000, 0, Some(9)), Some(true));
        arm.far(FAR);
        assert_eq!(job(&mut arm, 161_000, FAR, Some(9)), Some(false));
        assert_eq!(arm.hold.holds, 1);
    }

    #[test]
    fn code_compiled_before_tracking_started_holds_the_first_arming() {
        // The hook starts on, which threw away what the JIT had compiled.
        let mut arm = Arm::new(false, 0, 0);
        assert_eq!(job(&mut arm, 1_000, FAR, Some(40)), None);
        assert_eq!(job(&mut arm, 100_000, FAR, Some(40)), None);
        assert_eq!(job(&mut arm, 101_500, FAR, Some(40)), Some(false));
        assert_eq!(arm.hold.holds, 1);
    }

    #[test]
    fn without_such_a_jit_nothing_holds() {
        let (mut with, mut without) = (Arm::new(false, 0, 0), Arm::new(false, 0, 0));
        for (t, until) in [
            (1_000, FAR),
            (2_000, 0),
            (3_000, FAR),
            (4_000, 0),
            (9_000, FAR),
        ] {
            with.far(until);
            without.far(until);
            let a = job(&mut with, t, until, Some(0));
            assert_eq!(a, job(&mut without, t, until, None), "at {t}");
        }
        assert_eq!(with.hold.holds + without.hold.holds, 0);
    }

    #[test]
    fn a_jit_that_never_stops_compiling_holds_the_hook_a_twentieth_of_the_time() {
        // A job every ms for a minute, a point near every 40 ms, a new method compiled at
        // every job.
        let mut arm = Arm::new(false, 0, 0);
        let mut on_us = 0;
        for t in (1_000..=60_000_000).step_by(1_000) {
            let until = if t % 40_000 == 0 { 0 } else { FAR };
            arm.far(until);
            job(&mut arm, t, until, Some(t / 1_000));
            on_us += if arm.is_on() { 1_000 } else { 0 };
        }
        let held = arm.hold.held_us;
        // The longest hold first, then one in 20 of the time at most.
        let share = (60_000_000.0 * HOLD_SHARE) as u64;
        assert!(held <= MAX_HOLD_US + share, "{held}");
        assert!(held >= share / 2, "{held}");
        assert!(on_us <= held + 60_000_000 / 10, "{on_us} {held}");
    }
}
