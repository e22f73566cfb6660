//! What the kernel tells us about a process: its mappings, and the symbols and writable
//! segments of the binary that holds the Ruby VM (libruby.so, or a statically linked ruby).
use crate::error::{Error, Result};
use goblin::elf::{program_header::PT_LOAD, Elf};
use std::fs;
use std::io::ErrorKind;

/// One line of /proc/PID/maps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub perms: String,
    pub offset: u64,
    pub path: String,
}

/// Bytes of code no file backs: anonymous executable mappings, where a JIT writes what it
/// compiles.
pub fn anonymous_code_bytes(maps: &[Mapping]) -> u64 {
    maps.iter()
        .filter(|m| m.path.is_empty() && m.perms.as_bytes().get(2) == Some(&b'x'))
        .map(|m| m.end.saturating_sub(m.start))
        .sum()
}

/// Parses /proc/PID/maps text; malformed lines are skipped.
pub fn parse_maps(text: &str) -> Vec<Mapping> {
    text.lines()
        .filter_map(|line| {
            let mut it = line.split_whitespace();
            let range = it.next()?;
            let perms = it.next()?.to_string();
            let offset = u64::from_str_radix(it.next()?, 16).ok()?;
            let _dev = it.next()?;
            let _inode = it.next()?;
            let path = it.collect::<Vec<_>>().join(" ");
            let (s, e) = range.split_once('-')?;
            Some(Mapping {
                start: u64::from_str_radix(s, 16).ok()?,
                end: u64::from_str_radix(e, 16).ok()?,
                perms,
                offset,
                path,
            })
        })
        .collect()
}

fn io_error(pid: i32, what: &str, e: std::io::Error) -> Error {
    match e.kind() {
        ErrorKind::NotFound => Error::NoSuchProcess { pid },
        ErrorKind::PermissionDenied => Error::PermissionDenied { pid },
        _ => Error::Io {
            pid,
            context: what.to_string(),
            source: e,
        },
    }
}

/// What tells a process apart from the same pid later: its start time (a reused pid belongs
/// to a process that started later) and its auxiliary vector, which the kernel writes anew
/// at every exec (entry point, program headers, random bytes, file name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    start_ticks: u64,
    auxv: Vec<u8>,
}

/// The mappings Ruby objects can live in: anonymous read-write ones and `[heap]` (Ruby's
/// heap pages and malloc'ed memory), as `(start, end)`.
pub fn heap_ranges(maps: &[Mapping]) -> Vec<(u64, u64)> {
    maps.iter()
        .filter(|m| m.perms.starts_with("rw") && (m.path.is_empty() || m.path == "[heap]"))
        .map(|m| (m.start, m.end))
        .collect()
}

/// The fields of a /proc/PID/stat line after the command name (field 3, the state, first):
/// the name may hold spaces and parentheses, so the fields follow its last ')'.
fn stat_fields(stat: &str) -> Option<std::str::SplitWhitespace<'_>> {
    Some(stat[stat.rfind(')')? + 1..].split_whitespace())
}

/// Every descendant of `root` (children, their children...), from the parent pids in
/// /proc/*/stat; empty when /proc cannot be listed.
pub fn descendants(root: i32) -> Vec<i32> {
    let Ok(dir) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let parents: Vec<(i32, i32)> = dir
        .flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_str()?.parse::<i32>().ok()?;
            let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // Field 4: the parent pid.
            let ppid = stat_fields(&stat)?.nth(1)?.parse().ok()?;
            Some((pid, ppid))
        })
        .collect();
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(
            parents
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    found.remove(0);
    found
}

/// The worker number a preforking server gave process `pid` in its title (`$0`, which Ruby
/// writes over the process's argv, so /proc/PID/cmdline shows it): Puma's "puma: cluster
/// worker 1: 4242 [app]", Unicorn's and Pitchfork's "... worker[1] ...". None for any other
/// process, or one that is gone.
pub fn worker_name(pid: i32) -> Option<String> {
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    worker_in_title(&String::from_utf8_lossy(&cmdline))
}

fn worker_in_title(title: &str) -> Option<String> {
    let digits = |s: &str| -> Option<String> {
        let n: String = s.chars().take_while(char::is_ascii_digit).collect();
        (!n.is_empty()).then_some(n)
    };
    if let Some(rest) = title.split_once("cluster worker ").map(|(_, r)| r) {
        return digits(rest);
    }
    title.split_once("worker[").and_then(|(_, r)| digits(r))
}

/// How a process differs from the one an [`Identity`] was taken of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Replaced {
    /// The pid now belongs to another process.
    PidReused,
    /// The same process runs another program (it called exec); the program's path.
    Exec(String),
}

impl Identity {
    /// The identity of `pid` now; None when it has gone (no /proc entry, or a zombie, whose
    /// auxiliary vector is gone with its memory).
    pub fn of(pid: i32) -> Option<Identity> {
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let fields = stat_fields(&stat)?;
        // Field 22 of stat(5): start time in clock ticks.
        let start_ticks = fields.clone().nth(19)?.parse().ok()?;
        // Unreadable without the right to read the process's memory; then the start time alone.
        let auxv = fs::read(format!("/proc/{pid}/auxv")).unwrap_or_default();
        if auxv.is_empty() && fields.clone().next() == Some("Z") {
            return None;
        }
        Some(Identity { start_ticks, auxv })
    }

    /// How long the process has run (from its start time and the system's uptime); None
    /// when /proc/uptime cannot be read.
    pub fn age(&self) -> Option<std::time::Duration> {
        let uptime: f64 = fs::read_to_string("/proc/uptime")
            .ok()?
            .split_whitespace()
            .next()?
            .parse()
            .ok()?;
        // SAFETY: sysconf only reads a configuration value.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        if ticks <= 0 {
            return None;
        }
        let started = self.start_ticks as f64 / ticks as f64;
        Some(std::time::Duration::from_secs_f64(
            (uptime - started).max(0.0),
        ))
    }

    /// How `now` (the same pid's identity read later) differs from this one, if it does.
    pub fn replaced_by(&self, pid: i32, now: &Identity) -> Option<Replaced> {
        if now.start_ticks != self.start_ticks {
            return Some(Replaced::PidReused);
        }
        if !self.auxv.is_empty() && !now.auxv.is_empty() && now.auxv != self.auxv {
            let exe = fs::read_link(format!("/proc/{pid}/exe"))
                .map(|p| p.display().to_string())
                .unwrap_or_else(|_| "another program".into());
            return Some(Replaced::Exec(exe));
        }
        None
    }
}

/// Reads and parses /proc/PID/maps, mapping "no such file" to `NoSuchProcess` and EACCES to
/// `PermissionDenied`.
pub fn read_maps(pid: i32) -> Result<Vec<Mapping>> {
    let text = fs::read_to_string(format!("/proc/{pid}/maps"))
        .map_err(|e| io_error(pid, "reading /proc/PID/maps", e))?;
    let maps = parse_maps(&text);
    if maps.is_empty() {
        // A zombie has no mappings left: nothing to read.
        return Err(Error::NoSuchProcess { pid });
    }
    Ok(maps)
}

/// A binary mapped into the target, with what the spy needs from its ELF file.
#[derive(Debug, Clone)]
pub struct RubyBinary {
    /// The path as /proc/PID/maps shows it (may not exist for us: chroots, containers).
    pub path: String,
    /// Added to an ELF virtual address to get the address in the target.
    pub bias: u64,
    /// Symbols the spy may use, from `.dynsym` or `.symtab`: (name, address in the target, size).
    pub symbols: Vec<(String, u64, u64)>,
    /// Writable PT_LOAD segments in the target: (start, end).
    pub writable: Vec<(u64, u64)>,
}

impl RubyBinary {
    /// The target address of an exported symbol.
    pub fn symbol(&self, name: &str) -> Option<u64> {
        self.symbols
            .iter()
            .find(|(n, _, _)| n == name)
            .map(|(_, a, _)| *a)
    }

    /// The target address of a variable of `size` bytes: not a function of the same name,
    /// as `rb_yjit_enabled_p` was until 3.2.
    pub fn variable(&self, name: &str, size: u64) -> Option<u64> {
        self.symbols
            .iter()
            .find(|(n, _, s)| n == name && *s == size)
            .map(|(_, a, _)| *a)
    }
}

/// Symbols worth keeping (the ELF is parsed once at attach).
const WANTED: &[&str] = &[
    "ruby_version",
    // RUBY_DESCRIPTION (date and revision of a dev build), for an error naming the Ruby.
    "ruby_description",
    "ruby_current_vm_ptr",
    "ruby_current_vm",
    "ruby_single_main_ractor",
    "ruby_global_symbols",
    "ruby_api_version",
    // 4.1: set while ZJIT is on (hidden: only a static ruby's `.symtab` has it); 4.0 has it
    // too, and names the JIT in a profile's metadata with YJIT's flag (`spy::zjit::jit_of`).
    "rb_zjit_entry",
    "rb_yjit_enabled_p",
    // The object shapes, for the heap census: exported from 4.0; 3.3 and 3.4 keep the
    // pointer hidden (only a `.symtab` names it).
    "rb_shape_tree",
    "rb_shape_tree_ptr",
];

/// Maps the file behind a mapping of the target as the target sees it, read-only.
/// /proc/PID/map_files works across mount namespaces and chroots (root only); the path
/// through /proc/PID/root and the plain path are fallbacks for unprivileged readers of their
/// own processes.
fn map_mapped_file(pid: i32, mapping: &Mapping) -> Result<MappedFile> {
    let candidates = mapped_file_candidates(pid, mapping);
    let mut last = None;
    for c in &candidates {
        match fs::File::open(c).and_then(|f| MappedFile::new(&f)) {
            Ok(mapped) => return Ok(mapped),
            Err(e) => last = Some(e),
        }
    }
    Err(io_error(
        pid,
        &format!("opening {}", mapping.path),
        last.expect("at least one candidate"),
    ))
}

/// Paths to the file behind `mapping`, in the order this process may open them.
pub fn mapped_file_candidates(pid: i32, mapping: &Mapping) -> [String; 3] {
    let (start, end) = (mapping.start, mapping.end);
    [
        format!("/proc/{pid}/map_files/{start:x}-{end:x}"),
        format!("/proc/{pid}/root{}", mapping.path),
        mapping.path.clone(),
    ]
}

/// A file mapped read-only, unmapped when dropped. Mapped rather than read: an extension
/// built with debug information is about 30 MB, and a buffer that large, once freed, stays
/// in the malloc arena of the thread that read it (a listener's connection thread held 28 MB
/// of it for good), while mapped pages go back with the mapping. (A file truncated while
/// mapped would fault on access; binaries a process has loaded are not rewritten in place,
/// since that would crash the process itself.)
struct MappedFile {
    addr: *mut libc::c_void,
    len: usize,
}

impl MappedFile {
    fn new(file: &fs::File) -> std::io::Result<MappedFile> {
        use std::os::fd::AsRawFd;
        let len = usize::try_from(file.metadata()?.len())
            .map_err(|_| std::io::Error::other("file too large"))?;
        if len == 0 {
            return Err(std::io::Error::other("empty file"));
        }
        // SAFETY: a fresh read-only private mapping of an open file; nothing else aliases it.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(MappedFile { addr, len })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `len` readable bytes at `addr` while the mapping lives (until drop).
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }
}

impl Drop for MappedFile {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

fn is_libruby(path: &str) -> bool {
    let file = path.rsplit('/').next().unwrap_or(path);
    file.starts_with("libruby") && file.contains(".so")
}

/// Reads the ELF file behind the mappings of `path` in the target: its load bias, the
/// `.dynsym` entries named in `wanted` (at their addresses in the target), and its writable
/// segments. `NotRuby` with an empty detail when `path` is not mapped.
fn read_binary(pid: i32, maps: &[Mapping], path: &str, wanted: &[&str]) -> Result<RubyBinary> {
    let mine: Vec<&Mapping> = maps.iter().filter(|m| m.path == path).collect();
    let first = mine
        .iter()
        .min_by_key(|m| m.start)
        .ok_or_else(|| Error::NotRuby {
            pid,
            detail: String::new(),
        })?;
    let file = map_mapped_file(pid, first)?;
    let base_mapping = mine
        .iter()
        .filter(|m| m.offset == 0)
        .min_by_key(|m| m.start)
        .unwrap_or(first);
    parse_binary(file.bytes(), path, base_mapping.start, wanted)
        .map_err(|detail| Error::NotRuby { pid, detail })
}

/// What the spy needs from the bytes of an ELF file mapped at `base` (the start of its
/// mapping at file offset 0). The file is the target's: any bytes at all must give an
/// error, never a panic (fuzzed by `fuzz/fuzz_targets/elf.rs`).
pub fn parse_binary(
    bytes: &[u8],
    path: &str,
    base: u64,
    wanted: &[&str],
) -> std::result::Result<RubyBinary, String> {
    let elf = Elf::parse(bytes).map_err(|e| format!("{path} is not a readable ELF file ({e})"))?;
    let first_load = elf
        .program_headers
        .iter()
        .filter(|p| p.p_type == PT_LOAD)
        .map(|p| p.p_vaddr & !(p.p_align.max(1).wrapping_sub(1)))
        .min()
        .unwrap_or(0);
    let bias = base.wrapping_sub(first_load);
    // `.dynsym` first; then `.symtab` where the file still has one. A statically linked ruby
    // (rbenv's and ruby-build's default) exports `ruby_version` but keeps
    // `ruby_current_vm_ptr` and `ruby_global_symbols` hidden: only its `.symtab` has them.
    let from = |syms: &goblin::elf::Symtab, strtab: &goblin::strtab::Strtab| {
        syms.iter()
            .filter(|s| s.st_value != 0)
            .filter_map(|s| {
                let name = strtab.get_at(s.st_name)?;
                wanted
                    .contains(&name)
                    .then(|| (name.to_string(), bias.wrapping_add(s.st_value), s.st_size))
            })
            .collect::<Vec<_>>()
    };
    let mut symbols: Vec<(String, u64, u64)> = from(&elf.dynsyms, &elf.dynstrtab);
    for sym in from(&elf.syms, &elf.strtab) {
        if !symbols.iter().any(|(n, _, _)| *n == sym.0) {
            symbols.push(sym);
        }
    }
    let writable = elf
        .program_headers
        .iter()
        .filter(|p| p.p_type == PT_LOAD && p.is_write())
        .map(|p| {
            let start = bias.wrapping_add(p.p_vaddr);
            (start, start.wrapping_add(p.p_memsz))
        })
        .collect();
    Ok(RubyBinary {
        path: path.to_string(),
        bias,
        symbols,
        writable,
    })
}

/// Finds the binary that holds the Ruby VM: libruby.so if one is mapped, otherwise the main
/// executable (a statically linked ruby), which must then export `ruby_version`.
pub fn find_ruby_binary(pid: i32, maps: &[Mapping]) -> Result<RubyBinary> {
    let exe = fs::read_link(format!("/proc/{pid}/exe"))
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    let lib = maps.iter().find(|m| is_libruby(&m.path)).map(|m| &m.path);
    let path = match lib {
        Some(p) => p.clone(),
        None => exe.trim_end_matches(" (deleted)").to_string(),
    };
    let binary = read_binary(pid, maps, &path, WANTED).map_err(|e| match e {
        Error::NotRuby { pid, detail } if detail.is_empty() => Error::NotRuby {
            pid,
            detail: format!("no libruby is mapped and the executable ({exe}) is not mapped either"),
        },
        e => e,
    })?;
    if binary.symbol("ruby_version").is_none() {
        return Err(Error::NotRuby {
            pid,
            detail: format!("{path} does not export ruby_version (no libruby is mapped)"),
        });
    }
    Ok(binary)
}

/// The address in the target of glibc's `_thread_db_pthread_tid`: libthread_db's descriptor
/// of `struct pthread`'s `tid` field (three u32: bits, count, byte offset). glibc exports it
/// from libc.so.6 since 2.34 (from libpthread's symbol table before, which Debian strips).
/// Ruby before 3.1 keeps no native thread id, only the `pthread_t`, which on glibc is the
/// address of that `struct pthread`.
pub fn find_pthread_tid_descriptor(pid: i32, maps: &[Mapping]) -> Option<u64> {
    const NAME: &str = "_thread_db_pthread_tid";
    let libc = maps.iter().map(|m| m.path.as_str()).find(|p| {
        let file = p.rsplit('/').next().unwrap_or(p);
        file.starts_with("libc.so") || file.starts_with("libc-")
    })?;
    read_binary(pid, maps, libc, &[NAME]).ok()?.symbol(NAME)
}

/// Where an rbspy_ext extension the target has loaded (any mapped `rbspy_ext.so`) publishes
/// its thread-pointer offsets, if there is one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProfilerStateSymbols {
    /// The address of `ruby_profiler_state_tp_offset`.
    pub offset: u64,
    /// The address of `ruby_profiler_state_owner_tp_offset` (absent from older builds).
    pub owner_offset: Option<u64>,
    /// The address of `otel_thread_ctx_v1_tp_offset` (absent from older builds): where
    /// OpenTelemetry's thread context pointer is from the thread pointer.
    pub otel_offset: Option<u64>,
}

/// The symbols of `ProfilerStateSymbols` in the target, if it has loaded rbspy_ext.
pub fn find_profiler_state_symbols(pid: i32, maps: &[Mapping]) -> Option<ProfilerStateSymbols> {
    const OFFSET: &str = "ruby_profiler_state_tp_offset";
    const OWNER: &str = "ruby_profiler_state_owner_tp_offset";
    const OTEL: &str = "otel_thread_ctx_v1_tp_offset";
    extension_paths(maps).into_iter().find_map(|p| {
        let binary = read_binary(pid, maps, p, &[OFFSET, OWNER, OTEL]).ok()?;
        Some(ProfilerStateSymbols {
            offset: binary.symbol(OFFSET)?,
            owner_offset: binary.symbol(OWNER),
            otel_offset: binary.symbol(OTEL),
        })
    })
}

/// The address of `name` in an rbspy_ext extension the target has loaded, if it has one
/// that exports it.
pub fn find_extension_symbol(pid: i32, maps: &[Mapping], name: &str) -> Option<u64> {
    extension_paths(maps)
        .into_iter()
        .find_map(|p| read_binary(pid, maps, p, &[name]).ok()?.symbol(name))
}

/// Every mapped `rbspy_ext*.so`.
fn extension_paths(maps: &[Mapping]) -> Vec<&str> {
    let mut paths: Vec<&str> = maps
        .iter()
        .map(|m| m.path.as_str())
        .filter(|p| {
            let file = p.rsplit('/').next().unwrap_or(p);
            file.contains("rbspy_ext") && file.ends_with(".so")
        })
        .collect();
    paths.dedup();
    paths
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_numbers_come_from_preforking_servers_titles() {
        let w = |t: &str| worker_in_title(t);
        assert_eq!(
            w("puma: cluster worker 1: 4242 [app]").as_deref(),
            Some("1")
        );
        assert_eq!(w("puma: cluster worker 12: 4242").as_deref(), Some("12"));
        assert_eq!(
            w("unicorn worker[3] -c config/unicorn.rb").as_deref(),
            Some("3")
        );
        assert_eq!(w("puma 6.6.0 (tcp://127.0.0.1:3000) [app]"), None);
        assert_eq!(w("ruby\0bin/rails\0server"), None);
        assert_eq!(w("sidekiq worker[x]"), None);
    }

    #[test]
    fn parses_maps_lines_with_and_without_paths() {
        let text = "55d0c0a00000-55d0c0a01000 r--p 00000000 fe:01 123 /usr/bin/ruby3.1\n\
                    7f00-8f00 rw-p 00001000 00:00 0 \n\
                    7fff0000-7fff1000 rw-p 00000000 00:00 0 [stack]\n\
                    garbage line\n\
                    7f0000-7f1000 r-xp 00000000 fe:01 9 /opt/my dir/libruby.so.3.1\n";
        let maps = parse_maps(text);
        assert_eq!(maps.len(), 4);
        assert_eq!(maps[0].start, 0x55d0c0a00000);
        assert_eq!(maps[0].path, "/usr/bin/ruby3.1");
        assert_eq!(maps[1].offset, 0x1000);
        assert_eq!(maps[1].path, "");
        assert_eq!(maps[3].path, "/opt/my dir/libruby.so.3.1");
        assert!(is_libruby(&maps[3].path));
        assert!(!is_libruby("/usr/bin/ruby"));
    }

    #[test]
    fn identity_tells_exec_and_pid_reuse_apart() {
        let pid = std::process::id() as i32;
        let me = Identity::of(pid).expect("this process has an identity");
        assert!(!me.auxv.is_empty(), "our own auxv is readable");
        assert_eq!(me.replaced_by(pid, &Identity::of(pid).unwrap()), None);
        let mut reused = me.clone();
        reused.start_ticks += 1;
        assert_eq!(me.replaced_by(pid, &reused), Some(Replaced::PidReused));
        let mut execed = me.clone();
        execed.auxv[8] ^= 1;
        assert!(matches!(
            me.replaced_by(pid, &execed),
            Some(Replaced::Exec(_))
        ));
        assert_eq!(Identity::of(i32::MAX), None);
    }

    #[test]
    fn own_process_is_not_ruby() {
        let pid = std::process::id() as i32;
        let maps = read_maps(pid).unwrap();
        let err = find_ruby_binary(pid, &maps).unwrap_err();
        assert!(matches!(err, Error::NotRuby { .. }), "{err}");
    }

    #[test]
    fn missing_process_is_reported() {
        assert!(matches!(
            read_maps(i32::MAX),
            Err(Error::NoSuchProcess { .. })
        ));
    }
}
