//! `RubySpy::NativeProfile`: a recorded (or loaded) profile, wrapped for lib/rbspy_ext/profile.rb:
//! its views and selections, its rows for Ruby, and every format it renders to.
use crate::errors;
use crate::hash::option;
use crate::rows::FrameRow;
use magnus::{function, method, prelude::*, Error, RArray, RHash, Ruby};
use rbspy_ext_core::output::{self, Format, Options};
use rbspy_ext_core::profile::{Profile, ThreadState};

#[magnus::wrap(class = "RubySpy::NativeProfile", free_immediately, size)]
pub(crate) struct NativeProfile(pub(crate) Profile);

/// `NativeProfile#cost`: [sampler CPU seconds, of which sampling (not waking up),
/// process_vm_readv calls, and with the BPF sampler [program run time in seconds, runs,
/// wake-ups] (else nil)].
type CostRow = (f64, f64, u64, Option<(f64, u64, u64)>);

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
    fn cost(&self) -> CostRow {
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
    fn frames(&self) -> Vec<FrameRow<'_>> {
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
    crate::classes::resolve::<NativeProfile>(ruby);
    Ok(())
}
