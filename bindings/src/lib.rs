//! Ruby VM struct layouts, as data.
//!
//! Every Ruby release the walker supports maps (through [`layout_for_version`]) to one
//! [`Layout`]: the byte offsets and constants the stack walker needs, nothing else. The
//! entries in `generated.rs` are written by `script/generate-bindings`, which compiles
//! `bindings/generator/layout_probe.c` against the real headers of each Ruby (Debian's
//! source packages and upstream trees, `script/lib/ruby-releases.txt`) and prints
//! `offsetof`/`sizeof` values; `heap_generated.rs` likewise from `heap_probe.c` (the
//! census's [`HeapLayout`], defined in heap.rs). Never edit either by hand: `script/add-ruby`
//! adds a release (docs/adding-a-ruby.md).

mod fields;
mod generated;
mod heap;
mod heap_generated;
pub mod members;

pub use fields::{Field, FieldValue};
pub use generated::{LAYOUTS, VERSIONS};
pub use heap::{Fields, HeapLayout, RactorHeaps, ShapeList, Shapes};
pub use heap_generated::HEAP_LAYOUTS;

fields::layout_struct! {
/// Offsets (in bytes) and constants of one distinct Ruby VM layout.
///
/// Field names follow Ruby's own `struct.field` path so each can be checked against the
/// headers; `*_size` fields are `sizeof` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// A name for the layout, e.g. "3.1" (the first release that has it).
    pub name: &'static str,
    /// MAJOR * 100 + MINOR. Selects behaviour that is not a matter of offsets, such as 3.4
    /// merging rescue/ensure frames into their method's frame in backtraces.
    pub api_version: u32,

    // rb_vm_t. Before 3.0 there are no ractors: the GVL and the main thread hang off the VM.
    pub vm_main_ractor: Option<usize>,
    pub vm_main_thread: usize,
    pub vm_gvl_owner: Option<usize>,

    // rb_ractor_t: the thread holding the GVL is `threads.gvl.owner` (3.0, 3.1) or
    // `threads.sched.running` (3.2+).
    pub ractor_gvl_owner: Option<usize>,
    pub ractor_threads_main: Option<usize>,
    /// Every ractor (3.0+): `vm->ractor.set` is a `list_head` threaded through each
    /// ractor's `vmlr_node` (`ractor_list_node`), the main ractor first. A ractor is
    /// `pub.id` (1 for the main one) and `name` (a String or nil). The offsets are 0 before
    /// 3.0, where `vm_ractor_set` is None.
    pub vm_ractor_set: Option<usize>,
    pub ractor_list_node: usize,
    pub ractor_id: usize,
    pub ractor_name: usize,

    // rb_thread_t
    pub thread_self: usize,
    pub thread_vm: usize,
    pub thread_ec: usize,
    /// Every Ruby thread is on a list (`list_head`, whose first word points at the first
    /// thread's list node): the VM's `living_threads` before 3.0, the main ractor's
    /// `threads.set` after. `thread_list_node` is the node's offset in `rb_thread_t`.
    pub vm_living_threads: Option<usize>,
    pub ractor_threads_set: Option<usize>,
    pub thread_list_node: usize,
    /// `Thread#name` (a String or nil).
    pub thread_name: usize,
    /// (byte offset, mask) of the 2-bit `status` bitfield, and the value meaning runnable
    /// (any other: sleeping, blocked in a blocking region, or dead).
    pub thread_status: Option<(usize, u8)>,
    pub thread_status_runnable: u64,
    /// Native thread id: `th->tid` (3.1) or `th->nt->tid` (3.2+); unknown on 2.7 and 3.0.
    pub thread_tid: Option<usize>,
    pub thread_nt: Option<usize>,
    pub native_thread_tid: Option<usize>,
    /// The native thread's `pthread_t`: `th->thread_id` (before 3.2) or `th->nt->thread_id`
    /// (3.2+, through `thread_nt`). On glibc it is the thread pointer, from which the
    /// thread-local `ruby_profiler_state` is found.
    pub thread_pthread: Option<usize>,
    pub native_thread_pthread: Option<usize>,
    /// The list node that links a thread into the queue of threads waiting for the GVL:
    /// `native_thread_data.node.gvl` (before 3.2), `sched.node.readyq` (3.2+). Linked (not
    /// null, not pointing at itself) while the thread waits: also after sleep or IO, when
    /// its status still says stopped.
    pub thread_gvl_wait_node: usize,
    /// `unblock.func`, when the node above doubles as the ubf-list node (before 3.3): a
    /// linked node means waiting for the GVL only while no unblocking function is set
    /// (Ruby clears it before queueing for the GVL).
    pub thread_unblock_func: Option<usize>,
    /// The GC: `vm->objspace` (before 3.4) or `vm->gc.objspace`; None where each Ractor
    /// owns its heap (see `ractor_objspace`).
    pub vm_objspace: Option<usize>,
    /// `r->objspace`: each Ractor's own GC heap and flags (4.1.0 from the master of
    /// 2026-08); None where the VM has one objspace.
    pub ractor_objspace: Option<usize>,
    /// Offset of `flags` in `rb_objspace` (private to gc.c, measured by compiling it): a
    /// 2-bit `mode` (none, marking, sweeping, compacting) at bit 0, then `during_gc` at
    /// `objspace_during_gc_bit`.
    pub objspace_flags: usize,
    /// The bit of `during_gc` in those flags (5 until 4.1's `user_gc_disabled` moved it to 6).
    pub objspace_during_gc_bit: u32,

    // rb_execution_context_t
    pub ec_vm_stack: usize,
    pub ec_vm_stack_size: usize,
    pub ec_cfp: usize,
    pub ec_thread_ptr: usize,

    // rb_control_frame_t
    pub cfp_size: usize,
    pub cfp_pc: usize,
    pub cfp_sp: usize,
    pub cfp_iseq: usize,
    pub cfp_self: usize,
    pub cfp_ep: usize,
    /// 4.1: `jit_return`. While ZJIT is on (`rb_zjit_entry` set) a frame whose `jit_return`
    /// is set keeps its real iseq and pc in a JITFrame (zjit.h, `CFP_ISEQ`/`CFP_PC`), and
    /// `cfp->_iseq` and `pc` may be stale: `jit_return` equal to `zjit_return_c_frame` marks
    /// a C function's frame, any other value points just past a word holding the JITFrame's
    /// address. None before 4.1 (4.0's ZJIT writes the frame itself).
    pub cfp_jit_return: Option<usize>,
    /// `pc` and `iseq` in a JITFrame.
    pub zjit_frame_pc: usize,
    pub zjit_frame_iseq: usize,
    /// `ZJIT_JIT_RETURN_C_FRAME`.
    pub zjit_return_c_frame: u64,

    // rb_iseq_t and rb_iseq_constant_body
    pub iseq_body: usize,
    pub body_type: usize,
    pub body_iseq_size: usize,
    pub body_iseq_encoded: usize,
    pub body_location_pathobj: usize,
    /// None where a block's method name comes from its `local_iseq`'s label (4.1.0,
    /// upstream PR #18551 removed `base_label`).
    pub body_location_base_label: Option<usize>,
    pub body_location_label: usize,
    pub body_location_first_lineno: usize,
    pub body_insns_info_body: usize,
    pub body_insns_info_size: usize,
    pub body_insns_info_succ_index_table: usize,
    pub body_parent_iseq: usize,
    pub body_local_iseq: usize,
    /// Builtin methods with `Primitive.mandatory_only?` run a second iseq (3.1+).
    pub body_mandatory_only_iseq: Option<usize>,
    /// Ruby 3.4's `builtin_attrs` byte holding `BUILTIN_ATTR_C_TRACE`, and that bit: a method
    /// written in Ruby inside the VM with `Primitive.attr! :c_trace` (under YJIT `Array#each`,
    /// `#map`, `#select`) shows in backtraces as a C method does (vm_backtrace.c,
    /// `backtrace_each`). None before 3.4, and from 4.0, whose rule for every internal frame
    /// covers these (`locates_internal_frames_at_their_caller`).
    pub body_c_trace: Option<(usize, u8)>,
    /// Bytes of the body the walker reads in one go (covers every `body_*` field above).
    pub body_read_size: usize,
    pub insn_info_entry_size: usize,
    pub insn_info_entry_line_no: usize,
    /// `IMMEDIATE_TABLE_SIZE` of iseq.c's succinct bit vector.
    pub succ_immediate_table_size: usize,
    pub succ_dict_block_size: usize,
    pub succ_dict_block_rank: usize,
    pub succ_dict_block_small_block_ranks: usize,
    pub succ_dict_block_bits: usize,
    // enum iseq_type
    pub iseq_type_top: u32,
    pub iseq_type_method: u32,
    pub iseq_type_block: u32,
    pub iseq_type_class: u32,
    pub iseq_type_rescue: u32,
    pub iseq_type_ensure: u32,
    pub iseq_type_eval: u32,
    pub iseq_type_main: u32,
    pub iseq_type_plain: u32,

    // Method entries (imemo_ment) and definitions
    pub me_def: usize,
    pub me_owner: usize,
    pub me_def_original_id: usize,
    /// `def->original_module` (the master of 2026-08, 4.1.0): the module a method was
    /// defined in, which backtraces label it by (vm_backtrace.c, `location_original_module`:
    /// an alias in a subclass is shown as `Parent#name`). None before: labels use the owner.
    pub me_def_original_module: Option<usize>,
    /// `def->body.iseq.iseqptr`: the method body a Ruby method's frames must be running.
    pub me_def_iseqptr: usize,
    /// `def->type` is a bitfield in the definition's first word.
    pub me_def_type_mask: u64,
    pub me_def_type_shift: u32,
    pub method_type_iseq: u64,
    pub method_type_cfunc: u64,

    // Environment (ep[...]) indexes and frame flags
    pub frame_magic_mask: u64,
    pub frame_magic_cfunc: u64,
    pub env_flag_local: u64,
    pub imemo_ment: u64,
    pub imemo_iseq: u64,
    /// A method that uses `$~`/`$_` keeps an svar in `ep[-2]`; the method entry is inside.
    pub imemo_svar: u64,
    pub svar_cref_or_me: usize,

    // VALUEs that are no pointer (enum ruby_special_consts): false, true and nil, and the
    // tags of Integers (fixnums), Floats (flonums) and static Symbols. Qnil moved from 0x08
    // to 0x04 in 3.2, so a VALUE means nothing without its layout.
    pub qfalse: u64,
    pub qtrue: u64,
    pub qnil: u64,
    /// `v & fixnum_flag != 0`: an Integer, `v >> 1` (arithmetic).
    pub fixnum_flag: u64,
    /// `v & flonum_mask == flonum_flag`: a Float packed into the VALUE.
    pub flonum_mask: u64,
    pub flonum_flag: u64,
    /// The low `special_shift` bits equal to `symbol_flag`: a static Symbol, whose ID is
    /// `v >> special_shift`.
    pub symbol_flag: u64,
    pub special_shift: u32,
    // Object types (enum ruby_value_type): `RBasic.flags & t_mask`.
    pub t_mask: u64,
    pub t_class: u64,
    pub t_module: u64,
    pub t_string: u64,
    pub t_array: u64,
    /// A dynamic Symbol (one made at run time, e.g. by `to_sym`), named by `rsymbol_fstr`.
    pub t_symbol: u64,
    pub t_imemo: u64,

    // Object headers
    pub rbasic_flags: usize,
    pub rbasic_klass: usize,
    pub fl_ushift: u32,
    pub fl_singleton: u64,
    pub rstring_noembed: u64,
    pub rstring_embed_len_mask: u64,
    pub rstring_embed_len_shift: u32,
    /// Where an embedded string keeps its length (3.2+); before, it is in the flags.
    pub rstring_embed_len: Option<usize>,
    pub rstring_heap_len: usize,
    pub rstring_heap_ptr: usize,
    pub rstring_embed_ary: usize,
    pub rarray_embed_flag: u64,
    pub rarray_embed_len_mask: u64,
    pub rarray_embed_len_shift: u32,
    pub rarray_heap_len: usize,
    pub rarray_heap_ptr: usize,
    pub rarray_embed_ary: usize,
    /// `struct RSymbol.fstr`: a dynamic Symbol's name, a String.
    pub rsymbol_fstr: usize,

    // Classes. Before 3.3 a class's name is its `__classpath__` instance variable and a
    // singleton's object its `__attached__` one: before 3.2 both in the iv_tbl (an
    // st_table) of the class extension, which `RClass.ptr` points to; in 3.2 in an ivar
    // array indexed through object shapes (see `classext_iv_ptr` below), the extension
    // following the RClass in the same slot. From 3.3 the extension (after the RClass too)
    // has `classpath`, `permanent_classpath` and `attached_object` fields.
    pub rclass_ext_ptr: Option<usize>,
    pub rclass_ext_inline: Option<usize>,
    pub classext_iv_tbl: Option<usize>,
    pub classext_classpath: Option<usize>,
    /// (byte offset, bit mask) of the `permanent_classpath` bitfield.
    pub classext_permanent_classpath: Option<(usize, u8)>,
    pub classext_attached_object: Option<usize>,
    // Ruby 3.2 only: object shapes. A class's instance variables (`__classpath__`,
    // `__attached__` among them) are a flat VALUE array, `iv_ptr` of the class extension
    // (which follows the RClass, `rclass_ext_inline`); which ivar sits at which index is
    // kept by the class's shape, a node of a tree in `vm->shape_list`: walking from the
    // class's shape to the root through `parent_id`, each SHAPE_IVAR node names one ivar
    // (`edge_name`) at index `next_iv_index - 1`. 3.3 gave classes `classpath` and
    // `attached_object` fields (above), so every other layout has None and zeros here.
    /// Offset of `iv_ptr` (a `VALUE *`) in `rb_classext_t`.
    pub classext_iv_ptr: Option<usize>,
    /// Offset of `shape_list` (an `rb_shape_t *` array indexed by shape id) in `rb_vm_t`.
    pub vm_shape_list: Option<usize>,
    /// Offset of `next_shape_id` (a u32: one past the highest shape id) in `rb_vm_t`.
    pub vm_next_shape_id: Option<usize>,
    /// `SHAPE_FLAG_SHIFT`: an object's shape id is `RBasic.flags >> shape_flag_shift`
    /// (32 bits wide).
    pub shape_flag_shift: u32,
    /// `sizeof(rb_shape_t)`, the stride of `shape_list`.
    pub shape_size: usize,
    /// `rb_shape_t.edge_name`: the ivar's ID (a SHAPE_IVAR shape).
    pub shape_edge_name: usize,
    /// `rb_shape_t.next_iv_index` (u32): ivars up to and including this shape's.
    pub shape_next_iv_index: usize,
    /// `rb_shape_t.type` (u8, enum shape_type).
    pub shape_type: usize,
    /// `rb_shape_t.parent_id` (u32).
    pub shape_parent_id: usize,
    /// `SHAPE_IVAR` of enum shape_type: a shape that adds one ivar.
    pub shape_type_ivar: u64,
    /// `INVALID_SHAPE_ID`, the root's parent.
    pub shape_invalid_id: u64,
    pub st_table_entries_start: usize,
    /// Its width in bytes: 8 (`st_index_t`), or 4 since 4.1 packed it beside `rebuilds_num`.
    pub st_table_entries_start_size: usize,
    pub st_table_entries_bound: usize,
    pub st_table_entries: usize,
    pub st_table_entry_size: usize,
    pub st_table_entry_key: usize,
    pub st_table_entry_record: usize,

    // Symbols: struct rb_symbols_t (ruby_global_symbols) and ID encoding
    pub symbols_last_id: usize,
    pub symbols_ids: usize,
    pub symbols_size: usize,
    pub id_scope_shift: u32,
    pub last_op_id: u64,
    pub id_entry_unit: u64,
    pub id_entry_size: u64,
    /// 4.1: each chunk of `ids` is a T_DATA (`RTypedData.data` at this offset) wrapping an
    /// `rb_darray` of `struct sym_id_entry {sym, str}`; before, the chunk is an Array of
    /// `id_entry_size` VALUEs per ID. None before 4.1.
    pub id_chunk_data: Option<usize>,
    /// 4.1: bytes of the darray's header (`rb_darray_meta_t`) before its entries; 0 before.
    pub id_chunk_header: usize,
    /// Which VALUE of an ID's entry is its name (a String): `ID_ENTRY_STR` (0) before 4.1,
    /// `sym_id_entry.str` (1) in 4.1.
    pub id_entry_str: u64,
    /// 4.1 from the master of 2026-08: `ids` is itself a T_DATA (data at `id_chunk_data`)
    /// over a directory `struct id_entry_dir { long capa; VALUE *entries; }` whose entries
    /// are the chunks (0 where none was made yet): the offsets of `capa` and `entries` in
    /// it. None where `ids` is an Array of chunks.
    pub id_dir: Option<(usize, usize)>,
}
}

impl Layout {
    /// Backtraces label rescue, ensure and eval code like the code it belongs to (the nearest
    /// ancestor iseq of another kind) and leave out the frame of that code, showing the
    /// clause's frame in its place: Ruby 3.4's `calculate_iseq_label` and `skip_next_frame`
    /// in vm_backtrace.c. Before 3.4 every clause has its own label and frame.
    pub fn labels_clauses_as_their_code(&self) -> bool {
        self.api_version >= 304
    }

    /// Backtraces show a method defined inside the VM in Ruby (an iseq whose path starts with
    /// `<internal:`, such as `Kernel#loop` or, under YJIT, `Array#each`) the way they show a C
    /// function: at its caller's path and line, replacing the C functions and internal methods
    /// it called. Ruby 4.0's `is_internal_location` in vm_backtrace.c; 3.4 and older print
    /// such frames at their own `<internal:...>` location.
    pub fn locates_internal_frames_at_their_caller(&self) -> bool {
        self.api_version >= 400
    }

    /// Whether the iseq body read as `body` (`body_read_size` bytes) has 3.4's
    /// `BUILTIN_ATTR_C_TRACE` (`body_c_trace`).
    pub fn is_c_traced(&self, body: &[u8]) -> bool {
        self.body_c_trace
            .is_some_and(|(at, bit)| body.get(at).is_some_and(|byte| byte & bit != 0))
    }

    /// `symbols_last_id` is 4.0's `next_id`, one past the last ID serial, where before it was
    /// `last_id`, the last serial itself.
    pub fn symbols_count_next_id(&self) -> bool {
        self.api_version >= 400
    }
}

/// The layout for a Ruby version string such as "3.1.2", if it is a known release.
pub fn layout_for_version(version: &str) -> Option<&'static Layout> {
    VERSIONS
        .iter()
        .find(|(v, _)| *v == version)
        .map(|(_, index)| &LAYOUTS[*index])
}

/// The heap layout of `version` ("3.3.8"): its own when measured, else that of the
/// measured release of the same minor series (their gc.c rarely differs within a series;
/// the census checks every page it reads against it). None for an unknown series.
pub fn heap_layout_for_version(version: &str) -> Option<&'static HeapLayout> {
    let series = |v: &str| v.splitn(3, '.').take(2).collect::<Vec<_>>().join(".");
    let heaps = HEAP_LAYOUTS;
    heaps
        .iter()
        .find(|(release, _)| *release == version)
        .or_else(|| {
            heaps
                .iter()
                .find(|(release, _)| series(release) == series(version))
        })
        .map(|(_, layout)| layout)
}

/// The oldest and the newest release in [`VERSIONS`], ordered by number (major, minor,
/// patch: "3.2.10" is newer than "3.2.9"), e.g. for an error about an unsupported Ruby.
pub fn supported_range() -> (&'static str, &'static str) {
    numeric_range(VERSIONS.iter().map(|(v, _)| *v)).expect("VERSIONS is not empty")
}

/// Every minor series in [`VERSIONS`] as the range of its releases, oldest first, e.g.
/// "2.7.0-2.7.8, 3.0.0-3.0.7, ..., 4.1.0": the Rubies this build knows, for an error.
pub fn known_series() -> String {
    let mut series: Vec<(String, (&str, &str))> = Vec::new();
    for (v, _) in VERSIONS {
        let minor: String = v.splitn(3, '.').take(2).collect::<Vec<_>>().join(".");
        if series.iter().any(|(m, _)| *m == minor) {
            continue;
        }
        let prefix = format!("{minor}.");
        let of_minor = VERSIONS
            .iter()
            .map(|(v, _)| *v)
            .filter(|v| v.starts_with(&prefix));
        let range = numeric_range(of_minor).expect("holds v");
        series.push((minor, range));
    }
    series.sort_by_key(|(_, (oldest, _))| {
        oldest
            .split('.')
            .map(|p| p.parse::<u32>().unwrap_or(0))
            .collect::<Vec<_>>()
    });
    series
        .iter()
        .map(|(_, (oldest, newest))| match oldest == newest {
            true => oldest.to_string(),
            false => format!("{oldest}-{newest}"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The least and the greatest of `versions` by (major, minor, patch).
fn numeric_range<'a>(
    versions: impl Iterator<Item = &'a str> + Clone,
) -> Option<(&'a str, &'a str)> {
    fn key(version: &str) -> [u32; 3] {
        let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
        [(); 3].map(|_| parts.next().unwrap_or(0))
    }
    let oldest = versions.clone().min_by_key(|v| key(v))?;
    let newest = versions.max_by_key(|v| key(v))?;
    Some((oldest, newest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_version_points_at_a_layout() {
        for (version, index) in VERSIONS {
            assert!(*index < LAYOUTS.len(), "{version} points past LAYOUTS");
        }
    }

    #[test]
    fn ruby_3_1_2_is_known_and_1_8_7_is_not() {
        let layout = layout_for_version("3.1.2").expect("3.1.2 in the table");
        assert_eq!(layout.name, "3.1");
        assert!(layout_for_version("1.8.7").is_none());
    }

    #[test]
    fn supported_range_orders_releases_by_number() {
        let list = ["3.4.9", "3.4.12", "2.7.10", "2.7.8", "10.0.0", "4.1.0"];
        assert_eq!(numeric_range(list.into_iter()), Some(("2.7.8", "10.0.0")));
        assert_eq!(numeric_range(std::iter::empty()), None);

        let (oldest, newest) = supported_range();
        assert_eq!(oldest, "2.7.0");
        assert_eq!(newest, "4.1.0");
        let known = known_series();
        assert!(known.starts_with("2.7.0-2.7."), "{known}");
        assert!(
            known.contains(", 3.0.0-3.0.") && known.ends_with(", 4.1.0"),
            "{known}"
        );
    }

    #[test]
    fn only_ruby_3_2_has_shape_fields() {
        for l in LAYOUTS {
            if l.api_version == 302 {
                assert!(
                    l.classext_iv_ptr.is_some() && l.vm_shape_list.is_some(),
                    "{}",
                    l.name
                );
                assert!(
                    l.rclass_ext_inline.is_some() && l.shape_size > 0,
                    "{}",
                    l.name
                );
            } else {
                assert_eq!(l.classext_iv_ptr, None, "{}", l.name);
                assert_eq!(
                    (l.vm_shape_list, l.vm_next_shape_id),
                    (None, None),
                    "{}",
                    l.name
                );
                assert_eq!((l.shape_flag_shift, l.shape_size), (0, 0), "{}", l.name);
            }
        }
    }

    #[test]
    fn body_read_covers_every_body_field() {
        for l in LAYOUTS {
            for off in [
                l.body_type,
                l.body_iseq_size,
                l.body_iseq_encoded,
                l.body_location_pathobj,
                l.body_location_label,
                l.body_location_base_label.unwrap_or(0),
                l.body_location_first_lineno,
                l.body_insns_info_body,
                l.body_insns_info_size,
                l.body_insns_info_succ_index_table,
                l.body_parent_iseq,
                l.body_local_iseq,
            ] {
                assert!(off + 8 <= l.body_read_size, "{}: {off}", l.name);
            }
        }
    }
}
