//! `RubySpy::NativeOTel`, the OpenTelemetry bridge's Ruby face (lib/rbspy_ext/otel.rb): a
//! span attached to the current fiber (`trace`), and the process context (otel.rs) published,
//! read back and republished after a fork.
use crate::current::{apply_raw, current};
use crate::otel::{self, Trace};
use crate::state::{state_of, State};
use magnus::rb_sys::AsRawValue;
use magnus::{function, prelude::*, Error, IntoValue, RArray, RString, Ruby};
use rb_sys::VALUE;

/// `RubySpy::NativeOTel.trace(trace_id, span_id, flags, root_span_id, endpoint)`: makes the
/// current fiber's state one with this trace (trace_id nil: none) and the current tags.
fn trace(
    ruby: &Ruby,
    trace_id: Option<RString>,
    span_id: Option<RString>,
    flags: u8,
    root: Option<RString>,
    endpoint: Option<RString>,
) -> Result<(), Error> {
    let trace = match (
        id::<16>(ruby, trace_id, "trace")?,
        id::<8>(ruby, span_id, "span")?,
    ) {
        (Some(trace_id), Some(span_id)) => Some(std::sync::Arc::new(Trace {
            trace_id,
            span_id,
            flags,
            local_root_span_id: id::<8>(ruby, root, "root span")?,
            endpoint: endpoint.map(|e| e.to_string()).transpose()?,
        })),
        _ => None,
    };
    if let Some(trace) = &trace {
        otel::note_endpoint(trace);
    }
    let current = current(ruby).as_raw();
    let base = state_of(current);
    // The same span again (a context with a new value, not a new span), or still none.
    if base.and_then(|b| b.trace()).map(|t| &**t) == trace.as_deref() {
        return Ok(());
    }
    let state = match State::traced(base, trace) {
        Some(state) => state.into_value_with(ruby).as_raw(),
        None => rb_sys::Qnil as VALUE,
    };
    apply_raw(state);
    Ok(())
}

/// A binary String of N bytes (an OpenTelemetry id) as an array; nil as None.
fn id<const N: usize>(
    ruby: &Ruby,
    s: Option<RString>,
    what: &str,
) -> Result<Option<[u8; N]>, Error> {
    let Some(s) = s else { return Ok(None) };
    // SAFETY: copied at once, with no Ruby call in between.
    let bytes = unsafe { s.as_slice() };
    bytes.try_into().map(Some).map_err(|_| {
        Error::new(
            ruby.exception_arg_error(),
            format!("a {what} id is {N} bytes, got {}", bytes.len()),
        )
    })
}

/// `NativeOTel.publish_process(attributes)`: an Array of [key, value] Strings.
fn publish_process(attributes: RArray) -> Result<(), Error> {
    let mut resource = Vec::with_capacity(attributes.len());
    for pair in attributes.into_iter() {
        let (key, value): (String, String) = magnus::TryConvert::try_convert(pair)?;
        resource.push((key, value));
    }
    otel::publish_process(resource);
    Ok(())
}

pub fn init(ruby: &Ruby) -> Result<(), Error> {
    let native = ruby.define_module("RubySpy")?.define_module("NativeOTel")?;
    native.define_singleton_method("trace", function!(trace, 5))?;
    native.define_singleton_method("publish_process", function!(publish_process, 1))?;
    native.define_singleton_method("key_map", function!(otel::key_map, 0))?;
    native.define_singleton_method("stats", function!(otel::stats, 0))?;
    native.define_singleton_method("address", function!(otel::address, 0))?;
    native.define_singleton_method("after_fork", function!(otel::after_fork, 0))?;
    Ok(())
}
