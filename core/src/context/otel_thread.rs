//! OpenTelemetry's thread-local context record (OTEP 4947): what the thread-local
//! `otel_thread_ctx_v1` points at while a thread works for a trace. Packed, host byte
//! order, 2-byte aligned:
//!
//! | bytes | field |
//! |---|---|
//! | 0..16 | trace-id (W3C; zeroes: none) |
//! | 16..24 | span-id |
//! | 24 | valid: 1, anything else means "ignore this record" |
//! | 25 | trace-flags (W3C) |
//! | 26..28 | attrs-data-size (u16) |
//! | 28.. | attrs-data: entries of {key index u8, length u8, UTF-8 bytes} |
//!
//! A key index names an attribute through the process context's
//! `threadlocal.attribute_key_map` (super::otel_process); the last entry of a key wins. The
//! whole record is kept at or under [`MAX_RECORD_LEN`] bytes, the OTel eBPF profiler's
//! limit. A reader reads the 28-byte head ([`Head::parse`]), then `attrs-data-size` bytes
//! ([`attrs`]).
//!
//! The extension writes records with [`Record::encode`]; the user-space and BPF samplers
//! decode them here, and every record that gives no context, or an attribute that gives no
//! label, has a [`Drop`] reason that the samplers count.

/// Bytes before the attributes: trace-id, span-id, valid, trace-flags, attrs-data-size.
pub const HEAD_LEN: usize = 28;
/// The most bytes a record may take, head included (OTEP 4947's recommendation, the OTel
/// eBPF profiler's limit); a record saying it has more is not read.
pub const MAX_RECORD_LEN: usize = 640;
/// The most bytes of attributes a record may hold.
pub const MAX_ATTRS_LEN: usize = MAX_RECORD_LEN - HEAD_LEN;
/// The longest value an entry can hold (its length is one byte).
pub const MAX_VALUE_LEN: usize = u8::MAX as usize;

/// The first entries of the key map rbspy_ext publishes, the same in every process: the
/// record's own attributes (the extension appends tag names after them).
pub const ENDPOINT_KEY: (u8, &str) = (0, "trace endpoint");
pub const LOCAL_ROOT_KEY: (u8, &str) = (1, "local root span id");

/// The labels a sample gets from a record, under Datadog's names (its Ruby profiler's
/// pprof labels, which backends that link traces to profiles already read; Pyroscope's
/// `span_id` is the local root's id, so it is a relabel away).
pub const TRACE_ID_LABEL: &str = "trace id";
pub const SPAN_ID_LABEL: &str = "span id";
pub const LOCAL_ROOT_LABEL: &str = "local root span id";
pub const ENDPOINT_LABEL: &str = "trace endpoint";

const VALID: usize = 24;
const FLAGS: usize = 25;
/// Where attrs-data-size (u16) is in the head (the BPF sampler reads it there).
pub const ATTRS_SIZE_AT: usize = 26;

/// Why a record gives no context, or an attribute no label: counted by the samplers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Drop {
    /// `valid` was not 1: the writer is updating the record, or it is not one.
    NotValid,
    /// `attrs-data-size` says more than [`MAX_ATTRS_LEN`].
    TooLong,
    /// The record could not be read whole (past its mapping, or unmapped).
    Unreadable,
    /// The record, or the pointer to it, changed while it was read.
    Torn,
    /// An attribute's key index is not in the process context's key map.
    UnknownKey,
    /// An attribute's value is not UTF-8.
    NotUtf8,
}

impl Drop {
    /// Every reason, in a fixed order (for tables of counts).
    pub const ALL: [Drop; 6] = [
        Drop::NotValid,
        Drop::TooLong,
        Drop::Unreadable,
        Drop::Torn,
        Drop::UnknownKey,
        Drop::NotUtf8,
    ];

    /// Its name in counts and notes.
    pub fn name(self) -> &'static str {
        match self {
            Drop::NotValid => "not valid",
            Drop::TooLong => "attributes too long",
            Drop::Unreadable => "unreadable",
            Drop::Torn => "changed while read",
            Drop::UnknownKey => "unknown key index",
            Drop::NotUtf8 => "value not UTF-8",
        }
    }
}

/// A record's head, as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub trace_flags: u8,
    /// Bytes of attributes that follow the head.
    pub attrs_len: usize,
}

impl Head {
    /// The head at the start of `raw` (at least [`HEAD_LEN`] bytes), if the record is
    /// valid and its attributes fit [`MAX_RECORD_LEN`].
    pub fn parse(raw: &[u8]) -> Result<Head, Drop> {
        let head = raw.get(..HEAD_LEN).ok_or(Drop::Unreadable)?;
        if head[VALID] != 1 {
            return Err(Drop::NotValid);
        }
        let attrs_len = u16::from_ne_bytes([head[ATTRS_SIZE_AT], head[ATTRS_SIZE_AT + 1]]) as usize;
        if attrs_len > MAX_ATTRS_LEN {
            return Err(Drop::TooLong);
        }
        let mut trace_id = [0; 16];
        trace_id.copy_from_slice(&head[..16]);
        let mut span_id = [0; 8];
        span_id.copy_from_slice(&head[16..24]);
        Ok(Head {
            trace_id,
            span_id,
            trace_flags: head[FLAGS],
            attrs_len,
        })
    }

    /// Whether the record names a trace (a trace-id of zeroes names none: a record that
    /// carries attributes only).
    pub fn has_trace(&self) -> bool {
        self.trace_id != [0; 16]
    }

    /// Bytes of the whole record.
    pub fn record_len(&self) -> usize {
        HEAD_LEN + self.attrs_len
    }
}

/// The entries of `attrs-data`, in order: (key index, value bytes). Stops at an entry the
/// bytes cannot hold whole, as the OTEP tells readers to.
pub fn attrs(data: &[u8]) -> impl Iterator<Item = (u8, &[u8])> + '_ {
    let mut rest = data;
    std::iter::from_fn(move || {
        let (&[key, len], after) = rest.split_first_chunk::<2>()?;
        let value = after.get(..len as usize)?;
        rest = &after[len as usize..];
        Some((key, value))
    })
}

/// A record as the extension builds it, or as a reader decoded it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Record {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub trace_flags: u8,
    /// (key index, value), in the order written; a later entry of a key wins.
    pub attrs: Vec<(u8, String)>,
}

impl Record {
    /// The record's bytes, valid. A value longer than [`MAX_VALUE_LEN`] is cut at a
    /// character boundary within it; an entry that would take the record past
    /// [`MAX_RECORD_LEN`] is left out, and so are those after it (their count is returned),
    /// so a reader never meets a record it must refuse.
    pub fn encode(&self) -> (Vec<u8>, usize) {
        let mut out = Vec::with_capacity(HEAD_LEN + 64);
        out.extend_from_slice(&self.trace_id);
        out.extend_from_slice(&self.span_id);
        out.push(1);
        out.push(self.trace_flags);
        out.extend_from_slice(&[0, 0]);
        let mut left_out = 0;
        for (key, value) in &self.attrs {
            let value = cut(value, MAX_VALUE_LEN);
            if left_out > 0 || out.len() + 2 + value.len() > MAX_RECORD_LEN {
                left_out += 1;
                continue;
            }
            out.push(*key);
            out.push(value.len() as u8);
            out.extend_from_slice(value.as_bytes());
        }
        let size = (out.len() - HEAD_LEN) as u16;
        out[ATTRS_SIZE_AT..HEAD_LEN].copy_from_slice(&size.to_ne_bytes());
        (out, left_out)
    }

    /// The record in `raw` (its head and at least its attributes), with the entries whose
    /// values are not UTF-8 left out and counted.
    pub fn decode(raw: &[u8]) -> Result<(Record, usize), Drop> {
        let head = Head::parse(raw)?;
        let data = raw
            .get(HEAD_LEN..head.record_len())
            .ok_or(Drop::Unreadable)?;
        let mut not_utf8 = 0;
        let attrs = attrs(data)
            .filter_map(|(key, value)| match std::str::from_utf8(value) {
                Ok(text) => Some((key, text.to_string())),
                Err(_) => {
                    not_utf8 += 1;
                    None
                }
            })
            .collect();
        let record = Record {
            trace_id: head.trace_id,
            span_id: head.span_id,
            trace_flags: head.trace_flags,
            attrs,
        };
        Ok((record, not_utf8))
    }

    /// The attributes by name through the process context's key map, the last entry of a
    /// key winning, in key-map order; and how many entries named no key in `key_map` (a
    /// reader that meets one reads the map again first, as the OTEP says).
    pub fn named<'a>(&'a self, key_map: &'a [String]) -> (Vec<(&'a str, &'a str)>, usize) {
        let mut unknown = 0;
        let mut latest: Vec<Option<&str>> = vec![None; key_map.len()];
        for (key, value) in &self.attrs {
            match latest.get_mut(*key as usize) {
                Some(slot) => *slot = Some(value),
                None => unknown += 1,
            }
        }
        let named = (key_map.iter().zip(latest))
            .filter_map(|(name, value)| Some((name.as_str(), value?)))
            .collect();
        (named, unknown)
    }
}

/// The labels of a record rbspy_ext wrote (`raw`: its head and attributes): the trace and
/// span ids as hex when it names a trace, and the endpoint and local root span id when it
/// has them (the key map's first entries, [`ENDPOINT_KEY`] and [`LOCAL_ROOT_KEY`]). Its other
/// attributes are the tags `ruby_profiler_state` gives already.
pub fn labels(raw: &[u8]) -> Result<Vec<(&'static str, String)>, Drop> {
    let (record, _) = Record::decode(raw)?;
    let mut out = Vec::with_capacity(4);
    if record.trace_id != [0; 16] {
        out.push((TRACE_ID_LABEL, hex(&record.trace_id)));
        out.push((SPAN_ID_LABEL, hex(&record.span_id)));
    }
    let last = |key: u8| (record.attrs.iter().rev()).find(|(k, _)| *k == key);
    if let Some((_, root)) = last(LOCAL_ROOT_KEY.0) {
        out.push((LOCAL_ROOT_LABEL, root.clone()));
    }
    if let Some((_, endpoint)) = last(ENDPOINT_KEY.0) {
        out.push((ENDPOINT_LABEL, endpoint.clone()));
    }
    Ok(out)
}

/// The longest start of `text` of at most `max` bytes that ends at a character boundary.
fn cut(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let end = (0..=max)
        .rev()
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(0);
    &text[..end]
}

/// A W3C id as lower-case hex, as traces name it (`hex_trace_id`, Jaeger, Tempo).
pub fn hex(id: &[u8]) -> String {
    // By hand: the extension makes one for each span a context names, and `format!` per
    // byte was a tenth of that.
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(id.len() * 2);
    for b in id {
        out.push(DIGITS[(b >> 4) as usize] as char);
        out.push(DIGITS[(b & 15) as usize] as char);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(attrs: &[(u8, &str)]) -> Record {
        Record {
            trace_id: *b"0123456789abcdef",
            span_id: *b"spanid!!",
            trace_flags: 1,
            attrs: attrs.iter().map(|(k, v)| (*k, v.to_string())).collect(),
        }
    }

    #[test]
    fn a_record_reads_back_as_written_at_the_otep_offsets() {
        let written = record(&[(0, "UsersController#show"), (2, "GET")]);
        let (raw, left_out) = written.encode();
        assert_eq!(left_out, 0);
        // The OTEP's layout, byte by byte: 28 bytes of head, then {key, length, bytes}.
        assert_eq!(&raw[..16], b"0123456789abcdef");
        assert_eq!(&raw[16..24], b"spanid!!");
        assert_eq!((raw[24], raw[25]), (1, 1));
        let size = u16::from_ne_bytes([raw[26], raw[27]]) as usize;
        assert_eq!(size, 2 + 20 + 2 + 3);
        assert_eq!(raw.len(), HEAD_LEN + size);
        assert_eq!(&raw[28..30], &[0, 20]);
        let (read, not_utf8) = Record::decode(&raw).unwrap();
        assert_eq!((read, not_utf8), (written, 0));
        assert_eq!(hex(b"\x00\xab\x10"), "00ab10");
        assert!(Head::parse(&raw).unwrap().has_trace());
    }

    #[test]
    fn names_come_from_the_key_map_and_the_last_entry_wins() {
        let keys: Vec<String> = ["endpoint", "tenant"].map(String::from).to_vec();
        let r = record(&[(1, "a"), (0, "x"), (1, "b"), (7, "?")]);
        let (named, unknown) = r.named(&keys);
        assert_eq!(named, vec![("endpoint", "x"), ("tenant", "b")]);
        assert_eq!(unknown, 1);
    }

    #[test]
    fn a_record_never_outgrows_the_limit_and_values_are_cut_at_a_character() {
        // 300 bytes of 'é' (2 bytes each): cut to 254 bytes, not into a character.
        let long = "é".repeat(150);
        let (raw, left_out) = record(&[(0, &long)]).encode();
        assert_eq!((raw[29] as usize, left_out), (254, 0));
        assert_eq!(Record::decode(&raw).unwrap().0.attrs[0].1, "é".repeat(127));
        // Three entries of 257 bytes fit 640 twice: the third, and what follows, left out.
        let v = "v".repeat(255);
        let (raw, left_out) = record(&[(0, &v), (1, &v), (2, &v), (3, "x")]).encode();
        assert_eq!((raw.len(), left_out), (HEAD_LEN + 2 * 257, 2));
        let (raw, _) = record(&[
            (0, &"w".repeat(255)),
            (1, &"w".repeat(255)),
            (2, "w".repeat(80).as_str()),
        ])
        .encode();
        assert!(raw.len() <= MAX_RECORD_LEN, "{}", raw.len());
    }

    #[test]
    fn what_is_not_a_whole_valid_record_gives_its_reason() {
        let (good, _) = record(&[(0, "route")]).encode();
        let with = |at: usize, bytes: &[u8]| {
            let mut raw = good.clone();
            raw[at..at + bytes.len()].copy_from_slice(bytes);
            raw
        };
        assert_eq!(Head::parse(&with(24, &[0])), Err(Drop::NotValid));
        assert_eq!(Head::parse(&with(24, &[2])), Err(Drop::NotValid));
        let too_long = (MAX_ATTRS_LEN as u16 + 1).to_ne_bytes();
        assert_eq!(Head::parse(&with(26, &too_long)), Err(Drop::TooLong));
        assert_eq!(Head::parse(&good[..27]), Err(Drop::Unreadable));
        assert_eq!(
            Record::decode(&good[..good.len() - 1]),
            Err(Drop::Unreadable)
        );
        // A value that is not UTF-8 is left out and counted; the rest stands.
        let (mixed, _) = record(&[(0, "ok"), (1, "zz")]).encode();
        let mut mixed = mixed;
        let n = mixed.len();
        mixed[n - 2..].copy_from_slice(&[0xff, 0xfe]);
        let (r, not_utf8) = Record::decode(&mixed).unwrap();
        assert_eq!((r.attrs, not_utf8), (vec![(0, "ok".to_string())], 1));
    }

    #[test]
    fn a_records_labels_are_its_ids_in_hex_its_endpoint_and_its_root() {
        let (raw, _) =
            record(&[(1, "00aa00aa00aa00aa"), (0, "GET /users/:id"), (2, "acme")]).encode();
        let got = labels(&raw).unwrap();
        assert_eq!(
            got,
            vec![
                (TRACE_ID_LABEL, hex(b"0123456789abcdef")),
                (SPAN_ID_LABEL, hex(b"spanid!!")),
                (LOCAL_ROOT_LABEL, "00aa00aa00aa00aa".to_string()),
                (ENDPOINT_LABEL, "GET /users/:id".to_string()),
            ]
        );
        // Tags alone, no trace: no ids.
        let mut bare = record(&[(2, "acme")]);
        (bare.trace_id, bare.span_id) = ([0; 16], [0; 8]);
        assert_eq!(labels(&bare.encode().0).unwrap(), vec![]);
    }

    #[test]
    fn an_entry_cut_short_ends_the_attributes() {
        // {0, 2, "ab"}, then a key with a length of 5 and 2 bytes left.
        let data = [0, 2, b'a', b'b', 1, 5, b'c', b'd'];
        let got: Vec<_> = attrs(&data).collect();
        assert_eq!(got, vec![(0, &b"ab"[..])]);
        assert_eq!(attrs(&[3]).count(), 0);
        assert_eq!(attrs(&[3, 0]).collect::<Vec<_>>(), vec![(3, &b""[..])]);
    }
}
