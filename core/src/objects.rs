//! Reading Ruby heap objects out of another process: strings, arrays, symbol names and
//! class paths. Everything here is bounded (lengths capped, loops limited) because the
//! memory may be garbage: a racing target, or a wrong guess during the VM search.
use crate::error::{ObjResult, ObjectError};
use crate::memory::{field, word, word32, Memory};
use rbspy_ext_bindings::Layout;
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest string the spy will copy (paths and labels are far shorter).
const MAX_STRING: usize = 64 * 1024;
/// Most iv_tbl entries scanned when looking up a class's name.
const MAX_IVARS: u64 = 4096;

/// True for VALUEs that are pointers to heap objects (not nil/true/false/fixnums/symbols).
pub fn is_heap_object(value: u64) -> bool {
    value != 0 && value & 0x7 == 0 && value > 0x1000
}

/// Reads a T_STRING's bytes (lossily decoded as UTF-8).
pub fn read_string<M: Memory>(mem: &M, l: &Layout, value: u64) -> ObjResult<String> {
    if !is_heap_object(value) {
        return Err(ObjectError::Shape("String", value));
    }
    let mut head = [0u8; 48];
    let head_len = (l.rstring_embed_ary + 16).min(head.len());
    mem.read(value, &mut head[..head_len])?;
    let flags = word(&head, l.rbasic_flags);
    if flags & l.t_mask != l.t_string {
        return Err(ObjectError::Shape("String", value));
    }
    let bytes = if flags & l.rstring_noembed != 0 {
        let len = word(&head, l.rstring_heap_len) as usize;
        if len > MAX_STRING {
            return Err(ObjectError::Shape("String", value));
        }
        mem.read_vec(word(&head, l.rstring_heap_ptr), len)?
    } else {
        let len = match l.rstring_embed_len {
            Some(offset) => word(&head, offset) as usize,
            None => ((flags & l.rstring_embed_len_mask) >> l.rstring_embed_len_shift) as usize,
        };
        if len > MAX_STRING {
            return Err(ObjectError::Shape("String", value));
        }
        let start = l.rstring_embed_ary;
        if start + len <= head_len {
            head[start..start + len].to_vec()
        } else {
            // Since 3.2 embedded strings may fill a larger heap slot than the header read.
            mem.read_vec(field(value, start), len)?
        }
    };
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Reads element `index` of a T_ARRAY.
pub fn read_array_entry<M: Memory>(mem: &M, l: &Layout, value: u64, index: u64) -> ObjResult<u64> {
    if !is_heap_object(value) {
        return Err(ObjectError::Shape("Array", value));
    }
    let mut head = [0u8; 48];
    mem.read(value, &mut head[..l.rarray_heap_ptr + 8])?;
    let flags = word(&head, l.rbasic_flags);
    if flags & l.t_mask != l.t_array {
        return Err(ObjectError::Shape("Array", value));
    }
    let (len, ptr) = if flags & l.rarray_embed_flag != 0 {
        (
            (flags & l.rarray_embed_len_mask) >> l.rarray_embed_len_shift,
            field(value, l.rarray_embed_ary),
        )
    } else {
        (
            word(&head, l.rarray_heap_len),
            word(&head, l.rarray_heap_ptr),
        )
    };
    if index >= len {
        return Err(ObjectError::Shape("Array index", value));
    }
    Ok(mem.read_u64(ptr.wrapping_add(index.wrapping_mul(8)))?)
}

/// How many bytes of a T_ARRAY `array_len` needs.
pub fn array_head_len(l: &Layout) -> usize {
    l.rarray_heap_ptr + 8
}

/// The length of the T_ARRAY whose first `array_head_len` bytes are `head`; None for any
/// other object.
pub fn array_len(l: &Layout, head: &[u8]) -> Option<u64> {
    let flags = word(head, l.rbasic_flags);
    if flags & l.t_mask != l.t_array {
        return None;
    }
    Some(if flags & l.rarray_embed_flag != 0 {
        (flags & l.rarray_embed_len_mask) >> l.rarray_embed_len_shift
    } else {
        word(head, l.rarray_heap_len)
    })
}

/// `RUBY_T_DATA`: the same in every Ruby (ruby/internal/value_type.h).
const T_DATA: u64 = 0x0c;

/// Resolves IDs (method and ivar names) through the target's global symbol table
/// (`ruby_global_symbols`), caching every answer: IDs never change meaning.
#[derive(Debug)]
pub struct SymbolTable {
    /// Address of the target's `rb_symbols_t`.
    pub addr: u64,
    names: FxHashMap<u64, Arc<str>>,
}

impl SymbolTable {
    pub fn new(addr: u64) -> Self {
        SymbolTable {
            addr,
            names: FxHashMap::default(),
        }
    }

    /// The `last_id` and `ids` of `bytes` if they could be an `rb_symbols_t` (a small last_id,
    /// `ids` shaped like a heap object), judged without reading anything. Used to find the
    /// table in a stripped libruby by scanning its writable data; `confirms` decides.
    pub fn candidate(l: &Layout, bytes: &[u8]) -> Option<(u64, u64)> {
        let last_id = last_serial(l, word32(bytes, l.symbols_last_id));
        let ids = word(bytes, l.symbols_ids);
        ((l.last_op_id..1 << 28).contains(&last_id) && is_heap_object(ids))
            .then_some((last_id, ids))
    }

    /// Whether `head` (`array_head_len` bytes read at a candidate's `ids`) is an Array with
    /// exactly one chunk per `id_entry_unit` IDs up to the serial `last_id`, or, where the
    /// chunks live in a directory, a T_DATA (its capacity is checked when an ID is read).
    pub fn confirms(l: &Layout, last_id: u64, head: &[u8]) -> bool {
        if l.id_dir.is_some() {
            return word(head, l.rbasic_flags) & l.t_mask == T_DATA;
        }
        array_len(l, head) == Some(last_id / l.id_entry_unit + 1)
    }

    /// For 4.1's directory (a T_DATA, all `confirms` sees): whether the first ID above the
    /// operators and one halfway to the last (not the last, maybe being written) name
    /// Strings. Many words of a static ruby's data look like a counter beside a T_DATA, and
    /// the first is not always the table ("method name ID does not resolve" then, for good).
    pub fn resolves<M: Memory>(mem: &M, l: &Layout, ids: u64, last_id: u64) -> bool {
        let first = l.last_op_id + 1;
        [first, first + last_id.saturating_sub(first) / 2]
            .iter()
            .all(|&serial| {
                id_string(mem, l, ids, serial).is_ok_and(|s| read_string(mem, l, s).is_ok())
            })
    }

    /// The name of `id`, e.g. "each" or "__classpath__".
    pub fn name<M: Memory>(&mut self, mem: &M, l: &Layout, id: u64) -> ObjResult<Arc<str>> {
        if let Some(n) = self.names.get(&id) {
            return Ok(n.clone());
        }
        let serial = if id > l.last_op_id {
            id >> l.id_scope_shift
        } else {
            id
        };
        let mut head = [0u8; 64];
        mem.read(self.addr, &mut head[..l.symbols_size])?;
        let last_id = last_serial(l, word32(&head, l.symbols_last_id));
        if serial == 0 || serial > last_id {
            return Err(ObjectError::Shape("ID", id));
        }
        let str_value = id_string(mem, l, word(&head, l.symbols_ids), serial)?;
        let name: Arc<str> = read_string(mem, l, str_value)?.into();
        self.names.insert(id, name.clone());
        Ok(name)
    }
}

/// The String VALUE that names ID serial `serial`, through the table's `ids`.
fn id_string<M: Memory>(mem: &M, l: &Layout, ids: u64, serial: u64) -> ObjResult<u64> {
    let chunk = match l.id_dir {
        None => read_array_entry(mem, l, ids, serial / l.id_entry_unit)?,
        Some((capa_at, entries_at)) => {
            // `ids` wraps a directory {capa, entries}: chunk i at entries[i].
            let data_at = l
                .id_chunk_data
                .ok_or(ObjectError::Shape("ID directory", ids))?;
            if !is_heap_object(ids) {
                return Err(ObjectError::Shape("ID directory", ids));
            }
            let dir = mem.read_u64(field(ids, data_at))?;
            let mut d = [0u8; 16];
            mem.read(dir, &mut d)?;
            let (capa, entries) = (word(&d, capa_at), word(&d, entries_at));
            let index = serial / l.id_entry_unit;
            if index >= capa {
                return Err(ObjectError::Shape("ID directory index", ids));
            }
            mem.read_u64(entries.wrapping_add(index * 8))?
        }
    };
    let entry = (serial % l.id_entry_unit) * l.id_entry_size + l.id_entry_str;
    let str_value = match l.id_chunk_data {
        None => read_array_entry(mem, l, chunk, entry)?,
        Some(data_at) => {
            // 4.1: a T_DATA over an rb_darray {size, capa, entries...} of this chunk's IDs.
            if !is_heap_object(chunk) {
                return Err(ObjectError::Shape("ID chunk", chunk));
            }
            let darray = mem.read_u64(field(chunk, data_at))?;
            let size = mem.read_u64(darray)?;
            if serial % l.id_entry_unit >= size.min(l.id_entry_unit) {
                return Err(ObjectError::Shape("ID chunk index", chunk));
            }
            let at = darray.wrapping_add(l.id_chunk_header as u64);
            mem.read_u64(at.wrapping_add(entry.wrapping_mul(8)))?
        }
    };
    Ok(str_value)
}

/// The last ID serial in use, from the symbol table's counter (4.0 counts the next one).
fn last_serial(l: &Layout, counter: u32) -> u64 {
    let counter = u64::from(counter);
    if l.symbols_count_next_id() {
        counter.saturating_sub(1)
    } else {
        counter
    }
}

/// Computes method labels the way Ruby 3.4 does (`Foo#bar`, `Foo.bar`, or the bare name when
/// the owner has no permanent name), caching the class part per owner.
///
/// A class's permanent name never changes, but "no name" may: a class may be named later
/// (`Foo = Class.new`), and a read may fail or read nonsense while a compaction moves the
/// class or its path (once in a few runs of a compacting 3.3, a census named a class of
/// 20,000 objects `#<Class:0x...>` for the rest of the handle's life). So no name is
/// remembered for `UNNAMED_TTL` only, or until `forget_stale`. A compaction may also move
/// a class away and another into its address; the census forgets every name then
/// (`forget_stale`), the frames' labels do not (they are cached per method entry above).
#[derive(Debug, Default)]
pub struct ClassNames {
    /// owner VALUE → prefix ("Foo#" / "Foo.") or None for "no qualification".
    prefixes: FxHashMap<u64, Named>,
    /// class VALUE → its permanent name (`class_name`).
    names: FxHashMap<u64, Named>,
    /// The target's `rb_vm_t`, which holds Ruby 3.2's shape tree (0 when unknown: class
    /// names then resolve on the other Rubies only).
    vm: u64,
    /// The target's compactions when a census last looked (`forget_stale`).
    compactions: Option<u64>,
}

/// How long "no name" is remembered (see `ClassNames`): a sampler that meets an anonymous
/// class's methods at every tick reads its name once a second, not a thousand times.
const UNNAMED_TTL: Duration = Duration::from_secs(1);

/// A cached name, or the time a lookup found none.
#[derive(Debug, Clone)]
enum Named {
    Found(Arc<str>),
    Unnamed(Instant),
}

impl Named {
    /// The cached answer under `key`, or `read`'s (kept as `ClassNames` says).
    fn lookup(
        map: &mut FxHashMap<u64, Named>,
        key: u64,
        read: impl FnOnce() -> Option<Arc<str>>,
    ) -> Option<Arc<str>> {
        match map.get(&key) {
            Some(Named::Found(name)) => return Some(name.clone()),
            Some(Named::Unnamed(at)) if at.elapsed() < UNNAMED_TTL => return None,
            _ => {}
        }
        let found = read();
        let entry = match &found {
            Some(name) => Named::Found(name.clone()),
            None => Named::Unnamed(Instant::now()),
        };
        map.insert(key, entry);
        found
    }
}

impl ClassNames {
    /// Names for the classes of the target whose VM is at `vm`.
    pub fn for_vm(vm: u64) -> Self {
        ClassNames {
            vm,
            ..Default::default()
        }
    }

    /// Reads again, at their next lookup, the classes that had no name, and every class
    /// once `compactions` (the target's count of them) says objects have moved since the
    /// last call: a class moved elsewhere by `GC.compact` may have left its address to
    /// another. A census pass calls this, since the names it gives must be read during the
    /// pass that counts them.
    pub fn forget_stale(&mut self, compactions: u64) {
        if self.compactions.replace(compactions) != Some(compactions) {
            self.prefixes.clear();
            self.names.clear();
        }
        let found = |_: &u64, n: &mut Named| matches!(n, Named::Found(_));
        self.prefixes.retain(found);
        self.names.retain(found);
    }

    pub fn qualify<M: Memory>(
        &mut self,
        mem: &M,
        l: &Layout,
        symbols: &mut SymbolTable,
        owner: u64,
        name: &str,
    ) -> String {
        // A class we cannot name (anonymous, or memory that does not read) gets the bare
        // method name, which is also what Ruby prints for anonymous owners.
        let vm = self.vm;
        let prefix = Named::lookup(&mut self.prefixes, owner, || {
            method_prefix(mem, l, symbols, vm, owner)
                .ok()
                .flatten()
                .map(Arc::from)
        });
        match prefix {
            Some(p) => format!("{p}{name}"),
            None => name.to_string(),
        }
    }

    /// The permanent name of a class (`Foo::Bar`), if it has one.
    pub fn class_name<M: Memory>(
        &mut self,
        mem: &M,
        l: &Layout,
        symbols: &mut SymbolTable,
        class: u64,
    ) -> Option<Arc<str>> {
        let vm = self.vm;
        Named::lookup(&mut self.names, class, || {
            permanent_name(mem, l, symbols, vm, class)
                .ok()
                .flatten()
                .map(Arc::from)
        })
    }
}

/// "Foo#" for an instance method of a named class or module, "Foo." for a singleton method
/// of one, None otherwise (Ruby's `gen_method_name`).
fn method_prefix<M: Memory>(
    mem: &M,
    l: &Layout,
    symbols: &mut SymbolTable,
    vm: u64,
    owner: u64,
) -> ObjResult<Option<String>> {
    let flags = class_flags(mem, l, owner)?;
    let Some(flags) = flags else { return Ok(None) };
    if flags & l.fl_singleton != 0 {
        let attached = match l.classext_attached_object {
            Some(offset) => Some(mem.read_u64(field(class_ext(mem, l, owner)?, offset))?),
            None => ivar(mem, l, symbols, vm, owner, "__attached__")?,
        };
        let Some(attached) = attached else {
            return Ok(None);
        };
        if class_flags(mem, l, attached)?.is_none() {
            return Ok(None);
        }
        Ok(permanent_name(mem, l, symbols, vm, attached)?.map(|n| format!("{n}.")))
    } else {
        Ok(permanent_name(mem, l, symbols, vm, owner)?.map(|n| format!("{n}#")))
    }
}

/// The module whose name labels a method (vm_backtrace.c, `location_original_module`): the
/// module its definition was made in (`defined_in`, 0 when unrecorded), except for a copy
/// that `module_function` put in that module's own singleton class, which keeps `owner`.
pub fn label_module<M: Memory>(mem: &M, l: &Layout, owner: u64, defined_in: u64) -> ObjResult<u64> {
    if defined_in == 0 || defined_in == owner {
        return Ok(owner);
    }
    let (Some(flags), Some(attached_at)) =
        (class_flags(mem, l, owner)?, l.classext_attached_object)
    else {
        return Ok(defined_in);
    };
    let singleton = flags & l.t_mask == l.t_class && flags & l.fl_singleton != 0;
    if singleton && mem.read_u64(field(class_ext(mem, l, owner)?, attached_at))? == defined_in {
        return Ok(owner);
    }
    Ok(defined_in)
}

/// The address of a class's `rb_classext_t`.
fn class_ext<M: Memory>(mem: &M, l: &Layout, class: u64) -> ObjResult<u64> {
    match (l.rclass_ext_inline, l.rclass_ext_ptr) {
        (Some(offset), _) => Ok(field(class, offset)),
        (None, Some(offset)) => Ok(mem.read_u64(field(class, offset))?),
        (None, None) => Err(ObjectError::Shape("class (layout has no extension)", class)),
    }
}

/// The flags of a T_CLASS/T_MODULE, or None for any other object.
fn class_flags<M: Memory>(mem: &M, l: &Layout, value: u64) -> ObjResult<Option<u64>> {
    if !is_heap_object(value) {
        return Ok(None);
    }
    let flags = mem.read_u64(field(value, l.rbasic_flags))?;
    let t = flags & l.t_mask;
    Ok((t == l.t_class || t == l.t_module).then_some(flags))
}

/// A class's path once it is reachable from a constant (Ruby's "permanent" name: the
/// `__classpath__` ivar before 3.3, the `classpath` field with `permanent_classpath` set
/// after). A class with only a temporary path is treated as anonymous, as Ruby does.
fn permanent_name<M: Memory>(
    mem: &M,
    l: &Layout,
    symbols: &mut SymbolTable,
    vm: u64,
    class: u64,
) -> ObjResult<Option<String>> {
    let path = match (l.classext_classpath, l.classext_permanent_classpath) {
        (Some(offset), Some((flag_offset, mask))) => {
            let ext = class_ext(mem, l, class)?;
            let mut flag = [0u8; 1];
            mem.read(field(ext, flag_offset), &mut flag)?;
            if flag[0] & mask == 0 {
                return Ok(None);
            }
            Some(mem.read_u64(field(ext, offset))?)
        }
        _ => ivar(mem, l, symbols, vm, class, "__classpath__")?,
    };
    match path {
        Some(path) if is_heap_object(path) => Ok(Some(read_string(mem, l, path)?)),
        _ => Ok(None),
    }
}

/// Looks up a hidden instance variable of a class: in its iv_tbl (an st_table keyed by ID)
/// before 3.2, through its object shape in 3.2.
fn ivar<M: Memory>(
    mem: &M,
    l: &Layout,
    symbols: &mut SymbolTable,
    vm: u64,
    class: u64,
    name: &str,
) -> ObjResult<Option<u64>> {
    if l.vm_shape_list.is_some() {
        return shape_ivar(mem, l, symbols, vm, class, name);
    }
    let Some(iv_tbl) = l.classext_iv_tbl else {
        return Ok(None);
    };
    let ext = class_ext(mem, l, class)?;
    if ext == 0 {
        return Ok(None);
    }
    let table = mem.read_u64(field(ext, iv_tbl))?;
    if table == 0 {
        return Ok(None);
    }
    let mut head = [0u8; 64];
    mem.read(table, &mut head[..l.st_table_entries + 8])?;
    let start = match l.st_table_entries_start_size {
        4 => u64::from(word32(&head, l.st_table_entries_start)),
        _ => word(&head, l.st_table_entries_start),
    };
    let bound = word(&head, l.st_table_entries_bound);
    if bound < start || bound - start > MAX_IVARS {
        return Err(ObjectError::Shape("st_table", table));
    }
    let size = l.st_table_entry_size as u64;
    let entries = mem.read_vec(
        word(&head, l.st_table_entries).wrapping_add(start.wrapping_mul(size)),
        ((bound - start) * size) as usize,
    )?;
    for entry in entries.chunks_exact(l.st_table_entry_size) {
        let key = word(entry, l.st_table_entry_key);
        // Deleted entries and IDs that do not resolve are skipped, not fatal.
        if let Ok(key_name) = symbols.name(mem, l, key) {
            if &*key_name == name {
                return Ok(Some(word(entry, l.st_table_entry_record)));
            }
        }
    }
    Ok(None)
}

/// Ruby 3.2: a class's ivar through its shape (shape.c, `rb_shape_get_iv_index`). The shape
/// id is in the class's flags; from that shape towards the root, the SHAPE_IVAR shape whose
/// edge is `name` holds the ivar at index `next_iv_index - 1` of the class's `iv_ptr`. Every
/// step must go to a smaller id (a parent is made before its children), so a walk over
/// garbage ends after at most as many steps as the shape id.
fn shape_ivar<M: Memory>(
    mem: &M,
    l: &Layout,
    symbols: &mut SymbolTable,
    vm: u64,
    class: u64,
    name: &str,
) -> ObjResult<Option<u64>> {
    let (Some(list_at), Some(next_at), Some(iv_ptr_at)) =
        (l.vm_shape_list, l.vm_next_shape_id, l.classext_iv_ptr)
    else {
        return Ok(None);
    };
    if vm == 0 {
        return Ok(None);
    }
    let list = mem.read_u64(field(vm, list_at))?;
    let mut next = [0u8; 4];
    mem.read(field(vm, next_at), &mut next)?;
    let next = u64::from(u32::from_le_bytes(next));
    let flags = mem.read_u64(field(class, l.rbasic_flags))?;
    let start = (flags >> l.shape_flag_shift) & 0xffff_ffff;
    if start >= next {
        return Err(ObjectError::Shape("shape id", class));
    }
    let mut shape = vec![0u8; l.shape_size];
    let mut id = start;
    let mut ivars = None;
    for _ in 0..MAX_IVARS * 4 {
        let at = list.wrapping_add(id.wrapping_mul(l.shape_size as u64));
        mem.read(at, &mut shape)?;
        let parent = u64::from(word32(&shape, l.shape_parent_id));
        let next_iv = u64::from(word32(&shape, l.shape_next_iv_index));
        // The start shape's count bounds every index found below it.
        let count = *ivars.get_or_insert(next_iv);
        if parent == l.shape_invalid_id {
            return Ok(None); // the root: no such ivar
        }
        if u64::from(shape[l.shape_type]) == l.shape_type_ivar {
            let edge = word(&shape, l.shape_edge_name);
            if symbols.name(mem, l, edge).is_ok_and(|n| &*n == name) {
                if next_iv == 0 || next_iv > count {
                    return Err(ObjectError::Shape("shape ivar index", class));
                }
                let values = mem.read_u64(field(class_ext(mem, l, class)?, iv_ptr_at))?;
                return Ok(Some(mem.read_u64(values.wrapping_add((next_iv - 1) * 8))?));
            }
        }
        if parent >= id {
            return Err(ObjectError::Shape("shape tree", class));
        }
        id = parent;
    }
    Err(ObjectError::Shape("shape tree too deep", class))
}

/// The imemo type of an object whose flags are given, if it is a T_IMEMO.
pub(crate) fn imemo_type(l: &Layout, flags: u64) -> Option<u64> {
    (flags & l.t_mask == l.t_imemo).then_some((flags >> l.fl_ushift) & 0xf)
}

#[cfg(test)]
mod tests;
