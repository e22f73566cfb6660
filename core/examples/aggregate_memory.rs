//! Memory of aggregated samples: feeds 10^6 samples of 50-frame stacks (10,000 distinct
//! stacks over 2,000 distinct frames, 4 threads) to the aggregator, one tick of 4 samples
//! each millisecond, and prints the process's peak RSS and the timeline's share of it (its
//! bytes per sample). Run by bench/record.rb; `cargo run --release --example
//! aggregate_memory`.
use rbspy_ext_core::profile::{frame, Aggregator, ThreadInfo, ThreadState};

fn rss_kb(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn main() {
    let frames: Vec<_> = (0..2000)
        .map(|i| {
            frame(
                &format!("Module{}::Class{}#method_{i}", i % 37, i % 101),
                &format!("/app/lib/file_{}.rb", i % 300),
                (i % 500) + 1,
                i % 9 == 0,
            )
        })
        .collect();
    let threads: Vec<ThreadInfo> = (0..4)
        .map(|t| ThreadInfo {
            pid: 1,
            tid: 100 + t,
            name: Some(format!("worker-{t}")),
            ruby_thread: 0x1000 * (t as u64 + 1),
            main: t == 0,
            ractor: 1,
            ractor_name: None,
        })
        .collect();
    let before = rss_kb("VmRSS:");
    let mut agg = Aggregator::new(1, "3.1.2", 1000.0, 0);
    let mut seed = 12345u64;
    for i in 0..1_000_000u64 {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let stack_id = (seed >> 33) % 10_000;
        let stack: Vec<_> = (0..50)
            .map(|d| frames[((stack_id * 31 + d * 7919) % 2000) as usize].clone())
            .collect();
        let state = if i % 3 == 0 {
            ThreadState::Blocked
        } else {
            ThreadState::Running
        };
        if i % 4 == 0 {
            agg.tick_at(std::time::Duration::from_millis(i / 4));
        }
        agg.add_frames(&threads[(i % 4) as usize], state, &stack);
    }
    let p = agg.finish(250_000_000_000);
    let timeline_bytes = p.timeline.at_us.capacity() * 4 + p.timeline.stacks.capacity() * 4;
    println!(
        "aggregating 10^6 samples of 50-frame stacks: {} distinct stacks, {} in the timeline, \
         peak RSS {:.1} MB (was {:.1} MB before); the timeline holds {:.1} MB, {:.1} bytes a sample",
        p.stacks.len(),
        p.timeline.len(),
        rss_kb("VmHWM:") as f64 / 1024.0,
        before as f64 / 1024.0,
        timeline_bytes as f64 / 1048576.0,
        timeline_bytes as f64 / p.timeline.len() as f64
    );
}
