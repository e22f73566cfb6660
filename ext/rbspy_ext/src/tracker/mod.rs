//! The allocation tracker of `RubySpy::NativeAllocations` (allocs.rs). The NEWOBJ hook
//! counts slot bytes towards the next sample point; a sampled object's stack
//! (`rb_profile_frames`), class and type make its site, and the object joins the live set
//! (live.rs) until a marking finds it unmarked. What the samples mean, and how they are
//! scaled, is `rbspy_ext_core::allocs`; naming the frames and classes is allocs.rs.
//!
//! The hook is on only near a sample point (arming.rs): any NEWOBJ hook costs Ruby about
//! 100 ns on every allocation. The GC_END_MARK hook, once per GC, keeps the live set.
//!
//! What a hook may do: Ruby calls them inside the allocator and the GC, where it forbids any
//! Ruby API that allocates, raises or runs Ruby code. These hooks read the object's header
//! words, call `rb_profile_frames` (which only reads the control frames) and work on Rust
//! data: the frames and classes they keep are plain VALUEs, marked (and so pinned) by a
//! hidden root object, and turned into names only when a snapshot is asked for, with the GVL
//! and outside any hook. Turning hooks on and off is left to the postponed job.
//!
//! `GC.compact` moves objects, so the root's compaction callback re-keys the live set with
//! `rb_gc_location`.
//!
//! Bounds: at most [`MAX_SITES`] sites and [`MAX_LIVE`] live samples; past them samples are
//! counted in the notes, not kept. Only the Ractor that starts tracking is tracked before
//! Ruby 4.0 (hooks are per Ractor there); from 4.0 internal hooks fire in every Ractor.
mod arming;
mod live;

use live::{Entry, LiveSet};
use rb_sys::VALUE;
use rbspy_ext_core::allocs::marks::MarkBits;
use rbspy_ext_core::allocs::SiteCounts;
use rustc_hash::FxHashMap as HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Ruby's debug API (ruby/debug.h), declared here: rb-sys's bindings for 2.7 leave it out.
/// The same functions and signatures on every Ruby from 2.7 (rb_profile_frames: 2.3).
pub(crate) mod debug {
    use rb_sys::VALUE;
    use std::ffi::c_void;

    extern "C" {
        pub fn rb_profile_frames(start: i32, limit: i32, buff: *mut VALUE, lines: *mut i32) -> i32;
        pub fn rb_profile_frame_path(frame: VALUE) -> VALUE;
        pub fn rb_profile_frame_absolute_path(frame: VALUE) -> VALUE;
        pub fn rb_profile_frame_full_label(frame: VALUE) -> VALUE;
        pub fn rb_tracepoint_new(
            target_thread: VALUE,
            events: u32,
            func: unsafe extern "C" fn(VALUE, *mut c_void),
            data: *mut c_void,
        ) -> VALUE;
        pub fn rb_tracepoint_enable(tracepoint: VALUE) -> VALUE;
        pub fn rb_tracepoint_disable(tracepoint: VALUE) -> VALUE;
        pub fn rb_tracearg_from_tracepoint(tracepoint: VALUE) -> *mut c_void;
        pub fn rb_tracearg_object(arg: *mut c_void) -> VALUE;
    }
}

/// Frames kept per sample, innermost first.
const MAX_DEPTH: usize = 256;
/// Distinct sites kept; samples of new sites past it are counted, not kept.
pub const MAX_SITES: usize = 100_000;
/// Sampled objects followed until freed; past it a sample is counted as allocated only.
pub const MAX_LIVE: usize = 1 << 20;
/// Built-in types that are no object a program sees (`flags & 0x1f`): T_NONE, T_IMEMO,
/// T_NODE, T_ICLASS, T_ZOMBIE, T_MOVED. They are not counted towards samples either.
const INTERNAL_TYPES: [u8; 6] = [0x00, 0x1a, 0x1b, 0x1c, 0x1d, 0x1e];
/// A slot's size before Ruby 3.2, which has one size of slot.
const RVALUE_SIZE: u64 = 40;

const NEWOBJ: u32 = 0x0010_0000;
const GC_END_MARK: u32 = 0x0080_0000;

struct Site {
    counts: SiteCounts,
    frames: Vec<u32>,
    klass: VALUE,
    type_id: u8,
}

/// Everything the hooks keep.
struct Tracker {
    rate_bytes: u64,
    /// Bytes still to allocate before the next sample point.
    until_sample: i64,
    rng: u64,
    /// (frame VALUE, line) of each distinct frame, and its index.
    frames: Vec<(VALUE, i32)>,
    frame_ids: HashMap<(VALUE, i32), u32>,
    sites: Vec<Site>,
    site_ids: HashMap<(Vec<u32>, VALUE, u8), u32>,
    live: LiveSet,
    /// Where mark bits are on this Ruby; None: no liveness (every sample stays in use).
    marks: Option<MarkBits>,
    /// `rb_gc_count()` at the last marking checked.
    checked_gc: u64,
    sites_full: u64,
    live_full: u64,
    started: Instant,
    start_unix_ns: u64,
    running: bool,
    buf: Vec<VALUE>,
    lines: Vec<i32>,
    ids: Vec<u32>,
    slot_size: Option<unsafe extern "C" fn(VALUE) -> usize>,
    arm: arming::Arm,
    /// Points that passed while the hook was off, owed to the next allocation it sees.
    owed: u32,
}

static TRACKER: Mutex<Option<Tracker>> = Mutex::new(None);
/// The two tracepoints (NEWOBJ, GC_END_MARK), once made (kept alive by registered addresses).
static TRACEPOINTS: Mutex<Option<(usize, usize)>> = Mutex::new(None);

fn tracker() -> MutexGuard<'static, Option<Tracker>> {
    TRACKER.lock().unwrap_or_else(|p| p.into_inner())
}

impl Tracker {
    fn new(rate_bytes: u64, marks: Option<MarkBits>, arm: arming::Arm) -> Self {
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0x9e37_79b9, |d| d.as_nanos() as u64)
            ^ (std::process::id() as u64) << 32;
        let mut t = Tracker {
            rate_bytes: rate_bytes.max(1),
            until_sample: 0,
            rng: seed | 1,
            frames: Vec::new(),
            frame_ids: HashMap::default(),
            sites: Vec::new(),
            site_ids: HashMap::default(),
            live: LiveSet::new(),
            marks,
            // SAFETY: reads the GC's count; with the GVL.
            checked_gc: unsafe { rb_sys::rb_gc_count() } as u64,
            sites_full: 0,
            live_full: 0,
            started: Instant::now(),
            start_unix_ns: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64),
            running: true,
            buf: vec![0; MAX_DEPTH],
            lines: vec![0; MAX_DEPTH],
            ids: Vec::with_capacity(MAX_DEPTH),
            slot_size: slot_size_function(),
            arm,
            owed: 0,
        };
        t.until_sample = t.next_interval();
        t
    }

    /// Bytes until the next sample: exponential with the rate as mean (0 at rate 1, so every
    /// allocation is sampled).
    fn next_interval(&mut self) -> i64 {
        if self.rate_bytes <= 1 {
            return 0;
        }
        // xorshift64*: a generator of our own, so the hook calls nothing it does not need.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        let bits = self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11;
        let u = (bits as f64 + 1.0) / (1u64 << 53) as f64; // (0, 1]
        (-u.ln() * self.rate_bytes as f64).min(i64::MAX as f64 / 2.0) as i64
    }

    fn size_of(&self, object: VALUE) -> u64 {
        match self.slot_size {
            // SAFETY: Ruby's own function, called on an object just allocated.
            Some(f) => unsafe { f(object) as u64 },
            None => RVALUE_SIZE,
        }
    }

    /// NEWOBJ: counts the object's bytes; samples it when they cross the next point. True
    /// when the hook should be turned off (by the postponed job): the next point is far.
    fn allocated(&mut self, object: VALUE) -> bool {
        self.arm.seen += 1;
        // SAFETY: the object is allocated: its header (flags, class) is written before the
        // hook runs, on every Ruby.
        let (flags, klass) = unsafe {
            let words = object as *const VALUE;
            (*words, *words.add(1))
        };
        let type_id = (flags & 0x1f) as u8;
        if INTERNAL_TYPES.contains(&type_id) || klass == 0 {
            return false;
        }
        if MISSES_FREES {
            // Its address may have been freed without the GC (rb_gc_force_recycle): the
            // old object is gone.
            if let Some(old) = self.live.remove(object) {
                self.free(old);
            }
        }
        let size = self.size_of(object);
        self.arm.seen_bytes += size;
        self.until_sample -= size as i64;
        let mut times = std::mem::take(&mut self.owed);
        if self.until_sample <= 0 {
            // One sample however many points the object spans: Go's weight counts on it.
            times += 1;
            self.until_sample = self.next_interval();
        }
        if times == 0 {
            return false;
        }
        self.sample(object, klass, type_id, size, times);
        self.arm.far(self.until_sample)
    }

    /// The job, after `Arm::observe`: each point `until_sample` went past while the hook
    /// was off is owed to the next allocation. Returns how many.
    fn replay_missed(&mut self) -> u64 {
        let mut missed = 0;
        while self.until_sample <= 0 && self.rate_bytes > 1 && missed < 1_000_000 {
            missed += 1;
            self.until_sample += self.next_interval().max(1);
        }
        self.owed = self.owed.saturating_add(missed as u32);
        missed
    }

    /// Counts the object `times` times (more than once for points owed to it).
    fn sample(&mut self, object: VALUE, klass: VALUE, type_id: u8, size: u64, times: u32) {
        // SAFETY: reads this thread's control frames into our buffers; allocates nothing.
        let n = unsafe {
            debug::rb_profile_frames(
                0,
                MAX_DEPTH as i32,
                self.buf.as_mut_ptr(),
                self.lines.as_mut_ptr(),
            )
        };
        let n = (n.max(0) as usize).min(MAX_DEPTH);
        // SAFETY: the class of an object just allocated (a singleton class's real class).
        let klass = unsafe { rb_sys::rb_class_real(klass) };
        self.ids.clear();
        for i in 0..n {
            let key = (self.buf[i], self.lines[i]);
            let next = self.frames.len() as u32;
            let id = *self.frame_ids.entry(key).or_insert(next);
            if id == next {
                self.frames.push(key);
            }
            self.ids.push(id);
        }
        let key = (std::mem::take(&mut self.ids), klass, type_id);
        let site = match self.site_ids.get(&key) {
            Some(&site) => site,
            None if self.sites.len() >= MAX_SITES => {
                self.sites_full += 1;
                self.ids = key.0;
                return;
            }
            None => {
                let site = self.sites.len() as u32;
                self.sites.push(Site {
                    counts: SiteCounts::default(),
                    frames: key.0.clone(),
                    klass,
                    type_id,
                });
                self.site_ids.insert(key.clone(), site);
                site
            }
        };
        self.ids = key.0;
        for _ in 0..times {
            self.sites[site as usize].counts.add(size, self.rate_bytes);
        }
        let entry = Entry {
            site,
            size: size as u32,
            type_id,
            times,
        };
        if self.live.len() < MAX_LIVE {
            self.live.insert(object, entry);
        } else {
            self.live_full += 1;
            self.free(entry);
        }
    }

    /// A sampled object is gone: its site's in-use counts drop it.
    fn free(&mut self, entry: Entry) {
        free_entry(&mut self.sites, entry, self.rate_bytes);
    }

    /// GC_END_MARK: every sampled object the marking left unmarked is gone.
    fn marked(&mut self) {
        let Some(marks) = self.marks else { return };
        // SAFETY: reads the GC's count, inside its hook.
        let count = unsafe { rb_sys::rb_gc_count() } as u64;
        let direct = count == self.checked_gc.wrapping_add(1);
        self.checked_gc = count;
        let (sites, rate) = (&mut self.sites, self.rate_bytes);
        self.live
            .check(&marks, direct, |e| free_entry(sites, e, rate));
    }
}

fn free_entry(sites: &mut [Site], entry: Entry, rate_bytes: u64) {
    for _ in 0..entry.times {
        sites[entry.site as usize]
            .counts
            .free(entry.size as u64, rate_bytes);
    }
}

/// Ruby 2.7 and 3.0 free some objects without the GC (`rb_gc_force_recycle`), so a new
/// object at a sampled object's address also ends it there, when the hook sees it.
const MISSES_FREES: bool = cfg!(not(ruby_gte_3_1));

/// `rb_gc_obj_slot_size` (Ruby 3.2+, exported but declared in internal headers), looked up
/// at run time so that a Ruby without it still loads the extension.
fn slot_size_function() -> Option<unsafe extern "C" fn(VALUE) -> usize> {
    // SAFETY: dlsym on the global namespace with a NUL-terminated name; the symbol, when
    // present, is Ruby's `size_t rb_gc_obj_slot_size(VALUE)`.
    unsafe {
        let f = libc::dlsym(libc::RTLD_DEFAULT, c"rb_gc_obj_slot_size".as_ptr());
        (!f.is_null())
            .then(|| std::mem::transmute::<*mut c_void, unsafe extern "C" fn(VALUE) -> usize>(f))
    }
}

/// The NEWOBJ hook: inside the allocator (see the module docs).
unsafe extern "C" fn on_newobj(tracepoint: VALUE, _data: *mut c_void) {
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
}

/// The GC_END_MARK hook: inside the GC, between marking and sweeping.
unsafe extern "C" fn on_end_mark(_tracepoint: VALUE, _data: *mut c_void) {
    let _ = std::panic::catch_unwind(|| {
        let Ok(mut guard) = TRACKER.try_lock() else {
            return;
        };
        if let Some(t) = guard.as_mut().filter(|t| t.running) {
            t.marked();
        }
    });
}

/// The postponed job (arming.rs): with the GVL, on a Ruby thread, outside any hook.
unsafe extern "C" fn poll(_data: *mut c_void) {
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: with the GVL; the key is a static Symbol.
        let total = unsafe { rb_sys::rb_gc_stat(total_allocated_key()) } as u64;
        let change = {
            let mut guard = tracker();
            let Some(t) = guard.as_mut().filter(|t| t.running) else {
                return;
            };
            t.arm.observe(total, &mut t.until_sample);
            let missed = t.replay_missed();
            t.arm.decide(t.until_sample, missed)
        };
        // Outside the lock: enabling allocates, which may run a GC and its hook.
        if let (Some(on), Some((new, _))) = (change, *tracepoint_values()) {
            // SAFETY: our tracepoint, with the GVL, outside any hook.
            unsafe {
                if on {
                    debug::rb_tracepoint_enable(new as VALUE);
                } else {
                    debug::rb_tracepoint_disable(new as VALUE);
                }
            }
        }
    });
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
    if let Some(t) = tracker().as_mut() {
        t.live.moved();
    }
}

fn tracepoint_values() -> MutexGuard<'static, Option<(usize, usize)>> {
    TRACEPOINTS.lock().unwrap_or_else(|p| p.into_inner())
}

/// The hidden root whose mark and compaction functions are the tracker's, and the two
/// tracepoints, made once and kept alive for good; and the end proc that stops the poller
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
    arming::stop_poller();
}

/// Starts tracking anew at `rate_bytes` (at least 1) in Ruby `version`: what an earlier run
/// counted is dropped.
pub(crate) fn start(rate_bytes: u64, version: &str) {
    stop();
    let (new, end_mark) = tracepoints();
    let always = rate_bytes <= 1 || !arming::prepare(poll);
    let marks = MarkBits::for_version(version);
    // SAFETY: with the GVL; the key is made before any job needs it.
    let total = unsafe { rb_sys::rb_gc_stat(total_allocated_key()) } as u64;
    *tracker() = Some(Tracker::new(
        rate_bytes,
        marks,
        arming::Arm::new(always, total),
    ));
    // SAFETY: our tracepoints, with the GVL, outside any hook.
    unsafe {
        if marks.is_some() {
            debug::rb_tracepoint_enable(end_mark);
        }
        if always {
            debug::rb_tracepoint_enable(new);
        }
    }
    if !always {
        arming::start_poller();
    }
}

/// Stops tracking; what was counted stays for `copy`.
pub(crate) fn stop() {
    arming::stop_poller();
    if let Some((new, end_mark)) = *tracepoint_values() {
        // SAFETY: our tracepoints.
        unsafe {
            debug::rb_tracepoint_disable(new as VALUE);
            debug::rb_tracepoint_disable(end_mark as VALUE);
        }
    }
    if let Some(t) = tracker().as_mut() {
        t.running = false;
    }
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
}

pub(crate) fn copy() -> Option<Copied> {
    let guard = tracker();
    let t = guard.as_ref()?;
    let mut notes = Vec::new();
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
    if t.marks.is_none() {
        notes.push(
            "the heap's layout of this Ruby is not known: every sample is counted as in use".into(),
        );
    }
    if t.arm.missed > 0 {
        notes.push(format!(
            "{} sample points passed between two looks at the allocation count (a burst): each was taken at the next allocation",
            t.arm.missed
        ));
    }
    Some(Copied {
        rate_bytes: t.rate_bytes,
        frames: t.frames.clone(),
        sites: (t.sites.iter())
            .map(|s| (s.counts.clone(), s.frames.clone(), s.klass, s.type_id))
            .collect(),
        notes,
        start_unix_ns: t.start_unix_ns,
        duration_ns: t.started.elapsed().as_nanos() as u64,
    })
}
