//! Core values as the plain rows the Ruby side builds its objects from.
use rbspy_ext_core::Frame;

/// `[label, base_label, path, absolute_path, lineno, c_function]`, what
/// `RubySpy::Frame.from_row` (lib/rbspy_ext/frame.rb) takes.
#[allow(clippy::type_complexity)]
pub(crate) fn frame_row(f: &Frame) -> (&str, &str, Option<&str>, Option<&str>, i32, bool) {
    (
        &f.label,
        &f.base_label,
        // A C function with no Ruby caller has no path: nil, as in Ruby.
        Some(&*f.path).filter(|p| !p.is_empty()),
        f.absolute_path.as_deref(),
        f.lineno,
        f.c_function,
    )
}
