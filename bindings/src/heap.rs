//! The GC heap's layout, for the heap census (core/src/census/walk.rs): private to each
//! release's gc.c, so measured by `script/generate-bindings` from
//! `bindings/generator/heap_probe.c`, which compiles gc.c itself (never edit
//! `heap_generated.rs` by hand).

/// Offsets and constants of one release's object heap. Offsets are in bytes; flag values
/// are `RBasic.flags` bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeapLayout {
    /// `objspace->heap_pages.sorted`: every page, an array of `struct heap_page *`; before
    /// 3.4 `heap_pages.allocated_pages` of them (`allocated_pages`), from 3.4 an
    /// `rb_darray` whose block holds its size at `darray.0` and the pointers from `darray.1`.
    pub sorted: usize,
    pub allocated_pages: Option<usize>,
    pub darray: Option<(usize, usize)>,
    /// `HEAP_PAGE_ALIGN`: a page's slots are in one block of this size, at this alignment.
    pub page_align: usize,
    // struct heap_page: `start` (first slot), 16-bit slot counts, the slot size (3.1+; one
    // size of `base_slot_size` before), and the mark bitmap (`page_mark_bits_len` bytes).
    pub page_start: usize,
    pub page_total_slots: usize,
    pub page_free_slots: usize,
    pub page_final_slots: usize,
    pub page_slot_size: Option<usize>,
    pub page_mark_bits: usize,
    pub page_mark_bits_len: usize,
    /// (byte, mask) of `flags.before_sweep`: a page the running lazy sweep has not reached,
    /// whose unmarked slots are garbage.
    pub page_before_sweep: (usize, u8),
    /// (byte, mask) of `flags.in_tomb` (before 3.4): a page of the tomb heap, with no live
    /// objects.
    pub page_in_tomb: Option<(usize, u8)>,
    /// A slot's mark bit is (address within the page) / `base_slot_size`, or (4.1, where
    /// `bitmap_by_index`) its index from the page's `start`.
    pub base_slot_size: usize,
    pub bitmap_by_index: bool,
    /// `gc_mode_sweeping`: the value of the objspace's 2-bit mode while a sweep runs.
    pub gc_mode_sweeping: u64,
    /// `objspace->profile.compact_count` and (byte, mask) of `objspace->flags.during_compacting`
    /// (from the objspace's start): a census that saw either change read objects that moved.
    pub compact_count: usize,
    pub during_compacting: (usize, u8),
    /// Where `GC.stat(:total_allocated_objects)` is kept in the objspace.
    pub allocated: Allocated,
    // Bytes held outside the slot, as `ObjectSpace.memsize_of` counts them.
    /// A string owns its buffer (`as.heap.aux.capa` + 1 bytes) when not embedded, not
    /// shared and not `STR_NOFREE`.
    pub str_shared: u64,
    pub str_nofree: u64,
    pub rstring_capa: usize,
    /// An array owns its buffer (`as.heap.aux.capa` words, or its length for a shared
    /// root) when neither embedded nor shared.
    pub ary_shared: u64,
    pub ary_shared_root: u64,
    pub rarray_capa: usize,
    /// A hash is an st_table with `hash_st_flag` set (else an array table): in the slot
    /// after `struct RHash` from 3.3 (`hash_st_inline`), else at the pointer at
    /// `hash_st_ptr`, where an array table is `ar_table_size` bytes of its own.
    pub hash_st_flag: u64,
    pub hash_st_inline: Option<usize>,
    pub hash_st_ptr: Option<usize>,
    pub ar_table_size: Option<usize>,
    pub st_table_size: usize,
    pub st_entry_power: usize,
    /// A table has bins when its `bins` pointer (at `st_bins`, up to 4.0) is set, or (4.1,
    /// which has no such pointer) when its `entry_power` is above `st_bins_above_power`.
    pub st_bins_above_power: u8,
    pub st_bins: Option<usize>,
    /// (`ROBJECT_EMBED`, offset of `as.heap.numiv`) before 3.2, where an object that is not
    /// embedded holds `numiv` ivars out of its slot.
    pub robject_heap: Option<(u64, usize)>,
    /// From 3.2: how an object's shape sizes the ivars it keeps out of its slot.
    pub shapes: Option<Shapes>,
    /// Where a class's superclass is: in `struct RClass` (before 4.0), or in its classext
    /// (`Layout::rclass_ext_*`) from 4.0. An object with a singleton class is counted under
    /// the class its singleton class's superclass chain reaches, as `Object#class` says.
    pub class_super: Option<usize>,
    pub class_super_in_ext: Option<usize>,
    /// Where each Ractor owns its heap (the master of 2026-08): where the objspaces are
    /// besides each living Ractor's `r->objspace` (`Layout::ractor_objspace`).
    pub ractor_heaps: Option<RactorHeaps>,
    /// The master of 2026-08: what `ObjectSpace.memsize_of` adds for a T_IMEMO fields
    /// object, which holds the ivars that left an object's slot (`as.extended`).
    pub fields: Option<Fields>,
}

/// `GC.stat(:total_allocated_objects)`: the sum of `count` words, the first at `at` from the
/// objspace's start, each `stride` bytes after the one before (one counter before 3.3; one
/// per size pool or heap after), plus, on 4.0, what each Ractor's cache holds back
/// (`pending`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocated {
    pub at: usize,
    pub stride: usize,
    pub count: usize,
    pub pending: Option<Pending>,
}

/// 4.0: a Ractor adds its allocations to the objspace's counters only every 1,024 of a heap;
/// the rest are counted in its newobj cache, at `r->newobj_cache` (`cache`, a pointer), one
/// word per heap, the first at `at` in the cache, each `stride` bytes after the one before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pending {
    pub cache: usize,
    pub at: usize,
    pub stride: usize,
}

/// The objspaces of a VM whose Ractors each own one (`rb_gc_vm_each_objspace`'s list): each
/// living Ractor's, a child Ractor's while it is created, and terminated Ractors' (zombies)
/// until a living objspace absorbs their pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RactorHeaps {
    /// `r->creating_child_objspace`: a child's objspace, before the child joins the VM's
    /// Ractor list.
    pub creating_child: usize,
    /// `vm->gc.zombie_objspaces` (an array of `zombie_count` entries of `zombie_size` bytes,
    /// each an objspace pointer at 0 and its terminated Ractor at `zombie_owner`, NULL once
    /// that Ractor is collected) and `vm->gc.zombie_objspaces_count`.
    pub zombies: usize,
    pub zombie_count: usize,
    pub zombie_size: usize,
    pub zombie_owner: usize,
    /// `page->objspace`: the objspace a page belongs to (rewritten when a zombie's pages are
    /// absorbed by another).
    pub page_objspace: usize,
}

/// A T_IMEMO of type `imemo_type` (`(flags >> type_shift) & type_mask`) whose shape id
/// (`flags >> id_shift`) has `complex_flag` holds its ivars in an st_table embedded at
/// `table`; its memsize is its slot plus that table's bytes beyond `sizeof(st_table)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fields {
    pub imemo_type: u64,
    pub type_shift: u32,
    pub type_mask: u64,
    pub id_shift: u32,
    pub complex_flag: u64,
    pub table: usize,
}

/// What `ObjectSpace.memsize_of` adds for an object's ivars from 3.2 (shape.h): the
/// capacity of its shape in words when its ivars are out of the slot, or its st_table's
/// size when its shape is too complex (the ivars are then a table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shapes {
    /// (flag, set): the ivars are out of the slot when `ROBJECT_EMBED` is clear (before
    /// 4.0), or when `ROBJECT_HEAP` is set (from 4.0).
    pub out_of_slot: (u64, bool),
    /// `as.heap.ivptr` (`as.heap.fields` from 4.0): the buffer, or a too-complex object's
    /// st_table.
    pub fields: usize,
    /// The shape id is `flags >> id_shift`; its element of the shape list is the id (before
    /// 4.0) or `id & index_mask` (from 4.0, whose ids carry flags too).
    pub id_shift: u32,
    pub index_mask: Option<u64>,
    /// A shape is too complex when its id is `too_complex_id` (before 4.0), or has
    /// `too_complex_flag` (from 4.0).
    pub too_complex_id: Option<u64>,
    pub too_complex_flag: Option<u64>,
    /// `sizeof(rb_shape_t)`, and the offset and width in bytes of its `capacity` (a
    /// `uint32_t` on 3.x, an `attr_index_t` of 2 bytes on 4.0 and 1 on 4.1).
    pub shape_size: usize,
    pub capacity: usize,
    pub capacity_width: usize,
    pub list: ShapeList,
    /// From 4.0 a capacity is at least the embedded capacity of the heap the id names:
    /// `capacities[heap_index - 1]`, heap_index = `(id & mask) >> shift`. `capacities` is
    /// at this offset of the shape tree: a pointer to the array (4.0), or the array (4.1).
    pub heap_index: Option<(u64, u32)>,
    pub capacities: Option<(usize, bool)>,
}

/// Where the shape list (`rb_shape_t *shape_list`) is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShapeList {
    /// 3.2: `vm->shape_list`, at this offset of `rb_vm_t`.
    InVm(usize),
    /// 3.3 and 3.4: in the `rb_shape_tree_t` that the global `rb_shape_tree_ptr` points to.
    /// Debian's libruby does not name that global, so it may be found by a scan: the tree's
    /// `shape_list` and `root_shape` are the same pointer, its `next_shape_id` (a u32) is
    /// above 0, and the root shape's `parent_id` (of `rb_shape_t`) is `INVALID_SHAPE_ID`
    /// (all ones).
    TreePointer {
        shape_list: usize,
        root_shape: usize,
        next_shape_id: usize,
        parent_id: usize,
    },
    /// From 4.0: in the global `rb_shape_tree` itself (exported).
    Tree { shape_list: usize },
}
