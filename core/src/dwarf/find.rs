//! Which file holds a Ruby binary's DWARF, found the way gdb finds it: the binary itself,
//! then a separate debug file by build-id under `/usr/lib/debug/.build-id/`, then by
//! `.gnu_debuglink`; each path first inside the target's root (`/proc/PID/root`, so a
//! container's own debug files are used), then on this machine.

use object::read::ReadCache;
use object::{Object, ObjectSection};
use std::fs::File;
use std::path::{Path, PathBuf};

/// An ELF file read piece by piece (`ReadCache` keeps only what was asked for).
pub(super) struct Elf {
    pub(super) path: PathBuf,
    pub(super) cache: ReadCache<File>,
}

impl Elf {
    pub(super) fn open(path: &Path) -> Option<Elf> {
        let file = File::open(path).ok()?;
        file.metadata().ok().filter(|m| m.is_file())?;
        Some(Elf {
            path: path.to_path_buf(),
            cache: ReadCache::new(file),
        })
    }

    pub(super) fn parse(&self) -> Result<object::File<'_, &ReadCache<File>>, String> {
        object::File::parse(&self.cache).map_err(|e| format!("not an ELF file: {e}"))
    }
}

/// What the binary says of its debug information.
pub(super) struct Identity {
    pub(super) has_dwarf: bool,
    pub(super) build_id: Option<Vec<u8>>,
    pub(super) debuglink: Option<(String, u32)>,
}

pub(super) fn identity(elf: &Elf) -> Result<Identity, String> {
    let file = elf.parse()?;
    let has_dwarf = file
        .section_by_name(".debug_info")
        .or_else(|| file.section_by_name(".zdebug_info"))
        .is_some_and(|s| s.size() > 0);
    Ok(Identity {
        has_dwarf,
        build_id: file.build_id().ok().flatten().map(<[u8]>::to_vec),
        debuglink: file
            .gnu_debuglink()
            .ok()
            .flatten()
            .map(|(name, crc)| (String::from_utf8_lossy(name).into_owned(), crc)),
    })
}

/// `bytes` as lowercase hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Separate debug files to try for a binary at `binary` (as the target names it), in gdb's
/// order, each inside `root` and then on this machine.
pub(super) fn candidates(root: &Path, binary: &str, id: &Identity) -> Vec<PathBuf> {
    let mut relative: Vec<String> = Vec::new();
    let dirs = debug_dirs();
    if let Some(build_id) = id.build_id.as_deref().filter(|b| b.len() >= 2) {
        let hex = hex(build_id);
        for d in &dirs {
            relative.push(format!("{d}/.build-id/{}/{}.debug", &hex[..2], &hex[2..]));
        }
    }
    if let Some((name, _)) = &id.debuglink {
        // A link names a file, never a path (gdb ignores one with a slash).
        if !name.contains('/') && !name.is_empty() {
            let dir = Path::new(binary)
                .parent()
                .map_or_else(String::new, |d| d.display().to_string());
            relative.push(format!("{dir}/{name}"));
            relative.push(format!("{dir}/.debug/{name}"));
            relative.extend(dirs.iter().map(|d| format!("{d}{dir}/{name}")));
        }
    }
    let mut out: Vec<PathBuf> = (relative.iter())
        .map(|r| root.join(r.trim_start_matches('/')))
        .collect();
    out.extend(relative.iter().map(PathBuf::from));
    out
}

/// Where separate debug files live: gdb's `debug-file-directory`, `/usr/lib/debug` unless
/// `RUBYSPY_DEBUG_FILE_DIRECTORY` names others (colon-separated, as gdb's setting).
fn debug_dirs() -> Vec<String> {
    match std::env::var("RUBYSPY_DEBUG_FILE_DIRECTORY") {
        Ok(dirs) if !dirs.is_empty() => (dirs.split(':'))
            .filter(|d| !d.is_empty())
            .map(|d| d.trim_end_matches('/').to_string())
            .collect(),
        _ => vec!["/usr/lib/debug".to_string()],
    }
}

/// gdb's check of a debuglink target: the CRC-32 (IEEE, as zlib's) of the whole file.
pub(super) fn crc32(path: &Path) -> Option<u32> {
    use std::io::Read;
    let mut file = File::open(path).ok()?;
    let mut hasher = flate2::Crc::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = file.read(&mut buf).ok()?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Some(hasher.sum())
}
