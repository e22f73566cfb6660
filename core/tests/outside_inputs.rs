//! Replays every input the fuzz targets (fuzz/, run by bench/fuzz) were seeded with or found
//! a crash with through the readers of `rbspy_ext_core::outside`: each must return, whatever
//! the bytes. A crash's input goes into `tests/outside_inputs/<target>/` once fixed, so that
//! it stays fixed without a fuzzing run.
use rbspy_ext_core::outside::TARGETS;
use std::path::Path;

/// The files of `dir` (none when it does not exist).
fn inputs(dir: &Path) -> Vec<std::path::PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<_> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

#[test]
fn every_seed_and_every_crash_found_reads_without_a_panic() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut replayed = 0;
    for (name, read) in TARGETS {
        let dirs = [
            root.join("tests/outside_inputs").join(name),
            root.join("../fuzz/seeds").join(name),
        ];
        for file in dirs.iter().flat_map(|d| inputs(d)) {
            let bytes = std::fs::read(&file).expect("readable input");
            read(&bytes);
            // Every prefix too: a file cut short is the commonest bad input of all.
            for cut in (0..bytes.len()).step_by(bytes.len().div_ceil(64).max(1)) {
                read(&bytes[..cut]);
            }
            replayed += 1;
        }
    }
    // The committed seeds alone: request heads and a live set.
    assert!(replayed >= 6, "only {replayed} inputs found");
}

#[test]
fn every_target_survives_empty_and_random_bytes() {
    // A fixed generator (xorshift), so a failure repeats.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for (_, read) in TARGETS {
        read(&[]);
        for len in [1usize, 7, 64, 1000, 5000] {
            let bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            read(&bytes);
        }
    }
}
