//! `RubySpy::State`: an immutable set of tags published through the exported thread-local
//! `ruby_profiler_state` (src/profiler_state.c), so readers outside the process (BPF
//! programs, rbspy_ext's own sampler) can tag what they see with application context.
//!
//! Which state is current, fiber by fiber, and the hooks that publish it when fibers and
//! threads switch, are current.rs. A table is built once and never changed, so a reader
//! that interrupts the thread anywhere sees a whole one.
//! The Ruby API (`RubySpy.tag`, `RubySpy.tags`, inheritance into new fibers and threads) is
//! lib/rbspy_ext/state.rb.
//!
//! A reader outside reads a thread's pointer, then the table it points at: if the table were
//! freed in between, it would decode freed memory (and a reused slot as someone else's
//! tags). So a table that stops being published stays alive, with its values, for a grace
//! period (`Published`): readers that read the table within `READABLE_US` of its pointer
//! read the one that was published (docs/profiler-state.md).
use crate::otel::Trace;
use magnus::rb_sys::{AsRawValue, FromRawValue};
use magnus::{
    function, gc, method, prelude::*, value::ReprValue, DataTypeFunctions, Error, RClass, RHash,
    RString, Ruby, Symbol, TypedData, Value,
};
use rb_sys::{ID, VALUE};
use rbspy_ext_core::context::ownership::UNPUBLISHED_ALIVE;
use rbspy_ext_core::context::profiler_state;
use rbspy_ext_core::sync::locked;
use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Most tags one state may hold: readers walk every slot, and BPF programs must bound
/// their loops.
pub const MAX_TAGS: usize = 1024;

extern "C" {
    fn rbspy_ext_state_init() -> std::os::raw::c_long;
    fn rbspy_ext_state_set(
        state: *const c_void,
        record: *const c_void,
        owner: *const c_void,
        object: VALUE,
    ) -> VALUE;
}

#[derive(TypedData)]
#[magnus(class = "RubySpy::State", free_immediately, mark, size)]
pub struct State {
    /// The published table: `size`, `capacity`, then `capacity` (key, value) pairs; key 0
    /// is an empty slot. Boxed so its address never changes while published.
    table: Box<[u64]>,
    /// (ID, VALUE) in the order given, for `to_h`; the values are marked (pinned) by `mark`.
    pairs: Vec<(ID, VALUE)>,
    /// The OpenTelemetry span that was current when this state was made (otel.rs), if any.
    trace: Option<Arc<Trace>>,
    /// OTEP 4947's record of this state, what `otel_thread_ctx_v1` points at while it is
    /// published: its trace, and its tags as attributes. Made only while the OpenTelemetry
    /// bridge is on (otel.rs), so an app without it pays nothing for it. In u16s: the OTEP
    /// wants a record 2-byte aligned.
    record: Option<Box<[u16]>>,
    /// When this state last entered `Published::retired` (`now_us`; 0 never).
    retired_at: AtomicU64,
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
    /// A table for `pairs` in the published layout (`profiler_state::encode`), and the
    /// OpenTelemetry record for them and `trace` when the bridge is on.
    fn new(pairs: Vec<(ID, VALUE)>, trace: Option<Arc<Trace>>) -> State {
        let table = profiler_state::encode(&pairs);
        let record = crate::otel::record(&pairs, trace.as_deref());
        State {
            table,
            pairs,
            trace,
            record,
            retired_at: AtomicU64::new(0),
        }
    }

    /// `base`'s tags under `trace` (None: no span current), or None for a state of neither.
    pub(crate) fn traced(base: Option<&State>, trace: Option<Arc<Trace>>) -> Option<State> {
        let pairs = base.map_or_else(Vec::new, |b| b.pairs.clone());
        (!pairs.is_empty() || trace.is_some()).then(|| State::new(pairs, trace))
    }

    /// Whether this state carries an OpenTelemetry record (it was made with the bridge on).
    pub(crate) fn has_record(&self) -> bool {
        self.record.is_some()
    }

    /// The trace this state was made under.
    pub(crate) fn trace(&self) -> Option<&Arc<Trace>> {
        self.trace.as_ref()
    }

    /// `RubySpy::State#otel_record`: the OpenTelemetry record this state publishes (a binary
    /// String), or nil.
    fn otel_record_string(ruby: &Ruby, rb_self: &Self) -> Option<RString> {
        let words = rb_self.record.as_deref()?;
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
        // Exactly the record's length: the u16s may end with a byte of padding.
        let len = rbspy_ext_core::context::otel_thread::Head::parse(&bytes)
            .map_or(bytes.len(), |h| h.record_len());
        Some(ruby.str_from_slice(&bytes[..len]))
    }

    /// `base`'s tags overridden and extended by `hash` (Symbol keys only).
    pub(crate) fn merged(ruby: &Ruby, base: Option<&State>, hash: RHash) -> Result<State, Error> {
        let entries = crate::hash::hash_entries(hash);
        let base_trace = base.and_then(|b| b.trace.as_ref());
        let base = base.map_or(&[][..], |b| &b.pairs[..]);
        let mut pairs: Vec<(ID, VALUE)> = Vec::with_capacity(base.len() + entries.len());
        pairs.extend_from_slice(base);
        for (key, value) in entries {
            // SAFETY: `key` came from the live hash, which the caller holds.
            let key = unsafe { Value::from_raw(key) };
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
            match pairs.iter_mut().find(|(k, _)| *k == id) {
                Some(pair) => pair.1 = value,
                None => pairs.push((id, value)),
            }
        }
        if pairs.len() > MAX_TAGS {
            return Err(Error::new(
                ruby.exception_arg_error(),
                format!(
                    "{} tags is more than the {MAX_TAGS} one state may hold",
                    pairs.len()
                ),
            ));
        }
        Ok(State::new(pairs, base_trace.cloned()))
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

/// The `State` inside `state` if it is a `RubySpy::State`, else None. Runs in the
/// fiber-switch hook, so it checks the object by hand (immediate? T_DATA? our exact data
/// type?) instead of going through `rb_check_typeddata`: cheaper, and never raises. Anything
/// else (nil, or an object someone stored under the fiber-local's name with `Thread#[]=`)
/// publishes no table.
pub(crate) fn state_of<'a>(state: VALUE) -> Option<&'a State> {
    if rb_sys::SPECIAL_CONST_P(state) {
        return None;
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
            return None;
        }
        (rb_sys::RTYPEDDATA_GET_DATA(state) as *const State).as_ref()
    }
}

/// Points `ruby_profiler_state` at the table of `state` (a `RubySpy::State` or nil), the
/// current state of Ruby thread `thread` (a Thread), and `ruby_profiler_state_owner` at
/// that thread's `rb_thread_t`, which is what readers outside find in Ruby's thread list.
pub(crate) fn publish(state: VALUE, thread: VALUE) {
    let found = state_of(state);
    let table: *const c_void = found.map_or(std::ptr::null(), |s| s.table.as_ptr().cast());
    let record =
        (found.and_then(|s| s.record.as_ref())).map_or(std::ptr::null(), |r| r.as_ptr().cast());
    let object = if table.is_null() { 0 } else { state };
    // SAFETY: a Thread is typed data whose data pointer is its rb_thread_t. This sets this
    // native thread's pointers and learns which State they held until now.
    let previous = unsafe {
        let owner = rb_sys::RTYPEDDATA_GET_DATA(thread) as *const c_void;
        rbspy_ext_state_set(table, record, owner, object)
    };
    if previous != object {
        // The common case, a fiber switch between fibers with the same tags, ends above.
        // Fails only during this native thread's exit, after its slot is gone.
        let _ = PUBLISHED_HERE.try_with(|slot| slot.replace(object));
    }
}

/// Microseconds of CLOCK_MONOTONIC_COARSE: read whenever a thread's table changes, which a
/// fiber switch between fibers tagged apart does every time; it costs a few ns where the
/// precise clock costs some 20 (`ruby bench/tags.rb`, "fibers tagged apart").
fn now_us() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1000
}

/// How long, at least, a table that stopped being published stays readable: the promise to
/// readers in docs/profiler-state.md (a reader needs microseconds; rbspy_ext's own gives up
/// on a table after `rbspy_ext_core::context::ownership::TABLE_WINDOW`, within it).
const READABLE_US: u64 = UNPUBLISHED_ALIVE.as_micros() as u64;

/// How long a State is queued after it stops being published: `2 * (READABLE_US + the coarse
/// clock's resolution)` (set by `init`; 28 ms at the usual 4 ms). A State retired again
/// within half of it is not queued twice, and a coarse reading lags by up to one resolution,
/// so each stays at least `READABLE_US`. Short because a tight tagging loop keeps the States
/// of the last `GRACE_US` alive: 600 000 `RubySpy.tag` blocks a second hold some 8 MB.
static GRACE_US: AtomicU64 = AtomicU64::new(2 * (READABLE_US + 10_000));

fn grace_us() -> u64 {
    GRACE_US.load(Ordering::Relaxed)
}

/// Sets `GRACE_US` from the coarse clock's resolution (1 to 10 ms, by the kernel's HZ).
fn set_grace() {
    let mut res = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes the timespec it is given.
    if unsafe { libc::clock_getres(libc::CLOCK_MONOTONIC_COARSE, &mut res) } == 0 {
        let res_us = (res.tv_sec as u64 * 1_000_000 + res.tv_nsec as u64 / 1000).min(100_000);
        GRACE_US.store(2 * (READABLE_US + res_us), Ordering::Relaxed);
    }
}

/// What keeps published tables readable: the State each native thread publishes now (one
/// slot per native thread that ever published one) and the States retired within the last
/// `GRACE_US`, oldest first. Both are marked (pinned) by `mark_published`, so none of these
/// States, their tables or their values is freed or moved while a reader may be reading it.
struct Published {
    slots: Vec<Arc<AtomicU64>>,
    retired: VecDeque<(VALUE, u64)>,
}

static PUBLISHED: Mutex<Published> = Mutex::new(Published {
    slots: Vec::new(),
    retired: VecDeque::new(),
});

fn published() -> std::sync::MutexGuard<'static, Published> {
    // Nothing panics while holding it, but a poisoned lock must not stop marking.
    locked(&PUBLISHED)
}

/// When to queue `object`, a State that stopped being published just now, or None if it
/// needs no queueing: not a State, or queued within the last `grace_us() / 2` and so still
/// queued for at least that long (a fiber switching between two tagged fibers retires both
/// over and over). Called while `object` is still known alive: with the GVL right after it
/// left its slot (no GC can run in between), or under the lock.
fn queue_time(object: VALUE) -> Option<u64> {
    let state = state_of(object)?;
    let now = now_us();
    let last = state.retired_at.load(Ordering::Relaxed);
    if last != 0 && now.saturating_sub(last) < grace_us() / 2 {
        return None;
    }
    state.retired_at.store(now, Ordering::Relaxed);
    Some(now)
}

impl Published {
    /// Queues `object` (a State) for `GRACE_US` from `now`, dropping what has waited longer.
    fn queue(&mut self, object: VALUE, now: u64) {
        while let Some(&(_, at)) = self.retired.front() {
            if now.saturating_sub(at) <= grace_us() {
                break;
            }
            self.retired.pop_front();
        }
        self.retired.push_back((object, now));
    }
}

/// This native thread's slot in `Published::slots`; dropped when the native thread exits,
/// which retires what it published last (a thread that ended tagged must not keep its State
/// forever, nor lose it while a reader reads).
struct PublishedHere(Arc<AtomicU64>);

impl PublishedHere {
    fn new() -> PublishedHere {
        let slot = Arc::new(AtomicU64::new(0));
        published().slots.push(slot.clone());
        PublishedHere(slot)
    }

    /// Makes `object` this native thread's published State and retires the one before. With
    /// the GVL: marking, which holds it too, never sees the State in neither place.
    fn replace(&self, object: VALUE) {
        let previous = self.0.swap(object, Ordering::Relaxed) as VALUE;
        if let Some(now) = queue_time(previous) {
            published().queue(previous, now);
        }
    }
}

impl Drop for PublishedHere {
    fn drop(&mut self) {
        // At native-thread exit, without the GVL: under the lock, so marking sees the State
        // in the slot or in the queue.
        let mut published = published();
        let previous = self.0.swap(0, Ordering::Relaxed) as VALUE;
        published.slots.retain(|s| !Arc::ptr_eq(s, &self.0));
        if let Some(now) = queue_time(previous) {
            published.queue(previous, now);
        }
    }
}

thread_local! {
    static PUBLISHED_HERE: PublishedHere = PublishedHere::new();
}

/// Marks `PUBLISHED`: the mark function of a hidden object (no class, so no Ruby code can
/// see it) that a registered address keeps alive.
unsafe extern "C" fn mark_published(_data: *mut c_void) {
    let published = published();
    let slots = published.slots.iter().map(|s| s.load(Ordering::Relaxed));
    for object in slots.chain(published.retired.iter().map(|(o, _)| *o)) {
        if object != 0 {
            // SAFETY: in the mark phase; each is a live State (see `Published`). rb_gc_mark
            // pins, so GC.compact moves none of them.
            unsafe { rb_sys::rb_gc_mark(object as VALUE) };
        }
    }
}

/// Creates the object whose mark function marks `PUBLISHED`, rooted for good.
fn root_published() {
    // SAFETY: a zeroed rb_data_type_t is a valid one with no functions; the fields set are
    // the name and the mark function, leaked along with it so they outlive the object. The
    // object is hidden (class 0). Its data pointer must not be null, or Ruby skips the mark
    // function; it points at the data type itself, and there is nothing to free.
    unsafe {
        let mut data_type: rb_sys::rb_data_type_t = std::mem::zeroed();
        data_type.wrap_struct_name = c"rbspy_ext published tables".as_ptr();
        data_type.function.dmark = Some(mark_published);
        let data_type: &'static rb_sys::rb_data_type_t = Box::leak(Box::new(data_type));
        let data = data_type as *const rb_sys::rb_data_type_t as *mut c_void;
        let root = rb_sys::rb_data_typed_object_wrap(0, data, data_type);
        let slot: &'static mut VALUE = Box::leak(Box::new(root));
        rb_sys::rb_gc_register_address(slot);
    }
}

thread_local! {
    /// `PUBLISHED`'s guard, held by the forking thread from `fork_prepare` to the fork's end.
    static HELD_FOR_FORK: std::cell::RefCell<Option<std::sync::MutexGuard<'static, Published>>> =
        const { std::cell::RefCell::new(None) };
}

/// Before fork: takes `PUBLISHED`, so the child cannot inherit it locked by a thread that
/// does not exist there (a native thread exiting retires its State under the lock, without
/// the GVL, at any moment), which would hang its next fiber switch or GC mark.
extern "C" fn fork_prepare() {
    let guard = published();
    HELD_FOR_FORK.with(|held| *held.borrow_mut() = Some(guard));
}

/// After fork, in the parent and in the child: gives `PUBLISHED` back. The child keeps the
/// slots of the parent's other threads, and so their current States (a few, for good): its
/// copies of those threads' tables are unreachable, but cheap.
extern "C" fn fork_done() {
    HELD_FOR_FORK.with(|held| held.borrow_mut().take());
}

/// Registers the fork handlers (once, at load).
fn guard_fork() {
    // SAFETY: registers plain functions that only touch this module's lock and thread-local.
    unsafe { libc::pthread_atfork(Some(fork_prepare), Some(fork_done), Some(fork_done)) };
}

/// The table `ruby_profiler_state` points at on this native thread right now (0 for none).
fn published_address() -> u64 {
    extern "C" {
        fn rbspy_ext_state_get() -> *const c_void;
    }
    // SAFETY: reads this thread's pointer.
    unsafe { rbspy_ext_state_get() as u64 }
}

pub fn init(ruby: &Ruby) -> Result<(), Error> {
    // SAFETY: computes the published offset once, on the loading thread.
    unsafe { rbspy_ext_state_init() };
    let module = ruby.define_module("RubySpy")?;
    let class: RClass = module.define_class("State", ruby.class_object())?;
    class.undef_default_alloc_func();
    class.define_singleton_method("build", function!(State::build, 1))?;
    class.define_singleton_method("published_address", function!(published_address, 0))?;
    class.define_method("with_hash", method!(State::with, 1))?;
    class.define_method("to_h", method!(State::to_h, 0))?;
    class.define_method("size", method!(State::size, 0))?;
    class.define_method("table_address", method!(State::table_address, 0))?;
    class.define_method("otel_record", method!(State::otel_record_string, 0))?;
    crate::classes::resolve::<State>(ruby);
    set_grace();
    root_published();
    guard_fork();
    Ok(())
}
