//! The Ruby face of rbspy_ext: a thin magnus layer over `rbspy_ext_core`. Ruby-side API,
//! docs and the error classes live in lib/; this file only wires the native class.
use magnus::{Error, Ruby};

mod alloc_profile;
mod allocs;
mod census;
mod classes;
mod current;
mod errors;
mod guard;
mod handle;
mod hash;
mod native_otel;
mod nogvl;
mod otel;
mod profile;
mod recorder;
mod rows;
mod server;
mod state;
mod tag;
mod tracker;

/// The Ruby series ("3.1") this library was compiled for (build.rs).
const BUILT_FOR: &str = env!("RBSPY_EXT_RUBY_SERIES");

/// A library compiled against one Ruby's headers and loaded by another could misread that
/// Ruby's structs and crash it: refuse with a LoadError that says what to do
/// (lib/rbspy_ext/native.rb adds the path). A fat gem keeps one library per series, and a
/// copied or misplaced one must not load.
fn check_series(ruby: &Ruby) -> Result<(), Error> {
    let running: String = ruby.eval("RUBY_VERSION")?;
    let series = running.splitn(3, '.').take(2).collect::<Vec<_>>().join(".");
    if series == BUILT_FOR {
        return Ok(());
    }
    Err(Error::new(
        ruby.exception_load_error(),
        format!(
            "this rbspy_ext.so was compiled for Ruby {BUILT_FOR} and cannot run in Ruby \
             {running}; reinstall rbspy_ext for this Ruby (gem install rbspy_ext, or rake \
             compile in a checkout)"
        ),
    ))
}

/// Marks the methods defined next as callable from any Ractor (3.0+). What they share
/// between Ractors was audited for it:
/// - `state.rs`: the published-table registry (`PUBLISHED`: a mutex, taken without calling
///   into Ruby, so no GC barrier can stop a holder) and its per-native-thread slots; the
///   fiber-local's ID (interned once at load); the fiber-switch hook, which Ruby keeps per
///   Ractor and so each Ractor installs (a Ractor-local flag), and the process-wide
///   thread-resumed hook, installed once behind an atomic flag; the grace period (atomic);
/// - wrapped types' classes, resolved at load (`resolve_class`), and error classes, looked
///   up by constant on each error (a module is shareable);
/// - the pprof listener's threads never call into Ruby; its fork handler is registered
///   once behind a `Once`;
/// - handles, recorders and profiles are objects of the Ractor that made them, each behind
///   its own mutex.
fn ractor_safe() {
    #[cfg(ruby_gte_3_0)]
    // SAFETY: sets a flag Ruby reads while the extension's Init function defines methods.
    unsafe {
        rb_sys::rb_ext_ractor_safe(true)
    };
}

#[magnus::init]
fn init(ruby: &Ruby) -> Result<(), Error> {
    check_series(ruby)?;
    ractor_safe();
    alloc_profile::init(ruby)?;
    census::init(ruby)?;
    allocs::init(ruby)?;
    handle::init(ruby)?;
    state::init(ruby)?;
    current::init(ruby)?;
    tag::init(ruby)?;
    native_otel::init(ruby)?;
    server::init(ruby)?;
    profile::init(ruby)?;
    recorder::init(ruby)
}
