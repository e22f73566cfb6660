//! `RubySpy::NativeCensus`: a heap census's forms, for `RubySpy::Census`
//! (lib/rbspy_ext/census.rb), which keeps a census as the JSON the core writes (so that the
//! Ruby object, the saved file and the diff all read the same thing). Taking a census is
//! `NativeHandle#census_json` (handle.rs).
use crate::errors;
use magnus::{function, prelude::*, Error, RString, Ruby};
use rbspy_ext_core::census::{self, Census};
use rbspy_ext_core::output::heap;

fn parse(ruby: &Ruby, json: String) -> Result<Census, Error> {
    Census::from_json(&json).map_err(|e| Error::new(errors::class(ruby, "InvalidCensus"), e))
}

/// The top `limit` classes as text.
fn text(ruby: &Ruby, json: String, limit: usize) -> Result<String, Error> {
    Ok(heap::text(&parse(ruby, json)?, limit))
}

/// The census as a gzipped pprof heap profile (a binary String).
fn pprof(ruby: &Ruby, json: String) -> Result<RString, Error> {
    Ok(ruby.str_from_slice(&heap::pprof(&parse(ruby, json)?)))
}

/// `[deltas_json, text]`: how the census `now` changed since `before`.
fn diff(ruby: &Ruby, now: String, before: String, limit: usize) -> Result<(String, String), Error> {
    let deltas = parse(ruby, now)?.diff(&parse(ruby, before)?);
    let text = heap::diff_text(&deltas, limit);
    Ok((census::deltas_to_json(&deltas), text))
}

pub fn init(ruby: &Ruby) -> Result<(), Error> {
    let module = ruby.define_module("RubySpy")?;
    let native = module.define_module("NativeCensus")?;
    native.define_singleton_method("text", function!(text, 2))?;
    native.define_singleton_method("pprof", function!(pprof, 1))?;
    native.define_singleton_method("diff", function!(diff, 3))?;
    Ok(())
}
