//! Which classes Ruby hides from `ObjectSpace.each_object`, so that the census's "Class" row
//! counts what the target's own `each_object` yields and the rest gets a row of its own.
//!
//! gc.c's `internal_object_p` hides a T_CLASS with no class (`klass` 0), from 4.0 the VM's
//! `RubyVM::FrozenCore` (an iclass before, hidden as one), and a singleton class
//! whose object is a class (a metaclass: `__attached__` is a T_CLASS) unless it has a
//! metaclass of its own (`rb_singleton_class_internal_p`); the singleton class of any other
//! object (a module's, a string's) is yielded, as a Class. Reading each singleton's
//! `__attached__` would take an ivar lookup per class (an st_table keyed by ID before 3.2, a
//! shape walk on 3.2, a field from 3.3); the census answers both questions from the class
//! and superclass pointers instead, by how class.c links them:
//!
//! - Every T_CLASS's `klass` is `Class` (a class made without a metaclass) or a metaclass
//!   (`make_metaclass` and `make_singleton_class` only ever point a class at one), and a
//!   class's metaclass is its `klass`. So a singleton class is a metaclass exactly when some
//!   T_CLASS points at it.
//! - A metaclass `S` points at its own metaclass once it has one; until then at the
//!   metaclass of some other class (`ENSURE_EIGENCLASS(tmp)` in `make_metaclass`). The
//!   superclass of `S`'s own metaclass is the metaclass of `S`'s superclass, which is that
//!   superclass's `klass` (`make_metaclass` ensures it); the superclass of another class's
//!   metaclass is the metaclass of that class's superclass, never `S`'s superclass's (they
//!   are in different towers of metaclasses). Superclasses skip iclasses, as class.c does.
use rustc_hash::{FxHashMap, FxHashSet};

/// A T_CLASS slot as the census read it.
#[derive(Debug, Clone, Copy)]
pub(super) struct ClassSlot {
    pub address: u64,
    pub klass: u64,
    /// `FL_SINGLETON` is set in its flags.
    pub singleton: bool,
    /// `FL_FREEZE` is: few classes are frozen, RubyVM::FrozenCore is.
    pub frozen: bool,
    pub slot_bytes: u64,
}

/// The path of the class 4.0's gc.c hides by its address (`rb_mRubyVMFrozenCore`).
pub(super) const FROZEN_CORE: &str = "RubyVM::FrozenCore";

/// The addresses of the classes `ObjectSpace.each_object` does not yield (see the module
/// docs); `superclass` is a class's superclass past any iclass (None when it does not
/// read), `frozen_core` whether a frozen class is named `FROZEN_CORE`.
pub(super) fn hidden(
    classes: &[ClassSlot],
    mut superclass: impl FnMut(u64) -> Option<u64>,
    mut frozen_core: impl FnMut(u64) -> bool,
) -> FxHashSet<u64> {
    let klass_of: FxHashMap<u64, u64> = classes.iter().map(|c| (c.address, c.klass)).collect();
    let pointed: FxHashSet<u64> = classes.iter().map(|c| c.klass).collect();
    let mut supers: FxHashMap<u64, Option<u64>> = FxHashMap::default();
    let mut superclass = |class: u64| *supers.entry(class).or_insert_with(|| superclass(class));
    let mut has_metaclass = |c: &ClassSlot| {
        c.klass != c.address
            && superclass(c.address)
                .and_then(|s| klass_of.get(&s))
                .is_some_and(|meta| superclass(c.klass) == Some(*meta))
    };
    classes
        .iter()
        .filter(|c| {
            c.klass == 0
                || (c.singleton && pointed.contains(&c.address) && !has_metaclass(c))
                || (!c.singleton && c.frozen && frozen_core(c.address))
        })
        .map(|c| c.address)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(address: u64, klass: u64, singleton: bool) -> ClassSlot {
        ClassSlot {
            address,
            klass,
            singleton,
            frozen: false,
            slot_bytes: 40,
        }
    }

    /// A heap of BasicObject (1) < Object (2) < Module (3) < Class (4), a class Foo (5), an
    /// object's singleton class SX (6, a Foo's) and its metaclass (7), each class with its
    /// metaclass (1x), Class's chain ending in #<Class:#<Class:Class>> (44, its own class),
    /// and Foo's metaclass with one of its own (55).
    #[test]
    fn metaclasses_are_hidden_unless_they_have_a_metaclass_of_their_own() {
        let classes = [
            class(1, 11, false),
            class(2, 22, false),
            class(3, 33, false),
            class(4, 41, false),
            class(5, 51, false),
            class(6, 7, true),   // SX, with its metaclass
            class(7, 55, true),  // #<Class:SX>, pointing at #<Class:#<Class:Foo>>
            class(11, 41, true), // #<Class:BasicObject>
            class(22, 41, true),
            class(33, 41, true),
            class(41, 44, true), // #<Class:Class>, with its own metaclass
            class(44, 44, true), // #<Class:#<Class:Class>>, the chain's end
            class(51, 55, true), // #<Class:Foo>, with its own metaclass
            class(55, 44, true), // #<Class:#<Class:Foo>>, without
        ];
        let supers: FxHashMap<u64, u64> = [
            (2, 1),
            (3, 2),
            (4, 3),
            (5, 2),
            (6, 5),
            (7, 51),
            (11, 4),
            (22, 11),
            (33, 22),
            (41, 33),
            (44, 41),
            (51, 22),
            (55, 41),
        ]
        .into_iter()
        .collect();
        let mut hidden: Vec<u64> = hidden(&classes, |c| supers.get(&c).copied(), |_| false)
            .into_iter()
            .collect();
        hidden.sort();
        // SX is an object's (yielded); #<Class:SX> points at another tower (hidden).
        assert_eq!(hidden, [7, 11, 22, 33, 44, 55]);
    }
}
