//! The weak map that tells which sampled objects are alive while the tracker samples
//! (live.rs): an `ObjectSpace::WeakMap` from each sample's id (a Fixnum, which never dies)
//! to its object. The GC drops an entry when its object dies (from 3.3 when it clears weak
//! references, before that through the map's finalizer, and a lookup in between checks the
//! mark bit), and moves it with the object under `GC.compact`. Every function here calls
//! Ruby: with the GVL, outside any hook.
use rb_sys::VALUE;
use rbspy_ext_core::sync::locked;
use std::sync::Mutex;

/// The current map (0: none yet), in a registered slot so that the GC keeps it alive.
static SLOT: Mutex<Option<&'static mut VALUE>> = Mutex::new(None);

/// A Fixnum for `n` (below 2^62).
fn fixnum(n: u64) -> VALUE {
    ((n << 1) | 1) as VALUE
}

fn call(receiver: VALUE, method: &std::ffi::CStr, args: &[VALUE]) -> VALUE {
    // SAFETY: with the GVL; a method of WeakMap with its arguments. `[]` and `[]=` raise
    // nothing for a Fixnum key and a heap object.
    unsafe {
        let id = rb_sys::rb_intern(method.as_ptr());
        rb_sys::rb_funcallv(receiver, id, args.len() as i32, args.as_ptr())
    }
}

/// A new, empty map for a new tracking run (the old one, and its entries, go).
pub(super) fn renew() {
    // SAFETY: with the GVL: looks up ObjectSpace::WeakMap and makes one.
    let map = unsafe {
        let space = rb_sys::rb_const_get(
            rb_sys::rb_cObject,
            rb_sys::rb_intern(c"ObjectSpace".as_ptr()),
        );
        let class = rb_sys::rb_const_get(space, rb_sys::rb_intern(c"WeakMap".as_ptr()));
        rb_sys::rb_class_new_instance(0, std::ptr::null(), class)
    };
    let mut slot = locked(&SLOT);
    match slot.as_mut() {
        Some(value) => **value = map,
        None => {
            let value: &'static mut VALUE = Box::leak(Box::new(map));
            // SAFETY: a leaked slot, registered once, read by the GC as a root.
            unsafe { rb_sys::rb_gc_register_address(value) };
            *slot = Some(value);
        }
    }
}

fn map() -> Option<VALUE> {
    locked(&SLOT).as_ref().map(|v| **v)
}

/// Puts `object` in the map under sample `id`.
pub(super) fn put(id: u64, object: VALUE) {
    if let Some(map) = map() {
        call(map, c"[]=", &[fixnum(id), object]);
    }
}

/// The object of sample `id`, where it is now, while it is alive.
pub(super) fn get(id: u64) -> Option<VALUE> {
    let map = map()?;
    let object = call(map, c"[]", &[fixnum(id)]);
    (object != rb_sys::Qnil as VALUE).then_some(object)
}
