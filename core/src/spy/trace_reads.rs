//! The tag reader's reads of OpenTelemetry records (spy/traces.rs says what a record gives
//! and why it can be trusted): for a snapshot, a fresh read through the thread's pointer;
//! for a sample, the pointer its batch read between the owner words, and the record of last
//! time kept while its bytes read the same.
use super::attach::Target;
use super::tags::{pointer_read, TagRead, TagReader, TAG_ATTEMPTS};
use super::traces::{read_record, Labels, LastRecord};
use crate::context::otel_thread::Drop;
use crate::context::ownership::ReadAt;
use crate::memory::{Memory, ReadBatch};
use std::time::Instant;

impl TagReader {
    /// The labels of the OpenTelemetry record Ruby thread `thread` (at thread pointer `tp`)
    /// publishes now, read afresh (none without one, or when it gives none: counted), for a
    /// snapshot.
    pub(super) fn fresh_labels<M: Memory>(
        &mut self,
        t: &Target<M>,
        thread: u64,
        tp: u64,
    ) -> Labels {
        let Some(otel) = self.otel_offset else {
            return Labels::default();
        };
        // As for the table (`thread_tags`): a record read too long after its pointer (the
        // reader descheduled, on a busy machine) is read again, pointer first.
        let mut dropped = None;
        for _ in 0..TAG_ATTEMPTS {
            let read_at = ReadAt(Instant::now());
            match self.owned_pointer(t, thread, tp, otel) {
                0 => return Labels::default(),
                at => match read_record(&t.mem, at, read_at) {
                    Ok((_, labels)) => return labels,
                    Err(Drop::Torn) => dropped = Some(Drop::Torn),
                    Err(reason) => {
                        dropped = Some(reason);
                        break;
                    }
                },
            }
        }
        if let Some(reason) = dropped {
            self.otel_drops.add(reason);
        }
        Labels::default()
    }

    /// The labels of a thread's OpenTelemetry record from what the sample read (`late`: the
    /// batch's pointer was not this thread's, and `sampled_table_tags` found its thread
    /// pointer again). The record of last time, read again in the batch and unchanged, keeps
    /// its labels; another is read now.
    pub(super) fn sampled_labels<M: Memory>(
        &mut self,
        t: &Target<M>,
        thread: u64,
        late: bool,
        read: &TagRead,
        reads: &ReadBatch,
        called: Instant,
    ) -> Labels {
        let Some(otel) = self.otel_offset else {
            return Labels::default();
        };
        let (at, read_at) = match (late, read.otel) {
            (false, Some(p)) => {
                let at = pointer_read(reads, read.owner, p, read.owner_again).table_for(thread);
                (at, ReadAt(called))
            }
            _ => {
                let read_at = ReadAt(Instant::now());
                let at = match self.pointers.get(&thread) {
                    Some(p) => self.owned_pointer(t, thread, p.tp, otel),
                    None => 0,
                };
                (at, read_at)
            }
        };
        if at == 0 {
            self.last_records.remove(&thread);
            return Labels::default();
        }
        if let (Some(last), Some((last_at, span)), false) =
            (self.last_records.get(&thread), read.otel_last, late)
        {
            if last.at == at && last_at == at && reads.get(span) == &last.raw[..] {
                return last.labels.clone();
            }
        }
        let mut result = read_record(&t.mem, at, read_at);
        if result == Err(Drop::Torn) {
            // Read too late after the batch's pointer (a process's first sample, with cold
            // caches): as for a table (`table_still_published`), a record the thread still
            // publishes less than the writer's grace period after that read is the same one.
            let now = ReadAt(Instant::now());
            let tp = self.pointers.get(&thread).map(|p| p.tp);
            if read_at.still_same_at(now.0)
                && tp.is_some_and(|tp| self.owned_pointer(t, thread, tp, otel) == at)
            {
                result = read_record(&t.mem, at, now);
            }
        }
        match result {
            Ok((raw, labels)) => {
                if self.last_records.len() >= 4096 {
                    self.last_records.clear();
                }
                let last = LastRecord {
                    at,
                    raw,
                    labels: labels.clone(),
                };
                self.last_records.insert(thread, last);
                labels
            }
            Err(reason) => {
                self.otel_drops.add(reason);
                self.last_records.remove(&thread);
                Labels::default()
            }
        }
    }
}
