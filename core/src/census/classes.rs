//! A class's chain as Ruby walks it, for naming the census's rows: the class an object's
//! `Kernel#class` gives past singleton classes and iclasses, and a superclass past iclasses.
use crate::memory::{field, Memory};
use crate::spy::TargetView;
use rbspy_ext_bindings::HeapLayout;

use super::T_ICLASS;

/// The name `Object#class.name` gives an object whose class pointer is `klass`: a
/// singleton class stands for the first superclass that is not one (nor an iclass);
/// `#<Class:0x...>` when that class is anonymous.
pub(super) fn class_path<M: Memory>(
    t: &mut TargetView<'_, M>,
    h: &HeapLayout,
    klass: u64,
) -> String {
    let l = t.layout();
    let mut class = klass;
    // rb_class_real has no bound; a singleton extended by a thousand modules is absurd.
    for _ in 0..1024 {
        let flags = t.mem().read_u64(field(class, l.rbasic_flags)).unwrap_or(0);
        let iclass = flags & 0x1f == u64::from(T_ICLASS);
        if flags & l.fl_singleton == 0 && !iclass {
            break;
        }
        match superclass(t, h, class) {
            // A class its own superclass (or the start's) is a loop, read while it changed.
            Some(s) if s != 0 && s != class && s != klass => class = s,
            _ => break,
        }
    }
    t.class_name(class)
        .map_or_else(|| format!("#<Class:0x{class:016x}>"), |n| n.to_string())
}

/// The superclass of `class` past any iclass (an included or prepended module's, or a
/// prepended class's origin), as class.c's `make_metaclass` takes it.
pub(super) fn real_superclass<M: Memory>(
    t: &TargetView<'_, M>,
    h: &HeapLayout,
    class: u64,
) -> Option<u64> {
    let (l, mem) = (t.layout(), t.mem());
    let mut class = superclass(t, h, class)?;
    // A chain of iclasses is as long as the modules included; a thousand is absurd.
    for _ in 0..1024 {
        let flags = mem.read_u64(field(class, l.rbasic_flags)).ok()?;
        if class == 0 || flags & 0x1f != u64::from(T_ICLASS) {
            return Some(class);
        }
        let next = superclass(t, h, class)?;
        if next == class {
            return None; // a loop, read while it changed
        }
        class = next;
    }
    None
}

/// `RCLASS_SUPER(class)`.
fn superclass<M: Memory>(t: &TargetView<'_, M>, h: &HeapLayout, class: u64) -> Option<u64> {
    let (l, mem) = (t.layout(), t.mem());
    let addr = match (h.class_super, h.class_super_in_ext) {
        (Some(o), _) => field(class, o),
        (None, Some(o)) => {
            let ext = match (l.rclass_ext_inline, l.rclass_ext_ptr) {
                (Some(inline), _) => field(class, inline),
                (None, Some(ptr)) => mem.read_u64(field(class, ptr)).ok()?,
                _ => return None,
            };
            field(ext, o)
        }
        _ => return None,
    };
    mem.read_u64(addr).ok()
}
