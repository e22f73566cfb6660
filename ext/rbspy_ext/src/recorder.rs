//! `RubySpy::NativeRecorder`: a thin wrapper over the core's sampler, whose recordings are
//! `NativeProfile`s (profile.rs). The Ruby API (options, blocks, docs) is
//! lib/rbspy_ext/recorder.rb.
use crate::guard::{guarded, Gvl};
use crate::hash::option;
use crate::profile::NativeProfile;
use crate::{errors, nogvl::nogvl};
use magnus::{function, method, prelude::*, Error, RHash, Ruby};
use rbspy_ext_core::profile::Profile;
use rbspy_ext_core::record::{RecordConfig, Recorder};
use rbspy_ext_core::spy::ThreadSelection;
use rbspy_ext_core::sync::locked;
use rbspy_ext_core::Config;
use std::sync::Mutex;
use std::time::Duration;

#[magnus::wrap(class = "RubySpy::NativeRecorder", free_immediately, size)]
struct NativeRecorder(Mutex<Option<Recorder>>);

impl NativeRecorder {
    /// `NativeRecorder.start(pid, options)`: `options` is `RecordOptions#to_h` (validated
    /// there): `rate`, `duration` (nil for none), `threads` (`:all` or `:gvl`), `on_cpu`,
    /// `subprocesses`, `force_version`, `live`, `bpf`.
    fn start(ruby: &Ruby, pid: i64, options: RHash) -> Result<Self, Error> {
        let rate: f64 = option(ruby, options, "rate")?;
        let duration: Option<f64> = option(ruby, options, "duration")?;
        let threads: magnus::Symbol = option(ruby, options, "threads")?;
        let on_cpu: bool = option(ruby, options, "on_cpu")?;
        let subprocesses: bool = option(ruby, options, "subprocesses")?;
        let force_version: Option<String> = option(ruby, options, "force_version")?;
        let live: bool = option(ruby, options, "live")?;
        let bpf: bool = option(ruby, options, "bpf")?;
        let pid = i32::try_from(pid)
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| Error::new(ruby.exception_arg_error(), format!("invalid pid {pid}")))?;
        let duration = match duration {
            Some(d) if !(d.is_finite() && d > 0.0) => {
                return Err(Error::new(
                    ruby.exception_arg_error(),
                    format!("duration must be a positive number of seconds, got {d}"),
                ))
            }
            Some(d) => Some(Duration::from_secs_f64(d)),
            None => None,
        };
        let config = RecordConfig {
            rate_hz: rate,
            duration,
            threads: if threads.name()? == "gvl" {
                ThreadSelection::GvlHolder
            } else {
                ThreadSelection::All
            },
            on_cpu,
            subprocesses,
            live,
            bpf,
            spy: Config {
                force_version,
                ..Config::default()
            },
        };
        // Attaching reads the target (and, for the calling process, must not wait on the
        // GVL it holds): done without the GVL, like snapshots of other processes.
        let gvl = Gvl::for_pid(pid);
        let recorder = guarded(ruby, gvl, "starting a recording", || {
            Recorder::start(pid, config)
        })?;
        Ok(NativeRecorder(Mutex::new(Some(recorder))))
    }

    /// Stops and returns the profile; the join happens without the GVL.
    fn stop(ruby: &Ruby, rb_self: &Self) -> Result<NativeProfile, Error> {
        let recorder = locked(&rb_self.0).take().ok_or_else(|| {
            Error::new(
                ruby.exception_runtime_error(),
                "this recording was already stopped",
            )
        })?;
        match nogvl(move || recorder.stop()) {
            Ok(profile) => Ok(NativeProfile(profile)),
            Err(_) => Err(errors::panicked(ruby, "stopping a recording")),
        }
    }

    /// The profile so far, for a recording started with `live: true` (nil before its first
    /// refresh, or without `live`).
    fn profile_so_far(&self) -> Option<NativeProfile> {
        let guard = locked(&self.0);
        let profile = guard.as_ref()?.progress().profile?;
        Some(NativeProfile(Profile::clone(&profile)))
    }

    /// `{elapsed:, ticks:, samples:, finished:, top: [[label, samples], ...]}` (top 10).
    fn progress(ruby: &Ruby, rb_self: &Self) -> Result<RHash, Error> {
        let p = match &*locked(&rb_self.0) {
            Some(r) => r.progress(),
            None => rbspy_ext_core::record::Progress {
                finished: true,
                ..Default::default()
            },
        };
        let h = ruby.hash_new();
        h.aset(ruby.to_symbol("elapsed"), p.elapsed.as_secs_f64())?;
        h.aset(ruby.to_symbol("ticks"), p.ticks)?;
        h.aset(ruby.to_symbol("samples"), p.samples)?;
        h.aset(ruby.to_symbol("finished"), p.finished)?;
        h.aset(ruby.to_symbol("top"), p.top)?;
        Ok(h)
    }
}

pub fn init(ruby: &Ruby) -> Result<(), Error> {
    let module = ruby.define_module("RubySpy")?;
    let rec = module.define_class("NativeRecorder", ruby.class_object())?;
    rec.define_singleton_method("start", function!(NativeRecorder::start, 2))?;
    rec.define_method("stop", method!(NativeRecorder::stop, 0))?;
    rec.define_method("progress", method!(NativeRecorder::progress, 0))?;
    rec.define_method("profile_so_far", method!(NativeRecorder::profile_so_far, 0))?;
    rec.const_set("MAX_RATE_HZ", rbspy_ext_core::record::MAX_RATE_HZ)?;
    crate::classes::resolve::<NativeRecorder>(ruby);
    Ok(())
}
