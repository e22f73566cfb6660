//! The Ruby face of rbspy_ext: a thin magnus layer over `rbspy_ext_core`. Ruby-side API,
//! docs and the error classes live in lib/; this file only wires the native class.
use magnus::{Error, Ruby};

mod errors;
mod handle;
mod nogvl;
mod recorder;
mod state;

/// Resolves a wrapped type's Ruby class now, while the extension loads (one thread, holding
/// the GVL throughout). magnus looks the class up on first use behind a `OnceLock` whose
/// initialiser calls `const_get`, and Ruby may switch threads inside it; another thread that
/// wants the same class then blocks on the lock while holding the GVL, and the first can never
/// finish. Two threads tagging for the first time at once under GC.stress deadlocked so.
pub(crate) fn resolve_class<T: magnus::TypedData>(ruby: &Ruby) {
    let _ = T::class(ruby);
}

#[magnus::init]
fn init(ruby: &Ruby) -> Result<(), Error> {
    handle::init(ruby)?;
    state::init(ruby)?;
    recorder::init(ruby)
}
