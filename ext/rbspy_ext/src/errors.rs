//! Maps core errors to the `RubySpy::Error` hierarchy defined in lib/rbspy_ext/error.rb.
use magnus::{exception::ExceptionClass, prelude::*, Error, RModule, Ruby};
use rbspy_ext_core::Error as CoreError;

/// The Ruby exception class named `RubySpy::<name>` (looked up lazily: lib/ defines them).
pub fn class(ruby: &Ruby, name: &str) -> ExceptionClass {
    ruby.class_object()
        .const_get::<_, RModule>("RubySpy")
        .and_then(|m| m.const_get::<_, ExceptionClass>(name))
        .unwrap_or_else(|_| ruby.exception_runtime_error())
}

pub fn to_ruby(ruby: &Ruby, e: CoreError) -> Error {
    let name = match &e {
        CoreError::NoSuchProcess { .. } => "NoSuchProcess",
        CoreError::PermissionDenied { .. } => "PermissionDenied",
        CoreError::NotRuby { .. } => "NotRubyProcess",
        CoreError::UnsupportedVersion { .. } => "UnsupportedVersion",
        CoreError::DebugInfo { .. } => "DebugInfoError",
        CoreError::ProcessExited { .. } => "ProcessExited",
        CoreError::ProcessReplaced { .. } => "ProcessReplaced",
        CoreError::StackChanged { .. } => "StackChanged",
        CoreError::Corrupt { .. } | CoreError::Memory { .. } => "CorruptMemory",
        CoreError::InvalidArgument(_) => {
            return Error::new(ruby.exception_arg_error(), e.to_string())
        }
        CoreError::Io { .. } => "Error",
        CoreError::BpfUnavailable(_) => "BpfUnavailable",
        CoreError::Listen { .. } => "ListenError",
    };
    Error::new(class(ruby, name), e.to_string())
}

/// A Rust panic caught at the boundary: reported, never unwound into Ruby.
pub fn panicked(ruby: &Ruby, what: &str) -> Error {
    Error::new(
        class(ruby, "Error"),
        format!("internal error in rbspy_ext while {what}; please report it"),
    )
}
