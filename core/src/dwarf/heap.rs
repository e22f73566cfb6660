//! The heap census's `HeapLayout` from a Ruby's own types: the fields that are members of
//! gc.c's private structs (the objspace, its heaps, a heap page and its flags) and of the
//! object structs, read from the DWARF over the series' measured layout. What gc.c and
//! string.c keep as `#define`s (HEAP_PAGE_ALIGN, STR_SHARED, the shape id masks...) has no
//! type to read and stays the series'. The allocation tracker's counter words
//! (`allocated`) are among the fields read: it attaches to its own process, whose binary
//! carries the DWARF too.

use super::rules::bits_of;
use super::types::{Member, TypeError, Types};
use rbspy_ext_bindings::{Field, FieldValue, HeapLayout};

type Result<T> = std::result::Result<T, TypeError>;

const OBJSPACE: &str = "struct rb_objspace";
const PAGE: &str = "struct heap_page";

/// Types only the heap reads, for the index's list of names.
pub const NAMES: &[&str] = &[
    OBJSPACE,
    PAGE,
    "rb_heap_t",
    "rb_size_pool_t",
    "struct RHash",
    "struct RString",
    "struct RArray",
];

type Get = fn(&HeapLayout) -> FieldValue;
type Set = fn(&mut HeapLayout, FieldValue) -> Option<()>;

macro_rules! overlaid {
    ($($name:literal => $($field:ident).+),* $(,)?) => {
        /// The fields read from the DWARF, by name, with how to get and set each.
        const OVERLAID: &[(&str, Get, Set)] = &[$(
            ($name, |h| Field::value(&h.$($field).+), |h, v| {
                h.$($field).+ = Field::from_value(v)?;
                Some(())
            }),
        )*];
    };
}

overlaid! {
    "sorted" => sorted,
    "allocated_pages" => allocated_pages,
    "darray" => darray,
    "page_start" => page_start,
    "page_total_slots" => page_total_slots,
    "page_free_slots" => page_free_slots,
    "page_final_slots" => page_final_slots,
    "page_slot_size" => page_slot_size,
    "page_mark_bits" => page_mark_bits,
    "page_mark_bits_len" => page_mark_bits_len,
    "page_before_sweep" => page_before_sweep,
    "page_in_tomb" => page_in_tomb,
    "compact_count" => compact_count,
    "during_compacting" => during_compacting,
    "allocated.at" => allocated.at,
    "allocated.stride" => allocated.stride,
    "allocated.count" => allocated.count,
    "rstring_capa" => rstring_capa,
    "rarray_capa" => rarray_capa,
    "hash_st_inline" => hash_st_inline,
    "hash_st_ptr" => hash_st_ptr,
    "st_table_size" => st_table_size,
    "st_entry_power" => st_entry_power,
    "st_bins" => st_bins,
    "class_super" => class_super,
    "class_super_in_ext" => class_super_in_ext,
}

/// `table` (the series' measured heap layout) with every overlaid field read from `types`.
/// A field the series has not (None there) stays None.
pub fn overlay(types: &Types, table: &HeapLayout) -> Result<HeapLayout> {
    let r = Reader { types };
    let mut h = *table;
    h.sorted = r.off(OBJSPACE, "heap_pages.sorted")?;
    if table.allocated_pages.is_some() {
        h.allocated_pages = Some(r.off(OBJSPACE, "heap_pages.allocated_pages")?);
    }
    if table.darray.is_some() {
        h.darray = Some((
            r.off("rb_darray_meta_t", "size")?,
            r.size("rb_darray_meta_t")?,
        ));
    }
    h.page_start = r.off(PAGE, "start")?;
    h.page_total_slots = r.off(PAGE, "total_slots")?;
    h.page_free_slots = r.off(PAGE, "free_slots")?;
    h.page_final_slots = r.off(PAGE, "final_slots")?;
    if table.page_slot_size.is_some() {
        h.page_slot_size = Some(r.off(PAGE, "slot_size")?);
    }
    let marks = r.member(PAGE, "mark_bits")?;
    (h.page_mark_bits, h.page_mark_bits_len) = (marks.offset as usize, marks.size as usize);
    h.page_before_sweep = r.bits(PAGE, "flags.before_sweep")?;
    if table.page_in_tomb.is_some() {
        h.page_in_tomb = Some(r.bits(PAGE, "flags.in_tomb")?);
    }
    h.compact_count = r.off(OBJSPACE, "profile.compact_count")?;
    h.during_compacting = r.bits(OBJSPACE, "flags.during_compacting")?;
    (h.allocated.at, h.allocated.stride, h.allocated.count) = r.allocated()?;
    h.rstring_capa = r.off("struct RString", "as.heap.aux.capa")?;
    h.rarray_capa = r.off("struct RArray", "as.heap.aux.capa")?;
    if table.hash_st_inline.is_some() {
        h.hash_st_inline = Some(r.size("struct RHash")?);
    }
    if table.hash_st_ptr.is_some() {
        h.hash_st_ptr = Some(r.off("struct RHash", "as.st")?);
    }
    h.st_table_size = r.size("st_table")?;
    h.st_entry_power = r.off("st_table", "entry_power")?;
    if table.st_bins.is_some() {
        h.st_bins = Some(r.off("st_table", "bins")?);
    }
    if table.class_super.is_some() {
        h.class_super = Some(r.off("struct RClass", "super")?);
    }
    if table.class_super_in_ext.is_some() {
        h.class_super_in_ext = Some(r.off("rb_classext_t", "super")?);
    }
    Ok(h)
}

/// The overlaid fields where `a` and `b` differ.
pub fn differences(a: &HeapLayout, b: &HeapLayout) -> Vec<&'static str> {
    (OVERLAID.iter())
        .filter(|(_, get, _)| get(a) != get(b))
        .map(|(name, _, _)| *name)
        .collect()
}

/// The overlaid fields' values, for the layout cache.
pub fn values(h: &HeapLayout) -> Vec<(&'static str, FieldValue)> {
    OVERLAID
        .iter()
        .map(|(name, get, _)| (*name, get(h)))
        .collect()
}

/// `table` with the overlaid fields `value` gives, None when one is missing or misfits.
pub fn with_values(
    table: &HeapLayout,
    value: impl Fn(&str) -> Option<FieldValue>,
) -> Option<HeapLayout> {
    let mut h = *table;
    for (name, _, set) in OVERLAID {
        set(&mut h, value(name)?)?;
    }
    Some(h)
}

struct Reader<'t, 'a> {
    types: &'t Types<'a>,
}

impl Reader<'_, '_> {
    fn member(&self, ty: &str, path: &str) -> Result<Member> {
        self.types
            .member(ty, path)?
            .ok_or_else(|| TypeError::Missing(format!("{ty}.{path}, for the heap census")))
    }

    fn off(&self, ty: &str, path: &str) -> Result<usize> {
        Ok(self.member(ty, path)?.offset as usize)
    }

    fn size(&self, ty: &str) -> Result<usize> {
        let size = self.types.size_of(ty)?;
        size.map(|s| s as usize)
            .ok_or_else(|| TypeError::Missing(format!("{ty}, for the heap census")))
    }

    fn bits(&self, ty: &str, path: &str) -> Result<(usize, u8)> {
        match bits_of(self.member(ty, path)?) {
            Some(FieldValue::Pair(byte, mask)) => Ok((byte as usize, mask as u8)),
            _ => Err(TypeError::Corrupt(format!(
                "{ty}.{path}: not a bitfield within one byte"
            ))),
        }
    }

    /// (at, stride, count) of `GC.stat(:total_allocated_objects)`'s words: one per heap
    /// (3.4+: `heaps[HEAP_COUNT]`), per size pool (3.3), or one (`total_allocated_objects`).
    fn allocated(&self) -> Result<(usize, usize, usize)> {
        for (array, element) in [("heaps", "rb_heap_t"), ("size_pools", "rb_size_pool_t")] {
            let (Some(pools), Some(counter)) = (
                self.types.member(OBJSPACE, array)?,
                self.types.member(element, "total_allocated_objects")?,
            ) else {
                continue;
            };
            let count = pools
                .count
                .ok_or_else(|| TypeError::Corrupt(format!("{OBJSPACE}.{array} has no bound")))?;
            return Ok((
                (pools.offset + counter.offset) as usize,
                self.size(element)?,
                count as usize,
            ));
        }
        Ok((self.off(OBJSPACE, "total_allocated_objects")?, 0, 1))
    }
}
