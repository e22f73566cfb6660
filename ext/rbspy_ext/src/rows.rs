//! Core values as the plain rows the Ruby side builds its objects from.
use rbspy_ext_core::Frame;

/// `[label, base_label, path, absolute_path, lineno, c_function]`, what
/// `RubySpy::Frame.from_row` (lib/rbspy_ext/frame.rb) takes.
pub(crate) type FrameRow<'a> = (
    &'a str,
    &'a str,
    Option<&'a str>,
    Option<&'a str>,
    i32,
    bool,
);

/// A frame as a [`FrameRow`].
pub(crate) fn frame_row(f: &Frame) -> FrameRow<'_> {
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
