//! `RubySpy::State`: an immutable set of tags published through the exported thread-local
//! `ruby_profiler_state` (src/profiler_state.c), so readers outside the process (BPF
//! programs, rbspy_ext's own sampler) can tag what they see with application context.
//!
//! The current fiber's state lives in a fiber-local variable; a `RUBY_EVENT_FIBER_SWITCH`
//! hook, installed once the process first applies a state, points `ruby_profiler_state` at
//! the table of whichever fiber runs (and on 3.3+ a thread-resumed hook does the same when a
//! Ruby thread gets the GVL, for M:N threads). A table is built
//! once and never changed, so a reader that interrupts the thread anywhere sees a whole one.
//! The Ruby API (`RubySpy.tag`, `RubySpy.tags`, inheritance into new fibers and threads) is
//! lib/rbspy_ext/state.rb.
use magnus::rb_sys::{AsRawValue, FromRawValue};
use magnus::{
    function, gc, method, prelude::*, value::ReprValue, DataTypeFunctions, Error, RClass, RHash,
    Ruby, Symbol, TypedData, Value,
};
use rb_sys::{ID, VALUE};
use std::ffi::c_void;

/// Most tags one state may hold: readers walk every slot, and BPF programs must bound
/// their loops.
pub const MAX_TAGS: usize = 1024;

extern "C" {
    fn rbspy_ext_state_init() -> std::os::raw::c_long;
    fn rbspy_ext_state_set(state: *const c_void, owner: *const c_void);
}

/// The fiber-local variable holding the current fiber's `RubySpy::State`.
const FIBER_LOCAL: &str = "__rubyspy_ext_state__";

#[derive(TypedData)]
#[magnus(class = "RubySpy::State", free_immediately, mark, size)]
pub struct State {
    /// The published table: `size`, `capacity`, then `capacity` (key, value) pairs; key 0
    /// is an empty slot. Boxed so its address never changes while published.
    table: Box<[u64]>,
    /// (ID, VALUE) in the order given, for `to_h`; the values are marked (pinned) by `mark`.
    pairs: Vec<(ID, VALUE)>,
}

impl DataTypeFunctions for State {
    fn mark(&self, _marker: &gc::Marker) {
        for (_, value) in &self.pairs {
            // rb_gc_mark pins: a published VALUE must not move under an outside reader
            // (GC.compact), and must stay alive while any table holds it.
            // SAFETY: called by the GC's mark phase with a VALUE this object keeps.
            unsafe { rb_sys::rb_gc_mark(*value) };
        }
    }
}

impl State {
    /// A table for `pairs` in the published layout: capacity the smallest power of two at
    /// least twice the pairs (at least 2), first slot `key & (capacity - 1)`, linear probing.
    fn new(pairs: Vec<(ID, VALUE)>) -> State {
        let capacity = (pairs.len() * 2).next_power_of_two().max(2);
        let mut table = vec![0u64; 2 + 2 * capacity].into_boxed_slice();
        table[0] = pairs.len() as u64;
        table[1] = capacity as u64;
        let mask = capacity - 1;
        for (key, value) in &pairs {
            let mut slot = (*key as usize) & mask;
            while table[2 + 2 * slot] != 0 {
                slot = (slot + 1) & mask;
            }
            table[2 + 2 * slot] = *key;
            table[3 + 2 * slot] = *value;
        }
        State { table, pairs }
    }

    /// `base`'s tags overridden and extended by `hash` (Symbol keys only).
    fn merged(ruby: &Ruby, base: Option<&State>, hash: RHash) -> Result<State, Error> {
        let mut pairs: Vec<(ID, VALUE)> = base.map(|b| b.pairs.clone()).unwrap_or_default();
        hash.foreach(|key: Value, value: Value| {
            let Some(sym) = Symbol::from_value(key) else {
                return Err(Error::new(
                    ruby.exception_type_error(),
                    format!(
                        "tag keys must be Symbols, got {} ({})",
                        key.inspect(),
                        unsafe { key.classname() }
                    ),
                ));
            };
            // SAFETY: a Symbol VALUE; rb_sym2id also pins a dynamic symbol's ID.
            let id = unsafe { rb_sys::rb_sym2id(sym.as_raw()) };
            let raw = value.as_raw();
            match pairs.iter_mut().find(|(k, _)| *k == id) {
                Some(pair) => pair.1 = raw,
                None => pairs.push((id, raw)),
            }
            Ok(magnus::r_hash::ForEach::Continue)
        })?;
        if pairs.len() > MAX_TAGS {
            return Err(Error::new(
                ruby.exception_arg_error(),
                format!(
                    "{} tags is more than the {MAX_TAGS} one state may hold",
                    pairs.len()
                ),
            ));
        }
        Ok(State::new(pairs))
    }

    /// `RubySpy::State.new(hash)` (the keyword form is in Ruby).
    fn build(ruby: &Ruby, hash: RHash) -> Result<State, Error> {
        State::merged(ruby, None, hash)
    }

    /// A new state: these tags merged over this one's.
    fn with(ruby: &Ruby, rb_self: &Self, hash: RHash) -> Result<State, Error> {
        State::merged(ruby, Some(rb_self), hash)
    }

    fn to_h(ruby: &Ruby, rb_self: &Self) -> Result<RHash, Error> {
        let h = ruby.hash_new();
        for (id, value) in &rb_self.pairs {
            // SAFETY: IDs of Symbols this state pinned; values it keeps alive.
            let (key, value) = unsafe {
                (
                    Value::from_raw(rb_sys::rb_id2sym(*id)),
                    Value::from_raw(*value),
                )
            };
            h.aset(key, value)?;
        }
        Ok(h)
    }

    fn size(&self) -> usize {
        self.pairs.len()
    }

    /// The published table's address (for specs that check the exported pointer).
    fn table_address(&self) -> u64 {
        self.table.as_ptr() as u64
    }
}

/// The ID of `FIBER_LOCAL`, interned once at load: the fiber-switch hook must not intern.
static FIBER_LOCAL_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn fiber_local_id() -> ID {
    FIBER_LOCAL_ID.load(std::sync::atomic::Ordering::Relaxed) as ID
}

/// The table of `state` if it is a `RubySpy::State`, else null. Runs in the fiber-switch hook,
/// so it checks the object by hand (immediate? T_DATA? our exact data type?) instead of going
/// through `rb_check_typeddata`: cheaper, and never raises. Anything else (nil, or an object
/// someone stored under the fiber-local's name with `Thread#[]=`) publishes no table.
fn table_of(state: VALUE) -> *const c_void {
    if rb_sys::SPECIAL_CONST_P(state) {
        return std::ptr::null();
    }
    let ours = <State as TypedData>::data_type() as *const magnus::DataType
        as *const rb_sys::rb_data_type_t;
    // SAFETY: `state` is a heap object (not a special constant), so its type, typed-data
    // flag and data type can be read; the data pointer is only used once the data type is
    // ours, which makes it the `State` magnus wrapped.
    unsafe {
        if rb_sys::RB_BUILTIN_TYPE(state) != rb_sys::ruby_value_type::RUBY_T_DATA
            || !rb_sys::RTYPEDDATA_P(state)
            || rb_sys::RTYPEDDATA_TYPE(state) != ours
        {
            return std::ptr::null();
        }
        let data = rb_sys::RTYPEDDATA_GET_DATA(state) as *const State;
        if data.is_null() {
            return std::ptr::null();
        }
        (*data).table.as_ptr().cast()
    }
}

/// Points `ruby_profiler_state` at the table of `state` (a `RubySpy::State` or nil), the
/// current state of Ruby thread `thread` (a Thread), and `ruby_profiler_state_owner` at
/// that thread's `rb_thread_t`, which is what readers outside find in Ruby's thread list.
fn publish(state: VALUE, thread: VALUE) {
    // SAFETY: a Thread is typed data whose data pointer is its rb_thread_t. This sets this
    // native thread's pointers; the table lives as long as `state`, which the current
    // fiber's locals keep alive.
    unsafe {
        let owner = rb_sys::RTYPEDDATA_GET_DATA(thread) as *const c_void;
        rbspy_ext_state_set(table_of(state), owner)
    };
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
    // SAFETY: plain C API calls on the current thread, with the GVL.
    let thread = unsafe { rb_sys::rb_thread_current() };
    unsafe { rb_sys::rb_thread_local_aset(thread, fiber_local_id(), state.as_raw()) };
    if !state.is_nil() {
        install_hook();
    }
    publish(state.as_raw(), thread);
    Ok(state)
}

/// The current fiber's state, or nil.
fn current(_ruby: &Ruby) -> Value {
    // SAFETY: plain C API calls on the current thread, with the GVL.
    unsafe {
        Value::from_raw(rb_sys::rb_thread_local_aref(
            rb_sys::rb_thread_current(),
            fiber_local_id(),
        ))
    }
}

/// The table `ruby_profiler_state` points at on this native thread right now (0 for none).
fn published_address() -> u64 {
    extern "C" {
        fn rbspy_ext_state_get() -> *const c_void;
    }
    // SAFETY: reads this thread's pointer.
    unsafe { rbspy_ext_state_get() as u64 }
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
    // Nothing here can panic or raise: a lookup of a fiber-local and `table_of`'s checks.
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

/// Whether `on_fiber_switch` is installed: only from the first state a fiber applies, so a
/// process that loads the gem and never tags pays nothing on fiber switches. Until then every
/// fiber's state is nil and every thread's pointer null, which is what the hook would publish.
static HOOK_INSTALLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn install_hook() {
    use std::sync::atomic::Ordering;
    // With the GVL, so no two threads get here at once; the flag only saves the call.
    if HOOK_INSTALLED.swap(true, Ordering::Relaxed) {
        return;
    }
    // SAFETY: a raw-argument hook with the signature Ruby calls such hooks with
    // (`(VALUE data, rb_trace_arg_t *)`), installed once.
    unsafe {
        add_event_hook_raw(
            on_fiber_switch,
            rb_sys::RUBY_EVENT_FIBER_SWITCH as rb_sys::rb_event_flag_t,
            rb_sys::Qnil as VALUE,
            HOOK_SAFE_RAW,
        );
        #[cfg(ruby_gte_3_3)]
        rb_internal_thread_add_event_hook(
            on_thread_resumed,
            rb_sys::RUBY_INTERNAL_THREAD_EVENT_RESUMED,
            std::ptr::null_mut(),
        );
    }
}

/// Whether the fiber-switch hook is installed yet (for specs and the benchmark).
fn hook_installed() -> bool {
    HOOK_INSTALLED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether this build re-syncs the pointer when a thread resumes (built for Ruby 3.3+, where
/// M:N threads exist), for specs.
fn resyncs_on_resume() -> bool {
    cfg!(ruby_gte_3_3)
}

pub fn init(ruby: &Ruby) -> Result<(), Error> {
    // SAFETY: computes the published offset once, on the loading thread.
    unsafe { rbspy_ext_state_init() };
    // SAFETY: interning a static name; IDs of static names are never freed.
    let id = unsafe { rb_sys::rb_intern2(FIBER_LOCAL.as_ptr().cast(), FIBER_LOCAL.len() as _) };
    FIBER_LOCAL_ID.store(id as u64, std::sync::atomic::Ordering::Relaxed);
    let module = ruby.define_module("RubySpy")?;
    let class: RClass = module.define_class("State", ruby.class_object())?;
    class.undef_default_alloc_func();
    class.define_singleton_method("build", function!(State::build, 1))?;
    class.define_singleton_method("current", function!(current, 0))?;
    class.define_singleton_method("apply", function!(apply, 1))?;
    class.define_singleton_method("published_address", function!(published_address, 0))?;
    class.define_singleton_method("hook_installed?", function!(hook_installed, 0))?;
    class.define_singleton_method("resyncs_on_resume?", function!(resyncs_on_resume, 0))?;
    class.define_method("with_hash", method!(State::with, 1))?;
    class.define_method("to_h", method!(State::to_h, 0))?;
    class.define_method("size", method!(State::size, 0))?;
    class.define_method("table_address", method!(State::table_address, 0))?;
    crate::resolve_class::<State>(ruby);
    Ok(())
}
