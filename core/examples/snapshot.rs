//! `cargo run --example snapshot -- PID [COUNT]`: prints a process's stack, then (with COUNT)
//! takes COUNT warm snapshots and reports the mean time and `process_vm_readv` calls each.
use rbspy_ext_core::Spy;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let pid: i32 = args
        .get(1)
        .and_then(|p| p.parse().ok())
        .expect("usage: snapshot PID [COUNT]");
    let count: u32 = args.get(2).and_then(|c| c.parse().ok()).unwrap_or(0);
    let started = Instant::now();
    let mut spy = match Spy::attach(pid) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let frames = spy.snapshot().unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(1)
    });
    let cold = started.elapsed();
    for f in &frames {
        let c = if f.c_function { " [c]" } else { "" };
        println!("{}:{}:in '{}'{c}", f.path, f.lineno, f.label);
    }
    println!(
        "# {} frames, cold {:?}, Ruby {}",
        frames.len(),
        cold,
        spy.version()
    );
    if count > 0 {
        let calls_before = spy.memory().calls();
        let t = Instant::now();
        for _ in 0..count {
            spy.snapshot().expect("warm snapshot");
        }
        let per = t.elapsed() / count;
        let calls = (spy.memory().calls() - calls_before) as f64 / count as f64;
        println!("# warm: {per:?} per snapshot, {calls:.2} process_vm_readv calls each");
    }
}
