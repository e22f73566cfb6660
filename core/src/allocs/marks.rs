//! Where an object's mark bit is, for the allocation tracker's liveness check: at the end of
//! a GC's marking, before its sweep, a sampled object is alive exactly when it is marked.
//! The tracker runs inside the profiled process and reads its own memory; the layout is the
//! census's (`rbspy_ext_bindings::HeapLayout`, measured from each release's gc.c), so the
//! rule lives here, Ruby-free and tested, and the memory is read by the caller.
use rbspy_ext_bindings::{heap_layout_for_version, HeapLayout};

/// Built-in types of a slot that holds no object (`flags & 0x1f`): T_NONE, T_ZOMBIE, T_MOVED.
const NOT_AN_OBJECT: [u8; 3] = [0x00, 0x1d, 0x1e];

/// The fields of a release's heap layout the mark bit needs.
#[derive(Debug, Clone, Copy)]
pub struct MarkBits {
    page_align: u64,
    page_start: u64,
    page_slot_size: Option<u64>,
    page_mark_bits: u64,
    base_slot_size: u64,
    bitmap_by_index: bool,
}

/// An answer that needed a read which failed: the address is not mapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unreadable;

impl MarkBits {
    /// The layout of Ruby `version` (`RUBY_VERSION`), when the census knows it.
    pub fn for_version(version: &str) -> Option<Self> {
        heap_layout_for_version(version).map(Self::new)
    }

    pub fn new(h: &HeapLayout) -> Self {
        MarkBits {
            page_align: h.page_align as u64,
            page_start: h.page_start as u64,
            page_slot_size: h.page_slot_size.map(|o| o as u64),
            page_mark_bits: h.page_mark_bits as u64,
            base_slot_size: h.base_slot_size as u64,
            bitmap_by_index: h.bitmap_by_index,
        }
    }

    /// Whether the object sampled at `object` with type `type_id` is still there after the
    /// marking that just ended: its slot holds an object of the same type, and it is marked.
    /// `word` reads 8 bytes of this process at an address; `short` 2 bytes.
    ///
    /// Every release keeps a page's `struct heap_page *` in the first word of the aligned
    /// block its slots are in; its mark bitmap has a bit per base slot size from that block's
    /// start, or (4.1) per slot from the page's first slot.
    pub fn alive(
        &self,
        object: u64,
        type_id: u8,
        word: impl Fn(u64) -> Result<u64, Unreadable>,
        short: impl Fn(u64) -> Result<u16, Unreadable>,
    ) -> Result<bool, Unreadable> {
        let t = (word(object)? & 0x1f) as u8;
        if NOT_AN_OBJECT.contains(&t) || t != type_id {
            // Freed, or (2.7 and 3.0's rb_gc_force_recycle) its slot reused by another type.
            return Ok(false);
        }
        let block = object & !(self.page_align - 1);
        let page = word(block)?;
        let bit = if self.bitmap_by_index {
            let start = word(page + self.page_start)?;
            let slot_size = match self.page_slot_size {
                Some(at) => short(page + at)? as u64,
                None => self.base_slot_size,
            };
            object.wrapping_sub(start) / slot_size.max(1)
        } else {
            (object - block) / self.base_slot_size
        };
        let bits = word(page + self.page_mark_bits + bit / 64 * 8)?;
        Ok(bits & (1 << (bit % 64)) != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A fake memory of words and shorts at addresses.
    struct Mem(HashMap<u64, u64>);

    impl Mem {
        fn word(&self, at: u64) -> Result<u64, Unreadable> {
            self.0.get(&at).copied().ok_or(Unreadable)
        }
        fn short(&self, at: u64) -> Result<u16, Unreadable> {
            self.word(at).map(|w| w as u16)
        }
    }

    fn layout(by_index: bool) -> MarkBits {
        MarkBits {
            page_align: 0x1_0000,
            page_start: 8,
            page_slot_size: Some(16),
            page_mark_bits: 32,
            base_slot_size: 40,
            bitmap_by_index: by_index,
        }
    }

    const T_STRING: u64 = 0x05;

    #[test]
    fn reads_the_bit_by_address_within_the_block() {
        let block = 0x7f00_0001_0000;
        let page = 0x5000;
        // The 70th base slot from the block's start: word 1, bit 6.
        let object = block + 70 * 40;
        let mut m = HashMap::from([(object, T_STRING), (block, page)]);
        m.insert(page + 32 + 8, 1 << 6);
        let mem = Mem(m);
        let alive = |t| layout(false).alive(object, t, |a| mem.word(a), |a| mem.short(a));
        assert_eq!(alive(0x05), Ok(true));
        // Another type in the slot: not the object sampled.
        assert_eq!(alive(0x07), Ok(false));
    }

    #[test]
    fn reads_the_bit_by_index_from_the_first_slot() {
        let block = 0x7f00_0002_0000;
        let page = 0x6000;
        let start = block + 24;
        let object = start + 3 * 80;
        let mut m = HashMap::from([(object, T_STRING), (block, page)]);
        m.insert(page + 8, start);
        m.insert(page + 16, 80);
        m.insert(page + 32, 0b0111);
        let mem = Mem(m.clone());
        let by_index = layout(true);
        assert_eq!(
            by_index.alive(object, 0x05, |a| mem.word(a), |a| mem.short(a)),
            Ok(false)
        );
        m.insert(page + 32, 0b1000);
        let mem = Mem(m);
        assert_eq!(
            by_index.alive(object, 0x05, |a| mem.word(a), |a| mem.short(a)),
            Ok(true)
        );
    }

    #[test]
    fn a_freed_slot_or_an_unmapped_page_is_no_live_object() {
        let block = 0x7f00_0003_0000;
        let object = block + 40;
        let freed = Mem(HashMap::from([(object, 0)]));
        let l = layout(false);
        assert_eq!(
            l.alive(object, 0, |a| freed.word(a), |a| freed.short(a)),
            Ok(false)
        );
        let unmapped = Mem(HashMap::from([(object, T_STRING)]));
        assert_eq!(
            l.alive(object, 0x05, |a| unmapped.word(a), |a| unmapped.short(a)),
            Err(Unreadable)
        );
    }

    #[test]
    fn every_release_the_census_reads_has_its_mark_bits() {
        for v in [
            "2.7.4", "3.0.7", "3.1.2", "3.2.11", "3.3.8", "3.4.11", "4.0.2", "4.1.0",
        ] {
            assert!(MarkBits::for_version(v).is_some(), "{v}");
        }
    }
}
