//! One record of the ring buffer, as core/bpf/sampler.h lays it out: a header, then the
//! control frames, the value stack and the tag table's words, each as long as the header
//! says.
use super::skel::types::header as Header;
use crate::spy::Captured;

/// `FLAG_*` in core/bpf/sampler.h.
const FLAG_TRUNCATED: u32 = 1;
const FLAG_UNREADABLE: u32 = 2;
const FLAG_TAGS_CUT: u32 = 8;
const FLAG_UNKNOWN: u32 = 16;
const FLAG_OTEL_UNREAD: u32 = 32;

/// One thread of the target at one tick, borrowed from the drained ring.
#[derive(Debug, Clone, Copy)]
pub struct Record<'a> {
    /// CLOCK_MONOTONIC when the tick came.
    pub time_ns: u64,
    pub tid: u32,
    /// The context or its frames did not read (a thread starting or ending).
    pub unreadable: bool,
    /// The tag table was larger than the program copies.
    pub tags_cut: bool,
    /// A thread of the target the program's map does not know: a header alone.
    pub unknown: bool,
    pub captured: Captured<'a>,
}

impl<'a> Record<'a> {
    /// None when the bytes are shorter than their header says (never, from the program).
    pub fn parse(raw: &'a [u8]) -> Option<Record<'a>> {
        let size = std::mem::size_of::<Header>();
        if raw.len() < size {
            return None;
        }
        // SAFETY: `raw` holds at least a header's bytes; the header is plain integers, for
        // which any bytes are valid, and read_unaligned does not need them aligned.
        let h: Header = unsafe { std::ptr::read_unaligned(raw.as_ptr() as *const Header) };
        let frames_end = size.checked_add(h.frame_bytes as usize)?;
        let values_end = frames_end.checked_add(h.value_bytes as usize)?;
        let tags_end = values_end.checked_add(h.tag_words as usize * 8)?;
        let otel_end = tags_end.checked_add(h.otel_bytes as usize)?;
        if raw.len() < otel_end {
            return None;
        }
        Some(Record {
            time_ns: h.time_ns,
            tid: h.tid,
            unreadable: h.flags & FLAG_UNREADABLE != 0,
            tags_cut: h.flags & FLAG_TAGS_CUT != 0,
            unknown: h.flags & FLAG_UNKNOWN != 0,
            captured: Captured {
                thread: h.thread,
                head: h.head,
                gvl_owner: h.gvl_owner,
                gc_flags: h.gc_flags,
                frames: &raw[size..frames_end],
                values_from: h.values_from,
                values: &raw[frames_end..values_end],
                tag_table: h.tag_table,
                tag_words: &raw[values_end..tags_end],
                otel_record: h.otel_record,
                otel_bytes: &raw[tags_end..otel_end],
                otel_unread: h.flags & FLAG_OTEL_UNREAD != 0,
                truncated: h.flags & FLAG_TRUNCATED != 0,
                // Set by the reader, which knows when it reads it.
                age: std::time::Duration::ZERO,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The record's header is what core/bpf/sampler.h says (112 bytes), and the record
    /// holds 512 frames of 64 bytes, 128 KiB of value stack, a table of 64 slots and an
    /// OpenTelemetry record of OTEP 4947's most.
    #[test]
    fn layout_matches_the_program() {
        assert_eq!(std::mem::size_of::<Header>(), 112);
        let record = std::mem::size_of::<super::super::skel::types::record>();
        let otel = crate::context::otel_thread::MAX_RECORD_LEN;
        assert_eq!(
            record,
            112 + 512 * 64 + 128 * 1024 + (2 + 2 * 64) * 8 + otel
        );
    }

    #[test]
    fn records_shorter_than_their_header_says_are_refused() {
        let mut h = [0u8; 112];
        h[68..72].copy_from_slice(&64u32.to_ne_bytes()); // frame_bytes
        assert!(Record::parse(&h).is_none());
        let mut long = h.to_vec();
        long.extend_from_slice(&[0u8; 64]);
        let r = Record::parse(&long).expect("a whole record");
        assert_eq!(r.captured.frames.len(), 64);
        assert!(r.captured.values.is_empty() && r.captured.tag_words.is_empty());
        assert!(r.captured.otel_bytes.is_empty());
        // An OpenTelemetry record of 40 bytes after the frames (otel_bytes).
        h[104..108].copy_from_slice(&40u32.to_ne_bytes());
        let mut with_record = h.to_vec();
        with_record.extend_from_slice(&[0u8; 64]);
        assert!(Record::parse(&with_record).is_none());
        with_record.extend_from_slice(&[7u8; 40]);
        let r = Record::parse(&with_record).expect("a whole record");
        assert_eq!(r.captured.otel_bytes, &[7u8; 40][..]);
        assert!(Record::parse(&h[..111]).is_none());
    }
}
