//! What the walker knows about the target's code and names, between samples: iseqs, method
//! entries, class and symbol names. The walker's steps (walker.rs, frames.rs) fill it.
use crate::lines::LineTable;
use crate::memory::ReadBatch;
use crate::objects::{ClassNames, SymbolTable};
use rustc_hash::FxHashMap;
use std::sync::Arc;

/// What never changes about one iseq.
#[derive(Debug, Default)]
pub(super) struct IseqInfo {
    pub(super) body: u64,
    pub(super) encoded: u64,
    pub(super) size: u32,
    pub(super) path: Arc<str>,
    pub(super) absolute_path: Option<Arc<str>>,
    pub(super) label: Arc<str>,
    pub(super) base_label: Arc<str>,
    /// True when the iseq belongs to a method (its local iseq is a method), so its label
    /// gets the owner's name.
    pub(super) in_method: bool,
    /// `body.local_iseq`: the method (or top-level/class body) this iseq belongs to.
    pub(super) local_iseq: u64,
    /// The iseq is a method body itself (its frames always have a method entry).
    pub(super) is_method: bool,
    /// `body.type` (ISEQ_TYPE_*).
    pub(super) kind: u32,
    /// Ruby 3.4: the iseq has `Primitive.attr! :c_trace`, and backtraces show its frames as
    /// a C method's (`Layout::body_c_trace`).
    pub(super) c_trace: bool,
    pub(super) lines: LineTable,
    /// Qualified labels by owner class.
    pub(super) qualified: FxHashMap<u64, Arc<str>>,
}

/// What is cached about one method entry, checked against its header on every sample.
#[derive(Debug, Clone)]
pub(super) struct MethodInfo {
    pub(super) def: u64,
    pub(super) owner: u64,
    /// The module whose name labels the method's frames: `owner`, or from 4.1.0 the module
    /// the definition was made in (`label_module`).
    pub(super) label_owner: u64,
    pub(super) def_type: u64,
    pub(super) original_id: u64,
    /// For Ruby methods: the iseqs its frames may run (the body, and the
    /// mandatory-only variant of some builtins); a frame claiming this entry must run one.
    pub(super) iseqs: [u64; 2],
    /// `Owner#name` for C functions.
    pub(super) cfunc_label: Option<Arc<str>>,
    pub(super) name: Option<Arc<str>>,
}

/// What is known about the target's code and names: trusted between full validations
/// (every `REVALIDATE`, see `read_iseqs_and_method_entries`), except class and symbol
/// names, which do not change while their objects live.
#[derive(Debug, Default)]
pub(super) struct Cache {
    pub(super) symbols: Option<SymbolTable>,
    pub(super) classes: ClassNames,
    pub(super) iseqs: FxHashMap<u64, IseqInfo>,
    pub(super) methods: FxHashMap<u64, MethodInfo>,
    /// Candidate method-entry addresses that turned out to be crefs (not method entries).
    pub(super) not_methods: rustc_hash::FxHashSet<u64>,
    /// When cached iseqs and method entries were last all read again.
    pub(super) validated_at: Option<std::time::Instant>,
    /// A cached iseq or method entry was found changed since the last full validation: the
    /// memo's stacks may rest on it.
    pub(super) changed: bool,
    /// The arena of the one read that validates them, reused from sample to sample.
    pub(super) reads: ReadBatch,
}
