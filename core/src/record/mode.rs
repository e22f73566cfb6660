//! Which sampler a recording runs: the user-space one, or the BPF one (crate::bpf) when
//! `RecordConfig::bpf` asks for it and the target allows it.
use super::RecordConfig;
#[cfg(not(feature = "bpf"))]
use crate::error::Error;
use crate::error::Result;
use crate::spy::Spy;

/// The in-kernel sampler of a recording, when it has one.
#[cfg(feature = "bpf")]
pub(crate) type InKernel = crate::bpf::BpfSampler;
/// A build without the `bpf` feature has no in-kernel sampler.
#[cfg(not(feature = "bpf"))]
pub(crate) type InKernel = std::convert::Infallible;

/// The sampler a recording runs, and what its profile should say about the choice.
#[derive(Default)]
pub(crate) struct Mode {
    pub(crate) kernel: Option<InKernel>,
    pub(crate) notes: Vec<String>,
}

/// Loads the BPF sampler when the recording asks for it. A target whose Ruby threads take
/// turns on shared native threads (M:N, `RUBY_MN_THREADS=1`) is sampled through each native
/// thread's `ruby_current_ec` (which Ruby sets on every switch); where that thread-local is
/// not found, it is recorded in user space instead, with a note.
pub(crate) fn kernel_mode(spy: &mut Spy, config: &RecordConfig) -> Result<Mode> {
    if !config.bpf {
        return Ok(Mode::default());
    }
    let mut ec_tls = None;
    if let Some(why) = mn_threads(spy) {
        ec_tls = spy.capture().ec_tls();
        if ec_tls.is_none() {
            return Ok(Mode {
                kernel: None,
                notes: vec![format!(
                    "recorded by the user-space sampler, not in the kernel: {why}, and the \
                     BPF sampler could not find Ruby's ruby_current_ec thread-local, by \
                     which it tells which Ruby thread a native thread runs"
                )],
            });
        }
    }
    let mut mode = start(spy, config, ec_tls)?;
    if ec_tls.is_some() {
        mode.notes.push(
            "M:N threads: the BPF sampler tells which Ruby thread a native thread runs by \
             Ruby's own ruby_current_ec thread-local"
                .into(),
        );
    }
    Ok(mode)
}

/// Why the BPF sampler cannot run here, told before anything is attached or loaded.
pub(crate) fn preflight(config: &RecordConfig) -> Result<()> {
    if !config.bpf {
        return Ok(());
    }
    #[cfg(feature = "bpf")]
    return crate::bpf::preflight();
    #[cfg(not(feature = "bpf"))]
    return Err(no_bpf());
}

#[cfg(feature = "bpf")]
fn start(spy: &mut Spy, config: &RecordConfig, ec_tls: Option<(i64, u64)>) -> Result<Mode> {
    let mut layout = spy.capture().layout();
    layout.ec_tls = ec_tls;
    let kernel = crate::bpf::BpfSampler::start(spy.pid(), config.rate_hz, &layout)?;
    Ok(Mode {
        kernel: Some(kernel),
        notes: Vec::new(),
    })
}

#[cfg(not(feature = "bpf"))]
fn start(_: &mut Spy, _: &RecordConfig, _: Option<(i64, u64)>) -> Result<Mode> {
    Err(no_bpf())
}

#[cfg(not(feature = "bpf"))]
fn no_bpf() -> Error {
    Error::BpfUnavailable(
        "this build of rbspy_ext has no BPF sampler (it was built without clang or libelf, \
         as the precompiled gem is): install clang, libelf-dev and zlib1g-dev and build the \
         gem from source (gem install rbspy_ext --platform ruby), or record without --bpf"
            .into(),
    )
}

/// Why the target's threads are M:N, if they are: it was started with `RUBY_MN_THREADS=1`
/// (Ruby 3.3+), or two Ruby threads share a native thread id.
fn mn_threads(spy: &mut Spy) -> Option<String> {
    let environ = std::fs::read(format!("/proc/{}/environ", spy.pid())).unwrap_or_default();
    let minor = spy
        .version()
        .split('.')
        .take(2)
        .collect::<Vec<_>>()
        .join(".");
    let mn_capable = !matches!(minor.as_str(), "2.7" | "3.0" | "3.1" | "3.2");
    // Ruby turns M:N on for any positive number (thread_pthread.c: atoi(...) > 0).
    let setting = environ
        .split(|b| *b == 0)
        .find_map(|v| v.strip_prefix(b"RUBY_MN_THREADS="))
        .map(|v| String::from_utf8_lossy(v).into_owned());
    let on = setting
        .as_deref()
        .is_some_and(|v| v.trim().parse::<i64>().is_ok_and(|n| n > 0));
    if mn_capable && on {
        return Some(format!(
            "the process runs M:N threads (RUBY_MN_THREADS={})",
            setting.unwrap_or_default()
        ));
    }
    let threads = spy.threads().ok()?;
    let mut tids: Vec<i64> = threads.iter().map(|t| t.tid).filter(|t| *t > 0).collect();
    let n = tids.len();
    tids.sort_unstable();
    tids.dedup();
    (tids.len() != n).then(|| "two of the process's Ruby threads share a native thread".into())
}
