//! What a recording cost: the clocks the samplers measure themselves with, and the BPF
//! sampler's cost in the kernel (`Profile::kernel`), reported beside the sampler thread's own
//! CPU time.

/// The BPF program's run time (bpf_stats) and the recorder's wake-ups.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KernelCost {
    /// `run_time_ns` / `run_cnt` of the program over the recording, every run counted: the
    /// target's ticks and the ticks of other processes it filtered out.
    pub bpf_run_ns: u64,
    pub bpf_runs: u64,
    /// Times the recorder woke up to drain the ring buffer.
    pub wakeups: u64,
}

impl KernelCost {
    /// Mean in-kernel time of one run, in microseconds (0 before any run).
    pub fn us_per_run(&self) -> f64 {
        if self.bpf_runs == 0 {
            return 0.0;
        }
        self.bpf_run_ns as f64 / 1e3 / self.bpf_runs as f64
    }
}

/// CPU time used by the calling thread so far.
pub fn thread_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// A clock's reading in nanoseconds (0 if it cannot be read): CLOCK_THREAD_CPUTIME_ID for
/// costs, CLOCK_MONOTONIC for the BPF sampler's timestamps (`bpf_ktime_get_ns`).
pub fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, which we own.
    let ok = unsafe { libc::clock_gettime(clock, &mut ts) } == 0;
    if ok {
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    } else {
        0
    }
}
