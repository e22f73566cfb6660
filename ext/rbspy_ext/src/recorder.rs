//! `RubySpy::NativeRecorder` and `RubySpy::NativeProfile`: thin wrappers over the core's
//! sampler and profile. The Ruby API (options, blocks, docs) is lib/rbspy_ext/recorder.rb
//! and lib/rbspy_ext/profile.rb.
use crate::{errors, nogvl::nogvl};
use magnus::{function, method, prelude::*, Error, RArray, RHash, Ruby};
use rbspy_ext_core::output::{self, Format, Options};
use rbspy_ext_core::profile::{Profile, ThreadState};
use rbspy_ext_core::record::{RecordConfig, Recorder};
use rbspy_ext_core::spy::ThreadSelection;
use rbspy_ext_core::Config;
use std::sync::Mutex;
use std::time::Duration;

#[magnus::wrap(class = "RubySpy::NativeRecorder", free_immediately, size)]
struct NativeRecorder(Mutex<Option<Recorder>>);

#[magnus::wrap(class = "RubySpy::NativeProfile", free_immediately, size)]
struct NativeProfile(Profile);

/// `options[key]` converted, for the options Hash lib/rbspy_ext/recorder.rb passes.
fn option<T: magnus::TryConvert>(ruby: &Ruby, options: RHash, key: &str) -> Result<T, Error> {
    options.lookup(ruby.to_symbol(key))
}

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
        let own = pid as u32 == std::process::id();
        let started = if own {
            std::panic::catch_unwind(|| Recorder::start(pid, config))
        } else {
            nogvl(|| Recorder::start(pid, config))
        };
        match started {
            Ok(Ok(r)) => Ok(NativeRecorder(Mutex::new(Some(r)))),
            Ok(Err(e)) => Err(errors::to_ruby(ruby, e)),
            Err(_) => Err(errors::panicked(ruby, "starting a recording")),
        }
    }

    /// Stops and returns the profile; the join happens without the GVL.
    fn stop(ruby: &Ruby, rb_self: &Self) -> Result<NativeProfile, Error> {
        let recorder = rb_self
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| {
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
        let guard = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let profile = guard.as_ref()?.progress().profile?;
        Some(NativeProfile(Profile::clone(&profile)))
    }

    /// `{elapsed:, ticks:, samples:, finished:, top: [[label, samples], ...]}` (top 10).
    fn progress(ruby: &Ruby, rb_self: &Self) -> Result<RHash, Error> {
        let p = match &*rb_self.0.lock().unwrap_or_else(|p| p.into_inner()) {
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

impl NativeProfile {
    fn load(ruby: &Ruby, path: String) -> Result<Self, Error> {
        let mut file = std::fs::File::open(&path).map_err(|e| {
            Error::new(
                ruby.exception_arg_error(),
                format!("cannot read {path}: {e}"),
            )
        })?;
        output::read_raw(&mut file).map(NativeProfile).map_err(|e| {
            Error::new(
                errors::class(ruby, "InvalidProfile"),
                format!("{path} is not a readable rbspy_ext raw profile: {e}"),
            )
        })
    }

    /// `render(format, options)`: `options` is the keywords of `Profile#render` (`tag`,
    /// `per_thread`, `lines`, `idle`, `state`, `state_leaves`), checked there.
    fn render(
        ruby: &Ruby,
        rb_self: &Self,
        format: String,
        options: RHash,
    ) -> Result<magnus::RString, Error> {
        let arg_error =
            |e: output::OutputError| Error::new(ruby.exception_arg_error(), e.to_string());
        let format = Format::from_name(&format).map_err(arg_error)?;
        let options = Options {
            per_thread: option(ruby, options, "per_thread")?,
            lines: option(ruby, options, "lines")?,
            idle: option(ruby, options, "idle")?,
            state: option(ruby, options, "state")?,
            tag_root: option(ruby, options, "tag")?,
            no_state_leaves: !option::<bool>(ruby, options, "state_leaves")?,
        };
        let mut out = Vec::new();
        output::write(&rb_self.0, format, &mut out, &options).map_err(|e| match e {
            output::OutputError::OptionNotTaken { .. } => arg_error(e),
            e => Error::new(errors::class(ruby, "Error"), e.to_string()),
        })?;
        Ok(ruby.str_from_slice(&out))
    }

    /// `[{label:, path:, line:, self:, total:, state_leaf:}, ...]`:
    /// `output::summary::functions`, of every sample or (`idle` false) of those of threads
    /// that were not blocked, with state leaves (`[waiting for GVL]`...) unless `state_leaves`
    /// is false, as the summary counts them.
    fn functions(
        ruby: &Ruby,
        rb_self: &Self,
        idle: bool,
        state_leaves: bool,
    ) -> Result<RArray, Error> {
        let p = &rb_self.0;
        let busy;
        let counted = match idle {
            true => p,
            false => {
                busy = p.filtered(|s| s.state != ThreadState::Blocked);
                &busy
            }
        };
        let rows = match state_leaves {
            true => output::summary::functions(&output::leaves::with_state_leaves(counted)),
            false => output::summary::functions(counted),
        };
        let out = ruby.ary_new_capa(rows.len());
        for f in rows {
            let h = ruby.hash_new();
            h.aset(ruby.to_symbol("label"), f.label)?;
            h.aset(ruby.to_symbol("path"), f.path)?;
            h.aset(ruby.to_symbol("line"), f.line)?;
            h.aset(ruby.to_symbol("self"), f.self_samples)?;
            h.aset(ruby.to_symbol("total"), f.total_samples)?;
            h.aset(ruby.to_symbol("state_leaf"), f.state_leaf)?;
            out.push(h)?;
        }
        Ok(out)
    }

    fn samples(&self) -> u64 {
        self.0.samples
    }

    fn ticks(&self) -> u64 {
        self.0.ticks
    }

    fn duration(&self) -> f64 {
        self.0.duration_ns as f64 / 1e9
    }

    fn pid(&self) -> i32 {
        self.0.pid
    }

    fn ruby_version(&self) -> String {
        self.0.ruby_version.clone()
    }

    fn jit(&self) -> Option<String> {
        self.0.jit.clone()
    }

    fn rate(&self) -> f64 {
        self.0.rate_hz
    }

    /// [sampler CPU seconds, of which sampling (not waking up), process_vm_readv calls,
    /// and with the BPF sampler [program run time in seconds, runs, wake-ups] (else nil)]
    #[allow(clippy::type_complexity)]
    fn cost(&self) -> (f64, f64, u64, Option<(f64, u64, u64)>) {
        (
            self.0.sampler_cpu_ns as f64 / 1e9,
            self.0.sampler_work_ns as f64 / 1e9,
            self.0.read_calls,
            self.0
                .kernel
                .map(|k| (k.bpf_run_ns as f64 / 1e9, k.bpf_runs, k.wakeups)),
        )
    }

    fn errors(ruby: &Ruby, rb_self: &Self) -> Result<RHash, Error> {
        let h = ruby.hash_new();
        for (reason, n) in &rb_self.0.errors {
            h.aset(reason.as_str(), *n)?;
        }
        Ok(h)
    }

    fn notes(&self) -> Vec<String> {
        self.0.notes.clone()
    }

    /// `[{tags: [[key, value], ...], samples:}, ...]`: every set of tags seen.
    fn tag_sets(ruby: &Ruby, rb_self: &Self) -> Result<RArray, Error> {
        let p = &rb_self.0;
        let mut counts = vec![0u64; p.tag_sets.len().max(1)];
        for s in &p.stacks {
            if let Some(c) = counts.get_mut(s.tags as usize) {
                *c += s.count;
            }
        }
        let out = ruby.ary_new();
        for (i, n) in counts.into_iter().enumerate().filter(|(_, n)| *n > 0) {
            let h = ruby.hash_new();
            h.aset(
                ruby.to_symbol("tags"),
                p.tag_sets.get(i).cloned().unwrap_or_default(),
            )?;
            h.aset(ruby.to_symbol("samples"), n)?;
            out.push(h)?;
        }
        Ok(out)
    }

    /// Every distinct frame, as rows for `RubySpy::Frame.from_row`; `stacks` index them.
    #[allow(clippy::type_complexity)]
    fn frames(&self) -> Vec<(&str, &str, Option<&str>, Option<&str>, i32, bool)> {
        self.0.frames.iter().map(crate::rows::frame_row).collect()
    }

    /// Every distinct stack: `{frames: [indexes into #frames, innermost first], samples:,
    /// thread: (index into #threads' source list), state:}`.
    fn stacks(ruby: &Ruby, rb_self: &Self) -> Result<RArray, Error> {
        let out = ruby.ary_new_capa(rb_self.0.stacks.len());
        for s in &rb_self.0.stacks {
            let h = ruby.hash_new();
            h.aset(ruby.to_symbol("frames"), s.frames.clone())?;
            h.aset(ruby.to_symbol("samples"), s.count)?;
            h.aset(ruby.to_symbol("thread"), s.thread)?;
            h.aset(ruby.to_symbol("state"), s.state.name())?;
            out.push(h)?;
        }
        Ok(out)
    }

    /// Every sample with tag `key` = `value` unless it carries `key` already.
    fn with_tag(&self, key: String, value: String) -> NativeProfile {
        NativeProfile(self.0.with_tag(&key, &value))
    }

    /// The samples that carry tag `key`, whatever its value.
    fn having_tag(&self, key: String) -> NativeProfile {
        let p = &self.0;
        NativeProfile(p.filtered(|s| p.tag_value(s, &key).is_some()))
    }

    /// The samples whose tags include every `[key, value]` given.
    fn select_tags(&self, wanted: Vec<(String, String)>) -> NativeProfile {
        let p = &self.0;
        NativeProfile(p.filtered(|s| {
            wanted
                .iter()
                .all(|(k, v)| p.tag_value(s, k) == Some(v.as_str()))
        }))
    }

    /// The samples of threads in one of the states named (`ThreadState::name`); an unknown
    /// name is an ArgumentError listing the known ones.
    fn select_states(ruby: &Ruby, rb_self: &Self, names: Vec<String>) -> Result<Self, Error> {
        let states = names
            .iter()
            .map(|n| {
                ThreadState::from_name(n).ok_or_else(|| {
                    let known: Vec<&str> = ThreadState::ALL.iter().map(|s| s.name()).collect();
                    Error::new(
                        ruby.exception_arg_error(),
                        format!(
                            "unknown thread state {n:?}; states are {}",
                            known.join(", ")
                        ),
                    )
                })
            })
            .collect::<Result<Vec<_>, Error>>()?;
        let p = &rb_self.0;
        Ok(NativeProfile(p.filtered(|s| states.contains(&s.state))))
    }

    /// The samples of the threads at these indexes of `threads` (frames and threads kept
    /// whole, so a thread keeps its index).
    fn select_threads(ruby: &Ruby, rb_self: &Self, indexes: Vec<i64>) -> Result<Self, Error> {
        let p = &rb_self.0;
        if let Some(bad) = indexes
            .iter()
            .find(|&&i| i < 0 || i as usize >= p.threads.len())
        {
            return Err(Error::new(
                ruby.exception_arg_error(),
                format!(
                    "no thread {bad}: the profile has threads 0 to {} (see #threads)",
                    p.threads.len() as i64 - 1
                ),
            ));
        }
        Ok(NativeProfile(
            p.filtered(|s| indexes.contains(&i64::from(s.thread))),
        ))
    }

    /// `{value or nil => profile}`: the samples split by the value of tag `key`.
    fn group_by_tag(ruby: &Ruby, rb_self: &Self, key: String) -> Result<RHash, Error> {
        let p = &rb_self.0;
        let mut parts = p.split_by(|s| p.tag_value(s, &key).map(str::to_string));
        parts.sort_by(|a, b| a.0.cmp(&b.0));
        let out = ruby.hash_new();
        for (value, part) in parts {
            out.aset(value, ruby.obj_wrap(NativeProfile(part)))?;
        }
        Ok(out)
    }

    /// `[{pid:, tid:, ruby_thread:, name:, main:, ractor:, ractor_name:, states: {state =>
    /// samples}}, ...]`
    fn threads(ruby: &Ruby, rb_self: &Self) -> Result<RArray, Error> {
        let p = &rb_self.0;
        let out = ruby.ary_new();
        for (i, t) in p.threads.iter().enumerate() {
            let states = ruby.hash_new();
            for s in p.stacks.iter().filter(|s| s.thread as usize == i) {
                let prev = states
                    .lookup::<_, Option<u64>>(s.state.name())?
                    .unwrap_or(0);
                states.aset(s.state.name(), prev + s.count)?;
            }
            // A thread with no samples here (e.g. in a `select`ed profile) is not listed.
            if states.is_empty() {
                continue;
            }
            let h = ruby.hash_new();
            h.aset(ruby.to_symbol("pid"), t.pid)?;
            h.aset(ruby.to_symbol("tid"), t.tid)?;
            h.aset(ruby.to_symbol("ruby_thread"), t.ruby_thread)?;
            h.aset(ruby.to_symbol("name"), t.name.clone())?;
            h.aset(ruby.to_symbol("main"), t.main)?;
            h.aset(ruby.to_symbol("ractor"), t.ractor)?;
            h.aset(ruby.to_symbol("ractor_name"), t.ractor_name.clone())?;
            h.aset(ruby.to_symbol("states"), states)?;
            out.push(h)?;
        }
        Ok(out)
    }
}

pub fn init(ruby: &Ruby) -> Result<(), Error> {
    let module = ruby.define_module("RubySpy")?;
    let rec = module.define_class("NativeRecorder", ruby.class_object())?;
    rec.define_singleton_method("start", function!(NativeRecorder::start, 2))?;
    rec.define_method("stop", method!(NativeRecorder::stop, 0))?;
    rec.define_method("progress", method!(NativeRecorder::progress, 0))?;
    rec.define_method("profile_so_far", method!(NativeRecorder::profile_so_far, 0))?;
    let prof = module.define_class("NativeProfile", ruby.class_object())?;
    prof.define_singleton_method("load", function!(NativeProfile::load, 1))?;
    prof.define_method("render", method!(NativeProfile::render, 2))?;
    prof.define_method("functions", method!(NativeProfile::functions, 2))?;
    prof.define_method("select_states", method!(NativeProfile::select_states, 1))?;
    prof.define_method("select_threads", method!(NativeProfile::select_threads, 1))?;
    prof.define_method("tag_sets", method!(NativeProfile::tag_sets, 0))?;
    prof.define_method("select_tags", method!(NativeProfile::select_tags, 1))?;
    prof.define_method("having_tag", method!(NativeProfile::having_tag, 1))?;
    prof.define_method("with_tag", method!(NativeProfile::with_tag, 2))?;
    prof.define_method("group_by_tag", method!(NativeProfile::group_by_tag, 1))?;
    prof.define_method("samples", method!(NativeProfile::samples, 0))?;
    prof.define_method("frames", method!(NativeProfile::frames, 0))?;
    prof.define_method("stacks", method!(NativeProfile::stacks, 0))?;
    prof.define_method("ticks", method!(NativeProfile::ticks, 0))?;
    prof.define_method("duration", method!(NativeProfile::duration, 0))?;
    prof.define_method("pid", method!(NativeProfile::pid, 0))?;
    prof.define_method("ruby_version", method!(NativeProfile::ruby_version, 0))?;
    prof.define_method("jit", method!(NativeProfile::jit, 0))?;
    prof.define_method("rate", method!(NativeProfile::rate, 0))?;
    prof.define_method("errors", method!(NativeProfile::errors, 0))?;
    prof.define_method("cost", method!(NativeProfile::cost, 0))?;
    prof.define_method("notes", method!(NativeProfile::notes, 0))?;
    prof.define_method("threads", method!(NativeProfile::threads, 0))?;
    // The one table of formats and the one maximum rate (lib/rbspy_ext/profile.rb and
    // recorder.rb name them FORMATS, EXTENSIONS and MAX_RATE).
    let formats = ruby.hash_new();
    for format in Format::ALL {
        formats.aset(ruby.to_symbol(format.name()), format.extension())?;
    }
    formats.freeze();
    prof.const_set("FORMATS", formats)?;
    // The formats that take render's view keywords (per_thread, lines, idle, state, tag);
    // every format takes state_leaves.
    let shaped = ruby.ary_from_iter(Options::FORMATS.map(|f| ruby.to_symbol(f.name())));
    shaped.freeze();
    prof.const_set("VIEW_FORMATS", shaped)?;
    rec.const_set("MAX_RATE_HZ", rbspy_ext_core::record::MAX_RATE_HZ)?;
    crate::classes::resolve::<NativeRecorder>(ruby);
    crate::classes::resolve::<NativeProfile>(ruby);
    Ok(())
}
