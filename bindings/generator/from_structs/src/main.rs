//! Prints Ruby VM layouts (`struct Layout` of bindings/src/lib.rs) measured on the bindgen
//! output of the rbspy-ruby-structs crate, for releases whose source script/generate-bindings
//! does not have to run bindings/generator/layout_probe.c against (most patch releases).
//! The text is the probe's, field for field, so it can go where the probe's output goes.
//!
//!   cargo run --release -- 3.0.7 3.2.9 4.0.9     # one `Layout { ... }` per release
//!   cargo run --release -- --check 3.1.2         # compare with bindings/src/generated.rs
//!   cargo run --release -- --check               # ... every release generated.rs has
//!   cargo run --release -- --list                # releases known here
//!
//! Values the crate does not have for a release are copied from Ruby's sources and printed
//! after a `// from <source>` line; `--check` does not count them, except those the crate
//! has for no release at all (special constants, object types, RSymbol), which it compares
//! with the probe like measured ones.

mod check;
mod layout;
mod releases;

use std::path::PathBuf;
use std::process::ExitCode;

const USAGE: &str =
    "usage: layout_from_structs [--check] [--generated PATH] [--lib PATH] RELEASE...
       layout_from_structs --list
  RELEASE   a Ruby release such as 3.2.9 (2.7.0 to 4.0.9, as in rbspy-ruby-structs 0.55.0)
  --check   compare with the C-probe layouts of bindings/src/generated.rs instead of printing
            (all releases it has, if none are given); exits 1 on a mismatch
  --generated, --lib   other paths for bindings/src/generated.rs and bindings/src/lib.rs";

fn main() -> ExitCode {
    let bindings_src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../src");
    let mut generated_path = bindings_src.join("generated.rs");
    let mut lib_path = bindings_src.join("lib.rs");
    let mut check = false;
    let mut requested = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--check" => check = true,
            "--generated" => generated_path = args.next().expect(USAGE).into(),
            "--lib" => lib_path = args.next().expect(USAGE).into(),
            "--list" => {
                println!(
                    "{}",
                    releases::known_releases().collect::<Vec<_>>().join(" ")
                );
                return ExitCode::SUCCESS;
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            _ if arg.starts_with('-') => {
                eprintln!("unknown option {arg}\n{USAGE}");
                return ExitCode::from(2);
            }
            _ => requested.push(arg),
        }
    }

    if !check {
        if requested.is_empty() {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
        for release in &requested {
            let Some(layout) = releases::measure(release) else {
                eprintln!("{release}: not in rbspy-ruby-structs 0.55.0 (see --list)");
                return ExitCode::from(2);
            };
            let module = format!("ruby_{}", release.replace('.', "_"));
            println!("// {release} (rbspy_ruby_structs::{module})");
            print!("{layout}");
        }
        return ExitCode::SUCCESS;
    }

    let read = |path: &PathBuf| {
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    let generated = match check::parse_generated(&read(&generated_path)) {
        Ok(generated) => generated,
        Err(e) => {
            eprintln!("{}: {e}", generated_path.display());
            return ExitCode::from(2);
        }
    };
    if requested.is_empty() {
        requested = generated.versions.keys().cloned().collect();
        requested.sort();
    }
    let mut failed = false;
    let mut field_list_checked = false;
    for release in &requested {
        let Some(layout) = releases::measure(release) else {
            println!("{release}: not in rbspy-ruby-structs 0.55.0, not checked");
            continue;
        };
        if !field_list_checked {
            field_list_checked = true;
            match check::parse_layout_fields(&read(&lib_path)) {
                Ok(fields) => failed |= !check::check_field_list(&layout, &fields),
                Err(e) => {
                    eprintln!("{}: {e}", lib_path.display());
                    failed = true;
                }
            }
        }
        failed |= check::check_release(release, &layout, &generated) > 0;
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
