//! The trace each thread works for, read from the OpenTelemetry record (OTEP 4947) its
//! `otel_thread_ctx_v1` points at: the rbspy_ext extension writes one per `RubySpy::State`
//! while its OpenTelemetry bridge is on, switches the pointer with `ruby_profiler_state`
//! under the same owner word, and never changes a record once published
//! (ext/rbspy_ext/src/otel.rs). So the tag reader (spy/tags.rs) reads the pointer with the
//! table's, under the same ownership rules (`crate::context::ownership`), and this reads
//! the record behind it and turns it into labels (`context::otel_thread::labels`).
//!
//! This reader reads a running thread, not a stopped one as the OTEP assumes. What keeps it
//! right: a record is never written in place, and one that stops being published lives on
//! with its State for the grace period, so a record read within `TABLE_WINDOW` of its
//! pointer is the one published then; a record decoded later, or whose `valid` is not 1, or
//! that cannot be read whole, gives no labels and a counted [`Drop`].
use crate::context::otel_thread::{labels, Drop, Head, HEAD_LEN};
use crate::context::ownership::ReadAt;
use crate::memory::Memory;
use crate::model::Tags;
use std::sync::Arc;
use std::time::Instant;

/// A record's labels.
pub(super) type Labels = Arc<[(Arc<str>, Arc<str>)]>;

/// What a thread's record was at its last sample: its address and bytes, and the labels.
#[derive(Debug)]
pub(super) struct LastRecord {
    pub at: u64,
    pub raw: Vec<u8>,
    pub labels: Labels,
}

/// Records that gave no labels, by reason.
#[derive(Debug, Default, Clone, Copy)]
pub struct Drops([u64; Drop::ALL.len()]);

impl Drops {
    pub fn add(&mut self, reason: Drop) {
        if let Some(i) = Drop::ALL.iter().position(|d| *d == reason) {
            self.0[i] += 1;
        }
    }

    /// Each reason with its count, those counted only.
    pub fn counts(&self) -> Vec<(&'static str, u64)> {
        (Drop::ALL.iter().zip(self.0))
            .filter(|(_, n)| *n > 0)
            .map(|(d, n)| (d.name(), n))
            .collect()
    }
}

/// Reads the record at `at`, whose pointer was read at `read_at`: its head, then its
/// attributes when it has some; and its labels.
pub(super) fn read_record<M: Memory>(
    mem: &M,
    at: u64,
    read_at: ReadAt,
) -> Result<(Vec<u8>, Labels), Drop> {
    let mut raw = vec![0u8; HEAD_LEN];
    mem.read(at, &mut raw).map_err(|_| Drop::Unreadable)?;
    let head = Head::parse(&raw)?;
    if head.record_len() > HEAD_LEN {
        raw = mem
            .read_vec(at, head.record_len())
            .map_err(|_| Drop::Unreadable)?;
    }
    let labels = record_labels(&raw)?;
    if !read_at.decoded_in_time(Instant::now()) {
        return Err(Drop::Torn); // it may have been freed, and its memory reused, meanwhile
    }
    Ok((raw, labels))
}

/// The labels of a whole record's bytes (read here, or copied by the BPF sampler with the
/// stack, in one pass on the interrupted thread).
pub(super) fn record_labels(raw: &[u8]) -> Result<Labels, Drop> {
    let found = labels(raw)?;
    Ok(found
        .into_iter()
        .map(|(k, v)| (Arc::from(k), Arc::from(v)))
        .collect())
}

/// `tags` with a record's labels after them.
pub(super) fn with_labels(tags: Tags, labels: &Labels) -> Tags {
    if labels.is_empty() {
        return tags;
    }
    tags.iter().chain(labels.iter()).cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::otel_thread::Record;

    #[test]
    fn drops_count_by_reason_and_labels_follow_the_tags() {
        let mut drops = Drops::default();
        drops.add(Drop::Torn);
        drops.add(Drop::Torn);
        drops.add(Drop::NotValid);
        assert_eq!(
            drops.counts(),
            vec![("not valid", 1), ("changed while read", 2)]
        );

        let (raw, _) = Record {
            trace_id: [1; 16],
            span_id: [2; 8],
            trace_flags: 1,
            attrs: vec![],
        }
        .encode();
        let labels = record_labels(&raw).unwrap();
        let tags: Tags = vec![(Arc::from("user"), Arc::from("42"))].into();
        let both = with_labels(tags.clone(), &labels);
        assert_eq!(both.len(), 3);
        assert_eq!(&*both[0].0, "user");
        assert_eq!(
            (&*both[1].0, &*both[1].1),
            ("trace id", "01010101010101010101010101010101")
        );
        assert_eq!(with_labels(tags.clone(), &Labels::default()), tags);
        let mut bad = raw.clone();
        bad[24] = 0;
        assert_eq!(record_labels(&bad), Err(Drop::NotValid));
    }
}
