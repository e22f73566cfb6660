//! What a Ruby process running rbspy_ext publishes about its threads' context for readers
//! outside it, one module per record format: each encodes and decodes its format, and the
//! writer (ext/rbspy_ext), the readers (spy/tags.rs, the BPF sampler's user side) and the
//! tests all go through it, so a layout is written down once.
//!
//! - [`profiler_state`]: the `ruby_profiler_state` table of tags (docs/profiler-state.md).
//! - [`otel_process`]: OpenTelemetry's process context (OTEP 4719), the `OTEL_CTX`
//!   mapping: resource attributes and the thread context's key map.
//! - [`otel_thread`]: OpenTelemetry's thread-local context record (OTEP 4947), what
//!   `otel_thread_ctx_v1` points at.
//! - [`ownership`]: when a table read through a thread's pointer may be trusted: the owner
//!   word around the pointer, and how long a table stays alive once unpublished.
pub mod otel_process;
pub mod otel_thread;
pub mod ownership;
pub mod profiler_state;
