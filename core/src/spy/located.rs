//! Where each frame of a backtrace is shown. A Ruby frame has its own path and line; a C
//! function has none and takes those of the Ruby frame that called it, as does, from Ruby
//! 4.0, a method written in Ruby inside the VM (vm_backtrace.c: `bt_backpatch_loc`,
//! `is_internal_location`).
use crate::model::Frame;
use std::sync::Arc;

/// How the path of an iseq defined inside the VM (`<internal:kernel>`, `<internal:array>`,
/// RubyGems' `<internal:.../kernel_require.rb>`) begins.
pub(super) const INTERNAL_PATH: &str = "<internal:";

/// Frames from the innermost outwards, some waiting for their caller's location.
pub(super) struct Located {
    pub(super) frames: Vec<Frame>,
    /// Indexes of the frames waiting: always the tail of `frames`.
    waiting: Vec<usize>,
}

impl Located {
    pub(super) fn with_capacity(n: usize) -> Self {
        Located {
            frames: Vec::with_capacity(n),
            waiting: Vec::new(),
        }
    }

    /// A C function: shown at the location of the Ruby frame that called it (frames with no
    /// caller keep no location, as in Ruby).
    pub(super) fn push_cfunc(&mut self, frame: Frame) {
        self.waiting.push(self.frames.len());
        self.frames.push(frame);
    }

    /// Ruby 4.0: a method written in Ruby inside the VM is shown like a C function, at its
    /// caller's location, and it replaces the C functions and internal methods it called
    /// (they are left out). With no caller it keeps its own location.
    pub(super) fn push_internal(&mut self, mut frame: Frame, is_method: bool) {
        if let Some(&first) = self.waiting.first() {
            self.frames.truncate(first);
            self.waiting.clear();
        }
        if !is_method {
            // A block of such a method is labelled as the method itself.
            if let Some((_, method)) = frame.label.rsplit_once(" in ") {
                frame.label = Arc::from(method);
            }
        }
        self.push_cfunc(frame);
    }

    /// Ruby 3.4: a method with `Primitive.attr! :c_trace` (under YJIT `Array#each`) is
    /// located as a C function is, at its caller's location (vm_backtrace.c,
    /// `backtrace_each`), though it is written in Ruby (`c_function` stays false, as its
    /// `source_location` says).
    pub(super) fn push_c_traced(&mut self, frame: Frame) {
        self.push_cfunc(Frame {
            path: Arc::from(""),
            absolute_path: None,
            lineno: 0,
            ..frame
        });
    }

    /// A Ruby frame: its location is its own, and that of every frame waiting for it.
    pub(super) fn push_ruby(&mut self, frame: Frame) {
        for idx in self.waiting.drain(..) {
            self.frames[idx].path = frame.path.clone();
            self.frames[idx].absolute_path = frame.absolute_path.clone();
            self.frames[idx].lineno = frame.lineno;
        }
        self.frames.push(frame);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(label: &str, path: &str, lineno: i32, c: bool) -> Frame {
        Frame {
            label: label.into(),
            base_label: label.into(),
            path: path.into(),
            absolute_path: None,
            lineno,
            c_function: c,
        }
    }

    fn shown(l: &Located) -> Vec<(String, String, i32)> {
        l.frames
            .iter()
            .map(|f| (f.label.to_string(), f.path.to_string(), f.lineno))
            .collect()
    }

    /// `[r].each(&:read)` under 4.0's YJIT: `IO#read` (C) called by `Array#each` (internal)
    /// is left out, and `Array#each` shows the block's location.
    #[test]
    fn an_internal_method_replaces_what_it_called_and_takes_its_callers_location() {
        let mut l = Located::with_capacity(4);
        l.push_cfunc(frame("IO#read", "", 0, true));
        l.push_internal(frame("Array#each", "<internal:array>", 50, false), true);
        l.push_ruby(frame("block in <main>", "app.rb", 6, false));
        assert_eq!(
            shown(&l),
            [
                ("Array#each".into(), "app.rb".into(), 6),
                ("block in <main>".into(), "app.rb".into(), 6)
            ]
        );
    }

    /// `3.times.each {}`: an internal method inside a C function keeps both, at the Ruby
    /// caller's line; a block of an internal method takes the method's label.
    #[test]
    fn a_c_function_keeps_the_internal_method_inside_it() {
        let mut l = Located::with_capacity(4);
        l.push_internal(
            frame("block in Array#fetch_values", "<internal:array>", 9, false),
            false,
        );
        l.push_cfunc(frame("Enumerator#each", "", 0, true));
        l.push_ruby(frame("<main>", "app.rb", 2, false));
        assert_eq!(
            shown(&l),
            [
                ("Array#fetch_values".into(), "app.rb".into(), 2),
                ("Enumerator#each".into(), "app.rb".into(), 2),
                ("<main>".into(), "app.rb".into(), 2)
            ]
        );
    }

    /// `[1].each { sleep }` under 3.4's YJIT: `Array#each` (c_trace) keeps the C function it
    /// called, and both show the block's caller's location, as Ruby 3.4 prints them.
    #[test]
    fn a_c_traced_method_is_located_as_a_c_function_and_keeps_what_it_called() {
        let mut l = Located::with_capacity(4);
        l.push_cfunc(frame("Kernel#sleep", "", 0, true));
        l.push_c_traced(frame("Array#each", "<internal:array>", 228, false));
        l.push_ruby(frame("<main>", "app.rb", 3, false));
        assert_eq!(
            shown(&l),
            [
                ("Kernel#sleep".into(), "app.rb".into(), 3),
                ("Array#each".into(), "app.rb".into(), 3),
                ("<main>".into(), "app.rb".into(), 3)
            ]
        );
        assert!(!l.frames[1].c_function);
    }
}
