//! `RubySpy::NativeAllocations`: sampled allocation tracking in this process (the hooks and
//! what they keep are tracker.rs), and `NativeAllocationProfile`, a snapshot of it with its
//! frames and classes named, made with the GVL and outside any hook. The Ruby API is
//! lib/rbspy_ext/allocations.rb.
use crate::errors;
use crate::tracker::{self, debug, MAX_LIVE, MAX_SITES};
use magnus::rb_sys::FromRawValue;
use magnus::{function, method, prelude::*, Error, RString, Ruby};
use rb_sys::VALUE;
use rbspy_ext_core::allocs::view::{self, Measure};
use rbspy_ext_core::allocs::{pprof, AllocProfile};
use rbspy_ext_core::census::TYPE_NAMES;
use rbspy_ext_core::model::Frame;
use rbspy_ext_core::output::{self, Format, Options};
use rbspy_ext_core::serve::{provide_allocations, AllocsAnswer, AllocsRequest};
use rustc_hash::FxHashMap as HashMap;
use std::sync::Arc;
use std::time::Duration;

/// A snapshot: the tracker's counts with names, made with the GVL outside any hook.
#[magnus::wrap(class = "RubySpy::NativeAllocationProfile", free_immediately, size)]
struct NativeAllocationProfile(Arc<AllocProfile>);

/// `NativeAllocations.start(rate_bytes)`: starts tracking anew (what an earlier run counted
/// is dropped).
fn start(ruby: &Ruby, rate_bytes: u64) -> Result<(), Error> {
    if rate_bytes == 0 {
        return Err(Error::new(
            ruby.exception_arg_error(),
            "rate must be at least 1 byte (1: every allocation)",
        ));
    }
    let version: String = ruby.eval("RUBY_VERSION")?;
    tracker::start(rate_bytes, &version);
    Ok(())
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

/// The tracker's counts as an `AllocProfile`: frames named as snapshots name them (a C
/// function at its caller's path and line).
fn snapshot(ruby: &Ruby) -> Result<Option<NativeAllocationProfile>, Error> {
    let Some(copied) = tracker::copy() else {
        return Ok(None);
    };
    let raw: Vec<(String, Option<String>, Option<String>)> = copied
        .frames
        .iter()
        .map(|&(frame, _)| frame_names(frame))
        .collect();
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
    let version: String = ruby.eval("RUBY_VERSION")?;
    Ok(Some(NativeAllocationProfile(Arc::new(AllocProfile {
        pid: std::process::id() as i32,
        ruby_version: version,
        rate_bytes: copied.rate_bytes,
        start_unix_ns: copied.start_unix_ns,
        duration_ns: copied.duration_ns,
        frames,
        sites,
        notes: copied.notes,
    }))))
}

impl NativeAllocationProfile {
    /// Gzipped pprof that opens on `inuse_space` (`heap`) or `alloc_space` (`allocs`).
    fn pprof(ruby: &Ruby, rb_self: &Self, opens: String) -> Result<RString, Error> {
        let opens = match opens.as_str() {
            "heap" => pprof::Opens::Inuse,
            "allocs" => pprof::Opens::Allocs,
            other => {
                return Err(Error::new(
                    ruby.exception_arg_error(),
                    format!("profile must be :heap or :allocs, not {other:?}"),
                ))
            }
        };
        let mut out = Vec::new();
        pprof::write(&rb_self.0, opens, &mut out)
            .map_err(|e| Error::new(errors::class(ruby, "Error"), e))?;
        Ok(ruby.str_from_slice(&out))
    }

    /// The allocations as `summary` text, or a `flamegraph`, `speedscope` or `collapsed`
    /// drawing, counting `measure` (`alloc_objects`, `alloc_space`, `inuse_objects`,
    /// `inuse_space`).
    fn render(
        ruby: &Ruby,
        rb_self: &Self,
        format: String,
        measure: String,
    ) -> Result<RString, Error> {
        let arg_error = |e: String| Error::new(ruby.exception_arg_error(), e);
        let measure = Measure::parse(&measure).map_err(arg_error)?;
        if format == "summary" {
            return Ok(ruby.str_new(&view::summary(&rb_self.0, measure)));
        }
        let format = match Format::from_name(&format) {
            Ok(f @ (Format::Flamegraph | Format::Speedscope | Format::Collapsed)) => f,
            _ => {
                return Err(arg_error(format!(
                    "allocations render as summary, flamegraph, speedscope or collapsed, not {format:?} (pprof: #pprof)"
                )))
            }
        };
        let mut out = Vec::new();
        output::write(
            &view::as_profile(&rb_self.0, measure),
            format,
            &mut out,
            &Options::default(),
        )
        .map_err(|e| Error::new(errors::class(ruby, "Error"), e.to_string()))?;
        Ok(ruby.str_from_slice(&out))
    }

    /// `[[frame indexes], class, type, samples, allocated, allocated_bytes, live, live_bytes]`
    /// per site; `frames` gives the frames' rows.
    #[allow(clippy::type_complexity)]
    fn sites(&self) -> Vec<(Vec<u32>, String, String, u64, u64, u64, u64, u64)> {
        (self.0.sites.iter())
            .map(|s| {
                let e = s.estimates();
                (
                    s.frames.clone(),
                    s.class.clone(),
                    s.type_name.clone(),
                    s.samples,
                    e.alloc_objects,
                    e.alloc_space,
                    e.inuse_objects,
                    e.inuse_space,
                )
            })
            .collect()
    }

    #[allow(clippy::type_complexity)]
    fn frames(&self) -> Vec<(&str, &str, Option<&str>, Option<&str>, i32, bool)> {
        self.0.frames.iter().map(crate::rows::frame_row).collect()
    }

    fn rate(&self) -> u64 {
        self.0.rate_bytes
    }

    fn duration(&self) -> f64 {
        self.0.duration_ns as f64 / 1e9
    }

    fn notes(&self) -> Vec<String> {
        self.0.notes.clone()
    }
}

/// What the pprof listener serves from the tracker (core/src/serve/tracked.rs): asked on the
/// listener's thread, made by the postponed job on a Ruby thread.
fn serve(request: AllocsRequest) -> AllocsAnswer {
    if !tracker::tracking() {
        return AllocsAnswer::NotTracking;
    }
    let made: Option<Result<Vec<u8>, String>> = tracker::with_gvl(
        move || {
            let ruby = Ruby::get().map_err(|e| e.to_string())?;
            if request.gc {
                tracker::collect();
            }
            let profile = snapshot(&ruby)
                .map_err(|e| e.to_string())?
                .ok_or("tracking stopped")?;
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

/// How long the listener waits for a Ruby thread to make an allocation profile.
const SERVE_TIMEOUT: Duration = Duration::from_secs(10);

pub fn init(ruby: &Ruby) -> Result<(), Error> {
    tracker::prepare();
    provide_allocations(serve);
    let module = ruby.define_module("RubySpy")?;
    let native = module.define_module("NativeAllocations")?;
    native.define_singleton_method("start", function!(start, 1))?;
    native.define_singleton_method("stop", function!(tracker::stop, 0))?;
    native.define_singleton_method("tracking?", function!(tracker::tracking, 0))?;
    native.define_singleton_method("collect", function!(tracker::collect, 0))?;
    native.define_singleton_method("after_fork", function!(tracker::after_fork, 0))?;
    native.define_singleton_method("snapshot", function!(snapshot, 0))?;
    native.const_set("MAX_SITES", MAX_SITES)?;
    native.const_set("MAX_LIVE", MAX_LIVE)?;
    let profile = module.define_class("NativeAllocationProfile", ruby.class_object())?;
    profile.define_method("pprof", method!(NativeAllocationProfile::pprof, 1))?;
    profile.define_method("render", method!(NativeAllocationProfile::render, 2))?;
    profile.define_method("sites", method!(NativeAllocationProfile::sites, 0))?;
    profile.define_method("frames", method!(NativeAllocationProfile::frames, 0))?;
    profile.define_method("rate", method!(NativeAllocationProfile::rate, 0))?;
    profile.define_method("duration", method!(NativeAllocationProfile::duration, 0))?;
    profile.define_method("notes", method!(NativeAllocationProfile::notes, 0))?;
    crate::classes::resolve::<NativeAllocationProfile>(ruby);
    Ok(())
}
