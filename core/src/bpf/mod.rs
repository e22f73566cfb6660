//! The in-kernel sampler: a BPF program (core/bpf/sampler.bpf.c) on a `perf_event`
//! CPU-clock event per CPU copies the interrupted Ruby thread's frames, value stack, state
//! and tag table into a ring buffer without waking anyone; the recorder drains the ring
//! every `DRAIN_EVERY` (crate::record's `bpf.rs`) and resolves each copy through the spy's walker
//! (`Capture::resolve`). So a sample costs no thread wake-up and no
//! `process_vm_readv`; only a batch does.
//!
//! Everything here is released by `Drop`: the perf events and links, the program, its maps
//! and the statistics switch, whether the recording ends normally, by Ctrl-C (the CLI stops
//! the recorder) or with the target's exit. The kernel frees them too if the process dies.
mod record;

pub use record::Record;

use crate::error::{Error, Result};
use crate::spy::{CaptureLayout, CaptureThread};
use crate::sync::locked;
use libbpf_rs::{MapCore, MapFlags, ObjectBuilder};
use rustc_hash::FxHashSet;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The program, compiled by build.rs from core/bpf/sampler.bpf.c.
static OBJECT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/sampler.bpf.o"));

/// The program's name, as `bpftool prog show` lists it while a recording runs.
pub const PROGRAM: &str = "rbspy_sample";
/// How often the recorder drains the ring buffer before it knows how fast records come.
pub const DRAIN_EVERY: Duration = Duration::from_millis(50);
/// The longest and shortest drain periods once it knows: as long as half the ring holds,
/// within these (a drain costs a wake-up, ~90 µs of CPU on this VM, whatever it drains).
pub const DRAIN_LONGEST: Duration = Duration::from_millis(200);
pub const DRAIN_SHORTEST: Duration = Duration::from_millis(20);
/// The ring's size (`events` in core/bpf/sampler.bpf.c).
pub const RING_BYTES: u64 = 1 << 23;
/// Deepest stack copied, in frames (see `MAX_FRAME_BYTES` in core/bpf/sampler.h); deeper
/// stacks keep their innermost frames and end in a `[truncated]` frame.
pub const MAX_FRAMES: u64 = 512;
/// Bytes of control frames the program's record holds (`MAX_FRAME_BYTES`).
const MAX_FRAME_BYTES: u64 = 512 * 64;

/// The program's counters (`COUNT_*` in core/bpf/sampler.h).
const COUNT_UNKNOWN_THREAD: u32 = 0;
const COUNT_RING_FULL: u32 = 1;

/// What the kernel says the program cost, and what it could not record.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// `run_time_ns` and `run_cnt` of the program (bpf_stats), over every CPU and every
    /// process it ran for: the target's ticks and the others it filtered out.
    pub run_ns: u64,
    pub runs: u64,
    /// Ticks of a thread of the target that is no Ruby thread we know (a native thread of
    /// a C extension, Ruby's timer thread, or a Ruby thread started since the last refresh).
    pub unknown_thread: u64,
    /// Samples lost because the ring buffer was full.
    pub ring_full: u64,
}

/// A loaded, attached sampler of one process.
pub struct BpfSampler {
    // Fields drop in order: the ring buffer and links go before the object they use.
    ring: libbpf_rs::RingBuffer<'static>,
    _links: Vec<libbpf_rs::Link>,
    object: libbpf_rs::Object,
    /// The handler `drain` lends the ring's callback (see `Lent`).
    lent: Arc<Mutex<Lent>>,
    /// Keeps `kernel.bpf_stats_enabled` on while it is open.
    _stats: Option<OwnedFd>,
    /// The keys in the program's thread map: thread pointers, or `rb_thread_t *`s when
    /// `by_thread`.
    tids: FxHashSet<u64>,
    /// Whether the map is keyed by `rb_thread_t *` (M:N, `CaptureLayout::ec_tls`).
    by_thread: bool,
}

impl BpfSampler {
    /// Loads the program for process `pid` with its layout, and attaches it to a CPU-clock
    /// event on every online CPU at `rate_hz`. Every failure says what to do.
    pub fn start(pid: i32, rate_hz: f64, layout: &CaptureLayout) -> Result<BpfSampler> {
        let mut open = ObjectBuilder::default()
            .open_memory(OBJECT)
            .map_err(|e| unavailable(format!("libbpf could not open the program: {e}")))?;
        let cpus = libbpf_rs::num_possible_cpus()
            .map_err(|e| unavailable(format!("counting CPUs: {e}")))?;
        for mut map in open.maps_mut() {
            let name = map.name().to_string_lossy().into_owned();
            if name == "scratch" {
                map.set_max_entries(cpus as u32)
                    .map_err(|e| unavailable(format!("sizing the record buffers: {e}")))?;
            } else if name.ends_with(".rodata") {
                let data = map
                    .initial_value_mut()
                    .ok_or_else(|| unavailable("the program has no read-only data".into()))?;
                set_globals(data, pid, layout)?;
            }
        }
        let object = load(open)?;
        let stats = enable_stats();
        let links = attach(&object, rate_hz)?;
        let lent = Arc::new(Mutex::new(Lent::default()));
        let ring = ring_buffer(&object, lent.clone())?;
        Ok(BpfSampler {
            ring,
            _links: links,
            object,
            lent,
            _stats: stats,
            tids: FxHashSet::default(),
            by_thread: layout.ec_tls.is_some(),
        })
    }

    /// Makes the program's thread map hold exactly these threads (those with a known
    /// thread pointer, or every one when the map is keyed by `rb_thread_t *`): each one's
    /// `rb_thread_t *`, native tid (or 0) and its Ractor's GVL owner word.
    pub fn set_threads(&mut self, threads: &[CaptureThread]) -> Result<()> {
        // The map borrows the object, apart from the set of what it holds.
        let map = find_map(&self.object, "threads")?;
        let by_thread = self.by_thread;
        let threads: Vec<(u64, &CaptureThread)> = threads
            .iter()
            .filter_map(|t| {
                Some((
                    if by_thread {
                        t.thread
                    } else {
                        t.thread_pointer?
                    },
                    t,
                ))
            })
            .collect();
        let now: FxHashSet<u64> = threads.iter().map(|(tp, _)| *tp).collect();
        for gone in self.tids.difference(&now) {
            let _ = map.delete(&gone.to_ne_bytes());
        }
        // Whatever fails below, the map holds no more than `now` and what was there.
        self.tids.retain(|tp| now.contains(tp));
        for (tp, t) in threads {
            // struct ruby_thread in core/bpf/sampler.h.
            let mut value = [0u8; 24];
            value[..8].copy_from_slice(&t.thread.to_ne_bytes());
            value[8..12].copy_from_slice(&(t.info.tid.max(0) as u32).to_ne_bytes());
            value[16..24].copy_from_slice(&t.gvl_owner.to_ne_bytes());
            map.update(&tp.to_ne_bytes(), &value, MapFlags::ANY)
                .map_err(|e| unavailable(format!("updating the thread map: {e}")))?;
            self.tids.insert(tp);
        }
        Ok(())
    }

    /// Takes every record the ring holds and hands each to `f`, in the order they were
    /// written (the ring is shared by every CPU). Returns how many there were, and their
    /// bytes.
    pub fn drain(&mut self, mut f: impl FnMut(&Record)) -> (usize, u64) {
        let (mut n, mut bytes) = (0, 0);
        let mut each = |raw: &[u8]| {
            bytes += raw.len() as u64;
            if let Some(r) = Record::parse(raw) {
                f(&r);
                n += 1;
            }
        };
        let each: &mut dyn FnMut(&[u8]) = &mut each;
        // SAFETY: only the borrow's lifetime is erased. The pointer is used by the ring's
        // callback, which runs only inside the `consume` below, and `Taken` takes it out
        // of the slot before `each` goes out of scope, on a panic too.
        let each = unsafe {
            std::mem::transmute::<*mut (dyn FnMut(&[u8]) + '_), *mut (dyn FnMut(&[u8]) + 'static)>(
                each,
            )
        };
        locked(&self.lent).handler = Some(Handler(each));
        let taken = Taken(&self.lent);
        let _ = self.ring.consume();
        drop(taken);
        if let Some(panic) = locked(&self.lent).panic.take() {
            std::panic::resume_unwind(panic);
        }
        (n, bytes)
    }

    /// The program's cost so far and what it could not record.
    pub fn stats(&self) -> Stats {
        let mut s = Stats::default();
        if let Some(prog) = self.object.progs().find(|p| p.name() == PROGRAM) {
            let mut info = libbpf_sys::bpf_prog_info::default();
            let mut len = std::mem::size_of_val(&info) as u32;
            // SAFETY: the kernel writes at most `len` bytes of prog info into `info`.
            let rc = unsafe {
                libbpf_sys::bpf_prog_get_info_by_fd(
                    std::os::fd::AsRawFd::as_raw_fd(&std::os::fd::AsFd::as_fd(&prog)),
                    &mut info,
                    &mut len,
                )
            };
            if rc == 0 {
                s.run_ns = info.run_time_ns;
                s.runs = info.run_cnt;
            }
        }
        if let Ok(map) = self.map("counters") {
            let total = |which: u32| -> u64 {
                map.lookup_percpu(&which.to_ne_bytes(), MapFlags::ANY)
                    .ok()
                    .flatten()
                    .map(|cpus| {
                        cpus.iter()
                            .filter_map(|v| v.get(..8)?.try_into().ok())
                            .map(u64::from_ne_bytes)
                            .sum()
                    })
                    .unwrap_or(0)
            };
            s.unknown_thread = total(COUNT_UNKNOWN_THREAD);
            s.ring_full = total(COUNT_RING_FULL);
        }
        s
    }

    fn map(&self, name: &str) -> Result<libbpf_rs::Map<'_>> {
        find_map(&self.object, name)
    }
}

fn find_map<'a>(object: &'a libbpf_rs::Object, name: &str) -> Result<libbpf_rs::Map<'a>> {
    object
        .maps()
        .find(|m| m.name() == name)
        .ok_or_else(|| unavailable(format!("the program has no map {name}")))
}

fn unavailable(reason: String) -> Error {
    Error::BpfUnavailable(reason)
}

/// What can be told before libbpf tries: privilege and BTF.
pub(crate) fn preflight() -> Result<()> {
    if !std::path::Path::new("/sys/kernel/btf/vmlinux").exists() {
        return Err(unavailable(
            "this kernel has no BTF (/sys/kernel/btf/vmlinux is missing; it needs \
             CONFIG_DEBUG_INFO_BTF=y, as Debian, Ubuntu and Fedora kernels have): record \
             without --bpf"
                .into(),
        ));
    }
    if !privileged() {
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        return Err(unavailable(format!(
            "loading a BPF program needs root, or CAP_BPF and CAP_PERFMON, and this process \
             (uid {uid}) has neither: run it with sudo, or grant the capabilities (e.g. \
             `setcap cap_bpf,cap_perfmon+ep` on the binary, `--cap-add BPF --cap-add \
             PERFMON` in a container); without them record without --bpf"
        )));
    }
    Ok(())
}

/// Root, or both CAP_BPF (39) and CAP_PERFMON (38) effective (CAP_SYS_ADMIN covers both).
fn privileged() -> bool {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    let has = |cap: u32| eff & (1 << cap) != 0;
    has(21) || (has(39) && has(38))
}

/// Writes the read-only globals (`const volatile` in sampler.bpf.c) before load.
fn set_globals(data: &mut [u8], pid: i32, l: &CaptureLayout) -> Result<()> {
    use crate::context::{otel_thread, profiler_state};
    type Rodata = crate::bpf::skel::types::rodata;
    if data.len() < std::mem::size_of::<Rodata>() {
        return Err(unavailable(
            "the program's read-only data is too small".into(),
        ));
    }
    let max_frames = (MAX_FRAMES * l.cfp_size).min(MAX_FRAME_BYTES);
    // SAFETY: `data` is the map's initial value, at least as large as `Rodata` (checked),
    // and `Rodata` is plain integers (any bytes are valid); read_unaligned/write_unaligned
    // make no assumption about the buffer's alignment.
    unsafe {
        let p = data.as_mut_ptr() as *mut Rodata;
        let mut r = std::ptr::read_unaligned(p);
        r.target_tgid = pid as u32;
        let (dev, ino) = pid_namespace()?;
        r.pidns_dev = dev;
        r.pidns_ino = ino;
        r.thread_ec = l.thread_ec;
        r.thread_nt = l.thread_nt;
        r.nt_thread_id = l.nt_thread_id;
        r.ec_vm_stack = l.ec_vm_stack;
        r.cfp_size = l.cfp_size;
        r.cfp_sp = l.cfp_sp;
        r.cfp_ep = l.cfp_ep;
        r.max_frame_bytes = max_frames - max_frames % l.cfp_size.max(1);
        r.gvl_owner_addr = l.gvl_owner;
        r.gc_flags_addr = l.gc_flags;
        // The thread pointer is read as %fs base: x86-64 only (sampler.bpf.c).
        r.tag_offset = if cfg!(target_arch = "x86_64") {
            l.tag_offset.unwrap_or(0)
        } else {
            0
        };
        r.tag_owner_offset = if cfg!(target_arch = "x86_64") {
            l.tag_owner_offset.unwrap_or(0)
        } else {
            0
        };
        r.otel_offset = if cfg!(target_arch = "x86_64") {
            l.otel_offset.unwrap_or(0)
        } else {
            0
        };
        r.otel_head_len = otel_thread::HEAD_LEN as u64;
        r.otel_attrs_size_at = otel_thread::ATTRS_SIZE_AT as u64;
        r.tag_header_len = profiler_state::HEADER_LEN as u64;
        r.tag_pair_len = profiler_state::PAIR_LEN as u64;
        let (ec_tls_offset, ec_thread_ptr) = l.ec_tls.unwrap_or((0, 0));
        r.ec_tls_offset = ec_tls_offset;
        r.ec_thread_ptr = ec_thread_ptr;
        std::ptr::write_unaligned(p, r);
    }
    Ok(())
}

/// The device and inode of this process's PID namespace, in which the target's pid is
/// given.
fn pid_namespace() -> Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let ns = std::fs::metadata("/proc/self/ns/pid")
        .map_err(|e| unavailable(format!("reading /proc/self/ns/pid: {e}")))?;
    Ok((ns.dev(), ns.ino()))
}

/// Loads the program, with the verifier's last words in the error when it refuses it.
fn load(open: libbpf_rs::OpenObject) -> Result<libbpf_rs::Object> {
    static LOG: Mutex<String> = Mutex::new(String::new());
    fn keep(_: libbpf_rs::PrintLevel, msg: String) {
        if let Ok(mut log) = LOG.lock() {
            log.push_str(&msg);
        }
    }
    if let Ok(mut log) = LOG.lock() {
        log.clear();
    }
    // libbpf prints to stderr by default; its messages belong in our error instead.
    let before = libbpf_rs::set_print(Some((libbpf_rs::PrintLevel::Warn, keep)));
    let loaded = open.load();
    libbpf_rs::set_print(before);
    loaded.map_err(|e| {
        let log = LOG.lock().map(|l| l.clone()).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(6).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        let denied = matches!(e.kind(), libbpf_rs::ErrorKind::PermissionDenied);
        unavailable(if denied {
            format!(
                "the kernel refused to load the program ({e}): loading BPF needs root or \
                 CAP_BPF and CAP_PERFMON, and may be switched off \
                 (kernel.unprivileged_bpf_disabled, a seccomp or LSM policy)"
            )
        } else {
            format!(
                "the kernel refused the program ({e}); libbpf said: {}",
                tail.join(" | ")
            )
        })
    })
}

/// `kernel.bpf_stats_enabled` on for as long as the returned descriptor is open (the kernel
/// counts it down when it closes): run_time_ns and run_cnt are counted only meanwhile.
fn enable_stats() -> Option<OwnedFd> {
    // SAFETY: plain syscall wrapper; a non-negative result is a descriptor we now own.
    let fd = unsafe { libbpf_sys::bpf_enable_stats(libbpf_sys::BPF_STATS_RUN_TIME) };
    // SAFETY: `fd` was just returned to us and is owned by nobody else.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A CPU-clock perf event at `rate_hz` on every online CPU, each running the program.
fn attach(object: &libbpf_rs::Object, rate_hz: f64) -> Result<Vec<libbpf_rs::Link>> {
    let prog = object
        .progs_mut()
        .find(|p| p.name() == PROGRAM)
        .ok_or_else(|| unavailable("the object has no sampling program".into()))?;
    let period_ns = (1e9 / rate_hz).round().max(1.0) as u64;
    let mut links = Vec::new();
    for cpu in online_cpus() {
        let fd = perf_event_open(cpu, period_ns).map_err(|e| {
            unavailable(format!(
                "perf_event_open on CPU {cpu} failed ({e}): sampling every CPU needs root or \
                 CAP_PERFMON (kernel.perf_event_paranoid is {})",
                std::fs::read_to_string("/proc/sys/kernel/perf_event_paranoid")
                    .map(|s| s.trim().to_string())
                    .unwrap_or_else(|_| "unknown".into())
            ))
        })?;
        // The link owns the event's descriptor from here on: destroying it closes it.
        let link = prog.attach_perf_event(fd).map_err(|e| {
            // SAFETY: the attach failed, so `fd` is still ours alone to close.
            unsafe { libc::close(fd) };
            unavailable(format!("attaching the program to CPU {cpu}'s event: {e}"))
        })?;
        links.push(link);
    }
    if links.is_empty() {
        return Err(unavailable("no online CPU to sample".into()));
    }
    Ok(links)
}

fn online_cpus() -> Vec<usize> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap_or_default();
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let mut ends = part.split('-').filter_map(|n| n.parse::<usize>().ok());
        if let Some(a) = ends.next() {
            cpus.extend(a..=ends.next().unwrap_or(a));
        }
    }
    cpus
}

fn perf_event_open(cpu: usize, period_ns: u64) -> std::io::Result<i32> {
    let mut attr = libbpf_sys::perf_event_attr {
        type_: libbpf_sys::PERF_TYPE_SOFTWARE,
        size: std::mem::size_of::<libbpf_sys::perf_event_attr>() as u32,
        config: libbpf_sys::PERF_COUNT_SW_CPU_CLOCK as u64,
        ..Default::default()
    };
    attr.__bindgen_anon_1.sample_period = period_ns;
    // SAFETY: perf_event_open reads one perf_event_attr, which lives for the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            &attr as *const libbpf_sys::perf_event_attr,
            -1i32,
            cpu as i32,
            -1i32,
            libbpf_sys::PERF_FLAG_FD_CLOEXEC as libc::c_ulong,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fd as i32)
}

/// What the ring's callback hands each record to. The callback is registered once, for the
/// sampler's life, and can borrow nothing: `drain` lends it its handler for one `consume`,
/// so that records are resolved where the program wrote them. (Copied out first, at 10 kHz
/// the copy of each record's value stack was 40 % of the recorder's time.)
#[derive(Default)]
struct Lent {
    handler: Option<Handler>,
    /// A panic of the handler, caught in the callback (it must not unwind through libbpf)
    /// and resumed by `drain`.
    panic: Option<Box<dyn std::any::Any + Send>>,
}

#[derive(Clone, Copy)]
struct Handler(*mut dyn FnMut(&[u8]));

// SAFETY: a `Handler` is set, used and taken back by the one thread inside `drain`.
unsafe impl Send for Handler {}

/// Takes the lent handler back when dropped.
struct Taken<'a>(&'a Mutex<Lent>);

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        locked(self.0).handler = None;
    }
}

/// A reader of the program's ring buffer whose callback hands each record, in place, to the
/// handler `drain` lent it.
fn ring_buffer(
    object: &libbpf_rs::Object,
    lent: Arc<Mutex<Lent>>,
) -> Result<libbpf_rs::RingBuffer<'static>> {
    let map = object
        .maps()
        .find(|m| m.name() == "events")
        .ok_or_else(|| unavailable("the program has no ring buffer".into()))?;
    let mut builder = libbpf_rs::RingBufferBuilder::new();
    builder
        .add(&map, move |data: &[u8]| {
            let mut lent = locked(&lent);
            let Some(Handler(each)) = lent.handler else {
                return 1; // not inside `drain`: leave the record in the ring
            };
            // SAFETY: `drain` set the pointer for this `consume` and takes it back after.
            let run = std::panic::AssertUnwindSafe(|| unsafe { (*each)(data) });
            match std::panic::catch_unwind(run) {
                Ok(()) => 0,
                Err(panic) => {
                    lent.panic = Some(panic);
                    lent.handler = None;
                    1
                }
            }
        })
        .map_err(|e| unavailable(format!("reading the ring buffer: {e}")))?;
    builder
        .build()
        .map_err(|e| unavailable(format!("reading the ring buffer: {e}")))
}

#[allow(clippy::all, clippy::pedantic, unused_imports, dead_code)]
mod skel {
    include!(concat!(env!("OUT_DIR"), "/sampler.skel.rs"));
}
