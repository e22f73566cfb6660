//! One error type for the core; the Ruby layer maps each variant to a `RubySpy::Error` subclass.
use thiserror::Error;

/// Why a memory read failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum MemoryError {
    /// The address range is not mapped in the target (EFAULT or a short read).
    #[error("address {addr:#x} (+{len} bytes) is not readable in the target")]
    Unmapped { addr: u64, len: usize },
    /// The process no longer exists (ESRCH).
    #[error("the process no longer exists")]
    Gone,
    /// The kernel refused the read (EPERM).
    #[error("permission denied")]
    Denied,
    /// Any other errno.
    #[error("memory read failed with errno {0}")]
    Other(i32),
}

/// Why an object could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ObjectError {
    Memory(MemoryError),
    /// The object's header is not what the caller expected.
    Shape(&'static str, u64),
}

impl From<MemoryError> for ObjectError {
    fn from(e: MemoryError) -> Self {
        ObjectError::Memory(e)
    }
}

pub type ObjResult<T> = std::result::Result<T, ObjectError>;

/// Everything that can go wrong while attaching to or reading a Ruby process.
#[derive(Debug, Error)]
pub enum Error {
    #[error("no process with pid {pid}: check the pid (is it in another PID namespace?)")]
    NoSuchProcess { pid: i32 },
    #[error(
        "permission denied reading process {pid}: run as root or grant CAP_SYS_PTRACE \
         (e.g. `sudo`, or `--cap-add=SYS_PTRACE` in a container); non-root users also need \
         kernel.yama.ptrace_scope = 0 (see /proc/sys/kernel/yama/ptrace_scope) and the same uid"
    )]
    PermissionDenied { pid: i32 },
    #[error("process {pid} is not a Ruby process: {detail}")]
    NotRuby { pid: i32, detail: String },
    #[error(
        "process {pid} runs Ruby {version}, which rbspy_ext does not support ({detail}); \
         try `force_version:` with the nearest supported release"
    )]
    UnsupportedVersion {
        pid: i32,
        version: String,
        detail: String,
    },
    #[error(
        "process {pid} runs Ruby {version}, which no table of this build knows, and its debug \
         information in {path} cannot give its layout: {detail}. Install the debug file that \
         matches the binary (or remove a wrong one), or try `force_version:` with the nearest \
         supported release"
    )]
    DebugInfo {
        pid: i32,
        version: String,
        path: String,
        detail: String,
    },
    #[error("process {pid} exited while it was being read")]
    ProcessExited { pid: i32 },
    #[error(
        "process {pid} is no longer the process attached to: it {detail}; its memory is not \
         read as the old one's (attach again to read the new one)"
    )]
    ProcessReplaced { pid: i32, detail: String },
    #[error(
        "the stack of process {pid} kept changing while it was read ({attempts} attempts, \
         last: {last}); take the snapshot again"
    )]
    StackChanged {
        pid: i32,
        attempts: u32,
        last: String,
    },
    #[error("process {pid}: the {what} at {addr:#x} is not valid Ruby VM data")]
    Corrupt {
        pid: i32,
        what: &'static str,
        addr: u64,
    },
    #[error("process {pid}: {context}: {source}")]
    Memory {
        pid: i32,
        context: &'static str,
        #[source]
        source: MemoryError,
    },
    #[error("process {pid}: {context}: {source}")]
    Io {
        pid: i32,
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The BPF sampler cannot run here: the reason says what is missing and what to do.
    #[error("the BPF sampler cannot run: {0}")]
    BpfUnavailable(String),
    /// The pprof listener could not open its port (in use, or below 1024 without privilege).
    #[error(
        "cannot listen on {addr}: {source} (another process may hold the port: \
         pick another port, or stop that process)"
    )]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
