//! Unit tests of objects.rs: the class names' cache.
use super::{ClassNames, Named};
use std::cell::Cell;
use std::sync::Arc;

#[test]
fn a_name_found_is_kept_and_no_name_is_read_again_once_forgotten() {
    let mut classes = ClassNames::default();
    classes.forget_stale(0); // as a census does before its first pass
    let reads = Cell::new(0);
    let read = |answer: Option<&str>| {
        reads.set(reads.get() + 1);
        answer.map(Arc::from)
    };
    let found = Named::lookup(&mut classes.names, 0x10, || read(Some("Keeper")));
    assert_eq!(found.as_deref(), Some("Keeper"));
    // A torn read at first (a compaction moving the class): no name, for now.
    assert_eq!(Named::lookup(&mut classes.names, 0x20, || read(None)), None);
    assert_eq!(
        Named::lookup(&mut classes.names, 0x20, || read(Some("Late"))),
        None
    );
    assert_eq!(reads.get(), 2, "no name is remembered for UNNAMED_TTL");
    classes.forget_stale(0);
    let late = Named::lookup(&mut classes.names, 0x20, || read(Some("Late")));
    assert_eq!(late.as_deref(), Some("Late"));
    let kept = Named::lookup(&mut classes.names, 0x10, || read(None));
    assert_eq!(
        kept.as_deref(),
        Some("Keeper"),
        "a name found survives forget_stale without a compaction"
    );
    assert_eq!(reads.get(), 3);
    classes.forget_stale(0);
    assert_eq!(
        Named::lookup(&mut classes.names, 0x10, || read(None)).as_deref(),
        Some("Keeper")
    );
    // A compaction since: Keeper may have moved away and another class in.
    classes.forget_stale(1);
    assert_eq!(
        Named::lookup(&mut classes.names, 0x10, || read(Some("Other"))).as_deref(),
        Some("Other")
    );
    assert_eq!(reads.get(), 4);
}
