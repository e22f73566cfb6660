//! Where bytes come from: another process (`process_vm_readv`) or, in tests and fuzzing, an
//! in-memory image. Everything above this module is generic over [`Memory`], so the walker
//! can be exercised without a live process.
use crate::error::MemoryError;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// A read-only view of an address space.
pub trait Memory {
    /// Fills `buf` with the bytes at `addr`, or fails without a partial result.
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError>;

    /// Fills several buffers; a process source does this in one system call, which is what
    /// keeps a warm sample at a handful of calls.
    fn read_many(&self, requests: &mut [(u64, &mut [u8])]) -> Result<(), MemoryError> {
        for (addr, buf) in requests.iter_mut() {
            self.read(*addr, buf)?;
        }
        Ok(())
    }

    /// Like `read_many`, but reads what it can: the result says which requests were filled.
    /// Used when probing many candidate pointers, some of which may be unmapped.
    fn read_each(&self, requests: &mut [(u64, &mut [u8])]) -> Vec<bool> {
        requests
            .iter_mut()
            .map(|(addr, buf)| self.read(*addr, buf).is_ok())
            .collect()
    }

    /// How many system calls this source has made (0 for sources without any).
    fn calls(&self) -> u64 {
        0
    }

    /// Reads a little-endian u64 at `addr`.
    fn read_u64(&self, addr: u64) -> Result<u64, MemoryError> {
        let mut b = [0u8; 8];
        self.read(addr, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// Reads `len` bytes into a new vector; `len` is capped by the caller.
    fn read_vec(&self, addr: u64, len: usize) -> Result<Vec<u8>, MemoryError> {
        let mut v = vec![0u8; len];
        self.read(addr, &mut v)?;
        Ok(v)
    }

    /// Reads each `(address, length)` block into a new vector with one `read_each`: None
    /// for a block that did not read. For the heap census's batches of whole blocks (page
    /// headers and bodies, tables, shapes), any of which may have been freed meanwhile.
    fn read_blocks(&self, blocks: impl IntoIterator<Item = (u64, usize)>) -> Vec<Option<Vec<u8>>>
    where
        Self: Sized,
    {
        let (addrs, mut bufs): (Vec<u64>, Vec<Vec<u8>>) = blocks
            .into_iter()
            .map(|(addr, len)| (addr, vec![0u8; len]))
            .unzip();
        let mut requests: Vec<(u64, &mut [u8])> = addrs
            .iter()
            .zip(bufs.iter_mut())
            .map(|(addr, buf)| (*addr, &mut buf[..]))
            .collect();
        let ok = self.read_each(&mut requests);
        drop(requests);
        bufs.into_iter()
            .zip(ok)
            .map(|(b, ok)| ok.then_some(b))
            .collect()
    }
}

/// The address `offset` bytes into the struct at `base`. `base` is usually a word read from
/// the target, which may be garbage while the target runs: the sum wraps rather than
/// overflowing (a panic in debug builds), and the read at a wrapped address fails as any
/// unmapped one does. Every field address of a target struct is made here.
#[inline]
pub fn field(base: u64, offset: usize) -> u64 {
    base.wrapping_add(offset as u64)
}

/// The little-endian word at `offset` of bytes read from the target; 0 past their end (a
/// short read of a struct that moved reads as nothing, never as a panic).
pub fn word(bytes: &[u8], offset: usize) -> u64 {
    bytes
        .get(offset..offset + 8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        .unwrap_or(0)
}

/// The 32-bit little-endian value at `offset`, as [`word`].
pub fn word32(bytes: &[u8], offset: usize) -> u32 {
    bytes
        .get(offset..offset + 4)
        .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
        .unwrap_or(0)
}

/// `v`'s allocation, emptied, as a Vec of another type of the same size and alignment (the
/// standard library collects such a map in place): how a per-sample scratch Vec whose items
/// borrow one sample's bytes is kept from sample to sample without an allocation each time.
pub fn recycle<T, U>(mut v: Vec<T>) -> Vec<U> {
    v.clear();
    v.into_iter().map(|_| unreachable!("emptied")).collect()
}

/// Reads gathered into one reusable arena and made together: [`ReadBatch::add`] a range and
/// keep its [`Span`], [`ReadBatch::read`] them all with one `read_many` (one
/// `process_vm_readv` for a live process), then look each up with [`ReadBatch::get`]. The
/// arena keeps its size from batch to batch, so a warm sample neither allocates nor zeroes
/// anything for its reads (zeroing a deep stack's 25 KB at every tick showed in profiles).
#[derive(Debug, Default)]
pub struct ReadBatch {
    /// Initialized up to its length: zeros, or what an earlier batch read there.
    arena: Vec<u8>,
    /// How much of the arena this batch's spans take.
    used: usize,
    reads: Vec<(u64, Span)>,
    /// The requests of one `read`, always empty between calls (see `recycle`).
    requests: Requests<'static>,
}

/// Where one read's bytes sit in a [`ReadBatch`]'s arena; only meaningful for that batch
/// until it is cleared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Span {
    start: usize,
    len: usize,
}

impl Span {
    pub fn len(self) -> usize {
        self.len
    }

    pub fn is_empty(self) -> bool {
        self.len == 0
    }
}

impl ReadBatch {
    /// Forgets every read, keeping the arena.
    pub fn clear(&mut self) {
        self.used = 0;
        self.reads.clear();
    }

    /// Adds a read of `len` bytes at `addr` (none for `len` 0). Until a `read` succeeds its
    /// bytes are unspecified (zeros, or an earlier batch's): a failed read's bytes are never
    /// looked at, as every caller drops what a failed call was to read.
    pub fn add(&mut self, addr: u64, len: usize) -> Span {
        let span = Span {
            start: self.used,
            len,
        };
        self.used += len;
        if self.arena.len() < self.used {
            self.arena.resize(self.used, 0);
        }
        if len > 0 {
            self.reads.push((addr, span));
        }
        span
    }

    /// Makes every read added since the last `read` (or `clear`) in one `read_many`.
    pub fn read<M: Memory + ?Sized>(&mut self, mem: &M) -> Result<(), MemoryError> {
        let requests = recycle(std::mem::take(&mut self.requests));
        let (result, requests) = read_spans(&mut self.arena, &self.reads, mem, requests);
        self.requests = recycle(requests);
        self.reads.clear();
        result
    }

    /// Reads again the given spans (each as it was added, at its address), in one call.
    pub fn reread<M: Memory + ?Sized>(
        &mut self,
        mem: &M,
        spans: &[(u64, Span)],
    ) -> Result<(), MemoryError> {
        read_spans(&mut self.arena, spans, mem, Vec::new()).0
    }

    /// The bytes of `span`.
    pub fn get(&self, span: Span) -> &[u8] {
        &self.arena[span.start..span.start + span.len]
    }
}

/// The requests of one `read_many`: where to read, into which bytes.
type Requests<'a> = Vec<(u64, &'a mut [u8])>;

/// Reads `spans` of `arena` in one `read_many`. Spans are disjoint and in arena order (as
/// [`ReadBatch::add`] makes them), so the arena splits into one slice per read.
/// `requests` is an empty Vec to make them in, handed back.
fn read_spans<'a, M: Memory + ?Sized>(
    arena: &'a mut [u8],
    spans: &[(u64, Span)],
    mem: &M,
    mut requests: Requests<'a>,
) -> (Result<(), MemoryError>, Requests<'a>) {
    if spans.is_empty() {
        return (Ok(()), requests);
    }
    let mut rest = arena;
    let mut at = 0;
    for (addr, span) in spans {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(span.start - at);
        let (buf, tail) = tail.split_at_mut(span.len);
        requests.push((*addr, buf));
        rest = tail;
        at = span.start + span.len;
    }
    (mem.read_many(&mut requests), requests)
}

/// The memory of a live process, read with `process_vm_readv`. Never writes.
#[derive(Debug)]
pub struct ProcessMemory {
    pid: i32,
    calls: AtomicU64,
}

/// Linux caps the iovec count of one call at IOV_MAX (1024).
const IOV_MAX: usize = 1024;

impl ProcessMemory {
    pub fn new(pid: i32) -> Self {
        ProcessMemory {
            pid,
            calls: AtomicU64::new(0),
        }
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// How many `process_vm_readv` calls this source has made (for benchmarks).
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    fn readv(&self, requests: &mut [(u64, &mut [u8])]) -> Result<(), MemoryError> {
        // The iovec arrays live on the stack for the usual handful of requests: a sample
        // then makes no allocation for its reads.
        const ON_STACK: usize = 32;
        let empty = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        let (mut local_arr, mut remote_arr) = ([empty; ON_STACK], [empty; ON_STACK]);
        let (mut local_vec, mut remote_vec) = (Vec::new(), Vec::new());
        let (locals, remotes): (&mut [libc::iovec], &mut [libc::iovec]) =
            if requests.len() <= ON_STACK {
                (
                    &mut local_arr[..requests.len()],
                    &mut remote_arr[..requests.len()],
                )
            } else {
                local_vec.resize(requests.len(), empty);
                remote_vec.resize(requests.len(), empty);
                (&mut local_vec[..], &mut remote_vec[..])
            };
        for ((local, remote), (addr, buf)) in locals
            .iter_mut()
            .zip(remotes.iter_mut())
            .zip(requests.iter_mut())
        {
            *local = libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: buf.len(),
            };
            *remote = libc::iovec {
                iov_base: *addr as usize as *mut libc::c_void,
                iov_len: buf.len(),
            };
        }
        let want: usize = requests.iter().map(|(_, b)| b.len()).sum();
        self.calls.fetch_add(1, Ordering::Relaxed);
        // SAFETY: every local iovec points into a live, exclusively borrowed buffer of the
        // stated length; remote iovecs are only read by the kernel.
        let got = unsafe {
            libc::process_vm_readv(
                self.pid,
                locals.as_ptr(),
                locals.len() as libc::c_ulong,
                remotes.as_ptr(),
                remotes.len() as libc::c_ulong,
                0,
            )
        };
        if got < 0 {
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            return Err(match errno {
                libc::ESRCH => MemoryError::Gone,
                libc::EPERM | libc::EACCES => MemoryError::Denied,
                libc::EFAULT => {
                    let (addr, buf) = &requests[0];
                    MemoryError::Unmapped {
                        addr: *addr,
                        len: buf.len(),
                    }
                }
                e => MemoryError::Other(e),
            });
        }
        if got as usize != want {
            // The kernel stops at the first remote range it cannot read: name that one.
            let mut seen = 0usize;
            for (addr, buf) in requests.iter() {
                if seen + buf.len() > got as usize {
                    return Err(MemoryError::Unmapped {
                        addr: *addr,
                        len: buf.len(),
                    });
                }
                seen += buf.len();
            }
        }
        Ok(())
    }
}

impl Memory for ProcessMemory {
    fn calls(&self) -> u64 {
        ProcessMemory::calls(self)
    }

    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        if buf.is_empty() {
            return Ok(());
        }
        self.readv(&mut [(addr, buf)])
    }

    fn read_each(&self, requests: &mut [(u64, &mut [u8])]) -> Vec<bool> {
        let mut ok = vec![false; requests.len()];
        let mut next = 0;
        while next < requests.len() {
            let end = (next + IOV_MAX).min(requests.len());
            match self.readv(&mut requests[next..end]) {
                Ok(()) => {
                    ok[next..end].iter_mut().for_each(|o| *o = true);
                    next = end;
                }
                Err(MemoryError::Unmapped { addr, .. }) => {
                    // The kernel stopped at `addr`: everything before it was read.
                    let failed = (next..end).find(|i| requests[*i].0 == addr).unwrap_or(next);
                    ok[next..failed].iter_mut().for_each(|o| *o = true);
                    next = failed + 1;
                }
                Err(_) => break,
            }
        }
        ok
    }

    fn read_many(&self, requests: &mut [(u64, &mut [u8])]) -> Result<(), MemoryError> {
        for chunk in requests.chunks_mut(IOV_MAX) {
            self.readv(chunk)?;
        }
        Ok(())
    }
}

/// An address space made of byte regions, for tests and fuzzing.
#[derive(Debug, Default, Clone)]
pub struct MemoryImage {
    regions: BTreeMap<u64, Vec<u8>>,
}

impl MemoryImage {
    pub fn new() -> Self {
        Self::default()
    }

    /// Maps `bytes` at `addr` (regions must not overlap).
    pub fn map(&mut self, addr: u64, bytes: Vec<u8>) {
        self.regions.insert(addr, bytes);
    }

    /// Each region's start and length (for fuzzing: where mutations may land).
    pub fn regions(&self) -> Vec<(u64, usize)> {
        self.regions.iter().map(|(a, r)| (*a, r.len())).collect()
    }

    /// Overwrites bytes inside an already mapped region.
    pub fn write(&mut self, addr: u64, bytes: &[u8]) {
        let (start, region) = self
            .regions
            .range_mut(..=addr)
            .next_back()
            .expect("write into a mapped region");
        let off = (addr - start) as usize;
        region[off..off + bytes.len()].copy_from_slice(bytes);
    }
}

impl Memory for MemoryImage {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        let fail = MemoryError::Unmapped {
            addr,
            len: buf.len(),
        };
        let (start, region) = self.regions.range(..=addr).next_back().ok_or(fail)?;
        let off = usize::try_from(addr - start).map_err(|_| fail)?;
        let end = off.checked_add(buf.len()).ok_or(fail)?;
        let src = region.get(off..end).ok_or(fail)?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_batch_fills_each_span_in_one_read_and_keeps_its_arena() {
        let mut m = MemoryImage::new();
        m.map(0x1000, (0u8..64).collect());
        m.map(0x9000, vec![0xaa; 16]);
        let mut batch = ReadBatch::default();
        let a = batch.add(0x1008, 4);
        let none = batch.add(0x2000, 0); // nothing to read: not a read at all
        let b = batch.add(0x9004, 8);
        batch.read(&m).unwrap();
        assert_eq!(batch.get(a), [8, 9, 10, 11]);
        assert!(batch.get(none).is_empty() && none.is_empty());
        assert_eq!(batch.get(b), [0xaa; 8]);
        // A read outside any region fails the batch; the arena is reused after `clear`.
        batch.clear();
        let c = batch.add(0x1000, 2);
        batch.add(0x5000, 8);
        assert!(batch.read(&m).is_err());
        batch.reread(&m, &[(0x1000, c)]).unwrap();
        assert_eq!(batch.get(c), [0, 1]);
    }

    #[test]
    fn image_reads_inside_regions_only() {
        let mut m = MemoryImage::new();
        m.map(0x1000, (0u8..16).collect());
        let mut b = [0u8; 4];
        m.read(0x1004, &mut b).unwrap();
        assert_eq!(b, [4, 5, 6, 7]);
        assert!(m.read(0x100e, &mut b).is_err());
        assert!(m.read(0xfff, &mut b).is_err());
        assert!(m.read(u64::MAX - 1, &mut b).is_err());
    }

    #[test]
    fn process_memory_reads_own_process_in_one_call() {
        let a = 0x1122334455667788u64.to_le_bytes();
        let b = [9u8; 100];
        let mem = ProcessMemory::new(std::process::id() as i32);
        let mut x = [0u8; 8];
        let mut y = [0u8; 100];
        mem.read_many(&mut [
            (a.as_ptr() as u64, &mut x[..]),
            (b.as_ptr() as u64, &mut y[..]),
        ])
        .unwrap();
        assert_eq!(x, a);
        assert_eq!(y, b);
        assert_eq!(mem.calls(), 1);
        assert!(matches!(
            mem.read(8, &mut x),
            Err(MemoryError::Unmapped { .. })
        ));
    }
}
