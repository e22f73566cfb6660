//! Turning the NEWOBJ hook on only when a sample is near.
//!
//! Any NEWOBJ hook sends every allocation down Ruby's slow path and through its hook call:
//! about 100 ns each here, +51 % on bench/allocs.rb, whatever the hook does. So the hook is
//! on only around a sample point. A timer asks Ruby to run a postponed job on whichever
//! thread holds the GVL; the job reads how many objects were allocated
//! (`GC.stat(:total_allocated_objects)`) and asks `rbspy_ext_core::allocs::arm` (Ruby-free,
//! tested with a simulated allocator) whether the next sample point is due within a few
//! hundred µs (more after points were missed), when the hook goes on. The hook then counts
//! every byte exactly up to the point, samples, and asks for a job that turns it off again
//! when the next point is far. The job sets the timer to tick once, at most of the time it
//! expects the next point to take, so a point costs a few wake-ups.
//!
//! Where the bindings know where the objspace counts allocations (every Ruby from 3.0, see
//! `read_counters` in mod.rs), the signal handler reads that count itself, with the GC's
//! flags, and posts the job only when it has work (`rbspy_ext_core::allocs::gate`): about 2
//! jobs a sample instead of one a wake-up, each a Ruby interrupt and a `GC.stat` with the
//! GVL. The other wake-ups only set the timer again.
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
use rbspy_ext_core::allocs::arm::{delay_for, MIN_DELAY_US, SHORTEST_LONGEST_US};
use rbspy_ext_core::allocs::gate::{Gate, Tick};
use rbspy_ext_core::census::AllocatedCounters;
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI64, AtomicU32, AtomicU64, AtomicUsize};
use std::sync::OnceLock;
use std::time::Instant;

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
/// Ticks that came while no tracking was active: `time_wakeup`'s.
static IDLE_TICKS: AtomicU64 = AtomicU64::new(0);

/// µs on a monotonic clock, from the first call: the time `rbspy_ext_core::allocs::arm`
/// reckons in.
pub(super) fn now_us() -> u64 {
    now_us_f() as u64
}

/// As `now_us`, with its fraction (a handler takes a few µs).
fn now_us_f() -> f64 {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    ORIGIN.get_or_init(Instant::now).elapsed().as_nanos() as f64 / 1000.0
}

pub(super) fn symbol(name: &std::ffi::CStr) -> *mut c_void {
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

/// Where this process counts its allocations (`rbspy_ext_core::census::AllocatedCounters`):
/// the first `COUNTERS_LEN` addresses; none where they are not read (not found, or not yet
/// looked for).
static COUNTERS: [AtomicU64; 16] = [const { AtomicU64::new(0) }; 16];
static COUNTERS_LEN: AtomicUsize = AtomicUsize::new(0);
/// Between the handler and the job: whether a tick has work for the job (see `Gate`).
pub(super) static GATE: Gate = Gate::new();

/// The objspace's GC flags (a 32-bit word) and the bit set while a GC runs.
static GC_FLAGS: AtomicU64 = AtomicU64::new(0);
static DURING_GC: AtomicU32 = AtomicU32::new(0);

/// Keeps the words to read the count from (with the GVL); none: the count is not read.
pub(super) fn set_counters(counters: Option<&AllocatedCounters>) {
    COUNTERS_LEN.store(0, Ordering::Release);
    let Some(c) = counters else { return };
    let n = c.addresses.len().min(COUNTERS.len());
    for (slot, &at) in COUNTERS.iter().zip(&c.addresses[..n]) {
        slot.store(at, Ordering::Relaxed);
    }
    GC_FLAGS.store(c.gc_flags, Ordering::Relaxed);
    DURING_GC.store(1 << c.during_gc_bit, Ordering::Relaxed);
    COUNTERS_LEN.store(n, Ordering::Release);
}

/// Ticks that found a GC running (the count read), and that posted no job.
pub(super) static GC_TICKS: AtomicU64 = AtomicU64::new(0);
pub(super) static QUIET_TICKS: AtomicU64 = AtomicU64::new(0);

/// Whether a GC runs now (where the count is read).
fn in_gc() -> bool {
    // SAFETY: the flags word of the objspace whose counters `set_counters` kept.
    let flags = unsafe { std::ptr::read_volatile(GC_FLAGS.load(Ordering::Relaxed) as *const u32) };
    let running = flags & DURING_GC.load(Ordering::Relaxed) != 0;
    if running {
        GC_TICKS.fetch_add(1, Ordering::Relaxed);
    }
    running
}

/// The process's count of allocations, read from its objspace (None where not known). No
/// call into Ruby, so a signal handler may call it.
pub(super) fn read_count() -> Option<u64> {
    let n = COUNTERS_LEN.load(Ordering::Acquire);
    (n > 0).then(|| {
        COUNTERS[..n].iter().fold(0u64, |sum, at| {
            // SAFETY: words of this process's objspace, which lives as long as the VM;
            // `set_counters` checked their sum against `GC.stat`. A torn read is impossible
            // for an aligned word on x86-64, and a stale one only delays a tick.
            let word = unsafe { std::ptr::read_volatile(at.load(Ordering::Relaxed) as *const u64) };
            sum.wrapping_add(word)
        })
    })
}

/// The timer's signal: reads the count of allocations where it can, and posts the job only
/// when the job has work (`Gate`), else sets the timer for the next look; elsewhere posts
/// the job at every tick. Only async-signal-safe calls: atomics, word reads of the
/// objspace, the monotonic clock, `timer_settime`, and Ruby's posting, which sets a flag
/// and an interrupt.
extern "C" fn on_signal(_signal: libc::c_int, _info: *mut libc::siginfo_t, _context: *mut c_void) {
    // SAFETY: errno of this thread, saved and restored around the handler.
    let errno = unsafe { *libc::__errno_location() };
    if ACTIVE.load(Ordering::Relaxed) {
        let stats = &super::stats::STATS;
        stats.wakes.fetch_add(1, Ordering::Relaxed);
        // `now_us` was first called before the timer started: only a clock read here.
        let at = now_us_f();
        match read_count().map(|count| GATE.tick(count, at as u64, in_gc())) {
            Some(Tick::Wait(us)) => {
                QUIET_TICKS.fetch_add(1, Ordering::Relaxed);
                set_delay(us)
            }
            Some(Tick::Post) | None => {
                post();
                // The job sets the next tick; this one comes only if the job is late (a
                // long C call with no interrupt check), to post it again.
                set_delay(GATE.longest_us().max(SHORTEST_LONGEST_US));
            }
        }
        // Timed for the budget: `timer_settime` alone took 10 µs on some days in this VM.
        let ns = ((now_us_f() - at) * 1000.0) as u64;
        stats.handler_ns.fetch_add(ns, Ordering::Relaxed);
    } else {
        IDLE_TICKS.fetch_add(1, Ordering::Relaxed);
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

/// What a wake-up costs, for the CPU budget (`rbspy_ext_core::allocs::budget`), once
/// `start_timer` has timed it; 0 before.
static SIGNAL_NS: OnceLock<f64> = OnceLock::new();

pub(super) fn signal_ns() -> f64 {
    SIGNAL_NS.get().copied().unwrap_or(0.0)
}

/// Times what a tick of `timer` costs the process, once per process, before the timer is
/// started (the handler, inactive, only counts it): the fastest of 4 rounds of 16 ticks set
/// 1 µs ahead, each waited for, so that a preemption does not count. A round trip is
/// `timer_settime`, the clock's interrupt, the kernel's delivery of the signal and its
/// return, less the µs waited: 23 to 24 µs in this project's VM, against 25 to 95 µs of
/// process CPU a tick costs a Rack-like workload there (the caches' share: the budget
/// prices a wake-up at `WAKE_PER_ROUND_TRIP` round trips). A synchronous
/// `raise`, timed before, took 1 µs: it has no interrupt, and the budget priced a tick at a
/// tenth of its cost. 0 (ticks unpriced) when a tick did not come within 5 ms.
fn time_wakeup(timer: libc::timer_t) {
    SIGNAL_NS.get_or_init(|| {
        let mut fastest = f64::MAX;
        for _ in 0..4 {
            let at = Instant::now();
            for _ in 0..16 {
                let before = IDLE_TICKS.load(Ordering::Acquire);
                arm_once(timer, 1);
                let waited = Instant::now();
                while IDLE_TICKS.load(Ordering::Acquire) == before {
                    if waited.elapsed().as_micros() > 5_000 {
                        arm_once(timer, 0);
                        return 0.0;
                    }
                    std::hint::spin_loop();
                }
            }
            fastest = fastest.min(at.elapsed().as_nanos() as f64 / 16.0 - 1_000.0);
        }
        fastest.max(0.0)
    });
}

/// Sets `timer` to tick once in `us` (0: disarms it).
fn arm_once(timer: libc::timer_t, us: u64) {
    let value = libc::itimerspec {
        it_interval: libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        },
        it_value: libc::timespec {
            tv_sec: (us / 1_000_000) as libc::time_t,
            tv_nsec: ((us % 1_000_000) * 1000) as libc::c_long,
        },
    };
    // SAFETY: our timer, a filled itimerspec.
    unsafe { libc::timer_settime(timer, 0, &value, std::ptr::null_mut()) };
}

/// Wants the next job within `us`: the timer ticks once then (`delay_for`).
pub(super) fn set_delay(us: u64) {
    let timer = TIMER.load(Ordering::Acquire);
    if timer < 0 {
        return;
    }
    super::stats::STATS
        .timer_sets
        .fetch_add(1, Ordering::Relaxed);
    arm_once(timer as libc::timer_t, delay_for(us));
}

/// Starts the timer (deleting any earlier one first); false when none could be made (no free
/// real-time signal), and the hook must then stay on.
pub(super) fn start_timer() -> bool {
    stop_timer();
    // The clock's origin is set here, not first in the handler (a OnceLock's first call
    // from a signal could wait on itself).
    now_us();
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
    // Timed now, while the handler is inactive (`ACTIVE` is false since `stop_timer`).
    time_wakeup(timer as libc::timer_t);
    TIMER.store(timer, Ordering::Release);
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
