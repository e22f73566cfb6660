//! What the hooks keep (`Tracker`): the sample points, the sites with their frames and
//! counts, and the live set; and the sampling itself, which runs inside the NEWOBJ hook and
//! so calls no Ruby API but `rb_profile_frames`, `rb_class_real` and `rb_gc_obj_slot_size`,
//! none of which allocates. The hooks, the job and the Ruby-facing functions are mod.rs.
use super::debug;
use super::live;
use rb_sys::VALUE;
use rbspy_ext_core::allocs::arm::Arm;
use rbspy_ext_core::allocs::budget::{Budget, Spent};
use rbspy_ext_core::allocs::live::{Entry, LiveObjects};
use rbspy_ext_core::allocs::marks::MarkBits;
use rbspy_ext_core::allocs::points::{Points, Take};
use rbspy_ext_core::allocs::SiteCounts;
use rustc_hash::FxHashMap as HashMap;
use std::ffi::c_void;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

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

/// A sampled object the job has still to put in the weak map: its address, sample id, GC
/// count when sampled, and its header's class word and type (to know it again after a GC).
pub(super) struct Pending {
    pub object: VALUE,
    pub id: u64,
    pub gc: u64,
    pub klass: VALUE,
    pub type_id: u8,
}

pub(super) struct Site {
    pub counts: SiteCounts,
    pub frames: Vec<u32>,
    pub klass: VALUE,
    pub type_id: u8,
}

/// Everything the hooks keep.
pub(super) struct Tracker {
    pub rate_bytes: u64,
    /// The sample points and their weights (core's `allocs::points`), at most
    /// `max_per_second` samples a second (0: no cap).
    pub points: Points,
    pub max_per_second: u64,
    /// What samples may cost (core's `allocs::budget`), and the lowest cap it set.
    pub budget: Option<Budget>,
    pub lowest_cap: u64,
    /// (frame VALUE, line) of each distinct frame, and its index.
    pub frames: Vec<(VALUE, i32)>,
    pub frame_ids: HashMap<(VALUE, i32), u32>,
    pub sites: Vec<Site>,
    pub site_ids: HashMap<(Vec<u32>, VALUE, u8), u32>,
    pub live: LiveObjects,
    /// Where mark bits are on this Ruby; None: no liveness (every sample stays in use).
    pub marks: Option<MarkBits>,
    /// `rb_gc_count()` at the last marking checked.
    pub checked_gc: u64,
    pub sites_full: u64,
    pub live_full: u64,
    pub started: Instant,
    pub start_unix_ns: u64,
    pub running: bool,
    pub buf: Vec<VALUE>,
    pub lines: Vec<i32>,
    pub ids: Vec<u32>,
    pub slot_size: Option<unsafe extern "C" fn(VALUE) -> usize>,
    pub arm: Arm,
    /// Samples taken and markings that freed some: whether there is anything new to
    /// publish (publish.rs).
    pub changes: u64,
    /// Liveness from a weak map (live.rs): the samples the job has still to put there, as
    /// (address, id), and the next sample's id.
    pub weak: bool,
    pub pending: Vec<Pending>,
    pub next_id: u64,
    /// The live set's size after the last weak-map check.
    pub checked_len: usize,
}

impl Tracker {
    pub fn new(
        rate_bytes: u64,
        max_per_second: u64,
        marks: Option<MarkBits>,
        arm: Arm,
        weak: bool,
        budget: Option<Budget>,
    ) -> Self {
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0x9e37_79b9, |d| d.as_nanos() as u64)
            ^ (std::process::id() as u64) << 32;
        Tracker {
            rate_bytes: rate_bytes.max(1),
            points: Points::new(rate_bytes, max_per_second, seed),
            max_per_second,
            budget,
            lowest_cap: max_per_second,
            frames: Vec::new(),
            frame_ids: HashMap::default(),
            sites: Vec::new(),
            site_ids: HashMap::default(),
            live: LiveObjects::new(),
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
            changes: 0,
            weak,
            pending: Vec::new(),
            next_id: 0,
            checked_len: 0,
        }
    }

    /// The job: the cap follows what samples cost, as `spent` says (never above the cap
    /// asked for).
    pub fn follow_budget(&mut self, spent: Spent) {
        let Some(per_second) = self.budget.as_mut().and_then(|b| b.observe(spent)) else {
            return;
        };
        let cap = (per_second as u64).clamp(1, self.max_per_second);
        self.points.set_cap(cap);
        self.lowest_cap = self.lowest_cap.min(cap);
    }

    pub fn size_of(&self, object: VALUE) -> u64 {
        match self.slot_size {
            // SAFETY: Ruby's own function, called on an object just allocated.
            Some(f) => unsafe { f(object) as u64 },
            None => RVALUE_SIZE,
        }
    }

    /// NEWOBJ: counts the object's bytes; samples it when they cross the next point. True
    /// when the hook should be turned off (by the postponed job): the next point is far.
    pub fn allocated(&mut self, object: VALUE) -> bool {
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
        let Some(take) = self.points.counted(size) else {
            return false;
        };
        self.sample(object, klass, type_id, size, take);
        // While points are owed the hook stays on from sample to sample, so that the next
        // points pay them; the job turns it off when the next point is far all the same
        // (Arm::decide). The job runs soon after any sample anyway, to put it in the weak
        // map while it is whole.
        let far = self.points.owed() == 0 && self.arm.far(self.points.until());
        far || self.weak
    }

    /// Counts the object as `take` says: at its rate, and more than once for points owed.
    pub fn sample(&mut self, object: VALUE, klass: VALUE, type_id: u8, size: u64, take: Take) {
        let times = take.times;
        // SAFETY: the class of an object just allocated (a singleton class's real class).
        let real = unsafe { rb_sys::rb_class_real(klass) };
        let Some(site) = self.site_here(real, type_id) else {
            return;
        };
        self.changes += 1;
        super::stats::STATS
            .samples
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        for _ in 0..times {
            self.sites[site as usize].counts.add(size, take.rate);
        }
        let id = self.next_id;
        self.next_id += 1;
        let entry = Entry {
            site,
            size: size as u32,
            type_id,
            times,
            rate: take.rate,
            id,
            // SAFETY: reads the GC's count.
            gc: unsafe { rb_sys::rb_gc_count() } as u64,
        };
        if self.live.len() < MAX_LIVE {
            if let Some(old) = self.live.insert(object, entry) {
                self.free(old);
            }
            if self.weak {
                self.pending.push(Pending {
                    object,
                    id,
                    gc: entry.gc,
                    klass,
                    type_id,
                });
            }
        } else {
            self.live_full += 1;
            self.free(entry);
        }
    }

    /// The site of an object of class `klass` and type `type_id` allocated here: this
    /// thread's stack (`rb_profile_frames`), its frames kept once each. None past
    /// [`MAX_SITES`] sites, for a site not seen before.
    fn site_here(&mut self, klass: VALUE, type_id: u8) -> Option<u32> {
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
            Some(&site) => Some(site),
            None if self.sites.len() >= MAX_SITES => {
                self.sites_full += 1;
                None
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
                Some(site)
            }
        };
        self.ids = key.0;
        site
    }

    /// A sampled object is gone: its site's in-use counts drop it.
    pub fn free(&mut self, entry: Entry) {
        free_entry(&mut self.sites, entry);
    }

    /// GC_END_MARK: every sampled object the marking left unmarked is gone.
    pub fn marked(&mut self) {
        let Some(marks) = self.marks else { return };
        // SAFETY: reads the GC's count, inside its hook.
        let count = unsafe { rb_sys::rb_gc_count() } as u64;
        let direct = count == self.checked_gc.wrapping_add(1);
        self.checked_gc = count;
        let sites = &mut self.sites;
        let before = self.live.len();
        live::check(&mut self.live, &marks, direct, |e| free_entry(sites, e));
        if self.live.len() != before {
            self.changes += 1;
        }
    }
}

impl Tracker {
    /// Applies what the weak map said of each sample id (mod.rs's `follow_weak`): gone, or
    /// alive at an address. Samples taken since it looked stay as they are.
    pub fn follow_found(&mut self, found: &HashMap<u64, Option<VALUE>>) {
        let sites = &mut self.sites;
        let before = self.live.len();
        self.live.follow(
            |object, e| found.get(&e.id).copied().unwrap_or(Some(object)),
            |e| free_entry(sites, e),
        );
        if self.live.len() != before {
            self.changes += 1;
        }
        self.checked_len = self.live.len();
    }

    /// Each site's counts with Go's meaning of in use: the sampled objects a completed GC
    /// kept, those sampled before GC number `gc_count` started that are still here. Returns
    /// them, and how many live samples are newer.
    pub fn in_use(&self, gc_count: u64) -> (Vec<SiteCounts>, u64) {
        let mut sites: Vec<SiteCounts> = self.sites.iter().map(|s| s.counts.clone()).collect();
        for s in &mut sites {
            s.clear_live();
        }
        let mut unsettled = 0;
        for (_, e) in self.live.entries() {
            if e.gc < gc_count {
                sites[e.site as usize].add_live(e.size as u64, e.rate, e.times as u64);
            } else {
                unsettled += e.times as u64;
            }
        }
        (sites, unsettled)
    }
}

pub(super) fn free_entry(sites: &mut [Site], entry: Entry) {
    for _ in 0..entry.times {
        sites[entry.site as usize]
            .counts
            .free(entry.size as u64, entry.rate);
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
