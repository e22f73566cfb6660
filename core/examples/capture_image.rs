//! Writes a memory image of a live Ruby process, as a seed for the `memory_image` fuzz target
//! (bench/fuzz runs it on a Ruby of each version this machine has):
//!
//!     cargo run --release --example capture_image -- PID OUT
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(pid), Some(out)) = (args.get(1).and_then(|p| p.parse().ok()), args.get(2)) else {
        eprintln!("usage: capture_image PID OUT");
        std::process::exit(2);
    };
    match rbspy_ext_core::image::capture(pid) {
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
