//! The sampled live set as a tracking process publishes it for readers outside
//! (docs/allocations-state.md): the extension's tracker keeps its sites and live samples in
//! its own memory; once a second, when they changed, it writes them here as one JSON blob
//! and points the exported `rbspy_ext_allocations_state` header at it. `rubyspy heap --by
//! site` reads the header and the blob with `process_vm_readv` (never writing, never
//! stopping the target) and joins them with the census (core/src/heap_sites.rs).
//!
//! The header is four words: a magic that is also the format's version, a sequence number
//! that is odd while the tracker rewrites the header, the blob's address and its length. A
//! reader takes the header, the blob, then the header again, and keeps the blob only when
//! the sequence read the same and even both times. The tracker keeps the blob before
//! the current one alive, so a reader that loses the race reads old bytes and tries again
//! (and one held up through two publications gets a failed read, never a fault).
//!
//! Why JSON: the blob is written at most once a second, read rarely, and its reader must
//! reject anything malformed, which serde does; a site's frames are names, not the target's
//! VALUEs, so the reader needs no layout to print them.
use super::{AllocProfile, SiteCounts};
use crate::memory::{word, Memory};
use crate::model::Frame;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// The exported symbol of the header, in any mapped `rbspy_ext*.so`.
pub const SYMBOL: &str = "rbspy_ext_allocations_state";
/// "RBSPYAL1" read as a little-endian word: the header of this format.
pub const MAGIC: u64 = u64::from_le_bytes(*b"RBSPYAL1");
/// Bytes of the header: magic, sequence, address, length.
pub const HEADER_BYTES: usize = 32;
/// A blob larger than this is not one the tracker wrote (its bounds keep it far smaller).
pub const MAX_BLOB: u64 = 256 << 20;
/// Reads of a header that keeps changing before the reader gives up.
const ATTEMPTS: usize = 8;

/// One sampled object the tracker follows: its address, its site (an index into
/// `profile.sites`), its slot bytes, how many samples it stands for, and the rate its point
/// was drawn with (above the profile's under a cap on samples a second; 0, or absent from a
/// blob of an older tracker: the profile's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveSample {
    pub address: u64,
    pub site: u32,
    pub size: u32,
    pub times: u32,
    #[serde(default)]
    pub rate: u64,
}

/// What the tracker publishes: its profile with names, each site's class (the address of
/// the class object) and built-in type, and the objects it still follows.
#[derive(Debug, Clone, PartialEq)]
pub struct LiveSet {
    /// Whether the tracker was running when it published (it keeps its last set after
    /// `stop`).
    pub tracking: bool,
    /// When it published (Unix epoch, ms).
    pub published_at_ms: u64,
    pub profile: AllocProfile,
    /// Per site: the address of its class (0: none) and its type (`flags & 0x1f`).
    pub site_classes: Vec<(u64, u8)>,
    pub live: Vec<LiveSample>,
}

/// The blob's JSON: frames as rows, so the model's types need no serde of their own.
#[derive(Serialize, Deserialize)]
struct Wire {
    tracking: bool,
    published_at_ms: u64,
    pid: i32,
    ruby_version: String,
    rate_bytes: u64,
    start_unix_ns: u64,
    duration_ns: u64,
    /// `[label, base_label, path, absolute_path, lineno, c_function]`.
    frames: Vec<(String, String, String, Option<String>, i32, bool)>,
    sites: Vec<WireSite>,
    notes: Vec<String>,
    live: Vec<LiveSample>,
}

/// A site as published: its counts, with its class's address and type beside them, which
/// the reader checks each live sample's slot against.
#[derive(Serialize, Deserialize)]
struct WireSite {
    #[serde(flatten)]
    counts: SiteCounts,
    class_address: u64,
    type_id: u8,
}

impl LiveSet {
    /// The blob the tracker publishes.
    pub fn encode(&self) -> Vec<u8> {
        let p = &self.profile;
        let wire = Wire {
            tracking: self.tracking,
            published_at_ms: self.published_at_ms,
            pid: p.pid,
            ruby_version: p.ruby_version.clone(),
            rate_bytes: p.rate_bytes,
            start_unix_ns: p.start_unix_ns,
            duration_ns: p.duration_ns,
            frames: (p.frames.iter())
                .map(|f| {
                    (
                        f.label.to_string(),
                        f.base_label.to_string(),
                        f.path.to_string(),
                        f.absolute_path.as_deref().map(str::to_string),
                        f.lineno,
                        f.c_function,
                    )
                })
                .collect(),
            sites: (p.sites.iter().zip(&self.site_classes))
                .map(|(s, &(class_address, type_id))| WireSite {
                    counts: s.clone(),
                    class_address,
                    type_id,
                })
                .collect(),
            notes: p.notes.clone(),
            live: self.live.clone(),
        };
        serde_json::to_vec(&wire).unwrap_or_default()
    }

    /// A blob read back, checked: every frame and site index in range.
    pub fn decode(bytes: &[u8]) -> Result<LiveSet, String> {
        let wire: Wire = serde_json::from_slice(bytes)
            .map_err(|e| format!("the published allocations do not parse: {e}"))?;
        let frames = (wire.frames.into_iter())
            .map(|(label, base, path, absolute, lineno, c_function)| Frame {
                label: Arc::from(label),
                base_label: Arc::from(base),
                path: Arc::from(path),
                absolute_path: absolute.map(Arc::from),
                lineno,
                c_function,
            })
            .collect();
        let mut site_classes = Vec::with_capacity(wire.sites.len());
        let sites = (wire.sites.into_iter())
            .map(|s| {
                site_classes.push((s.class_address, s.type_id));
                s.counts
            })
            .collect();
        let set = LiveSet {
            tracking: wire.tracking,
            published_at_ms: wire.published_at_ms,
            profile: AllocProfile {
                pid: wire.pid,
                ruby_version: wire.ruby_version,
                rate_bytes: wire.rate_bytes.max(1),
                start_unix_ns: wire.start_unix_ns,
                duration_ns: wire.duration_ns,
                frames,
                sites,
                notes: wire.notes,
            },
            site_classes,
            live: wire.live,
        };
        set.profile.check()?;
        let sites = set.profile.sites.len();
        if let Some(s) = set.live.iter().find(|s| s.site as usize >= sites) {
            return Err(format!("a live sample names site {} of {sites}", s.site));
        }
        Ok(set)
    }
}

/// Why no live set could be read from a process that has the extension loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unpublished {
    /// The header is there, but nothing was ever published (tracking never ran long enough,
    /// or never ran).
    Nothing,
    /// The header or the blob is not what the tracker writes (another version of the gem).
    Malformed(String),
    /// The tracker rewrote it on every attempt, or it did not read.
    Unreadable(String),
}

/// Reads the live set published at `header` (the address of [`SYMBOL`] in the target).
pub fn read<M: Memory>(mem: &M, header: u64) -> Result<LiveSet, Unpublished> {
    let mut last = String::new();
    for _ in 0..ATTEMPTS {
        let head = read_header(mem, header)?;
        let (seq, data, len) = (word(&head, 8), word(&head, 16), word(&head, 24));
        if seq == 0 || data == 0 {
            return Err(Unpublished::Nothing);
        }
        if seq % 2 == 1 {
            std::thread::yield_now();
            continue;
        }
        if len > MAX_BLOB {
            return Err(Unpublished::Malformed(format!(
                "a blob of {len} bytes is not one the tracker writes"
            )));
        }
        let blob = mem.read_vec(data, len as usize);
        let again = read_header(mem, header)?;
        if word(&again, 8) != seq {
            last = "the tracker published again while it was read".into();
            continue;
        }
        let blob = blob.map_err(|e| Unpublished::Unreadable(e.to_string()))?;
        return LiveSet::decode(&blob).map_err(Unpublished::Malformed);
    }
    Err(Unpublished::Unreadable(last))
}

fn read_header<M: Memory>(mem: &M, header: u64) -> Result<[u8; HEADER_BYTES], Unpublished> {
    let mut head = [0u8; HEADER_BYTES];
    mem.read(header, &mut head)
        .map_err(|e| Unpublished::Unreadable(e.to_string()))?;
    if word(&head, 0) != MAGIC {
        return Err(Unpublished::Malformed(format!(
            "the header's magic is {:#x}, not this gem's {MAGIC:#x} (another version of rbspy_ext?)",
            word(&head, 0)
        )));
    }
    Ok(head)
}

/// Which published samples still hold an object of their site's class and type, read now
/// with one batch of 16-byte reads (`flags` and `klass`): the tracker learns of frees only
/// at each GC's marking, the heap changes in between. A slot freed and reused by an object
/// of the same class and type reads as alive (as between two GCs, a sampling estimate).
pub fn still_there<M: Memory>(mem: &M, set: &LiveSet) -> Vec<bool> {
    let mut bufs = vec![[0u8; 16]; set.live.len()];
    let mut requests: Vec<(u64, &mut [u8])> = (set.live.iter().zip(bufs.iter_mut()))
        .map(|(s, b)| (s.address, &mut b[..]))
        .collect();
    let read = mem.read_each(&mut requests);
    (set.live.iter().zip(bufs.iter()).zip(read))
        .map(|((s, b), ok)| {
            let (class, type_id) = set.site_classes[s.site as usize];
            ok && word(b, 0) as u8 & 0x1f == type_id && word(b, 8) == class
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryImage;

    fn sample_set() -> LiveSet {
        let frame = |label: &str, line| Frame {
            label: Arc::from(label),
            base_label: Arc::from(label),
            path: Arc::from("app.rb"),
            absolute_path: Some(Arc::from("/srv/app.rb")),
            lineno: line,
            c_function: false,
        };
        let mut site = SiteCounts {
            frames: vec![0, 1],
            class: "String".into(),
            type_name: "T_STRING".into(),
            ..SiteCounts::default()
        };
        site.add(40, 1);
        site.add(40, 1);
        LiveSet {
            tracking: true,
            published_at_ms: 1,
            profile: AllocProfile {
                pid: 7,
                ruby_version: "3.3.8".into(),
                rate_bytes: 1,
                frames: vec![frame("leak", 3), frame("<main>", 9)],
                sites: vec![site],
                ..AllocProfile::default()
            },
            site_classes: vec![(0x5000, 5)],
            live: vec![
                LiveSample {
                    address: 0x1000,
                    site: 0,
                    size: 40,
                    times: 1,
                    rate: 0,
                },
                LiveSample {
                    address: 0x1028,
                    site: 0,
                    size: 40,
                    times: 1,
                    rate: 0,
                },
            ],
        }
    }

    fn header(image: &mut MemoryImage, at: u64, seq: u64, data: u64, len: u64) {
        let mut h = Vec::new();
        for w in [MAGIC, seq, data, len] {
            h.extend_from_slice(&w.to_le_bytes());
        }
        image.map(at, h);
    }

    #[test]
    fn allocs_published_set_round_trips_and_reads_through_its_header() {
        let set = sample_set();
        let blob = set.encode();
        assert_eq!(LiveSet::decode(&blob).unwrap(), set);
        let mut image = MemoryImage::new();
        image.map(0x9000, blob.clone());
        header(&mut image, 0x100, 4, 0x9000, blob.len() as u64);
        assert_eq!(read(&image, 0x100).unwrap(), set);
        // Odd forever: the tracker never finished writing.
        header(&mut image, 0x100, 5, 0x9000, blob.len() as u64);
        assert!(matches!(
            read(&image, 0x100),
            Err(Unpublished::Unreadable(_))
        ));
        header(&mut image, 0x100, 0, 0, 0);
        assert_eq!(read(&image, 0x100), Err(Unpublished::Nothing));
        header(&mut image, 0x100, 2, 0x9000, MAX_BLOB + 1);
        assert!(matches!(
            read(&image, 0x100),
            Err(Unpublished::Malformed(_))
        ));
        image.map(0x200, vec![0; 32]);
        assert!(matches!(
            read(&image, 0x200),
            Err(Unpublished::Malformed(_))
        ));
    }

    #[test]
    fn allocs_published_blobs_with_indexes_out_of_range_are_refused() {
        let mut set = sample_set();
        set.live[1].site = 3;
        assert!(LiveSet::decode(&set.encode()).is_err());
        let mut set = sample_set();
        set.profile.sites[0].frames.push(9);
        assert!(LiveSet::decode(&set.encode()).is_err());
        assert!(LiveSet::decode(b"{\"tracking\":1}").is_err());
    }

    #[test]
    fn allocs_published_samples_are_there_while_their_slot_holds_the_same_class() {
        let set = sample_set();
        let mut image = MemoryImage::new();
        let slot = |flags: u64, klass: u64| {
            let mut b = flags.to_le_bytes().to_vec();
            b.extend_from_slice(&klass.to_le_bytes());
            b
        };
        image.map(0x1000, slot(0x2005, 0x5000));
        image.map(0x1028, slot(0x0000, 0)); // freed
        assert_eq!(still_there(&image, &set), vec![true, false]);
        let mut image = MemoryImage::new();
        image.map(0x1000, slot(0x2005, 0x6000)); // another class took the slot
        assert_eq!(still_there(&image, &set), vec![false, false]);
    }
}
