//! Each wrapped type's Ruby class, resolved while the extension loads (its `init`, below
//! lib.rs's): a floor of its own so that every wrapped type's file can call it without
//! importing the file that calls their `init`s.
use magnus::Ruby;

/// Resolves a wrapped type's Ruby class now, while the extension loads (one thread, holding
/// the GVL throughout). Invariant: no `OnceLock` of magnus is first taken after load. magnus
/// looks a wrapped type's class up on first use behind a `OnceLock` whose initialiser calls
/// `const_get`, where Ruby may switch threads; a second thread wanting the class then blocks
/// on the lock while holding the GVL, and the first can never finish: the lock-vs-GVL
/// ordering of <https://github.com/matsadler/magnus/issues/109> (fixed there for `Lazy`, not
/// for this lookup).
pub(crate) fn resolve<T: magnus::TypedData>(ruby: &Ruby) {
    let _ = T::class(ruby);
}
