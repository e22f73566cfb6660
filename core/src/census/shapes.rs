//! Objects' ivars out of their slots from Ruby 3.2, for the heap census (walk.rs).
//! `ObjectSpace.memsize_of` adds, for an object whose ivars left its slot, its shape's
//! capacity in words, or, when its shape is too complex, the size of its ivars' st_table.
//! The census notes each such object's shape id as it reads the pages (`Ivars::of`), then
//! reads each distinct shape once (`capacities`): a heap of millions of objects has a few
//! thousand shapes at most.
use super::Census;
use crate::memory::{field, word, word32, Memory};
use crate::spy::TargetView;
use rbspy_ext_bindings::{ShapeList, Shapes};
use rustc_hash::FxHashMap;

/// The root shape's `parent_id`: `INVALID_SHAPE_ID`, all ones.
const INVALID_SHAPE_ID: u64 = 0xffff_ffff;
/// A capacity of more ivars than this (16 million in one object) is not a shape's.
const MAX_CAPACITY: u64 = 1 << 24;

/// Where an object's ivars are, as its flags and slot say.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Ivars {
    InSlot,
    /// In a buffer out of the slot, as many words as this shape id's capacity.
    Shape(u32),
    /// In the st_table at this address (a too-complex shape).
    Table(u64),
}

impl Ivars {
    /// As `rb_obj_memsize_of` decides: before 4.0 a too-complex shape first, then a buffer
    /// when `ROBJECT_EMBED` is clear; from 4.0 nothing unless `ROBJECT_HEAP` is set.
    pub(super) fn of(s: &Shapes, flags: u64, slot: &[u8]) -> Ivars {
        let id = (flags >> s.id_shift) & 0xffff_ffff;
        let complex = match (s.too_complex_id, s.too_complex_flag) {
            (Some(c), _) => id == c,
            (None, Some(f)) => id & f != 0,
            _ => false,
        };
        let (flag, set) = s.out_of_slot;
        let out = (flags & flag != 0) == set;
        match (complex, out) {
            (true, _) if s.too_complex_id.is_some() => Ivars::Table(word(slot, s.fields)),
            (_, false) => Ivars::InSlot,
            (true, true) => Ivars::Table(word(slot, s.fields)),
            (false, true) => Ivars::Shape(id as u32),
        }
    }
}

/// Where the target's shapes are: the shape list, and (4.0+) the embedded capacity of each
/// heap, by heap index - 1.
pub(super) struct ShapeSource {
    pub(super) list: u64,
    embedded: Vec<u64>,
}

/// An unsigned little-endian integer of 1, 2, 4 or 8 bytes (a shape's capacity is a
/// `uint32_t` on 3.x, an `attr_index_t` of 2 bytes on 4.0 and 1 on 4.1).
fn uint(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .rev()
        .fold(0u64, |acc, b| (acc << 8) | u64::from(*b))
}

/// The target's shape list (and 4.0's embedded capacities), or None where it cannot be found:
/// the census then says objects' ivars were not counted.
pub(super) fn shape_source<M: Memory>(
    t: &mut TargetView<'_, M>,
    s: &Shapes,
) -> Option<ShapeSource> {
    // The struct that holds the list, and where in it.
    let (holder, at) = match s.list {
        ShapeList::InVm(at) => (t.vm(), at),
        ShapeList::TreePointer {
            shape_list,
            root_shape,
            next_shape_id,
            parent_id,
        } => {
            let tree = (shape_list, root_shape, next_shape_id, parent_id);
            let scan = |t: &TargetView<'_, M>| scan_for_shape_tree(t, tree);
            let pointer = t.shape_tree_or_scan(scan)?;
            (t.mem().read_u64(pointer).ok()?, shape_list)
        }
        ShapeList::Tree { shape_list } => (t.shape_tree()?, shape_list),
    };
    let list = t.mem().read_u64(field(holder, at)).ok()?;
    if list == 0 {
        return None;
    }
    let embedded = match (s.capacities, s.heap_index) {
        (Some((at, inline)), Some((mask, shift))) => {
            let tree = t.shape_tree()?;
            let mem = t.mem();
            let array = if inline {
                field(tree, at)
            } else {
                mem.read_u64(field(tree, at)).ok()?
            };
            // One read per entry: 4.0's array has only its heaps' entries (and a 0),
            // fewer than the id's bits could name, and may end where memory does.
            let (heaps, width) = ((mask >> shift) as usize, s.capacity_width);
            let entries = (0..heaps).map(|i| (field(array, i * width), width));
            let read = mem.read_blocks(entries);
            read.iter().map(|b| b.as_deref().map_or(0, uint)).collect()
        }
        _ => Vec::new(),
    };
    Some(ShapeSource { list, embedded })
}

/// The address of libruby's `rb_shape_tree_ptr` where its symbol is not exported (Debian's
/// 3.3 and 3.4): the word of libruby's data that points to a tree whose `shape_list` and
/// `root_shape` are one pointer and whose `next_shape_id` is above 0, to a shape whose parent
/// is `INVALID_SHAPE_ID` (the root: shape 0, allocated first). `tree` is the offsets of those
/// three fields in the tree, and of the parent in a shape.
pub(super) fn scan_for_shape_tree<M: Memory>(
    t: &TargetView<'_, M>,
    tree: (usize, usize, usize, usize),
) -> Option<u64> {
    let (shape_list, root_shape, next_shape_id, parent_id) = tree;
    let heap = t.heap();
    let in_heap = |p: u64| heap.is_empty() || heap.iter().any(|(s, e)| (*s..*e).contains(&p));
    let head_len = shape_list.max(root_shape).max(next_shape_id + 4) + 8;
    let mem = t.mem();
    t.scan_writable(
        8,
        head_len,
        |bytes| {
            Some(word(bytes, 0))
                .filter(|p| *p != 0 && in_heap(*p))
                .map(|p| (p, ()))
        },
        |_, head| {
            let list = word(head, shape_list);
            list != 0
                && list == word(head, root_shape)
                && word32(head, next_shape_id) > 0
                && mem
                    .read_vec(field(list, parent_id), 4)
                    .is_ok_and(|b| uint(&b) == INVALID_SHAPE_ID)
        },
    )
    .map(|(at, ())| at)
}

impl ShapeSource {
    /// The capacity of each of the shapes `ids`, in ivars: each distinct shape read once,
    /// many per call. What it reads and what does not read as a shape go into `census`.
    pub(super) fn capacities<M: Memory>(
        &self,
        mem: &M,
        s: &Shapes,
        mut ids: Vec<u32>,
        census: &mut Census,
    ) -> FxHashMap<u32, u64> {
        let source = self;
        ids.sort_unstable();
        ids.dedup();
        let mut capacities: FxHashMap<u32, u64> = FxHashMap::default();
        for chunk in ids.chunks(1024) {
            let at = |id: u32| {
                let index = s.index_mask.map_or(u64::from(id), |m| u64::from(id) & m);
                field(source.list, index as usize * s.shape_size + s.capacity)
            };
            let read = mem.read_blocks(chunk.iter().map(|id| (at(*id), s.capacity_width)));
            census.bytes_read += (chunk.len() * s.capacity_width) as u64;
            for (id, buf) in chunk.iter().zip(&read) {
                let Some(buf) = buf else {
                    census.unreadable_tables += 1;
                    continue;
                };
                let embedded = s.heap_index.map_or(0, |(mask, shift)| {
                    let heap = (u64::from(*id) & mask) >> shift;
                    (heap as usize)
                        .checked_sub(1)
                        .and_then(|i| source.embedded.get(i).copied())
                        .unwrap_or(0)
                });
                let capacity = uint(buf).max(embedded);
                if capacity > MAX_CAPACITY {
                    census.unreadable_tables += 1; // not a shape: garbage id
                    continue;
                }
                capacities.insert(*id, capacity);
            }
        }
        capacities
    }
}
