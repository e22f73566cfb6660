//! Where each `Layout` field comes from in Ruby's own types: the member paths that
//! bindings/generator/layout_probe.c measures with `offsetof` against a Ruby's headers, and
//! that core/src/dwarf/ reads from a Ruby binary's debug information. One list for both: a
//! test (below) fails when the probe measures a member this list does not name.
//!
//! Alternatives are tried in order and the first the Ruby has wins: which one a Ruby has is
//! decided by its types, not by its version number (`rb_vm_t.ractor.main_thread` from 3.0,
//! `rb_vm_t.main_thread` before). Types are spelled as in C: `struct X`, or a typedef.

/// How one field is found.
#[derive(Debug, Clone, Copy)]
pub enum Recipe {
    /// `offsetof` the first (type, member path) the Ruby has; it must have one.
    Off(&'static [(&'static str, &'static str)]),
    /// `Some(offsetof)` of the first the Ruby has, None when it has none.
    SomeOff(&'static [(&'static str, &'static str)]),
    /// `offsetof` the first the Ruby has, 0 when it has none (fields unused where absent).
    OffOrZero(&'static [(&'static str, &'static str)]),
    /// `sizeof` the first type the Ruby has.
    Size(&'static [&'static str]),
    /// `sizeof` the member.
    MemberSize(&'static str, &'static str),
    /// (byte offset, mask) of a bitfield within one byte, None when absent.
    Bits(&'static [(&'static str, &'static str)]),
    /// The value of the first of these enumerators the Ruby has (Ruby's debug.c keeps every
    /// enum gdb needs in `ruby_dummy_gdb_enums`, so they survive in the debug information).
    Enum(&'static [&'static str]),
    /// A constant of Ruby's source that no type or enum carries (the probe types it too).
    Fixed(u64),
    /// A rule of core/src/dwarf/rules.rs, by field name, over these members.
    Rule(&'static [(&'static str, &'static str)]),
}

use Recipe::*;

const VM: &str = "rb_vm_t";
const RACTOR: &str = "rb_ractor_t";
const TH: &str = "rb_thread_t";
const NT: &str = "struct rb_native_thread";
const EC: &str = "rb_execution_context_t";
const CFP: &str = "rb_control_frame_t";
const BODY: &str = "struct rb_iseq_constant_body";
const DEF: &str = "rb_method_definition_t";
const ME: &str = "rb_callable_method_entry_t";
const STR: &str = "struct RString";
const ARY: &str = "struct RArray";
const EXT: &str = "rb_classext_t";
const ST: &str = "st_table";
const ENTRY: &str = "struct st_table_entry";
const SYMS: &str = "rb_symbols_t";
const OBJSPACE: &str = "struct rb_objspace";

/// Every `Layout` field but `name`, with its recipe.
pub const MEMBERS: &[(&str, Recipe)] = &[
    ("api_version", Rule(&[])),
    ("vm_main_ractor", SomeOff(&[(VM, "ractor.main_ractor")])),
    (
        "vm_main_thread",
        Off(&[(VM, "ractor.main_thread"), (VM, "main_thread")]),
    ),
    ("vm_gvl_owner", SomeOff(&[(VM, "gvl.owner")])),
    (
        "ractor_gvl_owner",
        SomeOff(&[
            (RACTOR, "threads.sched.running"),
            (RACTOR, "threads.gvl.owner"),
        ]),
    ),
    ("ractor_threads_main", SomeOff(&[(RACTOR, "threads.main")])),
    ("vm_ractor_set", SomeOff(&[(VM, "ractor.set")])),
    ("ractor_list_node", OffOrZero(&[(RACTOR, "vmlr_node")])),
    ("ractor_id", OffOrZero(&[(RACTOR, "pub.id")])),
    ("ractor_name", OffOrZero(&[(RACTOR, "name")])),
    ("thread_self", Off(&[(TH, "self")])),
    ("thread_vm", Off(&[(TH, "vm")])),
    ("thread_ec", Off(&[(TH, "ec")])),
    ("vm_living_threads", SomeOff(&[(VM, "living_threads")])),
    ("ractor_threads_set", SomeOff(&[(RACTOR, "threads.set")])),
    (
        "thread_list_node",
        Off(&[(TH, "lt_node"), (TH, "vmlt_node")]),
    ),
    ("thread_name", Off(&[(TH, "name")])),
    ("thread_status", Bits(&[(TH, "status")])),
    ("thread_status_runnable", Enum(&["THREAD_RUNNABLE"])),
    ("thread_tid", SomeOff(&[(TH, "tid")])),
    ("thread_nt", SomeOff(&[(TH, "nt")])),
    ("native_thread_tid", SomeOff(&[(NT, "tid")])),
    ("thread_pthread", SomeOff(&[(TH, "thread_id")])),
    ("native_thread_pthread", SomeOff(&[(NT, "thread_id")])),
    (
        "thread_gvl_wait_node",
        Off(&[
            (TH, "sched.node.readyq"),
            (TH, "native_thread_data.node.gvl"),
        ]),
    ),
    // Some only where the wait node shares its place with the ubf-list node (before 3.3).
    (
        "thread_unblock_func",
        Rule(&[
            (TH, "unblock.func"),
            (TH, "sched.node.ubf"),
            (TH, "native_thread_data.node.ubf"),
        ]),
    ),
    (
        "vm_objspace",
        SomeOff(&[(VM, "gc.objspace"), (VM, "objspace")]),
    ),
    ("ractor_objspace", SomeOff(&[(RACTOR, "objspace")])),
    ("objspace_flags", Off(&[(OBJSPACE, "flags")])),
    (
        "objspace_during_gc_bit",
        Rule(&[(OBJSPACE, "flags.during_gc")]),
    ),
    ("ec_vm_stack", Off(&[(EC, "vm_stack")])),
    ("ec_vm_stack_size", Off(&[(EC, "vm_stack_size")])),
    ("ec_cfp", Off(&[(EC, "cfp")])),
    ("ec_thread_ptr", Off(&[(EC, "thread_ptr")])),
    ("cfp_size", Size(&[CFP])),
    ("cfp_pc", Off(&[(CFP, "pc")])),
    ("cfp_sp", Off(&[(CFP, "sp")])),
    ("cfp_iseq", Off(&[(CFP, "_iseq"), (CFP, "iseq")])),
    ("cfp_self", Off(&[(CFP, "self")])),
    ("cfp_ep", Off(&[(CFP, "ep")])),
    // 4.1's JITFrame scheme, which renamed `iseq` to `_iseq`; YJIT's `jit_return` before it
    // keeps frames whole.
    (
        "cfp_jit_return",
        Rule(&[(CFP, "jit_return"), (CFP, "_iseq")]),
    ),
    ("zjit_frame_pc", Rule(&[(CFP, "_iseq")])),
    ("zjit_frame_iseq", Rule(&[(CFP, "_iseq")])),
    ("zjit_return_c_frame", Rule(&[(CFP, "_iseq")])),
    ("iseq_body", Off(&[("rb_iseq_t", "body")])),
    ("body_type", Off(&[(BODY, "type")])),
    ("body_iseq_size", Off(&[(BODY, "iseq_size")])),
    ("body_iseq_encoded", Off(&[(BODY, "iseq_encoded")])),
    ("body_location_pathobj", Off(&[(BODY, "location.pathobj")])),
    (
        "body_location_base_label",
        SomeOff(&[(BODY, "location.base_label")]),
    ),
    ("body_location_label", Off(&[(BODY, "location.label")])),
    (
        "body_location_first_lineno",
        Off(&[(BODY, "location.first_lineno")]),
    ),
    ("body_insns_info_body", Off(&[(BODY, "insns_info.body")])),
    ("body_insns_info_size", Off(&[(BODY, "insns_info.size")])),
    (
        "body_insns_info_succ_index_table",
        // 4.1.0 shares the slot with `positions` (upstream PR #18464).
        Off(&[
            (BODY, "insns_info.succ_index_table"),
            (
                BODY,
                "insns_info.positions_or_succ_index_table.succ_index_table",
            ),
        ]),
    ),
    ("body_parent_iseq", Off(&[(BODY, "parent_iseq")])),
    ("body_local_iseq", Off(&[(BODY, "local_iseq")])),
    (
        "body_mandatory_only_iseq",
        SomeOff(&[(BODY, "mandatory_only_iseq")]),
    ),
    ("body_c_trace", Rule(&[(BODY, "builtin_attrs")])),
    ("body_read_size", Rule(&[])),
    (
        "insn_info_entry_size",
        Size(&["struct iseq_insn_info_entry"]),
    ),
    (
        "insn_info_entry_line_no",
        Off(&[("struct iseq_insn_info_entry", "line_no")]),
    ),
    (
        "succ_immediate_table_size",
        Rule(&[("struct succ_index_table", "imm_part")]),
    ),
    ("succ_dict_block_size", Size(&["struct succ_dict_block"])),
    (
        "succ_dict_block_rank",
        Off(&[("struct succ_dict_block", "rank")]),
    ),
    (
        "succ_dict_block_small_block_ranks",
        Off(&[("struct succ_dict_block", "small_block_ranks")]),
    ),
    (
        "succ_dict_block_bits",
        Off(&[("struct succ_dict_block", "bits")]),
    ),
    ("iseq_type_top", Enum(&["ISEQ_TYPE_TOP"])),
    ("iseq_type_method", Enum(&["ISEQ_TYPE_METHOD"])),
    ("iseq_type_block", Enum(&["ISEQ_TYPE_BLOCK"])),
    ("iseq_type_class", Enum(&["ISEQ_TYPE_CLASS"])),
    ("iseq_type_rescue", Enum(&["ISEQ_TYPE_RESCUE"])),
    ("iseq_type_ensure", Enum(&["ISEQ_TYPE_ENSURE"])),
    ("iseq_type_eval", Enum(&["ISEQ_TYPE_EVAL"])),
    ("iseq_type_main", Enum(&["ISEQ_TYPE_MAIN"])),
    ("iseq_type_plain", Enum(&["ISEQ_TYPE_PLAIN"])),
    ("me_def", Off(&[(ME, "def")])),
    ("me_owner", Off(&[(ME, "owner")])),
    ("me_def_original_id", Off(&[(DEF, "original_id")])),
    (
        "me_def_original_module",
        SomeOff(&[(DEF, "original_module")]),
    ),
    ("me_def_iseqptr", Off(&[(DEF, "body.iseq.iseqptr")])),
    ("me_def_type_mask", Rule(&[(DEF, "type")])),
    ("me_def_type_shift", Rule(&[(DEF, "type")])),
    ("method_type_iseq", Enum(&["VM_METHOD_TYPE_ISEQ"])),
    ("method_type_cfunc", Enum(&["VM_METHOD_TYPE_CFUNC"])),
    ("frame_magic_mask", Enum(&["VM_FRAME_MAGIC_MASK"])),
    ("frame_magic_cfunc", Enum(&["VM_FRAME_MAGIC_CFUNC"])),
    ("env_flag_local", Enum(&["VM_ENV_FLAG_LOCAL"])),
    ("imemo_ment", Enum(&["imemo_ment"])),
    ("imemo_iseq", Enum(&["imemo_iseq"])),
    ("imemo_svar", Enum(&["imemo_svar"])),
    ("svar_cref_or_me", Off(&[("struct vm_svar", "cref_or_me")])),
    ("qfalse", Enum(&["RUBY_Qfalse"])),
    ("qtrue", Enum(&["RUBY_Qtrue"])),
    ("qnil", Enum(&["RUBY_Qnil"])),
    ("fixnum_flag", Enum(&["RUBY_FIXNUM_FLAG"])),
    ("flonum_mask", Enum(&["RUBY_FLONUM_MASK"])),
    ("flonum_flag", Enum(&["RUBY_FLONUM_FLAG"])),
    ("symbol_flag", Enum(&["RUBY_SYMBOL_FLAG"])),
    ("special_shift", Enum(&["RUBY_SPECIAL_SHIFT"])),
    ("t_mask", Enum(&["RUBY_T_MASK"])),
    ("t_class", Enum(&["RUBY_T_CLASS"])),
    ("t_module", Enum(&["RUBY_T_MODULE"])),
    ("t_string", Enum(&["RUBY_T_STRING"])),
    ("t_array", Enum(&["RUBY_T_ARRAY"])),
    ("t_symbol", Enum(&["RUBY_T_SYMBOL"])),
    ("t_imemo", Enum(&["RUBY_T_IMEMO"])),
    ("rbasic_flags", Off(&[("struct RBasic", "flags")])),
    ("rbasic_klass", Off(&[("struct RBasic", "klass")])),
    ("fl_ushift", Enum(&["RUBY_FL_USHIFT"])),
    ("fl_singleton", Enum(&["RUBY_FL_SINGLETON"])),
    ("rstring_noembed", Enum(&["RSTRING_NOEMBED"])),
    // Where the length has a field of its own (3.2+), the flags hold none of it.
    ("rstring_embed_len_mask", Rule(&[])),
    ("rstring_embed_len_shift", Rule(&[])),
    (
        "rstring_embed_len",
        SomeOff(&[(STR, "len"), (STR, "as.embed.len")]),
    ),
    (
        "rstring_heap_len",
        Off(&[(STR, "len"), (STR, "as.heap.len")]),
    ),
    ("rstring_heap_ptr", Off(&[(STR, "as.heap.ptr")])),
    (
        "rstring_embed_ary",
        Off(&[(STR, "as.embed.ary"), (STR, "as.ary")]),
    ),
    ("rarray_embed_flag", Enum(&["RARRAY_EMBED_FLAG"])),
    ("rarray_embed_len_mask", Enum(&["RARRAY_EMBED_LEN_MASK"])),
    ("rarray_embed_len_shift", Enum(&["RARRAY_EMBED_LEN_SHIFT"])),
    ("rarray_heap_len", Off(&[(ARY, "as.heap.len")])),
    ("rarray_heap_ptr", Off(&[(ARY, "as.heap.ptr")])),
    ("rarray_embed_ary", Off(&[(ARY, "as.ary")])),
    ("rsymbol_fstr", Off(&[("struct RSymbol", "fstr")])),
    ("rclass_ext_ptr", SomeOff(&[("struct RClass", "ptr")])),
    // The extension after the RClass: a field of 3.4's pair struct, or the RClass's size.
    (
        "rclass_ext_inline",
        Rule(&[("struct RClass_and_rb_classext_t", "classext")]),
    ),
    (
        "classext_iv_tbl",
        Rule(&[("struct rb_classext_struct", "iv_tbl")]),
    ),
    ("classext_classpath", SomeOff(&[(EXT, "classpath")])),
    (
        "classext_permanent_classpath",
        Bits(&[(EXT, "permanent_classpath")]),
    ),
    (
        "classext_attached_object",
        SomeOff(&[(EXT, "as.singleton_class.attached_object")]),
    ),
    // 3.2's shapes: only where the VM holds the shape list (3.3 has classpath fields).
    (
        "classext_iv_ptr",
        Rule(&[(EXT, "iv_ptr"), (VM, "shape_list")]),
    ),
    ("vm_shape_list", SomeOff(&[(VM, "shape_list")])),
    ("vm_next_shape_id", SomeOff(&[(VM, "next_shape_id")])),
    ("shape_flag_shift", Rule(&[(VM, "shape_list")])),
    ("shape_size", Rule(&[(VM, "shape_list")])),
    (
        "shape_edge_name",
        Rule(&[("rb_shape_t", "edge_name"), (VM, "shape_list")]),
    ),
    (
        "shape_next_iv_index",
        Rule(&[("rb_shape_t", "next_iv_index"), (VM, "shape_list")]),
    ),
    (
        "shape_type",
        Rule(&[("rb_shape_t", "type"), (VM, "shape_list")]),
    ),
    (
        "shape_parent_id",
        Rule(&[("rb_shape_t", "parent_id"), (VM, "shape_list")]),
    ),
    ("shape_type_ivar", Rule(&[(VM, "shape_list")])),
    ("shape_invalid_id", Rule(&[(VM, "shape_list")])),
    ("st_table_entries_start", Off(&[(ST, "entries_start")])),
    (
        "st_table_entries_start_size",
        MemberSize(ST, "entries_start"),
    ),
    ("st_table_entries_bound", Off(&[(ST, "entries_bound")])),
    ("st_table_entries", Off(&[(ST, "entries")])),
    ("st_table_entry_size", Size(&[ENTRY])),
    ("st_table_entry_key", Off(&[(ENTRY, "key")])),
    ("st_table_entry_record", Off(&[(ENTRY, "record")])),
    (
        "symbols_last_id",
        Off(&[(SYMS, "next_id"), (SYMS, "last_id")]),
    ),
    ("symbols_ids", Off(&[(SYMS, "ids")])),
    ("symbols_size", Size(&[SYMS])),
    ("id_scope_shift", Enum(&["RUBY_ID_SCOPE_SHIFT"])),
    ("last_op_id", Enum(&["tLAST_OP_ID"])),
    ("id_entry_unit", Fixed(512)),
    ("id_entry_size", Fixed(2)),
    // 4.1's chunks of `struct sym_id_entry` in a T_DATA, and their directory.
    (
        "id_chunk_data",
        Rule(&[
            ("struct RTypedData", "data"),
            ("struct sym_id_entry", "str"),
        ]),
    ),
    ("id_chunk_header", Rule(&[("struct sym_id_entry", "str")])),
    ("id_entry_str", Rule(&[("struct sym_id_entry", "str")])),
    (
        "id_dir",
        Rule(&[
            ("struct id_entry_dir", "capa"),
            ("struct id_entry_dir", "entries"),
        ]),
    ),
];

/// The recipe of `field`.
pub fn recipe(field: &str) -> Option<Recipe> {
    MEMBERS.iter().find(|(f, _)| *f == field).map(|(_, r)| *r)
}

/// Every (type, member path) a recipe names.
pub fn paths(recipe: &Recipe) -> Vec<(&'static str, &'static str)> {
    match *recipe {
        Off(p) | SomeOff(p) | OffOrZero(p) | Bits(p) | Rule(p) => p.to_vec(),
        MemberSize(t, m) => vec![(t, m)],
        Size(_) | Enum(_) | Fixed(_) => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Layout;

    #[test]
    fn every_field_has_one_recipe() {
        let listed: Vec<&str> = MEMBERS.iter().map(|(f, _)| *f).collect();
        assert_eq!(
            listed,
            Layout::FIELDS,
            "MEMBERS must follow Layout's fields"
        );
    }

    /// The probe's `OFF(field, type, path)`, `SOMEOFF(...)` and `BITS(...)`: each must be
    /// one this list names for that field, so a member the probe learns to measure is one
    /// the debug-information reader reads too.
    #[test]
    fn the_probe_measures_only_members_this_list_names() {
        let probe = include_str!("../generator/layout_probe.c");
        let mut checked = 0;
        for line in probe.lines().map(str::trim) {
            let Some((mac, rest)) = line.split_once('(') else {
                continue;
            };
            if !matches!(mac, "OFF" | "SOMEOFF" | "BITS") {
                continue;
            }
            let args: Vec<&str> = rest.split(',').map(str::trim).collect();
            let (field, ty, path) = (args[0], args[1], args[2].trim_end_matches([')', ';']));
            if ty.starts_with("struct probe_") {
                continue; // the probe's copy of a private struct: its own recipe here
            }
            let recipe = recipe(field).unwrap_or_else(|| panic!("{field}: not in MEMBERS"));
            let path = path.replace("SYMBOLS_LAST_ID", "next_id");
            let named = paths(&recipe);
            let ok = named
                .iter()
                .any(|&(t, p)| t == ty && (p == path || (path == "next_id" && p == "last_id")));
            assert!(
                ok,
                "{field}: the probe measures {ty}.{path}, MEMBERS names {named:?}"
            );
            checked += 1;
        }
        assert!(checked > 80, "only {checked} probe lines read");
    }
}
