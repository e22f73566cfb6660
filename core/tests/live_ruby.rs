//! The core against real Ruby processes (needs `ruby` on PATH; .ci/run installs it).
use rbspy_ext_core::{Config, Error, Spy};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// A spawned Ruby script, killed and reaped on drop.
struct Target {
    child: Child,
    ready: PathBuf,
    _dir: TempDir,
}

struct TempDir(PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Target {
    fn spawn(script: &str, args: &[&str]) -> Target {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "rbspy-core-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let ready = dir.join("ready");
        let script = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/scripts")
            .join(script);
        let child = Command::new("ruby")
            .arg(&script)
            .arg(&ready)
            .args(args)
            .spawn()
            .expect("`ruby` must be on PATH (script/setup installs it)");
        let t = Target {
            child,
            ready,
            _dir: TempDir(dir),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !t.ready.exists() {
            assert!(
                Instant::now() < deadline,
                "{} never became ready",
                script.display()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        t
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// The target's own backtrace: (label, path, lineno) per frame.
    fn expected(&self) -> Vec<(String, String, i32)> {
        std::fs::read_to_string(&self.ready)
            .unwrap()
            .lines()
            .map(|l| {
                let f: Vec<&str> = l.split('\t').collect();
                (f[0].to_string(), f[1].to_string(), f[2].parse().unwrap())
            })
            .collect()
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Ruby before 3.4 prints bare method names; ours are qualified. "block in Outer::Worker.run"
/// → "block in run".
fn unqualify(label: &str) -> String {
    let (prefix, name) = match label.rfind(" in ") {
        Some(i) => (&label[..i + 4], &label[i + 4..]),
        None => ("", label),
    };
    let bare = name.rsplit(['#', '.']).next().unwrap_or(name);
    let bare = if name.starts_with('<') { name } else { bare };
    format!("{prefix}{bare}")
}

#[test]
fn snapshot_equals_the_targets_own_backtrace() {
    for depth in ["0", "5", "160"] {
        let target = Target::spawn("parked.rb", &[depth]);
        let expected = target.expected();
        let mut spy = Spy::attach(target.pid()).unwrap();
        let frames = spy.snapshot().unwrap();
        let got: Vec<(String, String, i32)> = frames
            .iter()
            .map(|f| (unqualify(&f.label), f.path.to_string(), f.lineno))
            .collect();
        assert_eq!(got, expected, "depth {depth}");
        assert_eq!(&*frames[0].label, "Kernel#sleep");
        assert!(frames[0].c_function);
        assert!(frames.iter().any(|f| &*f.label == "Outer::Worker#park"));
        assert!(frames
            .iter()
            .any(|f| &*f.label == "block in Outer::Worker.run"));
        assert!(frames.iter().any(|f| &*f.label == "Array#each"));
    }
}

/// The words a Ruby counts its allocations in (what the allocation tracker reads from its
/// signal handler) sum to the target's own `GC.stat(:total_allocated_objects)`, plus the
/// few objects it allocated writing that number down.
#[test]
fn the_allocation_counters_read_the_targets_own_count() {
    let target = Target::spawn("allocated.rb", &[]);
    let own: u64 = std::fs::read_to_string(&target.ready)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let mut spy = Spy::attach(target.pid()).unwrap();
    let view = spy.target_view();
    let counters = rbspy_ext_core::census::AllocatedCounters::find(&view).unwrap();
    let read = counters.read(view.mem()).unwrap();
    assert!(own > 100_000, "{own}");
    assert!(
        (own..own + 1_000).contains(&read),
        "read {read}, the target said {own}"
    );
}

/// An image captured from a live Ruby (the `memory_image` and `heap_image` fuzz targets'
/// seeds) holds all a walk and a census need: a spy over it reads the stack the live
/// process had and counts the heap it has (parked, it allocates nothing), and any cut of
/// the image loads as an image or as nothing.
#[test]
fn a_captured_image_walks_to_the_live_stack_and_counts_its_heap() {
    let target = Target::spawn("parked.rb", &["5"]);
    let mut live = Spy::attach(target.pid()).unwrap();
    let frames = live.snapshot().unwrap();
    let census = rbspy_ext_core::census::take(live.target_view(), Default::default()).unwrap();
    let bytes = rbspy_ext_core::image::capture(target.pid(), true).unwrap();
    let image = rbspy_ext_core::image::load(&bytes).expect("a captured image loads");
    let mut spy = image.spy();
    assert_eq!(spy.snapshot().unwrap(), frames);
    let counted = rbspy_ext_core::census::take(spy.target_view(), Default::default()).unwrap();
    assert!(census.objects() > 1000, "{} objects", census.objects());
    // All but the pid, the time and the duration.
    assert_eq!(counted.counts()[3..], census.counts()[3..]);
    assert_eq!(counted.classes, census.classes);
    assert_eq!(counted.types, census.types);
    for cut in (0..bytes.len()).step_by((bytes.len() / 300).max(1)) {
        rbspy_ext_core::outside::memory_image(&bytes[..cut]);
        rbspy_ext_core::outside::heap_image(&bytes[..cut]);
    }
}

#[test]
fn warm_snapshots_take_at_most_three_reads_and_agree() {
    let target = Target::spawn("parked.rb", &["40"]);
    let mut spy = Spy::attach(target.pid()).unwrap();
    let first = spy.snapshot().unwrap();
    let before = spy.memory().calls();
    for _ in 0..100 {
        assert_eq!(spy.snapshot().unwrap(), first);
    }
    let per = (spy.memory().calls() - before) as f64 / 100.0;
    assert!(per <= 3.0, "{per} process_vm_readv calls per warm snapshot");
}

#[test]
fn a_busy_target_yields_valid_stacks_or_a_counted_retry() {
    let target = Target::spawn("busy.rb", &[]);
    let mut spy = Spy::attach(target.pid()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/scripts/busy.rb");
    let mut ok = 0;
    for _ in 0..300 {
        match spy.snapshot() {
            Ok(frames) => {
                ok += 1;
                // Every Ruby frame is one of busy.rb's (or Ruby's own builtins such as
                // Integer#zero?), never invented.
                for f in frames.iter().filter(|f| !f.path.starts_with("<internal:")) {
                    assert_eq!(Path::new(&*f.path), script.as_path(), "{f:?}");
                    assert!((1..=7).contains(&f.lineno), "{f:?}");
                }
                for f in frames.iter().filter(|f| f.path.starts_with("<internal:")) {
                    assert_eq!(&*f.label, "Integer#zero?", "{f:?}");
                }
                assert!(frames.iter().any(|f| &*f.label == "<main>"));
            }
            Err(Error::StackChanged { .. }) => {}
            Err(e) => panic!("unexpected error {e}"),
        }
    }
    assert!(ok > 250, "only {ok} of 300 snapshots succeeded");
}

#[test]
fn a_process_without_ruby_is_not_ruby() {
    let mut child = Command::new("sleep").arg("30").spawn().unwrap();
    let err = Spy::attach(child.id() as i32)
        .err()
        .expect("sleep is not Ruby");
    let _ = child.kill();
    let _ = child.wait();
    assert!(matches!(err, Error::NotRuby { .. }), "{err}");
}

#[test]
fn a_target_that_exits_is_reported() {
    let mut target = Target::spawn("parked.rb", &["1"]);
    let mut spy = Spy::attach(target.pid()).unwrap();
    target.child.kill().unwrap();
    target.child.wait().unwrap();
    let err = spy.snapshot().unwrap_err();
    assert!(matches!(err, Error::ProcessExited { .. }), "{err}");
}

/// A target whose libruby path no longer exists for the reader (as for a target in a chroot
/// or another mount namespace): the library is a copy in a directory deleted after start.
/// The spy must read it through /proc/PID/map_files.
#[test]
fn a_libruby_whose_path_is_gone_is_read_through_map_files() {
    let libruby = Command::new("ruby")
        .args([
            "-e",
            "print File.read('/proc/self/maps')[%r{/\\S*/libruby\\S*}]",
        ])
        .output()
        .unwrap();
    let libruby = String::from_utf8(libruby.stdout).unwrap();
    let libname = Path::new(&libruby)
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    let soname = libname.rsplit_once('.').unwrap().0.to_string(); // libruby-3.1.so.3.1
    let dir = std::env::temp_dir().join(format!("rbspy-core-gone-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(&libruby, dir.join(&soname)).unwrap();
    let ready = dir.join("ready");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/scripts/parked.rb");
    let mut child = Command::new("ruby")
        .env("LD_LIBRARY_PATH", &dir)
        .arg(&script)
        .arg(&ready)
        .arg("2")
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ready.exists() {
        assert!(Instant::now() < deadline, "target never became ready");
        std::thread::sleep(Duration::from_millis(10));
    }
    let expected_len = std::fs::read_to_string(&ready).unwrap().lines().count();
    std::fs::remove_dir_all(&dir).unwrap();
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", child.id())).unwrap();
    let result = Spy::attach(child.id() as i32).and_then(|mut spy| spy.snapshot());
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        maps.contains(&format!("{soname} (deleted)")),
        "the copy was not used:\n{maps}"
    );
    let frames = result.unwrap();
    assert_eq!(frames.len(), expected_len);
    assert_eq!(&*frames[0].label, "Kernel#sleep");
}

/// Debian's 3.3 and 3.4 export no `ruby_current_vm_ptr`: the scan of libruby's data must
/// find the same VM the symbol names, and the snapshot must be the same.
#[test]
fn scanning_for_the_vm_finds_the_one_the_symbol_names() {
    let target = Target::spawn("parked.rb", &["3"]);
    let mut by_symbol = Spy::attach(target.pid()).unwrap();
    let scan = Config {
        scan_for_vm: true,
        ..Config::default()
    };
    let mut by_scan = Spy::attach_with(target.pid(), &scan).unwrap();
    assert_eq!(by_scan.vm_address(), by_symbol.vm_address());
    assert_eq!(by_scan.snapshot().unwrap(), by_symbol.snapshot().unwrap());
}

/// The BPF sampler through the core alone (root only: it loads a BPF program; the specs in
/// spec/bpf_sampler_spec.rb compare it with Ruby's own backtraces on the whole corpus).
///
/// The kernel samples the target only while it is on a CPU, so how many samples a second
/// brings depends on what else the machine runs: the recording goes on until it has
/// `WANTED` samples, however long that takes within a generous deadline; their number is
/// checked against the CPU time the target had, and the rest is about what they resolved to.
#[cfg(feature = "bpf")]
#[test]
fn the_bpf_sampler_resolves_a_busy_target_to_its_own_frames() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: loading a BPF program needs root");
        return;
    }
    use rbspy_ext_core::record::{RecordConfig, Recorder};
    const WANTED: u64 = 400;
    let target = Target::spawn("busy.rb", &[]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/scripts/busy.rb");
    let config = RecordConfig {
        rate_hz: 999.0,
        duration: None,
        bpf: true,
        ..RecordConfig::default()
    };
    let cpu_before = main_thread_cpu_seconds(target.pid());
    let started = Instant::now();
    let recorder = Recorder::start(target.pid(), config).expect("the BPF sampler starts as root");
    // About 0.4 s on an idle machine; a busy one only stretches it.
    let deadline = Instant::now() + Duration::from_secs(60);
    while recorder.progress().samples < WANTED && !recorder.finished() {
        assert!(
            Instant::now() < deadline,
            "{} samples of a thread that never leaves the CPU in 60 s",
            recorder.progress().samples
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let p = recorder.stop();
    let wall = started.elapsed().as_secs_f64();
    let cpu = main_thread_cpu_seconds(target.pid()) - cpu_before;
    assert!(
        p.samples >= WANTED,
        "{} samples, errors {:?}, notes {:?}",
        p.samples,
        p.errors,
        p.notes
    );
    // Each tick of the CPU the thread runs on is a sample: 999 a second of its CPU time (all
    // of it on an idle machine, a share on a busy one). Its CPU time within the recording is
    // all it had, less at most the wall time attaching and stopping took around it.
    let inside = cpu - (wall - p.duration_ns as f64 / 1e9);
    let n = p.samples as f64;
    assert!(
        n >= 0.9 * 999.0 * inside && n <= 1.1 * 999.0 * cpu + 10.0,
        "{n} samples for {cpu:.3} s of CPU, at least {inside:.3} s of it while recording"
    );
    // The kernel copied each stack as it was: none may fail to resolve.
    let dropped: u64 = p.errors.values().sum();
    assert!(
        dropped * 100 <= p.samples,
        "{dropped} dropped: {:?}",
        p.errors
    );
    let kernel = p.kernel.expect("a BPF recording reports its kernel cost");
    assert!(kernel.bpf_runs >= p.samples && kernel.bpf_run_ns > 0);
    let mut depths = std::collections::BTreeSet::new();
    for s in &p.stacks {
        let frames: Vec<_> = s.frames.iter().map(|i| &p.frames[*i as usize]).collect();
        assert!(s.state.on_cpu(), "{:?}: {frames:#?}", s.state);
        depths.insert(busy_stack_depth(&frames, &script));
    }
    // The stack goes through every depth from 0 to 40 spins, each for a time about
    // proportional to its depth: the samples must follow it, not repeat a few stacks. (Of
    // 400 samples the shallowest depths get one or two each, so a few may be missed.)
    assert!(depths.len() >= 30, "spin depths sampled: {depths:?}");
}

/// Checks one stack of busy.rb (innermost frame first) and returns how many `spin` frames it
/// has. busy.rb: `loop { spin(i % 40) }` at line 7; spin calls itself at line 3 down to
/// n == 0, where it maps and sums (line 3 too). Outermost first: <main> and Kernel#loop, then
/// between two turns nothing more, or block in <main>, 0 to 40 spins (0 around the call, in
/// `i % 40` or `i += 1`) and what the innermost spin calls. C frames are at their caller's
/// line; Ruby's own builtins (<internal:...>) at theirs. Any other frame would be invented.
#[cfg(feature = "bpf")]
fn busy_stack_depth(frames: &[&rbspy_ext_core::Frame], script: &Path) -> usize {
    let known = [
        "<main>",
        "Kernel#loop",
        "block in <main>",
        "Object#spin",
        "block in Object#spin",
        "Integer#zero?",
        "Array#map",
        "Array#sum",
        "Integer#*",
    ];
    let outer: Vec<_> = frames.iter().rev().take(2).map(|f| &*f.label).collect();
    assert_eq!(outer, ["<main>", "Kernel#loop"], "{frames:#?}");
    assert_eq!(frames.last().unwrap().lineno, 7, "{frames:#?}");
    for f in frames {
        assert!(known.contains(&&*f.label), "{f:?} in {frames:#?}");
        if f.path.starts_with("<internal:") {
            assert!(
                ["Integer#zero?", "Kernel#loop"].contains(&&*f.label),
                "{f:?}"
            );
        } else {
            assert_eq!(Path::new(&*f.path), script, "{f:?}");
            assert!((1..=7).contains(&f.lineno), "{f:?}");
        }
    }
    if frames.len() > 2 {
        assert_eq!(&*frames[frames.len() - 3].label, "block in <main>");
    }
    // Outermost first, after block in <main>: the spins, one after the other.
    let spins = frames
        .iter()
        .rev()
        .skip(3)
        .take_while(|f| &*f.label == "Object#spin")
        .count();
    let all_spins = frames.iter().filter(|f| &*f.label == "Object#spin").count();
    assert_eq!(spins, all_spins, "{frames:#?}");
    assert!(spins <= 40, "{spins} spins: {frames:#?}");
    spins
}

/// Seconds the main thread of process `pid` has spent on a CPU (/proc/PID/task/PID/schedstat,
/// in nanoseconds): what the kernel's CPU clock, and so the BPF sampler, counts.
#[cfg(feature = "bpf")]
fn main_thread_cpu_seconds(pid: i32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/schedstat")).unwrap();
    let ns: u64 = stat.split_whitespace().next().unwrap().parse().unwrap();
    ns as f64 / 1e9
}
