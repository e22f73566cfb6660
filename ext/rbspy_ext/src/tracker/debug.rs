//! Ruby's debug API (ruby/debug.h), declared here: rb-sys's bindings for 2.7 leave it out.
//! The same functions and signatures on every Ruby from 2.7 (rb_profile_frames: 2.3).
use rb_sys::VALUE;
use std::ffi::c_void;

extern "C" {
    pub fn rb_profile_frames(start: i32, limit: i32, buff: *mut VALUE, lines: *mut i32) -> i32;
    pub fn rb_profile_frame_path(frame: VALUE) -> VALUE;
    pub fn rb_profile_frame_absolute_path(frame: VALUE) -> VALUE;
    pub fn rb_profile_frame_full_label(frame: VALUE) -> VALUE;
    pub fn rb_tracepoint_new(
        target_thread: VALUE,
        events: u32,
        func: unsafe extern "C" fn(VALUE, *mut c_void),
        data: *mut c_void,
    ) -> VALUE;
    pub fn rb_tracepoint_enable(tracepoint: VALUE) -> VALUE;
    pub fn rb_tracepoint_disable(tracepoint: VALUE) -> VALUE;
    pub fn rb_tracearg_from_tracepoint(tracepoint: VALUE) -> *mut c_void;
    pub fn rb_tracearg_object(arg: *mut c_void) -> VALUE;
}
