//! A spy over a memory image (`crate::image`) instead of a process: what attaching read from
//! the process's maps and ELF files, which an image does not hold, taken from a live spy
//! (`image_parts`) and given back to one over the image (`over_image`).
use super::Spy;
use crate::memory::Memory;
use crate::vm::VmRoots;
use rbspy_ext_bindings::Layout;

impl<M: Memory> Spy<M> {
    /// What a spy over a memory image of this target needs besides the memory
    /// (`Spy::over_image`), as attaching and the walks so far found it.
    pub fn image_parts(&mut self) -> ImageParts {
        let tags = self
            .profiler_state_offset()
            .map(|o| (o, self.tags.owner_offset));
        let t = &self.target;
        ImageParts {
            layout: t.layout,
            version: t.version.clone(),
            roots: VmRoots {
                vm: t.vm,
                main_thread: t.main_thread,
                gvl_owner: t.gvl_owner,
                thread_list: t.thread_list_head,
            },
            symbols: self.cache.symbols.as_ref().map(|s| s.addr),
            writable: t.writable.clone(),
            heap: t.heap.clone(),
            tags,
            pthread_tid: t.pthread_tid,
            zjit_entry: t.zjit_entry,
            shape_tree: t.shape_tree,
        }
    }

    /// A spy over `mem`, a copy of (some of) the memory of the target `parts` were taken
    /// from (`image::capture`): what attaching found by reading the process (its maps and
    /// ELF files) comes from `parts` instead, and nothing is read from the process's files
    /// afterwards (an image's pid is nobody's).
    pub fn over_image(pid: i32, mem: M, parts: &ImageParts) -> Self {
        let p = parts;
        let mut spy = Spy::with_memory(pid, mem, p.layout, &p.version, p.roots, p.symbols)
            .with_writable(p.writable.clone());
        let t = &mut spy.target;
        t.heap = p.heap.clone();
        t.pthread_tid = p.pthread_tid;
        t.zjit_entry = p.zjit_entry;
        t.shape_tree = p.shape_tree;
        t.shape_tree_scanned = p.shape_tree.is_some();
        spy.tags.preset(p.tags);
        spy
    }
}

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
