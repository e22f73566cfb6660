//! `cargo run --release --example record -- PID [RATE] [SECONDS]`: records a process with the
//! sampler alone (no Ruby involved) and prints what it cost: ticks, sampler CPU per tick,
//! `process_vm_readv` calls per tick. Handy under `perf record` to see where a tick goes.
//! With `RBSPY_BPF=1` it records with the BPF sampler (as root) and prints its kernel cost.
//!
//! `... --example record -- interrupt PID [RATE] [PAIRS]` (root): what a tick costs the code
//! it interrupts, apart from the program's own run time: a loop pinned to CPU 0, with and
//! without the BPF sampler loaded (for PID's layout) but filtering for a process that does
//! not exist, so every tick interrupts and runs a program that returns at once (bench/bpf.rb).
//!
//! `... --example record -- idle [RATE] [SECONDS]`: the same timer loop without sampling, to
//! show what merely waking up at that rate costs on this machine.
//!
//! `... --example record -- idle-timerfd [RATE] [SECONDS]`: the same, woken by a periodic timerfd
//! whose timer the kernel re-arms in its interrupt: shows whether the cost of a wake-up depends
//! on how the sleep is asked for (on the Firecracker VM this was measured on, it does not).
use rbspy_ext_core::cost::thread_cpu_ns;
use rbspy_ext_core::record::{RecordConfig, Recorder, Timer};
use std::time::{Duration, Instant};

/// Wakes up at `rate` for `seconds` (the same jittered timer as the sampler), doing nothing.
fn idle(rate: f64, seconds: f64) {
    let mut timer = Timer::new(rate, 0x9e37_79b9);
    let started = Instant::now();
    let cpu = thread_cpu_ns();
    let mut next = started;
    let mut wakes = 0u64;
    while started.elapsed().as_secs_f64() < seconds {
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        }
        next += timer.next_interval();
        wakes += 1;
    }
    println!(
        "{wakes} wake-ups, {:.2} us CPU per wake-up",
        (thread_cpu_ns() - cpu) as f64 / 1e3 / wakes as f64
    );
}

/// Wakes up at `rate` for `seconds` from a periodic timerfd (no jitter, no re-arming from
/// user space), doing nothing.
fn idle_timerfd(rate: f64, seconds: f64) {
    let interval_ns = (1e9 / rate) as i64;
    let period = libc::timespec {
        tv_sec: interval_ns / 1_000_000_000,
        tv_nsec: interval_ns % 1_000_000_000,
    };
    let spec = libc::itimerspec {
        it_interval: period,
        it_value: period,
    };
    // SAFETY: plain syscalls on a descriptor this function owns; `spec` and `expirations`
    // outlive the calls that read or write them.
    unsafe {
        let fd = libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_CLOEXEC);
        assert!(fd >= 0, "timerfd_create failed");
        libc::timerfd_settime(fd, 0, &spec, std::ptr::null_mut());
        let started = Instant::now();
        let cpu = thread_cpu_ns();
        let mut wakes = 0u64;
        let mut expirations = 0u64;
        while started.elapsed().as_secs_f64() < seconds {
            libc::read(fd, (&mut expirations as *mut u64).cast(), 8);
            wakes += 1;
        }
        libc::close(fd);
        println!(
            "{wakes} timerfd wake-ups, {:.2} us CPU per wake-up",
            (thread_cpu_ns() - cpu) as f64 / 1e3 / wakes as f64
        );
    }
}

/// Iterations per second of a loop that does nothing else, over `window`.
#[cfg(feature = "bpf")]
fn spin(window: Duration) -> f64 {
    let started = Instant::now();
    let mut n = 0u64;
    while started.elapsed() < window {
        for _ in 0..1000 {
            n = std::hint::black_box(n + 1);
        }
    }
    n as f64 / started.elapsed().as_secs_f64()
}

#[cfg(feature = "bpf")]
/// What one CPU-clock tick running the sampler's program, returning at once, costs the code
/// it interrupts: a loop pinned to CPU 0 runs windows without the program, with it (loaded
/// for a pid no process has, on the same events as a recording), and without again; the
/// median slowdown of `pairs` such windows, over `rate` ticks a second.
fn interrupt_cost(pid: i32, rate: f64, pairs: usize) {
    let mut spy = rbspy_ext_core::Spy::attach(pid).expect("attaching to learn the layout");
    let layout = spy.capture().layout();
    // SAFETY: a CPU set we own, for the calling thread (0).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
    let window = Duration::from_millis(300);
    let mut slowdowns = Vec::new();
    let mut runs = 0;
    for _ in 0..pairs {
        let before = spin(window);
        // pid_max is at most 2^22: no process has this one.
        let bpf = rbspy_ext_core::bpf::BpfSampler::start(i32::MAX, rate, &layout)
            .unwrap_or_else(|e| panic!("{e}"));
        let with = spin(window);
        runs += bpf.stats().runs;
        drop(bpf);
        let after = spin(window);
        slowdowns.push(1.0 - with / ((before + after) / 2.0));
    }
    slowdowns.sort_by(f64::total_cmp);
    let median = slowdowns[slowdowns.len() / 2];
    println!(
        "interrupt: {:.3}% slower with the empty program ({runs} runs), {:.2} us per tick \
         (median of {pairs}: {:?})",
        100.0 * median,
        median * 1e6 / rate,
        slowdowns
            .iter()
            .map(|s| (s * 1e4).round() / 100.0)
            .collect::<Vec<_>>()
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = args.get(1).map(String::as_str);
    #[cfg(feature = "bpf")]
    if mode == Some("interrupt") {
        let pid: i32 = args[2]
            .parse()
            .expect("usage: record interrupt PID [RATE] [PAIRS]");
        let rate: f64 = args.get(3).and_then(|r| r.parse().ok()).unwrap_or(1000.0);
        let pairs: usize = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(11);
        return interrupt_cost(pid, rate, pairs);
    }
    if mode == Some("idle") || mode == Some("idle-timerfd") {
        let rate: f64 = args.get(2).and_then(|r| r.parse().ok()).unwrap_or(1000.0);
        let seconds: f64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(5.0);
        if mode == Some("idle") {
            return idle(rate, seconds);
        }
        return idle_timerfd(rate, seconds);
    }
    let pid: i32 = args
        .get(1)
        .and_then(|p| p.parse().ok())
        .expect("usage: record PID [RATE] [SECONDS]");
    let rate: f64 = args.get(2).and_then(|r| r.parse().ok()).unwrap_or(1000.0);
    let seconds: f64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(5.0);
    let config = RecordConfig {
        rate_hz: rate,
        duration: Some(Duration::from_secs_f64(seconds)),
        bpf: std::env::var_os("RBSPY_BPF").is_some_and(|v| v == "1"),
        ..RecordConfig::default()
    };
    let recorder = Recorder::start(pid, config).unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(1)
    });
    while !recorder.finished() {
        std::thread::sleep(Duration::from_millis(50));
    }
    let p = recorder.stop();
    let ticks = p.ticks.max(1);
    println!(
        "{} ticks ({} samples, {} distinct stacks), {:.2} us CPU per tick ({:.2} us sampling), \
         {:.2} reads per tick, errors {:?}",
        p.ticks,
        p.samples,
        p.stacks.len(),
        p.sampler_cpu_ns as f64 / 1e3 / ticks as f64,
        p.sampler_work_ns as f64 / 1e3 / ticks as f64,
        p.read_calls as f64 / ticks as f64,
        p.errors
    );
    if let Some(k) = p.kernel {
        println!(
            "in the kernel: {} runs, {:.2} us per run; {} wake-ups; notes {:?}",
            k.bpf_runs,
            k.us_per_run(),
            k.wakeups,
            p.notes
        );
    }
}
