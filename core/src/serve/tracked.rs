//! What the listener serves from the process's own allocation tracker: the extension's
//! sampled allocations (ext/rbspy_ext/src/tracker), which only Ruby can name, so the
//! extension hands the listener a function that asks a Ruby thread for the profile and waits.
//! `/debug/pprof/allocs` needs it; `/debug/pprof/heap` serves it when tracking is on, and
//! the census (read from outside the VM, as before) when it is off.
use crate::allocs::pprof::Opens;
use std::sync::OnceLock;

/// A profile the listener asks for.
#[derive(Debug, Clone, Copy)]
pub struct AllocsRequest {
    /// `Inuse` for `/heap`, `Allocs` for `/allocs`.
    pub opens: Opens,
    /// Run a full GC first (`?gc=1`, as Go's heap handler).
    pub gc: bool,
}

/// The answer.
pub enum AllocsAnswer {
    /// A gzipped pprof profile.
    Profile(Vec<u8>),
    /// Tracking is off in this process.
    NotTracking,
    /// Tracking is on, but no profile could be made (the text says why).
    Unavailable(String),
}

type Provider = Box<dyn Fn(AllocsRequest) -> AllocsAnswer + Send + Sync>;

static PROVIDER: OnceLock<Provider> = OnceLock::new();

/// Gives every listener of this process its allocation profiles (once: the extension does
/// it when it loads).
pub fn provide_allocations(
    provider: impl Fn(AllocsRequest) -> AllocsAnswer + Send + Sync + 'static,
) {
    let _ = PROVIDER.set(Box::new(provider));
}

/// The tracker's answer, or `NotTracking` where nothing provides one (the core alone).
pub(super) fn ask(request: AllocsRequest) -> AllocsAnswer {
    PROVIDER
        .get()
        .map_or(AllocsAnswer::NotTracking, |provide| provide(request))
}
