//! Turning the NEWOBJ hook on only when a sample is near.
//!
//! Any NEWOBJ hook sends every allocation down Ruby's slow path and through its hook call:
//! about 100 ns each here, +51 % on bench/allocs.rb, whatever the hook does. So the hook is
//! on only around a sample point. A native thread of ours (the poller) wakes, and asks Ruby
//! to run a postponed job on whichever thread holds the GVL; the job reads how many objects
//! were allocated (`GC.stat(:total_allocated_objects)`), turns them into bytes at the rate
//! the hook last saw, and turns the hook on when the next sample point is due within a few
//! hundred µs (more where the poller wakes late). The hook then counts every byte exactly
//! up to the point, samples, and asks for a job that turns it off again when the next point
//! is far. The poller sleeps most of the time the job expects the next point to take (from
//! [`MIN_DELAY_US`] to [`MAX_DELAY_US`]), so a point costs a few jobs, each a few µs.
//!
//! A point that passes while the hook is off (a burst faster than the poller) is owed, and
//! paid by the points after it (sites.rs), so the totals stay unbiased and no one line is
//! billed for the burst; the notes count them.
//!
//! Which Rubies: the job is posted from a thread Ruby does not know, which
//! `rb_postponed_job_trigger` (3.3+) and `rb_postponed_job_register_one` (3.0 to 3.2) allow;
//! 2.7's needs a Ruby thread, so on 2.7 the hook stays on.
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A point due within `Arm::ahead_us` turns the hook on: from this long...
const MIN_AHEAD_US: f64 = 200.0;
/// ...to this.
const MAX_AHEAD_US: f64 = 5_000.0;
const MIN_DELAY_US: u64 = 100;
const MAX_DELAY_US: u64 = 10_000;

type Job = unsafe extern "C" fn(*mut c_void);
type Preregister = unsafe extern "C" fn(u32, Job, *mut c_void) -> u32;
type Trigger = unsafe extern "C" fn(u32);
type RegisterOne = unsafe extern "C" fn(u32, Job, *mut c_void) -> i32;

/// How this Ruby runs a job posted from any thread.
#[derive(Clone, Copy)]
enum Post {
    /// 3.3+: a job registered once, triggered by its handle.
    Handle(Trigger, u32),
    /// 3.0 to 3.2.
    RegisterOne(RegisterOne, Job),
}

static POST: OnceLock<Option<Post>> = OnceLock::new();
/// Bumped to stop the poller; a poller runs while its generation is current.
static GENERATION: AtomicU64 = AtomicU64::new(0);
static DELAY_US: AtomicU64 = AtomicU64::new(MAX_DELAY_US);
static POLLER: Mutex<Option<JoinHandle<()>>> = Mutex::new(None);
/// The poller's thread, to wake it when its sleep should end sooner.
static POLLER_THREAD: Mutex<Option<std::thread::Thread>> = Mutex::new(None);
/// Set with a shorter delay: the poller, woken, sleeps again for the new one.
static RESCHEDULED: AtomicBool = AtomicBool::new(false);

fn symbol(name: &std::ffi::CStr) -> *mut c_void {
    // SAFETY: dlsym on the global namespace with a NUL-terminated name.
    unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) }
}

/// Finds how to post `job` (once, with the GVL); None where the hook must stay on (2.7).
pub(super) fn prepare(job: Job) -> bool {
    POST.get_or_init(|| {
        let preregister = symbol(c"rb_postponed_job_preregister");
        let trigger = symbol(c"rb_postponed_job_trigger");
        if !preregister.is_null() && !trigger.is_null() {
            // SAFETY: Ruby 3.3+'s own functions, with their declared signatures; called with
            // the GVL.
            unsafe {
                let preregister = std::mem::transmute::<*mut c_void, Preregister>(preregister);
                let handle = preregister(0, job, std::ptr::null_mut());
                if handle == u32::MAX {
                    return None;
                }
                let trigger = std::mem::transmute::<*mut c_void, Trigger>(trigger);
                return Some(Post::Handle(trigger, handle));
            }
        }
        let register_one = symbol(c"rb_postponed_job_register_one");
        if cfg!(ruby_gte_3_0) && !register_one.is_null() {
            // SAFETY: as above, Ruby 3.0 to 3.2's.
            let register_one =
                unsafe { std::mem::transmute::<*mut c_void, RegisterOne>(register_one) };
            return Some(Post::RegisterOne(register_one, job));
        }
        None
    })
    .is_some()
}

/// Asks Ruby to run the job soon on the thread holding the GVL. From any thread, inside a
/// hook too: both functions only set a flag and an interrupt.
pub(super) fn post() {
    match POST.get().copied().flatten() {
        // SAFETY: see `prepare`.
        Some(Post::Handle(trigger, handle)) => unsafe { trigger(handle) },
        Some(Post::RegisterOne(register_one, job)) => unsafe {
            register_one(0, job, std::ptr::null_mut());
        },
        None => {}
    }
}

/// How long the poller sleeps from now (it is woken if asleep for longer).
pub(super) fn set_delay(us: u64) {
    let us = us.clamp(MIN_DELAY_US, MAX_DELAY_US);
    let before = DELAY_US.swap(us, Ordering::Relaxed);
    if us < before {
        if let Some(thread) = POLLER_THREAD
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            RESCHEDULED.store(true, Ordering::SeqCst);
            thread.unpark();
        }
    }
}

/// Starts a poller (stopping any earlier one first).
pub(super) fn start_poller() {
    stop_poller();
    // The first job, soon, measures the rate.
    set_delay(MIN_DELAY_US);
    let generation = GENERATION.load(Ordering::SeqCst);
    let thread = std::thread::Builder::new()
        .name("rbspy-allocs".into())
        .spawn(move || loop {
            // Parked, not asleep: `stop_poller` wakes it at once.
            std::thread::park_timeout(Duration::from_micros(DELAY_US.load(Ordering::Relaxed)));
            if GENERATION.load(Ordering::SeqCst) != generation {
                return;
            }
            if !RESCHEDULED.swap(false, Ordering::SeqCst) {
                super::stats::STATS.wakes.fetch_add(1, Ordering::Relaxed);
                post();
            }
        });
    if let Ok(thread) = thread {
        *POLLER_THREAD.lock().unwrap_or_else(|p| p.into_inner()) = Some(thread.thread().clone());
        *POLLER.lock().unwrap_or_else(|p| p.into_inner()) = Some(thread);
    }
}

/// In a forked child: the poller thread was not copied, so its handle is dropped unjoined.
pub(super) fn forget_poller() {
    GENERATION.fetch_add(1, Ordering::SeqCst);
    POLLER_THREAD
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
    if let Some(thread) = POLLER.lock().unwrap_or_else(|p| p.into_inner()).take() {
        std::mem::forget(thread);
    }
}

/// Stops the poller and waits for it: after this no job is posted, so it is safe before
/// Ruby tears the VM down.
pub(super) fn stop_poller() {
    GENERATION.fetch_add(1, Ordering::SeqCst);
    let thread = POLLER.lock().unwrap_or_else(|p| p.into_inner()).take();
    if let Some(thread) = thread {
        thread.thread().unpark();
        let _ = thread.join();
    }
}

/// What the postponed job knows of the allocation rate, and whether the hook is on.
pub(super) struct Arm {
    /// The hook stays on: 2.7, or rate 1.
    always: bool,
    on: bool,
    /// The hook found the next point far: the job turns it off.
    off_wanted: bool,
    /// A point due within this long turns the hook on: it grows after a point was missed,
    /// and shrinks while none is, so it follows how late this machine wakes the poller.
    ahead_us: f64,
    /// A point within this many bytes turns the hook on, and keeps it on.
    within: i64,
    /// Allocations (of every type) and counted bytes the hook saw since the last job.
    pub seen: u64,
    pub seen_bytes: u64,
    bytes_per_allocation: f64,
    /// Objects allocated per µs, lately.
    per_us: f64,
    /// `total_allocated_objects` at the last job.
    total: u64,
    at: Instant,
    /// Points that passed while the hook was off.
    pub missed: u64,
}

impl Arm {
    /// The hook starts on (`start` turns it on): until the first job has measured how fast
    /// the process allocates, nothing can say when to arm it, and a burst right after
    /// tracking starts would pass unsampled. The first point then turns it off.
    pub fn new(always: bool, total: u64) -> Self {
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
            per_us: 0.0,
            total,
            at: Instant::now(),
            missed: 0,
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

    /// The job, first: `total` objects were allocated so far. While the hook was off, the
    /// bytes since the last job (at the rate the hook last saw) bring `until_sample` nearer
    /// (past 0 when points were missed).
    pub fn observe(&mut self, total: u64, until_sample: &mut i64) {
        let now = Instant::now();
        let us = now.duration_since(self.at).as_secs_f64() * 1e6;
        self.at = now;
        let allocated = total.saturating_sub(self.total);
        self.total = total;
        if us > 0.0 {
            // Rises at once, falls slowly: a burst is met by arming early.
            let rate = allocated as f64 / us;
            self.per_us = rate.max(self.per_us * 0.75 + rate * 0.25);
        }
        if self.seen >= 64 {
            let seen = self.seen_bytes as f64 / self.seen as f64;
            self.bytes_per_allocation = self.bytes_per_allocation * 0.5 + seen * 0.5;
        }
        (self.seen, self.seen_bytes) = (0, 0);
        if !self.on {
            *until_sample -= (allocated as f64 * self.bytes_per_allocation) as i64;
        }
    }

    /// The job, then: `missed` points passed while the hook was off (they are owed to the
    /// next allocation). Returns whether to turn the hook on (Some(true)) or off.
    pub fn decide(&mut self, until_sample: i64, missed: u64) -> Option<bool> {
        if missed > 0 {
            self.missed += missed;
            self.ahead_us = (self.ahead_us * 1.5).min(MAX_AHEAD_US);
        }
        let bytes_per_us = (self.per_us * self.bytes_per_allocation).max(1e-3);
        self.within = (bytes_per_us * self.ahead_us) as i64;
        let change = if self.always {
            None
        } else if !self.on && (missed > 0 || until_sample <= self.within) {
            Some(true)
        } else if self.on && self.off_wanted && until_sample > self.within {
            // A point taken in time: the margin may shrink.
            self.ahead_us = (self.ahead_us * 0.95).max(MIN_AHEAD_US);
            Some(false)
        } else {
            None
        };
        self.off_wanted = false;
        if let Some(on) = change {
            self.on = on;
        }
        let delay = if self.on {
            MAX_DELAY_US
        } else {
            ((until_sample as f64 / bytes_per_us - self.ahead_us) * 0.8) as u64
        };
        // A shorter delay wakes the poller (it may be asleep for the old one): waking it
        // costs a context switch, but sleeping on would miss the point.
        set_delay(delay);
        change
    }
}
