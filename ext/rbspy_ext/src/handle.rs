//! `RubySpy::NativeHandle`: one attached process. `RubySpy::Handle` (lib/rbspy_ext/handle.rb)
//! wraps it and turns the raw frame rows into `RubySpy::Frame` objects.
use crate::census::NativeCensus;
use crate::guard::{guarded, Gvl};
use crate::rows::frame_row;
use magnus::{function, method, prelude::*, value::ReprValue, Error, RArray, RHash, Ruby, Value};
use rbspy_ext_core::census;
use rbspy_ext_core::heap_sites;
use rbspy_ext_core::spy::ThreadSelection;
use rbspy_ext_core::sync::locked;
use rbspy_ext_core::{Config, Frame, Spy};
use std::collections::HashMap;
use std::sync::Mutex;

#[magnus::wrap(class = "RubySpy::NativeHandle", free_immediately, size)]
struct Handle {
    spy: Mutex<Spy>,
    /// Every distinct frame seen gets a small id; the Ruby side keeps one frozen
    /// `RubySpy::Frame` per id, so a warm snapshot allocates one Array of Integers instead
    /// of a Frame and four Strings per frame.
    frame_ids: Mutex<HashMap<Frame, u32>>,
    /// Snapshots of the calling process keep the GVL: releasing it would let another
    /// thread take it, and the snapshot would show that thread instead of the caller.
    gvl: Gvl,
}

fn pid_arg(ruby: &Ruby, pid: Value) -> Result<i32, Error> {
    if !pid.is_kind_of(ruby.class_integer()) {
        return Err(Error::new(
            ruby.exception_type_error(),
            format!("pid must be an Integer, got {}", unsafe { pid.classname() }),
        ));
    }
    let pid: i64 = i64::try_convert(pid)?;
    if pid <= 0 || pid > i32::MAX as i64 {
        return Err(Error::new(
            ruby.exception_arg_error(),
            format!("pid must be a process id from 1 to {}, got {pid}", i32::MAX),
        ));
    }
    Ok(pid as i32)
}

impl Handle {
    fn new(ruby: &Ruby, pid: Value, force_version: Option<String>) -> Result<Handle, Error> {
        let pid = pid_arg(ruby, pid)?;
        let gvl = Gvl::for_pid(pid);
        let config = Config {
            force_version,
            ..Config::default()
        };
        let spy = guarded(ruby, gvl, "attaching", || Spy::attach_with(pid, &config))?;
        Ok(Handle {
            spy: Mutex::new(spy),
            frame_ids: Mutex::new(HashMap::new()),
            gvl,
        })
    }

    fn pid(&self) -> i32 {
        self.lock().pid()
    }

    fn ruby_version(&self) -> String {
        self.lock().version().to_string()
    }

    fn warning(&self) -> Option<String> {
        self.lock().warning().map(str::to_string)
    }

    /// Where the layout came from and its fields: `{source:, lines:, path:, build_id:,
    /// table:, differs:, fields:}` (`RubySpy::Handle#layout` documents them).
    fn layout(ruby: &Ruby, rb_self: &Self) -> Result<RHash, Error> {
        use rbspy_ext_core::dwarf::FieldValue;
        use rbspy_ext_core::spy::LayoutSource;
        let spy = rb_self.lock();
        let h = ruby.hash_new();
        let source = spy.layout_source();
        h.aset(ruby.to_symbol("lines"), ruby.ary_from_vec(source.lines()))?;
        match source {
            LayoutSource::DebugInfo {
                path,
                build_id,
                table,
                cached,
                heap,
            } => {
                let heap_differs = heap
                    .as_ref()
                    .and_then(|h| h.as_ref().ok())
                    .map(|(_, d)| ruby.ary_from_vec(d.clone()));
                h.aset(ruby.to_symbol("heap_differs"), heap_differs)?;
                let from_dwarf = matches!(heap, Some(Ok(_)));
                h.aset(
                    ruby.to_symbol("heap"),
                    ruby.to_symbol(if from_dwarf { "debug_info" } else { "table" }),
                )?;
                h.aset(ruby.to_symbol("source"), ruby.to_symbol("debug_info"))?;
                h.aset(ruby.to_symbol("path"), path.as_str())?;
                h.aset(ruby.to_symbol("build_id"), build_id.clone())?;
                h.aset(ruby.to_symbol("cached"), *cached)?;
                h.aset(ruby.to_symbol("table"), table.as_ref().map(|t| t.0))?;
                let differs = table.as_ref().map(|t| ruby.ary_from_vec(t.1.clone()));
                h.aset(ruby.to_symbol("differs"), differs)?;
            }
            LayoutSource::Table { name, unusable } => {
                h.aset(ruby.to_symbol("source"), ruby.to_symbol("table"))?;
                h.aset(ruby.to_symbol("heap"), ruby.to_symbol("table"))?;
                h.aset(ruby.to_symbol("table"), *name)?;
                let why = unusable
                    .as_ref()
                    .map(|(path, why)| format!("{path}: {why}"));
                h.aset(ruby.to_symbol("unusable"), why)?;
            }
        }
        let fields = ruby.hash_new();
        for (name, value) in spy.layout().fields() {
            let v: Value = match value {
                FieldValue::Num(n) => ruby.integer_from_u64(n).as_value(),
                FieldValue::Absent => ruby.qnil().as_value(),
                FieldValue::Pair(a, b) => ruby.ary_from_vec(vec![a, b]).as_value(),
            };
            fields.aset(ruby.to_symbol(name), v)?;
        }
        h.aset(ruby.to_symbol("fields"), fields)?;
        Ok(h)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Spy> {
        // A panic while locked was already reported; the caches stay usable.
        locked(&self.spy)
    }

    /// A census of the process's heap (`RubySpy::Census` wraps it). `max_bytes`: stop
    /// before reading more than this many bytes of pages (the census is then partial).
    /// `sites`: join the allocation sites the process publishes (`heap_sites::read_sites`).
    fn census(
        ruby: &Ruby,
        rb_self: &Self,
        max_bytes: Option<u64>,
        sites: bool,
    ) -> Result<NativeCensus, Error> {
        let (census, sites) = guarded(ruby, rb_self.gvl, "taking a heap census", || {
            let options = census::CensusOptions { max_bytes };
            let mut spy = rb_self.lock();
            let census = census::take(spy.target_view(), options)?;
            let view = spy.target_view();
            let sites = sites.then(|| heap_sites::read_sites(view.pid(), view.mem(), &census));
            Ok((census, sites))
        })?;
        Ok(NativeCensus::new(census, sites))
    }

    /// `{ids:, fresh:, tags:}`: the frame ids of the current stack, innermost first,
    /// `[id, frame_row]` for each id not returned before, and the tags as `[key, value]`
    /// pairs. Callers serialise calls (lib/rbspy_ext/handle.rb holds a Mutex) so every fresh
    /// id reaches the cache before another snapshot can refer to it.
    fn snapshot_ids(ruby: &Ruby, rb_self: &Self) -> Result<RHash, Error> {
        let (ids, fresh, tags) = guarded(ruby, rb_self.gvl, "taking a snapshot", || {
            let (frames, tags) = {
                let mut spy = rb_self.lock();
                let frames = spy.snapshot()?;
                (frames, spy.snapshot_tags())
            };
            let mut table = locked(&rb_self.frame_ids);
            let mut fresh = Vec::new();
            let ids: Vec<u32> = frames
                .into_iter()
                .map(|f| {
                    let next = table.len() as u32;
                    *table.entry(f).or_insert_with_key(|f| {
                        fresh.push((next, f.clone()));
                        next
                    })
                })
                .collect();
            Ok((ids, fresh, tags))
        })?;
        let fresh_ary = ruby.ary_new_capa(fresh.len());
        for (id, f) in fresh {
            fresh_ary.push((id, frame_row(&f)))?;
        }
        let h = ruby.hash_new();
        h.aset(ruby.to_symbol("ids"), ruby.ary_from_vec(ids))?;
        h.aset(ruby.to_symbol("fresh"), fresh_ary)?;
        h.aset(ruby.to_symbol("tags"), tag_pairs(ruby, &tags)?)?;
        Ok(h)
    }

    /// One sample of every Ruby thread of every Ractor: `{threads: [{tid:, name:, main:,
    /// ractor:, ractor_name:, state:, frames: [frame_row, ...], tags: [[key, value], ...]},
    /// ...], dropped: [reason, ...]}`, `dropped` naming each thread whose stack did not read.
    fn thread_sample(ruby: &Ruby, rb_self: &Self) -> Result<RHash, Error> {
        let sample = guarded(ruby, rb_self.gvl, "sampling threads", || {
            rb_self.lock().sample(ThreadSelection::All)
        })?;
        let out = ruby.ary_new_capa(sample.threads.len());
        for t in &sample.threads {
            let frames = ruby.ary_new_capa(t.frames.len());
            for f in t.frames.iter() {
                frames.push(frame_row(f))?;
            }
            let h = ruby.hash_new();
            h.aset(ruby.to_symbol("tid"), t.info.tid)?;
            h.aset(ruby.to_symbol("name"), t.info.name.clone())?;
            h.aset(ruby.to_symbol("main"), t.info.main)?;
            h.aset(ruby.to_symbol("ractor"), t.info.ractor)?;
            h.aset(ruby.to_symbol("ractor_name"), t.info.ractor_name.clone())?;
            h.aset(ruby.to_symbol("state"), t.state.name())?;
            h.aset(ruby.to_symbol("frames"), frames)?;
            h.aset(ruby.to_symbol("tags"), tag_pairs(ruby, &t.tags)?)?;
            out.push(h)?;
        }
        let dropped = ruby.ary_from_iter(sample.dropped.iter().map(|d| d.name()));
        let h = ruby.hash_new();
        h.aset(ruby.to_symbol("threads"), out)?;
        h.aset(ruby.to_symbol("dropped"), dropped)?;
        Ok(h)
    }

    /// The target's `ruby_profiler_state_tp_offset`, if it has loaded rbspy_ext.
    fn profiler_state_offset(&self) -> Option<i64> {
        self.lock().profiler_state_offset()
    }

    /// `process_vm_readv` calls made so far (benchmarks count them).
    fn read_calls(&self) -> u64 {
        self.lock().memory().calls()
    }
}

/// `[[key, value], ...]` (both Strings) for one thread's tags.
fn tag_pairs(ruby: &Ruby, tags: &rbspy_ext_core::spy::Tags) -> Result<RArray, Error> {
    let out = ruby.ary_new_capa(tags.len());
    for (k, v) in tags.iter() {
        out.push((k.as_ref(), v.as_ref()))?;
    }
    Ok(out)
}

pub fn init(ruby: &Ruby) -> Result<(), Error> {
    let module = ruby.define_module("RubySpy")?;
    let class = module.define_class("NativeHandle", ruby.class_object())?;
    class.define_singleton_method("open", function!(Handle::new, 2))?;
    class.define_method("pid", method!(Handle::pid, 0))?;
    class.define_method("ruby_version", method!(Handle::ruby_version, 0))?;
    class.define_method("warning", method!(Handle::warning, 0))?;
    class.define_method("layout", method!(Handle::layout, 0))?;
    class.define_method("snapshot_ids", method!(Handle::snapshot_ids, 0))?;
    class.define_method("read_calls", method!(Handle::read_calls, 0))?;
    class.define_method(
        "profiler_state_offset",
        method!(Handle::profiler_state_offset, 0),
    )?;
    class.define_method("thread_sample", method!(Handle::thread_sample, 0))?;
    class.define_method("census", method!(Handle::census, 2))?;
    crate::classes::resolve::<Handle>(ruby);
    Ok(())
}
