//! A target's layout from its own debug information. A Ruby built from source with default
//! flags (ruby-build, rbenv, asdf, mise, `./configure && make install`) carries full DWARF in
//! its `ruby` or `libruby.so`; a distribution's sits in a separate debug file. Read from
//! there, every offset and constant of the `Layout` describes that very binary: a release
//! no table knows yet, a preview, a patch release that moved a field, a patched Ruby.
//!
//! Only the types the layout needs are read (`types`), each field by its recipe in
//! bindings' `members` (the list the header probe measures too) and `rules`. Layouts are
//! kept by build-id, in memory and under `~/.cache/rbspy_ext/layouts/`.

mod find;
mod heap;
mod rules;
mod types;

pub use find::hex;
pub use types::TypeError;

use crate::sync::locked;
use find::{Elf, Identity};
use object::{Object, ObjectSection};
pub use rbspy_ext_bindings::FieldValue;
use rbspy_ext_bindings::{heap_layout_for_version, HeapLayout, Layout};
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// A layout read from debug information.
#[derive(Debug, Clone)]
pub struct DebugLayout {
    pub layout: &'static Layout,
    /// The file the DWARF was read from (the binary, or its separate debug file).
    pub path: String,
    /// The binary's build-id, in hex.
    pub build_id: Option<String>,
    /// Whether it came from the cache (memory or disk) rather than the DWARF itself.
    pub cached: bool,
    /// The heap census's layout over the series' (`heap.rs`), with the fields where the
    /// series' differs; or why the DWARF could not give it. None where the census knows no
    /// layout of the series.
    pub heap: Option<HeapRead>,
}

/// The heap layout read from debug information, and the overlaid fields where the series'
/// measured layout differs; or why it could not be read (the series' is then used).
pub type HeapRead = Result<(&'static HeapLayout, Vec<&'static str>), String>;

/// What one read of debug information gives.
struct Read {
    layout: Layout,
    heap: Option<Result<HeapLayout, String>>,
}

/// Debug information that exists but cannot give a layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unusable {
    pub path: String,
    pub detail: String,
}

/// Layouts already read, by build-id (or path, for a binary without one).
static KEPT: Mutex<Vec<(String, DebugLayout)>> = Mutex::new(Vec::new());

/// The layout of Ruby `version` in the binary the target maps as `name`, read through
/// `file` (a path this process can open: /proc/PID/map_files, or through /proc/PID/root),
/// with separate debug files looked for under `root` (the target's /proc/PID/root) first.
/// `Ok(None)` when there is no debug information to read.
pub fn layout_for(
    file: &Path,
    name: &str,
    root: &Path,
    version: &str,
) -> Result<Option<DebugLayout>, Unusable> {
    let unusable = |path: &Path, detail: String| Unusable {
        path: path.display().to_string(),
        detail,
    };
    let Some(binary) = Elf::open(file) else {
        return Ok(None);
    };
    let id = find::identity(&binary).map_err(|d| unusable(file, d))?;
    let build_id = id.build_id.as_deref().map(hex);
    let key = build_id
        .clone()
        .unwrap_or_else(|| format!("{name}@{version}"));
    if let Some(kept) = kept(&key) {
        return Ok(Some(kept));
    }
    if let Some((read, path)) = build_id.as_deref().and_then(|b| disk::load(b, version)) {
        return Ok(Some(keep(key, read, version, &path, build_id, true)));
    }
    // The binary itself is named as the target names it (not /proc/PID/map_files/...).
    let (source, shown) = if id.has_dwarf {
        (binary, name.to_string())
    } else {
        match separate(root, name, &id)? {
            Some(elf) => {
                let shown = elf.path.display().to_string();
                (elf, shown)
            }
            None => return Ok(None),
        }
    };
    let read = read(&source, version).map_err(|detail| Unusable {
        path: shown.clone(),
        detail,
    })?;
    if let Some(b) = build_id.as_deref() {
        disk::store(b, &shown, &read, version);
    }
    Ok(Some(keep(key, read, version, &shown, build_id, false)))
}

fn kept(key: &str) -> Option<DebugLayout> {
    let kept = locked(&KEPT);
    kept.iter()
        .find(|(k, _)| k == key)
        .map(|(_, l)| DebugLayout {
            cached: true,
            ..l.clone()
        })
}

/// Keeps `layout` for the process's life: one per distinct binary attached to.
fn keep(
    key: String,
    read: Read,
    version: &str,
    path: &str,
    build_id: Option<String>,
    cached: bool,
) -> DebugLayout {
    let layout: &'static Layout = Box::leak(Box::new(read.layout));
    let table = heap_layout_for_version(version);
    let heap = read.heap.map(|h| {
        h.map(|h| {
            let h: &'static HeapLayout = Box::leak(Box::new(h));
            (h, table.map_or_else(Vec::new, |t| heap::differences(h, t)))
        })
    });
    let kept = DebugLayout {
        layout,
        path: path.to_string(),
        build_id,
        cached,
        heap,
    };
    locked(&KEPT).push((key, kept.clone()));
    kept
}

/// The first separate debug file of the binary that exists, checked to be its own.
fn separate(root: &Path, name: &str, id: &Identity) -> Result<Option<Elf>, Unusable> {
    for path in find::candidates(root, name, id) {
        let Some(elf) = Elf::open(&path) else {
            continue;
        };
        let theirs = find::identity(&elf).map_err(|detail| Unusable {
            path: path.display().to_string(),
            detail,
        })?;
        let refuse = |detail: String| {
            Err(Unusable {
                path: path.display().to_string(),
                detail,
            })
        };
        match (&id.build_id, &theirs.build_id, &id.debuglink) {
            (Some(ours), Some(their), _) if ours != their => {
                return refuse(format!(
                    "its build-id {} is not the binary's {}: it belongs to another build",
                    hex(their),
                    hex(ours)
                ));
            }
            (None, _, Some((_, crc))) | (_, None, Some((_, crc)))
                if find::crc32(&path) != Some(*crc) =>
            {
                return refuse(format!(
                    "its CRC-32 is not {crc:#010x}, which the binary's .gnu_debuglink names"
                ));
            }
            _ => {}
        }
        if !theirs.has_dwarf {
            return refuse("it holds no .debug_info".into());
        }
        return Ok(Some(elf));
    }
    Ok(None)
}

/// Sections the type reader uses; gimli gets empty ones for the rest.
const SECTIONS: &[gimli::SectionId] = &[
    gimli::SectionId::DebugInfo,
    gimli::SectionId::DebugAbbrev,
    gimli::SectionId::DebugStr,
    gimli::SectionId::DebugStrOffsets,
    gimli::SectionId::DebugLineStr,
    // Read by gimli for each unit's header (its line program's, its address base).
    gimli::SectionId::DebugLine,
    gimli::SectionId::DebugAddr,
];

/// The layout the DWARF of `elf` describes.
fn read(elf: &Elf, version: &str) -> Result<Read, String> {
    read_object(elf.parse()?, version)
}

/// The layout the DWARF of the ELF file `data` describes (the `debug_info` fuzz target's
/// entry: a file whole in memory).
pub fn layout_from_bytes(data: &[u8], version: &str) -> Result<Layout, String> {
    let file = object::File::parse(data).map_err(|e| format!("not an ELF file: {e}"))?;
    read_object(file, version).map(|r| r.layout)
}

/// Most a compressed section may inflate to, for each byte it holds: zlib's deflate cannot
/// do better than about 1032 to 1, and a header claiming more is not believed (it would
/// have the reader allocate what it says).
const MAX_INFLATION: u64 = 1100;

fn read_object<'d, R: object::ReadRef<'d>>(
    file: object::File<'d, R>,
    version: &str,
) -> Result<Read, String> {
    let mut data: HashMap<gimli::SectionId, Cow<[u8]>> = HashMap::new();
    for id in SECTIONS {
        let Some(section) = file.section_by_name(id.name()) else {
            continue;
        };
        let range = section
            .compressed_file_range()
            .map_err(|e| format!("{}: {e}", id.name()))?;
        if range.uncompressed_size
            > range
                .compressed_size
                .saturating_mul(MAX_INFLATION)
                .max(1 << 20)
        {
            return Err(format!(
                "{} claims {} bytes inflated from {}",
                id.name(),
                range.uncompressed_size,
                range.compressed_size
            ));
        }
        let bytes = section
            .uncompressed_data()
            .map_err(|e| format!("{}: {e}", id.name()))?;
        data.insert(*id, bytes);
    }
    let dwarf = gimli::Dwarf::load(|id| {
        let bytes: &[u8] = data.get(&id).map_or(&[], |b| b);
        Ok::<_, gimli::Error>(gimli::EndianSlice::new(bytes, gimli::LittleEndian))
    })
    .map_err(|e| e.to_string())?;
    let types = types::Types::index(dwarf, &[rules::wanted(), heap::NAMES.to_vec()].concat())
        .map_err(describe)?;
    let layout = rules::build(&types, version, NAME).map_err(describe)?;
    // The census's layout is not the walker's: a Ruby whose gc.c types do not read keeps
    // the series' (and says why).
    let heap = heap_layout_for_version(version)
        .map(|table| heap::overlay(&types, table).map_err(describe));
    Ok(Read { layout, heap })
}

/// What every layout read from debug information is called (`Layout::name`).
pub const NAME: &str = "debug info";

fn describe(e: TypeError) -> String {
    match e {
        TypeError::Corrupt(d) => format!("its DWARF does not parse: {d}"),
        TypeError::Missing(d) => format!("its DWARF lacks {d}, which the stack walker needs"),
    }
}

/// The fields where `a` and `b` differ, by name.
pub fn differences(a: &Layout, b: &Layout) -> Vec<&'static str> {
    a.fields()
        .into_iter()
        .zip(b.fields())
        .filter(|(x, y)| x.1 != y.1)
        .map(|(x, _)| x.0)
        .collect()
}

/// Layouts on disk, one file per build-id: `field value` lines after a header naming the
/// version and the DWARF's path. Any file that does not read back whole is ignored (and
/// rewritten).
mod disk {
    use super::*;

    fn dir() -> Option<PathBuf> {
        match std::env::var_os("RUBYSPY_LAYOUT_CACHE") {
            Some(d) if d.is_empty() || d == "0" => None,
            Some(d) => Some(PathBuf::from(d)),
            None => {
                let base = std::env::var_os("XDG_CACHE_HOME")
                    .map(PathBuf::from)
                    .or_else(|| {
                        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache"))
                    })?;
                Some(base.join("rbspy_ext").join("layouts"))
            }
        }
    }

    /// Bumped when the recipes change, so a layout cached by an older build is read again.
    const FORMAT: &str = "rbspy_ext layout 2";

    /// What was kept for `build_id`, and the path it was read from.
    pub(super) fn load(build_id: &str, version: &str) -> Option<(Read, String)> {
        if !build_id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let text = std::fs::read_to_string(dir()?.join(format!("{build_id}.layout"))).ok()?;
        let mut lines = text.lines();
        if lines.next()? != FORMAT || lines.next()? != format!("version {version}") {
            return None;
        }
        let pairs: Vec<(&str, &str)> = lines.filter_map(|l| l.split_once(' ')).collect();
        let text_of = |key: &str| pairs.iter().find(|(k, _)| *k == key).map(|(_, v)| *v);
        let source = text_of("source")?.to_string();
        let values: HashMap<&str, FieldValue> = (pairs.iter())
            .filter_map(|(f, v)| Some((*f, FieldValue::parse(v)?)))
            .collect();
        let layout = Layout::from_fields(NAME, |f| values.get(f).copied().ok_or(()), |_, _| ());
        let heap = match (heap_layout_for_version(version), text_of("heap_unusable")) {
            (None, _) => None,
            (Some(_), Some(why)) => Some(Err(why.to_string())),
            (Some(table), None) => Some(Ok(heap::with_values(table, |f| {
                values.get(format!("heap.{f}").as_str()).copied()
            })?)),
        };
        Some((
            Read {
                layout: layout.ok()?,
                heap,
            },
            source,
        ))
    }

    pub(super) fn store(build_id: &str, source: &str, read: &Read, version: &str) {
        let Some(dir) = dir() else {
            return;
        };
        let mut text = format!("{FORMAT}\nversion {version}\n");
        for (field, value) in read.layout.fields() {
            text.push_str(&format!("{field} {value}\n"));
        }
        match &read.heap {
            Some(Ok(h)) => (heap::values(h).into_iter())
                .for_each(|(field, value)| text.push_str(&format!("heap.{field} {value}\n"))),
            Some(Err(why)) => text.push_str(&format!("heap_unusable {why}\n")),
            None => {}
        }
        text.push_str(&format!("source {source}\n"));
        // Written aside and renamed: a reader never sees half a file.
        let tmp = dir.join(format!(".{build_id}.{}", std::process::id()));
        if std::fs::create_dir_all(&dir).is_ok() && std::fs::write(&tmp, text).is_ok() {
            let _ = std::fs::rename(&tmp, dir.join(format!("{build_id}.layout")));
        }
    }
}
