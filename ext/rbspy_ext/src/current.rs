//! The current fiber's `RubySpy::State` (state.rs): it lives in a fiber-local variable, and
//! a `RUBY_EVENT_FIBER_SWITCH` hook, installed once a Ractor first applies a state, points
//! `ruby_profiler_state` at the table of whichever fiber runs (on 3.3+ a thread-resumed hook
//! does the same when a Ruby thread gets the GVL, for M:N threads).
use crate::state::{publish, state_of, State};
use magnus::rb_sys::{AsRawValue, FromRawValue};
use magnus::{function, prelude::*, value::ReprValue, Error, IntoValue, Ruby, Value};
use rb_sys::{ID, VALUE};
use std::ffi::c_void;

/// The fiber-local variable holding the current fiber's `RubySpy::State`.
const FIBER_LOCAL: &str = "__rubyspy_ext_state__";

/// The ID of `FIBER_LOCAL`, interned once at load: the fiber-switch hook must not intern.
static FIBER_LOCAL_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn fiber_local_id() -> ID {
    FIBER_LOCAL_ID.load(std::sync::atomic::Ordering::Relaxed) as ID
}

/// Makes `state` (a `RubySpy::State`, or nil for none) the current fiber's state.
fn apply(ruby: &Ruby, state: Value) -> Result<Value, Error> {
    if !state.is_nil() && <&State>::try_convert(state).is_err() {
        return Err(Error::new(
            ruby.exception_type_error(),
            format!("expected a RubySpy::State or nil, got {}", unsafe {
                state.classname()
            }),
        ));
    }
    let state = refreshed(state.as_raw());
    apply_raw(state);
    // SAFETY: a State or nil, just published and held by the fiber-local.
    Ok(unsafe { Value::from_raw(state) })
}

/// `previous` (a `RubySpy::State` or nil) as it is put back: with the endpoint its trace's
/// local root has now, when it was made before a rename (`otel::renamed`), and with an
/// OpenTelemetry record, when it was made before the bridge came on (`RubySpy.tag` around
/// the process's first `RubySpy.trace`: its samples after the trace would be untagged).
pub(crate) fn refreshed(previous: VALUE) -> VALUE {
    let Some(state) = state_of(previous) else {
        return previous;
    };
    let renamed = state.trace().and_then(|trace| crate::otel::renamed(trace));
    let unrecorded = !state.has_record() && crate::otel::is_on();
    let (true, Ok(ruby)) = (renamed.is_some() || unrecorded, Ruby::get()) else {
        return previous;
    };
    let trace = renamed
        .map(std::sync::Arc::new)
        .or_else(|| state.trace().cloned());
    match State::traced(Some(state), trace) {
        Some(state) => state.into_value_with(&ruby).as_raw(),
        None => previous,
    }
}

/// `apply` for a VALUE known to be a `RubySpy::State` or nil. Never raises.
pub(crate) fn apply_raw(state: VALUE) {
    // SAFETY: plain C API calls on the current thread, with the GVL.
    let thread = unsafe { rb_sys::rb_thread_current() };
    if !rb_sys::NIL_P(state) {
        install_hook();
    }
    publish(state, thread);
    unsafe { rb_sys::rb_thread_local_aset(thread, fiber_local_id(), state) };
}

/// The current fiber's state, or nil.
pub(crate) fn current(_ruby: &Ruby) -> Value {
    // SAFETY: plain C API calls on the current thread, with the GVL.
    unsafe {
        Value::from_raw(rb_sys::rb_thread_local_aref(
            rb_sys::rb_thread_current(),
            fiber_local_id(),
        ))
    }
}

extern "C" {
    /// Declared here with plain integer flags: rb-sys types them as an enum, which cannot
    /// hold SAFE | RAW_ARG.
    #[link_name = "rb_add_event_hook2"]
    fn add_event_hook_raw(
        func: unsafe extern "C" fn(VALUE, *mut c_void),
        events: rb_sys::rb_event_flag_t,
        data: VALUE,
        hook_flag: u32,
    );
}
/// `RUBY_EVENT_HOOK_FLAG_SAFE | RUBY_EVENT_HOOK_FLAG_RAW_ARG` (ruby/debug.h): a raw-argument
/// hook skips building the Ruby-level trace argument on every fiber switch.
const HOOK_SAFE_RAW: u32 = 0x01 | 0x04;

/// Runs on every fiber switch, in the fiber switched to.
unsafe extern "C" fn on_fiber_switch(_data: VALUE, _trace_arg: *mut c_void) {
    // Nothing here can panic or raise: a lookup of a fiber-local and `state_of`'s checks.
    // SAFETY: with the GVL, in the fiber now running.
    unsafe {
        let thread = rb_sys::rb_thread_current();
        publish(
            rb_sys::rb_thread_local_aref(thread, fiber_local_id()),
            thread,
        );
    }
}

/// The part of `rb_internal_thread_event_data_t` the hook reads (3.3+: the thread the event
/// is about). Declared here because rb-sys marks the internal struct deprecated.
#[cfg(ruby_gte_3_3)]
#[repr(C)]
struct ThreadEventData {
    thread: VALUE,
}

#[cfg(ruby_gte_3_3)]
extern "C" {
    fn rb_internal_thread_add_event_hook(
        func: unsafe extern "C" fn(u32, *const ThreadEventData, *mut c_void),
        events: u32,
        data: *mut c_void,
    ) -> *mut c_void;
}

/// Runs when a Ruby thread has acquired the GVL, on the native thread that will run it.
/// Under M:N threads (`RUBY_MN_THREADS=1`, 3.3+) a Ruby thread can resume on another native
/// thread than it left, and another Ruby thread can have run on this one meanwhile, with no
/// fiber switch; the native thread's pointer must then become the resumed thread's current
/// fiber's table. With 1:1 threads it rewrites the value already there.
#[cfg(ruby_gte_3_3)]
unsafe extern "C" fn on_thread_resumed(
    _event: u32,
    data: *const ThreadEventData,
    _user: *mut c_void,
) {
    // SAFETY: Ruby passes event data for the thread that now holds the GVL (RESUMED is the
    // one thread event delivered with the GVL held), so its fiber-locals can be looked up.
    // Nothing here can panic or raise.
    unsafe {
        if data.is_null() {
            return;
        }
        let thread = (*data).thread;
        publish(
            rb_sys::rb_thread_local_aref(thread, fiber_local_id()),
            thread,
        );
    }
}

/// Whether this Ractor has installed `on_fiber_switch`: only from the first state one of its
/// fibers applies, so a process that loads the gem and never tags pays nothing on fiber
/// switches. Until then every fiber's state is nil and every thread's pointer null, which is
/// what the hook would publish. Ruby keeps event hooks per Ractor (3.0+), so each Ractor
/// installs its own, and remembers it in a Ractor-local slot (`hooks::here`).
#[cfg(ruby_gte_3_0)]
mod hooks {
    use std::sync::atomic::{AtomicPtr, Ordering};

    /// The Ractor-local key, made once at load (by the main Ractor).
    static KEY: AtomicPtr<rb_sys::rb_ractor_local_key_struct> =
        AtomicPtr::new(std::ptr::null_mut());

    pub fn init() {
        // SAFETY: a key with the default (null) type: its slots hold a plain flag, with
        // nothing to mark or free.
        let key = unsafe { rb_sys::rb_ractor_local_storage_ptr_newkey(std::ptr::null()) };
        KEY.store(key, Ordering::Relaxed);
    }

    /// Whether the current Ractor has its hook; marks it as having it when `set`.
    pub fn here(set: bool) -> bool {
        let key = KEY.load(Ordering::Relaxed);
        // SAFETY: the key made by `init`, used with the current Ractor's GVL held.
        unsafe {
            let had = !rb_sys::rb_ractor_local_storage_ptr(key).is_null();
            if set && !had {
                // Any non-null pointer: the slot is a flag, never dereferenced.
                rb_sys::rb_ractor_local_storage_ptr_set(key, std::ptr::dangling_mut());
            }
            had
        }
    }
}

/// Before Ractors (2.7) the process has one set of hooks.
#[cfg(not(ruby_gte_3_0))]
mod hooks {
    use std::sync::atomic::{AtomicBool, Ordering};
    static INSTALLED: AtomicBool = AtomicBool::new(false);

    pub fn init() {}

    pub fn here(set: bool) -> bool {
        if set {
            INSTALLED.swap(true, Ordering::Relaxed)
        } else {
            INSTALLED.load(Ordering::Relaxed)
        }
    }
}

/// Whether the thread-resumed hook is installed. Thread event hooks are the process's (not
/// a Ractor's), so it is installed once, by whichever Ractor tags first.
#[cfg(ruby_gte_3_3)]
static THREAD_HOOK_INSTALLED: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

fn install_hook() {
    // With this Ractor's GVL, so none of its threads gets here at once; the flag only saves
    // the call.
    if hooks::here(true) {
        return;
    }
    // SAFETY: a raw-argument hook with the signature Ruby calls such hooks with
    // (`(VALUE data, rb_trace_arg_t *)`), installed once per Ractor.
    unsafe {
        add_event_hook_raw(
            on_fiber_switch,
            rb_sys::RUBY_EVENT_FIBER_SWITCH as rb_sys::rb_event_flag_t,
            rb_sys::Qnil as VALUE,
            HOOK_SAFE_RAW,
        );
    }
    // Atomically, as Ractors tag in parallel.
    #[cfg(ruby_gte_3_3)]
    if !THREAD_HOOK_INSTALLED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        // SAFETY: a hook with the signature Ruby calls thread event hooks with.
        unsafe {
            rb_internal_thread_add_event_hook(
                on_thread_resumed,
                rb_sys::RUBY_INTERNAL_THREAD_EVENT_RESUMED,
                std::ptr::null_mut(),
            );
        }
    }
}

/// Whether the current Ractor's fiber-switch hook is installed yet (for specs and the
/// benchmark).
fn hook_installed() -> bool {
    hooks::here(false)
}

/// Whether this build re-syncs the pointer when a thread resumes (built for Ruby 3.3+, where
/// M:N threads exist), for specs.
fn resyncs_on_resume() -> bool {
    cfg!(ruby_gte_3_3)
}

pub fn init(ruby: &Ruby) -> Result<(), Error> {
    // SAFETY: interning a static name; IDs of static names are never freed.
    let id = unsafe { rb_sys::rb_intern2(FIBER_LOCAL.as_ptr().cast(), FIBER_LOCAL.len() as _) };
    FIBER_LOCAL_ID.store(id as u64, std::sync::atomic::Ordering::Relaxed);
    hooks::init();
    let class = ruby
        .define_module("RubySpy")?
        .const_get::<_, magnus::RClass>("State")?;
    class.define_singleton_method("current", function!(current, 0))?;
    class.define_singleton_method("apply", function!(apply, 1))?;
    class.define_singleton_method("hook_installed?", function!(hook_installed, 0))?;
    class.define_singleton_method("resyncs_on_resume?", function!(resyncs_on_resume, 0))?;
    Ok(())
}
