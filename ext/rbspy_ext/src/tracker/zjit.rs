//! How many methods ZJIT has compiled, where arming the hook throws its compiled code away
//! (`rbspy_ext_core::allocs::hold::Hold` says why the job wants to know).
//!
//! Ruby 4.1 declares `rb_zjit_invalidate_newobj_hook`, which enabling a NEWOBJ hook calls;
//! 4.0's ZJIT compiles no inline allocation and has none. The count is
//! `RubyVM::ZJIT.stats(:compiled_iseq_count)`, one of the counters ZJIT keeps without
//! `--zjit-stats`: about 0.6 µs a call, allocating nothing, nil while ZJIT is off.
use rb_sys::VALUE;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::OnceLock;

/// `RubyVM::ZJIT`, where its compiled code is thrown away by a NEWOBJ hook; 0 elsewhere.
/// A module constant, never freed.
static MODULE: AtomicUsize = AtomicUsize::new(0);
/// The method's ID and the key's Symbol (static, never freed), interned once rather than
/// at every job.
static CALL: OnceLock<(usize, usize)> = OnceLock::new();

/// Finds `RubyVM::ZJIT` where it matters (once per start, with the GVL).
pub(super) fn find() {
    let invalidates = !super::arming::symbol(c"rb_zjit_invalidate_newobj_hook").is_null();
    let module = invalidates.then(constant).flatten().unwrap_or(0);
    if module != 0 {
        // SAFETY: interns static names with the GVL.
        CALL.get_or_init(|| unsafe {
            let stats = rb_sys::rb_intern(c"stats".as_ptr());
            let key = rb_sys::rb_id2sym(rb_sys::rb_intern(c"compiled_iseq_count".as_ptr()));
            (stats as usize, key as usize)
        });
    }
    MODULE.store(module, Relaxed);
}

fn constant() -> Option<usize> {
    // SAFETY: constant lookups with the GVL, each name checked before it is read.
    unsafe {
        let object = rb_sys::rb_cObject;
        let vm = rb_sys::rb_intern(c"RubyVM".as_ptr());
        if rb_sys::rb_const_defined(object, vm) == 0 {
            return None;
        }
        let vm = rb_sys::rb_const_get(object, vm);
        let zjit = rb_sys::rb_intern(c"ZJIT".as_ptr());
        (rb_sys::rb_const_defined(vm, zjit) != 0).then(|| rb_sys::rb_const_get(vm, zjit) as usize)
    }
}

unsafe extern "C" fn compiled_count(module: VALUE) -> VALUE {
    // `find` set CALL before it set MODULE, which `compiled` checks first.
    let Some(&(stats, key)) = CALL.get() else {
        return rb_sys::Qnil as VALUE;
    };
    // SAFETY: called through rb_protect with the GVL.
    unsafe { rb_sys::rb_funcall(module, stats as rb_sys::ID, 1, key as VALUE) }
}

/// The methods ZJIT has compiled so far; None where the hook throws nothing away, or while
/// ZJIT is off. With the GVL, outside any hook and the tracker's lock (a call into Ruby).
pub(super) fn compiled() -> Option<u64> {
    let module = MODULE.load(Relaxed);
    if module == 0 {
        return None;
    }
    let mut state = 0;
    // SAFETY: with the GVL; rb_protect catches whatever the call raises, and the error is
    // cleared so that it does not surface in the interrupted Ruby code.
    let count = unsafe { rb_sys::rb_protect(Some(compiled_count), module as VALUE, &mut state) };
    if state != 0 {
        // SAFETY: as above.
        unsafe { rb_sys::rb_set_errinfo(rb_sys::Qnil as VALUE) };
        return None;
    }
    // A Fixnum: (n << 1) | 1.
    (count & 1 == 1).then_some((count >> 1) as u64)
}
