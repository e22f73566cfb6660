//! The narrow view of an attached target that a reader beside the stack walker (the heap
//! census, core/src/census/) reads through.
use super::attach::{memory_error, Check, Target};
use super::leaves::Attempt;
use super::thread_list::read_ractors;
use crate::error::{Error, MemoryError, Result};
use crate::memory::Memory;
use crate::objects::{ClassNames, SymbolTable};
use rbspy_ext_bindings::Layout;

/// What a reader beside the stack walker (the heap census, core/src/census/) may use of an
/// attached target: its memory, layout and VM, the identity check, libruby's data to scan,
/// and the names of classes (through the spy's symbol table and class-name cache, shared
/// with the walker so that a census after a snapshot names classes without reading them
/// again). Lent by [`Spy::target_view`]; the walker's own state stays out of reach.
pub struct TargetView<'a, M: Memory> {
    pub(super) target: &'a mut Target<M>,
    pub(super) symbols: &'a mut Option<SymbolTable>,
    pub(super) classes: &'a mut ClassNames,
}

/// A Ractor along the VM's list, for the census (`TargetView::ractors`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RactorRef {
    /// Its `rb_ractor_t`.
    pub address: u64,
    pub id: u32,
    pub name: Option<String>,
    /// Its `rb_objspace` (`r->objspace`) where each Ractor owns its heap, else the VM's; 0
    /// while a Ractor still shares its parent's.
    pub objspace: u64,
}

impl<M: Memory> TargetView<'_, M> {
    pub fn pid(&self) -> i32 {
        self.target.pid
    }

    pub fn version(&self) -> &str {
        &self.target.version
    }

    pub fn mem(&self) -> &M {
        &self.target.mem
    }

    pub fn layout(&self) -> &'static Layout {
        self.target.layout
    }

    /// The heap layout the target's own debug information gave, if it did.
    pub fn debug_heap_layout(&self) -> Option<&'static rbspy_ext_bindings::HeapLayout> {
        super::layouts::debug_heap(&self.target.layout_source)
    }

    /// The address of the target's `rb_vm_t`.
    pub fn vm(&self) -> u64 {
        self.target.vm
    }

    /// The mappings Ruby objects lived in at attach (empty for a memory image).
    pub fn heap(&self) -> &[(u64, u64)] {
        &self.target.heap
    }

    /// A failed read while `context`, as the error a caller reports.
    pub fn memory_error(&self, context: &'static str, e: MemoryError) -> Error {
        memory_error(self.target.pid, context, e)
    }

    /// Err when the process is gone or the pid holds another (checked now).
    pub fn check_identity(&mut self) -> Result<()> {
        self.target.check_identity(Check::Now)
    }

    /// The permanent name of `class`, from the spy's cache (found with the symbol table,
    /// which is found first if needed); None when it has none or it does not read.
    pub fn class_name(&mut self, class: u64) -> Option<std::sync::Arc<str>> {
        let symbols = self.target.symbol_table(self.symbols).ok()?;
        let (mem, layout) = (&self.target.mem, self.target.layout);
        self.classes.class_name(mem, layout, symbols, class)
    }

    /// See `ClassNames::forget_stale`.
    pub fn forget_stale_class_names(&mut self, compactions: u64) {
        self.classes.forget_stale(compactions);
    }

    /// The address of the shape tree's global (`rb_shape_tree` from 4.0, 3.3's and 3.4's
    /// `rb_shape_tree_ptr`) as the binary names it, or as `shape_tree_or_scan` found it.
    pub fn shape_tree(&self) -> Option<u64> {
        self.target.shape_tree
    }

    /// `shape_tree`, or where the binary does not name it what `scan` finds; the scan runs
    /// at most once per attach (it reads libruby's data).
    pub fn shape_tree_or_scan(&mut self, scan: impl FnOnce(&Self) -> Option<u64>) -> Option<u64> {
        if self.target.shape_tree.is_none() && !self.target.shape_tree_scanned {
            self.target.shape_tree_scanned = true;
            self.target.shape_tree = scan(self);
        }
        self.target.shape_tree
    }

    /// See `Target::scan_writable`: a scan of libruby's writable data for the one word that
    /// points to a struct `confirms` accepts.
    pub fn scan_writable<C>(
        &self,
        window: usize,
        head_len: usize,
        pick: impl Fn(&[u8]) -> Option<(u64, C)>,
        confirms: impl Fn(&C, &[u8]) -> bool,
    ) -> Option<(u64, C)> {
        self.target.scan_writable(window, head_len, pick, confirms)
    }

    /// Every Ractor along `vm->ractor.set` (the stack walker's own walk of it); Ok(None)
    /// when the list changed while it was read (read it again).
    pub fn ractors(&self) -> Result<Option<Vec<RactorRef>>> {
        let threads = self.target.layout.ractor_threads_set.unwrap_or(0) as u64;
        match read_ractors(self.target) {
            // The walk keeps each Ractor's thread list head, `threads` bytes into it.
            Ok(list) => Ok(Some(
                list.into_iter()
                    .map(|r| RactorRef {
                        address: r.threads.wrapping_sub(threads),
                        id: r.id,
                        name: r.name,
                        objspace: r.objspace,
                    })
                    .collect(),
            )),
            Err(Attempt::Changed(_)) => Ok(None),
            Err(Attempt::Fatal(e)) => Err(e),
        }
    }
}
