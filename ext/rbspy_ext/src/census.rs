//! `RubySpy::NativeCensus`: a heap census kept as the core's `Census`, which
//! `RubySpy::Census` (lib/rbspy_ext/census.rb) wraps. Rendering, diffs and the rows all read
//! it where it is; JSON is only what `save`/`load` and `--output x.json` write and read.
//! Taking one is `NativeHandle#census` (handle.rs).
use crate::alloc_profile::NativeAllocationProfile;
use crate::errors;
use magnus::{function, method, prelude::*, Error, RArray, RHash, RString, Ruby};
use rbspy_ext_core::census::{render, Census, ClassDelta, ClassRow, RactorHeap};
use rbspy_ext_core::heap_sites::{self, Sites};

#[magnus::wrap(class = "RubySpy::NativeCensus", free_immediately, size)]
pub(crate) struct NativeCensus(Census, Option<Sites>);

impl NativeCensus {
    /// A census, with its allocation sites when they were asked for (`rubyspy heap --by
    /// site`).
    pub(crate) fn new(census: Census, sites: Option<Sites>) -> Self {
        NativeCensus(census, sites)
    }

    /// A census saved as JSON; `RubySpy::InvalidCensus` says what is wrong with it.
    fn from_json(ruby: &Ruby, json: String) -> Result<Self, Error> {
        Census::from_json(&json)
            .map(|c| NativeCensus(c, None))
            .map_err(|e| Error::new(errors::class(ruby, "InvalidCensus"), e))
    }

    fn to_json(&self) -> String {
        self.0.to_json()
    }

    /// The top `limit` classes as text.
    fn text(&self, limit: usize) -> String {
        render::text(&self.0, limit)
    }

    /// The census as a gzipped pprof heap profile (a binary String).
    fn pprof(ruby: &Ruby, rb_self: &Self) -> RString {
        ruby.str_from_slice(&render::pprof(&rb_self.0))
    }

    /// Every figure but the rows: the counts, `ruby_version`, `partial`, `sweeping`,
    /// `moving`, `heaps_changed`, `pages_changed` and `not_counted`, under Symbol keys as
    /// saved.
    fn figures(ruby: &Ruby, rb_self: &Self) -> Result<RHash, Error> {
        let c = &rb_self.0;
        let hash = ruby.hash_new();
        for (name, value) in c.counts() {
            hash.aset(ruby.to_symbol(name), value)?;
        }
        hash.aset(ruby.to_symbol("ruby_version"), c.ruby_version.as_str())?;
        hash.aset(ruby.to_symbol("partial"), c.partial)?;
        hash.aset(ruby.to_symbol("sweeping"), c.sweeping)?;
        hash.aset(ruby.to_symbol("moving"), c.moving)?;
        hash.aset(ruby.to_symbol("heaps_changed"), c.heaps_changed)?;
        hash.aset(ruby.to_symbol("pages_changed"), c.pages_changed)?;
        hash.aset(ruby.to_symbol("not_counted"), c.not_counted.as_str())?;
        Ok(hash)
    }

    /// Live objects by class and type, most bytes first (see `row`).
    fn classes(ruby: &Ruby, rb_self: &Self) -> Result<RArray, Error> {
        rows(ruby, &rb_self.0.classes)
    }

    /// Live objects by type alone.
    fn types(ruby: &Ruby, rb_self: &Self) -> Result<RArray, Error> {
        rows(ruby, &rb_self.0.types)
    }

    /// Each Ractor's heap where each owns one (see `ractor`); empty where the VM has one.
    fn ractors(ruby: &Ruby, rb_self: &Self) -> Result<RArray, Error> {
        let heaps = &rb_self.0.ractors;
        let out = ruby.ary_new_capa(heaps.len());
        for r in heaps {
            out.push(ractor(ruby, r)?)?;
        }
        Ok(out)
    }

    /// How this census changed since `earlier`: one Hash per class that did.
    fn diff(ruby: &Ruby, rb_self: &Self, earlier: &Self) -> Result<RArray, Error> {
        let deltas = rb_self.0.diff(&earlier.0);
        let out = ruby.ary_new_capa(deltas.len());
        for d in &deltas {
            out.push(delta(ruby, d)?)?;
        }
        Ok(out)
    }

    /// Why the census has no allocation sites, when they were asked for and could not be
    /// read (nil when they were read, or not asked for).
    fn sites_note(&self) -> Option<String> {
        match &self.1 {
            Some(Sites::Unavailable(why)) => Some(why.clone()),
            _ => None,
        }
    }

    /// The census's text followed by each class's top `per_class` allocation sites.
    fn sites_text(&self, limit: usize, per_class: usize) -> Option<String> {
        match &self.1 {
            Some(Sites::Joined(j)) => Some(heap_sites::text(&self.0, j, limit, per_class)),
            _ => None,
        }
    }

    /// `{name:, type:, objects:, bytes:, sites: [{frames:, objects:, bytes:, samples:}]}`
    /// per class with sampled objects alive, most bytes first; `frames` are frame rows,
    /// innermost first. Nil without sites.
    fn sites(ruby: &Ruby, rb_self: &Self) -> Result<Option<RArray>, Error> {
        let Some(Sites::Joined(j)) = &rb_self.1 else {
            return Ok(None);
        };
        let out = ruby.ary_new();
        for class in j.classes.iter().filter(|c| !c.sites.is_empty()) {
            let hash = ruby.hash_new();
            hash.aset(ruby.to_symbol("name"), class.name.as_str())?;
            hash.aset(ruby.to_symbol("type"), class.type_name.as_str())?;
            hash.aset(ruby.to_symbol("objects"), class.objects)?;
            hash.aset(ruby.to_symbol("bytes"), class.bytes)?;
            let sites = ruby.ary_new();
            for share in &class.sites {
                let site = ruby.hash_new();
                let frames = ruby.ary_new();
                for &f in &j.profile.sites[share.site].frames {
                    frames.push(crate::rows::frame_row(&j.profile.frames[f as usize]))?;
                }
                site.aset(ruby.to_symbol("frames"), frames)?;
                site.aset(ruby.to_symbol("objects"), share.objects)?;
                site.aset(ruby.to_symbol("bytes"), share.bytes)?;
                site.aset(ruby.to_symbol("samples"), share.samples)?;
                sites.push(site)?;
            }
            hash.aset(ruby.to_symbol("sites"), sites)?;
            out.push(hash)?;
        }
        Ok(Some(out))
    }

    /// The joined allocations (in use: the samples still in their slots), nil without sites.
    fn sites_profile(&self) -> Option<NativeAllocationProfile> {
        match &self.1 {
            Some(Sites::Joined(j)) => Some(NativeAllocationProfile::new(j.profile.clone())),
            _ => None,
        }
    }

    /// `[tracking, samples still there, samples gone, published at (Unix ms)]`, nil
    /// without sites.
    fn sites_figures(&self) -> Option<(bool, u64, u64, u64)> {
        match &self.1 {
            Some(Sites::Joined(j)) => Some((j.tracking, j.there, j.gone, j.published_at_ms)),
            _ => None,
        }
    }

    /// The changes since `earlier` as text, the `limit` that grew most, then shrank.
    fn diff_text(&self, earlier: &Self, limit: usize) -> String {
        render::diff_text(&self.0.diff(&earlier.0), limit)
    }
}

/// `{name:, type:, objects:, bytes:, slot_bytes:, heap_bytes:}` per row.
fn rows(ruby: &Ruby, rows: &[ClassRow]) -> Result<RArray, Error> {
    let out = ruby.ary_new_capa(rows.len());
    for r in rows {
        let hash = ruby.hash_new();
        hash.aset(ruby.to_symbol("name"), r.name.as_str())?;
        hash.aset(ruby.to_symbol("type"), r.type_name.as_str())?;
        hash.aset(ruby.to_symbol("objects"), r.objects)?;
        hash.aset(ruby.to_symbol("bytes"), r.bytes())?;
        hash.aset(ruby.to_symbol("slot_bytes"), r.slot_bytes)?;
        hash.aset(ruby.to_symbol("heap_bytes"), r.heap_bytes)?;
        out.push(hash)?;
    }
    Ok(out)
}

/// `{id:, name:, state:, pages:, total_slots:, free_slots:, objects:, bytes:, slot_bytes:,
/// heap_bytes:}` for one Ractor's heap (`id` and `name` nil where unknown).
fn ractor(ruby: &Ruby, r: &RactorHeap) -> Result<RHash, Error> {
    let hash = ruby.hash_new();
    hash.aset(ruby.to_symbol("id"), r.id)?;
    hash.aset(ruby.to_symbol("name"), r.name.as_deref())?;
    hash.aset(ruby.to_symbol("state"), r.state.as_str())?;
    for (key, value) in [
        ("pages", r.pages),
        ("total_slots", r.total_slots),
        ("free_slots", r.free_slots),
        ("objects", r.objects),
        ("bytes", r.slot_bytes + r.heap_bytes),
        ("slot_bytes", r.slot_bytes),
        ("heap_bytes", r.heap_bytes),
    ] {
        hash.aset(ruby.to_symbol(key), value)?;
    }
    Ok(hash)
}

/// `{name:, type:, objects:, bytes:, objects_now:, bytes_now:}` for one class's change.
fn delta(ruby: &Ruby, d: &ClassDelta) -> Result<RHash, Error> {
    let hash = ruby.hash_new();
    hash.aset(ruby.to_symbol("name"), d.name.as_str())?;
    hash.aset(ruby.to_symbol("type"), d.type_name.as_str())?;
    hash.aset(ruby.to_symbol("objects"), d.objects)?;
    hash.aset(ruby.to_symbol("bytes"), d.bytes)?;
    hash.aset(ruby.to_symbol("objects_now"), d.objects_now)?;
    hash.aset(ruby.to_symbol("bytes_now"), d.bytes_now)?;
    Ok(hash)
}

pub fn init(ruby: &Ruby) -> Result<(), Error> {
    let module = ruby.define_module("RubySpy")?;
    let class = module.define_class("NativeCensus", ruby.class_object())?;
    class.define_singleton_method("from_json", function!(NativeCensus::from_json, 1))?;
    class.define_method("to_json", method!(NativeCensus::to_json, 0))?;
    class.define_method("text", method!(NativeCensus::text, 1))?;
    class.define_method("pprof", method!(NativeCensus::pprof, 0))?;
    class.define_method("figures", method!(NativeCensus::figures, 0))?;
    class.define_method("classes", method!(NativeCensus::classes, 0))?;
    class.define_method("types", method!(NativeCensus::types, 0))?;
    class.define_method("ractors", method!(NativeCensus::ractors, 0))?;
    class.define_method("diff", method!(NativeCensus::diff, 1))?;
    class.define_method("diff_text", method!(NativeCensus::diff_text, 2))?;
    class.define_method("sites", method!(NativeCensus::sites, 0))?;
    class.define_method("sites_note", method!(NativeCensus::sites_note, 0))?;
    class.define_method("sites_text", method!(NativeCensus::sites_text, 2))?;
    class.define_method("sites_profile", method!(NativeCensus::sites_profile, 0))?;
    class.define_method("sites_figures", method!(NativeCensus::sites_figures, 0))?;
    crate::classes::resolve::<NativeCensus>(ruby);
    Ok(())
}
