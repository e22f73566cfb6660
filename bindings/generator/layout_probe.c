/*
 * Prints one `Layout` (bindings/src/lib.rs) as Rust source, measured with offsetof/sizeof
 * against the real internal headers of one Ruby release. Built by script/generate-bindings
 * with -I pointing at a Ruby source tree (a Debian source package, or an upstream tree of
 * ../shared/rubies with its generated headers made by the script) and its configured
 * config.h; LAYOUT_NAME names the layout; OBJSPACE_FLAGS and OBJSPACE_DURING_GC_BIT are
 * measured by the script (see objspace_flags below), which also defines
 * PROBE_RACTOR_OBJSPACE when each Ractor owns its heap (`void *objspace;` in rb_ractor_t),
 * PROBE_ID_ENTRY_DIR and PROBE_ORIGINAL_MODULE likewise (see measure_release).
 *
 * Why C and not hand-typed numbers: the compiler resolves every #if (USE_RVARGC,
 * SIZEOF_SERIAL_T, VM_DEBUG_BP_CHECK...) exactly as the Ruby build did.
 */
#include "ruby/ruby.h"
#include "ruby/version.h"
#include "ruby/encoding.h" /* 2.7: must precede internal.h; symbol.h needs it */
#define RV (RUBY_API_VERSION_MAJOR * 100 + RUBY_API_VERSION_MINOR)
#include "vm_core.h"
#include "iseq.h"
#include "id.h"
#if RV >= 300
#include "internal/class.h"
#include "internal/imemo.h"
#include "ractor_core.h"
#else
#include "internal.h"
#endif
#if RV == 302
#include "shape.h"
#endif
#include "symbol.h"
#include <stddef.h>
#include <stdio.h>
#include <string.h>

/* Copies of private definitions in iseq.c and st.c, which have no header. They are checked
 * against those files by script/generate-bindings (it greps the source for them). */
#define IMMEDIATE_TABLE_SIZE 54
struct succ_dict_block {
    unsigned int rank;
    uint64_t small_block_ranks;
    uint64_t bits[512/64];
};
#if RV >= 401
/* zjit.h's JITFrame (defined there only when ZJIT is built; checked against zjit.h by the
 * script). */
struct probe_zjit_jit_frame {
    const VALUE *pc;
    const rb_iseq_t *iseq;
    bool materialize_block_code;
};
#endif
struct probe_st_table_entry {
    st_index_t hash; /* st_hash_t in st.c: same width */
    st_data_t key;
    st_data_t record;
};
#if RV >= 400
/* 4.0 moved rb_symbols_t from symbol.h into symbol.c (the symbol table became a concurrent
 * set) and renamed `last_id` to `next_id`: one past the last serial, where last_id was the
 * last serial itself. Copied, and checked against symbol.c by script/generate-bindings. */
typedef struct {
    rb_atomic_t next_id;
    VALUE sym_set;

    VALUE ids;
} rb_symbols_t;
#define SYMBOLS_LAST_ID next_id
#if RV >= 401
/* 4.1: symbol.c's entry of one ID in a chunk (checked against symbol.c by the script). */
#include "darray.h"
struct probe_sym_id_entry {
    VALUE sym;
    VALUE str;
};
#ifdef PROBE_ID_ENTRY_DIR
/* The master of 2026-08: symbol.c's directory of chunks, which `ids` wraps (the script
 * defines PROBE_ID_ENTRY_DIR when symbol.c has it, and checks it is this). */
struct probe_id_entry_dir {
    long capa;
    VALUE *entries;
};
#endif
#endif
#else
#define SYMBOLS_LAST_ID last_id
#endif
#ifndef OBJSPACE_DURING_GC_BIT
#error "OBJSPACE_DURING_GC_BIT: the bit of during_gc in rb_objspace's flags, measured by the script"
#endif
#ifndef OBJSPACE_FLAGS
#error "OBJSPACE_FLAGS: the offset of flags in struct rb_objspace, measured by the script"
#endif

#define U(name, value) printf("    " #name ": %lu,\n", (unsigned long)(value))
#define X(name, value) printf("    " #name ": 0x%lx,\n", (unsigned long)(value))
#define OFF(name, type, field) U(name, offsetof(type, field))
#define SOME(name, value) printf("    " #name ": Some(%lu),\n", (unsigned long)(value))
#define SOMEOFF(name, type, field) SOME(name, offsetof(type, field))
#define NONE(name) printf("    " #name ": None,\n")

/* Finds a small bitfield: sets all its bits (`all`) in a zeroed struct and reports
 * (byte offset, mask). The field must not straddle a byte. */
#define BITS(name, type, field, all) do { \
        type probe_; unsigned char *b_ = (unsigned char *)&probe_; \
        memset(&probe_, 0, sizeof(probe_)); probe_.field = all; \
        for (size_t i_ = 0; i_ < sizeof(probe_); i_++) if (b_[i_]) { \
            printf("    " #name ": Some((%zu, 0x%x)),\n", i_, b_[i_]); break; } \
    } while (0)

static size_t max_end(void) {
    size_t ends[] = {
        offsetof(struct rb_iseq_constant_body, type) + 8,
        offsetof(struct rb_iseq_constant_body, iseq_encoded) + 8,
        offsetof(struct rb_iseq_constant_body, location.first_lineno) + 8,
        offsetof(struct rb_iseq_constant_body, insns_info.succ_index_table) + 8,
        offsetof(struct rb_iseq_constant_body, parent_iseq) + 8,
        offsetof(struct rb_iseq_constant_body, local_iseq) + 8,
#if RV == 304
        offsetof(struct rb_iseq_constant_body, builtin_attrs) + 8,
#endif
    };
    size_t m = 0;
    for (size_t i = 0; i < sizeof(ends) / sizeof(ends[0]); i++) if (ends[i] > m) m = ends[i];
    return m;
}

int main(void) {
    printf("Layout {\n    name: \"%s\",\n", LAYOUT_NAME);
    U(api_version, RV);
#if RV >= 300
    SOMEOFF(vm_main_ractor, rb_vm_t, ractor.main_ractor);
    OFF(vm_main_thread, rb_vm_t, ractor.main_thread);
    NONE(vm_gvl_owner);
#if RV >= 302
    /* 3.2 replaced the GVL struct by a per-ractor scheduler; `running` is the holder. */
    SOMEOFF(ractor_gvl_owner, rb_ractor_t, threads.sched.running);
#else
    SOMEOFF(ractor_gvl_owner, rb_ractor_t, threads.gvl.owner);
#endif
    SOMEOFF(ractor_threads_main, rb_ractor_t, threads.main);
    /* Every ractor, for the recorder: a list threaded through each rb_ractor_t. */
    SOMEOFF(vm_ractor_set, rb_vm_t, ractor.set);
    OFF(ractor_list_node, rb_ractor_t, vmlr_node);
    OFF(ractor_id, rb_ractor_t, pub.id);
    OFF(ractor_name, rb_ractor_t, name);
#else
    NONE(vm_main_ractor);
    OFF(vm_main_thread, rb_vm_t, main_thread);
    SOMEOFF(vm_gvl_owner, rb_vm_t, gvl.owner);
    NONE(ractor_gvl_owner);
    NONE(ractor_threads_main);
    NONE(vm_ractor_set);
    U(ractor_list_node, 0);
    U(ractor_id, 0);
    U(ractor_name, 0);
#endif
    OFF(thread_self, rb_thread_t, self);
    OFF(thread_vm, rb_thread_t, vm);
    OFF(thread_ec, rb_thread_t, ec);
    /* Every thread, for the recorder: a list threaded through each rb_thread_t. */
#if RV >= 300
    NONE(vm_living_threads);
    SOMEOFF(ractor_threads_set, rb_ractor_t, threads.set);
    OFF(thread_list_node, rb_thread_t, lt_node);
#else
    SOMEOFF(vm_living_threads, rb_vm_t, living_threads);
    NONE(ractor_threads_set);
    OFF(thread_list_node, rb_thread_t, vmlt_node);
#endif
    OFF(thread_name, rb_thread_t, name);
    BITS(thread_status, rb_thread_t, status, (enum rb_thread_status)3);
    U(thread_status_runnable, THREAD_RUNNABLE);
    /* The native thread id (as in /proc/PID/task): in the thread (3.1) or in its native
     * thread (3.2+); 2.7 and 3.0 do not record it. */
#if RV >= 302
    NONE(thread_tid);
    SOMEOFF(thread_nt, rb_thread_t, nt);
    SOMEOFF(native_thread_tid, struct rb_native_thread, tid);
#elif RV == 301
    SOMEOFF(thread_tid, rb_thread_t, tid);
    NONE(thread_nt);
    NONE(native_thread_tid);
#else
    NONE(thread_tid);
    NONE(thread_nt);
    NONE(native_thread_tid);
#endif
    /* The pthread_t (the thread pointer on glibc): in the thread before 3.2, in its native
     * thread after. */
#if RV >= 302
    NONE(thread_pthread);
    SOMEOFF(native_thread_pthread, struct rb_native_thread, thread_id);
#else
    SOMEOFF(thread_pthread, rb_thread_t, thread_id);
    NONE(native_thread_pthread);
#endif
    /* Waiting for the GVL: linked into the GVL's (3.2+: the scheduler's) queue. Before 3.3
     * the node is a union with the ubf-list node, told apart by unblock.func. */
#if RV >= 303
    OFF(thread_gvl_wait_node, rb_thread_t, sched.node.readyq);
    NONE(thread_unblock_func);
#elif RV >= 302
    OFF(thread_gvl_wait_node, rb_thread_t, sched.node.readyq);
    SOMEOFF(thread_unblock_func, rb_thread_t, unblock.func);
#else
    OFF(thread_gvl_wait_node, rb_thread_t, native_thread_data.node.gvl);
    SOMEOFF(thread_unblock_func, rb_thread_t, unblock.func);
#endif
    /* The GC's flags: rb_objspace is private to gc.c (gc/default/default.c in 3.4+, which
     * gc.c includes), so the script measures offsetof(rb_objspace_t, flags) by compiling
     * gc.c itself, with the bit of `during_gc` (`mode` must be bits 0-1: checked there). */
#if defined(PROBE_RACTOR_OBJSPACE)
    /* Each Ractor owns its heap (r->objspace); the VM points only at the global page pool. */
    NONE(vm_objspace);
    SOMEOFF(ractor_objspace, rb_ractor_t, objspace);
#elif RV >= 304
    SOMEOFF(vm_objspace, rb_vm_t, gc.objspace);
    NONE(ractor_objspace);
#else
    SOMEOFF(vm_objspace, rb_vm_t, objspace);
    NONE(ractor_objspace);
#endif
    U(objspace_flags, OBJSPACE_FLAGS);
    U(objspace_during_gc_bit, OBJSPACE_DURING_GC_BIT);
    OFF(ec_vm_stack, rb_execution_context_t, vm_stack);
    OFF(ec_vm_stack_size, rb_execution_context_t, vm_stack_size);
    OFF(ec_cfp, rb_execution_context_t, cfp);
    OFF(ec_thread_ptr, rb_execution_context_t, thread_ptr);
    U(cfp_size, sizeof(rb_control_frame_t));
    OFF(cfp_pc, rb_control_frame_t, pc);
    OFF(cfp_sp, rb_control_frame_t, sp);
#if RV >= 401
    /* 4.1 renamed it: under ZJIT a frame whose `jit_return` is set keeps its iseq and pc in
     * a JITFrame (zjit.h, CFP_ISEQ/CFP_PC) and `_iseq` may be stale. */
    OFF(cfp_iseq, rb_control_frame_t, _iseq);
#else
    OFF(cfp_iseq, rb_control_frame_t, iseq);
#endif
    OFF(cfp_self, rb_control_frame_t, self);
    OFF(cfp_ep, rb_control_frame_t, ep);
#if RV >= 401
    SOMEOFF(cfp_jit_return, rb_control_frame_t, jit_return);
    OFF(zjit_frame_pc, struct probe_zjit_jit_frame, pc);
    OFF(zjit_frame_iseq, struct probe_zjit_jit_frame, iseq);
    X(zjit_return_c_frame, 0x1); /* ZJIT_JIT_RETURN_C_FRAME */
#else
    NONE(cfp_jit_return);
    U(zjit_frame_pc, 0);
    U(zjit_frame_iseq, 0);
    X(zjit_return_c_frame, 0);
#endif
    OFF(iseq_body, rb_iseq_t, body);
    OFF(body_type, struct rb_iseq_constant_body, type);
    OFF(body_iseq_size, struct rb_iseq_constant_body, iseq_size);
    OFF(body_iseq_encoded, struct rb_iseq_constant_body, iseq_encoded);
    OFF(body_location_pathobj, struct rb_iseq_constant_body, location.pathobj);
    SOMEOFF(body_location_base_label, struct rb_iseq_constant_body, location.base_label);
    OFF(body_location_label, struct rb_iseq_constant_body, location.label);
    OFF(body_location_first_lineno, struct rb_iseq_constant_body, location.first_lineno);
    OFF(body_insns_info_body, struct rb_iseq_constant_body, insns_info.body);
    OFF(body_insns_info_size, struct rb_iseq_constant_body, insns_info.size);
    OFF(body_insns_info_succ_index_table, struct rb_iseq_constant_body, insns_info.succ_index_table);
    OFF(body_parent_iseq, struct rb_iseq_constant_body, parent_iseq);
    OFF(body_local_iseq, struct rb_iseq_constant_body, local_iseq);
#if RV >= 301
    SOMEOFF(body_mandatory_only_iseq, struct rb_iseq_constant_body, mandatory_only_iseq);
#else
    NONE(body_mandatory_only_iseq);
#endif
#if RV == 304
    /* builtin_attrs' first byte holds BUILTIN_ATTR_C_TRACE (x86_64 is little-endian). */
    _Static_assert(BUILTIN_ATTR_C_TRACE < 0x100, "C_TRACE is not in builtin_attrs' first byte");
    printf("    body_c_trace: Some((%zu, 0x%x)),\n", offsetof(struct rb_iseq_constant_body, builtin_attrs),
           (unsigned)BUILTIN_ATTR_C_TRACE);
#else
    NONE(body_c_trace);
#endif
    U(body_read_size, max_end());
    U(insn_info_entry_size, sizeof(struct iseq_insn_info_entry));
    OFF(insn_info_entry_line_no, struct iseq_insn_info_entry, line_no);
    U(succ_immediate_table_size, IMMEDIATE_TABLE_SIZE);
    U(succ_dict_block_size, sizeof(struct succ_dict_block));
    OFF(succ_dict_block_rank, struct succ_dict_block, rank);
    OFF(succ_dict_block_small_block_ranks, struct succ_dict_block, small_block_ranks);
    OFF(succ_dict_block_bits, struct succ_dict_block, bits);
    U(iseq_type_top, ISEQ_TYPE_TOP);
    U(iseq_type_method, ISEQ_TYPE_METHOD);
    U(iseq_type_block, ISEQ_TYPE_BLOCK);
    U(iseq_type_class, ISEQ_TYPE_CLASS);
    U(iseq_type_rescue, ISEQ_TYPE_RESCUE);
    U(iseq_type_ensure, ISEQ_TYPE_ENSURE);
    U(iseq_type_eval, ISEQ_TYPE_EVAL);
    U(iseq_type_main, ISEQ_TYPE_MAIN);
    U(iseq_type_plain, ISEQ_TYPE_PLAIN);
    OFF(me_def, rb_callable_method_entry_t, def);
    OFF(me_owner, rb_callable_method_entry_t, owner);
    OFF(me_def_original_id, rb_method_definition_t, original_id);
#ifdef PROBE_ORIGINAL_MODULE
    SOMEOFF(me_def_original_module, rb_method_definition_t, original_module);
#else
    NONE(me_def_original_module);
#endif
    OFF(me_def_iseqptr, rb_method_definition_t, body.iseq.iseqptr);
    {
        /* `type` is a bitfield: find its bits in the first word by setting them all. */
        rb_method_definition_t def;
        uint64_t first = 0;
        memset(&def, 0, sizeof(def));
        def.type = (rb_method_type_t)((1u << VM_METHOD_TYPE_MINIMUM_BITS) - 1);
        memcpy(&first, &def, sizeof(first));
        X(me_def_type_mask, first);
        U(me_def_type_shift, __builtin_ctzll(first));
    }
    U(method_type_iseq, VM_METHOD_TYPE_ISEQ);
    U(method_type_cfunc, VM_METHOD_TYPE_CFUNC);
    X(frame_magic_mask, VM_FRAME_MAGIC_MASK);
    X(frame_magic_cfunc, VM_FRAME_MAGIC_CFUNC);
    X(env_flag_local, VM_ENV_FLAG_LOCAL);
    U(imemo_ment, imemo_ment);
    U(imemo_iseq, imemo_iseq);
    U(imemo_svar, imemo_svar);
    OFF(svar_cref_or_me, struct vm_svar, cref_or_me);
    /* The enum values follow the build's USE_FLONUM (on in every 64-bit build), which is why
     * they are read here and not typed in: 3.2 renumbered them (Qnil 0x08 -> 0x04). */
    X(qfalse, RUBY_Qfalse);
    X(qtrue, RUBY_Qtrue);
    X(qnil, RUBY_Qnil);
    X(fixnum_flag, RUBY_FIXNUM_FLAG);
    X(flonum_mask, RUBY_FLONUM_MASK);
    X(flonum_flag, RUBY_FLONUM_FLAG);
    X(symbol_flag, RUBY_SYMBOL_FLAG);
    U(special_shift, RUBY_SPECIAL_SHIFT);
    X(t_mask, RUBY_T_MASK);
    X(t_class, RUBY_T_CLASS);
    X(t_module, RUBY_T_MODULE);
    X(t_string, RUBY_T_STRING);
    X(t_array, RUBY_T_ARRAY);
    X(t_symbol, RUBY_T_SYMBOL);
    X(t_imemo, RUBY_T_IMEMO);
    OFF(rbasic_flags, struct RBasic, flags);
    OFF(rbasic_klass, struct RBasic, klass);
    U(fl_ushift, RUBY_FL_USHIFT);
    X(fl_singleton, RUBY_FL_SINGLETON);
    X(rstring_noembed, RSTRING_NOEMBED);
#if RV >= 303
    /* 3.3 moved the length out of the union: one field for both representations. */
    X(rstring_embed_len_mask, 0);
    U(rstring_embed_len_shift, 0);
    SOMEOFF(rstring_embed_len, struct RString, len);
    OFF(rstring_heap_len, struct RString, len);
#elif RV >= 302
    X(rstring_embed_len_mask, 0);
    U(rstring_embed_len_shift, 0);
    SOMEOFF(rstring_embed_len, struct RString, as.embed.len);
    OFF(rstring_heap_len, struct RString, as.heap.len);
#else
    X(rstring_embed_len_mask, RSTRING_EMBED_LEN_MASK);
    U(rstring_embed_len_shift, RSTRING_EMBED_LEN_SHIFT);
    NONE(rstring_embed_len);
    OFF(rstring_heap_len, struct RString, as.heap.len);
#endif
    OFF(rstring_heap_ptr, struct RString, as.heap.ptr);
#if RV >= 301 /* as.embed arrived in 3.1 */
    OFF(rstring_embed_ary, struct RString, as.embed.ary);
#else
    OFF(rstring_embed_ary, struct RString, as.ary);
#endif
    X(rarray_embed_flag, RARRAY_EMBED_FLAG);
    X(rarray_embed_len_mask, RARRAY_EMBED_LEN_MASK);
    U(rarray_embed_len_shift, RARRAY_EMBED_LEN_SHIFT);
    OFF(rarray_heap_len, struct RArray, as.heap.len);
    OFF(rarray_heap_ptr, struct RArray, as.heap.ptr);
    OFF(rarray_embed_ary, struct RArray, as.ary);
    OFF(rsymbol_fstr, struct RSymbol, fstr);
#if RV >= 303
    /* The class extension lives right after struct RClass, with the class path and the
     * singleton's attached object as fields. */
    NONE(rclass_ext_ptr);
#if RV >= 304
    SOMEOFF(rclass_ext_inline, struct RClass_and_rb_classext_t, classext);
#else
    SOME(rclass_ext_inline, sizeof(struct RClass));
#endif
    NONE(classext_iv_tbl);
    SOMEOFF(classext_classpath, rb_classext_t, classpath);
    BITS(classext_permanent_classpath, rb_classext_t, permanent_classpath, 1);
    SOMEOFF(classext_attached_object, rb_classext_t, as.singleton_class.attached_object);
#elif RV == 302
    /* USE_RVARGC: the class extension is embedded right after the RClass
     * (RCLASS_EXT_EMBEDDED), with no iv_tbl: ivars are in iv_ptr, indexed by shape. */
#if !RCLASS_EXT_EMBEDDED
#error "3.2 without RCLASS_EXT_EMBEDDED (USE_RVARGC): RClass.ptr, not handled here"
#endif
    NONE(rclass_ext_ptr);
    SOME(rclass_ext_inline, sizeof(struct RClass));
    NONE(classext_iv_tbl);
    NONE(classext_classpath);
    NONE(classext_permanent_classpath);
    NONE(classext_attached_object);
#else
    SOMEOFF(rclass_ext_ptr, struct RClass, ptr);
    NONE(rclass_ext_inline);
    SOMEOFF(classext_iv_tbl, struct rb_classext_struct, iv_tbl);
    NONE(classext_classpath);
    NONE(classext_permanent_classpath);
    NONE(classext_attached_object);
#endif
#if RV == 302
    SOMEOFF(classext_iv_ptr, rb_classext_t, iv_ptr);
    SOMEOFF(vm_shape_list, rb_vm_t, shape_list);
    SOMEOFF(vm_next_shape_id, rb_vm_t, next_shape_id);
    U(shape_flag_shift, SHAPE_FLAG_SHIFT);
    U(shape_size, sizeof(rb_shape_t));
    OFF(shape_edge_name, rb_shape_t, edge_name);
    OFF(shape_next_iv_index, rb_shape_t, next_iv_index);
    OFF(shape_type, rb_shape_t, type);
    OFF(shape_parent_id, rb_shape_t, parent_id);
    U(shape_type_ivar, SHAPE_IVAR);
    X(shape_invalid_id, INVALID_SHAPE_ID);
#else
    /* Only 3.2 finds class ivars through shapes (3.3 has classpath fields). */
    NONE(classext_iv_ptr);
    NONE(vm_shape_list);
    NONE(vm_next_shape_id);
    U(shape_flag_shift, 0);
    U(shape_size, 0);
    U(shape_edge_name, 0);
    U(shape_next_iv_index, 0);
    U(shape_type, 0);
    U(shape_parent_id, 0);
    U(shape_type_ivar, 0);
    X(shape_invalid_id, 0);
#endif
    OFF(st_table_entries_start, st_table, entries_start);
    U(st_table_entries_start_size, sizeof(((st_table *)0)->entries_start));
    OFF(st_table_entries_bound, st_table, entries_bound);
    OFF(st_table_entries, st_table, entries);
    U(st_table_entry_size, sizeof(struct probe_st_table_entry));
    OFF(st_table_entry_key, struct probe_st_table_entry, key);
    OFF(st_table_entry_record, struct probe_st_table_entry, record);
#if RV >= 400
    printf("    // from symbol.c: rb_symbols_t (private); 4.0+: `next_id`, one past the last serial\n");
#endif
    OFF(symbols_last_id, rb_symbols_t, SYMBOLS_LAST_ID);
    OFF(symbols_ids, rb_symbols_t, ids);
    U(symbols_size, sizeof(rb_symbols_t));
    U(id_scope_shift, RUBY_ID_SCOPE_SHIFT);
    U(last_op_id, tLAST_OP_ID);
    U(id_entry_unit, 512);
    U(id_entry_size, 2);
#if RV >= 401
    /* 4.1: each chunk of `ids` is a T_DATA wrapping an rb_darray of struct sym_id_entry
     * {sym, str} (symbol.c), no longer an Array of ID_ENTRY_SIZE VALUEs per ID, str first. */
    SOMEOFF(id_chunk_data, struct RTypedData, data);
    U(id_chunk_header, sizeof(rb_darray_meta_t));
    U(id_entry_str, offsetof(struct probe_sym_id_entry, str) / sizeof(VALUE));
#ifdef PROBE_ID_ENTRY_DIR
    printf("    id_dir: Some((%lu, %lu)),\n", (unsigned long)offsetof(struct probe_id_entry_dir, capa),
           (unsigned long)offsetof(struct probe_id_entry_dir, entries));
#else
    NONE(id_dir);
#endif
#else
    NONE(id_chunk_data);
    U(id_chunk_header, 0);
    U(id_entry_str, 0); /* ID_ENTRY_STR */
    NONE(id_dir);
#endif
    printf("}\n");
    return 0;
}
