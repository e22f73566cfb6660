//! The allocation tracker of `RubySpy::NativeAllocations` (allocs.rs). The NEWOBJ hook
//! counts slot bytes towards the next sample point; a sampled object's stack
//! (`rb_profile_frames`), class and type make its site, and the object joins the live set
//! (live.rs) until a marking finds it unmarked. What the samples mean, and how they are
//! scaled, is `rbspy_ext_core::allocs`; naming the frames and classes is allocs.rs.
//!
//! The hook is on only near a sample point (arming.rs): any NEWOBJ hook costs Ruby about
//! 100 ns on every allocation. Which samples are alive (live.rs): when sampling, a weak map
//! filled by the job, with no GC hook on (before 3.3 any GC hook sends every allocation down
//! Ruby's slow path, +16 % on bench/allocs.rb); at rate 1 and at rates of 16 KiB or less,
//! where the NEWOBJ hook is on anyway, the GC_END_MARK hook reads the mark bits once per GC.
//!
//! What a hook may do: Ruby calls them inside the allocator and the GC, where it forbids any
//! Ruby API that allocates, raises or runs Ruby code. These hooks read the object's header
//! words, call `rb_profile_frames` (which only reads the control frames) and work on Rust
//! data: the frames and classes they keep are plain VALUEs, marked (and so pinned) by a
//! hidden root object, and turned into names only when a snapshot is asked for, with the GVL
//! and outside any hook. Turning hooks on and off is left to the postponed job. `GC.compact`
//! moves objects, so the root's compaction callback re-keys the live set (`rb_gc_location`).
//!
//! Bounds: at most [`MAX_SITES`] sites and [`MAX_LIVE`] live samples; past them samples are
//! counted in the notes, not kept. Only the Ractor that starts tracking is tracked before
//! Ruby 4.0 (hooks are per Ractor there); from 4.0 internal hooks fire in every Ractor.
mod arming;
pub(crate) mod debug;
mod live;
mod publish;
mod sites;
mod stats;
mod weak;
mod zjit;

pub(crate) use publish::{published_at_ms, set_publisher, store};
use rb_sys::VALUE;
use rbspy_ext_core::allocs::arm::{longest_wait_us, Arm, STEADY_RATE_BYTES};
use rbspy_ext_core::allocs::budget::Budget;
use rbspy_ext_core::allocs::marks::MarkBits;
use rbspy_ext_core::allocs::SiteCounts;
use rbspy_ext_core::census::AllocatedCounters;
use rbspy_ext_core::memory::Memory;
use rbspy_ext_core::sync::locked;
use sites::Tracker;
pub use sites::{MAX_LIVE, MAX_SITES};
use stats::{HOOK_TIMED_EVERY, STATS};
use std::ffi::c_void;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

const NEWOBJ: u32 = 0x0010_0000;
const GC_END_MARK: u32 = 0x0080_0000;

static TRACKER: Mutex<Option<Tracker>> = Mutex::new(None);
/// The two tracepoints (NEWOBJ, GC_END_MARK), once made (kept alive by registered addresses).
static TRACEPOINTS: Mutex<Option<(usize, usize)>> = Mutex::new(None);

fn tracker() -> MutexGuard<'static, Option<Tracker>> {
    locked(&TRACKER)
}

/// The NEWOBJ hook: inside the allocator (see the module docs).
unsafe extern "C" fn on_newobj(tracepoint: VALUE, _data: *mut c_void) {
    if publish::QUIET.load(Relaxed) {
        return;
    }
    let call = STATS.hook_calls.fetch_add(1, Relaxed);
    let timed = call.is_multiple_of(HOOK_TIMED_EVERY).then(Instant::now);
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: called by Ruby with our NEWOBJ tracepoint, inside its hook.
        let object =
            unsafe { debug::rb_tracearg_object(debug::rb_tracearg_from_tracepoint(tracepoint)) };
        // Never blocks: every hook, mark and compaction runs with the GVL (from 4.0, under
        // the VM lock in any Ractor), and nothing holding the lock allocates.
        let Ok(mut guard) = TRACKER.try_lock() else {
            return;
        };
        let Some(t) = guard.as_mut().filter(|t| t.running) else {
            return;
        };
        if t.allocated(object) {
            arming::post();
        }
    });
    if let Some(at) = timed {
        let ns = at.elapsed().as_nanos() as u64 * HOOK_TIMED_EVERY;
        STATS.hook_ns.fetch_add(ns, Relaxed);
    }
}

/// The GC_END_MARK hook: inside the GC, between marking and sweeping.
unsafe extern "C" fn on_end_mark(_tracepoint: VALUE, _data: *mut c_void) {
    let at = Instant::now();
    let _ = std::panic::catch_unwind(|| {
        let Ok(mut guard) = TRACKER.try_lock() else {
            return;
        };
        if let Some(t) = guard.as_mut().filter(|t| t.running) {
            t.marked();
        }
    });
    STATS.marks.fetch_add(1, Relaxed);
    STATS
        .mark_ns
        .fetch_add(at.elapsed().as_nanos() as u64, Relaxed);
}

/// Work a native thread (the listener's) hands the postponed job.
type Task = Box<dyn FnOnce() + Send>;
static TASK: Mutex<Option<Task>> = Mutex::new(None);

/// Makes the postponed job known to Ruby (with the GVL, when the extension loads); false
/// where it cannot be posted from a native thread (Ruby 2.7).
pub(crate) fn prepare() -> bool {
    arming::prepare(poll)
}

/// Runs `f` with the GVL on a Ruby thread (in the postponed job) and waits up to `timeout`
/// for its value; None where no job can be posted (2.7), while another task waits, or when
/// no Ruby thread got to it in time (a C call holding the GVL).
pub(crate) fn with_gvl<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
    timeout: Duration,
) -> Option<T> {
    if !prepare() {
        return None;
    }
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    {
        let mut slot = locked(&TASK);
        if slot.is_some() {
            return None;
        }
        *slot = Some(Box::new(move || {
            let _ = tx.send(f());
        }));
    }
    arming::post();
    let value = rx.recv_timeout(timeout).ok();
    locked(&TASK).take();
    value
}

/// The postponed job (arming.rs): with the GVL, on a Ruby thread, outside any hook. It runs
/// a waiting task first.
unsafe extern "C" fn poll(_data: *mut c_void) {
    let at = Instant::now();
    let task = locked(&TASK).take();
    if let Some(task) = task {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(task));
    }
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: with the GVL; the key is a static Symbol.
        let total = unsafe { rb_sys::rb_gc_stat(total_allocated_key()) } as u64;
        let compiled = zjit::compiled();
        let (change, changes) = {
            let mut guard = tracker();
            let Some(t) = guard.as_mut().filter(|t| t.running) else {
                return;
            };
            let now = arming::now_us();
            let unseen = t.arm.observe(total, now);
            t.arm.heard(arming::GATE.per_us());
            t.arm.compiled(compiled);
            t.points.advance(unseen);
            t.follow_budget(stats::spent());
            t.points
                .budget(t.arm.bytes_per_second(), t.arm.interval_us() as f64 / 1e6);
            let missed = t.points.replay_missed();
            STATS.missed.fetch_add(missed, Relaxed);
            let mean = t.points.mean();
            let (change, wanted_us) = t.arm.decide(t.points.until(), missed, mean);
            arming::set_delay(wanted_us);
            if let Some(count) = arming::read_count() {
                let point = t.arm.until_point(t.points.until());
                let per_us = t.arm.per_us();
                arming::GATE.open_at(point, count, now, per_us, longest_wait_us(mean));
            }
            (change, t.changes)
        };
        register_pending();
        // Outside the lock: enabling allocates, which may run a GC and its hook.
        if let Some((new, _)) = *tracepoint_values() {
            let at = Instant::now();
            switch(new as VALUE, change);
            STATS
                .switch_ns
                .fetch_add(at.elapsed().as_nanos() as u64, Relaxed);
        }
        if let Some(on) = change {
            STATS.switched(on);
        }
        publish::when_due(changes);
    });
    STATS.jobs.fetch_add(1, Relaxed);
    STATS
        .job_ns
        .fetch_add(at.elapsed().as_nanos() as u64, Relaxed);
}

/// Puts the objects sampled since the last job in the weak map (weak.rs), with the GVL and
/// outside any hook: the hook itself may not call Ruby, and the object is whole only once
/// its allocator returned. One a GC may have freed since (the GC count moved) is left out,
/// and so found dead at the next check, unless its header is still the same. Then, when the live set has doubled since the last
/// check, drops the dead ones, so that it does not grow with garbage between snapshots.
fn register_pending() {
    let (pending, check) = {
        let mut guard = tracker();
        let Some(t) = guard.as_mut().filter(|t| t.weak) else {
            return;
        };
        let check = t.live.len() >= 2 * t.checked_len + 4096;
        (std::mem::take(&mut t.pending), check)
    };
    if pending.is_empty() && !check {
        return;
    }
    // SAFETY: reads the GC's count, with the GVL.
    let count = unsafe { rb_sys::rb_gc_count() } as u64;
    publish::quietly(|| {
        for p in pending {
            // After a GC, the same header at the address: the object survived it (a GC
            // that freed it and gave the slot to an object of the same class and type, in
            // the µs before the job, would be taken for it).
            if p.gc == count || live::same_header(p.object, p.klass, p.type_id) {
                weak::put(p.id, p.object);
            }
        }
    });
    if check {
        follow_weak();
    }
}

/// Drops every sampled object the weak map no longer holds, and follows those `GC.compact`
/// moved. The lookups call Ruby, which may allocate and so run a GC, whose marking takes
/// the tracker's lock (`mark_tracker`): they run with the lock released, on the ids taken
/// under it, and what they found is applied under it again.
fn follow_weak() {
    let ids: Vec<u64> = match tracker().as_ref().filter(|t| t.weak && t.running) {
        Some(t) => t.live.entries().map(|(_, e)| e.id).collect(),
        None => return,
    };
    let found: rustc_hash::FxHashMap<u64, Option<VALUE>> =
        publish::quietly(|| ids.into_iter().map(|id| (id, weak::get(id))).collect());
    if let Some(t) = tracker().as_mut().filter(|t| t.weak && t.running) {
        t.follow_found(&found);
    }
}

/// Turns a tracepoint of ours on or off (with the GVL, outside any hook).
fn switch(tracepoint: VALUE, on: Option<bool>) {
    // SAFETY: our tracepoint, with the GVL, outside any hook.
    unsafe {
        match on {
            Some(true) => debug::rb_tracepoint_enable(tracepoint),
            Some(false) => debug::rb_tracepoint_disable(tracepoint),
            None => return,
        };
    }
}

fn total_allocated_key() -> VALUE {
    static KEY: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    // SAFETY: interns a static name with the GVL; a static Symbol is never freed.
    *KEY.get_or_init(|| unsafe {
        rb_sys::rb_id2sym(rb_sys::rb_intern(c"total_allocated_objects".as_ptr())) as usize
    }) as VALUE
}

/// Marks (and so pins) every frame and class the tracker keeps.
unsafe extern "C" fn mark_tracker(_data: *mut c_void) {
    let guard = tracker();
    let Some(t) = guard.as_ref() else { return };
    for &(frame, _) in &t.frames {
        // SAFETY: in the mark phase; each is an iseq or method entry a sample saw.
        unsafe { rb_sys::rb_gc_mark(frame) };
    }
    for site in &t.sites {
        // SAFETY: as above, a class.
        unsafe { rb_sys::rb_gc_mark(site.klass) };
    }
}

/// After `GC.compact` moved objects: the live set's keys follow them.
unsafe extern "C" fn compact_tracker(_data: *mut c_void) {
    if let Some(t) = tracker().as_mut().filter(|t| t.running) {
        let sites = &mut t.sites;
        live::moved(&mut t.live, |e| sites::free_entry(sites, e));
        t.changes += 1;
    }
}

fn tracepoint_values() -> MutexGuard<'static, Option<(usize, usize)>> {
    locked(&TRACEPOINTS)
}

/// The hidden root whose mark and compaction functions are the tracker's, and the two
/// tracepoints, made once and kept alive for good; and the end proc that stops the timer
/// before Ruby tears the VM down.
fn tracepoints() -> (VALUE, VALUE) {
    let mut made = tracepoint_values();
    if let Some((new, end_mark)) = *made {
        return (new as VALUE, end_mark as VALUE);
    }
    // SAFETY: as state.rs's root: a leaked data type with a mark and a compaction function,
    // a hidden object whose data points at it, and registered addresses keeping the root
    // and both tracepoints alive.
    let pair = unsafe {
        let mut data_type: rb_sys::rb_data_type_t = std::mem::zeroed();
        data_type.wrap_struct_name = c"rbspy_ext allocation tracker".as_ptr();
        data_type.function.dmark = Some(mark_tracker);
        data_type.function.dcompact = Some(compact_tracker);
        let data_type: &'static rb_sys::rb_data_type_t = Box::leak(Box::new(data_type));
        let data = data_type as *const rb_sys::rb_data_type_t as *mut c_void;
        let root = rb_sys::rb_data_typed_object_wrap(0, data, data_type);
        let new = debug::rb_tracepoint_new(0, NEWOBJ, on_newobj, std::ptr::null_mut());
        let end_mark = debug::rb_tracepoint_new(0, GC_END_MARK, on_end_mark, std::ptr::null_mut());
        for value in [root, new, end_mark] {
            rb_sys::rb_gc_register_address(Box::leak(Box::new(value)));
        }
        rb_sys::rb_set_end_proc(Some(at_exit), 0);
        (new, end_mark)
    };
    *made = Some((pair.0 as usize, pair.1 as usize));
    pair
}

unsafe extern "C" fn at_exit(_data: VALUE) {
    arming::stop_timer();
}

/// Starts tracking anew at `rate_bytes` (at least 1) in Ruby `version`, at most
/// `max_per_second` samples a second (0: no cap), fewer when they cost more than `max_cpu`
/// of a core (0: no budget): what an earlier run counted is dropped.
pub(crate) fn start(rate_bytes: u64, max_per_second: u64, max_cpu: f64, version: &str) {
    stop();
    let (new, end_mark) = tracepoints();
    // With no timer (2.7 cannot post from a signal on any thread; no free signal) the hook
    // stays on. At rate 1 it stays on anyway, and the timer's jobs publish the live set; so
    // at small rates, where turning it off only loses the start of a burst (STEADY_RATE_BYTES).
    let timed = arming::prepare(poll) && arming::start_timer();
    let always = rate_bytes <= STEADY_RATE_BYTES || !timed;
    // Sampling: liveness from the weak map, and no GC hook; every allocation: from the
    // mark bits at the end of each marking (live.rs).
    let marks = if always {
        MarkBits::for_version(version)
    } else {
        None
    };
    if !always {
        weak::renew();
    }
    // SAFETY: with the GVL; the key is made before any job needs it.
    let total = unsafe { rb_sys::rb_gc_stat(total_allocated_key()) } as u64;
    zjit::find();
    arming::GATE.close();
    match always {
        true => arming::set_counters(None),
        false => read_counters(total),
    }
    let arm = Arm::new(always, total, arming::now_us());
    // A budget only where samples are capped and the timer arms the hook: at rate 1, or
    // with the hook always on, a sample costs nothing the cap could save.
    let budget = (max_cpu > 0.0 && max_per_second > 0 && !always)
        .then(|| Budget::new(max_cpu, arming::signal_ns()));
    let t = Tracker::new(rate_bytes, max_per_second, marks, arm, !always, budget);
    *tracker() = Some(t);
    publish::reset();
    STATS.reset();
    arming::GC_TICKS.store(0, Relaxed);
    arming::QUIET_TICKS.store(0, Relaxed);
    STATS.switched(true);
    switch(end_mark, marks.is_some().then_some(true));
    // On from the start, always or until the first point (see `Arm::new`).
    switch(new, Some(true));
}

/// Has the timer's handler read the words this process counts its allocations in
/// (arming.rs): found once by a spy on this very process (the census's wing knows them per
/// release), and kept only if their sum is `total`, what `GC.stat` said just before with the
/// GVL held: not where another Ractor allocated meanwhile (the job then runs at every tick,
/// as before).
fn read_counters(total: u64) {
    static FOUND: OnceLock<Option<AllocatedCounters>> = OnceLock::new();
    let found = FOUND.get_or_init(|| {
        let pid = std::process::id() as i32;
        let mut spy = rbspy_ext_core::Spy::attach(pid).ok()?;
        let view = spy.target_view();
        // Checked first through the spy's reads, which fail where a plain load would crash.
        let c = AllocatedCounters::find(&view).ok()?;
        let flags = view.mem().read(c.gc_flags, &mut [0u8; 4]).is_ok();
        (flags && c.read(view.mem()).ok() == Some(total)).then_some(c)
    });
    arming::set_counters(found.as_ref());
    if arming::read_count() != Some(total) {
        arming::set_counters(None);
    }
}

/// Stops tracking; what was counted stays for `copy`.
pub(crate) fn stop() {
    arming::stop_timer();
    if let Some((new, end_mark)) = *tracepoint_values() {
        // SAFETY: our tracepoints.
        unsafe {
            debug::rb_tracepoint_disable(new as VALUE);
            debug::rb_tracepoint_disable(end_mark as VALUE);
        }
        STATS.switched(false);
    }
    // The counts stay as of this look: no marking or weak map is checked from now on (the
    // addresses would go stale, and a compaction would follow freed ones).
    register_pending();
    follow_weak();
    // SAFETY: reads the GC's count, with the GVL.
    let gc_count = unsafe { rb_sys::rb_gc_count() } as u64;
    let stopped = tracker().as_mut().map(|t| {
        if t.running {
            let (sites, _) = t.in_use(gc_count);
            for (site, counts) in t.sites.iter_mut().zip(sites) {
                site.counts = counts;
            }
        }
        std::mem::replace(&mut t.running, false)
    });
    if stopped == Some(true) {
        // Readers outside see the run's last counts, and that it stopped.
        publish::now();
    }
    if let Some(t) = tracker().as_mut() {
        t.live.clear();
        t.pending.clear();
    }
}

/// In a forked child (a Puma worker): timers are not inherited, so the child makes its own.
/// Called from `Process._fork` (lib/rbspy_ext/allocations.rb).
pub(crate) fn after_fork() {
    arming::forget_timer();
    let running = tracker().as_ref().is_some_and(|t| t.running);
    if running && prepare() {
        arming::start_timer();
    }
}

/// `GC.start`: what is in use is then as of now.
pub(crate) fn collect() {
    // SAFETY: with the GVL, outside any hook.
    unsafe { rb_sys::rb_gc_start() };
}

/// What the tracker's machinery did since tracking started (stats.rs), as (name, value).
pub(crate) fn stats() -> Vec<(&'static str, f64)> {
    let mut stats = STATS.snapshot();
    // 1 where the timer's handler reads the count itself and posts only the jobs with work.
    stats.push(("reads_count", arming::read_count().is_some() as u8 as f64));
    // Of the wakes: those that found a GC running, and those that posted no job.
    stats.push(("gc_wakes", arming::GC_TICKS.load(Relaxed) as f64));
    stats.push(("quiet_wakes", arming::QUIET_TICKS.load(Relaxed) as f64));
    // The CPU budget's prices (allocs::budget): a wake-up, all the tracker spent as the
    // budget prices it, and a sample lately (0: no budget).
    stats.push(("signal_ns", arming::signal_ns()));
    let spent = rbspy_ext_core::allocs::budget::price(&stats::spent(), arming::signal_ns());
    stats.push(("priced_ns", spent));
    let guard = tracker();
    let t = guard.as_ref();
    let sample_ns = t.and_then(|t| t.budget.as_ref().map(|b| b.per_sample_ns()));
    stats.push(("sample_ns", sample_ns.unwrap_or(0.0)));
    // Holds of the hook while ZJIT compiles (allocs::hold::Hold): begun, and the ms of those
    // that ended.
    let (holds, held_us) = t.map_or((0, 0), |t| (t.arm.hold.holds, t.arm.hold.held_us));
    stats.push(("holds", holds as f64));
    stats.push(("held_ms", held_us as f64 / 1000.0));
    // The margin within which a point turns the hook on, now (µs).
    stats.push(("ahead_us", t.map_or(0.0, |t| t.arm.ahead_us())));
    stats
}

pub(crate) fn tracking() -> bool {
    tracker().as_ref().is_some_and(|t| t.running)
}

/// What a snapshot copies under the lock, before any Ruby call: the raw frames (VALUE and
/// line), each site's counts with its frame indexes, class and type, and the notes.
pub(crate) struct Copied {
    pub rate_bytes: u64,
    pub frames: Vec<(VALUE, i32)>,
    pub sites: Vec<(SiteCounts, Vec<u32>, VALUE, u8)>,
    pub notes: Vec<String>,
    pub start_unix_ns: u64,
    pub duration_ns: u64,
    pub running: bool,
    /// With `Take::WithLive`: each live sample's address, site, slot bytes, samples and rate.
    pub live: Vec<(u64, u32, u32, u32, u64)>,
}

/// What `copy` takes of the tracker: its counts by site, or those and its live samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Take {
    Counts,
    WithLive,
}

/// The tracker's counts, and with `Take::WithLive` its live samples, as of one moment.
pub(crate) fn copy(take: Take) -> Option<Copied> {
    register_pending();
    follow_weak();
    // SAFETY: reads the GC's count, with the GVL.
    let gc_count = unsafe { rb_sys::rb_gc_count() } as u64;
    let mut guard = tracker();
    let t = guard.as_mut()?;
    let (sites, unsettled) = match t.running {
        true => t.in_use(gc_count),
        // As `stop` left them.
        false => (t.sites.iter().map(|s| s.counts.clone()).collect(), 0),
    };
    let mut notes = Vec::new();
    if unsettled > 0 {
        notes.push(format!(
            "{unsettled} samples taken since the last GC are counted as allocated, not yet as in use (Go's meaning: in use as of the last completed GC)"
        ));
    }
    if t.sites_full > 0 {
        notes.push(format!(
            "{} samples of new sites past {MAX_SITES} sites were not kept",
            t.sites_full
        ));
    }
    if t.live_full > 0 {
        notes.push(format!(
            "{} samples were not followed until freed ({MAX_LIVE} were): counted as allocated, not live",
            t.live_full
        ));
    }
    if t.points.highest_rate() > t.rate_bytes {
        let why = match &t.budget {
            Some(b) if t.lowest_cap < t.max_per_second => format!(
                " (fewer than {}: each cost about {:.0} µs, and tracking may spend {:.2} % of a core)",
                t.max_per_second,
                b.per_sample_ns() / 1e3,
                b.share() * 100.0
            ),
            _ => String::new(),
        };
        notes.push(format!(
            "samples were capped near {} a second{why}: at times one sample stood for up to {} bytes (each weighs what it stood for)",
            t.lowest_cap,
            t.points.highest_rate()
        ));
    }
    if t.marks.is_none() && !t.weak {
        notes.push(
            "the heap's layout of this Ruby is not known: every sample is counted as in use".into(),
        );
    }
    if t.arm.missed > 0 {
        let unpaid = match t.points.owed() {
            0 => String::new(),
            n => format!(" ({n} not yet)"),
        };
        notes.push(format!(
            "{} sample points passed between two looks at the allocation count (a burst): each was counted at one of the points after it{unpaid}",
            t.arm.missed
        ));
    }
    Some(Copied {
        rate_bytes: t.rate_bytes,
        frames: t.frames.clone(),
        sites: (t.sites.iter().zip(sites))
            .map(|(s, counts)| (counts, s.frames.clone(), s.klass, s.type_id))
            .collect(),
        notes,
        start_unix_ns: t.start_unix_ns,
        duration_ns: t.started.elapsed().as_nanos() as u64,
        running: t.running,
        live: match take {
            Take::WithLive => t.live.samples(),
            Take::Counts => Vec::new(),
        },
    })
}
