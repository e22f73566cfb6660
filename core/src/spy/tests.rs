//! Unit tests of spy/'s rules on small memory images: how many frames a context's stack
//! holds (walker.rs), when a Ractor list read is a moved read (thread_list.rs), and when a
//! thread's tags hold around its stack (tags.rs).

/// `walker::frame_count`: the frames between a control frame pointer and the stack's end.
mod frames {
    use super::super::leaves::MAX_FRAMES;
    use super::super::walker::frame_count;

    const CFP: u64 = 56;
    const STACK: u64 = 0x7f00_0000_0000;
    /// Ruby's default VM stack: 1 MiB of words.
    const WORDS: u64 = 128 * 1024;

    /// The control frame `n` frames below the stack's end (frames grow down from its end).
    fn cfp_at(n: u64) -> u64 {
        STACK + WORDS * 8 - CFP - n * CFP
    }

    #[test]
    fn counts_the_frames_between_the_pointer_and_the_stack_end() {
        assert_eq!(frame_count(CFP, [STACK, WORDS, cfp_at(0)]), Ok(0));
        assert_eq!(frame_count(CFP, [STACK, WORDS, cfp_at(20)]), Ok(20));
    }

    #[test]
    fn refuses_a_pointer_outside_its_stack_or_between_frames() {
        for (what, ec) in [
            ("no stack", [0, WORDS, cfp_at(3)]),
            ("past the end", [STACK, WORDS, cfp_at(0) + CFP]),
            ("below the stack", [STACK, WORDS, STACK - 8]),
            ("between two frames", [STACK, WORDS, cfp_at(3) + 8]),
            ("a size read mid-change", [STACK, u64::MAX / 8, cfp_at(3)]),
        ] {
            assert!(frame_count(CFP, ec).is_err(), "{what}: {ec:x?}");
        }
        assert!(
            frame_count(0, [STACK, WORDS, cfp_at(0)]).is_err(),
            "no frame size"
        );
    }

    #[test]
    fn refuses_more_frames_than_any_stack_holds() {
        let words = MAX_FRAMES * 1024;
        let last = STACK + words * 8 - CFP;
        let deep = last - (MAX_FRAMES + 1) * CFP;
        assert_eq!(
            frame_count(CFP, [STACK, words, deep]),
            Err(format!("{} frames", MAX_FRAMES + 1))
        );
        assert_eq!(frame_count(CFP, [STACK, words, deep + CFP]), Ok(MAX_FRAMES));
    }
}

/// `thread_list::read_ractors` over a VM whose Ractor list is laid out by hand.
mod ractors {
    use super::super::attach::Target;
    use super::super::leaves::Attempt;
    use super::super::thread_list::read_ractors;
    use crate::memory::field;
    use crate::memory::MemoryImage;
    use crate::vm::VmRoots;

    const VM: u64 = 0x10_0000;
    /// Where the Ractors live in the image, 4 KiB apart.
    const RACTORS: u64 = 0x20_0000;

    fn layout() -> &'static rbspy_ext_bindings::Layout {
        rbspy_ext_bindings::layout_for_version("3.3.8").expect("3.3.8's layout")
    }

    /// A VM whose Ractor list links the Ractors given by (id, their `next` node: None for the
    /// list's head), the first one's thread list being the main one's.
    fn target(ractors: &[(u32, Option<usize>)]) -> Target<MemoryImage> {
        let l = layout();
        let node = |i: usize| RACTORS + i as u64 * 0x1000 + l.ractor_list_node as u64;
        let head = field(VM, l.vm_ractor_set.expect("3.3 has Ractors"));
        let mut vm = vec![0u8; 0x2000];
        let first = if ractors.is_empty() { head } else { node(0) };
        let at = (head - VM) as usize;
        vm[at..at + 8].copy_from_slice(&first.to_le_bytes());
        let mut image = MemoryImage::new();
        image.map(VM, vm);
        let mut space = vec![0u8; 0x1000 * ractors.len().max(1)];
        for (i, (id, next)) in ractors.iter().enumerate() {
            let base = i * 0x1000;
            let put = |s: &mut Vec<u8>, off: usize, bytes: &[u8]| {
                s[base + off..base + off + bytes.len()].copy_from_slice(bytes)
            };
            put(&mut space, l.ractor_id, &id.to_le_bytes());
            put(&mut space, l.ractor_name, &8u64.to_le_bytes()); // nil
            put(
                &mut space,
                l.ractor_list_node,
                &next.map_or(head, node).to_le_bytes(),
            );
        }
        image.map(RACTORS, space);
        let threads = field(RACTORS, l.ractor_threads_set.expect("3.3 has Ractors"));
        let roots = VmRoots {
            vm: VM,
            main_thread: 0,
            gvl_owner: 0,
            thread_list: threads,
        };
        Target::new(1, image, l, l.name, roots)
    }

    #[test]
    fn follows_the_ractor_list_from_the_main_ractor() {
        let ractors = read_ractors(&target(&[(1, Some(1)), (2, None)])).expect("reads");
        assert_eq!(ractors.iter().map(|r| r.id).collect::<Vec<_>>(), [1, 2]);
        assert!(
            ractors.iter().all(|r| r.name.is_none()),
            "nil names no Ractor"
        );
        let l = layout();
        let second = RACTORS + 0x1000;
        assert_eq!(
            ractors[1].threads,
            field(second, l.ractor_threads_set.unwrap())
        );
    }

    #[test]
    fn a_list_that_never_comes_back_to_its_head_is_a_moved_read() {
        // The second Ractor's node points at itself: a list read while it changed.
        match read_ractors(&target(&[(1, Some(1)), (2, Some(1))])) {
            Err(Attempt::Changed(why)) => assert!(why.contains("does not close"), "{why}"),
            other => panic!(
                "expected a moved read, got {:?}",
                other.map(|r| r.len()).ok()
            ),
        }
    }

    #[test]
    fn a_list_without_the_main_ractor_is_a_moved_read() {
        match read_ractors(&target(&[])) {
            Err(Attempt::Changed(why)) => assert!(why.contains("main ractor"), "{why}"),
            other => panic!(
                "expected a moved read, got {:?}",
                other.map(|r| r.len()).ok()
            ),
        }
    }
}

/// `TagRead`: the tag pointer read around a thread's stack in a sample's one call.
mod tag_reads {
    use super::super::tags::{Pointer, TagReader};
    use crate::memory::MemoryImage;
    use crate::memory::ReadBatch;

    /// A thread pointer, where it is kept, and the published offset of the table pointer.
    const TP: u64 = 0x7000_0000;
    const TP_AT: u64 = 0x6000_0000;
    const OFFSET: i64 = -0x40;

    fn image(tp: u64, table: u64) -> MemoryImage {
        let mut image = MemoryImage::new();
        image.map(TP_AT, tp.to_le_bytes().to_vec());
        let at = TP.wrapping_add_signed(OFFSET);
        image.map(at, table.to_le_bytes().to_vec());
        image
    }

    fn reader() -> TagReader {
        let mut r = TagReader::default();
        r.pointers.insert(
            1,
            Pointer {
                nt: 0,
                tp: TP,
                tp_at: TP_AT,
            },
        );
        r
    }

    #[test]
    fn tags_hold_when_the_pointer_reads_the_same_around_the_stack() {
        let mut reads = ReadBatch::default();
        let mut read = reader().tag_read(1, OFFSET, &mut reads);
        read.reread_pointer(&mut reads);
        reads.read(&image(TP, 0x5000)).expect("reads");
        assert!(read.held(&reads));
        assert!(
            !read.read_late(0, &reads),
            "same native thread, same thread pointer"
        );
    }

    #[test]
    fn tags_that_changed_while_the_stack_was_copied_do_not_hold() {
        let mut reads = ReadBatch::default();
        let mut read = reader().tag_read(1, OFFSET, &mut reads);
        read.reread_pointer(&mut reads);
        reads.read(&image(TP, 0x5000)).expect("reads");
        // The second reading of the pointer, made after the stack, finds another table.
        let again = read.pointer_again.expect("read again");
        reads
            .reread(&image(TP, 0x9000), &[(read.pointer_at, again)])
            .expect("reads");
        assert!(!read.held(&reads));
    }

    #[test]
    fn a_pointer_is_read_late_for_a_thread_unknown_moved_or_replaced() {
        let mut reads = ReadBatch::default();
        let unknown = reader().tag_read(2, OFFSET, &mut reads);
        let read = reader().tag_read(1, OFFSET, &mut reads);
        // Another Ruby thread now has this one's address: its thread pointer differs.
        reads.read(&image(TP + 0x100, 0x5000)).expect("reads");
        assert!(
            unknown.read_late(0, &reads),
            "a thread whose native thread is not known"
        );
        assert!(
            read.read_late(0, &reads),
            "another thread at this one's address"
        );
        assert!(
            read.read_late(0xbeef, &reads),
            "a thread now on another native thread"
        );
    }
}
