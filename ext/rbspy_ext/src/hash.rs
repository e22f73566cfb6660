//! Reading a Ruby Hash's pairs without Ruby calls in between, for `RubySpy::State`
//! (crate::state), which `RubySpy.tag` (crate::tag) builds on; and one option of the
//! options Hashes the Ruby side passes.
use magnus::rb_sys::AsRawValue;
use magnus::{Error, RHash, Ruby};
use rb_sys::VALUE;

/// `hash`'s (key, value) pairs in order. Read with a bare `rb_hash_foreach` whose callback
/// only copies words, so nothing can raise inside it and it needs none of the `rb_protect`
/// that magnus wraps each of its callbacks in: that wrapping was a third of the cost of
/// `RubySpy.tag` (`ruby bench/tags.rb`).
pub(crate) fn hash_entries(hash: RHash) -> Vec<(VALUE, VALUE)> {
    unsafe extern "C" fn push(key: VALUE, value: VALUE, out: VALUE) -> std::os::raw::c_int {
        // SAFETY: `out` is the `&mut Vec` passed below, alive for the whole iteration.
        let out = unsafe { &mut *(out as *mut Vec<(VALUE, VALUE)>) };
        out.push((key, value));
        rb_sys::st_retval::ST_CONTINUE as std::os::raw::c_int
    }
    let mut out: Vec<(VALUE, VALUE)> = Vec::with_capacity(hash.len());
    // SAFETY: iterates a live Hash with a callback that calls no Ruby API; the pointer to
    // `out` outlives the call.
    unsafe {
        rb_sys::rb_hash_foreach(
            hash.as_raw(),
            Some(push),
            &mut out as *mut Vec<(VALUE, VALUE)> as VALUE,
        )
    };
    out
}

/// `options[key]` converted, for the options Hashes lib/rbspy_ext/recorder.rb and
/// profile.rb pass (validated there).
pub(crate) fn option<T: magnus::TryConvert>(
    ruby: &Ruby,
    options: RHash,
    key: &str,
) -> Result<T, Error> {
    options.lookup(ruby.to_symbol(key))
}
