//! Ruby VM struct layouts, as data.
//!
//! Every Ruby release the walker supports maps (through [`layout_for_version`]) to one
//! [`Layout`]: the byte offsets and constants the stack walker needs, nothing else. The
//! entries in `generated.rs` are written by `script/generate-bindings`, which compiles
//! `bindings/generator/layout_probe.c` against the real headers of each Ruby (Debian source
//! packages) and prints `offsetof`/`sizeof` values. Never edit `generated.rs` by hand.

mod generated;

pub use generated::{LAYOUTS, VERSIONS};

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
    /// The GC: `vm->objspace` (before 3.4) or `vm->gc.objspace`.
    pub vm_objspace: usize,
    /// Offset of `flags` in `rb_objspace` (private to gc.c, copied from the sources): a
    /// 2-bit `mode` (none, marking, sweeping, compacting) at bit 0 and `during_gc` at bit 5.
    pub objspace_flags: usize,

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

    // rb_iseq_t and rb_iseq_constant_body
    pub iseq_body: usize,
    pub body_type: usize,
    pub body_iseq_size: usize,
    pub body_iseq_encoded: usize,
    pub body_location_pathobj: usize,
    pub body_location_base_label: usize,
    pub body_location_label: usize,
    pub body_location_first_lineno: usize,
    pub body_insns_info_body: usize,
    pub body_insns_info_size: usize,
    pub body_insns_info_succ_index_table: usize,
    pub body_parent_iseq: usize,
    pub body_local_iseq: usize,
    /// Builtin methods with `Primitive.mandatory_only?` run a second iseq (3.1+).
    pub body_mandatory_only_iseq: Option<usize>,
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
    // singleton's object its `__attached__` one, both in the iv_tbl (an st_table) of the
    // class extension, which `RClass.ptr` points to. From 3.3 the extension follows the
    // RClass in the same slot and has `classpath`, `permanent_classpath` and
    // `attached_object` fields.
    pub rclass_ext_ptr: Option<usize>,
    pub rclass_ext_inline: Option<usize>,
    pub classext_iv_tbl: Option<usize>,
    pub classext_classpath: Option<usize>,
    /// (byte offset, bit mask) of the `permanent_classpath` bitfield.
    pub classext_permanent_classpath: Option<(usize, u8)>,
    pub classext_attached_object: Option<usize>,
    pub st_table_entries_start: usize,
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
}

impl Layout {
    /// Backtraces label rescue, ensure and eval code like the code it belongs to (the nearest
    /// ancestor iseq of another kind) and leave out the frame of that code, showing the
    /// clause's frame in its place: Ruby 3.4's `calculate_iseq_label` and `skip_next_frame`
    /// in vm_backtrace.c. Before 3.4 every clause has its own label and frame.
    pub fn labels_clauses_as_their_code(&self) -> bool {
        self.api_version >= 304
    }
}

/// The layout for a Ruby version string such as "3.1.2", if it is a known release.
pub fn layout_for_version(version: &str) -> Option<&'static Layout> {
    VERSIONS
        .iter()
        .find(|(v, _)| *v == version)
        .map(|(_, index)| &LAYOUTS[*index])
}

/// The layout of the newest known release of `major.minor`, for a patch release newer than
/// the table (the caller warns). Layouts do not change within a minor series in practice.
pub fn layout_for_minor(major: u32, minor: u32) -> Option<(&'static str, &'static Layout)> {
    let prefix = format!("{major}.{minor}.");
    VERSIONS
        .iter()
        .filter(|(v, _)| v.starts_with(&prefix))
        .max_by_key(|(v, _)| v[prefix.len()..].parse::<u32>().unwrap_or(0))
        .map(|(v, index)| (*v, &LAYOUTS[*index]))
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
    fn ruby_3_1_2_is_known_and_minor_fallback_finds_it() {
        let layout = layout_for_version("3.1.2").expect("3.1.2 in the table");
        assert_eq!(layout.name, "3.1");
        // The newest 3.1 (3.1.5+ moved `rb_vm_t.objspace`), which need not be 3.1.2's.
        let (v, fallback) = layout_for_minor(3, 1).unwrap();
        assert!(v.starts_with("3.1."));
        assert_eq!(fallback.name, "3.1");
        assert!(layout_for_version("1.8.7").is_none());
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
                l.body_location_base_label,
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
