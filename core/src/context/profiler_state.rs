//! The `ruby_profiler_state` table (docs/profiler-state.md): a header of two words, `size`
//! (pairs in use) and `capacity` (slots, a power of two), then `capacity` slots of two
//! words, an ID and a VALUE; an ID of 0 marks an empty slot. A pair's first slot is
//! `key & (capacity - 1)`, then the next free one (linear probing), so a reader in BPF can
//! look a key up in a bounded loop. Host byte order.
//!
//! The extension builds tables with [`encode`]; readers check a copied header with
//! [`Header::parse`] before they copy the slots, and take the pairs with [`pairs`].
use crate::memory::word;

/// Bytes of the header: `size`, `capacity`.
pub const HEADER_LEN: usize = 16;
/// Bytes of a slot: key (an ID), value (a VALUE).
pub const PAIR_LEN: usize = 16;
/// The largest capacity a reader accepts: the extension holds at most 1,024 tags, in 2,048
/// slots; a larger capacity is not a table it wrote.
pub const MAX_CAPACITY: u64 = 4096;

/// A table's header, as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub size: u64,
    pub capacity: u64,
}

impl Header {
    /// The header at the start of `raw`, if it can be a table's: a capacity that is a power
    /// of two up to [`MAX_CAPACITY`], no more pairs than slots.
    pub fn parse(raw: &[u8]) -> Option<Header> {
        if raw.len() < HEADER_LEN {
            return None;
        }
        let (size, capacity) = (word(raw, 0), word(raw, 8));
        let fits = capacity.is_power_of_two() && capacity <= MAX_CAPACITY && size <= capacity;
        fits.then_some(Header { size, capacity })
    }

    /// Bytes of the whole table: header and every slot.
    pub fn table_len(&self) -> usize {
        table_len(self.capacity)
    }
}

/// Bytes of a table of `capacity` slots.
pub const fn table_len(capacity: u64) -> usize {
    HEADER_LEN + PAIR_LEN * capacity as usize
}

/// The (key, value) pairs of a whole table's bytes, in slot order; None when the bytes are
/// not one table (a bad header, or not as long as its capacity says).
pub fn pairs(raw: &[u8]) -> Option<impl Iterator<Item = (u64, u64)> + '_> {
    let header = Header::parse(raw)?;
    if raw.len() != header.table_len() {
        return None;
    }
    let slots = raw[HEADER_LEN..].chunks_exact(PAIR_LEN);
    Some(
        slots
            .map(|slot| (word(slot, 0), word(slot, 8)))
            .filter(|&(key, _)| key != 0),
    )
}

/// Whether any slot of a whole table's bytes holds a pair (a table of no tags holds no
/// object a reader must find alive).
pub fn has_pairs(raw: &[u8]) -> bool {
    pairs(raw).is_some_and(|mut p| p.next().is_some())
}

/// A table holding `pairs` (keys not 0, each once), as words: capacity the smallest power
/// of two at least twice the pairs (at least 2), so a probe always ends at an empty slot.
pub fn encode(pairs: &[(u64, u64)]) -> Box<[u64]> {
    let capacity = (pairs.len() * 2).next_power_of_two().max(2);
    let mut table = vec![0u64; (table_len(capacity as u64)) / 8].into_boxed_slice();
    table[0] = pairs.len() as u64;
    table[1] = capacity as u64;
    let mask = capacity - 1;
    let slot_words = PAIR_LEN / 8;
    let first = HEADER_LEN / 8;
    for &(key, value) in pairs {
        let mut slot = (key as usize) & mask;
        while table[first + slot_words * slot] != 0 {
            slot = (slot + 1) & mask;
        }
        table[first + slot_words * slot] = key;
        table[first + slot_words * slot + 1] = value;
    }
    table
}

/// A table's words as bytes in host order, as a reader copies them.
pub fn to_bytes(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_ne_bytes()).collect()
}

/// The value of `key` in a whole table's bytes, found as a BPF program finds it: from the
/// key's first slot to the next empty one.
pub fn lookup(raw: &[u8], key: u64) -> Option<u64> {
    let header = Header::parse(raw)?;
    if raw.len() != header.table_len() || key == 0 {
        return None;
    }
    let mask = header.capacity - 1;
    let mut slot = key & mask;
    for _ in 0..header.capacity {
        let at = HEADER_LEN + PAIR_LEN * slot as usize;
        match word(raw, at) {
            0 => return None,
            k if k == key => return Some(word(raw, at + 8)),
            _ => slot = (slot + 1) & mask,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_gives_back_its_pairs_and_finds_each_by_probing() {
        // Keys that share a first slot (1, 9, 17 in 8 slots) probe onwards.
        let given = [(1, 100), (9, 900), (17, 1700), (4, 400)];
        let raw = to_bytes(&encode(&given));
        let header = Header::parse(&raw).unwrap();
        assert_eq!(
            header,
            Header {
                size: 4,
                capacity: 8
            }
        );
        assert_eq!(raw.len(), header.table_len());
        let mut got: Vec<_> = pairs(&raw).unwrap().collect();
        got.sort();
        let mut want = given.to_vec();
        want.sort();
        assert_eq!(got, want);
        for (key, value) in given {
            assert_eq!(lookup(&raw, key), Some(value), "key {key}");
        }
        assert_eq!(lookup(&raw, 25), None);
        assert!(has_pairs(&raw));
    }

    #[test]
    fn no_tags_is_a_table_of_two_empty_slots() {
        let raw = to_bytes(&encode(&[]));
        assert_eq!(
            Header::parse(&raw),
            Some(Header {
                size: 0,
                capacity: 2
            })
        );
        assert_eq!(pairs(&raw).unwrap().count(), 0);
        assert!(!has_pairs(&raw));
    }

    #[test]
    fn what_is_not_a_table_gives_no_pairs() {
        let good = to_bytes(&encode(&[(1, 2)]));
        let with_header = |size: u64, capacity: u64| {
            let mut raw = good.clone();
            raw[..8].copy_from_slice(&size.to_ne_bytes());
            raw[8..16].copy_from_slice(&capacity.to_ne_bytes());
            raw
        };
        // Not a power of two, none, too many pairs, too large.
        for (size, capacity) in [(1, 3), (0, 0), (3, 2), (1, MAX_CAPACITY * 2)] {
            assert!(
                Header::parse(&with_header(size, capacity)).is_none(),
                "{size}/{capacity}"
            );
        }
        // A header alone, or a table cut short or read too long.
        assert!(Header::parse(&good[..HEADER_LEN]).is_some());
        assert!(pairs(&good[..HEADER_LEN]).is_none());
        assert!(pairs(&good[..good.len() - 8]).is_none());
        assert!(pairs(&[good.clone(), vec![0; 16]].concat()).is_none());
        assert!(Header::parse(&good[..8]).is_none());
    }

    #[test]
    fn the_bpf_samplers_room_for_a_table_is_this_layout() {
        // core/bpf/sampler.h sizes its copy of a table in words: 2 + 2 * MAX_TAG_SLOTS.
        let header = include_str!("../../bpf/sampler.h");
        let define = |name: &str| {
            let line = header
                .lines()
                .find(|l| l.starts_with(&format!("#define {name} ")));
            line.unwrap_or_else(|| panic!("no {name}"))
                .split_whitespace()
                .skip(2)
                .collect::<String>()
        };
        let slots: u64 = define("MAX_TAG_SLOTS").parse().unwrap();
        assert_eq!(define("MAX_TAG_BYTES"), "((2+2*MAX_TAG_SLOTS)*8)");
        assert_eq!((2 + 2 * slots) * 8, table_len(slots) as u64);
    }
}
