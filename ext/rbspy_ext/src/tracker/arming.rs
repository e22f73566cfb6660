//! Turning the NEWOBJ hook on only when a sample is near.
//!
//! Any NEWOBJ hook sends every allocation down Ruby's slow path and through its hook call:
//! about 100 ns each here, +51 % on bench/allocs.rb, whatever the hook does. So the hook is
//! on only around a sample point. A timer asks Ruby to run a postponed job on whichever
//! thread holds the GVL; the job reads how many objects were allocated
//! (`GC.stat(:total_allocated_objects)`), turns them into bytes at the rate the hook last
//! saw, and turns the hook on when the next sample point is due within a few hundred µs
//! (more after points were missed). The hook then counts every byte exactly up to the point,
//! samples, and asks for a job that turns it off again when the next point is far. The job
//! sets the timer's period to most of the time it expects the next point to take (from
//! [`MIN_DELAY_US`] to [`MAX_DELAY_US`]), so a point costs a few jobs, each about a µs.
//!
//! Why a timer's signal and not a thread of ours: on a busy machine a thread that sleeps
//! between polls is woken late, by many points, while the Ruby thread it watches runs on
//! (a CI run with one core busy missed 359 points in a second this way). A POSIX timer
//! expires in the kernel and signals the process at once; the signal interrupts the running
//! Ruby thread (or another one of the process, which then only posts the job), so no thread
//! of ours has to be scheduled. The handler only posts the job, which is async-signal-safe
//! on every Ruby that can post from outside a Ruby thread. The signal is a real-time one
//! nobody else handles, installed with `SA_RESTART` so that interrupted system calls go on.
//!
//! A point that passes while the hook is off anyway (a long C call allocating with no
//! interrupt check, where the job cannot run) is owed, and paid by the points after it
//! (sites.rs), so the totals stay unbiased; the notes count them.
//!
//! Which Rubies: `rb_postponed_job_trigger` (3.3+) and `rb_postponed_job_register_one`
//! (3.0 to 3.2) may be called from any thread; 2.7's needs a Ruby thread, so on 2.7 the hook
//! stays on.
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI64, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// A point due within `Arm::ahead_us` turns the hook on: from this long...
const MIN_AHEAD_US: f64 = 200.0;
/// ...to this.
const MAX_AHEAD_US: f64 = 5_000.0;
const MIN_DELAY_US: u64 = 100;
const MAX_DELAY_US: u64 = 20_000;
/// The longest wait is the time a burst of this many bytes a µs (50 MB/s) takes to pass one
/// point at the current mean, from 2 ms to [`MAX_DELAY_US`]: each wake-up costs the process
/// about 30 µs of CPU here (the VM's timer interrupt and the signal), so waking every 2 ms
/// cost 1.5 % by itself, while at the default rate, or under the cap's larger means, a
/// burst missed over 10 ms misses one point or two (paid by the points after it). A small
/// rate, asked for its detail, keeps 2 ms: a 2 ms burst of 100 points at 4 KiB passed
/// unseen between two looks 10 ms apart.
const BURST_BYTES_PER_US: f64 = 50.0;
const SHORTEST_LONGEST_US: u64 = 2_000;
/// The timer aims at this share of the time the next point should take, less the margin.
/// Nearer 1, fewer wake-ups arm the hook (each costs about 30 µs here, see above), but more
/// points are missed when the rate rises, and each miss widens the margin: at 0.95 the hook
/// was on 7 % of the time instead of 2 %, for the same CPU, and misses bill other code.
const AIM: f64 = 0.8;

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
/// The timer (a `timer_t`, which glibc gives as the kernel's small id), -1 when none.
static TIMER: AtomicI64 = AtomicI64::new(-1);
/// The signal the timer sends, once a handler is installed for it (0: none).
static SIGNAL: AtomicI32 = AtomicI32::new(0);
/// Whether a signal posts the job: false once tracking stops, for a signal still pending.
static ACTIVE: AtomicBool = AtomicBool::new(false);
/// The timer's period (0: not set).
static PERIOD_US: AtomicU64 = AtomicU64::new(0);

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

/// The timer's signal: posts the job. Only async-signal-safe calls: an atomic load, and
/// Ruby's posting, which sets a flag and an interrupt.
extern "C" fn on_signal(_signal: libc::c_int, _info: *mut libc::siginfo_t, _context: *mut c_void) {
    // SAFETY: errno of this thread, saved and restored around the handler.
    let errno = unsafe { *libc::__errno_location() };
    if ACTIVE.load(Ordering::Relaxed) {
        super::stats::STATS.wakes.fetch_add(1, Ordering::Relaxed);
        post();
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

/// The highest real-time signal nobody handles, with our handler installed (once: it stays,
/// since a pending real-time signal with no handler would end the process); None when every
/// one is taken.
fn signal() -> Option<libc::c_int> {
    let installed = SIGNAL.load(Ordering::Acquire);
    if installed != 0 {
        return Some(installed);
    }
    for signal in (libc::SIGRTMIN()..=libc::SIGRTMAX()).rev() {
        // SAFETY: queries, then sets, one signal's action with zeroed, then filled, structs.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(signal, std::ptr::null(), &mut old) != 0
                || old.sa_sigaction != libc::SIG_DFL
            {
                continue;
            }
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            if libc::sigaction(signal, &action, std::ptr::null_mut()) == 0 {
                SIGNAL.store(signal, Ordering::Release);
                return Some(signal);
            }
        }
    }
    None
}

/// Wants the next job within `us` (clamped), when a timer runs. The timer is periodic, its
/// period a power of two times [`MIN_DELAY_US`], and set again only when it is longer than
/// `us` or less than a quarter of it: `timer_settime` costs about 10 µs in this machine's VM,
/// more than the job itself, and a job that comes early costs about 1 µs.
pub(super) fn set_delay(us: u64) {
    let us = us.clamp(MIN_DELAY_US, MAX_DELAY_US);
    let timer = TIMER.load(Ordering::Acquire);
    let period = PERIOD_US.load(Ordering::Relaxed);
    if timer < 0 || (period <= us && period * 4 >= us) {
        return;
    }
    // The largest power-of-two multiple of the shortest period within `us`.
    let us = MIN_DELAY_US << (us / MIN_DELAY_US).ilog2();
    PERIOD_US.store(us, Ordering::Relaxed);
    let span = libc::timespec {
        tv_sec: (us / 1_000_000) as libc::time_t,
        tv_nsec: ((us % 1_000_000) * 1000) as libc::c_long,
    };
    let value = libc::itimerspec {
        it_interval: span,
        it_value: span,
    };
    // SAFETY: our timer, a filled itimerspec.
    unsafe { libc::timer_settime(timer as libc::timer_t, 0, &value, std::ptr::null_mut()) };
}

/// Starts the timer (deleting any earlier one first); false when none could be made (no free
/// real-time signal), and the hook must then stay on.
pub(super) fn start_timer() -> bool {
    stop_timer();
    let Some(signal) = signal() else {
        return false;
    };
    // SAFETY: a zeroed sigevent filled for a signal to the process; glibc writes the id.
    let made = unsafe {
        let mut event: libc::sigevent = std::mem::zeroed();
        event.sigev_notify = libc::SIGEV_SIGNAL;
        event.sigev_signo = signal;
        let mut timer: libc::timer_t = std::ptr::null_mut();
        (libc::timer_create(libc::CLOCK_MONOTONIC, &mut event, &mut timer) == 0)
            .then_some(timer as i64)
    };
    let Some(timer) = made else {
        return false;
    };
    TIMER.store(timer, Ordering::Release);
    PERIOD_US.store(0, Ordering::Relaxed);
    ACTIVE.store(true, Ordering::Release);
    // The first job, soon, measures the rate.
    set_delay(MIN_DELAY_US);
    true
}

/// In a forked child: the parent's timer is not inherited, so only our note of it goes.
pub(super) fn forget_timer() {
    ACTIVE.store(false, Ordering::Release);
    TIMER.store(-1, Ordering::Release);
}

/// Stops the timer: after this no job is posted by it (a signal already pending finds
/// `ACTIVE` false), so it is safe before Ruby tears the VM down.
pub(super) fn stop_timer() {
    ACTIVE.store(false, Ordering::Release);
    let timer = TIMER.swap(-1, Ordering::AcqRel);
    if timer >= 0 {
        // SAFETY: our timer, deleted once (the swap took it).
        unsafe { libc::timer_delete(timer as libc::timer_t) };
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
    /// and shrinks while none is, so it follows how late this machine runs the job.
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

    /// The job, first: `total` objects were allocated so far. Returns the bytes allocated
    /// since the last job while the hook was off (at the bytes an allocation took while it
    /// last watched), which bring the next point nearer (past it when points were missed).
    pub fn observe(&mut self, total: u64) -> i64 {
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
        match self.on {
            true => 0,
            false => (allocated as f64 * self.bytes_per_allocation) as i64,
        }
    }

    /// Bytes the process allocates a second, lately (for the budget).
    pub fn bytes_per_second(&self) -> f64 {
        self.per_us * self.bytes_per_allocation * 1e6
    }

    /// The job, then: `missed` points passed while the hook was off (they are owed to the
    /// next allocation); points are drawn at a mean of `mean` bytes. Returns whether to turn
    /// the hook on (Some(true)) or off.
    pub fn decide(&mut self, until_sample: i64, missed: u64, mean: u64) -> Option<bool> {
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
        let longest =
            ((mean as f64 / BURST_BYTES_PER_US) as u64).clamp(SHORTEST_LONGEST_US, MAX_DELAY_US);
        let delay = if self.on {
            longest
        } else {
            ((until_sample as f64 / bytes_per_us - self.ahead_us) * AIM) as u64
        };
        set_delay(delay.min(longest));
        change
    }
}
