//! `RubySpy::NativeAllocationProfile`: one look at sampled allocations, with names: what
//! the tracker of this process counted (allocs.rs makes it), or what another process
//! published, joined with a census of its heap (census.rs). `RubySpy::Allocations`
//! (lib/rbspy_ext/allocations.rb) wraps it.
use crate::errors;
use crate::rows::FrameRow;
use magnus::{method, prelude::*, Error, RArray, RString, Ruby};
use rbspy_ext_core::allocs::view::{self, Measure};
use rbspy_ext_core::allocs::{pprof, AllocProfile};
use rbspy_ext_core::output::{self, Format, Options};
use std::sync::Arc;

/// A snapshot: the tracker's counts with names, made with the GVL outside any hook.
#[magnus::wrap(class = "RubySpy::NativeAllocationProfile", free_immediately, size)]
pub(crate) struct NativeAllocationProfile(pub(crate) Arc<AllocProfile>);

impl NativeAllocationProfile {
    /// A profile with names (this process's, or one read from outside).
    pub(crate) fn new(profile: AllocProfile) -> Self {
        NativeAllocationProfile(Arc::new(profile))
    }

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

    /// `{frames: [frame indexes], class:, type:, samples:, allocated:, allocated_bytes:,
    /// live:, live_bytes:}` per site; `frames` gives the frames' rows.
    fn sites(ruby: &Ruby, rb_self: &Self) -> Result<RArray, Error> {
        let out = ruby.ary_new_capa(rb_self.0.sites.len());
        for s in &rb_self.0.sites {
            let e = s.estimates();
            let h = ruby.hash_new();
            h.aset(
                ruby.to_symbol("frames"),
                ruby.ary_from_vec(s.frames.clone()),
            )?;
            h.aset(ruby.to_symbol("class"), s.class.as_str())?;
            h.aset(ruby.to_symbol("type"), s.type_name.as_str())?;
            h.aset(ruby.to_symbol("samples"), s.samples)?;
            h.aset(ruby.to_symbol("allocated"), e.alloc_objects)?;
            h.aset(ruby.to_symbol("allocated_bytes"), e.alloc_space)?;
            h.aset(ruby.to_symbol("live"), e.inuse_objects)?;
            h.aset(ruby.to_symbol("live_bytes"), e.inuse_space)?;
            out.push(h)?;
        }
        Ok(out)
    }

    fn frames(&self) -> Vec<FrameRow<'_>> {
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

pub fn init(ruby: &Ruby) -> Result<(), Error> {
    let module = ruby.define_module("RubySpy")?;
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
