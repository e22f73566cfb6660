//! `cargo run --release --example floor -- PID [RATE] [SECONDS]`: the floor of a user-space
//! sample of PID, for bench/sample_floor.rb. A spy samples PID at RATE for one second while a
//! memory source notes every `process_vm_readv` it makes (addresses and lengths); then a loop
//! wakes at RATE for SECONDS, with the recorder's own jittered timer, and replays those calls,
//! one sample's calls per wake-up, with `process_vm_readv` straight into buffers made
//! beforehand, and nothing else. Its CPU per wake-up is what the recorder cannot go below: a
//! wake-up and the same reads of the same bytes. Prints the wake-ups, the CPU per wake-up, and
//! the calls and bytes of an average sample.
use rbspy_ext_core::cost::thread_cpu_ns;
use rbspy_ext_core::memory::{Memory, ProcessMemory};
use rbspy_ext_core::record::Timer;
use rbspy_ext_core::spy::ThreadSelection;
use rbspy_ext_core::{MemoryError, Spy};
use std::cell::RefCell;
use std::time::{Duration, Instant};

/// One `process_vm_readv` call: (address, length) of each of its pieces.
type Call = Vec<(u64, usize)>;

/// Process memory that notes each call it makes, when asked to.
struct Noting {
    inner: ProcessMemory,
    calls: RefCell<Option<Vec<Call>>>,
}

impl Noting {
    fn note(&self, call: Call) {
        if let Some(calls) = self.calls.borrow_mut().as_mut() {
            calls.push(call);
        }
    }
}

impl Memory for Noting {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        self.note(vec![(addr, buf.len())]);
        self.inner.read(addr, buf)
    }

    fn read_many(&self, requests: &mut [(u64, &mut [u8])]) -> Result<(), MemoryError> {
        self.note(requests.iter().map(|(a, b)| (*a, b.len())).collect());
        self.inner.read_many(requests)
    }

    fn read_each(&self, requests: &mut [(u64, &mut [u8])]) -> Vec<bool> {
        self.note(requests.iter().map(|(a, b)| (*a, b.len())).collect());
        self.inner.read_each(requests)
    }

    fn calls(&self) -> u64 {
        self.inner.calls()
    }
}

/// The calls of each of a second's samples at `rate`, after a warm-up second.
fn noted_samples(pid: i32, rate: f64) -> Vec<Vec<Call>> {
    let mut spy = Spy::attach(pid).unwrap_or_else(|e| panic!("attaching to {pid}: {e}"));
    for _ in 0..20 {
        let _ = spy.sample(ThreadSelection::All);
    }
    let parts = spy.image_parts();
    let mem = Noting {
        inner: ProcessMemory::new(pid),
        calls: RefCell::new(None),
    };
    let mut spy = Spy::over_image(pid, mem, &parts);
    let period = Duration::from_secs_f64(1.0 / rate);
    let n = rate as usize;
    let mut samples = Vec::with_capacity(n);
    for round in 0..2 * n {
        let noting = round >= n;
        if noting {
            *spy.memory().calls.borrow_mut() = Some(Vec::new());
        }
        let _ = spy.sample(ThreadSelection::All);
        if noting {
            samples.push(spy.memory().calls.borrow_mut().take().unwrap_or_default());
        }
        std::thread::sleep(period);
    }
    samples
}

/// A call made ready to replay: its local buffers and both iovec arrays.
struct Ready {
    _buffers: Vec<Vec<u8>>,
    local: Vec<libc::iovec>,
    remote: Vec<libc::iovec>,
}

fn ready(call: &Call) -> Ready {
    let mut buffers: Vec<Vec<u8>> = call.iter().map(|(_, len)| vec![0u8; *len]).collect();
    let local = buffers
        .iter_mut()
        .map(|b| libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: b.len(),
        })
        .collect();
    let remote = call
        .iter()
        .map(|(addr, len)| libc::iovec {
            iov_base: *addr as *mut libc::c_void,
            iov_len: *len,
        })
        .collect();
    Ready {
        _buffers: buffers,
        local,
        remote,
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let pid: i32 = args
        .get(1)
        .and_then(|p| p.parse().ok())
        .expect("usage: floor PID [RATE] [SECONDS]");
    let rate: f64 = args.get(2).and_then(|r| r.parse().ok()).unwrap_or(1000.0);
    let seconds: f64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(5.0);
    let samples = noted_samples(pid, rate);
    let calls: usize = samples.iter().map(Vec::len).sum();
    let bytes: usize = samples.iter().flatten().flatten().map(|(_, l)| l).sum();
    let replay: Vec<Vec<Ready>> = samples
        .iter()
        .map(|s| s.iter().map(ready).collect())
        .collect();
    let mut timer = Timer::new(rate, 0x9e37_79b9);
    let started = Instant::now();
    let cpu = thread_cpu_ns();
    let mut next = started;
    let mut wakes = 0usize;
    while started.elapsed().as_secs_f64() < seconds {
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        }
        next += timer.next_interval();
        for r in &replay[wakes % replay.len()] {
            // SAFETY: each local iovec points into a buffer `r` owns, of the length given;
            // the remote ones are only read, by the kernel, from the other process.
            unsafe {
                libc::process_vm_readv(
                    pid,
                    r.local.as_ptr(),
                    r.local.len() as libc::c_ulong,
                    r.remote.as_ptr(),
                    r.remote.len() as libc::c_ulong,
                    0,
                );
            }
        }
        wakes += 1;
    }
    let n = samples.len().max(1) as f64;
    println!(
        "{wakes} wake-ups, {:.2} us CPU per wake-up, {:.2} calls and {:.0} bytes per sample",
        (thread_cpu_ns() - cpu) as f64 / 1e3 / wakes as f64,
        calls as f64 / n,
        bytes as f64 / n
    );
}
