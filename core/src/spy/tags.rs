//! The tags of each thread, read from the target's `ruby_profiler_state` tables
//! (docs/profiler-state.md) through its memory only: the thread's `pthread_t` (its thread
//! pointer) from Ruby's thread structures, plus the offset the rbspy_ext extension publishes
//! in `ruby_profiler_state_tp_offset`, gives the thread's pointer to the current fiber's
//! table; the table's IDs and VALUEs are decoded like everything else the walker reads.
//!
//! A child module of `spy` so that it shares the walker's symbol table and class names.
use super::attach::Target;
use crate::context::ownership::{PointerRead, ReadAt};
use crate::context::profiler_state::{Header, HEADER_LEN};
use crate::memory::{field, word, Memory, ReadBatch, Span};
use crate::objects::is_heap_object;

pub(super) use super::tag_decoder::Decoder;
use super::traces::{with_labels, Drops, LastRecord};
use crate::model::Tags;
use crate::process::{find_profiler_state_symbols, read_maps};
use std::time::{Duration, Instant};

/// How often a process without the extension is checked again (it may load it later).
const RECHECK: Duration = Duration::from_secs(1);
/// How long a thread's decoded tags are trusted while its table reads the same: a String
/// value can be changed in place without a new table, so it is decoded afresh this often.
const TAGS_TTL: Duration = Duration::from_millis(100);

/// How many times [`TagReader::thread_tags`] reads a table (and spy/trace_reads.rs an
/// OpenTelemetry record) whose decoding took longer than
/// the time a reader may take (`crate::context::ownership::TABLE_WINDOW`; each read is a
/// fresh one, pointer first).
pub(super) const TAG_ATTEMPTS: u32 = 3;

/// Where the target's `ruby_profiler_state` is, once known.
#[derive(Debug, Default)]
pub(super) struct TagReader {
    /// The published offset from the thread pointer, once the extension is seen loaded.
    offset: Option<i64>,
    /// The offset of `ruby_profiler_state_owner` (the Ruby thread the pointer is for), when
    /// the extension publishes it.
    pub(super) owner_offset: Option<i64>,
    checked_at: Option<Instant>,
    /// The offsets were given (`preset`), not looked for.
    fixed: bool,
    /// By Ruby thread: the native thread it was last seen on, that one's thread pointer,
    /// and where that pointer was read (see `Pointer`).
    pub(super) pointers: rustc_hash::FxHashMap<u64, Pointer>,
    /// By Ruby thread: the table its pointer held at the last sample, that table's bytes
    /// and their decoding (see `sampled_tags`).
    last: rustc_hash::FxHashMap<u64, LastTable>,
    /// By Ruby thread: the table it publishes now, read once per batch of captured samples
    /// (spy/captured.rs), and how many captured tables were no longer published.
    pub(super) published_now: rustc_hash::FxHashMap<u64, (u64, Vec<u8>)>,
    pub(super) expired: u64,
    /// The offset of `otel_thread_ctx_v1` (OpenTelemetry's thread context, spy/traces.rs),
    /// when the extension publishes it.
    pub(super) otel_offset: Option<i64>,
    /// By Ruby thread: the record its OpenTelemetry pointer held at the last sample.
    pub(super) last_records: rustc_hash::FxHashMap<u64, LastRecord>,
    /// Records that gave no labels, by reason.
    pub(super) otel_drops: Drops,
}

/// Where a Ruby thread's `ruby_profiler_state` was found: its native thread (`th->nt`, 0
/// before 3.2), that one's thread pointer (`pthread_t`), and the address the thread pointer
/// was read from (in the Ruby thread before 3.2, in the native thread after). A Ruby thread
/// that ends can be followed by another at the same address, on a native thread struct at
/// the same address too, but on another pthread: so each sample reads the thread pointer
/// again (`TagRead::tp`), and a different one means this is another thread.
#[derive(Debug, Clone, Copy)]
pub(super) struct Pointer {
    pub(super) nt: u64,
    pub(super) tp: u64,
    pub(super) tp_at: u64,
}

#[derive(Debug)]
struct LastTable {
    table: u64,
    raw: Vec<u8>,
    tags: Tags,
    at: Instant,
}

/// What `Spy::sample` reads for one thread's tags, in its one call (spans of its batch):
/// the owner and `ruby_profiler_state` pointer on the native thread the Ruby thread was on
/// last time and, where it had a table then, that table's bytes again (`last`: the table's
/// address and span). No spans while the thread's native thread is not known yet.
#[derive(Debug, Clone, Copy)]
pub(super) struct TagRead {
    /// The native thread the pointer was read on (0 before 3.2) and the published offset.
    pub nt: u64,
    pub offset: i64,
    /// The thread pointer the Ruby thread had when last seen, and its thread pointer read
    /// again in this call (see `Pointer`): a pointer that differs means the address is now
    /// another Ruby thread's.
    tp: u64,
    tp_again: Span,
    /// `ruby_profiler_state_owner`, read before the pointer and again after it (see
    /// profiler_state.c; empty when not published).
    pub owner: Span,
    pub owner_again: Span,
    /// `ruby_profiler_state`; None while the native thread is not known yet.
    pub pointer: Option<Span>,
    pub last: Option<(u64, Span)>,
    /// `ruby_profiler_state` again, read after the thread's stack in the same call
    /// (`reread_pointer`): a thread that changed tags while the call copied its stack shows
    /// another pointer here.
    pub pointer_again: Option<Span>,
    /// Where the pointer is (for `reread_pointer`).
    pub(super) pointer_at: u64,
    /// `otel_thread_ctx_v1`, read between the owner reads with `ruby_profiler_state` (None
    /// where the extension has none), the record it held last time and its span, and the
    /// pointer again after the stack, as for the table.
    pub(super) otel: Option<Span>,
    pub(super) otel_last: Option<(u64, Span)>,
    otel_again: Option<Span>,
    otel_at: u64,
}

impl TagRead {
    /// Whether the pointer must be read apart from the batch, after the stack: the native
    /// thread was not known, or the Ruby thread is now on another (`nt`, its `th->nt` in the
    /// batch), or another Ruby thread took this one's address (see `Pointer`).
    pub(super) fn read_late(&self, nt: u64, reads: &ReadBatch) -> bool {
        self.pointer.is_none() || nt != self.nt || word(reads.get(self.tp_again), 0) != self.tp
    }

    /// Adds a read of the pointer again to `reads`, after whatever was added since `tag_read`.
    pub(super) fn reread_pointer(&mut self, reads: &mut ReadBatch) {
        if self.pointer.is_some() {
            self.pointer_again = Some(reads.add(self.pointer_at, 8));
        }
        if self.otel.is_some() {
            self.otel_again = Some(reads.add(self.otel_at, 8));
        }
    }

    /// False when the pointer read before and after the thread's stack differs: its tags
    /// changed while the stack was copied, so they may not be the ones the stack ran under.
    pub(super) fn held(&self, reads: &ReadBatch) -> bool {
        let same = |before: Option<Span>, after: Option<Span>| match (before, after) {
            (Some(a), Some(b)) => word(reads.get(a), 0) == word(reads.get(b), 0),
            _ => true,
        };
        same(self.pointer, self.pointer_again) && same(self.otel, self.otel_again)
    }
}

impl TagReader {
    /// Where the offsets are already known, or known to be absent (a spy over a memory
    /// image, whose process's maps cannot be read): they are never looked for.
    pub(super) fn preset(&mut self, offsets: Option<(i64, Option<i64>)>) {
        self.offset = offsets.map(|(offset, _)| offset);
        self.owner_offset = offsets.and_then(|(_, owner)| owner);
        self.otel_offset = None;
        self.fixed = true;
    }

    /// See [`Spy::profiler_state_offset`].
    pub(super) fn offset<M: Memory>(&mut self, t: &Target<M>) -> Option<i64> {
        if self.offset.is_some() || self.fixed {
            return self.offset;
        }
        if self.checked_at.is_some_and(|at| at.elapsed() < RECHECK) {
            return None;
        }
        self.checked_at = Some(Instant::now());
        let maps = read_maps(t.pid).ok()?;
        let symbols = find_profiler_state_symbols(t.pid, &maps)?;
        // Both 0 until the extension has initialised, which sets the owner's first.
        let offset = t.mem.read_u64(symbols.offset).ok()? as i64;
        self.offset = (offset != 0).then_some(offset);
        let published = |addr: Option<u64>| {
            addr.and_then(|addr| t.mem.read_u64(addr).ok())
                .map(|o| o as i64)
                .filter(|o| *o != 0)
        };
        self.owner_offset = published(symbols.owner_offset);
        self.otel_offset = published(symbols.otel_offset);
        self.offset
    }

    /// The thread pointer (glibc's `pthread_t`) of a Ruby thread on native thread `nt`
    /// (`th->nt`; 0 before 3.2, where the thread pointer is a field of the Ruby thread
    /// itself), read now and kept for the samples that follow, which check it in their own
    /// call (`tag_read`): a kept one can be a dead thread's (see `Pointer`).
    /// Under M:N threads (3.3+, `RUBY_MN_THREADS=1`) a Ruby thread moves between native
    /// threads and has none while it waits (`th->nt` is null): then there is no pointer, as
    /// the native threads' `ruby_profiler_state` belong to whichever Ruby threads run there.
    fn thread_pointer_on<M: Memory>(&mut self, t: &Target<M>, thread: u64, nt: u64) -> Option<u64> {
        let l = t.layout;
        let tp_at = match (l.thread_pthread, l.native_thread_pthread) {
            (Some(off), _) => field(thread, off),
            (None, Some(off)) if is_heap_object(nt) => field(nt, off),
            _ => return None,
        };
        let tp = t.mem.read_u64(tp_at).ok().filter(|tp| *tp != 0)?;
        if self.pointers.len() >= 4096 {
            self.pointers.clear();
        }
        self.pointers.insert(thread, Pointer { nt, tp, tp_at });
        Some(tp)
    }

    /// The thread pointer of a Ruby thread now (its native thread read afresh on 3.2+).
    pub(super) fn thread_pointer<M: Memory>(&mut self, t: &Target<M>, thread: u64) -> Option<u64> {
        let nt = match t.layout.thread_nt {
            Some(off) => t.mem.read_u64(field(thread, off)).ok()?,
            None => 0,
        };
        self.thread_pointer_on(t, thread, nt)
    }

    /// The table Ruby thread `thread` publishes now (0: none) and its words (header and
    /// slots), read once per batch of captured samples; None when it cannot be read.
    pub(super) fn published_table<M: Memory>(
        &mut self,
        t: &Target<M>,
        thread: u64,
    ) -> Option<&(u64, Vec<u8>)> {
        if !self.published_now.contains_key(&thread) {
            let offset = self.offset?;
            let tp = self.thread_pointer(t, thread)?;
            let table = t.mem.read_u64(tp.wrapping_add_signed(offset)).ok()?;
            let words = if table == 0 {
                Vec::new()
            } else {
                // Not a table's header: kept as read, which no copy of a table equals.
                let header = t.mem.read_vec(table, HEADER_LEN).ok()?;
                match Header::parse(&header) {
                    Some(h) => t.mem.read_vec(table, h.table_len()).ok()?,
                    None => header,
                }
            };
            self.published_now.insert(thread, (table, words));
        }
        self.published_now.get(&thread)
    }

    /// See [`Spy::thread_tags`]: everything read now, apart from any sample.
    pub(super) fn thread_tags<M: Memory>(&mut self, d: &mut Decoder<M>, thread: u64) -> Tags {
        let t = d.target;
        let Some(offset) = self.offset(t) else {
            return Tags::default();
        };
        let nt = match t.layout.thread_nt {
            Some(nt) => t.mem.read_u64(field(thread, nt)).unwrap_or(0),
            None => 0,
        };
        let Some(tp) = self.thread_pointer_on(t, thread, nt) else {
            return Tags::default();
        };
        // A decoding held up past `TABLE_WINDOW` is not trusted, but one from a fresh read
        // of the pointer is, and is fast: the first had warmed the caches (the symbol table,
        // class names). A parked thread's snapshot came back untagged in CI, read beside
        // another run with a core kept busy: a snapshot takes 1.5 to 6 ms here when idle.
        let labels = self.fresh_labels(t, thread, tp);
        for _ in 0..TAG_ATTEMPTS {
            let pointer_read_at = ReadAt(Instant::now());
            let table = self.owned_pointer(t, thread, tp, offset);
            if table == 0 {
                return with_labels(Tags::default(), &labels);
            }
            if let Some((_, tags)) = d.read_table(table, pointer_read_at) {
                return with_labels(tags, &labels);
            }
            if pointer_read_at.decoded_in_time(Instant::now()) {
                break; // read in time, and not a table: no later read would differ
            }
        }
        with_labels(Tags::default(), &labels)
    }

    /// The pointer at `offset` from thread pointer `tp` (`ruby_profiler_state`'s, or
    /// `otel_thread_ctx_v1`'s) if it is Ruby thread `thread`'s (its owner, read before and
    /// after the pointer, says so both times; see profiler_state.c), else 0.
    pub(super) fn owned_pointer<M: Memory>(
        &self,
        t: &Target<M>,
        thread: u64,
        tp: u64,
        offset: i64,
    ) -> u64 {
        let owner_addr = self.owner_offset.map(|o| tp.wrapping_add_signed(o));
        // A failed read names no thread (0); a first owner that is not this thread's spares
        // the other reads.
        let owner = || owner_addr.map(|a| t.mem.read_u64(a).unwrap_or(0));
        let owner_before = owner();
        if owner_before.is_some_and(|o| o != thread) {
            return 0;
        }
        let pointer = t.mem.read_u64(tp.wrapping_add_signed(offset)).unwrap_or(0);
        let read = PointerRead {
            owner_before,
            pointer,
            owner_after: owner(),
        };
        read.table_for(thread)
    }

    /// What to read for a thread's tags along with the rest of a sample, given the target's
    /// `profiler_state_offset`: the owner and pointer on the native thread the Ruby thread was
    /// on last time (the sample also reads `th->nt`, and `sampled_tags` checks it is still the
    /// same), and the table it had then. Nothing to read for a thread not seen on a native
    /// thread yet: `sampled_tags` finds its pointer from the `th->nt` the sample read, so the
    /// sample's one call is never preceded by a read of its own. Each read is added to
    /// `reads`, the sample's batch, in that order (the owner before and after the pointer).
    pub(super) fn tag_read(&mut self, thread: u64, offset: i64, reads: &mut ReadBatch) -> TagRead {
        let Some(&Pointer { nt, tp, tp_at }) = self.pointers.get(&thread) else {
            return TagRead {
                nt: 0,
                offset,
                tp: 0,
                tp_again: Span::default(),
                owner: Span::default(),
                owner_again: Span::default(),
                pointer: None,
                last: None,
                pointer_again: None,
                pointer_at: 0,
                otel: None,
                otel_last: None,
                otel_again: None,
                otel_at: 0,
            };
        };
        // The owner before and after the pointer: see profiler_state.c.
        let owner_addr = self.owner_offset.map(|o| tp.wrapping_add_signed(o));
        let owner_read = |reads: &mut ReadBatch| match owner_addr {
            Some(addr) => reads.add(addr, 8),
            None => Span::default(),
        };
        let tp_again = reads.add(tp_at, 8);
        let owner = owner_read(reads);
        let pointer_at = tp.wrapping_add_signed(offset);
        let pointer = Some(reads.add(pointer_at, 8));
        let otel_at = self.otel_offset.map_or(0, |o| tp.wrapping_add_signed(o));
        let otel = self.otel_offset.map(|_| reads.add(otel_at, 8));
        let owner_again = owner_read(reads);
        let last = self.last.get(&thread).map(|l| (l.table, l.raw.len()));
        let otel_last =
            (self.last_records.get(&thread)).map(|l| (l.at, reads.add(l.at, l.raw.len())));
        TagRead {
            nt,
            offset,
            tp,
            tp_again,
            owner,
            owner_again,
            pointer,
            last: last.map(|(table, len)| (table, reads.add(table, len))),
            pointer_again: None,
            pointer_at,
            otel,
            otel_last,
            otel_again: None,
            otel_at,
        }
    }

    /// A thread's tags from what the sample read, `nt` being its `th->nt` in that same read
    /// (0 before 3.2) and `called` when that read began. When the pointer still holds the
    /// table of last time and that table's bytes read the same (and were decoded lately), the
    /// last decoding stands and the sample needed no read of its own for tags; otherwise the
    /// table is read and decoded now. A thread that moved to another native thread (M:N
    /// threads) has its pointer read there.
    pub(super) fn sampled_tags<M: Memory>(
        &mut self,
        d: &mut Decoder<M>,
        thread: u64,
        nt: u64,
        read: TagRead,
        reads: &ReadBatch,
        called: Instant,
    ) -> Tags {
        let late = read.read_late(nt, reads);
        let tags = self.sampled_table_tags(d, thread, nt, read, reads, called);
        let labels = self.sampled_labels(d.target, thread, late, &read, reads, called);
        with_labels(tags, &labels)
    }

    /// A thread's tags from its `ruby_profiler_state` table (see `sampled_tags`).
    fn sampled_table_tags<M: Memory>(
        &mut self,
        d: &mut Decoder<M>,
        thread: u64,
        nt: u64,
        read: TagRead,
        reads: &ReadBatch,
        called: Instant,
    ) -> Tags {
        let mut pointer_read_at = ReadAt(called);
        // 0 when the native thread's pointer is another Ruby thread's (M:N threads).
        let mut table = read.pointer.map_or(0, |p| {
            pointer_read(reads, read.owner, p, read.owner_again).table_for(thread)
        });
        let mut bytes = read.last.map(|(_, span)| reads.get(span));
        if read.read_late(nt, reads) {
            // Another native thread (M:N threads), or another Ruby thread that took this one's
            // address: what was read on the old pthread is not this thread's.
            self.pointers.remove(&thread);
            self.last.remove(&thread);
            bytes = None;
            pointer_read_at = ReadAt(Instant::now());
            table = match self.thread_pointer_on(d.target, thread, nt) {
                Some(tp) => self.owned_pointer(d.target, thread, tp, read.offset),
                None => 0, // waiting for a native thread: its tags are on none
            };
        }
        // The table of last time, unchanged: its decoding stands while fresh, and stands in
        // for a decoding that fails now (a value on a page Ruby 3.0/3.1's GC.compact has
        // protected for the moment).
        let same = match (&bytes, self.last.get(&thread)) {
            (Some(bytes), Some(last)) if last.table == table && *bytes == &last.raw[..] => {
                Some((last.tags.clone(), last.at.elapsed() < TAGS_TTL))
            }
            _ => None,
        };
        if let Some((tags, true)) = same {
            return tags;
        }
        if table == 0 {
            self.last.remove(&thread);
            return Tags::default();
        }
        let decoded = match d.read_table(table, pointer_read_at) {
            Some((raw, tags)) => Some((table, raw, tags)),
            None => match same {
                Some((tags, _)) => return tags,
                None => {
                    self.table_still_published(d, thread, nt, read.offset, table, pointer_read_at)
                }
            },
        };
        let Some((table, raw, tags)) = decoded else {
            self.last.remove(&thread);
            return Tags::default();
        };
        if self.last.len() >= 4096 {
            self.last.clear();
        }
        let last = LastTable {
            table,
            raw,
            tags: tags.clone(),
            at: Instant::now(),
        };
        self.last.insert(thread, last);
        tags
    }

    /// The table this sample's tags for `thread` came from (0: none), as `sampled_tags`
    /// left it.
    pub(super) fn sampled_table(&self, thread: u64) -> u64 {
        self.last.get(&thread).map_or(0, |l| l.table)
    }

    /// The OpenTelemetry record this sample's labels for `thread` came from (0: none).
    pub(super) fn sampled_record(&self, thread: u64) -> u64 {
        self.last_records.get(&thread).map_or(0, |l| l.at)
    }

    /// For each (Ruby thread, table, record), whether the thread's pointers, read again now
    /// (the owner around them, as `tag_read` reads them), still hold `table` and `record`
    /// (its OpenTelemetry record, 0 for none); all in one call. A
    /// thread whose native thread is not known has no pointer to hold anything: it holds 0.
    /// A table is never freed, nor its address reused, within the extension's grace period
    /// of its last publication, so the same address before and after means the same tags.
    pub(super) fn tables_unchanged<M: Memory>(
        &self,
        t: &Target<M>,
        offset: i64,
        threads: &[(u64, u64, u64)],
    ) -> Vec<bool> {
        let mut reads = ReadBatch::default();
        let spans: Vec<Option<[Span; 4]>> = threads
            .iter()
            .map(|(thread, _, _)| {
                let tp = self.pointers.get(thread)?.tp;
                let at = |reads: &mut ReadBatch, offset: Option<i64>| match offset {
                    Some(o) => reads.add(tp.wrapping_add_signed(o), 8),
                    None => Span::default(),
                };
                let before = at(&mut reads, self.owner_offset);
                let pointer = at(&mut reads, Some(offset));
                let record = at(&mut reads, self.otel_offset);
                Some([before, pointer, record, at(&mut reads, self.owner_offset)])
            })
            .collect();
        if reads.read(&t.mem).is_err() {
            return vec![false; threads.len()];
        }
        threads
            .iter()
            .zip(spans)
            .map(|(&(thread, table, record), spans)| {
                let Some([before, pointer, otel, after]) = spans else {
                    return table == 0 && record == 0;
                };
                let now = |p: Span| match p.is_empty() {
                    true => 0,
                    false => pointer_read(&reads, before, p, after).table_for(thread),
                };
                now(pointer) == table && now(otel) == record
            })
            .collect()
    }

    /// `table`, decoded again from a fresh read of its pointer, when the thread still
    /// publishes it and its pointer was first read less than `UNPUBLISHED_ALIVE` ago: for a
    /// decoding that failed. The usual cause is time: a process's first sample walks every
    /// thread with cold caches and finds the symbol table before it decodes, which took
    /// 8.3 ms, past `TABLE_WINDOW`, once per Puma worker under load. A table that is
    /// published at both pointer reads, less than the extension's grace period apart, is the
    /// same table throughout (it could not have been freed and its address reused between),
    /// so its tags are the ones the sample's stack ran under.
    fn table_still_published<M: Memory>(
        &mut self,
        d: &mut Decoder<M>,
        thread: u64,
        nt: u64,
        offset: i64,
        table: u64,
        first_read_at: ReadAt,
    ) -> Option<(u64, Vec<u8>, Tags)> {
        let tp = self.thread_pointer_on(d.target, thread, nt)?;
        let pointer_read_at = ReadAt(Instant::now());
        if !first_read_at.still_same_at(pointer_read_at.0)
            || self.owned_pointer(d.target, thread, tp, offset) != table
        {
            return None;
        }
        let (raw, tags) = d.read_table(table, pointer_read_at)?;
        Some((table, raw, tags))
    }

    /// Forgets the tables seen last (one may have been freed and unmapped, which would fail
    /// the sample's one call again).
    pub(super) fn forget_tables(&mut self) {
        self.last.clear();
        self.last_records.clear();
    }

    /// Forgets everything known per Ruby thread: their addresses may be other threads' by
    /// the time the spy samples again.
    pub(super) fn forget_threads(&mut self) {
        self.last.clear();
        self.last_records.clear();
        self.pointers.clear();
    }
}

/// A [`PointerRead`] from the spans of a batch: the owner before (empty: not published), the
/// pointer, the owner after.
pub(super) fn pointer_read(
    reads: &ReadBatch,
    before: Span,
    pointer: Span,
    after: Span,
) -> PointerRead {
    let owner = |span: Span| (!span.is_empty()).then(|| word(reads.get(span), 0));
    PointerRead {
        owner_before: owner(before),
        pointer: word(reads.get(pointer), 0),
        owner_after: owner(after),
    }
}
