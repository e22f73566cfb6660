//! `RubySpy::NativeAllocations`: sampled allocation tracking in this process (the hooks and
//! what they keep are tracker/), its snapshots (`NativeAllocationProfile`, alloc_profile.rs)
//! with frames and classes named, made with the GVL and outside any hook, and the blob it
//! publishes for readers outside (tracker/publish.rs). The Ruby API is
//! lib/rbspy_ext/allocations.rb.
use crate::alloc_profile::NativeAllocationProfile;
use crate::tracker::{self, debug, Copied, MAX_LIVE, MAX_SITES};
use magnus::rb_sys::FromRawValue;
use magnus::{function, prelude::*, Error, RString, Ruby};
use rb_sys::VALUE;
use rbspy_ext_core::allocs::published::{LiveSample, LiveSet};
use rbspy_ext_core::allocs::{pprof, AllocProfile};
use rbspy_ext_core::census::TYPE_NAMES;
use rbspy_ext_core::model::Frame;
use rbspy_ext_core::serve::{provide_allocations, AllocsAnswer, AllocsRequest};
use rbspy_ext_core::sync::locked;
use rustc_hash::FxHashMap as HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// `NativeAllocations.start(rate_bytes, max_per_second, max_cpu)`: starts tracking anew (what
/// an earlier run counted is dropped), at most `max_per_second` samples a second (0: no cap),
/// and fewer when they would cost more than `max_cpu` of a core (0: no such budget).
fn start(ruby: &Ruby, rate_bytes: u64, max_per_second: u64, max_cpu: f64) -> Result<(), Error> {
    if rate_bytes == 0 {
        return Err(Error::new(
            ruby.exception_arg_error(),
            "rate must be at least 1 byte (1: every allocation)",
        ));
    }
    if !(0.0..=1.0).contains(&max_cpu) {
        return Err(Error::new(
            ruby.exception_arg_error(),
            format!("max_cpu is a share of one core, from 0 (no budget) to 1, got {max_cpu}"),
        ));
    }
    tracker::start(rate_bytes, max_per_second, max_cpu, ruby_version());
    Ok(())
}

/// `RUBY_VERSION`, read once when the extension loads: the postponed job must not evaluate
/// Ruby code (compiling an eval there, in the middle of a `require`, crashed Ruby 3.3).
static RUBY_VERSION: std::sync::OnceLock<String> = std::sync::OnceLock::new();

fn ruby_version() -> &'static str {
    RUBY_VERSION.get().map_or("", String::as_str)
}

/// One raw frame's label, path (None for a C function) and absolute path.
fn frame_names(frame: VALUE) -> (String, Option<String>, Option<String>) {
    let text = |v: VALUE| -> Option<String> {
        // SAFETY: a VALUE Ruby just returned, read as a String when it is one.
        let value = unsafe { magnus::Value::from_raw(v) };
        RString::from_value(value).and_then(|s| s.to_string().ok())
    };
    // SAFETY: with the GVL, outside any hook; the frame is kept alive (marked) by the
    // tracker.
    unsafe {
        (
            text(debug::rb_profile_frame_full_label(frame)).unwrap_or_default(),
            text(debug::rb_profile_frame_path(frame)),
            text(debug::rb_profile_frame_absolute_path(frame)),
        )
    }
}

fn class_name(klass: VALUE) -> String {
    // SAFETY: a class the tracker keeps alive; rb_class_path names an anonymous one too.
    let path = unsafe { rb_sys::rb_class_path(klass) };
    // SAFETY: rb_class_path returns a String.
    let path = unsafe { magnus::Value::from_raw(path) };
    RString::from_value(path)
        .and_then(|s| s.to_string().ok())
        .unwrap_or_default()
}

/// The tracker's counts as an `AllocProfile` (see `named`), or None before any tracking.
fn snapshot() -> Option<NativeAllocationProfile> {
    let copied = tracker::copy(tracker::Take::Counts)?;
    let profile = named(copied, ruby_version().to_string());
    Some(NativeAllocationProfile(Arc::new(profile)))
}

/// Names of frames already named in this tracking run (by frame index: the tracker only
/// appends frames during a run), so that publishing once a second names only new ones.
type Names = (String, Option<String>, Option<String>);
static NAMED: Mutex<(u64, Vec<Names>)> = Mutex::new((0, Vec::new()));

fn frame_names_of(run: u64, frames: &[(VALUE, i32)]) -> Vec<Names> {
    let mut named = locked(&NAMED);
    if named.0 != run || named.1.len() > frames.len() {
        *named = (run, Vec::with_capacity(frames.len()));
    }
    let known = named.1.len();
    for &(frame, _) in &frames[known..] {
        named.1.push(frame_names(frame));
    }
    named.1.clone()
}

/// The copied counts with names: frames named as snapshots name them (a C function at its
/// caller's path and line), classes by their path.
fn named(copied: Copied, version: String) -> AllocProfile {
    let raw = frame_names_of(copied.start_unix_ns, &copied.frames);
    let mut frames: Vec<Frame> = Vec::new();
    let mut frame_ids: HashMap<Frame, u32> = HashMap::default();
    let mut sites = Vec::with_capacity(copied.sites.len());
    let mut class_names: HashMap<VALUE, String> = HashMap::default();
    for (mut counts, ids, klass, type_id) in copied.sites {
        let mut resolved = Vec::with_capacity(ids.len());
        for (i, &id) in ids.iter().enumerate() {
            let (label, path, absolute) = &raw[id as usize];
            let line = copied.frames[id as usize].1;
            // A C function has no file: it is shown at its caller's, as Ruby shows it.
            let caller = ids[i + 1..].iter().find_map(|&c| {
                raw[c as usize]
                    .1
                    .clone()
                    .map(|p| (p, copied.frames[c as usize].1))
            });
            let (frame_path, frame_line, c_function) = match (path, caller) {
                (Some(p), _) => (p.clone(), line, false),
                (None, Some((p, l))) => (p, l, true),
                (None, None) => (String::new(), 0, true),
            };
            let frame = Frame {
                base_label: Arc::from(label.rsplit(['#', '.', ' ']).next().unwrap_or(label)),
                label: Arc::from(label.as_str()),
                path: Arc::from(frame_path),
                absolute_path: absolute.as_deref().map(Arc::from),
                lineno: frame_line,
                c_function,
            };
            let next = frames.len() as u32;
            let fid = *frame_ids.entry(frame.clone()).or_insert(next);
            if fid == next {
                frames.push(frame);
            }
            resolved.push(fid);
        }
        counts.frames = resolved;
        counts.class = class_names
            .entry(klass)
            .or_insert_with(|| class_name(klass))
            .clone();
        counts.type_name = TYPE_NAMES[type_id as usize & 0x1f].to_string();
        sites.push(counts);
    }
    AllocProfile {
        pid: std::process::id() as i32,
        ruby_version: version,
        rate_bytes: copied.rate_bytes,
        start_unix_ns: copied.start_unix_ns,
        duration_ns: copied.duration_ns,
        frames,
        sites,
        notes: copied.notes,
    }
}

/// Makes the blob readers outside read (tracker/publish.rs calls it from the postponed job
/// and when tracking stops): the named profile, each site's class and type, and the live
/// samples, copied at one moment.
fn publish() {
    let Some(mut copied) = tracker::copy(tracker::Take::WithLive) else {
        return;
    };
    let version = ruby_version().to_string();
    let site_classes: Vec<(u64, u8)> = (copied.sites.iter())
        .map(|&(_, _, klass, type_id)| (klass, type_id))
        .collect();
    let live = (std::mem::take(&mut copied.live).into_iter())
        .map(|(address, site, size, times, rate)| LiveSample {
            address,
            site,
            size,
            times,
            rate,
        })
        .collect();
    let running = copied.running;
    let published_at_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let set = LiveSet {
        tracking: running,
        published_at_ms,
        profile: named(copied, version),
        site_classes,
        live,
    };
    tracker::store(set.encode());
}

/// What the pprof listener serves from the tracker (core/src/serve/tracked.rs): asked on the
/// listener's thread, made by the postponed job on a Ruby thread.
fn serve(request: AllocsRequest) -> AllocsAnswer {
    if !tracker::tracking() {
        return AllocsAnswer::NotTracking;
    }
    let made: Option<Result<Vec<u8>, String>> = tracker::with_gvl(
        move || {
            // On a Ruby thread with the GVL (the postponed job), or not at all.
            Ruby::get().map_err(|e| e.to_string())?;
            if request.gc {
                tracker::collect();
            }
            let profile = snapshot().ok_or("tracking stopped")?;
            let mut body = Vec::new();
            pprof::write(&profile.0, request.opens, &mut body)?;
            Ok(body)
        },
        SERVE_TIMEOUT,
    );
    match made {
        Some(Ok(body)) => AllocsAnswer::Profile(body),
        Some(Err(e)) => AllocsAnswer::Unavailable(format!("cannot make the profile: {e}")),
        None => AllocsAnswer::Unavailable(format!(
            "no Ruby thread took the request within {} s (a C call holding the GVL?), or \
             this Ruby (2.7) cannot be asked from the listener's thread: try again, or \
             write RubySpy.allocations from the app",
            SERVE_TIMEOUT.as_secs()
        )),
    }
}

/// `NativeAllocations.stats`: what the tracker's machinery did since tracking started, as
/// a Hash of Symbol to Float (tracker/stats.rs).
fn stats(ruby: &Ruby) -> Result<magnus::RHash, Error> {
    let hash = ruby.hash_new();
    for (name, value) in tracker::stats() {
        hash.aset(ruby.to_symbol(name), value)?;
    }
    Ok(hash)
}

/// How long the listener waits for a Ruby thread to make an allocation profile.
const SERVE_TIMEOUT: Duration = Duration::from_secs(10);

pub fn init(ruby: &Ruby) -> Result<(), Error> {
    let version: String = ruby.eval("RUBY_VERSION")?;
    let _ = RUBY_VERSION.set(version);
    tracker::prepare();
    tracker::set_publisher(publish);
    provide_allocations(serve);
    let module = ruby.define_module("RubySpy")?;
    let native = module.define_module("NativeAllocations")?;
    native.define_singleton_method("start", function!(start, 3))?;
    native.define_singleton_method("stop", function!(tracker::stop, 0))?;
    native.define_singleton_method("tracking?", function!(tracker::tracking, 0))?;
    native.define_singleton_method("collect", function!(tracker::collect, 0))?;
    native.define_singleton_method("after_fork", function!(tracker::after_fork, 0))?;
    native.define_singleton_method("snapshot", function!(snapshot, 0))?;
    native.define_singleton_method("stats", function!(stats, 0))?;
    native.define_singleton_method("published_at_ms", function!(tracker::published_at_ms, 0))?;
    native.const_set("MAX_SITES", MAX_SITES)?;
    native.const_set("MAX_LIVE", MAX_LIVE)?;
    Ok(())
}
