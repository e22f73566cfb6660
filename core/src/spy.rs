//! The one stack walker: attach to a process once, then read its current stack as often as
//! needed. Everything that cannot change between samples (addresses, the layout, iseq
//! labels and line tables, method names, class names) is cached in the [`Spy`], so a warm
//! snapshot costs four `process_vm_readv` calls: thread state, control frames, frame
//! environments + iseq headers, and method-entry headers.
use crate::error::{Error, MemoryError, Result};
use crate::lines::LineTable;
use crate::memory::{Memory, ProcessMemory};
use crate::objects::{
    is_heap_object, read_array_entry, read_string, word, word32, ClassNames, ObjectError,
    SymbolTable, T_ARRAY, T_IMEMO, T_MASK, T_STRING,
};
use crate::process::{find_ruby_binary, read_maps, Identity, Replaced};
use crate::vm::{check_vm, find_vm, VmRoots};
use rbspy_ext_bindings::{layout_for_minor, layout_for_version, Layout};
use rustc_hash::FxHashMap;
use std::sync::Arc;

#[path = "spy_threads.rs"]
mod threads;
pub use threads::{SampledThread, ThreadSelection};
#[path = "spy_tags.rs"]
mod tags;
pub use tags::Tags;

/// Most frames one stack may have: Ruby's default VM stack (1 MiB) holds fewer.
const MAX_FRAMES: u64 = 65_536;
/// Most environments followed from a block frame to its method frame.
const MAX_EP_DEPTH: usize = 256;
/// Most bytes of one thread's value stack read (Ruby's default VM stack is 1 MiB; the
/// fuzz test found garbage frames asking for far more).
const MAX_VALUE_STACK: usize = 64 << 20;
/// How long cached iseqs and method entries are trusted without reading their headers.
const REVALIDATE: std::time::Duration = std::time::Duration::from_millis(100);
/// How often a spy makes sure its pid still holds the process it attached to.
pub const IDENTITY_TTL: std::time::Duration = std::time::Duration::from_millis(100);
/// Most escaped environments cached between samples.
const MAX_CACHED_ENVS: usize = 4096;
/// Most distinct raw stacks remembered with their frames (see `Spy::memo`).
const MAX_MEMO: usize = 16_384;
/// And at most this many bytes of them (signatures and frames, roughly): a target that starts
/// threads all the time puts every stack at new addresses, so the memo fills with stacks that
/// never come back; deep stacks would make 16k of them ~100 MB, while a few thousand of the
/// stacks a steady program repeats fit in 8 MB.
const MAX_MEMO_BYTES: usize = 8 << 20;
/// How often a snapshot is retried when the stack changes under it.
pub const SNAPSHOT_ATTEMPTS: u32 = 8;

/// One frame, innermost first, shaped like `Thread::Backtrace::Location`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Frame {
    /// Qualified the way Ruby 3.4 prints it: `Foo::Bar#baz`, `block in Foo.build`.
    pub label: Arc<str>,
    pub base_label: Arc<str>,
    pub path: Arc<str>,
    pub absolute_path: Option<Arc<str>>,
    pub lineno: i32,
    pub c_function: bool,
}

/// Options for [`Spy::attach_with`].
#[derive(Debug, Clone, Default)]
pub struct Config {
    /// Use this version's layout instead of the one the process reports.
    pub force_version: Option<String>,
    /// Find the VM by scanning libruby's data even when `ruby_current_vm_ptr` is exported
    /// (what stripped 3.3+ builds need; lets tests exercise the scan on any Ruby).
    pub scan_for_vm: bool,
}

/// What never changes about one iseq.
#[derive(Debug)]
struct IseqInfo {
    body: u64,
    encoded: u64,
    size: u32,
    path: Arc<str>,
    absolute_path: Option<Arc<str>>,
    label: Arc<str>,
    base_label: Arc<str>,
    /// True when the iseq belongs to a method (its local iseq is a method), so its label
    /// gets the owner's name.
    in_method: bool,
    /// `body.local_iseq`: the method (or top-level/class body) this iseq belongs to.
    local_iseq: u64,
    /// The iseq is a method body itself (its frames always have a method entry).
    is_method: bool,
    /// `body.type` (ISEQ_TYPE_*).
    kind: u32,
    lines: LineTable,
    /// Qualified labels by owner class.
    qualified: FxHashMap<u64, Arc<str>>,
}

/// What is cached about one method entry, checked against its header on every sample.
#[derive(Debug, Clone)]
struct MethodInfo {
    def: u64,
    owner: u64,
    def_type: u64,
    original_id: u64,
    /// For Ruby methods: the iseqs its frames may run (the body, and the
    /// mandatory-only variant of some builtins); a frame claiming this entry must run one.
    iseqs: [u64; 2],
    /// `Owner#name` for C functions.
    cfunc_label: Option<Arc<str>>,
    name: Option<Arc<str>>,
}

/// A handle on one Ruby process.
pub struct Spy<M: Memory = ProcessMemory> {
    pid: i32,
    mem: M,
    layout: &'static Layout,
    version: String,
    warning: Option<String>,
    vm: u64,
    /// Address of the word naming the thread that holds the GVL (0 when none does).
    gvl_owner: u64,
    main_thread: u64,
    symbols: Option<SymbolTable>,
    writable: Vec<(u64, u64)>,
    classes: ClassNames,
    iseqs: FxHashMap<u64, IseqInfo>,
    methods: FxHashMap<u64, MethodInfo>,
    /// The thread and execution context seen last, read speculatively in one call.
    last_ec: Option<(u64, u64)>,
    /// Bytes of value stack the last sample of each stack needed, by `vm_stack` address
    /// (see `read_frames`).
    stack_hints: FxHashMap<u64, usize>,
    /// Environments that escaped to the heap, by `ep` (see `env_slots`).
    heap_envs: FxHashMap<u64, Slots>,
    /// Candidate method-entry addresses that turned out to be crefs (not method entries).
    not_methods: rustc_hash::FxHashSet<u64>,
    /// When cached iseqs and method entries were last all read again.
    validated_at: Option<std::time::Instant>,
    /// The attached process's identity and when it was last checked (None for memory that
    /// is not a live process's): see `check_identity`.
    identity: Option<(Identity, std::time::Instant)>,
    /// Address of the list of every Ruby thread, and its last reading (spy_threads.rs).
    thread_list_head: u64,
    thread_list: threads::ThreadList,
    /// Frames already resolved, by raw stack (see `Signature`): a stack seen before in the
    /// current validation epoch is answered without resolving anything. The walker is a
    /// function of the raw words and of its caches, which are trusted for exactly as long.
    memo: FxHashMap<Box<[u64]>, Memo>,
    /// What `memo` holds, roughly, in bytes.
    memo_bytes: usize,
    /// Bumped whenever the caches behind `memo` are validated or dropped.
    epoch: u64,
    /// Last token handed out (`Stack::token`).
    tokens: u64,
    /// Reused buffer for the signature of the stack being walked.
    signature: Vec<u64>,
    /// Buffers for control frames and value stacks, reused from sample to sample.
    spare: Vec<Vec<u8>>,
    /// Where the target publishes `ruby_profiler_state` (spy_tags.rs).
    tag_source: tags::TagSource,
}

/// One walked stack, innermost frame first.
#[derive(Debug, Clone)]
pub struct Stack {
    pub frames: Arc<[Frame]>,
    /// Names these exact frames for as long as this spy lives: two stacks with the same token
    /// have equal frames (equal frames may still come with different tokens). Lets the
    /// aggregator count a repeated stack without looking at its frames.
    pub token: u64,
}

#[derive(Debug)]
struct Memo {
    stack: Stack,
    epoch: u64,
}

/// A failure inside one attempt: either the stack moved (retry) or a real error.
enum Attempt {
    Changed(String),
    Fatal(Error),
}

impl From<Error> for Attempt {
    fn from(e: Error) -> Self {
        Attempt::Fatal(e)
    }
}

impl Spy<ProcessMemory> {
    /// Attaches to a live process: finds libruby, its version and its VM.
    pub fn attach(pid: i32) -> Result<Self> {
        Self::attach_with(pid, &Config::default())
    }

    pub fn attach_with(pid: i32, config: &Config) -> Result<Self> {
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
        let (layout, warning) = resolve_layout(pid, &wanted)?;
        let vm_symbol = binary
            .symbol("ruby_current_vm_ptr")
            .or_else(|| binary.symbol("ruby_current_vm"))
            .filter(|_| !config.scan_for_vm);
        let roots = match vm_symbol {
            Some(vm_ptr) => {
                let vm = mem
                    .read_u64(vm_ptr)
                    .map_err(|e| starting(pid, "ruby_current_vm_ptr", e))?;
                // A VM that does not validate yet is usually a Ruby still starting up (the
                // pointer is set before the VM is complete): say so, so callers can retry.
                check_vm(&mem, layout, vm).ok_or_else(|| Error::NotRuby {
                    pid,
                    detail: format!(
                        "ruby_current_vm_ptr points at {vm:#x}, which does not validate as a VM \
                         (Ruby {found} may still be starting: try again; or check force_version)"
                    ),
                })?
            }
            None => {
                // Stripped of the symbol (Debian's 3.3 and 3.4): scan libruby's data.
                let heap: Vec<(u64, u64)> = maps
                    .iter()
                    .filter(|m| {
                        m.perms.starts_with("rw") && (m.path.is_empty() || m.path == "[heap]")
                    })
                    .map(|m| (m.start, m.end))
                    .collect();
                let (vm, examined) = find_vm(&mem, layout, &binary.writable, &heap);
                vm.ok_or_else(|| Error::NotRuby {
                    pid,
                    detail: format!(
                        "{} (Ruby {found_version}) exports no ruby_current_vm_ptr and none of the \
                         {examined} pointers in its writable data validates as a VM; if the \
                         process is still starting, try again{hint}",
                        binary.path,
                        found_version = found.as_str(),
                        hint = if config.force_version.is_some() {
                            ", or check force_version"
                        } else {
                            ""
                        }
                    ),
                })?
            }
        };
        let mut spy = Spy::with_memory(
            pid,
            mem,
            layout,
            &found,
            roots,
            binary.symbol("ruby_global_symbols"),
        );
        spy.warning = warning;
        spy.identity = identity.map(|i| (i, std::time::Instant::now()));
        spy.writable = binary.writable.clone();
        Ok(spy)
    }
}

/// A symbol of libruby that cannot be read while attaching: the mappings are changing,
/// which happens while a process execs into Ruby or Ruby loads. Reported as "not Ruby (yet)",
/// the error that says to try again.
fn starting(pid: i32, symbol: &str, e: MemoryError) -> Error {
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

fn memory_error(pid: i32, context: &'static str, e: MemoryError) -> Error {
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

/// The layout for a version string, falling back to the newest known release of the same
/// minor series (with a warning).
fn resolve_layout(pid: i32, version: &str) -> Result<(&'static Layout, Option<String>)> {
    let parts: Vec<u32> = version
        .split('.')
        .map(|p| p.parse::<u32>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| Error::UnsupportedVersion {
            pid,
            version: version.to_string(),
            detail: "not a MAJOR.MINOR.PATCH version".into(),
        })?;
    if parts.len() != 3 {
        return Err(Error::UnsupportedVersion {
            pid,
            version: version.to_string(),
            detail: "not a MAJOR.MINOR.PATCH version".into(),
        });
    }
    if let Some(layout) = layout_for_version(version) {
        return Ok((layout, None));
    }
    match layout_for_minor(parts[0], parts[1]) {
        Some((known, layout)) => Ok((
            layout,
            Some(format!(
                "Ruby {version} is newer than the layout table; using the layout of {known}"
            )),
        )),
        None => Err(Error::UnsupportedVersion {
            pid,
            version: version.to_string(),
            detail: format!(
                "known layouts: {}",
                rbspy_ext_bindings::VERSIONS
                    .iter()
                    .map(|(v, _)| *v)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }),
    }
}

impl<M: Memory> Spy<M> {
    /// A spy over any memory source whose VM is already known: for tests and fuzzing
    /// against memory images (`symbols`: the address of `rb_symbols_t`, if known).
    pub fn with_memory(
        pid: i32,
        mem: M,
        layout: &'static Layout,
        version: &str,
        roots: VmRoots,
        symbols: Option<u64>,
    ) -> Self {
        Spy {
            pid,
            mem,
            layout,
            version: version.to_string(),
            warning: None,
            vm: roots.vm,
            gvl_owner: roots.gvl_owner,
            main_thread: roots.main_thread,
            symbols: symbols.map(SymbolTable::new),
            writable: Vec::new(),
            classes: ClassNames::default(),
            iseqs: FxHashMap::default(),
            methods: FxHashMap::default(),
            last_ec: None,
            stack_hints: FxHashMap::default(),
            heap_envs: FxHashMap::default(),
            not_methods: Default::default(),
            validated_at: None,
            identity: None,
            thread_list_head: roots.thread_list,
            thread_list: threads::ThreadList::default(),
            memo: FxHashMap::default(),
            memo_bytes: 0,
            epoch: 0,
            tokens: 0,
            signature: Vec::new(),
            spare: Vec::new(),
            tag_source: tags::TagSource::default(),
        }
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Err when the pid no longer holds the process attached to: gone (`ProcessExited`), or
    /// `ProcessReplaced` when it ran exec or the pid was reused, so that nothing read from it
    /// is taken for the old process's. Checked at most every [`IDENTITY_TTL`] (two small
    /// /proc reads) unless `now`, which the read paths ask for after a failure.
    pub fn check_identity(&mut self, now: bool) -> Result<()> {
        let pid = self.pid;
        let Some((identity, checked)) = &mut self.identity else {
            return Ok(());
        };
        if !now && checked.elapsed() < IDENTITY_TTL {
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

    /// The Ruby version the target reports (e.g. "3.1.2").
    pub fn version(&self) -> &str {
        &self.version
    }

    /// Set when the layout came from the newest known release of the same minor series.
    pub fn warning(&self) -> Option<&str> {
        self.warning.as_deref()
    }

    pub fn memory(&self) -> &M {
        &self.mem
    }

    /// The memory source, writable: tests rewrite a memory image between samples.
    pub fn memory_mut(&mut self) -> &mut M {
        &mut self.mem
    }

    /// The address of the target's `rb_vm_t`.
    pub fn vm_address(&self) -> u64 {
        self.vm
    }

    /// The stack of the thread holding the GVL (the main thread when none does), innermost
    /// frame first. Retries a bounded number of times if the stack changes while read.
    pub fn snapshot(&mut self) -> Result<Vec<Frame>> {
        self.check_identity(false)?;
        let mut last = String::new();
        for _ in 0..SNAPSHOT_ATTEMPTS {
            match self.try_snapshot() {
                Ok(stack) => return Ok(stack.frames.to_vec()),
                Err(Attempt::Fatal(e)) => {
                    self.check_identity(true)?;
                    return Err(e);
                }
                Err(Attempt::Changed(why)) => {
                    // Forget what may be what changed: the speculative thread and cached
                    // heap environments.
                    self.last_ec = None;
                    self.forget_envs();
                    self.validated_at = None;
                    last = why;
                }
            }
        }
        // A process that vanished between attempts reports as exited, not as a moving stack;
        // one that ran exec, or whose pid was taken by another, as replaced.
        if !std::path::Path::new(&format!("/proc/{}", self.pid)).exists() {
            return Err(Error::ProcessExited { pid: self.pid });
        }
        self.check_identity(true)?;
        Err(Error::StackChanged {
            pid: self.pid,
            attempts: SNAPSHOT_ATTEMPTS,
            last,
        })
    }

    /// The tags of the thread the last [`Spy::snapshot`] read (see spy_tags.rs).
    pub fn snapshot_tags(&mut self) -> Tags {
        match self.last_ec {
            Some((thread, _)) => self.thread_tags(thread),
            None => Tags::default(),
        }
    }

    /// Maps a read failure during a walk: the process being gone or unreadable is fatal,
    /// an unmapped address means the stack moved under us.
    fn moved(&self, what: &str) -> impl Fn(MemoryError) -> Attempt + '_ {
        let what = what.to_string();
        move |e| match e {
            MemoryError::Gone => Attempt::Fatal(Error::ProcessExited { pid: self.pid }),
            MemoryError::Denied => Attempt::Fatal(Error::PermissionDenied { pid: self.pid }),
            other => Attempt::Changed(format!("{what}: {other}")),
        }
    }

    fn object_moved(&self, what: &str, e: ObjectError) -> Attempt {
        match e {
            ObjectError::Memory(m) => self.moved(what)(m),
            ObjectError::Shape(kind, addr) => {
                Attempt::Changed(format!("{what}: {kind} at {addr:#x} does not validate"))
            }
        }
    }

    /// Reads the current thread's execution context: one call that reads the GVL owner
    /// together with the last thread's `ec` field and that ec's stack fields.
    fn current_ec(&mut self) -> std::result::Result<[u64; 3], Attempt> {
        let l = self.layout;
        let mut owner = [0u8; 8];
        let mut ec_field = [0u8; 8];
        let mut ec_head = [0u8; 24];
        if let Some((thread, ec)) = self.last_ec {
            self.mem
                .read_many(&mut [
                    (self.gvl_owner, &mut owner[..]),
                    (thread.wrapping_add(l.thread_ec as u64), &mut ec_field[..]),
                    (ec.wrapping_add(l.ec_vm_stack as u64), &mut ec_head[..]),
                ])
                .map_err(self.moved("reading the GVL owner"))?;
            let owner = word(&owner, 0);
            let current = if owner == 0 { self.main_thread } else { owner };
            if current == thread && word(&ec_field, 0) == ec {
                return Ok(self.ec_fields(&ec_head));
            }
            return self.read_ec_of(current);
        }
        self.mem
            .read(self.gvl_owner, &mut owner)
            .map_err(self.moved("reading the GVL owner"))?;
        let owner = word(&owner, 0);
        self.read_ec_of(if owner == 0 { self.main_thread } else { owner })
    }

    fn ec_fields(&self, head: &[u8]) -> [u64; 3] {
        let l = self.layout;
        let base = l.ec_vm_stack;
        [
            word(head, l.ec_vm_stack - base),
            word(head, l.ec_vm_stack_size - base),
            word(head, l.ec_cfp - base),
        ]
    }

    fn read_ec_of(&mut self, thread: u64) -> std::result::Result<[u64; 3], Attempt> {
        let l = self.layout;
        let ec = self
            .mem
            .read_u64(thread.wrapping_add(l.thread_ec as u64))
            .map_err(self.moved("reading the thread's execution context"))?;
        let mut head = [0u8; 24];
        self.mem
            .read(ec.wrapping_add(l.ec_vm_stack as u64), &mut head)
            .map_err(self.moved("reading the execution context"))?;
        self.last_ec = Some((thread, ec));
        Ok(self.ec_fields(&head))
    }

    fn try_snapshot(&mut self) -> std::result::Result<Stack, Attempt> {
        let ec = self.current_ec()?;
        self.walk(ec)
    }

    /// Drops the cached heap environments (one may have been freed and its address reused),
    /// and with them every memoized stack that relied on them.
    fn forget_envs(&mut self) {
        self.heap_envs.clear();
        self.epoch += 1;
    }

    /// The frames of one execution context, given its `vm_stack`, `vm_stack_size`, `cfp`.
    fn walk(&mut self, ec: [u64; 3]) -> std::result::Result<Stack, Attempt> {
        self.walk_many(&[ec], Vec::new())
            .pop()
            .expect("one result per context")
    }

    /// Where one execution context's control frames are.
    fn plan(&self, [vm_stack, vm_stack_size, cfp]: [u64; 3]) -> std::result::Result<Plan, Attempt> {
        let cfp_size = self.layout.cfp_size as u64;
        // Control frames grow down from the end of the VM stack; the last slot is a dummy
        // frame that Ruby's own backtrace skips.
        let end = vm_stack.wrapping_add(vm_stack_size.wrapping_mul(8));
        let last = end.wrapping_sub(cfp_size);
        if vm_stack == 0
            || vm_stack_size > MAX_FRAMES * 1024
            || cfp < vm_stack
            || cfp > last
            || (last - cfp) % cfp_size != 0
        {
            return Err(Attempt::Changed(format!(
                "control frame pointer {cfp:#x} outside its stack"
            )));
        }
        let count = (last - cfp) / cfp_size;
        if count > MAX_FRAMES {
            return Err(Attempt::Changed(format!("{count} frames")));
        }
        let hint = self.stack_hints.get(&vm_stack).copied().unwrap_or(0);
        Ok(Plan {
            vm_stack,
            cfp,
            count,
            guess: (hint as u64).min(cfp - vm_stack) as usize,
        })
    }

    /// The frames of several execution contexts (the threads of one sample). One call reads
    /// every context's control frames and, with them, the used part of its value stack,
    /// where every running frame's environment (`ep[-2..=0]`) lives; the extent is guessed
    /// from the previous sample of that stack (a deeper stack costs one more read). A
    /// context whose frames were already read along with its thread (`prefetched`, see
    /// spy_threads.rs) costs no call at all.
    fn walk_many(
        &mut self,
        ecs: &[[u64; 3]],
        prefetched: Vec<Option<Prefetched>>,
    ) -> Vec<std::result::Result<Stack, Attempt>> {
        let l = self.layout;
        let plans: Vec<_> = ecs.iter().map(|ec| self.plan(*ec)).collect();
        let mut prefetched = prefetched;
        prefetched.resize_with(plans.len(), || None);
        let mut bufs: Vec<(Vec<u8>, Vec<u8>)> = Vec::with_capacity(plans.len());
        let mut done: Vec<bool> = Vec::with_capacity(plans.len());
        for (p, pre) in plans.iter().zip(prefetched) {
            let Ok(p) = p else {
                bufs.push((Vec::new(), Vec::new()));
                done.push(true);
                if let Some(pre) = pre {
                    self.recycle(pre.frames);
                    self.recycle(pre.values);
                }
                continue;
            };
            let want = p.count as usize * l.cfp_size;
            match pre {
                Some(mut pre)
                    if pre.vm_stack == p.vm_stack
                        && p.cfp >= pre.from
                        && (p.cfp - pre.from) as usize + want <= pre.frames.len() =>
                {
                    pre.frames.drain(..(p.cfp - pre.from) as usize);
                    pre.frames.truncate(want);
                    bufs.push((pre.frames, pre.values));
                    done.push(true);
                }
                other => {
                    if let Some(pre) = other {
                        self.recycle(pre.frames);
                        self.recycle(pre.values);
                    }
                    bufs.push((self.buffer(want), self.buffer(p.guess)));
                    done.push(false);
                }
            }
        }
        let read_all = {
            let mut requests: Vec<(u64, &mut [u8])> = Vec::new();
            for ((plan, (cfps, values)), done) in plans.iter().zip(bufs.iter_mut()).zip(&done) {
                if let (Ok(p), false) = (plan, done) {
                    requests.push((p.cfp, &mut cfps[..]));
                    if !values.is_empty() {
                        requests.push((p.vm_stack, &mut values[..]));
                    }
                }
            }
            if requests.is_empty() {
                Ok(())
            } else {
                self.mem.read_many(&mut requests)
            }
        };
        let mut read_each: Vec<std::result::Result<(), Attempt>> =
            plans.iter().map(|_| Ok(())).collect();
        if let Err(e) = read_all {
            // One stack moved or vanished: read the others one by one so they still count.
            if plans.len() == 1 {
                read_each[0] = Err(self.moved("reading control frames")(e));
            } else {
                for (((plan, (cfps, values)), result), done) in plans
                    .iter()
                    .zip(bufs.iter_mut())
                    .zip(read_each.iter_mut())
                    .zip(&done)
                {
                    if let (Ok(p), false) = (plan, done) {
                        let mut requests: Vec<(u64, &mut [u8])> = vec![(p.cfp, &mut cfps[..])];
                        if !values.is_empty() {
                            requests.push((p.vm_stack, &mut values[..]));
                        }
                        if let Err(e) = self.mem.read_many(&mut requests) {
                            *result = Err(self.moved("reading control frames")(e));
                        }
                    }
                }
            }
        }
        plans
            .into_iter()
            .zip(bufs)
            .zip(read_each)
            .map(|((plan, (cfps, values)), read)| {
                let result = match (read, plan) {
                    (Ok(()), Ok(plan)) => self.resolve(plan, &cfps, values),
                    (Err(e), _) | (_, Err(e)) => {
                        self.recycle(values);
                        Err(e)
                    }
                };
                self.recycle(cfps);
                result
            })
            .collect()
    }

    /// A zeroed buffer of `len` bytes, reusing one from an earlier sample when there is one
    /// (a sample then allocates nothing for its reads).
    fn buffer(&mut self, len: usize) -> Vec<u8> {
        let mut b = self.spare.pop().unwrap_or_default();
        b.clear();
        b.resize(len, 0);
        b
    }

    fn recycle(&mut self, b: Vec<u8>) {
        if self.spare.len() < 16 && b.capacity() <= 1 << 20 {
            self.spare.push(b);
        }
    }

    /// Turns one context's control frames and value stack into frames: from the memo when
    /// this raw stack was resolved before in the current epoch, otherwise by resolving it.
    fn resolve(
        &mut self,
        plan: Plan,
        cfps: &[u8],
        values: Vec<u8>,
    ) -> std::result::Result<Stack, Attempt> {
        let (frames, envs) = match self.raw_frames(plan, cfps, values) {
            Ok(x) => x,
            Err((e, values)) => {
                self.recycle(values);
                return Err(e);
            }
        };
        let result = self.resolve_raw(&frames, &envs);
        self.recycle(envs.values);
        result
    }

    fn resolve_raw(
        &mut self,
        frames: &[RawFrame],
        envs: &Envs,
    ) -> std::result::Result<Stack, Attempt> {
        let due = self.validated_at.is_none_or(|t| t.elapsed() >= REVALIDATE);
        self.sign(frames, envs);
        if !due {
            if let Some(m) = self.memo.get(&self.signature[..]) {
                if m.epoch == self.epoch {
                    return Ok(m.stack.clone());
                }
            }
        }
        let resolved: Arc<[Frame]> = self.resolve_frames(frames, envs)?.into();
        // `resolve_frames` may have started a new epoch (a full validation).
        let epoch = self.epoch;
        if self.memo.len() >= MAX_MEMO || self.memo_bytes >= MAX_MEMO_BYTES {
            self.memo.clear();
            self.memo_bytes = 0;
        }
        // Keep the token while the frames stay the same, so a stack keeps one name.
        let token = match self.memo.get(&self.signature[..]) {
            Some(m) if m.stack.frames == resolved => m.stack.token,
            _ => {
                self.tokens += 1;
                self.tokens
            }
        };
        let stack = Stack {
            frames: resolved,
            token,
        };
        self.memo_bytes += self.signature.len() * 8
            + stack.frames.len() * std::mem::size_of::<Frame>()
            + std::mem::size_of::<Memo>();
        self.memo.insert(
            self.signature.as_slice().into(),
            Memo {
                stack: stack.clone(),
                epoch,
            },
        );
        Ok(stack)
    }

    /// What the frames of a raw stack depend on besides the walker's caches: each frame's
    /// iseq, pc and environment address, and the environment's slots when it lives on the
    /// value stack (method entry or cref, block handler or parent, flags).
    fn sign(&mut self, frames: &[RawFrame], envs: &Envs) {
        let sig = &mut self.signature;
        sig.clear();
        for f in frames {
            sig.extend_from_slice(&[f.iseq, f.pc, f.ep]);
            if let Some(s) = envs.on_stack(f.ep) {
                sig.extend_from_slice(&[s.me_cref, s.specval, s.flags]);
            }
        }
    }

    /// The raw control frames of one context, and the value stack under them (read further
    /// when the frames' environments reach past what was read along with them).
    fn raw_frames(
        &mut self,
        plan: Plan,
        cfps: &[u8],
        mut values: Vec<u8>,
    ) -> std::result::Result<(Vec<RawFrame>, Envs), (Attempt, Vec<u8>)> {
        let l = self.layout;
        let Plan { vm_stack, cfp, .. } = plan;
        let frames: Vec<RawFrame> = cfps
            .chunks_exact(l.cfp_size)
            .map(|c| RawFrame {
                pc: word(c, l.cfp_pc),
                iseq: word(c, l.cfp_iseq),
                ep: word(c, l.cfp_ep),
            })
            .collect();
        // Checked: a garbage ep near the top of the address space must not wrap around
        // into a plausible (or enormous) length.
        let needed = frames
            .iter()
            .map(|f| f.ep)
            .filter(|ep| {
                *ep >= vm_stack.saturating_add(16) && ep.checked_add(8).is_some_and(|e| e <= cfp)
            })
            .map(|ep| (ep + 8 - vm_stack) as usize)
            .max()
            .unwrap_or(0);
        if needed > MAX_VALUE_STACK {
            return Err((
                Attempt::Changed(format!("a value stack of {needed} bytes")),
                values,
            ));
        }
        if needed > values.len() {
            let have = values.len();
            values.resize(needed, 0);
            if let Err(e) = self
                .mem
                .read(vm_stack.wrapping_add(have as u64), &mut values[have..])
            {
                return Err((self.moved("reading the value stack")(e), values));
            }
        }
        // Slack so that a slightly deeper stack next time still fits in one read.
        if self.stack_hints.len() >= MAX_CACHED_ENVS {
            self.stack_hints.clear();
        }
        self.stack_hints
            .insert(vm_stack, needed + needed / 4 + 1024);
        let envs = Envs {
            base: vm_stack,
            values,
        };
        Ok((frames, envs))
    }

    /// Resolves raw frames into frames (labels, paths, lines), through the caches.
    fn resolve_frames(
        &mut self,
        frames: &[RawFrame],
        envs: &Envs,
    ) -> std::result::Result<Vec<Frame>, Attempt> {
        let l = self.layout;
        // Which frames are reported, and the candidates for the method entry each needs (for
        // C functions: its name; for Ruby methods and their blocks: the owner's name).
        let mut wanted: Vec<Wanted> = Vec::new();
        for (i, f) in frames.iter().enumerate() {
            if f.iseq != 0 {
                if f.pc == 0 {
                    continue; // IFUNC and dummy frames: Ruby skips them too.
                }
                // An iseq not seen before may belong to a method: collect its chain too.
                let needs_owner = self.iseqs.get(&f.iseq).is_none_or(|x| x.in_method);
                let chain = if needs_owner {
                    self.method_entry_chain(f.ep, envs)?
                } else {
                    Vec::new()
                };
                wanted.push(Wanted {
                    index: i,
                    cfunc: false,
                    chain,
                });
            } else {
                let s = self.env_slots(f.ep, envs)?;
                if s.flags & l.frame_magic_mask != l.frame_magic_cfunc {
                    continue;
                }
                let chain = self.method_entry_chain(f.ep, envs)?;
                wanted.push(Wanted {
                    index: i,
                    cfunc: true,
                    chain,
                });
            }
        }
        let mes = self.read_iseqs_and_method_entries(frames, &wanted)?;
        self.build_frames(frames, wanted, &mes)
    }

    /// `ep[-2..=0]` of an environment: from the value stack copy, or from an environment
    /// that escaped to the heap (a method whose block became a Proc, a block called after
    /// its method returned). Escaped environments do not change, so they are cached; a
    /// failed attempt clears the cache in case one was freed and its address reused.
    fn env_slots(&mut self, ep: u64, envs: &Envs) -> std::result::Result<Slots, Attempt> {
        if let Some(s) = envs.on_stack(ep) {
            return Ok(s);
        }
        if let Some(s) = self.heap_envs.get(&ep) {
            return Ok(*s);
        }
        let mut buf = [0u8; 24];
        self.mem
            .read(ep.wrapping_sub(16), &mut buf)
            .map_err(self.moved("reading an environment"))?;
        let s = slots(&buf);
        if self.heap_envs.len() >= MAX_CACHED_ENVS {
            self.forget_envs();
        }
        self.heap_envs.insert(ep, s);
        Ok(s)
    }

    /// Iseqs and method entries the frames need. What is cached is trusted between full
    /// validations (every [`REVALIDATE`]): an iseq while the frame's pc lies inside its
    /// instructions, a method entry while it defines the frame's method (checked in
    /// `build_frames`). A full validation, and anything not cached, costs one batched read:
    /// the header of every iseq and of its cached body (same body, instructions, size) and
    /// the header of every candidate method entry. New ones are loaded on the cold path.
    fn read_iseqs_and_method_entries(
        &mut self,
        frames: &[RawFrame],
        wanted: &[Wanted],
    ) -> std::result::Result<FxHashMap<u64, MethodInfo>, Attempt> {
        let l = self.layout;
        let full = self.validated_at.is_none_or(|t| t.elapsed() >= REVALIDATE);
        let mut iseq_addrs: Vec<u64> = frames
            .iter()
            .filter(|f| f.iseq != 0 && f.pc != 0)
            .filter(|f| {
                full || self
                    .iseqs
                    .get(&f.iseq)
                    .is_none_or(|i| f.pc < i.encoded || f.pc > i.encoded + u64::from(i.size) * 8)
            })
            .map(|f| f.iseq)
            .collect();
        iseq_addrs.sort_unstable();
        iseq_addrs.dedup();
        let candidates: Vec<u64> = wanted
            .iter()
            .flat_map(|w| w.chain.iter().copied())
            .collect();
        let mut me_addrs: Vec<u64> = candidates
            .iter()
            .copied()
            .filter(|a| full || !(self.methods.contains_key(a) || self.not_methods.contains(a)))
            .collect();
        me_addrs.sort_unstable();
        me_addrs.dedup();
        if full {
            self.not_methods.clear();
        }
        let head_len = l.me_owner.max(l.me_def).max(l.svar_cref_or_me) + 8;
        let mut iseq_bufs = vec![[0u8; 24]; iseq_addrs.len()];
        let mut body_bufs = vec![[0u8; 16]; iseq_addrs.len()];
        let mut me_bufs = vec![vec![0u8; head_len]; me_addrs.len()];
        if !iseq_addrs.is_empty() || !me_addrs.is_empty() {
            let mut requests: Vec<(u64, &mut [u8])> = Vec::new();
            for ((addr, ibuf), bbuf) in iseq_addrs
                .iter()
                .zip(iseq_bufs.iter_mut())
                .zip(body_bufs.iter_mut())
            {
                requests.push((*addr, &mut ibuf[..]));
                if let Some(info) = self.iseqs.get(addr) {
                    requests.push((info.body, &mut bbuf[..]));
                }
            }
            for (addr, buf) in me_addrs.iter().zip(me_bufs.iter_mut()) {
                requests.push((*addr, &mut buf[..]));
            }
            self.mem
                .read_many(&mut requests)
                .map_err(self.moved("reading iseqs and method entries"))?;
        }
        for ((addr, ibuf), bbuf) in iseq_addrs.iter().zip(&iseq_bufs).zip(&body_bufs) {
            if imemo_type(l, word(ibuf, l.rbasic_flags)) != Some(l.imemo_iseq) {
                return Err(Attempt::Changed(format!(
                    "iseq at {addr:#x} is not an iseq"
                )));
            }
            let body = word(ibuf, l.iseq_body);
            let valid = self.iseqs.get(addr).is_some_and(|info| {
                info.body == body
                    && word32(bbuf, l.body_iseq_size) == info.size
                    && word(bbuf, l.body_iseq_encoded) == info.encoded
            });
            if !valid {
                self.iseqs.remove(addr);
                let info = self.load_iseq(body)?;
                self.iseqs.insert(*addr, info);
            }
        }
        let mut mes = self.method_entries(&me_addrs, &me_bufs)?;
        for addr in &me_addrs {
            if !mes.contains_key(addr) {
                self.not_methods.insert(*addr);
            }
        }
        for addr in candidates {
            if let Some(info) = self.methods.get(&addr) {
                mes.entry(addr).or_insert_with(|| info.clone());
            }
        }
        if full {
            self.validated_at = Some(std::time::Instant::now());
            self.epoch += 1;
        }
        Ok(mes)
    }

    /// Reads and decodes everything an iseq's frames need (cold path, once per iseq).
    fn load_iseq(&mut self, body: u64) -> std::result::Result<IseqInfo, Attempt> {
        let l = self.layout;
        let b = self
            .mem
            .read_vec(body, l.body_read_size)
            .map_err(self.moved("reading an iseq body"))?;
        let strings = |spy: &Self, v: u64| {
            read_string(&spy.mem, l, v).map_err(|e| spy.object_moved("reading an iseq label", e))
        };
        let kind = word32(&b, l.body_type);
        let mut label = strings(self, word(&b, l.body_location_label))?;
        if l.api_version >= 304 {
            // 3.4 labels rescue, ensure and eval code like the code it belongs to
            // (calculate_iseq_label): the label of the nearest other ancestor.
            let mut body = b.clone();
            for _ in 0..64 {
                let kind = word32(&body, l.body_type);
                if ![l.iseq_type_rescue, l.iseq_type_ensure, l.iseq_type_eval].contains(&kind) {
                    break;
                }
                let parent = word(&body, l.body_parent_iseq);
                if parent == 0 {
                    break;
                }
                let parent_body = self
                    .mem
                    .read_u64(parent.wrapping_add(l.iseq_body as u64))
                    .map_err(self.moved("reading a parent iseq"))?;
                body = self
                    .mem
                    .read_vec(parent_body, l.body_read_size)
                    .map_err(self.moved("reading a parent iseq"))?;
                label = strings(self, word(&body, l.body_location_label))?;
            }
        }
        let label: Arc<str> = label.into();
        let base_label: Arc<str> = strings(self, word(&b, l.body_location_base_label))?.into();
        let (path, absolute_path) = self.read_pathobj(word(&b, l.body_location_pathobj))?;
        let size = word32(&b, l.body_iseq_size);
        let lines = LineTable::read(
            &self.mem,
            l,
            word(&b, l.body_insns_info_body),
            word32(&b, l.body_insns_info_size) as u64,
            word(&b, l.body_insns_info_succ_index_table),
            size as u64,
        )
        .map_err(|e| self.object_moved("reading a line table", e))?;
        let local = word(&b, l.body_local_iseq);
        let in_method = if local == 0 {
            false
        } else {
            let local_body = self
                .mem
                .read_u64(local.wrapping_add(l.iseq_body as u64))
                .map_err(self.moved("reading a local iseq"))?;
            let mut t = [0u8; 4];
            self.mem
                .read(local_body.wrapping_add(l.body_type as u64), &mut t)
                .map_err(self.moved("reading a local iseq"))?;
            u32::from_le_bytes(t) == l.iseq_type_method
        };
        Ok(IseqInfo {
            body,
            encoded: word(&b, l.body_iseq_encoded),
            size,
            path,
            absolute_path,
            label,
            base_label,
            in_method,
            local_iseq: local,
            is_method: kind == l.iseq_type_method,
            kind,
            lines,
            qualified: FxHashMap::default(),
        })
    }

    /// An iseq's `pathobj` is either the path String or a frozen [path, realpath] Array.
    fn read_pathobj(
        &self,
        pathobj: u64,
    ) -> std::result::Result<(Arc<str>, Option<Arc<str>>), Attempt> {
        let l = self.layout;
        let fail = |e| self.object_moved("reading an iseq path", e);
        let flags = self
            .mem
            .read_u64(pathobj)
            .map_err(self.moved("reading an iseq path"))?;
        match flags & T_MASK {
            T_STRING => {
                let p: Arc<str> = read_string(&self.mem, l, pathobj).map_err(fail)?.into();
                Ok((p.clone(), Some(p)))
            }
            T_ARRAY => {
                let path = read_array_entry(&self.mem, l, pathobj, 0).map_err(fail)?;
                let real = read_array_entry(&self.mem, l, pathobj, 1).map_err(fail)?;
                let path: Arc<str> = read_string(&self.mem, l, path).map_err(fail)?.into();
                let real = if is_heap_object(real) {
                    Some(read_string(&self.mem, l, real).map_err(fail)?.into())
                } else {
                    None
                };
                Ok((path, real))
            }
            _ => Err(Attempt::Changed(format!(
                "pathobj at {pathobj:#x} is neither String nor Array"
            ))),
        }
    }

    /// The candidates for a frame's method entry, in Ruby's order
    /// (`rb_vm_frame_method_entry`): `ep[-2]` of each environment from the frame's own to the
    /// local one. The first that turns out to be an `imemo_ment` (crefs are skipped) is it;
    /// their headers are read in one batch afterwards.
    fn method_entry_chain(
        &mut self,
        ep: u64,
        envs: &Envs,
    ) -> std::result::Result<Vec<u64>, Attempt> {
        let l = self.layout;
        let mut ep = ep;
        let mut chain = Vec::new();
        for _ in 0..MAX_EP_DEPTH {
            let s = self.env_slots(ep, envs)?;
            if is_heap_object(s.me_cref) {
                chain.push(s.me_cref);
            }
            if s.flags & l.env_flag_local != 0 {
                return Ok(chain);
            }
            ep = s.specval & !0x3;
        }
        Err(Attempt::Changed("environment chain too long".into()))
    }

    fn build_frames(
        &mut self,
        frames: &[RawFrame],
        wanted: Vec<Wanted>,
        mes: &FxHashMap<u64, MethodInfo>,
    ) -> std::result::Result<Vec<Frame>, Attempt> {
        let l = self.layout;
        let mut out: Vec<Frame> = Vec::with_capacity(wanted.len());
        let mut pending_cfuncs: Vec<usize> = Vec::new();
        // Ruby 3.4 shows a rescue/ensure frame in place of the frame it belongs to, which it
        // then leaves out (vm_backtrace.c, skip_next_frame).
        let merges_clauses = l.api_version >= 304;
        let mut skip_next = false;
        for Wanted {
            index,
            cfunc: is_cfunc,
            chain,
        } in wanted
        {
            let f = &frames[index];
            let me = chain.into_iter().find(|m| mes.contains_key(m));
            if is_cfunc {
                let info = me
                    .and_then(|m| mes.get(&m))
                    .filter(|m| m.def_type == l.method_type_cfunc)
                    .ok_or_else(|| Attempt::Changed("C frame without a C method entry".into()))?;
                let (label, base_label) = self.cfunc_label(me.expect("checked"), info)?;
                pending_cfuncs.push(out.len());
                out.push(Frame {
                    base_label,
                    label,
                    path: Arc::from(""),
                    absolute_path: None,
                    lineno: 0,
                    c_function: true,
                });
                continue;
            }
            let info = &self.iseqs[&f.iseq];
            let is_clause = info.kind == l.iseq_type_rescue || info.kind == l.iseq_type_ensure;
            if merges_clauses && std::mem::replace(&mut skip_next, is_clause) {
                continue;
            }
            // The entry must define the method this frame runs; otherwise the environment we
            // read belonged to a frame pushed or popped meanwhile.
            let owner = me
                .and_then(|m| mes.get(&m))
                .filter(|m| !info.in_method || m.iseqs.contains(&info.local_iseq))
                .map(|m| m.owner);
            if owner.is_none() && info.is_method {
                // Every method frame has a method entry: not finding one means the frame
                // was being pushed or popped while we read it.
                return Err(Attempt::Changed(
                    "method frame without a method entry".into(),
                ));
            }
            let frame = self.iseq_frame(f, owner)?;
            // A C function reports the location of the Ruby frame that called it.
            for idx in pending_cfuncs.drain(..) {
                out[idx].path = frame.path.clone();
                out[idx].absolute_path = frame.absolute_path.clone();
                out[idx].lineno = frame.lineno;
            }
            out.push(frame);
        }
        Ok(out)
    }

    /// Third batched read: headers of every method entry the frames point at. Cached entries
    /// are kept only while their `def` and `owner` still match.
    fn method_entries(
        &mut self,
        addrs: &[u64],
        bufs: &[Vec<u8>],
    ) -> std::result::Result<FxHashMap<u64, MethodInfo>, Attempt> {
        let l = self.layout;
        let mut out = FxHashMap::default();
        for (addr, buf) in addrs.iter().zip(bufs) {
            let mut head = buf.clone();
            let mut imemo = imemo_type(l, word(&head, l.rbasic_flags));
            if imemo == Some(l.imemo_svar) {
                // Rare (methods using $~): one more read to reach the entry inside.
                let inner = word(&head, l.svar_cref_or_me);
                if !is_heap_object(inner) {
                    continue;
                }
                self.mem
                    .read(inner, &mut head)
                    .map_err(self.moved("reading a method entry"))?;
                imemo = imemo_type(l, word(&head, l.rbasic_flags));
            }
            if imemo != Some(l.imemo_ment) {
                continue; // a cref: the frame has no method entry of its own
            }
            let def = word(&head, l.me_def);
            let owner = word(&head, l.me_owner);
            let cached = self
                .methods
                .get(addr)
                .filter(|m| m.def == def && m.owner == owner)
                .cloned();
            let info = match cached {
                Some(info) => info,
                None => self.load_method(def, owner)?,
            };
            self.methods.insert(*addr, info.clone());
            out.insert(*addr, info);
        }
        Ok(out)
    }

    /// Reads a method definition (cold path, once per method entry).
    fn load_method(&self, def: u64, owner: u64) -> std::result::Result<MethodInfo, Attempt> {
        let l = self.layout;
        let d = self
            .mem
            .read_vec(def, l.me_def_original_id.max(l.me_def_iseqptr) + 8)
            .map_err(self.moved("reading a method definition"))?;
        let def_type = (word(&d, 0) & l.me_def_type_mask) >> l.me_def_type_shift;
        let mut iseqs = [0, 0];
        if def_type == l.method_type_iseq {
            iseqs[0] = word(&d, l.me_def_iseqptr);
            if let Some(mandatory_only) = l.body_mandatory_only_iseq {
                let body = self
                    .mem
                    .read_u64(iseqs[0].wrapping_add(l.iseq_body as u64))
                    .map_err(self.moved("reading a method's iseq"))?;
                iseqs[1] = self
                    .mem
                    .read_u64(body.wrapping_add(mandatory_only as u64))
                    .map_err(self.moved("reading a method's iseq"))?;
            }
        }
        Ok(MethodInfo {
            def,
            owner,
            def_type,
            original_id: word(&d, l.me_def_original_id),
            iseqs,
            cfunc_label: None,
            name: None,
        })
    }

    fn symbols(&mut self) -> std::result::Result<&mut SymbolTable, Attempt> {
        if self.symbols.is_none() {
            let addr = self
                .find_symbol_table()
                .ok_or(Attempt::Fatal(Error::Corrupt {
                    pid: self.pid,
                    what: "symbol table (not found in libruby's data)",
                    addr: 0,
                }))?;
            self.symbols = Some(SymbolTable::new(addr));
        }
        Ok(self.symbols.as_mut().expect("just set"))
    }

    /// Finds `ruby_global_symbols` in a libruby that does not export it: scans the writable
    /// segments for a struct that validates through its `ids` array. Words that merely look
    /// like one are common (thousands in some runs, as ASLR places things), so every
    /// candidate's `ids` header is read in one batch per segment, not one call each.
    fn find_symbol_table(&self) -> Option<u64> {
        let l = self.layout;
        for &(start, end) in &self.writable {
            let len = (end - start).min(16 << 20) as usize;
            let Ok(data) = self.mem.read_vec(start, len) else {
                continue;
            };
            let candidates: Vec<(usize, u64, u64)> = (0..data.len().saturating_sub(l.symbols_size)
                + 1)
                .step_by(8)
                .filter_map(|off| {
                    let bytes = data.get(off..off + l.symbols_size)?;
                    SymbolTable::candidate(l, bytes).map(|(last_id, ids)| (off, last_id, ids))
                })
                .collect();
            let head_len = crate::objects::array_head_len(l);
            let mut heads = vec![0u8; candidates.len() * head_len];
            let mut requests: Vec<(u64, &mut [u8])> = candidates
                .iter()
                .zip(heads.chunks_exact_mut(head_len))
                .map(|((_, _, ids), head)| (*ids, head))
                .collect();
            let read = self.mem.read_each(&mut requests);
            let found = candidates
                .iter()
                .zip(&requests)
                .zip(read)
                .find(|((c, (_, head)), ok)| *ok && SymbolTable::confirms(l, c.1, head));
            if let Some((((off, _, _), _), _)) = found {
                return Some(start.wrapping_add(*off as u64));
            }
        }
        None
    }

    /// (qualified label, bare name) of a C function's method entry.
    fn cfunc_label(
        &mut self,
        me: u64,
        info: &MethodInfo,
    ) -> std::result::Result<(Arc<str>, Arc<str>), Attempt> {
        if let (Some(label), Some(name)) = (&info.cfunc_label, &info.name) {
            return Ok((label.clone(), name.clone()));
        }
        let l = self.layout;
        let id = info.original_id;
        self.symbols()?;
        let symbols = self.symbols.as_mut().expect("found by symbols()");
        let name = symbols
            .name(&self.mem, l, id)
            .map_err(|_| Attempt::Changed(format!("method name ID {id:#x} does not resolve")))?;
        let label: Arc<str> = self
            .classes
            .qualify(&self.mem, l, symbols, info.owner, &name)
            .into();
        if let Some(m) = self.methods.get_mut(&me) {
            m.cfunc_label = Some(label.clone());
            m.name = Some(name.clone());
        }
        Ok((label, name))
    }

    fn iseq_frame(
        &mut self,
        f: &RawFrame,
        owner: Option<u64>,
    ) -> std::result::Result<Frame, Attempt> {
        let l = self.layout;
        let info = self
            .iseqs
            .get(&f.iseq)
            .expect("loaded in read_iseqs_and_method_entries");
        let n = (f.pc.wrapping_sub(info.encoded) / 8) as usize;
        if f.pc < info.encoded || n > info.size as usize {
            return Err(Attempt::Changed("pc outside its iseq".into()));
        }
        // The pc points at the next instruction (Ruby's calc_pos uses pos - 1).
        let pos = n.saturating_sub(1);
        let lineno = info
            .lines
            .line_at(pos)
            .ok_or_else(|| Attempt::Changed("pc outside the line table".into()))?;
        let label = match owner {
            Some(owner) if info.in_method => {
                if let Some(q) = info.qualified.get(&owner) {
                    q.clone()
                } else {
                    let (label, base) = (info.label.clone(), info.base_label.clone());
                    self.symbols()?;
                    let symbols = self.symbols.as_mut().expect("found by symbols()");
                    let qualified = self.classes.qualify(&self.mem, l, symbols, owner, &base);
                    // "block (2 levels) in foo" → "block (2 levels) in Foo#foo".
                    let q: Arc<str> = match label.strip_suffix(&*base) {
                        Some(prefix) => format!("{prefix}{qualified}").into(),
                        None => label.clone(),
                    };
                    let info = self.iseqs.get_mut(&f.iseq).expect("present");
                    info.qualified.insert(owner, q.clone());
                    q
                }
            }
            _ => info.label.clone(),
        };
        let info = &self.iseqs[&f.iseq];
        Ok(Frame {
            label,
            base_label: info.base_label.clone(),
            path: info.path.clone(),
            absolute_path: info.absolute_path.clone(),
            lineno,
            c_function: false,
        })
    }
}

/// The imemo type of an object whose flags are given, if it is a T_IMEMO.
fn imemo_type(l: &Layout, flags: u64) -> Option<u64> {
    (flags & T_MASK == T_IMEMO).then_some((flags >> l.fl_ushift) & 0xf)
}

#[derive(Debug, Clone, Copy)]
struct RawFrame {
    pc: u64,
    iseq: u64,
    ep: u64,
}

/// `ep[-2]`, `ep[-1]`, `ep[0]` of one environment.
#[derive(Debug, Clone, Copy)]
struct Slots {
    me_cref: u64,
    specval: u64,
    flags: u64,
}

fn slots(buf: &[u8; 24]) -> Slots {
    Slots {
        me_cref: word(buf, 0),
        specval: word(buf, 8),
        flags: word(buf, 16),
    }
}

/// The environments of one sample: a copy of the value stack `[base, base + len)`.
#[derive(Debug, Default)]
struct Envs {
    base: u64,
    values: Vec<u8>,
}

impl Envs {
    fn on_stack(&self, ep: u64) -> Option<Slots> {
        let start = ep.checked_sub(16)?.checked_sub(self.base)? as usize;
        let bytes: &[u8; 24] = self.values.get(start..start + 24)?.try_into().ok()?;
        Some(slots(bytes))
    }
}

/// Where one execution context's frames are (see `Spy::plan`).
#[derive(Debug, Clone, Copy)]
struct Plan {
    vm_stack: u64,
    cfp: u64,
    count: u64,
    /// Bytes of value stack to read along with the frames.
    guess: usize,
}

/// A thread's control frames and value stack, read along with the thread on the guess that
/// its stack is where it was last time (see spy_threads.rs).
#[derive(Debug)]
struct Prefetched {
    vm_stack: u64,
    /// Address of `frames[0]`: somewhat below the last sample's `cfp`, so a stack a few
    /// frames deeper still fits.
    from: u64,
    frames: Vec<u8>,
    values: Vec<u8>,
}

/// A frame to report and the candidates for its method entry.
struct Wanted {
    index: usize,
    cfunc: bool,
    chain: Vec<u64>,
}
