//! A live Ruby's memory as a spy read it, saved to bytes and loaded again: the seeds of the
//! coverage-guided targets over memory images (`outside::memory_image`, the stack walker
//! and tag tables; `outside::heap_image`, the census). `capture` attaches, walks once to
//! warm up, then walks again (and takes a census, if asked) through a memory that keeps
//! every byte it returns; the image is those bytes, with what a spy over them needs and
//! attaching read from the process's maps and ELF files (`spy::ImageParts`: version and
//! layout, roots, the symbol table's address, libruby's writable segments, the heap's
//! ranges, where the tags are). Loaded, any bytes give an image or None.
use crate::census::{self, CensusOptions};
use crate::error::{MemoryError, Result};
use crate::memory::{Memory, MemoryImage, ProcessMemory};
use crate::spy::{ImageParts, Spy, ThreadSelection};
use crate::vm::VmRoots;

use rbspy_ext_bindings::LAYOUTS;
use std::cell::RefCell;
use std::collections::BTreeMap;

const MAGIC: &[u8; 8] = b"RBSPYIM2";
/// Most bytes an image may map when loaded: a fuzzed length is refused above it.
const MAX_BYTES: usize = 64 << 20;
/// Most ranges of each list (writable segments, heap ranges) an image keeps: a live Ruby has
/// some tens of heap ranges; a fuzzed count must not make every scan walk a long list.
const MAX_RANGES: u64 = 1024;

/// A memory image of a Ruby process and what a spy over it needs.
pub struct Image {
    pub parts: ImageParts,
    pub memory: MemoryImage,
}

impl Image {
    /// A spy over the image, as over the process it was captured from.
    pub fn spy(self) -> Spy<MemoryImage> {
        Spy::over_image(1, self.memory, &self.parts)
    }
}

/// A process's memory that keeps a copy of every range read from it.
struct Keeping {
    process: ProcessMemory,
    kept: RefCell<BTreeMap<u64, Vec<u8>>>,
}

impl Memory for Keeping {
    fn read(&self, addr: u64, buf: &mut [u8]) -> std::result::Result<(), MemoryError> {
        self.process.read(addr, buf)?;
        let mut kept = self.kept.borrow_mut();
        let entry = kept.entry(addr).or_default();
        // A shorter read at the same address keeps what a longer one saw beyond it.
        if entry.len() < buf.len() {
            entry.resize(buf.len(), 0);
        }
        entry[..buf.len()].copy_from_slice(buf);
        Ok(())
    }
}

/// What a snapshot and two samples of every thread of `pid` read (tags included, where the
/// target has loaded the extension), and with `census` what a census of its heap read, as
/// an image's bytes.
pub fn capture(pid: i32, census: bool) -> Result<Vec<u8>> {
    let mut warm = Spy::attach(pid)?;
    warm.snapshot()?;
    let _ = warm.sample(ThreadSelection::All);
    let parts = warm.image_parts();
    let keeping = Keeping {
        process: ProcessMemory::new(pid),
        kept: RefCell::default(),
    };
    let mut spy = Spy::over_image(pid, keeping, &parts);
    spy.snapshot()?;
    let _ = spy.snapshot_tags();
    for _ in 0..2 {
        let _ = spy.sample(ThreadSelection::All);
    }
    if census {
        census::take(spy.target_view(), CensusOptions::default())?;
    }
    let kept = spy.memory().kept.borrow();
    let mut out = MAGIC.to_vec();
    // The layout by name: a dev series has several, which attaching chose between.
    for text in [parts.version.as_str(), parts.layout.name] {
        put(&mut out, &(text.len() as u64).to_le_bytes());
        out.extend_from_slice(text.as_bytes());
    }
    let r = parts.roots;
    let (tags, owner) = parts.tags.unwrap_or((0, None));
    let words = [
        r.vm,
        r.main_thread,
        r.gvl_owner,
        r.thread_list,
        parts.symbols.unwrap_or(0),
        tags as u64,
        owner.unwrap_or(0) as u64,
        parts.pthread_tid.unwrap_or(0),
        parts.zjit_entry.unwrap_or(0),
        parts.shape_tree.unwrap_or(0),
    ];
    for word in words {
        put(&mut out, &word.to_le_bytes());
    }
    for ranges in [&parts.writable, &parts.heap] {
        put(&mut out, &(ranges.len() as u64).to_le_bytes());
        for (start, end) in ranges {
            put(&mut out, &start.to_le_bytes());
            put(&mut out, &end.to_le_bytes());
        }
    }
    let regions = merge(&kept);
    put(&mut out, &(regions.len() as u64).to_le_bytes());
    for (addr, bytes) in regions {
        put(&mut out, &addr.to_le_bytes());
        put(&mut out, &(bytes.len() as u64).to_le_bytes());
        out.extend_from_slice(&bytes);
    }
    Ok(out)
}

fn put(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(bytes);
}

/// The ranges read, overlapping and touching ones merged (a later read's bytes win).
fn merge(kept: &BTreeMap<u64, Vec<u8>>) -> Vec<(u64, Vec<u8>)> {
    let mut out: Vec<(u64, Vec<u8>)> = Vec::new();
    for (&addr, bytes) in kept {
        if let Some((start, merged)) = out.last_mut() {
            let end = *start + merged.len() as u64;
            if addr <= end {
                let offset = (addr - *start) as usize;
                let overlap = merged.len().saturating_sub(offset).min(bytes.len());
                merged[offset..offset + overlap].copy_from_slice(&bytes[..overlap]);
                merged.extend_from_slice(&bytes[overlap..]);
                continue;
            }
        }
        out.push((addr, bytes.clone()));
    }
    out
}

/// Reads what `capture` wrote, or any bytes at all: None for what is not an image of a known
/// Ruby version. Regions that overlap one already mapped are left out.
pub fn load(data: &[u8]) -> Option<Image> {
    let mut r = Reader(data.strip_prefix(MAGIC.as_slice())?);
    let version = r.text()?.to_string();
    let name = r.text()?;
    let layout = LAYOUTS.iter().find(|l| l.name == name)?;
    let roots = VmRoots {
        vm: r.word()?,
        main_thread: r.word()?,
        gvl_owner: r.word()?,
        thread_list: r.word()?,
    };
    let symbols = nonzero(r.word()?);
    let (tags, owner) = (r.word()? as i64, r.word()? as i64);
    let tags = (tags != 0).then_some((tags, (owner != 0).then_some(owner)));
    let [pthread_tid, zjit_entry, shape_tree] = [r.word()?, r.word()?, r.word()?].map(nonzero);
    let writable = r.ranges()?;
    let heap = r.ranges()?;
    let mut memory = MemoryImage::new();
    // Start → end of each region mapped, to leave out one that overlaps (in log time: a
    // fuzzed image can name a region for every few bytes).
    let mut mapped: BTreeMap<u64, u64> = BTreeMap::new();
    let mut total = 0usize;
    for _ in 0..r.word()? {
        let addr = r.word()?;
        let len = usize::try_from(r.word()?).ok()?;
        total = total.checked_add(len)?;
        if total > MAX_BYTES {
            return None;
        }
        let bytes = r.take(len)?;
        let end = addr.checked_add(len as u64)?;
        let before = mapped.range(..=addr).next_back();
        let after = mapped.range(addr..).next();
        if len == 0
            || before.is_some_and(|(_, &e)| addr < e)
            || after.is_some_and(|(&s, _)| s < end)
        {
            continue;
        }
        mapped.insert(addr, end);
        memory.map(addr, bytes.to_vec());
    }
    let parts = ImageParts {
        layout,
        version,
        roots,
        symbols,
        writable,
        heap,
        tags,
        pthread_tid,
        zjit_entry,
        shape_tree,
    };
    Some(Image { parts, memory })
}

fn nonzero(word: u64) -> Option<u64> {
    (word != 0).then_some(word)
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.0.len() {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn text(&mut self) -> Option<&'a str> {
        let len = usize::try_from(self.word()?).ok()?;
        std::str::from_utf8(self.take(len)?).ok()
    }

    fn word(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }

    /// A count, then that many (start, end) pairs: at most `MAX_RANGES` of them are kept,
    /// and none that ends before it starts.
    fn ranges(&mut self) -> Option<Vec<(u64, u64)>> {
        let count = self.word()?;
        let mut out = Vec::new();
        for i in 0..count {
            let (start, end) = (self.word()?, self.word()?);
            if i < MAX_RANGES && start < end {
                out.push((start, end));
            }
        }
        Some(out)
    }
}
