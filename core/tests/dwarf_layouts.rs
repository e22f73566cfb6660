//! Layouts read from the debug information of the Rubies built from source here
//! (script/rubies: `$RBSPY_EXT_CACHE/srcrubies/NAME`, `~/.cache/rbspy_ext` by default), against
//! the table's layout of the same release, field by field. A Ruby built with flags that
//! move its structs (`source-unknown`, e.g. VM_DEBUG_BP_CHECK) must differ exactly where
//! it does.

use rbspy_ext_core::dwarf;
use std::path::{Path, PathBuf};

/// (name, version, binary) of every complete source build.
fn source_rubies() -> Vec<(String, String, PathBuf)> {
    let cache = std::env::var_os("RBSPY_EXT_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/rbspy_ext")
        });
    let dir = cache.join("srcrubies");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let marker = entry.path().join(".rbspy_ext-complete");
        let Ok(text) = std::fs::read_to_string(&marker) else {
            continue;
        };
        let mut words = text.split_whitespace();
        let (Some(version), Some(bin)) = (words.next(), words.next()) else {
            continue;
        };
        out.push((
            entry.file_name().to_string_lossy().into_owned(),
            version.to_string(),
            PathBuf::from(bin),
        ));
    }
    out.sort();
    out
}

#[test]
fn debug_info_layouts_agree_with_the_table() {
    let rubies = source_rubies();
    if rubies.is_empty() {
        eprintln!("no Ruby built from source here (script/rubies build): nothing to compare");
        return;
    }
    for (name, version, bin) in rubies {
        std::env::set_var("RUBYSPY_LAYOUT_CACHE", "0");
        let t = std::time::Instant::now();
        let got = dwarf::layout_for(&bin, &bin.display().to_string(), Path::new("/"), &version)
            .unwrap_or_else(|e| panic!("{name}: {e:?}"))
            .unwrap_or_else(|| panic!("{name}: no debug info in {}", bin.display()));
        let table = rbspy_ext_bindings::layout_for_version(&version).expect("a table layout");
        let differ = dwarf::differences(got.layout, table);
        eprintln!(
            "{name} {version}: read in {:?}; differs: {differ:?}",
            t.elapsed()
        );
        for f in &differ {
            let v = |l: &rbspy_ext_bindings::Layout| {
                l.fields().into_iter().find(|(n, _)| n == f).unwrap().1
            };
            eprintln!("  {f}: dwarf {} table {}", v(got.layout), v(table));
        }
        // The heap census's layout: VM_DEBUG_BP_CHECK moves no gc.c struct, so every build's
        // equals its series' measured one.
        let heap = got.heap.clone().expect("a series with a heap layout");
        let (_, heap_differs) = heap.unwrap_or_else(|why| panic!("{name}: heap: {why}"));
        assert!(
            heap_differs.is_empty(),
            "{name}: heap differs in {heap_differs:?}"
        );
        match build_kind(&name) {
            Some((kind, _)) if kind == "source" => assert!(differ.is_empty(), "{name}: {differ:?}"),
            Some((_, conf)) if conf.contains("VM_DEBUG_BP_CHECK") => {
                assert_eq!(differ, ["cfp_size"], "{name}")
            }
            _ => {}
        }
    }
}

/// (KIND, configure arguments) of source build `name`, from script/lib/source-rubies.sh.
fn build_kind(name: &str) -> Option<(String, String)> {
    let table = include_str!("../../script/lib/source-rubies.sh");
    table.lines().find_map(|l| {
        let fields: Vec<&str> = l.trim().trim_matches('"').split('|').collect();
        (fields.len() == 4 && fields[0] == name)
            .then(|| (fields[1].to_string(), fields[3].to_string()))
    })
}
