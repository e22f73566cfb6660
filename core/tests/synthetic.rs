//! The walker against hand-built memory images, one per generated layout, including layouts
//! of Rubies that have no live process here. Each image is a small but complete Ruby VM as
//! the layout describes it: VM, thread, execution context, VM stack with environments and
//! control frames, iseqs with labels and line tables, method entries, classes and the
//! symbol table. The walk must name every frame as Ruby would.
use rbspy_ext_bindings::{Layout, LAYOUTS};
use rbspy_ext_core::context::profiler_state;
use rbspy_ext_core::memory::{Memory, MemoryImage};
use rbspy_ext_core::spy::ThreadSelection;
use rbspy_ext_core::vm::VmRoots;
use rbspy_ext_core::Spy;
use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// The system allocator, remembering the largest single allocation: the fuzz test below
/// checks that no garbage size read from memory ever turns into a huge allocation.
struct Watching;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged.
unsafe impl GlobalAlloc for Watching {
    unsafe fn alloc(&self, layout: AllocLayout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: AllocLayout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: AllocLayout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Watching = Watching;

const HEAP: u64 = 0x10_0000;
const HEAP_SIZE: usize = 4 << 20;
const VM_STACK_WORDS: u64 = 2048;
/// `T_DATA` of enum ruby_value_type (the same in every Ruby; the layouts do not list it, as
/// the walker never checks it): the type of 4.1's symbol-table chunks.
const T_DATA: u64 = 0x0c;

/// A bump allocator over one region of a fake address space.
struct Image {
    l: &'static Layout,
    bytes: Vec<u8>,
    next: u64,
    /// name → ID, in the fake global symbol table.
    ids: Vec<(String, u64)>,
    /// 3.2's object shapes, indexed by shape id (the root first).
    shapes: Vec<Shape>,
}

/// One `rb_shape_t` of Ruby 3.2.
struct Shape {
    parent: u32,
    /// The ivar's ID (0 for the root).
    edge: u64,
    next_iv: u32,
}

impl Image {
    fn new(l: &'static Layout) -> Self {
        Image {
            l,
            bytes: vec![0; HEAP_SIZE],
            next: HEAP + 0x100,
            ids: Vec::new(),
            shapes: Vec::new(),
        }
    }

    fn alloc(&mut self, size: usize) -> u64 {
        let at = self.next;
        self.next += (size as u64 + 15) & !15;
        assert!(self.next < HEAP + HEAP_SIZE as u64);
        at
    }

    fn put(&mut self, addr: u64, value: u64) {
        let o = (addr - HEAP) as usize;
        self.bytes[o..o + 8].copy_from_slice(&value.to_le_bytes());
    }

    fn put32(&mut self, addr: u64, value: u32) {
        let o = (addr - HEAP) as usize;
        self.bytes[o..o + 4].copy_from_slice(&value.to_le_bytes());
    }

    fn or_byte(&mut self, addr: u64, mask: u8) {
        self.bytes[(addr - HEAP) as usize] |= mask;
    }

    fn put_bytes(&mut self, addr: u64, b: &[u8]) {
        let o = (addr - HEAP) as usize;
        self.bytes[o..o + b.len()].copy_from_slice(b);
    }

    /// Short strings are embedded (length in the flags or, from 3.2, in a field), longer
    /// ones point at a separate buffer: both representations get read.
    fn string(&mut self, s: &str) -> u64 {
        let l = self.l;
        let v = self.alloc(l.rstring_embed_ary + 64);
        if s.len() < 16 {
            let mut flags = l.t_string;
            match l.rstring_embed_len {
                Some(off) => self.put(v + off as u64, s.len() as u64),
                None => flags |= (s.len() as u64) << l.rstring_embed_len_shift,
            }
            self.put(v, flags);
            self.put_bytes(v + l.rstring_embed_ary as u64, s.as_bytes());
        } else {
            let buf = self.alloc(s.len() + 1);
            self.put_bytes(buf, s.as_bytes());
            self.put(v, l.t_string | l.rstring_noembed);
            self.put(v + l.rstring_heap_len as u64, s.len() as u64);
            self.put(v + l.rstring_heap_ptr as u64, buf);
        }
        v
    }

    fn array(&mut self, elements: &[u64]) -> u64 {
        let l = self.l;
        let v = self.alloc(64);
        let buf = self.alloc(elements.len() * 8);
        for (i, e) in elements.iter().enumerate() {
            self.put(buf + i as u64 * 8, *e);
        }
        self.put(v, l.t_array);
        self.put(v + l.rarray_heap_len as u64, elements.len() as u64);
        self.put(v + l.rarray_heap_ptr as u64, buf);
        v
    }

    /// The ID of `name` (registered now; the table is written by `symbol_table`).
    fn id(&mut self, name: &str) -> u64 {
        if let Some((_, id)) = self.ids.iter().find(|(n, _)| n == name) {
            return *id;
        }
        let serial = self.l.last_op_id + 1 + self.ids.len() as u64;
        let id = (serial << self.l.id_scope_shift) | 0x1;
        self.ids.push((name.to_string(), id));
        id
    }

    /// A `Ruby_Profiler_State` table holding `TAGS`, as the extension writes one
    /// (`profiler_state::encode`). Before `symbol_table`, which must list its keys.
    fn tag_table(&mut self) -> u64 {
        let l = self.l;
        let values = [
            self.string(TAGS[0].1),
            (42 << 1) | l.fixnum_flag,
            l.qnil,
            l.qtrue,
            (self.id(TAGS[4].1) << l.special_shift) | l.symbol_flag,
            self.dynamic_symbol(TAGS[5].1),
        ];
        let pairs: Vec<(u64, u64)> = (TAGS.iter().zip(values))
            .map(|((name, _), value)| (self.id(name), value))
            .collect();
        let words = profiler_state::encode(&pairs);
        let table = self.alloc(words.len() * 8);
        for (i, w) in words.iter().enumerate() {
            self.put(table + 8 * i as u64, *w);
        }
        table
    }

    /// A Symbol made at run time (`to_sym`): an object of its own, named by a String.
    fn dynamic_symbol(&mut self, name: &str) -> u64 {
        let l = self.l;
        let v = self.alloc(l.rsymbol_fstr + 16);
        let fstr = self.string(name);
        self.put(v, l.t_symbol);
        self.put(v + l.rsymbol_fstr as u64, fstr);
        v
    }

    /// `rb_symbols_t`: `ids` is an array of chunks of `id_entry_unit` entries of
    /// `id_entry_size` VALUEs, the name (a String) being VALUE `id_entry_str` of an entry.
    /// A chunk is an Array, or from 4.1 (`id_chunk_data`) a T_DATA whose data is an
    /// `rb_darray` (size, capacity, then the entries); from the master of 2026-08 (`id_dir`)
    /// `ids` is a T_DATA over a directory of the chunks. The counter at `symbols_last_id` is
    /// the last serial, or from 4.0 (`symbols_count_next_id`) the next one.
    fn symbol_table(&mut self) -> u64 {
        let l = self.l;
        let names: Vec<(String, u64)> = self.ids.clone();
        let last_serial = names
            .iter()
            .map(|(_, id)| id >> l.id_scope_shift)
            .max()
            .unwrap();
        let chunks = last_serial / l.id_entry_unit + 1;
        let mut chunk_values = Vec::new();
        for c in 0..chunks {
            let mut entries = vec![0u64; (l.id_entry_unit * l.id_entry_size) as usize];
            for (name, id) in &names {
                let serial = id >> l.id_scope_shift;
                if serial / l.id_entry_unit == c {
                    let s = self.string(name);
                    let at = (serial % l.id_entry_unit) * l.id_entry_size + l.id_entry_str;
                    entries[at as usize] = s;
                }
            }
            let chunk = match l.id_chunk_data {
                None => self.array(&entries),
                Some(data_at) => {
                    let darray = self.alloc(l.id_chunk_header + entries.len() * 8);
                    self.put(darray, l.id_entry_unit); // size
                    self.put(darray + 8, l.id_entry_unit); // capa
                    for (i, e) in entries.iter().enumerate() {
                        self.put(darray + l.id_chunk_header as u64 + i as u64 * 8, *e);
                    }
                    let data = self.alloc(data_at + 8);
                    self.put(data, T_DATA);
                    self.put(data + data_at as u64, darray);
                    data
                }
            };
            chunk_values.push(chunk);
        }
        let ids = match (l.id_dir, l.id_chunk_data) {
            // The master of 2026-08: `ids` wraps a directory {capa, entries} of the chunks,
            // with room to spare (capa doubles as IDs grow).
            (Some((capa_at, entries_at)), Some(data_at)) => {
                let capa = chunk_values.len() as u64 * 2;
                let entries = self.alloc(capa as usize * 8);
                for (i, c) in chunk_values.iter().enumerate() {
                    self.put(entries + i as u64 * 8, *c);
                }
                let dir = self.alloc(16);
                self.put(dir + capa_at as u64, capa);
                self.put(dir + entries_at as u64, entries);
                let data = self.alloc(data_at + 8);
                self.put(data, T_DATA);
                self.put(data + data_at as u64, dir);
                data
            }
            _ => self.array(&chunk_values),
        };
        let table = self.alloc(l.symbols_size);
        let counter = if l.symbols_count_next_id() {
            last_serial + 1
        } else {
            last_serial
        };
        self.put32(table + l.symbols_last_id as u64, counter as u32);
        self.put(table + l.symbols_ids as u64, ids);
        table
    }

    /// A class or module named `path` (its permanent name), or an unnamed singleton class
    /// attached to `attached`. Named classes also get an ordinary ivar after their path, so
    /// that a lookup has one to pass over.
    fn class(&mut self, path: Option<&str>, module: bool, attached: Option<u64>) -> u64 {
        let l = self.l;
        let class = self.alloc(512);
        let mut flags = if module { l.t_module } else { l.t_class };
        if attached.is_some() {
            flags |= l.fl_singleton;
        }
        self.put(class, flags);
        let ext = match (l.rclass_ext_inline, l.rclass_ext_ptr) {
            (Some(off), _) => class + off as u64,
            (None, Some(off)) => {
                let ext = self.alloc(256);
                self.put(class + off as u64, ext);
                ext
            }
            (None, None) => panic!("layout {} has no class extension", l.name),
        };
        let mut ivars: Vec<(u64, u64)> = Vec::new();
        if let Some(object) = attached {
            match l.classext_attached_object {
                Some(off) => self.put(ext + off as u64, object),
                None => ivars.push((self.id("__attached__"), object)),
            }
        }
        if let Some(path) = path {
            let s = self.string(path);
            match (l.classext_classpath, l.classext_permanent_classpath) {
                (Some(off), Some((flag, mask))) => {
                    self.put(ext + off as u64, s);
                    self.or_byte(ext + flag as u64, mask);
                }
                _ => ivars.push((self.id("__classpath__"), s)),
            }
            ivars.push((self.id("@version"), (3 << 1) | l.fixnum_flag));
        }
        if let Some(iv_tbl) = l.classext_iv_tbl {
            // An st_table with its entries (hash, key, record) and no bins.
            let size = l.st_table_entry_size as u64;
            let entries = self.alloc(ivars.len() * l.st_table_entry_size + 8);
            for (i, (key, record)) in ivars.iter().enumerate() {
                let e = entries + i as u64 * size;
                self.put(e + l.st_table_entry_key as u64, *key);
                self.put(e + l.st_table_entry_record as u64, *record);
            }
            let table = self.alloc(l.st_table_entries + 8);
            self.put(table + l.st_table_entries_start as u64, 0);
            self.put(table + l.st_table_entries_bound as u64, ivars.len() as u64);
            self.put(table + l.st_table_entries as u64, entries);
            self.put(ext + iv_tbl as u64, table);
        }
        if let Some(iv_ptr) = l.classext_iv_ptr {
            // 3.2: the values in order of definition, their names in the class's shape.
            let values = self.alloc(ivars.len() * 8 + 8);
            for (i, (_, value)) in ivars.iter().enumerate() {
                self.put(values + i as u64 * 8, *value);
            }
            self.put(ext + iv_ptr as u64, values);
            let names: Vec<u64> = ivars.iter().map(|(id, _)| *id).collect();
            let shape = self.shape(&names);
            self.put(class, flags | (shape << l.shape_flag_shift));
        }
        class
    }

    /// The id of the shape of an object whose ivars are `names`, in that order: the root's
    /// descendant through one SHAPE_IVAR shape per name, made where missing (children get
    /// higher ids than their parents, as in Ruby). Written by `shape_list`.
    fn shape(&mut self, names: &[u64]) -> u64 {
        let invalid = self.l.shape_invalid_id as u32;
        if self.shapes.is_empty() {
            self.shapes.push(Shape {
                parent: invalid,
                edge: 0,
                next_iv: 0,
            });
        }
        let mut id = 0u32;
        for (i, &edge) in names.iter().enumerate() {
            let child = self
                .shapes
                .iter()
                .position(|s| s.parent == id && s.edge == edge);
            id = match child {
                Some(c) => c as u32,
                None => {
                    self.shapes.push(Shape {
                        parent: id,
                        edge,
                        next_iv: i as u32 + 1,
                    });
                    self.shapes.len() as u32 - 1
                }
            };
        }
        u64::from(id)
    }

    /// 3.2: the VM's `shape_list` (an array of `rb_shape_t` indexed by id) and
    /// `next_shape_id`, for the shapes the classes were given.
    fn shape_list(&mut self, vm: u64) {
        let l = self.l;
        let (Some(list_at), Some(next_at)) = (l.vm_shape_list, l.vm_next_shape_id) else {
            return;
        };
        let shapes = std::mem::take(&mut self.shapes);
        let list = self.alloc(shapes.len() * l.shape_size + 8);
        for (i, s) in shapes.iter().enumerate() {
            let at = list + (i * l.shape_size) as u64;
            self.put32(at + l.shape_parent_id as u64, s.parent);
            self.put(at + l.shape_edge_name as u64, s.edge);
            self.put32(at + l.shape_next_iv_index as u64, s.next_iv);
            // The root's type is SHAPE_ROOT (0); every other shape adds an ivar.
            if i > 0 {
                self.or_byte(at + l.shape_type as u64, l.shape_type_ivar as u8);
            }
        }
        self.put(vm + list_at as u64, list);
        self.put32(vm + next_at as u64, shapes.len() as u32);
    }

    /// An iseq with a one-entry line table (every instruction on `line`).
    fn iseq(
        &mut self,
        kind: u32,
        label: &str,
        base: &str,
        path: &str,
        line: i32,
        parent: u64,
    ) -> u64 {
        let l = self.l;
        let iseq = self.alloc(64);
        let body = self.alloc(
            l.body_read_size
                .max(l.body_mandatory_only_iseq.unwrap_or(0) + 8),
        );
        let encoded = self.alloc(64 * 8);
        let insns = self.alloc(l.insn_info_entry_size);
        self.put(iseq, l.t_imemo | (l.imemo_iseq << l.fl_ushift));
        self.put(iseq + l.iseq_body as u64, body);
        self.put32(body + l.body_type as u64, kind);
        self.put32(body + l.body_iseq_size as u64, 64);
        self.put(body + l.body_iseq_encoded as u64, encoded);
        let (p, lb, bl) = (self.string(path), self.string(label), self.string(base));
        self.put(body + l.body_location_pathobj as u64, p);
        self.put(body + l.body_location_label as u64, lb);
        if let Some(at) = l.body_location_base_label {
            self.put(body + at as u64, bl);
        }
        self.put32(insns + l.insn_info_entry_line_no as u64, line as u32);
        self.put(body + l.body_insns_info_body as u64, insns);
        self.put32(body + l.body_insns_info_size as u64, 1);
        self.put(body + l.body_parent_iseq as u64, parent);
        let local = if parent == 0 || kind == l.iseq_type_method {
            iseq
        } else {
            self.local_of(parent)
        };
        self.put(body + l.body_local_iseq as u64, local);
        iseq
    }

    fn local_of(&self, iseq: u64) -> u64 {
        let word = |a: u64| {
            let o = (a - HEAP) as usize;
            u64::from_le_bytes(self.bytes[o..o + 8].try_into().unwrap())
        };
        word(word(iseq + self.l.iseq_body as u64) + self.l.body_local_iseq as u64)
    }

    fn encoded(&self, iseq: u64) -> u64 {
        let o = (iseq + self.l.iseq_body as u64 - HEAP) as usize;
        let body = u64::from_le_bytes(self.bytes[o..o + 8].try_into().unwrap());
        let o = (body + self.l.body_iseq_encoded as u64 - HEAP) as usize;
        u64::from_le_bytes(self.bytes[o..o + 8].try_into().unwrap())
    }

    /// A method entry: for a Ruby method `iseq` is its body, for a C function 0.
    fn method(&mut self, owner: u64, name: &str, iseq: u64) -> u64 {
        let l = self.l;
        let me = self.alloc(64);
        let def = self.alloc(l.me_def_original_id.max(l.me_def_iseqptr) + 16);
        let kind = if iseq == 0 {
            l.method_type_cfunc
        } else {
            l.method_type_iseq
        };
        self.put(def, kind << l.me_def_type_shift);
        self.put(def + l.me_def_iseqptr as u64, iseq);
        let id = self.id(name);
        self.put(def + l.me_def_original_id as u64, id);
        self.put(me, l.t_imemo | (l.imemo_ment << l.fl_ushift));
        self.put(me + l.me_def as u64, def);
        self.put(me + l.me_owner as u64, owner);
        me
    }
}

/// One frame to lay out on the fake VM stack, outermost first.
enum Push {
    /// iseq, instruction index the pc is after, method entry (or 0), local environment?
    Ruby(u64, u64, u64, bool),
    /// method entry of a C function
    C(u64),
}

/// Addresses a test may rewrite after the first walk.
struct Handles {
    /// `ep` of the innermost frame (a C frame: `ep[-2]` is its method entry).
    top_ep: u64,
    /// The method entry of `Array#each`.
    each_me: u64,
    /// A `Ruby_Profiler_State` table with `TAGS`, as rbspy_ext publishes one.
    tags: u64,
}

/// The tags of the synthetic image's table: a String, an Integer, nil, true, a static
/// Symbol and a dynamic one.
const TAGS: [(&str, &str); 6] = [
    ("request_id", "abc-123"),
    ("user", "42"),
    ("note", "nil"),
    ("admin", "true"),
    ("endpoint", "build"),
    ("reason", "refund"),
];

fn build(l: &'static Layout) -> (MemoryImage, VmRoots, u64, Handles) {
    let mut im = Image::new(l);
    let kernel = im.class(Some("Kernel"), true, None);
    let array = im.class(Some("Array"), false, None);
    let invoice = im.class(Some("Billing::Invoice"), false, None);
    let invoice_meta = im.class(None, false, Some(invoice));

    let main = im.iseq(l.iseq_type_main, "<main>", "<main>", "app.rb", 30, 0);
    let build = im.iseq(l.iseq_type_method, "build", "build", "app.rb", 12, main);
    let block = im.iseq(
        l.iseq_type_block,
        "block in build",
        "build",
        "app.rb",
        13,
        build,
    );
    let total = im.iseq(
        l.iseq_type_method,
        "total",
        "total",
        "/src/billing/invoice.rb",
        20,
        0,
    );
    let build_me = im.method(invoice_meta, "build", build);
    let total_me = im.method(invoice, "total", total);
    let each_me = im.method(array, "each", 0);
    let sleep_me = im.method(kernel, "sleep", 0);
    let tags = im.tag_table();
    let symbols = im.symbol_table();

    let stack = [
        Push::Ruby(main, 3, 0, true),
        Push::Ruby(build, 5, build_me, true),
        Push::C(each_me),
        Push::Ruby(block, 2, 0, false),
        Push::Ruby(total, 7, total_me, true),
        Push::C(sleep_me),
    ];
    // The VM stack: values grow up from the bottom, control frames down from the top; the
    // topmost slot holds the dummy frame Ruby's backtrace skips.
    let vm_stack = im.alloc((VM_STACK_WORDS * 8) as usize);
    let end = vm_stack + VM_STACK_WORDS * 8;
    let cfp_size = l.cfp_size as u64;
    let mut sp = vm_stack + 64;
    let mut eps: Vec<u64> = Vec::new();
    let mut cfp = end - cfp_size; // the dummy frame
    for push in &stack {
        cfp -= cfp_size;
        let ep = sp + 16;
        sp += 24 + 32;
        let (iseq, pc, me_cref, flags, specval) = match push {
            Push::Ruby(iseq, at, me, local) => {
                let specval = if *local { 0 } else { eps[eps.len() - 2] | 1 };
                let flags = if *local { l.env_flag_local } else { 0 };
                (*iseq, im.encoded(*iseq) + at * 8, *me, flags, specval)
            }
            Push::C(me) => (0, 0, *me, l.frame_magic_cfunc | l.env_flag_local, 0),
        };
        im.put(ep - 16, me_cref);
        im.put(ep - 8, specval);
        im.put(ep, flags);
        im.put(cfp + l.cfp_pc as u64, pc);
        im.put(cfp + l.cfp_sp as u64, sp);
        im.put(cfp + l.cfp_iseq as u64, iseq);
        im.put(cfp + l.cfp_ep as u64, ep);
        eps.push(ep);
    }

    let ec = im.alloc(256);
    im.put(ec + l.ec_vm_stack as u64, vm_stack);
    im.put(ec + l.ec_vm_stack_size as u64, VM_STACK_WORDS);
    im.put(ec + l.ec_cfp as u64, cfp);
    let thread = im.alloc(1024);
    let vm_fields = [l.vm_main_ractor, l.vm_shape_list, l.vm_next_shape_id];
    let vm_size = vm_fields
        .iter()
        .flatten()
        .fold(l.vm_main_thread, |a, b| a.max(*b));
    let vm = im.alloc(vm_size + 4096);
    im.put(thread + l.thread_ec as u64, ec);
    im.put(thread + l.thread_vm as u64, vm);
    im.put(vm + l.vm_main_thread as u64, thread);
    im.shape_list(vm);
    if let Some(off) = l.vm_main_ractor {
        let ractor = im.alloc(4096);
        im.put(vm + off as u64, ractor);
        if let Some(main) = l.ractor_threads_main {
            im.put(ractor + main as u64, thread);
        }
    }
    let mut mem = MemoryImage::new();
    mem.map(HEAP, im.bytes);
    let roots = rbspy_ext_core::vm::check_vm(&mem, l, vm).expect("the fake VM validates");
    let handles = Handles {
        top_ep: *eps.last().expect("frames pushed"),
        each_me,
        tags,
    };
    (mem, roots, symbols, handles)
}

/// Every table layout, and the newest without `location.base_label`, as 4.1.0 has it
/// (upstream PR #18551): a block's method name then comes from its local iseq's label.
fn layouts_and_one_without_base_label() -> Vec<&'static Layout> {
    let newest = LAYOUTS.last().expect("a layout");
    let without: &'static Layout = Box::leak(Box::new(Layout {
        name: "no base_label",
        body_location_base_label: None,
        ..*newest
    }));
    LAYOUTS.iter().chain([without]).collect()
}

#[test]
fn every_layout_walks_a_synthetic_stack_like_ruby() {
    for l in layouts_and_one_without_base_label() {
        let (mem, roots, symbols, _) = build(l);
        let mut spy = Spy::with_memory(1, mem, l, l.name, roots, Some(symbols));
        let frames = spy
            .snapshot()
            .unwrap_or_else(|e| panic!("layout {}: {e}", l.name));
        let got: Vec<(String, String, i32, bool)> = frames
            .iter()
            .map(|f| {
                (
                    f.label.to_string(),
                    f.path.to_string(),
                    f.lineno,
                    f.c_function,
                )
            })
            .collect();
        let expected = [
            ("Kernel#sleep", "/src/billing/invoice.rb", 20, true),
            (
                "Billing::Invoice#total",
                "/src/billing/invoice.rb",
                20,
                false,
            ),
            ("block in Billing::Invoice.build", "app.rb", 13, false),
            ("Array#each", "app.rb", 12, true),
            ("Billing::Invoice.build", "app.rb", 12, false),
            ("<main>", "app.rb", 30, false),
        ]
        .map(|(a, b, c, d)| (a.to_string(), b.to_string(), c, d));
        assert_eq!(got, expected, "layout {}", l.name);
        assert_eq!(&*frames[0].base_label, "sleep");
        assert_eq!(&*frames[2].base_label, "build");
        // Warm: the same answer from the caches.
        assert_eq!(spy.snapshot().unwrap(), frames, "layout {}", l.name);
    }
}

#[test]
fn a_stack_whose_raw_words_change_is_resolved_again_not_served_from_memory() {
    for l in LAYOUTS {
        let (mut mem, roots, symbols, h) = build(l);
        // The same stack twice: the second comes from the spy's memo of resolved stacks.
        let mut spy = Spy::with_memory(1, mem.clone(), l, l.name, roots, Some(symbols));
        let first = spy.snapshot().unwrap();
        assert_eq!(spy.snapshot().unwrap(), first);
        // The innermost C frame now runs another method: same frames, same pcs, only
        // ep[-2] differs. A fresh spy and the warm one must agree on the new top frame.
        mem.write(h.top_ep - 16, &h.each_me.to_le_bytes());
        let mut fresh = Spy::with_memory(1, mem.clone(), l, l.name, roots, Some(symbols));
        let expected = fresh.snapshot().unwrap();
        assert_eq!(&*expected[0].base_label, "each", "layout {}", l.name);
        let mut warm = spy;
        *warm.memory_mut() = mem;
        assert_eq!(warm.snapshot().unwrap(), expected, "layout {}", l.name);
    }
}

/// xorshift64*: reproducible pseudo-random numbers without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// A memory image that notes every range read from it: the fuzz test mutates only words the
/// walker actually reads (elsewhere a mutation would test nothing).
struct Noting {
    image: MemoryImage,
    read: std::cell::RefCell<Vec<(u64, usize)>>,
}

impl rbspy_ext_core::memory::Memory for Noting {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), rbspy_ext_core::MemoryError> {
        self.read.borrow_mut().push((addr, buf.len()));
        self.image.read(addr, buf)
    }
}

/// The 8-byte-aligned words `reads` makes a spy over a clean `image` read.
fn words_read(
    image: &MemoryImage,
    l: &'static Layout,
    roots: VmRoots,
    symbols: u64,
    reads: &dyn Fn(&mut Spy<Noting>),
) -> Vec<u64> {
    let noting = Noting {
        image: image.clone(),
        read: Default::default(),
    };
    let mut spy = Spy::with_memory(1, noting, l, l.name, roots, Some(symbols));
    reads(&mut spy);
    let mut words: Vec<u64> = spy
        .memory()
        .read
        .borrow()
        .iter()
        .flat_map(|(addr, len)| (addr / 8..(addr + *len as u64).div_ceil(8)).map(|w| w * 8))
        .collect();
    words.sort_unstable();
    words.dedup();
    words
}

/// The CPU time the calling thread has used.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, which lives for the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Mutation fuzzing, bounded so it runs in every `cargo test`. For every layout's synthetic
/// image, `reads` is first run on the clean image to learn which words it reads; then, for
/// each iteration, a few of those words are overwritten by garbage (random words, small
/// integers, 0, all ones, pointers into other regions, a region's own start) and `reads` runs
/// again on a fresh spy. Nothing may panic, any one iteration must end within a second of CPU
/// time, and no allocation may exceed 64 MiB. `RBSPY_EXT_FUZZ_ITERATIONS` (per layout,
/// default 400) and `RBSPY_EXT_FUZZ_SEED` run it longer or elsewhere; a failure names the
/// layout, seed and iteration to replay. Returns (images read, how many of them `reads`
/// called a success).
fn fuzz(
    what: &str,
    reads: &dyn Fn(&mut Spy<Noting>, &Handles) -> bool,
    clean: &dyn Fn(&mut Spy<Noting>, &Handles),
) -> (u64, u64) {
    const MAX_ALLOCATION: usize = 64 << 20;
    let iterations: u64 = std::env::var("RBSPY_EXT_FUZZ_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400);
    let seed: u64 = std::env::var("RBSPY_EXT_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed_1234_abcd_0001);
    let (mut runs, mut succeeded) = (0u64, 0u64);
    for (n, l) in LAYOUTS.iter().enumerate() {
        let (mem, roots, symbols, handles) = build(l);
        let regions = mem.regions();
        let targets = words_read(&mem, l, roots, symbols, &|spy| clean(spy, &handles));
        for i in 0..iterations {
            let mixed = seed ^ ((n as u64) << 32) ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let mut rng = Rng(mixed.wrapping_mul(0xbf58_476d_1ce4_e5b9) | 1);
            let mut image = mem.clone();
            for _ in 0..1 + rng.below(6) {
                let at = targets[rng.below(targets.len() as u64) as usize];
                let start = regions
                    .iter()
                    .rev()
                    .find(|(s, _)| *s <= at)
                    .map_or(at, |(s, _)| *s);
                let (other, other_len) = regions[rng.below(regions.len() as u64) as usize];
                let word = match rng.below(6) {
                    0 => rng.next(),
                    1 => rng.below(1 << 16),
                    2 => 0,
                    3 => u64::MAX,
                    4 => other + rng.below(other_len as u64 + 64),
                    _ => start,
                };
                image.write(at, &word.to_le_bytes());
            }
            let replay = format!(
                "{what}: layout {}, RBSPY_EXT_FUZZ_SEED={seed}, iteration {i}",
                l.name
            );
            let began = thread_cpu();
            let noting = Noting {
                image,
                read: Default::default(),
            };
            let mut spy = Spy::with_memory(1, noting, l, l.name, roots, Some(symbols));
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                reads(&mut spy, &handles)
            }));
            succeeded += u64::from(outcome.as_ref().is_ok_and(|ok| *ok));
            assert!(outcome.is_ok(), "panicked: {replay}");
            // CPU time, not the wall clock: a hang spins, while a machine busy with other
            // work only stretches the wall clock (~0.1 s of CPU is the most one takes here).
            let took = thread_cpu() - began;
            assert!(
                took < Duration::from_secs(1),
                "took {took:?} of CPU: {replay}"
            );
            let largest = LARGEST.load(Ordering::Relaxed);
            assert!(
                largest <= MAX_ALLOCATION,
                "allocated {largest} bytes at once: {replay}"
            );
            runs += 1;
        }
    }
    println!(
        "{what}: {runs} mutated images (seed {seed}) read without a panic, hang or oversized \
         allocation ({succeeded} still read, the rest gave an error)"
    );
    (runs, succeeded)
}

/// The stack walker and thread sampler on mutated images (see `fuzz`).
#[test]
fn mutated_images_never_panic_hang_or_allocate_wildly() {
    fuzz(
        "walker",
        &|spy, _| {
            let ok = spy.snapshot().is_ok();
            let _ = spy.sample(ThreadSelection::All);
            let _ = spy.sample(ThreadSelection::GvlHolder);
            ok
        },
        &|spy, _| {
            spy.snapshot().expect("the clean image walks");
            let _ = spy.sample(ThreadSelection::All);
        },
    );
}

/// The tag-table reader on mutated tables, keys, symbol table and String values (see `fuzz`):
/// a decoding, when there is one, has at most as many tags as the table has slots.
#[test]
fn mutated_tag_tables_never_panic_hang_or_allocate_wildly() {
    let (runs, decoded) = fuzz(
        "tag tables",
        &|spy, h| spy.tags_at(h.tags).len() <= 4096,
        &|spy, h| assert_eq!(spy.tags_at(h.tags).len(), TAGS.len()),
    );
    assert!(decoded == runs, "a decoding had more tags than slots");
}

/// The tag table of every layout's image decodes to its tags, as text.
#[test]
fn every_layout_decodes_a_tag_table() {
    for l in LAYOUTS {
        let (mem, roots, symbols, h) = build(l);
        let mut spy = Spy::with_memory(1, mem, l, l.name, roots, Some(symbols));
        let mut got: Vec<(String, String)> = spy
            .tags_at(h.tags)
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        got.sort();
        let mut want: Vec<(String, String)> = TAGS
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        want.sort();
        assert_eq!(got, want, "layout {}", l.name);
        assert!(spy.tags_at(0).is_empty());
    }
}

/// The corpus of what the fuzz tests found, rebuilt by hand so each stays fixed whatever the
/// fuzz tests' seeds: each case rewrites one word of every layout's image, and the walk and
/// the sampler must give an error or a stack, not panic or allocate wildly.
#[test]
fn found_crashes_stay_fixed() {
    /// What was found, which field of the innermost control frame, and the value written.
    type Case = (&'static str, fn(&Layout) -> usize, u64);
    let cases: [Case; 3] = [
        // c61e454: an `ep` near the top of the address space made the value-stack length
        // wrap into a capacity overflow (a panic), later a huge allocation.
        ("ep near u64::MAX", |l| l.cfp_ep, u64::MAX - 7),
        ("ep far above the stack", |l| l.cfp_ep, 1 << 46),
        // Address arithmetic on words read from the target overflowed in debug builds.
        ("iseq near u64::MAX", |l| l.cfp_iseq, u64::MAX - 15),
    ];
    for l in LAYOUTS {
        let (mem, roots, symbols, _) = build(l);
        let ec = mem
            .read_u64(roots.main_thread + l.thread_ec as u64)
            .expect("thread");
        let cfp = mem.read_u64(ec + l.ec_cfp as u64).expect("ec");
        for (what, field, value) in cases {
            let mut image = mem.clone();
            image.write(cfp + field(l) as u64, &value.to_le_bytes());
            let mut spy = Spy::with_memory(1, image, l, l.name, roots, Some(symbols));
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let _ = spy.snapshot();
                let _ = spy.sample(ThreadSelection::All);
            }));
            assert!(outcome.is_ok(), "{what}: panicked on layout {}", l.name);
            assert!(
                LARGEST.load(Ordering::Relaxed) <= 64 << 20,
                "{what}: oversized allocation on layout {}",
                l.name
            );
        }
    }
}
