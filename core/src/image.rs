//! A live Ruby's memory as a spy read it, saved to bytes and loaded again: the seeds of the
//! coverage-guided stack-walker target (`outside::memory_image`). `capture` attaches, walks
//! once to warm up, then walks again through a memory that keeps every byte it returns; the
//! image is those bytes, with what a spy over them needs (version and layout, roots, the symbol table's
//! address, libruby's writable segments). Loaded, any bytes give an image or None.
use crate::error::{MemoryError, Result};
use crate::memory::{Memory, MemoryImage, ProcessMemory};
use crate::spy::{Spy, ThreadSelection};
use crate::vm::VmRoots;

use rbspy_ext_bindings::{Layout, LAYOUTS};
use std::cell::RefCell;
use std::collections::BTreeMap;

const MAGIC: &[u8; 8] = b"RBSPYIM1";
/// Most bytes an image may map when loaded: a fuzzed length is refused above it.
const MAX_BYTES: usize = 64 << 20;

/// A memory image of a Ruby process and what a spy over it needs.
pub struct Image {
    pub layout: &'static Layout,
    pub version: String,
    pub roots: VmRoots,
    pub symbols: Option<u64>,
    pub writable: Vec<(u64, u64)>,
    pub memory: MemoryImage,
}

impl Image {
    /// A spy over the image, as over the process it was captured from.
    pub fn spy(self) -> Spy<MemoryImage> {
        Spy::with_memory(
            1,
            self.memory,
            self.layout,
            &self.version,
            self.roots,
            self.symbols,
        )
        .with_writable(self.writable)
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

/// What a snapshot and two samples of every thread of `pid` read, as an image's bytes.
pub fn capture(pid: i32) -> Result<Vec<u8>> {
    let mut warm = Spy::attach(pid)?;
    warm.snapshot()?;
    let _ = warm.sample_threads(ThreadSelection::All);
    let (layout, roots, symbols, writable) = warm.image_parts();
    let keeping = Keeping {
        process: ProcessMemory::new(pid),
        kept: RefCell::default(),
    };
    let version = warm.version().to_string();
    let mut spy = Spy::with_memory(pid, keeping, layout, &version, roots, symbols)
        .with_writable(writable.clone());
    spy.snapshot()?;
    for _ in 0..2 {
        let _ = spy.sample_threads(ThreadSelection::All);
    }
    let kept = spy.memory().kept.borrow();
    let mut out = MAGIC.to_vec();
    // The layout by name: a dev series has several, which attaching chose between.
    for text in [version.as_str(), layout.name] {
        put(&mut out, &(text.len() as u64).to_le_bytes());
        out.extend_from_slice(text.as_bytes());
    }
    for word in [
        roots.vm,
        roots.main_thread,
        roots.gvl_owner,
        roots.thread_list,
    ] {
        put(&mut out, &word.to_le_bytes());
    }
    put(&mut out, &symbols.unwrap_or(0).to_le_bytes());
    put(&mut out, &(writable.len() as u64).to_le_bytes());
    for (start, end) in &writable {
        put(&mut out, &start.to_le_bytes());
        put(&mut out, &end.to_le_bytes());
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
    let symbols = Some(r.word()?).filter(|&a| a != 0);
    let mut writable = Vec::new();
    for _ in 0..r.word()?.min(64) {
        writable.push((r.word()?, r.word()?));
    }
    let mut memory = MemoryImage::new();
    let mut mapped: Vec<(u64, u64)> = Vec::new();
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
        if len == 0 || mapped.iter().any(|&(s, e)| addr < e && s < end) {
            continue;
        }
        mapped.push((addr, end));
        memory.map(addr, bytes.to_vec());
    }
    Some(Image {
        layout,
        version,
        roots,
        symbols,
        writable,
        memory,
    })
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
}
