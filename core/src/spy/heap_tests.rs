//! Unit tests of the heap census (spy/heap.rs): page headers and st_table bytes, on memory
//! images and the generated 3.3 layouts.
use super::*;
use crate::memory::MemoryImage;
use rbspy_ext_bindings::layout_for_version;

fn layouts() -> (&'static Layout, &'static HeapLayout) {
    let l = layout_for_version("3.3.8").expect("3.3 layout");
    (
        l,
        heap_layout_for_version("3.3.8").expect("3.3 heap layout"),
    )
}

/// A page header of `slots` slots of `size` bytes from `start`.
fn header(h: &HeapLayout, start: u64, slots: u16, size: u16) -> Vec<u8> {
    let mut bytes = vec![0u8; h.page_mark_bits + h.page_mark_bits_len];
    bytes[h.page_start..h.page_start + 8].copy_from_slice(&start.to_le_bytes());
    bytes[h.page_total_slots..h.page_total_slots + 2].copy_from_slice(&slots.to_le_bytes());
    let at = h.page_slot_size.expect("3.3 has slot sizes");
    bytes[at..at + 2].copy_from_slice(&size.to_le_bytes());
    bytes
}

#[test]
fn a_page_header_that_leaves_its_block_or_does_not_read_is_unreadable_and_not_followed() {
    let (_, h) = layouts();
    let block = 0x10_0000u64;
    let mut mem = MemoryImage::new();
    mem.map(0x1000, header(h, block + 64, 100, 40)); // fits in its 64 KiB block
    mem.map(0x2000, header(h, block + 64, 2000, 40)); // 80,000 bytes: past the block
    mem.map(0x3000, header(h, 0, 0, 0)); // emptied (3.4+) or never used: skipped
    let mut census = Census::default();
    let pages = read_headers(
        &mem,
        h,
        false,
        &[0x1000, 0x2000, 0x3000, 0x4000],
        &mut census,
    );
    assert_eq!(pages.len(), 1);
    assert_eq!(
        (pages[0].start, pages[0].slots, pages[0].slot_size),
        (block + 64, 100, 40)
    );
    assert_eq!(census.unreadable_pages, 2); // 0x2000 nonsense, 0x4000 unmapped
}

#[test]
fn st_tables_count_their_entries_and_bins_as_st_memsize_does() {
    let (l, h) = layouts();
    let count = Count {
        l,
        h,
        census: Census::default(),
        by_class: FxHashMap::default(),
        tables: Vec::new(),
    };
    let table = |power: u8, bins: u64| {
        let mut t = vec![0u8; h.st_table_size];
        t[h.st_entry_power] = power;
        let at = h.st_bins.expect("3.3 has a bins pointer");
        t[at..at + 8].copy_from_slice(&bins.to_le_bytes());
        t
    };
    let header = h.st_table_size as u64;
    // 100 entries: 2^7 of 24 bytes, and 2^8 one-byte bins (st.c's features[7]: 0x20 words).
    assert_eq!(
        count.st_bytes(&table(7, 0xdead_0000)),
        header + 128 * 24 + 0x20 * 8
    );
    // 12 entries from a literal: 2^4 entries, bins only if the table has them.
    assert_eq!(count.st_bytes(&table(4, 0)), header + 16 * 24);
    assert_eq!(
        count.st_bytes(&table(4, 0xdead_0000)),
        header + 16 * 24 + 4 * 8
    );
    // 2^9 entries: 2^10 two-byte bins (features[9]: 0x100 words).
    assert_eq!(
        count.st_bytes(&table(9, 0xdead_0000)),
        header + 512 * 24 + 0x100 * 8
    );
}
