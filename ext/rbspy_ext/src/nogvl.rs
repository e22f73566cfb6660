//! Runs Rust code without the GVL, catching panics so none unwinds across FFI.
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};

struct Call<F, R> {
    func: Option<F>,
    result: Option<std::thread::Result<R>>,
}

unsafe extern "C" fn trampoline<F: FnOnce() -> R, R>(data: *mut c_void) -> *mut c_void {
    // SAFETY: `data` is the `Call` that `nogvl` passed in and keeps alive for the call.
    let call = unsafe { &mut *(data as *mut Call<F, R>) };
    if let Some(func) = call.func.take() {
        call.result = Some(catch_unwind(AssertUnwindSafe(func)));
    }
    std::ptr::null_mut()
}

/// Calls `func` with the GVL released (other Ruby threads keep running while a target's
/// memory is read). `func` must not touch Ruby objects. Returns Err if it panicked.
pub fn nogvl<F: FnOnce() -> R, R>(func: F) -> std::thread::Result<R> {
    let mut call = Call {
        func: Some(func),
        result: None,
    };
    // SAFETY: the trampoline only touches `call`, which outlives this blocking call; no
    // unblocking function is given because the work is short and bounded.
    unsafe {
        rb_sys::rb_thread_call_without_gvl(
            Some(trampoline::<F, R>),
            &mut call as *mut _ as *mut c_void,
            None,
            std::ptr::null_mut(),
        );
    }
    call.result
        .unwrap_or_else(|| Err(Box::new("function did not run")))
}
