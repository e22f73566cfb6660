//! The heap census: what fills a process's memory, read from outside. A census is the live
//! objects of one process by class and built-in type, the slots and pages they sit in, and
//! what could not be read: plain data (this file), so that it can be saved (JSON), read back
//! and compared (`Census::diff`). The rest of the wing, in the order a census runs:
//!
//! - `walk.rs`: [`take`] reads the target's heap through the view of the target the spy
//!   lends ([`crate::spy::TargetView`]) and counts what it finds;
//! - `heaps.rs`: the heaps to read: the VM's one, or every Ractor's where each owns one;
//! - `pages.rs`: the list of every heap page, and each page's header;
//! - `shapes.rs`: objects' ivars out of their slots, sized by their shapes (3.2+);
//! - `singletons.rs`: the classes Ruby hides from `ObjectSpace.each_object`;
//! - `render.rs`: a census as text, a diff as text, and pprof in Go's heap profile shape.
use serde::{Deserialize, Serialize};

mod allocated;
mod classes;
mod heaps;
mod pages;
pub mod render;
mod shapes;
mod singletons;
mod walk;
pub use allocated::AllocatedCounters;
pub use walk::{take, CensusOptions};

// The built-in types the census tells apart (enum ruby_value_type: the same on every Ruby).
const T_NONE: u8 = 0x00;
const T_OBJECT: u8 = 0x01;
const T_CLASS: u8 = 0x02;
const T_STRING: u8 = 0x05;
const T_ARRAY: u8 = 0x07;
const T_HASH: u8 = 0x08;
const T_IMEMO: u8 = 0x1a;
const T_NODE: u8 = 0x1b;
const T_ICLASS: u8 = 0x1c;
const T_ZOMBIE: u8 = 0x1d;
const T_MOVED: u8 = 0x1e;

/// The names of Ruby's built-in types (`enum ruby_value_type`, `flags & 0x1f`), as
/// `ObjectSpace.count_objects` spells them; bindings/generator/heap_probe.c checks the
/// numbering against each release's headers.
pub const TYPE_NAMES: [&str; 32] = [
    "T_NONE",
    "T_OBJECT",
    "T_CLASS",
    "T_MODULE",
    "T_FLOAT",
    "T_STRING",
    "T_REGEXP",
    "T_ARRAY",
    "T_HASH",
    "T_STRUCT",
    "T_BIGNUM",
    "T_FILE",
    "T_DATA",
    "T_MATCH",
    "T_COMPLEX",
    "T_RATIONAL",
    "T_0x10",
    "T_NIL",
    "T_TRUE",
    "T_FALSE",
    "T_SYMBOL",
    "T_FIXNUM",
    "T_UNDEF",
    "T_0x17",
    "T_0x18",
    "T_0x19",
    "T_IMEMO",
    "T_NODE",
    "T_ICLASS",
    "T_ZOMBIE",
    "T_MOVED",
    "T_0x1f",
];

/// What the census counts out of each object's slot, and what it does not: named in every
/// census (`Census::not_counted`), in docs/memory.md and in `rubyspy heap`'s output.
pub const NOT_COUNTED: &str = "bytes outside the slot are counted for strings, arrays, \
     hashes and objects' ivars; T_DATA, generic ivars (those of strings, arrays and other \
     non-T_OBJECT objects), regexps, bignums, classes and every C extension's own memory \
     count their slot only, and a UTF-16/32 string's terminator counts 1 byte, not 2 or 4";

/// One class (or, for what Ruby hides, one type alone) and its live objects.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClassRow {
    /// The path of the objects' class as their `Kernel#class` gives it (`Module#name`;
    /// "Class" for classes, a module's class for modules), `#<Class:0x...>` for an anonymous
    /// class, or "" for what `ObjectSpace.each_object` does not yield: objects with no class
    /// (hidden), iclasses, imemos and the metaclasses Ruby hides (walk.rs, singletons.rs).
    pub name: String,
    /// The built-in type of its objects (`T_OBJECT`, `T_STRING`, ...).
    #[serde(rename = "type")]
    pub type_name: String,
    pub objects: u64,
    /// Bytes of the slots the objects sit in.
    pub slot_bytes: u64,
    /// Bytes the objects hold outside their slots (see `NOT_COUNTED`).
    pub heap_bytes: u64,
}

impl ClassRow {
    /// Slot and outside bytes together: what `ObjectSpace.memsize_of` sums to (saturating:
    /// sizes read from a changing heap, or a file, can be anything).
    pub fn bytes(&self) -> u64 {
        self.slot_bytes.saturating_add(self.heap_bytes)
    }
}

/// A census of one process's object heap.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Census {
    pub pid: i32,
    pub ruby_version: String,
    /// When it was taken (milliseconds since the Unix epoch) and how long it took.
    pub taken_at_ms: u64,
    pub duration_us: u64,
    /// Live objects by class and type, most bytes first.
    pub classes: Vec<ClassRow>,
    /// Live objects by type alone (the sum over `classes`), most bytes first.
    pub types: Vec<ClassRow>,
    /// Heap pages read, and the slots in them: free (`T_NONE`), live, awaiting a finalizer
    /// (`T_ZOMBIE`), left behind by compaction (`T_MOVED`), and garbage an unfinished lazy
    /// sweep had not freed yet (unmarked, on a page not swept).
    pub pages: u64,
    pub total_slots: u64,
    pub free_slots: u64,
    pub live_slots: u64,
    pub zombie_slots: u64,
    pub moved_slots: u64,
    pub garbage_slots: u64,
    /// Bytes of every page's slots.
    pub heap_bytes_total: u64,
    /// Pages whose header or body did not read, or did not make sense (freed or changed
    /// while read): their objects are not counted. Tables (hashes', too-complex objects'
    /// ivars) and shapes that did not read or made no sense: their bytes outside the slot
    /// are not counted.
    pub unreadable_pages: u64,
    pub unreadable_tables: u64,
    /// Bytes read from the target, and whether the census stopped at the caller's
    /// `max_bytes` before the last page.
    pub bytes_read: u64,
    pub partial: bool,
    /// A lazy sweep was running when the census began.
    pub sweeping: bool,
    /// Passes discarded because a compaction (`GC.compact`, or auto-compaction) moved objects
    /// while they were read, and whether the pass kept still overlapped one: its counts may
    /// then include objects seen both before and after they moved, or miss some.
    #[serde(default)]
    pub compactions: u64,
    #[serde(default)]
    pub moving: bool,
    pub not_counted: String,
    /// Where each Ractor owns its heap (Ruby master of 2026-08 and later): every heap
    /// counted, with its Ractor, in the order the VM lists them (living Ractors, the main
    /// one first, then children being created, then terminated Ractors' heaps not yet
    /// absorbed). Empty where the VM has one heap.
    #[serde(default)]
    pub ractors: Vec<RactorHeap>,
    /// The set of heaps changed while the last pass read them (a Ractor started or ended
    /// through every pass): a heap may then be missing or counted twice.
    #[serde(default)]
    pub heaps_changed: bool,
    /// The page list the last pass read was caught while the GC freed pages, through every
    /// pass: pages at its end may have been missed (see walk.rs, `pass`).
    #[serde(default)]
    pub pages_changed: bool,
}

/// One Ractor's heap (its objspace) and what the census counted in it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RactorHeap {
    /// The Ractor's id (`Ractor#inspect`'s number; the main Ractor is 1) and name, where
    /// known: a child's heap is populated before the child has either, and a terminated
    /// Ractor's heap outlives the Ractor object.
    pub id: Option<u32>,
    pub name: Option<String>,
    /// "running" (a living Ractor's), "creating" (a child's, before it joins the VM) or
    /// "terminated" (awaiting absorption by a living heap).
    pub state: String,
    pub pages: u64,
    pub total_slots: u64,
    pub free_slots: u64,
    /// Live objects, and their slot and outside bytes (as `ClassRow`'s).
    pub objects: u64,
    pub slot_bytes: u64,
    pub heap_bytes: u64,
}

/// One class's change between two censuses (`Census::diff`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClassDelta {
    pub name: String,
    #[serde(rename = "type")]
    pub type_name: String,
    pub objects: i64,
    pub bytes: i64,
    /// The later census's figures.
    pub objects_now: u64,
    pub bytes_now: u64,
}

impl Census {
    /// The census as JSON (what `rubyspy heap --output` writes and `--diff` reads).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a census serialises")
    }

    /// A census saved by `to_json`; the error says what is wrong with it.
    pub fn from_json(json: &str) -> Result<Census, String> {
        serde_json::from_str(json).map_err(|e| format!("not a heap census saved as JSON: {e}"))
    }

    /// Every whole-number figure with its name as saved, for readers that show or hand over
    /// a census's figures without knowing each (the Ruby layer's `Census#to_h`).
    pub fn counts(&self) -> [(&'static str, u64); 15] {
        [
            ("pid", u64::try_from(self.pid).unwrap_or(0)),
            ("taken_at_ms", self.taken_at_ms),
            ("duration_us", self.duration_us),
            ("pages", self.pages),
            ("total_slots", self.total_slots),
            ("free_slots", self.free_slots),
            ("live_slots", self.live_slots),
            ("zombie_slots", self.zombie_slots),
            ("moved_slots", self.moved_slots),
            ("garbage_slots", self.garbage_slots),
            ("heap_bytes_total", self.heap_bytes_total),
            ("unreadable_pages", self.unreadable_pages),
            ("unreadable_tables", self.unreadable_tables),
            ("bytes_read", self.bytes_read),
            ("compactions", self.compactions),
        ]
    }

    /// Live objects in all.
    pub fn objects(&self) -> u64 {
        self.classes.iter().map(|c| c.objects).sum()
    }

    /// How each class changed since `earlier`: classes that grew first (most bytes), then
    /// those that shrank; unchanged classes are left out.
    pub fn diff(&self, earlier: &Census) -> Vec<ClassDelta> {
        use std::collections::HashMap;
        let key = |c: &ClassRow| (c.name.clone(), c.type_name.clone());
        let before: HashMap<_, &ClassRow> = earlier.classes.iter().map(|c| (key(c), c)).collect();
        let now: HashMap<_, &ClassRow> = self.classes.iter().map(|c| (key(c), c)).collect();
        let mut keys: Vec<_> = before.keys().chain(now.keys()).cloned().collect();
        keys.sort();
        keys.dedup();
        let mut deltas: Vec<ClassDelta> = keys
            .into_iter()
            .filter_map(|k| {
                let (b, n) = (before.get(&k), now.get(&k));
                let count = |r: Option<&&ClassRow>| r.map_or((0, 0), |r| (r.objects, r.bytes()));
                let ((ob, bb), (on, bn)) = (count(b), count(n));
                let delta = ClassDelta {
                    name: k.0,
                    type_name: k.1,
                    objects: change(ob, on),
                    bytes: change(bb, bn),
                    objects_now: on,
                    bytes_now: bn,
                };
                (delta.objects != 0 || delta.bytes != 0).then_some(delta)
            })
            .collect();
        deltas.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(b.objects.cmp(&a.objects)));
        deltas
    }
}

/// `now - before` as a signed count, clamped: a saved census (or one whose sizes saturated)
/// can hold any u64.
fn change(before: u64, now: u64) -> i64 {
    (i128::from(now) - i128::from(before)).clamp(i64::MIN.into(), i64::MAX.into()) as i64
}

#[cfg(test)]
mod tests;
