/*
 * The GC heap's layout for the heap census (core/src/census/walk.rs), measured from one Ruby
 * release's own gc.c. Everything the census reads is private to gc.c (gc/default/default.c
 * from 3.4, which gc.c includes): rb_objspace_t, struct heap_page, the page and slot sizes.
 * So this unit includes gc.c itself, compiled as the build compiled it (RUBY_EXPORT, the
 * tree's headers and the release's configured config.h), and is never linked or run:
 *
 *   - each value is the size of an array, `char rbspy_heap_NAME[value + 1]`, which
 *     script/generate-bindings reads back with `nm -S` (+1 so that 0 still makes a symbol);
 *   - a bitfield has no offsetof, so each flag the census tests is a `struct heap_page`
 *     with only that bit set, in a section of its own, whose bytes the script dumps to find
 *     the byte and mask.
 *
 * The script passes what only string.c, array.c and st.c define: PROBE_STR_NOFREE and
 * PROBE_ARY_SHARED_ROOT (FL_USERn), PROBE_ST_BINS_ABOVE (MAX_POWER2_FOR_TABLES_WITHOUT_BINS).
 */
#include "gc.c"
#undef heaps
#undef size_pools
#include "ruby/version.h"

#define API (RUBY_API_VERSION_MAJOR * 100 + RUBY_API_VERSION_MINOR)
#define VALUE_OF(name, expr) char rbspy_heap_##name[(expr) + 1];

/* The census names types from value_type.h's numbering, which has not changed since 2.0:
 * stop here if it ever does. */
_Static_assert(T_NONE == 0x00 && T_OBJECT == 0x01 && T_CLASS == 0x02 && T_MODULE == 0x03 &&
                   T_FLOAT == 0x04 && T_STRING == 0x05 && T_REGEXP == 0x06 &&
                   T_ARRAY == 0x07 && T_HASH == 0x08 && T_STRUCT == 0x09 &&
                   T_BIGNUM == 0x0a && T_FILE == 0x0b && T_DATA == 0x0c &&
                   T_MATCH == 0x0d && T_COMPLEX == 0x0e && T_RATIONAL == 0x0f &&
                   T_SYMBOL == 0x14 && T_IMEMO == 0x1a && T_NODE == 0x1b &&
                   T_ICLASS == 0x1c && T_ZOMBIE == 0x1d && T_MOVED == 0x1e && T_MASK == 0x1f,
               "enum ruby_value_type changed: update core/src/census/walk.rs's type names");
_Static_assert(sizeof(bits_t) == 8, "mark bitmaps of 64-bit words");
_Static_assert(sizeof(((struct heap_page *)0)->total_slots) == 2, "16-bit slot counts");

/* Pages: every page is in objspace->heap_pages.sorted, an array of struct heap_page *
 * (from 3.4 an rb_darray: a pointer to {size, capa, data[]}). */
VALUE_OF(sorted, offsetof(rb_objspace_t, heap_pages.sorted))
#if API >= 304
VALUE_OF(darray_size, offsetof(rb_darray_meta_t, size))
VALUE_OF(darray_data, sizeof(rb_darray_meta_t))
#else
VALUE_OF(allocated_pages, offsetof(rb_objspace_t, heap_pages.allocated_pages))
#endif
VALUE_OF(page_align, HEAP_PAGE_ALIGN)
VALUE_OF(page_start, offsetof(struct heap_page, start))
VALUE_OF(page_total_slots, offsetof(struct heap_page, total_slots))
VALUE_OF(page_free_slots, offsetof(struct heap_page, free_slots))
VALUE_OF(page_final_slots, offsetof(struct heap_page, final_slots))
VALUE_OF(page_mark_bits, offsetof(struct heap_page, mark_bits))
VALUE_OF(page_mark_bits_len, sizeof(((struct heap_page *)0)->mark_bits))
VALUE_OF(page_header_size, sizeof(struct heap_page))
#if API >= 301
VALUE_OF(page_slot_size, offsetof(struct heap_page, slot_size))
#endif

/* A slot's bit in a page's bitmaps: its address within the page body over a base slot
 * size, or (4.1) its index from the page's start. */
#if defined(SLOT_RECIPROCAL_SHIFT)
VALUE_OF(bitmap_by_index, 1)
VALUE_OF(base_slot_size, RVALUE_SLOT_SIZE)
#elif defined(BASE_SLOT_SIZE)
VALUE_OF(base_slot_size, BASE_SLOT_SIZE)
#else
VALUE_OF(base_slot_size, sizeof(RVALUE))
#endif

VALUE_OF(gc_mode_sweeping, gc_mode_sweeping)
/* Compactions so far: a census during which it changes read objects that moved. */
VALUE_OF(compact_count, offsetof(rb_objspace_t, profile.compact_count))

/* Objects allocated so far (GC.stat's total_allocated_objects): one counter before 3.3, then
 * one per size pool (3.3) or heap (3.4+), summed. The allocation tracker reads them in its own
 * process, with no call into Ruby, to see a sample point coming
 * (ext/rbspy_ext/src/tracker/arming.rs). 4.0 adds a Ractor's allocations to them only every
 * ALLOCATED_COUNT_STEP of a heap, and keeps the rest in the Ractor's newobj cache
 * (`r->newobj_cache`, per heap), which GC.stat adds first: those are measured too. */
#if API >= 304
VALUE_OF(allocated_at, offsetof(rb_objspace_t, heaps) + offsetof(rb_heap_t, total_allocated_objects))
VALUE_OF(allocated_stride, sizeof(rb_heap_t))
VALUE_OF(allocated_count, HEAP_COUNT)
#elif API >= 303
VALUE_OF(allocated_at,
         offsetof(rb_objspace_t, size_pools) + offsetof(rb_size_pool_t, total_allocated_objects))
VALUE_OF(allocated_stride, sizeof(rb_size_pool_t))
VALUE_OF(allocated_count, SIZE_POOL_COUNT)
#else
VALUE_OF(allocated_at, offsetof(rb_objspace_t, total_allocated_objects))
VALUE_OF(allocated_stride, 0)
VALUE_OF(allocated_count, 1)
#endif
#if API == 400
VALUE_OF(pending_cache, offsetof(rb_ractor_t, newobj_cache))
VALUE_OF(pending_at, offsetof(rb_ractor_newobj_cache_t, heap_caches) +
                         offsetof(rb_ractor_newobj_heap_cache_t, allocated_objects_count))
VALUE_OF(pending_stride, sizeof(rb_ractor_newobj_heap_cache_t))
#endif

/* Bytes outside the slot (what ObjectSpace.memsize_of adds to the slot). */
VALUE_OF(str_shared, STR_SHARED)
VALUE_OF(str_nofree, PROBE_STR_NOFREE)
VALUE_OF(rstring_capa, offsetof(struct RString, as.heap.aux.capa))
VALUE_OF(ary_shared, ELTS_SHARED)
VALUE_OF(ary_shared_root, PROBE_ARY_SHARED_ROOT)
VALUE_OF(rarray_capa, offsetof(struct RArray, as.heap.aux.capa))
VALUE_OF(hash_st_flag, RHASH_ST_TABLE_FLAG)
#if API >= 303
/* The st_table lives in the slot, right after struct RHash. */
VALUE_OF(hash_st_inline, sizeof(struct RHash))
#else
VALUE_OF(hash_st_ptr, offsetof(struct RHash, as.st))
/* hash.c's ar_table, `ar_table_pair pairs[RHASH_AR_TABLE_MAX_SIZE]` of a key and a value
 * each (the script checks the definition). */
VALUE_OF(ar_table_size, RHASH_AR_TABLE_MAX_SIZE * 2 * sizeof(VALUE))
#endif
VALUE_OF(st_table_size, sizeof(st_table))
VALUE_OF(st_entry_power, offsetof(st_table, entry_power))
/* st.c: a table has bins (see core/src/census/walk.rs) when its `bins` pointer is set (up to
 * 4.0), or (4.1, which has no such pointer) when its entry power is above this. */
VALUE_OF(st_bins_above_power, PROBE_ST_BINS_ABOVE)
#if API < 401
VALUE_OF(st_bins, offsetof(st_table, bins))
#endif
#if API < 302
/* An object's ivars out of its slot: ROBJECT_EMBED clear, numiv of them. */
VALUE_OF(robject_embed, ROBJECT_EMBED)
VALUE_OF(robject_numiv, offsetof(struct RObject, as.heap.numiv))
#else
/* From 3.2 an object's shape says how many ivars its buffer out of the slot holds (its
 * capacity), or that the ivars are an st_table (a too-complex shape). The shape id is the
 * flags' top bits; the shape is an element of the shape list. */
VALUE_OF(shape_id_shift, SHAPE_FLAG_SHIFT)
VALUE_OF(shape_size, sizeof(rb_shape_t))
VALUE_OF(shape_capacity, offsetof(rb_shape_t, capacity))
VALUE_OF(shape_capacity_width, sizeof(((rb_shape_t *)0)->capacity))
#if API >= 400 && !defined(ROBJECT_HEAP)
/* Master of 2026-08: an object whose ivars left its slot points (as.extended) at an
 * imemo_fields object of its own, which the census counts as a T_IMEMO like
 * ObjectSpace.memsize_of does (a T_OBJECT's memsize is its slot alone). A complex
 * fields object embeds its st_table at as.complex.table, whose memsize beyond
 * sizeof(st_table) is the imemo's. */
VALUE_OF(robject_extended, offsetof(struct RObject, as.extended))
VALUE_OF(shape_layout_mask, SHAPE_ID_LAYOUT_MASK)
VALUE_OF(shape_layout_extended, SHAPE_ID_LAYOUT_EXTENDED)
VALUE_OF(shape_capacity_mask, SHAPE_ID_CAPACITY_MASK)
VALUE_OF(shape_index_mask, SHAPE_ID_OFFSET_MASK)
VALUE_OF(too_complex_flag, SHAPE_ID_FL_COMPLEX)
VALUE_OF(imemo_fields, imemo_fields)
VALUE_OF(imemo_type_shift, FL_USHIFT)
VALUE_OF(imemo_type_mask, IMEMO_MASK)
VALUE_OF(fields_complex_table, offsetof(struct rb_fields, as.complex.table))
VALUE_OF(tree_shape_list, offsetof(rb_shape_tree_t, shape_list))
/* Each Ractor owns an objspace; the VM-global page index lists every objspace's pages. */
VALUE_OF(page_objspace, offsetof(struct heap_page, objspace))
VALUE_OF(global_page_index, offsetof(rb_global_objspace_t, page_index.pages))
VALUE_OF(global_page_count, offsetof(rb_global_objspace_t, page_index.n_pages))
VALUE_OF(vm_zombie_objspaces, offsetof(rb_vm_t, gc.zombie_objspaces))
VALUE_OF(vm_zombie_objspaces_count, offsetof(rb_vm_t, gc.zombie_objspaces_count))
VALUE_OF(zombie_objspace_size, sizeof(struct rb_objspace_zombie))
VALUE_OF(zombie_objspace_owner, offsetof(struct rb_objspace_zombie, owner))
VALUE_OF(ractor_creating_child_objspace, offsetof(rb_ractor_t, creating_child_objspace))
#elif API >= 400
VALUE_OF(robject_heap_flag, ROBJECT_HEAP)
VALUE_OF(robject_fields, offsetof(struct RObject, as.heap.fields))
VALUE_OF(shape_index_mask, SHAPE_ID_OFFSET_MASK)
VALUE_OF(shape_heap_index_mask, SHAPE_ID_HEAP_INDEX_MASK)
VALUE_OF(shape_heap_index_shift, SHAPE_ID_HEAP_INDEX_OFFSET)
VALUE_OF(tree_shape_list, offsetof(rb_shape_tree_t, shape_list))
VALUE_OF(tree_capacities, offsetof(rb_shape_tree_t, capacities))
#if API >= 401
VALUE_OF(too_complex_flag, SHAPE_ID_FL_COMPLEX)
VALUE_OF(capacities_inline, 1)
#else
VALUE_OF(too_complex_flag, SHAPE_ID_FL_TOO_COMPLEX)
#endif
#else
VALUE_OF(robject_embed_flag, ROBJECT_EMBED)
VALUE_OF(robject_fields, offsetof(struct RObject, as.heap.ivptr))
VALUE_OF(too_complex_id, OBJ_TOO_COMPLEX_SHAPE_ID)
#if API >= 303
VALUE_OF(tree_shape_list, offsetof(rb_shape_tree_t, shape_list))
VALUE_OF(tree_root_shape, offsetof(rb_shape_tree_t, root_shape))
VALUE_OF(tree_next_shape_id, offsetof(rb_shape_tree_t, next_shape_id))
VALUE_OF(shape_parent_id, offsetof(rb_shape_t, parent_id))
#else
VALUE_OF(vm_shape_list, offsetof(rb_vm_t, shape_list))
#endif
#endif
#endif

/* A class's superclass, for an object whose class is its singleton class: in struct RClass
 * before 4.0, in the class's (prime) classext from 4.0. */
#if API >= 400
VALUE_OF(class_super_in_ext, offsetof(rb_classext_t, super))
#else
VALUE_OF(class_super, offsetof(struct RClass, super))
#endif

/* Images of struct heap_page with one flag set: the script finds the bit. */
#define FLAG_IMAGE(name, member)                                                          \
    struct heap_page rbspy_heap_flag_##name __attribute__((section(".rbspy_" #name))) = { \
        .flags = {.member = 1}};
FLAG_IMAGE(before_sweep, before_sweep)
#undef during_gc
rb_objspace_t rbspy_heap_flag_during_gc __attribute__((section(".rbspy_during_gc"))) = {.flags = {.during_gc = 1}};
#if API >= 400 && !defined(ROBJECT_HEAP)
rb_objspace_t rbspy_heap_flag_during_global_gc __attribute__((section(".rbspy_during_global_gc"))) = {.flags = {.during_global_gc = 1}};
#endif
rb_objspace_t rbspy_heap_flag_during_compacting
    __attribute__((section(".rbspy_during_compacting"))) = {.flags = {.during_compacting = 1}};
#if API < 304
FLAG_IMAGE(in_tomb, in_tomb)
#endif
