//! rbspy_ext's core: reads the stack of a running Ruby process from its memory, without a
//! Ruby VM of its own. See ARCHITECTURE.md for a snapshot followed through these modules.
//!
//! - [`process`]: /proc/PID/maps and the ELF symbols of libruby;
//! - [`memory`]: `process_vm_readv` behind the [`memory::Memory`] trait (and a test image);
//! - [`objects`]: Ruby strings, arrays, symbol names and class names;
//! - [`lines`]: instruction → line numbers;
//! - [`vm`]: finding and validating the VM, with or without symbols;
//! - [`model`]: what a sample is made of (frames, tags, threads and their states);
//! - [`spy`]: the one stack walker and its caches;
//! - [`census`]: the heap census, read through the spy's view of its target;
//! - [`profile`]: samples aggregated into a [`profile::Profile`];
//! - [`record`]: the recorder over both samplers (user space and BPF);
//! - [`timeline`]: the order of a profile's samples;
//! - [`serve`]: the pprof listener, a port of its own on native threads;
//! - [`output`]: every output format of a profile, and reading the raw one back;
//! - [`allocs`]: sampled allocations (the extension's tracker counts them) and their forms.
pub mod allocs;
#[cfg(feature = "bpf")]
pub mod bpf;
pub mod census;
pub mod context;
pub mod cost;
pub mod dwarf;
pub mod error;
pub mod heap_sites;
pub mod image;
pub mod lines;
pub mod memory;
pub mod model;
pub mod objects;
pub mod output;
pub mod outside;
pub mod process;
pub mod profile;
pub mod record;
pub mod serve;
pub mod spy;
pub mod sync;
pub mod timeline;
pub mod vm;

pub use error::{Error, MemoryError, Result};
pub use spy::{Config, Frame, Spy};
