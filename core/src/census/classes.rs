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
    let mut guard = LoopGuard::new(klass);
    // rb_class_real has no bound; a singleton extended by a thousand modules is absurd.
    for _ in 0..1024 {
        let flags = t.mem().read_u64(field(class, l.rbasic_flags)).unwrap_or(0);
        let iclass = flags & 0x1f == u64::from(T_ICLASS);
        if flags & l.fl_singleton == 0 && !iclass {
            break;
        }
        match superclass(t, h, class) {
            Some(s) if s != 0 && !guard.seen(s) => class = s,
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
    let mut guard = LoopGuard::new(class);
    // A chain of iclasses is as long as the modules included; a thousand is absurd.
    for _ in 0..1024 {
        let flags = mem.read_u64(field(class, l.rbasic_flags)).ok()?;
        if class == 0 || flags & 0x1f != u64::from(T_ICLASS) {
            return Some(class);
        }
        let next = superclass(t, h, class)?;
        if guard.seen(next) {
            return None;
        }
        class = next;
    }
    None
}

/// A class chain read while it changed can loop (a class its own superclass, or a longer
/// round). Brent's cycle finding sees a loop within about twice the steps to it and round
/// it, so a loop costs a few reads, not the 1,024 steps each chain is bounded by.
struct LoopGuard {
    /// A class passed, moved forward each time `steps` reaches `power`.
    mark: u64,
    power: u32,
    steps: u32,
}

impl LoopGuard {
    fn new(start: u64) -> LoopGuard {
        LoopGuard {
            mark: start,
            power: 1,
            steps: 0,
        }
    }

    /// Whether `next`, the chain's next class, came round again.
    fn seen(&mut self, next: u64) -> bool {
        if next == self.mark {
            return true;
        }
        self.steps += 1;
        if self.steps == self.power {
            (self.mark, self.power, self.steps) = (next, self.power.saturating_mul(2), 0);
        }
        false
    }
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

#[cfg(test)]
mod tests {
    use super::LoopGuard;

    /// Every loop is seen, whatever its length and wherever it starts, within a few times
    /// the steps to it and round it; a chain without one never is.
    #[test]
    fn a_loop_is_seen_within_a_few_rounds_and_a_straight_chain_never() {
        for lead in 0..20u64 {
            for round in 1..50u64 {
                // Classes 0..lead lead into the loop lead..lead+round.
                let next = |c: u64| if c + 1 < lead + round { c + 1 } else { lead };
                let mut guard = LoopGuard::new(0);
                let mut class = 0;
                let steps = (1..)
                    .find(|_| {
                        class = next(class);
                        guard.seen(class)
                    })
                    .unwrap();
                assert!(steps <= 3 * (lead + round) + 2, "{lead} {round}: {steps}");
            }
        }
        let mut guard = LoopGuard::new(0);
        assert!((1..5000u64).all(|c| !guard.seen(c)));
    }
}
