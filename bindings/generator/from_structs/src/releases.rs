//! One `Layout` per Ruby release, measured on the bindgen output of rbspy-ruby-structs.
//!
//! `layout!` is `layout_probe.c` transcribed: the same fields in the same order, the same
//! `#if RV >= ...` branches (written `since!(RV >= ...)`), `offset_of!`/`size_of` in place
//! of `offsetof`/`sizeof`. It takes the crate's module for a release, so one body covers
//! every release. What the crate lacks for a release (private structs of iseq.c, st.c and
//! symbol.c, enums bindgen did not emit, RClass before 3.3...) is copied from the Ruby
//! sources and marked `NotMeasured`, which prints a `// from ...` line before the field;
//! what the crate has for no release at all (special constants, object types, RSymbol) is
//! marked `Transcribed` instead, which `--check` compares with the probe.

use crate::layout::{Layout, Val};
use std::ffi::c_void;

/// `since!(RV >= MIN { A } else { B })` is A when the release's RV (major * 100 + minor, as in
/// layout_probe.c) is at least MIN, else B: the probe's `#if RV >= MIN`. Only the chosen
/// branch is compiled, so each may name fields that exist only in its releases.
/// macro_rules cannot compare numbers, so the pairs for which the test fails are listed;
/// any other RV of a known MIN, including releases newer than this table, passes it.
#[rustfmt::skip]
macro_rules! since {
    (207 >= 300 $a:block else $b:block) => { $b };
    (207 >= 301 $a:block else $b:block) => { $b };
    (300 >= 301 $a:block else $b:block) => { $b };
    (207 >= 302 $a:block else $b:block) => { $b };
    (300 >= 302 $a:block else $b:block) => { $b };
    (301 >= 302 $a:block else $b:block) => { $b };
    (207 >= 303 $a:block else $b:block) => { $b };
    (300 >= 303 $a:block else $b:block) => { $b };
    (301 >= 303 $a:block else $b:block) => { $b };
    (302 >= 303 $a:block else $b:block) => { $b };
    (207 >= 304 $a:block else $b:block) => { $b };
    (300 >= 304 $a:block else $b:block) => { $b };
    (301 >= 304 $a:block else $b:block) => { $b };
    (302 >= 304 $a:block else $b:block) => { $b };
    (303 >= 304 $a:block else $b:block) => { $b };
    (207 >= 400 $a:block else $b:block) => { $b };
    (300 >= 400 $a:block else $b:block) => { $b };
    (301 >= 400 $a:block else $b:block) => { $b };
    (302 >= 400 $a:block else $b:block) => { $b };
    (303 >= 400 $a:block else $b:block) => { $b };
    (304 >= 400 $a:block else $b:block) => { $b };
    ($rv:tt >= 300 $a:block else $b:block) => { $a };
    ($rv:tt >= 301 $a:block else $b:block) => { $a };
    ($rv:tt >= 302 $a:block else $b:block) => { $a };
    ($rv:tt >= 303 $a:block else $b:block) => { $a };
    ($rv:tt >= 304 $a:block else $b:block) => { $a };
    ($rv:tt >= 400 $a:block else $b:block) => { $a };
    // A threshold not listed above would otherwise be true for every release.
    ($rv:tt >= $min:tt $a:block else $b:block) => {
        compile_error!(concat!("since!: add the releases older than ", stringify!($min)))
    };
}

// ---------------------------------------------------------------------------------------
// Copies of definitions that rbspy-ruby-structs does not have. The probe copies the first
// two as well (they have no header); the others the probe reads from headers the crate
// lacks. All were checked against the 2.7.4, 3.1.2, 3.3.8 and 3.4.5 sources (Debian's) and
// the upstream 3.0.3, 3.2.11, 4.0.2 ones (../shared/rubies), which script/generate-bindings
// measures with the probe, where they are identical unless said otherwise.

/// gc.c, gc/default/default.c: where `flags` sits in the private `struct rb_objspace`.
/// The probe's value is measured by compiling gc.c; these are those measurements.
const FROM_GC_FLAGS: &str =
    "from gc.c (gc/default/default.c from 3.4): rb_objspace's flags (during_gc: bit 5 in 2.7.4-4.0.2)";
const FROM_GC_C: &str = "from gc.c: struct rb_objspace (private; 16 in 2.7.4-3.3.8)";
const FROM_GC_DEFAULT_C: &str =
    "from gc/default/default.c: struct rb_objspace (private; 20 in 3.4.5)";
/// 4.0 put `malloc_counters` (increase, oldmalloc_increase) before malloc_params.
const FROM_GC_DEFAULT_C_4_0: &str =
    "from gc/default/default.c: struct rb_objspace (private; 28 in 4.0.2: malloc_counters first)";

/// iseq.c: `IMMEDIATE_TABLE_SIZE` of the succinct bit vector behind `succ_index_table`.
const IMMEDIATE_TABLE_SIZE: u64 = 54;
/// iseq.c: `struct succ_dict_block` (the crate's `succ_index_table` is opaque).
#[allow(dead_code)]
#[repr(C)]
struct SuccDictBlock {
    rank: u32,
    small_block_ranks: u64,
    bits: [u64; 512 / 64],
}
const FROM_ISEQ_C: &str =
    "from iseq.c: IMMEDIATE_TABLE_SIZE, struct succ_dict_block (private; same in 2.7.4-3.4.5)";

/// st.c: `struct st_table_entry` (opaque in the crate). `st_hash_t` is `st_index_t`.
#[allow(dead_code)]
#[repr(C)]
struct StTableEntry {
    hash: usize,
    key: usize,
    record: usize,
}
const FROM_ST_C: &str = "from st.c: struct st_table_entry (private; same in 2.7.4-3.4.5)";

/// vm_core.h enums that bindgen did not emit (no crate constant for them in any release).
const VM_FRAME_MAGIC_MASK: u64 = 0x7fff0001;
const VM_FRAME_MAGIC_CFUNC: u64 = 0x55550001;
const VM_ENV_FLAG_LOCAL: u64 = 0x0002;
const FROM_VM_CORE_H: &str =
    "from vm_core.h: VM_FRAME_MAGIC_*, VM_ENV_FLAG_LOCAL (not emitted; same in 2.7.4-3.4.5)";

const FROM_VM_CORE_H_JMPBUF: &str =
    "from vm_core.h: rb_thread_t.name less the crate's extra root_jmpbuf bytes: rb_jmpbuf_t\n\
     is void *[5] without RUBY_JMP_BUF, as in x86_64-linux config.h (Debian 2.7.4, upstream\n\
     3.0.3); the crate's is a sigjmp_buf";

/// symbol.h, 2.7 to 3.4: `rb_symbols_t`, the type of `ruby_global_symbols`.
#[allow(dead_code)]
#[repr(C)]
struct SymbolsWithStSym {
    last_id: u32, // rb_id_serial_t
    str_sym: *mut c_void,
    ids: usize,
    dsymbol_fstr_hash: usize,
}
const FROM_SYMBOL_H: &str =
    "from symbol.h: rb_symbols_t {last_id, str_sym, ids, dsymbol_fstr_hash} (same in 2.7.4-3.4.5)";

/// symbol.c from 4.0, the symbol table a concurrent set: `{ rb_atomic_t next_id; VALUE
/// sym_set; VALUE ids; }`, one word shorter. `next_id` is one past the last serial (where
/// `last_id` was the last serial); the probe measures it as `symbols_last_id`.
#[allow(dead_code)]
#[repr(C)]
struct SymbolsWithSymSet {
    next_id: u32,
    sym_set: usize,
    ids: usize,
}
const FROM_SYMBOL_C_4_0: &str =
    "from symbol.c: rb_symbols_t {next_id, sym_set, ids}, the concurrent-set symbol table\n\
     (private; same in 4.0.2)";

/// symbol.c: `ID_ENTRY_UNIT` and `ID_ENTRY_SIZE` (enum id_entry_type {STR, SYM, SIZE}).
const ID_ENTRY_UNIT: u64 = 512;
const ID_ENTRY_SIZE: u64 = 2;
const FROM_SYMBOL_C: &str =
    "from symbol.c: ID_ENTRY_UNIT, ID_ENTRY_SIZE (private; same in 2.7.4-3.4.5)";

/// internal/class.h (internal.h in 2.7) before 3.2, without USE_RVARGC: the start of
/// `struct RClass`. The crate has no RClass before 3.3.
#[allow(dead_code)]
#[repr(C)]
struct RClassWithPtr<RBasic> {
    basic: RBasic,
    super_: usize,
    ptr: *mut c_void,
}
const FROM_CLASS_H_RCLASS: &str =
    "from internal/class.h: struct RClass {basic, super, ptr, ...} (not in the crate before 3.3)";

/// internal/class.h, 3.0 and 3.1: the start of `struct rb_classext_struct`, as in the 2.7.4
/// and 3.1.2 sources (the crate has it for 2.7 only, with the same first two fields).
#[allow(dead_code)]
#[repr(C)]
struct ClassextWithIvTbl {
    iv_index_tbl: *mut c_void,
    iv_tbl: *mut c_void,
}
const FROM_CLASS_H_CLASSEXT: &str =
    "from internal/class.h: rb_classext_struct {iv_index_tbl, iv_tbl, ...} (as in 2.7.4 and 3.1.2)";

/// special_consts.h (ruby.h in 2.7): `enum ruby_special_consts` with USE_FLONUM, which
/// every 64-bit build has. ruby/ruby#6599 renumbered it for 3.2.0 (Qnil 0x08 -> 0x04, Qundef
/// 0x34 -> 0x24); the rest did not change.
const QFALSE: u64 = 0x00;
const QTRUE: u64 = 0x14;
const QNIL_BEFORE_3_2: u64 = 0x08;
/// zjit.h: 4.1's ZJIT keeps iseq and pc in a JITFrame; no release before has one.
const FROM_ZJIT_H: &str = "from zjit.h: JITFrames are 4.1's (none before)";
const QNIL: u64 = 0x04;
const FIXNUM_FLAG: u64 = 0x01;
const FLONUM_MASK: u64 = 0x03;
const FLONUM_FLAG: u64 = 0x02;
const SYMBOL_FLAG: u64 = 0x0c;
const SPECIAL_SHIFT: u64 = 8;
const FROM_SPECIAL_CONSTS_H: &str =
    "from special_consts.h (ruby.h in 2.7): enum ruby_special_consts with USE_FLONUM\n\
     (not in the crate; as in 2.7.4-3.4.5, Qnil renumbered in 3.2.0)";

/// value_type.h (ruby.h in 2.7): `enum ruby_value_type`.
const T_MASK: u64 = 0x1f;
const T_CLASS: u64 = 0x02;
const T_MODULE: u64 = 0x03;
const T_STRING: u64 = 0x05;
const T_ARRAY: u64 = 0x07;
const T_SYMBOL: u64 = 0x14;
const T_IMEMO: u64 = 0x1a;
const FROM_VALUE_TYPE_H: &str =
    "from value_type.h (ruby.h in 2.7): enum ruby_value_type (not in the crate; same in 2.7.4-3.4.5)";

/// symbol.h: `struct RSymbol`, around the crate's RBasic. `hashval` is an `st_index_t`.
#[allow(dead_code)]
#[repr(C)]
struct RSymbol<RBasic> {
    basic: RBasic,
    hashval: usize,
    fstr: usize,
    id: usize,
}
const FROM_SYMBOL_H_RSYMBOL: &str =
    "from symbol.h: struct RSymbol {basic, hashval, fstr, id} (not in the crate; same in 2.7.4-3.4.5)";

/// internal/class.h, 3.2 with USE_RVARGC (RCLASS_EXT_EMBEDDED): `struct RClass` without its
/// `ptr`, the class extension following it, and that extension's first field. The crate has
/// neither for 3.2 (RClass from 3.3 only, rb_classext_struct for 2.7 and 3.3+).
#[allow(dead_code)]
#[repr(C)]
struct RClassEmbeddedExt<RBasic> {
    basic: RBasic,
    super_: usize,
    m_tbl: *mut c_void,
}
#[allow(dead_code)]
#[repr(C)]
struct ClassextWithIvPtr {
    iv_ptr: *mut usize,
    const_tbl: *mut c_void,
}
const FROM_CLASS_H_3_2: &str =
    "from internal/class.h (3.2, USE_RVARGC): struct RClass {basic, super, m_tbl}, followed by\n\
     rb_classext_struct {iv_ptr, ...} (not in the crate for 3.2; as in 3.2.11)";

/// shape.h, 3.2: `enum shape_type`, which bindgen did not emit (in no release).
const SHAPE_IVAR: u64 = 1;
const FROM_SHAPE_H: &str =
    "from shape.h: enum shape_type {SHAPE_ROOT, SHAPE_IVAR, ...} (not in the crate)";

/// The offset of the one bit a bindgen bitfield setter sets in a zeroed `T`, as
/// `Some((byte, mask))` (the probe's ONE_BIT).
fn one_bit<T>(set: impl FnOnce(&mut T)) -> (usize, u8) {
    // SAFETY: bindgen structs are plain C data (integers, raw pointers, Option<fn>, no
    // bool): all-zero bytes are a valid value.
    let mut value: T = unsafe { std::mem::zeroed() };
    set(&mut value);
    // SAFETY: reading the bytes of a fully initialised (zeroed, then written) value.
    let bytes = unsafe {
        std::slice::from_raw_parts(&value as *const T as *const u8, std::mem::size_of::<T>())
    };
    let (i, b) = bytes
        .iter()
        .enumerate()
        .find(|(_, b)| **b != 0)
        .expect("no bit set");
    (i, *b)
}

/// The first 8 bytes of a zeroed `T` after `set`: where a bitfield in the first word is.
fn first_word<T>(set: impl FnOnce(&mut T)) -> u64 {
    // SAFETY: as in one_bit; every T used here is at least 8 bytes long.
    let mut value: T = unsafe { std::mem::zeroed() };
    set(&mut value);
    assert!(std::mem::size_of::<T>() >= 8);
    unsafe { std::ptr::read_unaligned(&value as *const T as *const u64) }
}

/// The shape fields of every layout but 3.2's, as the probe prints them.
fn shapes_unused(l: &mut Layout) {
    l.none("classext_iv_ptr");
    l.none("vm_shape_list");
    l.none("vm_next_shape_id");
    for field in [
        "shape_flag_shift",
        "shape_size",
        "shape_edge_name",
        "shape_next_iv_index",
        "shape_type",
        "shape_parent_id",
        "shape_type_ivar",
    ] {
        l.dec(field, 0);
    }
    l.hex("shape_invalid_id", 0);
}

/// The layout of one release: `$m` is its rbspy-ruby-structs module, `$rv` its RV.
macro_rules! layout {
    ($m:ident, $rv:tt) => {{
        #[allow(unused_imports)]
        use core::mem::{offset_of, size_of};
        use rbspy_ruby_structs::$m as r;

        let release = release_of(stringify!($m));
        let mut l = Layout::new(release[..release.rfind('.').unwrap()].to_string());
        // RUBY_API_VERSION_MAJOR * 100 + MINOR: the crate has no such constant, but the
        // module is one release, so it is the RV this expansion was given.
        l.dec("api_version", $rv);

        // rb_vm_t, rb_ractor_t: the GVL holder and the main thread.
        since!($rv >= 300 {
            l.some("vm_main_ractor", offset_of!(r::rb_vm_t, ractor.main_ractor));
            l.dec("vm_main_thread", offset_of!(r::rb_vm_t, ractor.main_thread));
            l.none("vm_gvl_owner");
            since!($rv >= 302 {
                // 3.2 replaced the GVL struct by a per-ractor scheduler; `running` holds it.
                l.some("ractor_gvl_owner", offset_of!(r::rb_ractor_t, threads.sched.running));
            } else {
                l.some("ractor_gvl_owner", offset_of!(r::rb_ractor_t, threads.gvl.owner));
            });
            l.some("ractor_threads_main", offset_of!(r::rb_ractor_t, threads.main));
            // Every ractor, for the recorder: a list threaded through each rb_ractor_t.
            l.some("vm_ractor_set", offset_of!(r::rb_vm_t, ractor.set));
            l.dec("ractor_list_node", offset_of!(r::rb_ractor_t, vmlr_node));
            l.dec("ractor_id", offset_of!(r::rb_ractor_t, pub_.id));
            l.dec("ractor_name", offset_of!(r::rb_ractor_t, name));
        } else {
            l.none("vm_main_ractor");
            l.dec("vm_main_thread", offset_of!(r::rb_vm_t, main_thread));
            l.some("vm_gvl_owner", offset_of!(r::rb_vm_t, gvl.owner));
            l.none("ractor_gvl_owner");
            l.none("ractor_threads_main");
            l.none("vm_ractor_set");
            l.dec("ractor_list_node", 0);
            l.dec("ractor_id", 0);
            l.dec("ractor_name", 0);
        });

        // rb_thread_t, rb_execution_context_t, rb_control_frame_t (`self` is `self_`).
        l.dec("thread_self", offset_of!(r::rb_thread_t, self_));
        l.dec("thread_vm", offset_of!(r::rb_thread_t, vm));
        l.dec("thread_ec", offset_of!(r::rb_thread_t, ec));
        since!($rv >= 300 {
            l.none("vm_living_threads");
            l.some("ractor_threads_set", offset_of!(r::rb_ractor_t, threads.set));
            l.dec("thread_list_node", offset_of!(r::rb_thread_t, lt_node));
        } else {
            l.some("vm_living_threads", offset_of!(r::rb_vm_t, living_threads));
            l.none("ractor_threads_set");
            l.dec("thread_list_node", offset_of!(r::rb_thread_t, vmlt_node));
        });
        since!($rv >= 301 {
            l.dec("thread_name", offset_of!(r::rb_thread_t, name));
        } else {
            // 2.7 and 3.0 have `rb_jmpbuf_t root_jmpbuf` before `name`. The crate's bindgen
            // saw RUBY_JMP_BUF = sigjmp_buf; x86_64-linux builds (Debian's 2.7.4, upstream
            // 3.0.3) define no RUBY_JMP_BUF, so vm_core.h makes it `void *[5]`.
            assert!(offset_of!(r::rb_thread_t, root_jmpbuf) < offset_of!(r::rb_thread_t, name));
            let extra = size_of::<r::rb_jmpbuf_t>() - size_of::<[*mut c_void; 5]>();
            l.transcribed(
                "thread_name",
                Val::Dec((offset_of!(r::rb_thread_t, name) - extra) as u64),
                FROM_VM_CORE_H_JMPBUF,
            );
        });
        l.some_bit(
            "thread_status",
            one_bit::<r::rb_thread_t>(|t| t.set_status(3)),
        );
        l.dec("thread_status_runnable", r::rb_thread_status_THREAD_RUNNABLE);
        since!($rv >= 302 {
            l.none("thread_tid");
            l.some("thread_nt", offset_of!(r::rb_thread_t, nt));
            l.some("native_thread_tid", offset_of!(r::rb_native_thread, tid));
        } else {
            since!($rv >= 301 {
                // Only 3.1 has it here (3.0 has none; 3.2 moved it to the native thread).
                l.some("thread_tid", offset_of!(r::rb_thread_t, tid));
            } else {
                l.none("thread_tid");
            });
            l.none("thread_nt");
            l.none("native_thread_tid");
        });
        // The pthread_t (see layout_probe.c).
        since!($rv >= 302 {
            l.none("thread_pthread");
            l.some("native_thread_pthread", offset_of!(r::rb_native_thread, thread_id));
        } else {
            l.some("thread_pthread", offset_of!(r::rb_thread_t, thread_id));
            l.none("native_thread_pthread");
        });
        // Waiting for the GVL (see layout_probe.c).
        since!($rv >= 302 {
            l.dec("thread_gvl_wait_node", offset_of!(r::rb_thread_t, sched.node.readyq));
            since!($rv >= 303 {
                l.none("thread_unblock_func");
            } else {
                l.some("thread_unblock_func", offset_of!(r::rb_thread_t, unblock.func));
            });
        } else {
            l.dec(
                "thread_gvl_wait_node",
                offset_of!(r::rb_thread_t, native_thread_data.node.gvl),
            );
            l.some("thread_unblock_func", offset_of!(r::rb_thread_t, unblock.func));
        });
        // The GC's flags; rb_objspace is private to gc.c (see layout_probe.c). One objspace
        // per VM in every release the crate has, and during_gc is bit 5 of its flags.
        since!($rv >= 304 {
            l.some("vm_objspace", offset_of!(r::rb_vm_t, gc.objspace));
        } else {
            l.some("vm_objspace", offset_of!(r::rb_vm_t, objspace));
        });
        l.none("ractor_objspace");
        since!($rv >= 400 {
            l.copied("objspace_flags", Val::Dec(28), FROM_GC_DEFAULT_C_4_0);
        } else {
            since!($rv >= 304 {
                l.copied("objspace_flags", Val::Dec(20), FROM_GC_DEFAULT_C);
            } else {
                l.copied("objspace_flags", Val::Dec(16), FROM_GC_C);
            });
        });
        l.copied("objspace_during_gc_bit", Val::Dec(5), FROM_GC_FLAGS);
        l.dec("ec_vm_stack", offset_of!(r::rb_execution_context_t, vm_stack));
        l.dec("ec_vm_stack_size", offset_of!(r::rb_execution_context_t, vm_stack_size));
        l.dec("ec_cfp", offset_of!(r::rb_execution_context_t, cfp));
        l.dec("ec_thread_ptr", offset_of!(r::rb_execution_context_t, thread_ptr));
        l.dec("cfp_size", size_of::<r::rb_control_frame_t>());
        l.dec("cfp_pc", offset_of!(r::rb_control_frame_t, pc));
        l.dec("cfp_sp", offset_of!(r::rb_control_frame_t, sp));
        l.dec("cfp_iseq", offset_of!(r::rb_control_frame_t, iseq));
        l.dec("cfp_self", offset_of!(r::rb_control_frame_t, self_));
        l.dec("cfp_ep", offset_of!(r::rb_control_frame_t, ep));
        // ZJIT's JITFrames are 4.1's (no crate release has them).
        l.copied("cfp_jit_return", Val::None, FROM_ZJIT_H);
        l.copied("zjit_frame_pc", Val::Dec(0), FROM_ZJIT_H);
        l.copied("zjit_frame_iseq", Val::Dec(0), FROM_ZJIT_H);
        l.copied("zjit_return_c_frame", Val::Hex(0), FROM_ZJIT_H);

        // rb_iseq_t and its body (`type` is `type_`).
        type Body = r::rb_iseq_constant_body;
        l.dec("iseq_body", offset_of!(r::rb_iseq_t, body));
        l.dec("body_type", offset_of!(Body, type_));
        l.dec("body_iseq_size", offset_of!(Body, iseq_size));
        l.dec("body_iseq_encoded", offset_of!(Body, iseq_encoded));
        l.dec("body_location_pathobj", offset_of!(Body, location.pathobj));
        l.some("body_location_base_label", offset_of!(Body, location.base_label));
        l.dec("body_location_label", offset_of!(Body, location.label));
        l.dec("body_location_first_lineno", offset_of!(Body, location.first_lineno));
        l.dec("body_insns_info_body", offset_of!(Body, insns_info.body));
        l.dec("body_insns_info_size", offset_of!(Body, insns_info.size));
        l.dec(
            "body_insns_info_succ_index_table",
            offset_of!(Body, insns_info.succ_index_table),
        );
        l.dec("body_parent_iseq", offset_of!(Body, parent_iseq));
        l.dec("body_local_iseq", offset_of!(Body, local_iseq));
        since!($rv >= 301 {
            l.some("body_mandatory_only_iseq", offset_of!(Body, mandatory_only_iseq));
        } else {
            l.none("body_mandatory_only_iseq");
        });
        // 3.4's BUILTIN_ATTR_C_TRACE (0x08, vm_core.h), in builtin_attrs' first byte; 4.0's
        // rule for internal frames covers it.
        since!($rv >= 304 {
            since!($rv >= 400 {
                l.none("body_c_trace");
            } else {
                l.some_bit("body_c_trace", (offset_of!(Body, builtin_attrs), 0x08));
            });
        } else {
            l.none("body_c_trace");
        });
        // The probe's max_end(): the end of the last of these, each read as 8 bytes.
        #[allow(unused_mut)]
        let mut ends = vec![
            offset_of!(Body, type_),
            offset_of!(Body, iseq_encoded),
            offset_of!(Body, location.first_lineno),
            offset_of!(Body, insns_info.succ_index_table),
            offset_of!(Body, parent_iseq),
            offset_of!(Body, local_iseq),
        ];
        since!($rv >= 304 {
            since!($rv >= 400 {} else { ends.push(offset_of!(Body, builtin_attrs)); });
        } else {});
        let body_read_size = ends
        .into_iter()
        .map(|off| off + 8)
        .max()
        .unwrap();
        l.dec("body_read_size", body_read_size);
        l.dec("insn_info_entry_size", size_of::<r::iseq_insn_info_entry>());
        l.dec("insn_info_entry_line_no", offset_of!(r::iseq_insn_info_entry, line_no));
        l.copied("succ_immediate_table_size", Val::Dec(IMMEDIATE_TABLE_SIZE), FROM_ISEQ_C);
        {
            type Block = SuccDictBlock;
            let from = FROM_ISEQ_C;
            l.copied("succ_dict_block_size", Val::Dec(size_of::<Block>() as u64), from);
            l.copied("succ_dict_block_rank", Val::Dec(offset_of!(Block, rank) as u64), from);
            let small = offset_of!(Block, small_block_ranks) as u64;
            l.copied("succ_dict_block_small_block_ranks", Val::Dec(small), from);
            l.copied("succ_dict_block_bits", Val::Dec(offset_of!(Block, bits) as u64), from);
        }

        // enum iseq_type: nested in the body struct (so prefixed by bindgen) before 3.2.
        since!($rv >= 302 {
            l.dec("iseq_type_top", r::rb_iseq_type_ISEQ_TYPE_TOP);
            l.dec("iseq_type_method", r::rb_iseq_type_ISEQ_TYPE_METHOD);
            l.dec("iseq_type_block", r::rb_iseq_type_ISEQ_TYPE_BLOCK);
            l.dec("iseq_type_class", r::rb_iseq_type_ISEQ_TYPE_CLASS);
            l.dec("iseq_type_rescue", r::rb_iseq_type_ISEQ_TYPE_RESCUE);
            l.dec("iseq_type_ensure", r::rb_iseq_type_ISEQ_TYPE_ENSURE);
            l.dec("iseq_type_eval", r::rb_iseq_type_ISEQ_TYPE_EVAL);
            l.dec("iseq_type_main", r::rb_iseq_type_ISEQ_TYPE_MAIN);
            l.dec("iseq_type_plain", r::rb_iseq_type_ISEQ_TYPE_PLAIN);
        } else {
            l.dec("iseq_type_top", r::rb_iseq_constant_body_iseq_type_ISEQ_TYPE_TOP);
            l.dec("iseq_type_method", r::rb_iseq_constant_body_iseq_type_ISEQ_TYPE_METHOD);
            l.dec("iseq_type_block", r::rb_iseq_constant_body_iseq_type_ISEQ_TYPE_BLOCK);
            l.dec("iseq_type_class", r::rb_iseq_constant_body_iseq_type_ISEQ_TYPE_CLASS);
            l.dec("iseq_type_rescue", r::rb_iseq_constant_body_iseq_type_ISEQ_TYPE_RESCUE);
            l.dec("iseq_type_ensure", r::rb_iseq_constant_body_iseq_type_ISEQ_TYPE_ENSURE);
            l.dec("iseq_type_eval", r::rb_iseq_constant_body_iseq_type_ISEQ_TYPE_EVAL);
            l.dec("iseq_type_main", r::rb_iseq_constant_body_iseq_type_ISEQ_TYPE_MAIN);
            l.dec("iseq_type_plain", r::rb_iseq_constant_body_iseq_type_ISEQ_TYPE_PLAIN);
        });

        // Method entries. The probe measures rb_callable_method_entry_t, which the crate
        // lacks; rb_method_entry_struct has the same fields (flags, defined_class, def,
        // called_id, owner) and so the same offsets.
        l.dec("me_def", offset_of!(r::rb_method_entry_struct, def));
        l.dec("me_owner", offset_of!(r::rb_method_entry_struct, owner));
        type Def = r::rb_method_definition_struct;
        l.dec("me_def_original_id", offset_of!(Def, original_id));
        l.none("me_def_original_module");
        l.dec("me_def_iseqptr", offset_of!(Def, body.iseq.iseqptr));
        {
            // `type` is a bitfield: set all its bits (bindgen's setter masks to the field's
            // width, VM_METHOD_TYPE_MINIMUM_BITS) and see where they land in the first word.
            let first = first_word::<Def>(|d| d.set_type(!0));
            l.hex("me_def_type_mask", first);
            l.dec("me_def_type_shift", first.trailing_zeros());
        }
        l.dec("method_type_iseq", r::rb_method_type_t_VM_METHOD_TYPE_ISEQ);
        l.dec("method_type_cfunc", r::rb_method_type_t_VM_METHOD_TYPE_CFUNC);

        // Frame flags, imemo types, svar.
        l.copied("frame_magic_mask", Val::Hex(VM_FRAME_MAGIC_MASK), FROM_VM_CORE_H);
        l.copied("frame_magic_cfunc", Val::Hex(VM_FRAME_MAGIC_CFUNC), FROM_VM_CORE_H);
        l.copied("env_flag_local", Val::Hex(VM_ENV_FLAG_LOCAL), FROM_VM_CORE_H);
        l.dec("imemo_ment", r::imemo_type_imemo_ment);
        l.dec("imemo_iseq", r::imemo_type_imemo_iseq);
        l.dec("imemo_svar", r::imemo_type_imemo_svar);
        l.dec("svar_cref_or_me", offset_of!(r::vm_svar, cref_or_me));

        // Special constants and object types: the crate has neither enum (see above).
        l.transcribed("qfalse", Val::Hex(QFALSE), FROM_SPECIAL_CONSTS_H);
        l.transcribed("qtrue", Val::Hex(QTRUE), FROM_SPECIAL_CONSTS_H);
        since!($rv >= 302 {
            l.transcribed("qnil", Val::Hex(QNIL), FROM_SPECIAL_CONSTS_H);
        } else {
            l.transcribed("qnil", Val::Hex(QNIL_BEFORE_3_2), FROM_SPECIAL_CONSTS_H);
        });
        l.transcribed("fixnum_flag", Val::Hex(FIXNUM_FLAG), FROM_SPECIAL_CONSTS_H);
        l.transcribed("flonum_mask", Val::Hex(FLONUM_MASK), FROM_SPECIAL_CONSTS_H);
        l.transcribed("flonum_flag", Val::Hex(FLONUM_FLAG), FROM_SPECIAL_CONSTS_H);
        l.transcribed("symbol_flag", Val::Hex(SYMBOL_FLAG), FROM_SPECIAL_CONSTS_H);
        l.transcribed("special_shift", Val::Dec(SPECIAL_SHIFT), FROM_SPECIAL_CONSTS_H);
        l.transcribed("t_mask", Val::Hex(T_MASK), FROM_VALUE_TYPE_H);
        l.transcribed("t_class", Val::Hex(T_CLASS), FROM_VALUE_TYPE_H);
        l.transcribed("t_module", Val::Hex(T_MODULE), FROM_VALUE_TYPE_H);
        l.transcribed("t_string", Val::Hex(T_STRING), FROM_VALUE_TYPE_H);
        l.transcribed("t_array", Val::Hex(T_ARRAY), FROM_VALUE_TYPE_H);
        l.transcribed("t_symbol", Val::Hex(T_SYMBOL), FROM_VALUE_TYPE_H);
        l.transcribed("t_imemo", Val::Hex(T_IMEMO), FROM_VALUE_TYPE_H);

        // Object headers. The RSTRING_*/RARRAY_* flags are enums bindgen did not emit;
        // they are built here from the crate's RUBY_FL_USERn exactly as the headers
        // (include/ruby/internal/core/rstring.h, rarray.h; ruby.h in 2.7) define them.
        let user = |n: u32| -> u64 {
            [
                r::ruby_fl_type_RUBY_FL_USER0 as u64,
                r::ruby_fl_type_RUBY_FL_USER1 as u64,
                r::ruby_fl_type_RUBY_FL_USER2 as u64,
                r::ruby_fl_type_RUBY_FL_USER3 as u64,
                r::ruby_fl_type_RUBY_FL_USER4 as u64,
                r::ruby_fl_type_RUBY_FL_USER5 as u64,
                r::ruby_fl_type_RUBY_FL_USER6 as u64,
                r::ruby_fl_type_RUBY_FL_USER7 as u64,
                r::ruby_fl_type_RUBY_FL_USER8 as u64,
                r::ruby_fl_type_RUBY_FL_USER9 as u64,
            ][n as usize]
        };
        // 3.0 moved RUBY_FL_USHIFT into its own enum.
        let fl_ushift: u32 = since!($rv >= 300 {
            r::ruby_fl_ushift_RUBY_FL_USHIFT as u32
        } else {
            r::ruby_fl_type_RUBY_FL_USHIFT as u32
        });
        // The flag masks below depend on USE_RVARGC (variable-width slots: on from 3.2, off
        // before in the builds both the crate and Debian used). RArray's embedded array
        // shows which the crate's bindgen saw: 3 VALUEs without RVARGC, 1 with it.
        // SAFETY: as in one_bit; only the size of the union field is taken.
        let rarray_embed_len = unsafe {
            let a: r::RArray = std::mem::zeroed();
            std::mem::size_of_val(&a.as_.ary) / size_of::<r::VALUE>()
        };
        assert_eq!(rarray_embed_len, since!($rv >= 302 { 1 } else { 3 }), "{release}: USE_RVARGC?");

        l.dec("rbasic_flags", offset_of!(r::RBasic, flags));
        l.dec("rbasic_klass", offset_of!(r::RBasic, klass));
        l.dec("fl_ushift", fl_ushift);
        l.hex("fl_singleton", r::ruby_fl_type_RUBY_FL_SINGLETON as u64);
        l.hex("rstring_noembed", user(1)); // RSTRING_NOEMBED = RUBY_FL_USER1
        since!($rv >= 303 {
            // 3.3 moved the length out of the union: one field for both representations.
            l.hex("rstring_embed_len_mask", 0);
            l.dec("rstring_embed_len_shift", 0);
            l.some("rstring_embed_len", offset_of!(r::RString, len));
            l.dec("rstring_heap_len", offset_of!(r::RString, len));
        } else {
            since!($rv >= 302 {
                l.hex("rstring_embed_len_mask", 0);
                l.dec("rstring_embed_len_shift", 0);
                l.some("rstring_embed_len", offset_of!(r::RString, as_.embed.len));
                l.dec("rstring_heap_len", offset_of!(r::RString, as_.heap.len));
            } else {
                // RSTRING_EMBED_LEN_MASK = USER2..USER6, RSTRING_EMBED_LEN_SHIFT = USHIFT + 2
                l.hex("rstring_embed_len_mask", (2..=6).map(user).fold(0, |a, b| a | b));
                l.dec("rstring_embed_len_shift", fl_ushift + 2);
                l.none("rstring_embed_len");
                l.dec("rstring_heap_len", offset_of!(r::RString, as_.heap.len));
            });
        });
        l.dec("rstring_heap_ptr", offset_of!(r::RString, as_.heap.ptr));
        // `as.embed` appeared in 3.1; 3.0 still has `as.ary` (the crate's 3.0.x RString).
        // layout_probe.c uses `#if RV >= 300` here, which would not compile against 3.0.
        since!($rv >= 301 {
            l.dec("rstring_embed_ary", offset_of!(r::RString, as_.embed.ary));
        } else {
            l.dec("rstring_embed_ary", offset_of!(r::RString, as_.ary));
        });
        l.hex("rarray_embed_flag", user(1)); // RARRAY_EMBED_FLAG = RUBY_FL_USER1
        since!($rv >= 302 {
            // With USE_RVARGC: RARRAY_EMBED_LEN_MASK = USER3..USER9.
            l.hex("rarray_embed_len_mask", (3..=9).map(user).fold(0, |a, b| a | b));
        } else {
            // Without: RARRAY_EMBED_LEN_MASK = USER3 | USER4.
            l.hex("rarray_embed_len_mask", user(3) | user(4));
        });
        l.dec("rarray_embed_len_shift", fl_ushift + 3); // RARRAY_EMBED_LEN_SHIFT
        l.dec("rarray_heap_len", offset_of!(r::RArray, as_.heap.len));
        l.dec("rarray_heap_ptr", offset_of!(r::RArray, as_.heap.ptr));
        l.dec("rarray_embed_ary", offset_of!(r::RArray, as_.ary));
        l.transcribed(
            "rsymbol_fstr",
            Val::Dec(offset_of!(RSymbol<r::RBasic>, fstr) as u64),
            FROM_SYMBOL_H_RSYMBOL,
        );

        // Classes.
        since!($rv >= 303 {
            // The class extension lives right after struct RClass, with the class path and
            // the singleton's attached object as fields.
            l.none("rclass_ext_ptr");
            since!($rv >= 304 {
                l.some("rclass_ext_inline", offset_of!(r::RClass_and_rb_classext_t, classext));
            } else {
                // As the probe: 3.3's RCLASS_EXT is also RClass_and_rb_classext_t.classext,
                // which follows the (pointer-aligned) RClass.
                l.some("rclass_ext_inline", size_of::<r::RClass>());
            });
            l.none("classext_iv_tbl");
            l.some("classext_classpath", offset_of!(r::rb_classext_t, classpath));
            l.some_bit(
                "classext_permanent_classpath",
                one_bit::<r::rb_classext_t>(|c| c.set_permanent_classpath(true)),
            );
            l.some(
                "classext_attached_object",
                offset_of!(r::rb_classext_t, as_.singleton_class.attached_object),
            );
        } else {
            since!($rv >= 302 {
                // The extension follows the RClass; class ivars are in its iv_ptr, indexed
                // by shape (below), with no iv_tbl nor classpath field.
                l.none("rclass_ext_ptr");
                l.copied(
                    "rclass_ext_inline",
                    Val::Some(size_of::<RClassEmbeddedExt<r::RBasic>>() as u64),
                    FROM_CLASS_H_3_2,
                );
                l.none("classext_iv_tbl");
                l.none("classext_classpath");
                l.none("classext_permanent_classpath");
                l.none("classext_attached_object");
            } else {
                l.copied(
                    "rclass_ext_ptr",
                    Val::Some(offset_of!(RClassWithPtr<r::RBasic>, ptr) as u64),
                    FROM_CLASS_H_RCLASS,
                );
                l.none("rclass_ext_inline");
                since!($rv >= 300 {
                    l.copied(
                        "classext_iv_tbl",
                        Val::Some(offset_of!(ClassextWithIvTbl, iv_tbl) as u64),
                        FROM_CLASS_H_CLASSEXT,
                    );
                } else {
                    l.some("classext_iv_tbl", offset_of!(r::rb_classext_t, iv_tbl));
                });
                l.none("classext_classpath");
                l.none("classext_permanent_classpath");
                l.none("classext_attached_object");
            });
        });
        // Object shapes: 3.2 finds a class's ivars by its shape (see layout_probe.c).
        since!($rv >= 302 {
            since!($rv >= 303 {
                shapes_unused(&mut l);
            } else {
                type Shape = r::rb_shape_t;
                l.copied(
                    "classext_iv_ptr",
                    Val::Some(offset_of!(ClassextWithIvPtr, iv_ptr) as u64),
                    FROM_CLASS_H_3_2,
                );
                l.some("vm_shape_list", offset_of!(r::rb_vm_t, shape_list));
                l.some("vm_next_shape_id", offset_of!(r::rb_vm_t, next_shape_id));
                // shape.h builds both from the width of shape_id_t: SHAPE_ID_NUM_BITS, then
                // SHAPE_FLAG_SHIFT = VALUE bits - SHAPE_ID_NUM_BITS and INVALID_SHAPE_ID =
                // SHAPE_MASK = (1 << SHAPE_ID_NUM_BITS) - 1.
                let id_bits = 8 * size_of::<r::shape_id_t>() as u32;
                l.dec("shape_flag_shift", 8 * size_of::<r::VALUE>() as u32 - id_bits);
                l.dec("shape_size", size_of::<Shape>());
                l.dec("shape_edge_name", offset_of!(Shape, edge_name));
                l.dec("shape_next_iv_index", offset_of!(Shape, next_iv_index));
                l.dec("shape_type", offset_of!(Shape, type_));
                l.dec("shape_parent_id", offset_of!(Shape, parent_id));
                l.transcribed("shape_type_ivar", Val::Dec(SHAPE_IVAR), FROM_SHAPE_H);
                l.hex("shape_invalid_id", (1u64 << id_bits) - 1);
            });
        } else {
            shapes_unused(&mut l);
        });
        l.dec("st_table_entries_start", offset_of!(r::st_table, entries_start));
        l.dec("st_table_entries_start_size", field_size(|t: &r::st_table| &t.entries_start));
        l.dec("st_table_entries_bound", offset_of!(r::st_table, entries_bound));
        l.dec("st_table_entries", offset_of!(r::st_table, entries));
        l.copied("st_table_entry_size", Val::Dec(size_of::<StTableEntry>() as u64), FROM_ST_C);
        l.copied("st_table_entry_key", Val::Dec(offset_of!(StTableEntry, key) as u64), FROM_ST_C);
        l.copied(
            "st_table_entry_record",
            Val::Dec(offset_of!(StTableEntry, record) as u64),
            FROM_ST_C,
        );

        // Symbols.
        since!($rv >= 400 {
            type Symbols = SymbolsWithSymSet;
            let from = FROM_SYMBOL_C_4_0;
            l.copied("symbols_last_id", Val::Dec(offset_of!(Symbols, next_id) as u64), from);
            l.copied("symbols_ids", Val::Dec(offset_of!(Symbols, ids) as u64), from);
            l.copied("symbols_size", Val::Dec(size_of::<Symbols>() as u64), from);
        } else {
            type Symbols = SymbolsWithStSym;
            let from = FROM_SYMBOL_H;
            l.copied("symbols_last_id", Val::Dec(offset_of!(Symbols, last_id) as u64), from);
            l.copied("symbols_ids", Val::Dec(offset_of!(Symbols, ids) as u64), from);
            l.copied("symbols_size", Val::Dec(size_of::<Symbols>() as u64), from);
        });
        l.dec("id_scope_shift", r::ruby_id_types_RUBY_ID_SCOPE_SHIFT as u64);
        l.dec("last_op_id", r::ruby_method_ids_tLAST_OP_ID as u64);
        l.copied("id_entry_unit", Val::Dec(ID_ENTRY_UNIT), FROM_SYMBOL_C);
        l.copied("id_entry_size", Val::Dec(ID_ENTRY_SIZE), FROM_SYMBOL_C);
        // Chunks of `ids` are Arrays before 4.1 (which no crate release is).
        l.copied("id_chunk_data", Val::None, FROM_SYMBOL_C);
        l.copied("id_chunk_header", Val::Dec(0), FROM_SYMBOL_C);
        l.copied("id_entry_str", Val::Dec(0), FROM_SYMBOL_C);
        l.copied("id_dir", Val::None, FROM_SYMBOL_C);
        l
    }};
}

/// "ruby_3_2_9" -> "3.2.9".
fn release_of(module: &str) -> String {
    module.trim_start_matches("ruby_").replace('_', ".")
}

/// `(release, layout function)` for every release listed, grouped by RV.
macro_rules! releases {
    ($($rv:tt: $($m:ident)*;)*) => {
        /// Every release this program knows, as "3.2.9", with the function measuring it.
        pub static RELEASES: &[(&str, fn() -> Layout)] = &[
            $($((
                // stringify! cannot give "3.2.9"; main() maps names through release_of.
                stringify!($m),
                {
                    fn measure() -> Layout {
                        layout!($m, $rv)
                    }
                    measure
                },
            ),)*)*
        ];
    };
}

// Every 2.7-4.0 release rbspy-ruby-structs 0.55.0 has bindings for.
releases! {
    207: ruby_2_7_0 ruby_2_7_1 ruby_2_7_2 ruby_2_7_3 ruby_2_7_4 ruby_2_7_5 ruby_2_7_6 ruby_2_7_7
         ruby_2_7_8;
    300: ruby_3_0_0 ruby_3_0_1 ruby_3_0_2 ruby_3_0_3 ruby_3_0_4 ruby_3_0_5 ruby_3_0_6 ruby_3_0_7;
    301: ruby_3_1_0 ruby_3_1_1 ruby_3_1_2 ruby_3_1_3 ruby_3_1_4 ruby_3_1_5 ruby_3_1_6 ruby_3_1_7;
    302: ruby_3_2_0 ruby_3_2_1 ruby_3_2_2 ruby_3_2_3 ruby_3_2_4 ruby_3_2_5 ruby_3_2_6 ruby_3_2_7
         ruby_3_2_8 ruby_3_2_9 ruby_3_2_10 ruby_3_2_11;
    303: ruby_3_3_0 ruby_3_3_1 ruby_3_3_2 ruby_3_3_3 ruby_3_3_4 ruby_3_3_5 ruby_3_3_6 ruby_3_3_7
         ruby_3_3_8 ruby_3_3_9 ruby_3_3_10 ruby_3_3_11 ruby_3_3_12 ruby_3_3_13;
    304: ruby_3_4_0 ruby_3_4_1 ruby_3_4_2 ruby_3_4_3 ruby_3_4_4 ruby_3_4_5 ruby_3_4_6 ruby_3_4_7
         ruby_3_4_8 ruby_3_4_9 ruby_3_4_10 ruby_3_4_11 ruby_3_4_12;
    400: ruby_4_0_0 ruby_4_0_1 ruby_4_0_2 ruby_4_0_3 ruby_4_0_4 ruby_4_0_5 ruby_4_0_6 ruby_4_0_7
         ruby_4_0_8 ruby_4_0_9;
}

/// The layout of `release` ("3.2.9"), if the crate has it.
pub fn measure(release: &str) -> Option<Layout> {
    RELEASES
        .iter()
        .find(|(module, _)| release_of(module) == release)
        .map(|(_, measure)| measure())
}

pub fn known_releases() -> impl Iterator<Item = String> {
    RELEASES.iter().map(|(module, _)| release_of(module))
}

/// The size of the field `f` picks out of a `T`, for fields whose width changed between
/// releases (offset_of! gives only where they start).
fn field_size<T, F>(_f: fn(&T) -> &F) -> usize {
    std::mem::size_of::<F>()
}
