//! The heap walk: every live object of the target by class and type, read from its GC's
//! heap pages without stopping it (`take`), through the view of the target the spy lends
//! (`spy::TargetView`: memory, layout, VM, class names).
//!
//! Every page is in the objspace's sorted page array; each page is a run of fixed-size
//! slots whose first two words are `flags` (the type in its low 5 bits, 0 for a free slot)
//! and `klass`. The census reads the array, then the page headers, then the pages' slots,
//! many pages per `process_vm_readv`, and counts as it goes; hash tables outside their
//! slots (before 3.3), objects' ivar tables and shapes (3.2+, shapes.rs) and the headers of
//! pages a lazy sweep had not reached (pages.rs) take one more batch of reads each, and
//! which metaclasses Ruby hides one read or two per metaclass (singletons.rs). The heap's
//! layout is `rbspy_ext_bindings::HeapLayout`, measured from each release's gc.c.
use super::allocated::heap_layout;
use super::classes;
use super::heaps::{addresses, gc_state, objspaces, Objspace};
use super::pages::{self, page_list_read, read_headers, Page, Reread};
use super::shapes::{shape_source, Ivars, ShapeSource};
use super::singletons::{self, ClassSlot};
use super::{Census, ClassRow, NOT_COUNTED, TYPE_NAMES};
use super::{T_ARRAY, T_CLASS, T_HASH, T_ICLASS, T_IMEMO, T_MOVED, T_NODE, T_NONE, T_OBJECT};
use super::{T_STRING, T_ZOMBIE};
use crate::error::Result;
use crate::memory::{field, word, Memory};
use crate::spy::TargetView;
use rbspy_ext_bindings::{HeapLayout, Layout, Shapes};
use rustc_hash::FxHashMap;
use std::time::Instant;

/// Appended to `NOT_COUNTED` when objects' ivars could not be sized (3.2+).
const SHAPES_NOT_FOUND: &str = "; here also T_OBJECT ivar buffers (the shape list was not found)";
/// Appended to `NOT_COUNTED` where ivars that left their object's slot are an object of
/// their own (the master of 2026-08): `ObjectSpace.memsize_of` counts them apart, so does
/// the census.
const FIELDS_APART: &str = "; here an object's ivars out of its slot are an object of their own \
     (an imemo_fields T_IMEMO), counted under T_IMEMO as memsize_of counts them";

/// Pages per `process_vm_readv` (4 MiB of 64 KiB pages): large reads, bounded memory.
const PAGES_PER_CALL: usize = 64;
/// Passes a census makes at most while compactions keep moving objects under it (or its
/// page list reads as nothing, or names freed pages).
const ATTEMPTS: u64 = 4;

/// An st_table of more entries than 2^this (a trillion) is not one.
const MAX_ENTRY_POWER: u8 = 40;

/// `RUBY_FL_FREEZE`, the same bit on every Ruby.
const FL_FREEZE: u64 = 1 << 11;

/// What the caller bounds a census by.
#[derive(Debug, Clone, Copy, Default)]
pub struct CensusOptions {
    /// Stop (with a census marked partial) before reading more than this many bytes of
    /// pages.
    pub max_bytes: Option<u64>,
}

/// Live objects of one (class, type), as counted.
#[derive(Default, Clone, Copy)]
struct Tally {
    objects: u64,
    slot_bytes: u64,
    heap_bytes: u64,
}

/// A census in progress.
pub(super) struct Count<'a> {
    l: &'a Layout,
    h: &'a HeapLayout,
    census: Census,
    by_class: FxHashMap<(u64, u8), Tally>,
    /// The T_CLASS slots, counted apart: whether Ruby yields a class from `each_object`
    /// depends on the others (singletons.rs).
    class_slots: Vec<ClassSlot>,
    /// Hashes whose st_table is outside the slot (before 3.3), and objects whose ivars are
    /// an st_table (too complex, 3.2+): (class, type, table).
    tables: Vec<(u64, u8, u64)>,
    /// Objects whose ivars are in a buffer sized by their shape (3.2+), by (class, shape id):
    /// how many (see shapes.rs).
    shaped: FxHashMap<(u64, u32), u64>,
    /// The index in `census.ractors` of the Ractor whose heap is being counted (None where
    /// the VM has one heap). Tables read after the pages (`tables`, before 3.3) never occur
    /// where Ractors own heaps, so each Ractor's bytes are complete without them.
    ractor: Option<usize>,
}

impl<'a> Count<'a> {
    pub(super) fn new(l: &'a Layout, h: &'a HeapLayout, census: Census) -> Self {
        Count {
            l,
            h,
            census,
            by_class: FxHashMap::default(),
            class_slots: Vec::new(),
            tables: Vec::new(),
            shaped: FxHashMap::default(),
            ractor: None,
        }
    }
}

/// The target's heap, read through the view the spy lends, and its layout.
struct Heap<'a, M: Memory> {
    t: TargetView<'a, M>,
    h: &'static HeapLayout,
}

/// Counts the target's live objects by class and type, reading its heap pages while it
/// runs. A page that does not read, or reads as nonsense (freed or changed meanwhile), is
/// counted as unreadable and skipped; nothing is followed beyond a page but the class names,
/// hash and ivar tables and shapes. A pass that overlapped a compaction (objects moved while
/// it read, so some were seen twice or not at all) is taken again, up to `ATTEMPTS` passes;
/// the census says how many were (`compactions`) and whether the last one still did
/// (`moving`). So is a pass that read no page, or found a listed page freed (the census
/// then says how many in its last pass, `unreadable_pages`).
pub fn take<M: Memory>(target: TargetView<'_, M>, options: CensusOptions) -> Result<Census> {
    let began = Instant::now();
    let h = heap_layout(&target)?;
    let mut heap = Heap { t: target, h };
    let mut spaces = objspaces(&heap.t, h)?;
    let (mut passes, mut compactions) = (0, 0);
    let mut census = loop {
        let before = gc_state(&heap.t, h, &spaces)?;
        // Names are read again where they may have changed: a class unnamed in a pass that
        // overlapped a compaction, and every class once one moved objects.
        heap.t.forget_stale_class_names(before.0);
        let mut census = heap.pass(&spaces, options)?;
        // A Ractor that started or ended meanwhile (its heap absorbed by another, whose
        // pages then moved from one list to the other) may have been missed or counted
        // twice: the pass is taken again, like one that overlapped a compaction.
        let now = objspaces(&heap.t, h)?;
        census.heaps_changed |= addresses(&now) != addresses(&spaces);
        census.moving = before.1
            || (!census.heaps_changed && gc_state(&heap.t, h, &spaces)? != (before.0, false));
        passes += 1;
        // A live Ruby has pages: a list none of whose pages read was read while it
        // changed (once in 500 censuses of a churning 2.7 under load it named 6 pages,
        // of some 320, none readable).
        let no_page = census.pages == 0;
        // A listed page that did not read was freed meanwhile, and the list may have been
        // read in the middle of the loop that frees pages (gc.c's
        // heap_pages_free_unused_pages lowers the count with each page it frees while the
        // kept pages above are still to be moved down): the pass missed as many pages at
        // the top (on a compacting 3.3, 1,050 and 2,425 of 20,000 live objects).
        let freed = census.unreadable_pages > 0;
        let changed = census.heaps_changed || census.pages_changed;
        if !(census.moving || no_page || freed || changed) || passes >= ATTEMPTS {
            break census;
        }
        compactions += u64::from(census.moving);
        spaces = now;
    };
    census.compactions = compactions;
    census.duration_us = began.elapsed().as_micros() as u64;
    census.taken_at_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    Ok(census)
}

impl<M: Memory> Heap<'_, M> {
    /// One pass over every page of every heap (see `take`).
    fn pass(&mut self, spaces: &[Objspace], options: CensusOptions) -> Result<Census> {
        let h = self.h;
        let shapes = h.shapes.and_then(|s| shape_source(&mut self.t, &s));
        let t = &self.t;
        let (l, mem) = (t.layout(), t.mem());
        let mut count = Count::new(
            l,
            h,
            Census {
                pid: t.pid(),
                ruby_version: t.version().to_string(),
                not_counted: NOT_COUNTED.to_string()
                    + if h.fields.is_some() { FIELDS_APART } else { "" },
                ractors: spaces.iter().filter_map(|s| s.ractor.clone()).collect(),
                ..Census::default()
            },
        );
        'heaps: for (i, space) in spaces.iter().enumerate() {
            let memory = |context| move |e| t.memory_error(context, e);
            let read = mem
                .read_u64(field(space.address, l.objspace_flags))
                .map_err(memory("reading the GC's flags"))
                .and_then(|flags| {
                    let (pages, consistent) = page_list_read(mem, h, space.address)
                        .map_err(memory("reading the heap's page list"))?;
                    count.census.pages_changed |= !consistent;
                    Ok((flags, pages))
                });
            let (flags, pages) = match read {
                Ok(read) => read,
                // A terminated Ractor's heap freed once absorbed: the set changed.
                Err(_) if i > 0 => {
                    count.census.heaps_changed = true;
                    continue;
                }
                Err(e) => return Err(e),
            };
            // Each heap sweeps lazily on its own.
            let sweeping = flags & 3 == h.gc_mode_sweeping;
            count.census.sweeping |= sweeping;
            count.ractor = space.ractor.is_some().then_some(i);
            for chunk in pages.chunks(PAGES_PER_CALL) {
                let mut headers = read_headers(mem, h, sweeping, chunk, &mut count.census);
                if h.ractor_heaps.is_some() {
                    // A page of another heap now (absorbed meanwhile) is counted there.
                    let listed = headers.len();
                    headers.retain(|p| p.objspace == space.address);
                    count.census.heaps_changed |= headers.len() != listed;
                }
                if !count.read_bodies(mem, &headers, options.max_bytes) {
                    break 'heaps;
                }
            }
            count.census.pages_changed |= pages::freed_since(mem, h, space.address, &pages);
        }
        count.read_tables(mem);
        match (h.shapes, &shapes) {
            (Some(s), Some(source)) => count.add_shaped(mem, &s, source),
            (Some(_), None) if !count.shaped.is_empty() => {
                count.census.not_counted += SHAPES_NOT_FOUND;
            }
            _ => {}
        }
        if count.census.unreadable_pages > 0 || count.census.unreadable_tables > 0 {
            // Pages freed while read, or the process gone (an error, not a census of part).
            self.t.check_identity()?;
        }
        Ok(self.name_classes(count))
    }

    /// The census's rows, named as the target's own `Kernel#class` names each object that
    /// `ObjectSpace.each_object` yields: its class's path (`#<Class:0x...>` when anonymous),
    /// "Class" for classes, a module's class (Module, or a subclass such as Refinement).
    /// What `each_object` does not yield has no class to Ruby and is named "" under its
    /// type: objects with no class (hidden), iclasses, imemos and nodes, and the singleton
    /// classes Ruby hides (singletons.rs).
    fn name_classes(&mut self, count: Count) -> Census {
        let Count {
            mut census,
            mut by_class,
            class_slots,
            ..
        } = count;
        let frozen_core: Vec<u64> = (class_slots.iter())
            .filter(|c| c.frozen && !c.singleton)
            .map(|c| c.address)
            .filter(|c| self.t.class_name(*c).as_deref() == Some(singletons::FROZEN_CORE))
            .collect();
        let hidden = singletons::hidden(
            &class_slots,
            |class| classes::real_superclass(&self.t, self.h, class),
            |class| frozen_core.contains(&class),
        );
        for c in &class_slots {
            // Under a `klass` of 0 (no class: "") or 1 (any other: "Class"), since every class
            // Ruby yields is a Class (no class inherits from Class).
            let key = u64::from(!hidden.contains(&c.address));
            let one = Tally {
                objects: 1,
                slot_bytes: c.slot_bytes,
                heap_bytes: 0,
            };
            by_class.entry((key, T_CLASS)).or_default().add(one);
        }
        let mut names: FxHashMap<u64, String> = FxHashMap::default();
        let mut classes: FxHashMap<(String, u8), Tally> = FxHashMap::default();
        for ((klass, t), tally) in by_class {
            let name = match t {
                // An iclass, imemo or node keeps something else than a class in `klass`.
                T_ICLASS | T_IMEMO | T_NODE => String::new(),
                _ if klass == 0 => String::new(),
                T_CLASS => "Class".to_string(),
                _ => names
                    .entry(klass)
                    .or_insert_with(|| classes::class_path(&mut self.t, self.h, klass))
                    .clone(),
            };
            classes.entry((name, t)).or_default().add(tally);
        }
        let mut types: FxHashMap<u8, Tally> = FxHashMap::default();
        for ((_, t), tally) in &classes {
            types.entry(*t).or_default().add(*tally);
        }
        census.classes = rows(classes.into_iter().map(|((n, t), tally)| (n, t, tally)));
        census.types = rows(
            types
                .into_iter()
                .map(|(t, tally)| (String::new(), t, tally)),
        );
        census
    }
}

impl Count<'_> {
    /// Adds the ivars buffers of the objects counted by shape (`shaped`) to their classes,
    /// each shape's capacity in words.
    fn add_shaped<M: Memory>(&mut self, mem: &M, s: &Shapes, source: &ShapeSource) {
        let shaped = std::mem::take(&mut self.shaped);
        let ids = shaped.keys().map(|(_, id)| *id).collect();
        let capacities = source.capacities(mem, s, ids, &mut self.census);
        for ((klass, id), objects) in shaped {
            if let Some(capacity) = capacities.get(&id) {
                let tally = self.by_class.entry((klass, T_OBJECT)).or_default();
                let bytes = capacity.saturating_mul(8).saturating_mul(objects);
                tally.heap_bytes = tally.heap_bytes.saturating_add(bytes);
            }
        }
    }
}

impl Tally {
    /// Saturating: outside bytes read from a heap that changes (or a freed slot) can be anything.
    fn add(&mut self, other: Tally) {
        self.objects += other.objects;
        self.slot_bytes += other.slot_bytes;
        self.heap_bytes = self.heap_bytes.saturating_add(other.heap_bytes);
    }
}

/// Rows most bytes first (then most objects, then by name, so that equal heaps list alike).
fn rows(tallies: impl Iterator<Item = (String, u8, Tally)>) -> Vec<ClassRow> {
    let mut rows: Vec<ClassRow> = tallies
        .map(|(name, t, tally)| ClassRow {
            name,
            type_name: TYPE_NAMES[(t & 0x1f) as usize].to_string(),
            objects: tally.objects,
            slot_bytes: tally.slot_bytes,
            heap_bytes: tally.heap_bytes,
        })
        .collect();
    rows.sort_by(|a, b| {
        b.bytes()
            .cmp(&a.bytes())
            .then(b.objects.cmp(&a.objects))
            .then_with(|| (&a.name, &a.type_name).cmp(&(&b.name, &b.type_name)))
    });
    rows
}

impl Count<'_> {
    /// Reads the slots of `pages` in one call and counts them. False when `max_bytes` cut
    /// the census short (it is then partial).
    fn read_bodies<M: Memory>(&mut self, mem: &M, pages: &[Page], max_bytes: Option<u64>) -> bool {
        let mut take = pages.len();
        if let Some(max) = max_bytes {
            let mut total = self.census.bytes_read;
            take = pages
                .iter()
                .position(|p| {
                    total += (p.slots * p.slot_size) as u64;
                    total > max
                })
                .unwrap_or(pages.len());
        }
        let cut = take < pages.len();
        let pages = &pages[..take];
        let body = |p: &Page| (p.start, p.slots * p.slot_size);
        let mut bodies = mem.read_blocks(pages.iter().map(body));
        let states = pages::reread(mem, self.h, pages);
        let reread = pages.iter().filter(|p| p.unswept).count();
        self.census.bytes_read += (reread * pages::header_len(self.h)) as u64;
        // Pages swept meanwhile: their slots again, as a swept page's.
        let swept: Vec<usize> = (0..pages.len())
            .filter(|i| states[*i] == Reread::Swept)
            .collect();
        let again = mem.read_blocks(swept.iter().map(|i| body(&pages[*i])));
        for (i, read) in swept.into_iter().zip(again) {
            bodies[i] = read;
        }
        for ((page, body), state) in pages.iter().zip(&bodies).zip(states) {
            let Some(body) = body.as_deref().filter(|_| state != Reread::Gone) else {
                self.census.unreadable_pages += 1;
                continue;
            };
            self.census.bytes_read += body.len() as u64;
            self.census.pages += 1;
            self.census.heap_bytes_total += body.len() as u64;
            if let Some(r) = self.ractor {
                self.census.ractors[r].pages += 1;
            }
            self.count_page(page, body, page.unswept && state == Reread::Same);
        }
        self.census.partial |= cut;
        !cut
    }

    /// Counts one page's slots; unmarked ones as garbage when `unswept` (see `Page`).
    fn count_page(&mut self, page: &Page, body: &[u8], unswept: bool) {
        let (mut total, mut free, mut live) = (0, 0, Tally::default());
        for i in 0..page.slots {
            let slot = &body[i * page.slot_size..(i + 1) * page.slot_size];
            // Only word 0 of a free slot means anything: on the master of 2026-08 the
            // slots after a free run's first hold what the dead object left.
            let flags = word(slot, 0);
            let t = (flags & 0x1f) as u8;
            total += 1;
            match t {
                _ if flags == 0 || t == T_NONE => free += 1,
                T_ZOMBIE => self.census.zombie_slots += 1,
                T_MOVED => self.census.moved_slots += 1,
                _ if unswept && !self.marked(page, i) => self.census.garbage_slots += 1,
                _ => {
                    self.census.live_slots += 1;
                    let klass = word(slot, 8);
                    if t == T_CLASS {
                        // Counted once every class is known (`name_classes`); a class's
                        // bytes are its slot alone.
                        self.class_slots.push(ClassSlot {
                            address: page.start + (i * page.slot_size) as u64,
                            klass,
                            singleton: flags & self.l.fl_singleton != 0,
                            frozen: flags & FL_FREEZE != 0,
                            slot_bytes: page.slot_size as u64,
                        });
                        live.add(Tally {
                            objects: 1,
                            slot_bytes: page.slot_size as u64,
                            heap_bytes: 0,
                        });
                        continue;
                    }
                    let heap_bytes = self.heap_bytes(t, flags, klass, slot, page.slot_size);
                    let one = Tally {
                        objects: 1,
                        slot_bytes: page.slot_size as u64,
                        heap_bytes,
                    };
                    self.by_class.entry((klass, t)).or_default().add(one);
                    live.add(one);
                }
            }
        }
        self.census.total_slots += total;
        self.census.free_slots += free;
        if let Some(r) = self.ractor {
            let row = &mut self.census.ractors[r];
            row.total_slots += total;
            row.free_slots += free;
            row.objects += live.objects;
            row.slot_bytes += live.slot_bytes;
            row.heap_bytes = row.heap_bytes.saturating_add(live.heap_bytes);
        }
    }

    /// Whether slot `i` of `page` is marked: its bit in the page's mark bitmap is its index
    /// (4.1) or its address within the page's aligned block over the base slot size.
    fn marked(&self, page: &Page, i: usize) -> bool {
        let bit = if self.h.bitmap_by_index {
            i
        } else {
            let addr = page.start + (i * page.slot_size) as u64;
            (addr & (self.h.page_align as u64 - 1)) as usize / self.h.base_slot_size
        };
        page.marks
            .get(bit / 64)
            .is_some_and(|w| w & (1 << (bit % 64)) != 0)
    }

    /// The bytes an object of type `t` holds outside its slot, as `ObjectSpace.memsize_of`
    /// counts them, for the types it can tell from the slot (and, for a hash whose table is
    /// outside it, from the table, read later: `read_tables`).
    fn heap_bytes(&mut self, t: u8, flags: u64, klass: u64, slot: &[u8], slot_size: usize) -> u64 {
        let (l, h) = (self.l, self.h);
        match t {
            T_STRING
                if flags & l.rstring_noembed != 0 && flags & (h.str_shared | h.str_nofree) == 0 =>
            {
                word(slot, h.rstring_capa).saturating_add(1)
            }
            T_ARRAY if flags & (l.rarray_embed_flag | h.ary_shared) == 0 => {
                let words = if flags & h.ary_shared_root != 0 {
                    word(slot, l.rarray_heap_len)
                } else {
                    word(slot, h.rarray_capa)
                };
                words.saturating_mul(8)
            }
            T_HASH => match (h.hash_st_inline, h.hash_st_ptr) {
                (Some(at), _)
                    if flags & h.hash_st_flag != 0 && at + h.st_table_size <= slot_size =>
                {
                    match self.st_bytes(&slot[at..at + h.st_table_size]) {
                        Some(bytes) => bytes - h.st_table_size as u64,
                        None => {
                            self.census.unreadable_tables += 1;
                            0
                        }
                    }
                }
                (_, Some(at)) => {
                    let table = word(slot, at);
                    if flags & h.hash_st_flag != 0 && table != 0 {
                        self.tables.push((klass, T_HASH, table));
                    } else if table != 0 {
                        return h.ar_table_size.unwrap_or(0) as u64;
                    }
                    0
                }
                _ => 0,
            },
            T_IMEMO => match h.fields {
                // A fields object (the master of 2026-08) whose ivars are a table
                // embedded in its slot: the table's bytes beyond its header.
                Some(f)
                    if (flags >> f.type_shift) & f.type_mask == f.imemo_type
                        && (flags >> f.id_shift) & f.complex_flag != 0
                        && f.table + h.st_table_size <= slot_size =>
                {
                    match self.st_bytes(&slot[f.table..f.table + h.st_table_size]) {
                        Some(bytes) => bytes - h.st_table_size as u64,
                        None => {
                            self.census.unreadable_tables += 1;
                            0
                        }
                    }
                }
                _ => 0,
            },
            T_OBJECT => match (h.robject_heap, &h.shapes) {
                (Some((embed, numiv)), _) if flags & embed == 0 => {
                    u64::from(crate::memory::word32(slot, numiv)) * 8
                }
                (_, Some(s)) => {
                    match Ivars::of(s, flags, slot) {
                        Ivars::Shape(id) => *self.shaped.entry((klass, id)).or_default() += 1,
                        Ivars::Table(table) if table != 0 => {
                            self.tables.push((klass, T_OBJECT, table))
                        }
                        _ => {}
                    }
                    0
                }
                _ => 0,
            },
            _ => 0,
        }
    }

    /// `st_memsize` of the st_table whose header is `table`: the header, its `2^entry_power`
    /// entries and, when it has bins (its `bins` pointer is set, or on 4.1 its entry power
    /// is above `st_bins_above_power`), `2^(entry_power+1)` bins of 1, 2, 4 or 8 bytes each
    /// as their number needs (st.c's `features`). None for a table of more than
    /// `2^MAX_ENTRY_POWER` entries: not a table (read while freed, or garbage).
    pub(super) fn st_bytes(&self, table: &[u8]) -> Option<u64> {
        let entry_power = table[self.h.st_entry_power];
        if entry_power > MAX_ENTRY_POWER {
            return None;
        }
        let p = u32::from(entry_power);
        let entries = (1u64 << p) * self.l.st_table_entry_size as u64;
        let has_bins = match self.h.st_bins {
            Some(at) => word(table, at) != 0,
            None => entry_power > self.h.st_bins_above_power,
        };
        let bins = if has_bins {
            let bin_power = p + 1;
            let bin_bytes = match bin_power {
                0..=8 => 1,
                9..=16 => 2,
                17..=32 => 4,
                _ => 8,
            };
            ((1u64 << bin_power) * bin_bytes).div_ceil(8) * 8
        } else {
            0
        };
        Some(self.h.st_table_size as u64 + entries + bins)
    }

    /// Reads the st_tables of hashes whose table is outside the slot (before 3.3) and of
    /// too-complex objects' ivars, many per call, and adds each table's bytes to its
    /// object's class.
    fn read_tables<M: Memory>(&mut self, mem: &M) {
        let len = self.h.st_table_size;
        let tables = std::mem::take(&mut self.tables);
        for chunk in tables.chunks(1024) {
            let headers = mem.read_blocks(chunk.iter().map(|(_, _, table)| (*table, len)));
            self.census.bytes_read += (chunk.len() * len) as u64;
            for ((klass, t, _), header) in chunk.iter().zip(&headers) {
                let Some(bytes) = header.as_deref().and_then(|h| self.st_bytes(h)) else {
                    self.census.unreadable_tables += 1;
                    continue;
                };
                let tally = self.by_class.entry((*klass, *t)).or_default();
                tally.heap_bytes = tally.heap_bytes.saturating_add(bytes);
            }
        }
    }
}
