//! Unit tests of the heap census (walk.rs, pages.rs, shapes.rs): page headers, st_table
//! bytes and shapes, on memory images and the generated 3.3 layouts.
use super::pages::{self, page_list_read, read_headers};
use super::shapes::{shape_source, Ivars};
use super::walk::Count;
use super::T_OBJECT;
use super::{Census, ClassRow};
use crate::memory::MemoryImage;
use crate::spy::Spy;
use rbspy_ext_bindings::ShapeList;
use rbspy_ext_bindings::{heap_layout_for_version, layout_for_version, HeapLayout, Layout};

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
    let count = Count::new(l, h, Census::default());
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
        Some(header + 128 * 24 + 0x20 * 8)
    );
    // 12 entries from a literal: 2^4 entries, bins only if the table has them.
    assert_eq!(count.st_bytes(&table(4, 0)), Some(header + 16 * 24));
    assert_eq!(
        count.st_bytes(&table(4, 0xdead_0000)),
        Some(header + 16 * 24 + 4 * 8)
    );
    // 2^9 entries: 2^10 two-byte bins (features[9]: 0x100 words).
    assert_eq!(
        count.st_bytes(&table(9, 0xdead_0000)),
        Some(header + 512 * 24 + 0x100 * 8)
    );
    // Garbage (a table freed while read): not a table, never a panic on overflow.
    assert_eq!(count.st_bytes(&table(63, 0xdead_0000)), None);
}

/// Object flags of type T_OBJECT with shape `id` in the top 32 bits and `extra` flags.
fn object_flags(id: u64, extra: u64) -> u64 {
    (id << 32) | extra | u64::from(T_OBJECT)
}

#[test]
fn an_objects_ivars_are_where_memsize_of_looks_on_3_3_and_4_0() {
    let slot = {
        let mut s = vec![0u8; 40];
        s[16..24].copy_from_slice(&0xdead_0000u64.to_le_bytes());
        s
    };
    let s = heap_layout_for_version("3.3.8").unwrap().shapes.unwrap();
    let (embed, _) = s.out_of_slot;
    let complex = s.too_complex_id.unwrap();
    assert_eq!(Ivars::of(&s, object_flags(40, embed), &slot), Ivars::InSlot);
    assert_eq!(Ivars::of(&s, object_flags(40, 0), &slot), Ivars::Shape(40));
    // Too complex before 4.0 whatever ROBJECT_EMBED says.
    assert_eq!(
        Ivars::of(&s, object_flags(complex, embed), &slot),
        Ivars::Table(0xdead_0000)
    );

    let s = heap_layout_for_version("4.0.2").unwrap().shapes.unwrap();
    let (heap, set) = s.out_of_slot;
    assert!(set, "4.0 marks ivars out of the slot with ROBJECT_HEAP");
    let complex = s.too_complex_flag.unwrap();
    assert_eq!(
        Ivars::of(&s, object_flags(complex | 7, 0), &slot),
        Ivars::InSlot
    );
    assert_eq!(
        Ivars::of(&s, object_flags(complex | 7, heap), &slot),
        Ivars::Table(0xdead_0000)
    );
    assert_eq!(Ivars::of(&s, object_flags(7, heap), &slot), Ivars::Shape(7));
}

#[test]
fn every_layout_from_3_2_sizes_ivars_by_shape_and_none_before() {
    for (release, h) in rbspy_ext_bindings::HEAP_LAYOUTS {
        let from_3_2 = !["2.", "3.0.", "3.1."]
            .iter()
            .any(|p| release.starts_with(p));
        // The master of 2026-08 (4.1.0) sizes them as objects of their own (`fields`),
        // with no shape list; and its Ractors own their heaps.
        let apart = h.fields.is_some();
        assert_eq!(apart, h.ractor_heaps.is_some(), "{release}");
        assert_eq!(h.shapes.is_some() || apart, from_3_2, "{release}");
        assert!(!(h.shapes.is_some() && apart), "{release}");
        assert_eq!(h.robject_heap.is_some(), !from_3_2, "{release}");
        if let Some(s) = h.shapes {
            assert!([1, 2, 4].contains(&s.capacity_width), "{release}: {s:?}");
            assert!(
                s.capacity + s.capacity_width <= s.shape_size,
                "{release}: {s:?}"
            );
            assert_eq!(s.heap_index.is_some(), s.capacities.is_some(), "{release}");
        }
    }
}

#[test]
fn the_shape_tree_is_found_by_a_scan_where_libruby_does_not_name_it() {
    let (l, h) = layouts();
    let s = h.shapes.expect("3.3 has shapes");
    let ShapeList::TreePointer {
        shape_list,
        root_shape,
        next_shape_id,
        parent_id,
    } = s.list
    else {
        panic!(
            "3.3 keeps its shape tree behind rb_shape_tree_ptr: {:?}",
            s.list
        )
    };
    let tree_len = shape_list.max(root_shape).max(next_shape_id + 4) + 8;
    let mut mem = MemoryImage::new();
    // A shape list whose first shape is the root (parent INVALID_SHAPE_ID), and one whose
    // first shape is not.
    let (list, not_root) = (0x50_0000u64, 0x60_0000u64);
    for (at, parent) in [(list, u32::MAX), (not_root, 0)] {
        let mut shapes = vec![0u8; s.shape_size * 4];
        shapes[parent_id..parent_id + 4].copy_from_slice(&parent.to_le_bytes());
        mem.map(at, shapes);
    }
    // Trees: one whose shape_list and root_shape differ, one over the list whose first shape
    // is no root, and the real one.
    let tree = |list: u64, root: u64| {
        let mut t = vec![0u8; tree_len];
        t[shape_list..shape_list + 8].copy_from_slice(&list.to_le_bytes());
        t[root_shape..root_shape + 8].copy_from_slice(&root.to_le_bytes());
        t[next_shape_id..next_shape_id + 4].copy_from_slice(&12u32.to_le_bytes());
        t
    };
    mem.map(0x20_0000, tree(list, list + 8));
    mem.map(0x30_0000, tree(not_root, not_root));
    mem.map(0x40_0000, tree(list, list));
    // libruby's data: zeros, the decoys, then the pointer to the real tree.
    let data = 0x10_0000u64;
    let mut words = vec![0u8; 64];
    for (i, p) in [0x20_0000u64, 0x30_0000, 0x40_0000].iter().enumerate() {
        words[16 + i * 8..24 + i * 8].copy_from_slice(&p.to_le_bytes());
    }
    mem.map(data, words);
    let roots = crate::vm::VmRoots {
        vm: 0,
        main_thread: 0,
        gvl_owner: 0,
        thread_list: 0,
    };
    let mut spy =
        Spy::with_memory(1, mem, l, "3.3.8", roots, None).with_writable(vec![(data, data + 64)]);
    let mut view = spy.target_view();
    let source = shape_source(&mut view, &s).expect("found by the scan");
    assert_eq!(view.shape_tree(), Some(data + 32));
    assert_eq!(source.list, list);
}

#[test]
fn a_page_list_read_mid_change_is_taken_deduplicated_and_a_whole_one_as_it_is() {
    let (_, h) = layouts();
    let count = h.allocated_pages.expect("3.3 counts its pages");
    let objspace = 0x1000u64;
    let array = 0x9000u64;
    let image = |entries: &[u64]| {
        let mut mem = MemoryImage::new();
        let mut space = vec![0u8; h.sorted.max(count) + 8];
        space[h.sorted..h.sorted + 8].copy_from_slice(&array.to_le_bytes());
        space[count..count + 8].copy_from_slice(&(entries.len() as u64).to_le_bytes());
        mem.map(objspace, space);
        mem.map(
            array,
            entries.iter().flat_map(|p| p.to_le_bytes()).collect(),
        );
        mem
    };
    // The array is sorted by the pages' bodies: their headers come in any order.
    let listed = [0x30_0000, 0x10_0000, 0x20_0000];
    assert_eq!(
        page_list_read(&image(&listed), h, objspace).unwrap(),
        (listed.to_vec(), true)
    );
    // An insertion's move caught halfway: one page twice, and the pass is told so.
    let moving = [0x30_0000, 0x10_0000, 0x10_0000, 0x20_0000];
    assert_eq!(
        page_list_read(&image(&moving), h, objspace).unwrap(),
        (vec![0x10_0000, 0x20_0000, 0x30_0000], false)
    );
}

#[test]
fn a_page_that_reads_as_swept_or_with_other_marks_the_second_time_was_swept_meanwhile() {
    let (_, h) = layouts();
    let block = 0x10_0000u64;
    let (at, mask) = h.page_before_sweep;
    let unswept = |marks: u64, slots: u16| {
        let mut bytes = header(h, block + 64, slots, 40);
        bytes[at] |= mask;
        bytes[h.page_mark_bits..h.page_mark_bits + 8].copy_from_slice(&marks.to_le_bytes());
        bytes
    };
    let mut mem = MemoryImage::new();
    let headers = [0x1000, 0x2000, 0x3000, 0x4000, 0x5000];
    for at in headers {
        mem.map(at, unswept(0b1011, 100));
    }
    let mut census = Census::default();
    let pages = read_headers(&mem, h, true, &headers, &mut census);
    assert!(pages.iter().all(|p| p.unswept && p.marks[0] == 0b1011));
    // Meanwhile the second page is swept (its flag cleared, old objects' marks left), the
    // third reads with other marks, the fourth is freed and the fifth names other slots.
    mem.map(0x2000, header(h, block + 64, 100, 40));
    mem.map(0x3000, unswept(0b0001, 100));
    mem.map(0x4000, Vec::new());
    mem.map(0x5000, unswept(0b1011, 50));
    use pages::Reread::*;
    assert_eq!(
        pages::reread(&mem, h, &pages),
        [Same, Swept, Swept, Gone, Gone]
    );
}

fn row(name: &str, objects: u64, bytes: u64) -> ClassRow {
    ClassRow {
        name: name.into(),
        type_name: "T_OBJECT".into(),
        objects,
        slot_bytes: bytes,
        heap_bytes: 0,
    }
}

#[test]
fn diff_puts_the_class_that_grew_most_first_and_leaves_out_the_unchanged() {
    let a = Census {
        classes: vec![
            row("Kept", 10, 400),
            row("Shrank", 5, 200),
            row("Grew", 1, 40),
        ],
        ..Census::default()
    };
    let b = Census {
        classes: vec![
            row("Kept", 10, 400),
            row("Grew", 1001, 40040),
            row("New", 2, 80),
        ],
        ..Census::default()
    };
    let d = b.diff(&a);
    let names: Vec<&str> = d.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["Grew", "New", "Shrank"]);
    assert_eq!((d[0].objects, d[0].bytes), (1000, 40000));
    assert_eq!((d[2].objects, d[2].bytes, d[2].objects_now), (-5, -200, 0));
}
