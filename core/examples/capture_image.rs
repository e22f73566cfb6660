//! Writes a memory image of a live Ruby process, as a seed for the `memory_image` fuzz target
//! (bench/fuzz runs it on a Ruby of each version this machine has), or with `--census` for
//! the `heap_image` target (what a census of its heap read too):
//!
//!     cargo run --release --example capture_image -- [--census] PID OUT
fn main() {
    let mut args: Vec<String> = std::env::args().collect();
    let census = args.iter().any(|a| a == "--census");
    args.retain(|a| a != "--census");
    let (Some(pid), Some(out)) = (args.get(1).and_then(|p| p.parse().ok()), args.get(2)) else {
        eprintln!("usage: capture_image [--census] PID OUT");
        std::process::exit(2);
    };
    match rbspy_ext_core::image::capture(pid, census) {
        Ok(bytes) => {
            if let Err(e) = std::fs::write(out, &bytes) {
                eprintln!("capture_image: cannot write {out}: {e}");
                std::process::exit(1);
            }
        }
        Err(e) => {
            eprintln!("capture_image: {e}");
            std::process::exit(1);
        }
    }
}
