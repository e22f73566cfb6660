//! Decoding a `ruby_profiler_state` table read from the target (its layout is
//! `crate::context::profiler_state`): its keys, IDs, through the target's symbol table, and
//! its values as text, through the walker's caches. spy/tags.rs reads the tables; this is
//! what turns their bytes into tags, for samples, snapshots and the BPF sampler's copies.
use super::attach::Target;
use super::cache::Cache;
use crate::context::ownership::ReadAt;
use crate::context::profiler_state::{self, Header, HEADER_LEN, PAIR_LEN};
use crate::memory::Memory;
use crate::model::Tags;
use std::sync::Arc;
use std::time::Instant;

/// Slots read with a table's header on the first try: tables of up to 4 tags in one read.
const FIRST_SLOTS: usize = 8;

/// What decoding a table needs besides its bytes: the target, and the symbol table and
/// class names the walker caches too (a tag's key is an ID, its value may be a Symbol or an
/// object of a named class).
pub(super) struct Decoder<'a, M: Memory> {
    pub(super) target: &'a Target<M>,
    pub(super) cache: &'a mut Cache,
}

impl<M: Memory> Decoder<'_, M> {
    /// Reads and decodes the table at `table`, whose pointer was read at `pointer_read_at`:
    /// its bytes (header and every slot) and its tags. None when it does not read as a
    /// table, when a value cannot be read now, or when the decoding ended outside
    /// `TABLE_WINDOW`. Small tables take one read.
    pub(super) fn read_table(
        &mut self,
        table: u64,
        pointer_read_at: ReadAt,
    ) -> Option<(Vec<u8>, Tags)> {
        let mut raw = vec![0u8; HEADER_LEN + PAIR_LEN * FIRST_SLOTS];
        if self.target.mem.read(table, &mut raw).is_err() {
            // Maybe a small table near the end of a mapping: the header alone.
            raw.truncate(HEADER_LEN);
            self.target.mem.read(table, &mut raw).ok()?;
        }
        let len = Header::parse(&raw)?.table_len();
        if raw.len() < len {
            raw = self.target.mem.read_vec(table, len).ok()?;
        } else {
            raw.truncate(len);
        }
        let tags = self.decode(&raw)?;
        if !pointer_read_at.decoded_in_time(Instant::now()) {
            return None; // the table may have been freed and reused meanwhile
        }
        Some((raw, tags))
    }

    /// The tags of a table's bytes (header and every slot), read by whoever read them (the
    /// sampler's call, or the BPF sampler in the same pass as the stack). None when they do
    /// not make a table, or a key is not an ID or a value cannot be read now.
    pub(super) fn decode(&mut self, raw: &[u8]) -> Option<Tags> {
        let size = Header::parse(raw)?.size;
        let mut out = Vec::with_capacity(size as usize);
        for (key, value) in profiler_state::pairs(raw)? {
            let Some(name) = self.id_name(key) else {
                return None; // not an ID of this process: the table changed under us
            };
            let text = self.value_text(value)?;
            out.push((name, text));
        }
        Some(out.into())
    }

    fn id_name(&mut self, id: u64) -> Option<Arc<str>> {
        let t = self.target;
        let symbols = t.symbol_table(&mut self.cache.symbols).ok()?;
        symbols.name(&t.mem, t.layout, id).ok()
    }

    /// A VALUE as text (`values::value_text`); None when it cannot be read now.
    fn value_text(&mut self, v: u64) -> Option<Arc<str>> {
        let t = self.target;
        let symbols = self.cache.symbols.as_mut();
        super::values::value_text(&t.mem, t.layout, symbols, &mut self.cache.classes, v)
    }
}
