//! Attaching to a process: libruby, its version and layout, its VM, and the identity check
//! that notices the pid running something else later.
use super::fits::{fitting, not_fitting};
use super::layouts;
use super::leaves::{Attempt, Config, IDENTITY_TTL};
use super::parts::ImageParts;
use crate::error::{Error, MemoryError, ObjectError, Result};
use crate::memory::{field, Memory, ProcessMemory};
use crate::objects::SymbolTable;
use crate::process::{
    find_pthread_tid_descriptor, find_ruby_binary, heap_ranges, read_maps, Identity, Mapping,
    Replaced, RubyBinary,
};
use crate::vm::{check_vm, find_vm, VmRoots};
use rbspy_ext_bindings::Layout;

/// When `Target::check_identity` looks at /proc again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Check {
    /// Once `IDENTITY_TTL` has passed since the last look: before every read.
    WhenDue,
    /// At once: after a read failed, which may be the process gone or replaced.
    Now,
}

/// What attaching to a process found, fixed for the spy's life: the process, its memory, the
/// layout of its Ruby, and the VM's roots.
pub(super) struct Target<M: Memory> {
    pub(super) pid: i32,
    pub(super) mem: M,
    pub(super) layout: &'static Layout,
    pub(super) version: String,
    pub(super) warning: Option<String>,
    pub(super) layout_source: layouts::LayoutSource,
    pub(super) vm: u64,
    /// Address of the word naming the thread that holds the GVL (0 when none does).
    pub(super) gvl_owner: u64,
    pub(super) main_thread: u64,
    /// libruby's writable segments (where the VM and symbol-table scans look).
    pub(super) writable: Vec<(u64, u64)>,
    /// The mappings Ruby objects lived in at attach (`process::heap_ranges`; empty for a
    /// memory image): where the symbol-table scan looks first.
    pub(super) heap: Vec<(u64, u64)>,
    /// The attached process's identity and when it was last checked (None for memory that
    /// is not a live process's): see `check_identity`.
    pub(super) identity: Option<(Identity, std::time::Instant)>,
    /// Address of the list of every Ruby thread.
    pub(super) thread_list_head: u64,
    /// Where glibc keeps a thread's tid in its `struct pthread`, for Rubies that record no
    /// native thread id (before 3.1): see `pthread_tid_offset`.
    pub(super) pthread_tid: Option<u64>,
    /// 4.1: the address of `rb_zjit_entry`, when the binary names it, and whether it was
    /// last seen set (ZJIT on: frames may keep their iseq and pc in JITFrames) and when.
    pub(super) zjit_entry: Option<u64>,
    pub(super) zjit_on: Option<(bool, std::time::Instant)>,
    /// `rb_zjit_entry` and `rb_yjit_enabled_p` whatever the version, when the binary names
    /// them (a static ruby's `.symtab`): which JIT is on, for a profile's metadata.
    pub(super) jit_flags: [Option<u64>; 2],
    /// The address of the shape tree's global for the heap census (census/shapes.rs):
    /// `rb_shape_tree` from 4.0, `rb_shape_tree_ptr` on 3.3 and 3.4 (named by the binary, or
    /// found by a scan at the first census). None before 3.2, or until found.
    pub(super) shape_tree: Option<u64>,
    /// Whether the scan for `rb_shape_tree_ptr` ran (it reads libruby's data: once).
    pub(super) shape_tree_scanned: bool,
}

impl Target<ProcessMemory> {
    /// Attaches to a live process: finds libruby, its version and its VM. With the target,
    /// the address of its `rb_symbols_t` when the binary names it.
    pub(super) fn attach(pid: i32, config: &Config) -> Result<(Self, Option<u64>)> {
        if pid <= 0 {
            return Err(Error::InvalidArgument(format!(
                "pid must be positive, got {pid}"
            )));
        }
        // Taken first: whatever is read next belongs to this process or is noticed not to.
        let identity = Identity::of(pid);
        let maps = read_maps(pid)?;
        let binary = find_ruby_binary(pid, &maps)?;
        let mem = ProcessMemory::new(pid);
        let version_addr = binary
            .symbol("ruby_version")
            .expect("checked by find_ruby_binary");
        let raw = mem
            .read_vec(version_addr, 16)
            .map_err(|e| starting(pid, "ruby_version", e))?;
        let found =
            String::from_utf8_lossy(raw.split(|b| *b == 0).next().unwrap_or(&[])).into_owned();
        let wanted = config
            .force_version
            .clone()
            .unwrap_or_else(|| found.clone());
        let (candidates, source) =
            layouts::choose(pid, &maps, &binary, &found, config.force_version.as_deref())?;
        // The first candidate layout whose VM validates; an unknown patch release may have
        // any of its minor series' layouts (4.0.6 moved fields that 4.0.5 had).
        let mut first_error = None;
        let mut chosen = None;
        for (layout, warning) in candidates {
            match find_roots(pid, &mem, layout, &binary, &maps, config, &found) {
                Ok(roots) => {
                    chosen = Some((layout, warning, roots));
                    break;
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        let Some((layout, warning, roots)) = chosen else {
            let error = first_error.expect("layouts::choose gives at least one layout");
            return Err(layouts::refusal(&source, pid, &found).unwrap_or_else(|| {
                not_fitting(
                    pid,
                    identity.as_ref(),
                    &binary,
                    &mem,
                    &found,
                    &wanted,
                    error,
                )
            }));
        };
        let mut t = Target::new(pid, mem, layout, &found, roots);
        t.warning = warning;
        t.layout_source = layouts::settled(source, layout);
        t.identity = identity.map(|i| (i, std::time::Instant::now()));
        t.writable = binary.writable.clone();
        t.heap = heap_ranges(&maps);
        t.pthread_tid = pthread_tid_offset(pid, &t.mem, layout, &maps, &roots);
        t.shape_tree = binary
            .symbol("rb_shape_tree")
            .or_else(|| binary.symbol("rb_shape_tree_ptr"));
        t.zjit_entry = binary
            .symbol("rb_zjit_entry")
            .filter(|_| layout.cfp_jit_return.is_some());
        t.jit_flags = [
            binary.variable("rb_zjit_entry", 8),
            binary.variable("rb_yjit_enabled_p", 1),
        ];
        Ok((t, binary.symbol("ruby_global_symbols")))
    }
}

/// glibc's offset of `tid` in `struct pthread` on x86_64 since 2.x; used where libc does not
/// export its libthread_db descriptor (glibc before 2.34).
const GLIBC_PTHREAD_TID: u64 = 0x2d0;

/// For a Ruby that keeps only each thread's `pthread_t` (2.7, 3.0), where glibc keeps the
/// thread's tid in it. Trusted only when the main thread's reads back as the process id, so
/// another libc (musl) or a target in a PID namespace of its own gives None (tid 0, as
/// before) rather than a wrong id.
fn pthread_tid_offset<M: Memory>(
    pid: i32,
    mem: &M,
    l: &Layout,
    maps: &[Mapping],
    roots: &VmRoots,
) -> Option<u64> {
    let pthread = l
        .thread_pthread
        .filter(|_| l.thread_tid.is_none() && l.thread_nt.is_none())?;
    let offset = match find_pthread_tid_descriptor(pid, maps) {
        Some(addr) => {
            let mut d = [0u8; 12];
            mem.read(addr, &mut d).ok()?;
            let (bits, count) = (crate::memory::word32(&d, 0), crate::memory::word32(&d, 4));
            if bits != 32 || count != 1 {
                return None;
            }
            u64::from(crate::memory::word32(&d, 8))
        }
        None => GLIBC_PTHREAD_TID,
    };
    let main = mem
        .read_u64(crate::memory::field(roots.main_thread, pthread))
        .ok()?;
    let mut tid = [0u8; 4];
    mem.read(main.wrapping_add(offset), &mut tid).ok()?;
    (i32::from_le_bytes(tid) == pid).then_some(offset)
}

/// The VM and what hangs off it: through `ruby_current_vm_ptr` when libruby exports it, else
/// (Debian's stripped 3.3 and 3.4, or `config.scan_for_vm`) by scanning libruby's data.
fn find_roots(
    pid: i32,
    mem: &ProcessMemory,
    layout: &'static Layout,
    binary: &RubyBinary,
    maps: &[Mapping],
    config: &Config,
    found: &str,
) -> Result<VmRoots> {
    let vm_symbol = binary
        .symbol("ruby_current_vm_ptr")
        .or_else(|| binary.symbol("ruby_current_vm"))
        .filter(|_| !config.scan_for_vm);
    match vm_symbol {
        Some(vm_ptr) => {
            let vm = mem
                .read_u64(vm_ptr)
                .map_err(|e| starting(pid, "ruby_current_vm_ptr", e))?;
            // A VM that does not validate yet is usually a Ruby still starting up (the
            // pointer is set before the VM is complete): say so, so callers can retry.
            let roots = check_vm(mem, layout, vm).ok_or_else(|| Error::NotRuby {
                pid,
                detail: format!(
                    "ruby_current_vm_ptr points at {vm:#x}, which does not validate as a VM \
                     (Ruby {found} may still be starting: try again; or check force_version)"
                ),
            })?;
            fitting(pid, mem, layout, roots, found)
        }
        None => {
            // Stripped of the symbol (Debian's 3.3 and 3.4, a stripped static ruby): scan
            // libruby's data. 4.1 allocates the VM, the main ractor and the main thread
            // statically, in that data itself, rather than on the heap.
            let mut heap = heap_ranges(maps);
            heap.extend_from_slice(&binary.writable);
            let (vm, examined) = find_vm(mem, layout, &binary.writable, &heap);
            let roots = vm.ok_or_else(|| Error::NotRuby {
                pid,
                detail: format!(
                    "{} (Ruby {found_version}) exports no ruby_current_vm_ptr and none of the \
                     {examined} pointers in its writable data validates as a VM; if the \
                     process is still starting, try again{hint}",
                    binary.path,
                    found_version = found,
                    hint = if config.force_version.is_some() {
                        ", or check force_version"
                    } else {
                        ""
                    }
                ),
            })?;
            fitting(pid, mem, layout, roots, found)
        }
    }
}

/// A symbol of libruby that cannot be read while attaching: the mappings are changing,
/// which happens while a process execs into Ruby or Ruby loads. Reported as "not Ruby (yet)",
/// the error that says to try again.
pub(super) fn starting(pid: i32, symbol: &str, e: MemoryError) -> Error {
    match e {
        MemoryError::Unmapped { .. } | MemoryError::Other(_) => Error::NotRuby {
            pid,
            detail: format!(
                "{symbol} is not readable yet ({e}); if the process is still starting, try again"
            ),
        },
        e => memory_error(pid, "reading libruby", e),
    }
}

pub(super) fn memory_error(pid: i32, context: &'static str, e: MemoryError) -> Error {
    match e {
        MemoryError::Gone => Error::ProcessExited { pid },
        MemoryError::Denied => Error::PermissionDenied { pid },
        source => Error::Memory {
            pid,
            context,
            source,
        },
    }
}

impl<M: Memory> Target<M> {
    /// A target over any memory source whose VM is already known (`Spy::with_memory`).
    pub(super) fn new(
        pid: i32,
        mem: M,
        layout: &'static Layout,
        version: &str,
        roots: VmRoots,
    ) -> Self {
        Target {
            pid,
            mem,
            layout,
            version: version.to_string(),
            warning: None,
            layout_source: layouts::LayoutSource::Table {
                name: layout.name,
                unusable: None,
            },
            vm: roots.vm,
            gvl_owner: roots.gvl_owner,
            main_thread: roots.main_thread,
            writable: Vec::new(),
            heap: Vec::new(),
            identity: None,
            thread_list_head: roots.thread_list,
            pthread_tid: None,
            zjit_entry: None,
            zjit_on: None,
            jit_flags: [None, None],
            shape_tree: None,
            shape_tree_scanned: false,
        }
    }
}

impl<M: Memory> Target<M> {
    /// The `rb_objspace` of the VM (`vm->gc.objspace`), or of the main Ractor where each
    /// Ractor owns its heap (`r->objspace`); 0 when unreadable (then GC is simply not told
    /// apart).
    pub(super) fn main_objspace(&self) -> u64 {
        let l = self.layout;
        let at = match (l.vm_objspace, l.ractor_objspace, l.vm_main_ractor) {
            (Some(o), _, _) => field(self.vm, o),
            (None, Some(o), Some(r)) => match self.mem.read_u64(field(self.vm, r)) {
                Ok(ractor) if crate::objects::is_heap_object(ractor) => field(ractor, o),
                _ => return 0,
            },
            _ => return 0,
        };
        self.mem.read_u64(at).unwrap_or(0)
    }

    /// Maps a read failure during a walk: the process being gone or unreadable is fatal,
    /// an unmapped address means the stack moved under us.
    pub(super) fn moved(&self, what: &str) -> impl Fn(MemoryError) -> Attempt + '_ {
        let what = what.to_string();
        move |e| match e {
            MemoryError::Gone => Attempt::Fatal(Error::ProcessExited { pid: self.pid }),
            MemoryError::Denied => Attempt::Fatal(Error::PermissionDenied { pid: self.pid }),
            other => Attempt::Changed(format!("{what}: {other}")),
        }
    }

    /// The word at `base + offset` in the target (wrapping); a failed read is `moved(what)`.
    pub(super) fn read_word(
        &self,
        base: u64,
        offset: usize,
        what: &str,
    ) -> std::result::Result<u64, Attempt> {
        self.mem
            .read_u64(field(base, offset))
            .map_err(self.moved(what))
    }

    pub(super) fn object_moved(&self, what: &str, e: ObjectError) -> Attempt {
        match e {
            ObjectError::Memory(m) => self.moved(what)(m),
            ObjectError::Shape(kind, addr) => {
                Attempt::Changed(format!("{what}: {kind} at {addr:#x} does not validate"))
            }
        }
    }

    /// Err when the pid no longer holds the process attached to: gone (`ProcessExited`), or
    /// `ProcessReplaced` when it ran exec or the pid was reused, so that nothing read from it
    /// is taken for the old process's. Checked at most every [`IDENTITY_TTL`] (two small
    /// /proc reads) unless `Check::Now`, which the read paths ask for after a failure.
    pub(super) fn check_identity(&mut self, when: Check) -> Result<()> {
        let pid = self.pid;
        let Some((identity, checked)) = &mut self.identity else {
            return Ok(());
        };
        if when == Check::WhenDue && checked.elapsed() < IDENTITY_TTL {
            return Ok(());
        }
        *checked = std::time::Instant::now();
        let Some(current) = Identity::of(pid) else {
            return Err(Error::ProcessExited { pid });
        };
        let detail = match identity.replaced_by(pid, &current) {
            None => return Ok(()),
            Some(Replaced::PidReused) => {
                "exited and its pid now belongs to another process".to_string()
            }
            Some(Replaced::Exec(exe)) => format!("ran exec and now runs {exe}"),
        };
        Err(Error::ProcessReplaced { pid, detail })
    }

    /// The symbol table in `slot`, found first if it is not there yet (see
    /// `find_symbol_table`). The slot is `Cache::symbols`, passed alone so that the caller
    /// may use the cache's class names beside it.
    pub(super) fn symbol_table<'a>(
        &self,
        slot: &'a mut Option<SymbolTable>,
    ) -> std::result::Result<&'a mut SymbolTable, Attempt> {
        if slot.is_none() {
            let addr = self
                .find_symbol_table()
                .ok_or(Attempt::Fatal(Error::Corrupt {
                    pid: self.pid,
                    what: "symbol table (not found in libruby's data)",
                    addr: 0,
                }))?;
            *slot = Some(SymbolTable::new(addr));
        }
        Ok(slot.as_mut().expect("just set"))
    }

    /// Finds `ruby_global_symbols` in a libruby that does not export it: scans the writable
    /// segments for a struct that validates through its `ids` array. Words that merely look
    /// like one are common (thousands in some runs, as ASLR places things), so only those
    /// whose `ids` lies in a mapping a Ruby object can live in are candidates, and all their
    /// `ids` headers are read in one batch per segment (`read_each` costs one more call per
    /// unreadable address, which the mapping filter makes rare). The mappings of attach
    /// time come first; the `ids` array may have moved to a newer one since, so a miss
    /// looks again with the mappings of now. A memory image (tests) has none: no filter.
    pub(super) fn find_symbol_table(&self) -> Option<u64> {
        if self.heap.is_empty() {
            return self.scan_for_symbol_table(None);
        }
        self.scan_for_symbol_table(Some(&self.heap)).or_else(|| {
            // Not for an image (no identity): its pid is nobody's.
            self.identity.as_ref()?;
            let now = heap_ranges(&read_maps(self.pid).ok()?);
            self.scan_for_symbol_table(Some(&now))
        })
    }

    /// One scan of `find_symbol_table`, keeping candidates whose `ids` lies in `heap`.
    fn scan_for_symbol_table(&self, heap: Option<&[(u64, u64)]>) -> Option<u64> {
        let l = self.layout;
        let in_heap = |p: u64| heap.is_none_or(|h| h.iter().any(|(s, e)| (*s..*e).contains(&p)));
        let head_len = crate::objects::array_head_len(l);
        self.scan_writable(
            l.symbols_size,
            head_len,
            |bytes| {
                SymbolTable::candidate(l, bytes)
                    .filter(|(_, ids)| in_heap(*ids))
                    .map(|(last_id, ids)| (ids, (last_id, ids)))
            },
            |&(last_id, ids), head| {
                SymbolTable::confirms(l, last_id, head)
                    && (l.id_dir.is_none() || SymbolTable::resolves(&self.mem, l, ids, last_id))
            },
        )
        .map(|(at, _)| at)
    }

    /// Scans libruby's writable segments, word by word, for a struct only one word of the
    /// data holds: `pick` takes the `window` bytes from a word on and gives the address the
    /// candidate points to (and what it needs to confirm); the `head_len` bytes there are
    /// read for every candidate of a segment in one batch, and the first that `confirms`
    /// wins. Gives that word's address and the candidate.
    pub(super) fn scan_writable<C>(
        &self,
        window: usize,
        head_len: usize,
        pick: impl Fn(&[u8]) -> Option<(u64, C)>,
        confirms: impl Fn(&C, &[u8]) -> bool,
    ) -> Option<(u64, C)> {
        for &(start, end) in &self.writable {
            let len = end.saturating_sub(start).min(16 << 20) as usize;
            let Ok(data) = self.mem.read_vec(start, len) else {
                continue;
            };
            let candidates: Vec<(usize, u64, C)> = (0..data.len().saturating_sub(window) + 1)
                .step_by(8)
                .filter_map(|off| {
                    let (at, c) = pick(data.get(off..off + window)?)?;
                    Some((off, at, c))
                })
                .collect();
            let heads = self
                .mem
                .read_blocks(candidates.iter().map(|(_, at, _)| (*at, head_len)));
            let found = heads
                .iter()
                .zip(&candidates)
                .position(|(head, (_, _, c))| head.as_deref().is_some_and(|h| confirms(c, h)));
            if let Some(i) = found {
                let (off, _, c) = candidates.into_iter().nth(i).expect("found");
                return Some((field(start, off), c));
            }
        }
        None
    }
}

impl<M: Memory> Target<M> {
    /// What a spy over a memory image of this target needs besides the memory
    /// (`Spy::image_parts`), as attaching and the walks so far found it: `symbols` and
    /// `tags` are what the spy's caches and tag reader found.
    pub(super) fn image_parts(
        &self,
        symbols: Option<u64>,
        tags: Option<(i64, Option<i64>)>,
    ) -> ImageParts {
        let t = self;
        ImageParts {
            layout: t.layout,
            version: t.version.clone(),
            roots: VmRoots {
                vm: t.vm,
                main_thread: t.main_thread,
                gvl_owner: t.gvl_owner,
                thread_list: t.thread_list_head,
            },
            symbols,
            writable: t.writable.clone(),
            heap: t.heap.clone(),
            tags,
            pthread_tid: t.pthread_tid,
            zjit_entry: t.zjit_entry,
            shape_tree: t.shape_tree,
        }
    }

    /// A spy over `mem`, a copy of (some of) the memory of the target `parts` were taken
    /// from (`image::capture`): what attaching found by reading the process (its maps and
    /// ELF files) comes from `parts` instead, and nothing is read from the process's files
    /// afterwards (an image's pid is nobody's).
    pub(super) fn over_image(pid: i32, mem: M, parts: &ImageParts) -> Self {
        let p = parts;
        let mut t = Target::new(pid, mem, p.layout, &p.version, p.roots);
        t.writable = p.writable.clone();
        t.heap = p.heap.clone();
        t.pthread_tid = p.pthread_tid;
        t.zjit_entry = p.zjit_entry;
        t.shape_tree = p.shape_tree;
        t.shape_tree_scanned = p.shape_tree.is_some();
        t
    }
}
