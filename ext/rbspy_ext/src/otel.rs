//! OpenTelemetry's context for readers outside the process: the writer's half.
//!
//! - **Thread context (OTEP 4947).** Each `RubySpy::State` (state.rs) carries, while the
//!   bridge is on, a record in the OTEP's layout (`rbspy_ext_core::context::otel_thread`):
//!   the trace and span current when it was made, and as attributes the local root span's
//!   name (`trace endpoint`), its id (`local root span id`) and the state's tags. The
//!   exported thread-local `otel_thread_ctx_v1` (profiler_state.c) points at the current
//!   fiber's record, switched with `ruby_profiler_state` on every fiber switch. The bridge
//!   (lib/rbspy_ext/otel.rb) calls `NativeOTel.trace` (current.rs) when the SDK attaches a
//!   context, which makes a State with the new trace and the current tags. This file
//!   depends on neither: it is what a State's record is made of.
//! - **Process context (OTEP 4719).** A mapping named `OTEL_CTX` (a memfd, else a named
//!   anonymous mapping) holds the header and, after it, the payload: the SDK's resource
//!   attributes, `threadlocal.schema_version` and `threadlocal.attribute_key_map`, the names
//!   a record's key indexes stand for (`rbspy_ext_core::context::otel_process`). It is
//!   published again when the resource changes or a tag name joins the key map, and anew in
//!   a forked child (the mapping is not inherited: `MADV_DONTFORK`).
use magnus::rb_sys::{AsRawValue, FromRawValue};
use magnus::{prelude::*, RString, Symbol, Value};
use rb_sys::{ID, VALUE};
use rbspy_ext_core::context::otel_process::{self, Header};
use rbspy_ext_core::context::otel_thread::{hex, Record, ENDPOINT_KEY, LOCAL_ROOT_KEY};
use rbspy_ext_core::sync::locked;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// The span current when a State was made: what its record says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub flags: u8,
    /// The first span of this trace in this process (the request's), and its name.
    pub local_root_span_id: Option<[u8; 8]>,
    pub endpoint: Option<String>,
}

/// The latest endpoint of each local root span the bridge named, newest last: a State kept
/// from before its root was renamed (the one `RubySpy.tag` puts back when its block ends,
/// made before ActionPack routed the request) is put back with the endpoint of now
/// (`current::refreshed`), not "GET" again.
static ENDPOINTS: Mutex<Vec<([u8; 8], Option<String>)>> = Mutex::new(Vec::new());
/// Roots whose endpoint is kept: the requests in flight, and more.
const ENDPOINTS_KEPT: usize = 256;

/// Notes `trace`'s endpoint as its local root's latest.
pub fn note_endpoint(trace: &Trace) {
    let Some(root) = trace.local_root_span_id else {
        return;
    };
    let mut kept = locked(&ENDPOINTS);
    if let Some(i) = kept.iter().rposition(|(r, _)| *r == root) {
        if kept[i].1 == trace.endpoint {
            return;
        }
        kept.remove(i);
    } else if kept.len() >= ENDPOINTS_KEPT {
        kept.remove(0);
    }
    kept.push((root, trace.endpoint.clone()));
}

/// `trace` with its local root's latest endpoint, when that is another one.
pub fn renamed(trace: &Trace) -> Option<Trace> {
    let root = trace.local_root_span_id?;
    let kept = locked(&ENDPOINTS);
    let (_, latest) = kept.iter().rev().find(|(r, _)| *r == root)?;
    (*latest != trace.endpoint).then(|| Trace {
        endpoint: latest.clone(),
        ..trace.clone()
    })
}

/// Whether States carry records: from the bridge's first publication of the process context.
static ON: AtomicBool = AtomicBool::new(false);
/// Whether States made now carry records.
pub fn is_on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Tags left out of records: their name came after the key map's 256 entries were taken.
static KEYS_FULL: AtomicU64 = AtomicU64::new(0);
/// Entries of records that would have taken a record past the OTEP's 640 bytes.
static LEFT_OUT: AtomicU64 = AtomicU64::new(0);

/// What the process context says, and where it is written.
struct Published {
    /// The SDK's resource attributes.
    resource: Vec<(String, String)>,
    /// OTEP 4947's `threadlocal.attribute_key_map`: append-only.
    keys: Vec<String>,
    mapping: Option<Mapping>,
    /// The last `published_at_ns` written: each publication's is later.
    last_ns: u64,
}

/// The `OTEL_CTX` mapping: a header, then the payload.
struct Mapping {
    at: *mut u8,
    pid: u32,
}

// SAFETY: the mapping's address is only used under `PUBLISHED`'s lock.
unsafe impl Send for Mapping {}

/// The mapping's size: a resource and a key map take a few hundred bytes; a payload that
/// outgrows this is not published (counted in `TOO_LARGE`).
const MAPPING_LEN: usize = 64 << 10;
static TOO_LARGE: AtomicU64 = AtomicU64::new(0);

static PUBLISHED: Mutex<Published> = Mutex::new(Published {
    resource: Vec::new(),
    keys: Vec::new(),
    mapping: None,
    last_ns: 0,
});

fn published() -> MutexGuard<'static, Published> {
    locked(&PUBLISHED)
}

/// The OTEP 4947 record of a State holding `pairs` under `trace`, or None while the bridge
/// is off. With the GVL (tag names and values are read through Ruby).
pub fn record(pairs: &[(ID, VALUE)], trace: Option<&Trace>) -> Option<Box<[u16]>> {
    if !is_on() {
        return None;
    }
    let mut r = Record::default();
    if let Some(t) = trace {
        (r.trace_id, r.span_id, r.trace_flags) = (t.trace_id, t.span_id, t.flags);
        if let Some(endpoint) = &t.endpoint {
            r.attrs.push((ENDPOINT_KEY.0, endpoint.clone()));
        }
        if let Some(root) = t.local_root_span_id {
            r.attrs.push((LOCAL_ROOT_KEY.0, hex(&root)));
        }
    }
    if !pairs.is_empty() {
        // Names and texts before the lock: `to_s` runs Ruby, which may switch threads, and
        // another thread making a record would then wait for the lock holding the GVL, and
        // this one for the GVL holding the lock (seen: spec/fork_spec.rb's tagging threads
        // hung once records were on).
        let texts: Vec<(String, String)> = pairs
            .iter()
            // SAFETY: IDs of Symbols and VALUEs the State keeps alive, with the GVL.
            .map(|&(id, value)| unsafe { (id_name(id), value_text(value)) })
            .collect();
        let mut p = published();
        let before = p.keys.len();
        for (name, text) in texts {
            match key_index(&mut p.keys, &name) {
                Some(key) => r.attrs.push((key, text)),
                None => _ = KEYS_FULL.fetch_add(1, Ordering::Relaxed),
            }
        }
        if p.keys.len() != before {
            write(&mut p);
        }
    }
    let (bytes, left_out) = r.encode();
    LEFT_OUT.fetch_add(left_out as u64, Ordering::Relaxed);
    let mut words = vec![0u16; bytes.len().div_ceil(2)].into_boxed_slice();
    for (i, pair) in bytes.chunks(2).enumerate() {
        words[i] = u16::from_ne_bytes([pair[0], *pair.get(1).unwrap_or(&0)]);
    }
    Some(words)
}

/// The index of `name` in the key map, appended if new; None once 256 are taken.
fn key_index(keys: &mut Vec<String>, name: &str) -> Option<u8> {
    if let Some(i) = keys.iter().position(|k| k == name) {
        return Some(i as u8);
    }
    if keys.len() > u8::MAX as usize {
        return None;
    }
    keys.push(name.to_string());
    Some((keys.len() - 1) as u8)
}

/// A tag's name.
unsafe fn id_name(id: ID) -> String {
    // SAFETY: an ID of a Symbol the State pinned.
    let sym = unsafe { Value::from_raw(rb_sys::rb_id2sym(id)) };
    Symbol::from_value(sym)
        .and_then(|s| s.name().ok().map(|n| n.into_owned()))
        .unwrap_or_default()
}

/// A tag's value as text: Strings, Symbols, numbers, true, false and nil as `to_s` gives
/// them (none of those can run app code), any other object as its class's name.
unsafe fn value_text(value: VALUE) -> String {
    // SAFETY: a VALUE the State keeps alive, with the GVL.
    let v = unsafe { Value::from_raw(value) };
    let plain = RString::from_value(v).is_some()
        || Symbol::from_value(v).is_some()
        || magnus::Integer::from_value(v).is_some()
        || magnus::Float::from_value(v).is_some()
        || v.is_nil()
        || v.as_raw() == rb_sys::Qtrue as VALUE
        || v.as_raw() == rb_sys::Qfalse as VALUE;
    if plain {
        if let Ok(text) = v.to_s() {
            return text.into_owned();
        }
    }
    // SAFETY: the class name of a live object.
    unsafe { v.classname() }.into_owned()
}

/// Publishes the process context with these resource attributes (`NativeOTel.publish_process`),
/// and turns records on.
pub(crate) fn publish_process(resource: Vec<(String, String)>) {
    let mut p = published();
    if p.keys.is_empty() {
        // At the indexes the readers expect them (`ENDPOINT_KEY.0`, `LOCAL_ROOT_KEY.0`).
        p.keys = vec![ENDPOINT_KEY.1.to_string(), LOCAL_ROOT_KEY.1.to_string()];
    }
    p.resource = resource;
    write(&mut p);
    ON.store(true, Ordering::Relaxed);
}

/// The key map as published.
pub(crate) fn key_map() -> Vec<String> {
    published().keys.clone()
}

/// Tags left out (key map full), entries left out (record full), payloads too large to
/// publish.
pub(crate) fn stats() -> (u64, u64, u64) {
    (
        KEYS_FULL.load(Ordering::Relaxed),
        LEFT_OUT.load(Ordering::Relaxed),
        TOO_LARGE.load(Ordering::Relaxed),
    )
}

/// Where the OTEL_CTX mapping is (0: none yet).
pub(crate) fn address() -> u64 {
    published().mapping.as_ref().map_or(0, |m| m.at as u64)
}

/// Writes the process context: the payload after the header, under the OTEP's update
/// protocol (the signature last the first time; `published_at_ns` 0 while the payload
/// changes after that). Nothing is written when no mapping can be made.
fn write(p: &mut Published) {
    let payload = otel_process::encode_resource(&p.resource, &p.keys);
    if payload.len() > MAPPING_LEN - otel_process::HEADER_LEN {
        TOO_LARGE.fetch_add(1, Ordering::Relaxed);
        return;
    }
    // A mapping made before a fork is not in the child (MADV_DONTFORK): the child makes its own.
    if p.mapping
        .as_ref()
        .is_some_and(|m| m.pid != std::process::id())
    {
        p.mapping = None;
    }
    let first = p.mapping.is_none();
    if first {
        match map() {
            Some(at) => {
                p.mapping = Some(Mapping {
                    at,
                    pid: std::process::id(),
                })
            }
            None => return,
        }
    }
    let Some(at) = p.mapping.as_ref().map(|m| m.at) else {
        return;
    };
    let now = now_ns().max(p.last_ns + 1);
    p.last_ns = now;
    let header = Header {
        version: otel_process::VERSION,
        payload_size: payload.len() as u32,
        published_at_ns: now,
        payload: at as u64 + otel_process::HEADER_LEN as u64,
    };
    let bytes = header.encode();
    use std::sync::atomic::{fence, Ordering::SeqCst};
    // SAFETY: `at` is our mapping of MAPPING_LEN bytes, written only under the lock.
    unsafe {
        let published_at = at.add(otel_process::PUBLISHED_AT) as *mut u64;
        if !first {
            std::ptr::write_volatile(published_at, 0);
            fence(SeqCst);
        }
        let payload_at = at.add(otel_process::HEADER_LEN);
        std::ptr::copy_nonoverlapping(payload.as_ptr(), payload_at, payload.len());
        // version, payload_size; then the payload pointer.
        std::ptr::copy_nonoverlapping(bytes[8..16].as_ptr(), at.add(8), 8);
        std::ptr::copy_nonoverlapping(bytes[24..32].as_ptr(), at.add(24), 8);
        fence(SeqCst);
        std::ptr::write_volatile(published_at, now);
        if first {
            fence(SeqCst);
            std::ptr::copy_nonoverlapping(bytes[..8].as_ptr(), at, 8);
        }
        name_mapping(at);
    }
}

/// A new OTEL_CTX mapping: a memfd (`/memfd:OTEL_CTX` in the maps), else an anonymous
/// mapping named by `prctl` where the kernel can; not inherited by a fork.
fn map() -> Option<*mut u8> {
    // SAFETY: plain system calls on a descriptor and a mapping this function owns.
    unsafe {
        let fd = libc::memfd_create(c"OTEL_CTX".as_ptr(), libc::MFD_CLOEXEC);
        let at = if fd >= 0 && libc::ftruncate(fd, MAPPING_LEN as libc::off_t) == 0 {
            let at = libc::mmap(
                std::ptr::null_mut(),
                MAPPING_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            libc::close(fd);
            at
        } else {
            if fd >= 0 {
                libc::close(fd);
            }
            libc::mmap(
                std::ptr::null_mut(),
                MAPPING_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if at == libc::MAP_FAILED {
            return None;
        }
        libc::madvise(at, MAPPING_LEN, libc::MADV_DONTFORK);
        Some(at as *mut u8)
    }
}

/// Names the mapping `OTEL_CTX` for readers of the maps (Linux 5.17+ with
/// CONFIG_ANON_VMA_NAME; an error otherwise, which the OTEP says to ignore).
unsafe fn name_mapping(at: *mut u8) {
    const PR_SET_VMA: libc::c_int = 0x53564d41;
    const PR_SET_VMA_ANON_NAME: libc::c_ulong = 0;
    // SAFETY: names our own mapping; the name is a static C string.
    unsafe {
        libc::prctl(
            PR_SET_VMA,
            PR_SET_VMA_ANON_NAME,
            at as libc::c_ulong,
            MAPPING_LEN as libc::c_ulong,
            c"OTEL_CTX".as_ptr() as libc::c_ulong,
        )
    };
}

fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
}

/// In a forked child, publishes the process context anew (the parent's mapping is not
/// inherited).
pub(crate) fn after_fork() {
    let mut p = published();
    if ON.load(Ordering::Relaxed) {
        p.mapping = None;
        write(&mut p);
    }
}
