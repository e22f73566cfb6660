//! `RubySpy.tag(**pairs) { ... }`: runs a block under more tags (lib/rbspy_ext/state.rb
//! documents it). Written here rather than in Ruby because a Rails request runs it two or
//! three times: in Ruby it also cost a method frame, a keyword Hash, three calls into Rust
//! and an ensure frame, half of its 6,200 instructions (`RUBYSPY_BENCH_CALLGRIND=1 ruby
//! bench/rails.rb`).
use crate::current::{apply_raw, current, refreshed};
use crate::state::{state_of, State};
use magnus::rb_sys::{AsRawValue, FromRawValue};
use magnus::{function, prelude::*, Error, IntoValue, RHash, Ruby, Value};
use rb_sys::VALUE;

/// `RubySpy.tag(**pairs) { ... }`: the block's value.
pub fn tag(ruby: &Ruby, args: &[Value]) -> Result<Value, Error> {
    // SAFETY: questions about the current method call, with the GVL.
    let (block, keywords) = unsafe {
        (
            rb_sys::rb_block_given_p() != 0,
            rb_sys::rb_keyword_given_p() != 0,
        )
    };
    let hash = match args {
        [] => ruby.hash_new(),
        [pairs] if keywords => RHash::from_value(*pairs)
            .ok_or_else(|| Error::new(ruby.exception_type_error(), "tags must be keywords"))?,
        _ => {
            return Err(Error::new(
                ruby.exception_arg_error(),
                format!(
                    "wrong number of arguments (given {}, expected 0): tags are keywords, \
                     RubySpy.tag(request_id: id) {{ ... }}",
                    args.len()
                ),
            ))
        }
    };
    if !block {
        return Err(Error::new(
            ruby.exception_arg_error(),
            "RubySpy.tag needs a block: the tags hold while it runs",
        ));
    }
    let previous = current(ruby).as_raw();
    let state = State::merged(ruby, state_of(previous), hash)?.into_value_with(ruby);
    apply_raw(state.as_raw());
    // The block runs inside rb_ensure, which puts `previous` back however it ends (an
    // exception, break, throw); rb_protect catches what then propagates, so that it is
    // raised again once this Rust frame has returned rather than jumping over it.
    // SAFETY: rb_ensure with functions of the signature it calls; `previous` is a State or
    // nil that the fiber-local kept alive until now and the C stack keeps alive meanwhile.
    magnus::rb_sys::protect(|| unsafe {
        rb_sys::rb_ensure(Some(run_block), 0, Some(restore), previous)
    })
    .map(|v| unsafe { Value::from_raw(v) })
}

/// The block of the `RubySpy.tag` call this runs under, with no arguments.
unsafe extern "C" fn run_block(_: VALUE) -> VALUE {
    // SAFETY: called by rb_ensure inside `tag`, whose block is the current one.
    unsafe { rb_sys::rb_yield_values2(0, std::ptr::null()) }
}

/// Puts back the state `RubySpy.tag` replaced.
unsafe extern "C" fn restore(previous: VALUE) -> VALUE {
    apply_raw(refreshed(previous));
    rb_sys::Qnil as VALUE
}

/// Defines `RubySpy.tag`, after `RubySpy::State` (crate::state), which it uses.
pub fn init(ruby: &Ruby) -> Result<(), Error> {
    ruby.define_module("RubySpy")?
        .define_singleton_method("tag", function!(tag, -1))
}
