//! The heap's pages for the census (walk.rs): the list of every page, read whole while
//! the target adds and frees pages, and the pages' headers, checked before their slots are
//! read.
use super::Census;
use crate::memory::field;
use crate::memory::word;
use crate::memory::Memory;
use rbspy_ext_bindings::HeapLayout;

/// Reads of the page list before the last is taken as it is (see `page_list_read`).
const LIST_ATTEMPTS: usize = 8;
/// More pages than this (a terabyte heap) means the array's length did not read right.
const MAX_PAGES: u64 = 1 << 24;

/// One page, as its header read.
pub(super) struct Page {
    /// The `struct heap_page` (its header).
    pub(super) header: u64,
    pub(super) start: u64,
    pub(super) slots: usize,
    pub(super) slot_size: usize,
    /// Unmarked slots here are garbage: a lazy sweep runs and has not reached this page.
    pub(super) unswept: bool,
    pub(super) marks: Vec<u64>,
    /// `page->objspace` where each Ractor owns its heap (else 0): the heap it belongs to now.
    pub(super) objspace: u64,
}

/// Every page's `struct heap_page *`, from the objspace's sorted array: before 3.4 a plain
/// array of `heap_pages.allocated_pages`, from 3.4 an rb_darray that holds its own size.
///
/// The target adds and frees pages as it runs: it moves the array's entries, then sets the
/// count (and a darray may move). A read between the two would miss the last page or see
/// one twice. So a read counts only when the array and its count read the same after it
/// as before and no page is in it twice (the array is sorted by the pages' bodies, not by
/// these header pointers, so their order says nothing); after `LIST_ATTEMPTS` reads that
/// never were, the last one, deduplicated.
///
/// With the pages, whether a read was consistent: false when the last was taken.
pub(super) fn page_list_read<M: Memory>(
    mem: &M,
    h: &HeapLayout,
    objspace: u64,
) -> std::result::Result<(Vec<u64>, bool), crate::error::MemoryError> {
    let mut last: Option<Vec<u64>> = None;
    let mut error = None;
    for _ in 0..LIST_ATTEMPTS {
        let before = list_extent(mem, h, objspace)?;
        let (data, len) = before;
        if data == 0 || len == 0 || len > MAX_PAGES {
            continue; // read while it moved: read it again
        }
        let bytes = match mem.read_vec(data, len as usize * 8) {
            Ok(bytes) => bytes,
            Err(e) => {
                error = Some(e); // a darray moved meanwhile: read where it is now
                continue;
            }
        };
        let pages: Vec<u64> = (0..len as usize).map(|i| word(&bytes, i * 8)).collect();
        let mut distinct = pages.clone();
        distinct.retain(|p| *p != 0);
        distinct.sort_unstable();
        distinct.dedup();
        if distinct.len() == pages.len() && list_extent(mem, h, objspace)? == before {
            return Ok((pages, true));
        }
        last = Some(distinct);
    }
    match (last, error) {
        (Some(pages), _) => Ok((pages, false)),
        (None, Some(e)) => Err(e),
        (None, None) => Ok((Vec::new(), false)),
    }
}

/// Whether a page of `listed` (a pass's list) is gone from the list now: freed around the
/// pass, which may then have missed pages. The GC frees pages in a loop that moves the kept
/// ones down the list and lowers its count with each page it frees: a list read in the
/// middle of it, steady for the microseconds of the read, lacks as many pages at its end
/// as were freed so far, and still lists a freed page (or one twice, which
/// `page_list_read` sees). On 3.2 a freed page's body goes back to malloc and still reads,
/// so nothing in the pass told: two CI runs' censuses of a compacting heap missed 1,455 of
/// its 20,000 live objects, none moving or unreadable.
pub(super) fn freed_since<M: Memory>(
    mem: &M,
    h: &HeapLayout,
    objspace: u64,
    listed: &[u64],
) -> bool {
    let Ok((now, _)) = page_list_read(mem, h, objspace) else {
        return false; // the pass's own reads tell of a heap that went
    };
    let now: rustc_hash::FxHashSet<u64> = now.into_iter().collect();
    listed.iter().any(|p| !now.contains(p))
}

/// Where the page array's entries are, and how many.
fn list_extent<M: Memory>(
    mem: &M,
    h: &HeapLayout,
    objspace: u64,
) -> std::result::Result<(u64, u64), crate::error::MemoryError> {
    let sorted = mem.read_u64(field(objspace, h.sorted))?;
    Ok(match (h.darray, h.allocated_pages) {
        (Some((size, data)), _) if sorted != 0 => {
            (field(sorted, data), mem.read_u64(field(sorted, size))?)
        }
        (None, Some(count)) => (sorted, mem.read_u64(field(objspace, count))?),
        _ => (0, 0),
    })
}

/// The headers of `pages`, in one call: the pages that read and make sense (a live page of
/// slots inside its aligned block). Emptied pages (3.4+, whose header is zeroed) hold no
/// objects and are skipped; tomb pages (before 3.4) are read like any other; the rest
/// count as unreadable.
pub(super) fn read_headers<M: Memory>(
    mem: &M,
    h: &HeapLayout,
    sweeping: bool,
    pages: &[u64],
    census: &mut Census,
) -> Vec<Page> {
    let len = header_len(h);
    let headers = mem.read_blocks(pages.iter().map(|p| (*p, len)));
    let mut read = Vec::with_capacity(pages.len());
    for (bytes, &header) in headers.iter().zip(pages) {
        let Some(bytes) = bytes else {
            census.unreadable_pages += 1;
            continue;
        };
        census.bytes_read += len as u64;
        let (start, slots, slot_size) = geometry(h, bytes);
        // Emptied pages (3.4+) are zeroed. Tomb pages (before 3.4) hold only free slots and
        // zombies, which count_objects counts too: they are read like any other.
        if start == 0 || slots == 0 {
            continue;
        }
        let block = start & !(h.page_align as u64 - 1);
        if slot_size < 16
            || !start.is_multiple_of(8)
            || (start - block) + (slots * slot_size) as u64 > h.page_align as u64
        {
            census.unreadable_pages += 1;
            continue;
        }
        let (at, mask) = h.page_before_sweep;
        let unswept = sweeping && bytes[at] & mask != 0;
        let marks = if unswept {
            marks_of(h, bytes)
        } else {
            Vec::new()
        };
        let objspace = h.ractor_heaps.map_or(0, |r| word(bytes, r.page_objspace));
        read.push(Page {
            header,
            start,
            slots,
            slot_size,
            unswept,
            marks,
            objspace,
        });
    }
    read
}

/// The bytes of a page header the census reads: up to the end of its mark bitmap.
pub(super) fn header_len(h: &HeapLayout) -> usize {
    h.page_mark_bits + h.page_mark_bits_len
}

/// A page header's `start`, `total_slots` and slot size (one size before 3.1).
fn geometry(h: &HeapLayout, header: &[u8]) -> (u64, usize, usize) {
    let short = |at: usize| u16::from_le_bytes([header[at], header[at + 1]]) as usize;
    let slot_size = h.page_slot_size.map_or(h.base_slot_size, short);
    (
        word(header, h.page_start),
        short(h.page_total_slots),
        slot_size,
    )
}

/// A page header's mark bitmap, as words.
fn marks_of(h: &HeapLayout, header: &[u8]) -> Vec<u64> {
    let bits = &header[h.page_mark_bits..];
    (0..h.page_mark_bits_len / 8)
        .map(|i| word(bits, i * 8))
        .collect()
}

/// What a page read as unswept reads as when its header is read again after its slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reread {
    /// As before: before its sweep, with the same marks (or not read as unswept at all).
    Same,
    /// Swept meanwhile, or being swept: its flag cleared, or other marks. Its header read
    /// may even have torn across the sweep (the flag from before it, the marks from after
    /// it, when only old objects stay marked), which would take young live objects for
    /// garbage. Its slots are to be read again and counted as a swept page's (garbage the
    /// sweep has not freed yet then counts as live).
    Swept,
    /// No longer this page: the header did not read, or names other slots (freed, or
    /// reused).
    Gone,
}

/// `Reread` of each of `pages` (only unswept pages are read again).
pub(super) fn reread<M: Memory>(mem: &M, h: &HeapLayout, pages: &[Page]) -> Vec<Reread> {
    let mut states = vec![Reread::Same; pages.len()];
    let unswept: Vec<usize> = (0..pages.len()).filter(|i| pages[*i].unswept).collect();
    if unswept.is_empty() {
        return states;
    }
    let headers = mem.read_blocks(unswept.iter().map(|i| (pages[*i].header, header_len(h))));
    let (at, mask) = h.page_before_sweep;
    for (i, bytes) in unswept.iter().zip(&headers) {
        let page = &pages[*i];
        states[*i] = match bytes {
            Some(b) if geometry(h, b) == (page.start, page.slots, page.slot_size) => {
                if b[at] & mask == 0 || marks_of(h, b) != page.marks {
                    Reread::Swept
                } else {
                    Reread::Same
                }
            }
            _ => Reread::Gone,
        };
    }
    states
}
