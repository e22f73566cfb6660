//! A spy over a memory image (`crate::image`) instead of a process: what attaching read from
//! the process's maps and ELF files, which an image does not hold, taken from a live spy
//! (`Spy::image_parts`) and given back to one over the image (`Spy::over_image`), both in
//! attach.rs beside attaching itself.
use crate::vm::VmRoots;
use rbspy_ext_bindings::Layout;

/// What a spy over a memory image needs besides the memory: what attaching to the process
/// found by reading its maps and ELF files, which an image does not hold.
#[derive(Debug, Clone)]
pub struct ImageParts {
    pub layout: &'static Layout,
    pub version: String,
    pub roots: VmRoots,
    /// The address of `rb_symbols_t`, once a walk has found it.
    pub symbols: Option<u64>,
    /// libruby's writable segments, where the scans for unnamed structs look.
    pub writable: Vec<(u64, u64)>,
    /// The heap's ranges, where the census looks for the shape tree.
    pub heap: Vec<(u64, u64)>,
    /// `ruby_profiler_state`'s offset from a thread pointer, and its owner's, where the
    /// target has loaded the extension.
    pub tags: Option<(i64, Option<i64>)>,
    /// Where glibc keeps a thread's tid (before 3.1), `rb_zjit_entry` (4.1) and the shape
    /// tree's global (3.3+), where known.
    pub pthread_tid: Option<u64>,
    pub zjit_entry: Option<u64>,
    pub shape_tree: Option<u64>,
}
