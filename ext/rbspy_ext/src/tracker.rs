//! The allocation tracker of `RubySpy::NativeAllocations` (allocs.rs): two internal
//! event hooks (`RUBY_INTERNAL_EVENT_NEWOBJ` and `FREEOBJ`) count, by bytes, towards the next
//! sample; a sampled object's stack (`rb_profile_frames`), class and type make its site, and
//! the object joins the live set until the GC frees it. What the samples mean, and how they
//! are scaled, is `rbspy_ext_core::allocs`; naming the frames and classes is allocs.rs.
//!
//! What a hook may do: Ruby calls them inside the allocator and the sweeper, where it forbids
//! any Ruby API that allocates, raises or runs Ruby code. These hooks read the object's header
//! words, call `rb_profile_frames` (which only reads the control frames) and work on Rust
//! data: the frames and classes they keep are plain VALUEs, marked (and so pinned) by a
//! hidden root object, and turned into names only when a snapshot is asked for, with the GVL
//! and outside any hook.
//!
//! The live set is keyed by address, weakly (the objects are not marked): FREEOBJ takes an
//! object out, a NEWOBJ at an address still in the set means the GC freed its object without
//! telling (2.7 and 3.0's `rb_gc_force_recycle`), and `GC.compact` moves objects, so the
//! root's compaction callback re-keys every entry with `rb_gc_location`.
//!
//! Bounds: at most [`MAX_SITES`] sites and [`MAX_LIVE`] live samples; past them samples are
//! counted in the notes, not kept. Only the Ractor that starts tracking is tracked before
//! Ruby 4.0 (hooks are per Ractor there); from 4.0 internal hooks fire in every Ractor.
use rb_sys::VALUE;
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
        pub fn rb_tracearg_event_flag(arg: *mut c_void) -> u32;
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

/// Bits of the live set's filter (128 KiB).
const FILTER_BITS: usize = 1 << 20;

const NEWOBJ: u32 = 0x0010_0000;
const FREEOBJ: u32 = 0x0020_0000;

struct Site {
    counts: SiteCounts,
    frames: Vec<u32>,
    klass: VALUE,
    type_id: u8,
}

/// Everything the hooks keep.
struct Tracker {
    rate_bytes: u64,
    /// Bytes still to allocate before the next sample.
    until_sample: i64,
    rng: u64,
    /// (frame VALUE, line) of each distinct frame, and its index.
    frames: Vec<(VALUE, i32)>,
    frame_ids: HashMap<(VALUE, i32), u32>,
    sites: Vec<Site>,
    site_ids: HashMap<(Vec<u32>, VALUE, u8), u32>,
    /// Sampled object → (site, its size).
    live: HashMap<VALUE, (u32, u32)>,
    /// A bit per hash of every address put in `live` since it was last rebuilt: a free whose
    /// bit is clear (nearly every one) needs no lookup.
    maybe_live: Vec<u64>,
    /// Addresses put in the filter since it was last rebuilt from `live`.
    filtered: usize,
    sites_full: u64,
    live_full: u64,
    started: Instant,
    start_unix_ns: u64,
    running: bool,
    buf: Vec<VALUE>,
    lines: Vec<i32>,
    ids: Vec<u32>,
    slot_size: Option<unsafe extern "C" fn(VALUE) -> usize>,
}

static TRACKER: Mutex<Option<Tracker>> = Mutex::new(None);
/// The two tracepoints, once made (kept alive by a registered address).
static TRACEPOINTS: Mutex<Option<(usize, usize)>> = Mutex::new(None);

fn tracker() -> MutexGuard<'static, Option<Tracker>> {
    TRACKER.lock().unwrap_or_else(|p| p.into_inner())
}

impl Tracker {
    fn new(rate_bytes: u64) -> Self {
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
            live: HashMap::default(),
            maybe_live: vec![0; FILTER_BITS / 64],
            filtered: 0,
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

    /// NEWOBJ: counts the object's bytes; samples it when they cross the next sample.
    fn allocated(&mut self, object: VALUE) {
        // SAFETY: the object is allocated: its header (flags, class) is written before the
        // hook runs, on every Ruby.
        let (flags, klass) = unsafe {
            let words = object as *const VALUE;
            (*words, *words.add(1))
        };
        let type_id = (flags & 0x1f) as u8;
        if INTERNAL_TYPES.contains(&type_id) || klass == 0 {
            return;
        }
        if MISSES_FREES {
            // Its address may have been freed without a FREEOBJ: the old object is gone.
            self.freed(object);
        }
        let size = self.size_of(object);
        self.until_sample -= size as i64;
        if self.until_sample > 0 {
            return;
        }
        self.until_sample = self.next_interval();
        self.sample(object, klass, type_id, size);
    }

    fn sample(&mut self, object: VALUE, klass: VALUE, type_id: u8, size: u64) {
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
        self.sites[site as usize].counts.add(size, self.rate_bytes);
        if self.live.len() < MAX_LIVE {
            self.live.insert(object, (site, size as u32));
            self.filter(object);
        } else {
            self.live_full += 1;
            self.sites[site as usize].counts.free(size, self.rate_bytes);
        }
    }

    /// Puts a sampled object's address in the filter; once as many went in as would fill an
    /// eighth of it, the filter is made again from the live set alone (freed addresses leave).
    fn filter(&mut self, object: VALUE) {
        self.filtered += 1;
        if self.filtered >= FILTER_BITS / 8 {
            self.rebuild_filter();
        } else {
            let bit = filter_bit(object);
            self.maybe_live[bit / 64] |= 1 << (bit % 64);
        }
    }

    fn rebuild_filter(&mut self) {
        self.maybe_live.fill(0);
        for &object in self.live.keys() {
            let bit = filter_bit(object);
            self.maybe_live[bit / 64] |= 1 << (bit % 64);
        }
        self.filtered = self.live.len();
    }

    /// FREEOBJ: a sampled object leaves the live set.
    fn freed(&mut self, object: VALUE) {
        let bit = filter_bit(object);
        if self.maybe_live[bit / 64] & (1 << (bit % 64)) == 0 {
            return;
        }
        if let Some((site, size)) = self.live.remove(&object) {
            self.sites[site as usize]
                .counts
                .free(size as u64, self.rate_bytes);
        }
    }
}

/// Ruby 2.7 and 3.0 free some objects without a FREEOBJ event (`rb_gc_force_recycle`), so a
/// new object at a sampled object's address also ends it there.
const MISSES_FREES: bool = cfg!(not(ruby_gte_3_1));

/// The filter bit of an address (slots are at least 40 bytes apart).
fn filter_bit(object: VALUE) -> usize {
    ((object >> 3).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 44) as usize % FILTER_BITS
}

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

/// Both hooks: inside the allocator or the sweeper (see the module docs).
unsafe extern "C" fn on_event(tracepoint: VALUE, _data: *mut c_void) {
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: called by Ruby with a tracepoint of ours, inside its hook.
        let (event, object) = unsafe {
            let arg = debug::rb_tracearg_from_tracepoint(tracepoint);
            (
                debug::rb_tracearg_event_flag(arg),
                debug::rb_tracearg_object(arg),
            )
        };
        // Never blocks: every hook, mark and compaction runs with the GVL (from 4.0, under
        // the VM lock in any Ractor), and nothing holding the lock allocates.
        let Ok(mut guard) = TRACKER.try_lock() else {
            return;
        };
        let Some(t) = guard.as_mut().filter(|t| t.running) else {
            return;
        };
        match event {
            NEWOBJ => t.allocated(object),
            FREEOBJ => t.freed(object),
            _ => {}
        }
    });
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
    let mut guard = tracker();
    let Some(t) = guard.as_mut() else { return };
    let moved: Vec<(VALUE, (u32, u32))> = t.live.drain().collect();
    for (object, entry) in moved {
        // SAFETY: in the reference-updating phase, on objects the GC has not freed.
        t.live
            .insert(unsafe { rb_sys::rb_gc_location(object) }, entry);
    }
    // Their new addresses' filter bits.
    t.rebuild_filter();
}

/// The hidden root whose mark and compaction functions are the tracker's, and the two
/// tracepoints, made once and kept alive for good.
fn tracepoints() -> (VALUE, VALUE) {
    let mut made = TRACEPOINTS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((new, free)) = *made {
        return (new as VALUE, free as VALUE);
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
        let new = debug::rb_tracepoint_new(0, NEWOBJ, on_event, std::ptr::null_mut());
        let free = debug::rb_tracepoint_new(0, FREEOBJ, on_event, std::ptr::null_mut());
        for value in [root, new, free] {
            rb_sys::rb_gc_register_address(Box::leak(Box::new(value)));
        }
        (new, free)
    };
    *made = Some((pair.0 as usize, pair.1 as usize));
    pair
}

/// Starts tracking anew at `rate_bytes` (at least 1): what an earlier run counted is
/// dropped.
pub(crate) fn start(rate_bytes: u64) {
    let (new, free) = tracepoints();
    *tracker() = Some(Tracker::new(rate_bytes));
    // SAFETY: our tracepoints; enabling runs no Ruby code.
    unsafe {
        debug::rb_tracepoint_enable(new);
        debug::rb_tracepoint_enable(free);
    }
}

/// Stops tracking; what was counted stays for `copy`.
pub(crate) fn stop() {
    if let Some((new, free)) = *TRACEPOINTS.lock().unwrap_or_else(|p| p.into_inner()) {
        // SAFETY: our tracepoints.
        unsafe {
            debug::rb_tracepoint_disable(new as VALUE);
            debug::rb_tracepoint_disable(free as VALUE);
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
