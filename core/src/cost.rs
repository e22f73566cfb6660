//! What the BPF sampler's recording cost in the kernel (`Profile::kernel`), reported beside
//! the sampler thread's own CPU time.

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
