//! What the listener answers: Go's pprof paths, under the same rules as the Rack endpoint
//! (lib/rbspy_ext/rack/pprof.rb): a token, or a loopback client not behind a proxy; one
//! profile at a time (429); bounded parameters (400), and nothing else (no redirect).
use super::http::{Request, Response};
use super::tracked::{self, AllocsAnswer, AllocsRequest};
use super::Shared;
use crate::allocs::pprof::Opens;
use crate::census::{self, render, CensusOptions};
use crate::model::Sample;
use crate::output::{self, thread_title, Format, Options};
use crate::process::{descendants, worker_name};
use crate::record::{RecordConfig, Recorder};
use crate::spy::{Spy, ThreadSelection};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Longest profile one request may ask for, in seconds.
pub const MAX_SECONDS: u64 = 60;
/// Highest sampling rate one request may ask for, in Hz.
pub const MAX_RATE: u64 = 1000;
const DEFAULT_SECONDS: u64 = 30;
const DEFAULT_RATE: u64 = 100;
const BASE: &str = "/debug/pprof";

pub(super) enum Route {
    Index,
    Profile,
    Threads,
    Heap,
    Allocs,
}

pub(super) fn respond(shared: &Shared, request: &Request, peer: SocketAddr) -> Response {
    let (route, params) = match route(request) {
        Ok(routed) => routed,
        Err(r) => return r,
    };
    if !allowed(shared, request, &params, peer) {
        return Response::text(
            403,
            "forbidden: send the token (?token= or Authorization: Bearer)\n",
        );
    }
    match route {
        Route::Index => params.only(&[]).map_or_else(|r| r, |()| index(shared)),
        Route::Threads => params.only(&[]).map_or_else(|r| r, |()| threads(shared)),
        Route::Profile => profile(shared, &params),
        Route::Heap => heap(shared, &params),
        Route::Allocs => allocs(shared, &params),
    }
}

/// What a request asks for, from its head alone (no state: see `super::screen`): a method
/// served, a known path, and its query's parameters, each at most once.
pub(super) fn route(request: &Request) -> Result<(Route, Params), Response> {
    if request.method != "GET" && request.method != "HEAD" {
        return Err(
            Response::text(405, "only GET is served\n").with_header("allow", "GET, HEAD".into())
        );
    }
    let route = match request.path.strip_prefix(BASE) {
        Some("" | "/") => Route::Index,
        Some("/profile") => Route::Profile,
        Some("/threads") => Route::Threads,
        Some("/heap") => Route::Heap,
        Some("/allocs") => Route::Allocs,
        _ => return Err(Response::text(404, &format!("not found: try {BASE}/\n"))),
    };
    Ok((route, Params::parse(&request.query)?))
}

/// The query's parameters, each at most once.
pub(super) struct Params(Vec<(String, String)>);

impl Params {
    fn parse(query: &str) -> Result<Params, Response> {
        let pairs: Vec<(String, String)> = form_urlencoded::parse(query.as_bytes())
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect();
        for (i, (k, _)) in pairs.iter().enumerate() {
            if pairs[..i].iter().any(|(seen, _)| seen == k) {
                return Err(Response::text(400, &format!("parameter {k} given twice\n")));
            }
        }
        Ok(Params(pairs))
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Err (400) when a parameter other than `allowed` and `token` is present.
    fn only(&self, allowed: &[&str]) -> Result<(), Response> {
        let unknown: Vec<&str> = self
            .0
            .iter()
            .map(|(k, _)| k.as_str())
            .filter(|k| *k != "token" && !allowed.contains(k))
            .collect();
        if unknown.is_empty() {
            return Ok(());
        }
        let known: Vec<&str> = allowed.iter().copied().chain(["token"]).collect();
        Err(Response::text(
            400,
            &format!(
                "unknown parameter {}: only {}\n",
                unknown.join(", "),
                known.join(", ")
            ),
        ))
    }

    /// A whole number in `range`, `default` when absent; None when anything else.
    fn whole(&self, key: &str, default: u64, range: std::ops::RangeInclusive<u64>) -> Option<u64> {
        let Some(text) = self.get(key) else {
            return Some(default);
        };
        let digits =
            !text.is_empty() && text.len() <= 6 && text.bytes().all(|b| b.is_ascii_digit());
        let value: u64 = if digits {
            text.parse().ok()?
        } else {
            return None;
        };
        range.contains(&value).then_some(value)
    }
}

/// A matching token from anywhere; else, with none given, a loopback peer not behind a proxy.
fn allowed(shared: &Shared, request: &Request, params: &Params, peer: SocketAddr) -> bool {
    let given = params.get("token").or(request.bearer.as_deref());
    if let Some(given) = given {
        return shared
            .config
            .token
            .as_deref()
            .is_some_and(|token| same(given.as_bytes(), token.as_bytes()));
    }
    shared.config.loopback && !request.forwarded && peer.ip().to_canonical().is_loopback()
}

/// Compares in time that depends on the lengths only, not on where the first difference is.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn index(shared: &Shared) -> Response {
    let config = &shared.config;
    let scope = if config.subprocesses {
        "this process and its Ruby subprocesses (each sample labelled with its pid, and a\n    preforking server's worker)"
    } else {
        "this process"
    };
    Response::text(
        200,
        &format!(
            "rbspy_ext profiles of process {pid}, served on {addr}\n\n\
             {BASE}/profile?seconds=N[&rate=HZ][&state_leaves=0][&format=firefox]\n    \
             Records every thread of {scope}\n    \
             for N seconds (1-{MAX_SECONDS}, default {DEFAULT_SECONDS}) at HZ samples a second \
             (1-{MAX_RATE}, default {DEFAULT_RATE})\n    \
             and returns a gzipped pprof profile: wall time by stack, labelled with each \
             sample's thread,\n    state and RubySpy tags. Fetch it with: go tool pprof URL\n    \
             Waits for the GVL and GC pauses end in leaves of their own ([waiting for GVL], \
             [GC marking]...);\n    state_leaves=0 bills them to the frame they stood in.\n    \
             format=firefox returns every thread on one timeline instead, for the Firefox \
             Profiler\n    (profiler.firefox.com, \"Load a profile from file\").\n\n\
             {BASE}/threads\n    The stack of every thread now, as text (like Go's goroutine \
             dump).\n\n\
             {BASE}/heap[?gc=1]\n    While allocations are tracked (RubySpy.track_allocations, \
             RUBYSPY_ALLOCATIONS): the sampled objects\n    still alive, by the stack that \
             allocated them (gzipped pprof: inuse_space, inuse_objects,\n    alloc_space, \
             alloc_objects), as of the last GC; gc=1 runs a full GC first.\n\n\
             {BASE}/heap?census=1[&pid=PID][&debug=1]\n    A census of the heap's live objects \
             by class (gzipped pprof: inuse_objects, inuse_space;\n    debug=1: text), of this \
             process or one of its Ruby subprocesses: what /heap serves while\n    allocations \
             are not tracked.\n\n\
             {BASE}/allocs[?gc=1]\n    While allocations are tracked: every sampled allocation \
             by stack, opening on alloc_space.\n",
            pid = config.pid,
            addr = config.addr,
        ),
    )
}

fn profile(shared: &Shared, params: &Params) -> Response {
    if let Err(r) = params.only(&["seconds", "rate", "state_leaves", "format"]) {
        return r;
    }
    let format = match params.get("format") {
        None | Some("pprof") => Format::Pprof,
        Some("firefox") => Format::Firefox,
        Some(_) => return Response::text(400, "format must be pprof or firefox\n"),
    };
    let Some(leaves) = params.whole("state_leaves", 1, 0..=1) else {
        return Response::text(400, "state_leaves must be 0 or 1\n");
    };
    let Some(seconds) = params.whole("seconds", DEFAULT_SECONDS, 1..=MAX_SECONDS) else {
        return Response::text(
            400,
            &format!("seconds must be a whole number from 1 to {MAX_SECONDS}\n"),
        );
    };
    let Some(rate) = params.whole("rate", DEFAULT_RATE, 1..=MAX_RATE) else {
        return Response::text(
            400,
            &format!("rate must be a whole number of Hz from 1 to {MAX_RATE}\n"),
        );
    };
    if shared.busy.swap(true, Ordering::AcqRel) {
        return Response::text(
            429,
            "a profile is already being recorded in this process; try again later\n",
        )
        .with_header("retry-after", seconds.to_string());
    }
    let options = Options {
        no_state_leaves: leaves == 0,
        ..Options::default()
    };
    let response = record(
        shared,
        Duration::from_secs(seconds),
        rate as f64,
        (format, &options),
    );
    shared.busy.store(false, Ordering::Release);
    response
}

fn record(
    shared: &Shared,
    seconds: Duration,
    rate_hz: f64,
    (format, options): (Format, &Options),
) -> Response {
    let config = RecordConfig {
        rate_hz,
        duration: Some(seconds),
        subprocesses: shared.config.subprocesses,
        ..RecordConfig::default()
    };
    let recorder = match Recorder::start(shared.config.pid, config) {
        Ok(r) => r,
        Err(e) => return Response::text(500, &format!("cannot record: {e}\n")),
    };
    // The recorder stops itself at the duration; the deadline only bounds a stuck stop.
    let deadline = Instant::now() + seconds + Duration::from_secs(1);
    while !recorder.finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let profile = recorder.stop();
    let mut body = Vec::new();
    if let Err(e) = output::write(&profile, format, &mut body, options) {
        return Response::text(500, &format!("cannot write the profile: {e}\n"));
    }
    Response {
        status: 200,
        content_type: "application/octet-stream",
        extra: vec![(
            "content-disposition",
            format!("attachment; filename=\"profile.{}\"", format.extension()),
        )],
        body,
    }
}

/// `/heap`: the tracked allocations still alive when tracking is on (Go's meaning: sampled
/// live objects by the stack that allocated them); else, or with `census=1`, `pid` or
/// `debug=1`, a heap census of the process (or of one of its Ruby subprocesses when the
/// listener serves them) as a pprof heap profile, or text with `debug=1`. One at a time,
/// like profiles: a census reads the whole heap.
fn heap(shared: &Shared, params: &Params) -> Response {
    if let Err(r) = params.only(&["pid", "debug", "gc", "census"]) {
        return r;
    }
    let root = shared.config.pid;
    let pid = match params.get("pid").map(str::parse::<i32>) {
        None => root,
        Some(Ok(pid))
            if pid == root || (shared.config.subprocesses && descendants(root).contains(&pid)) =>
        {
            pid
        }
        Some(_) => {
            return Response::text(
                400,
                &format!("pid must be {root} or one of its Ruby subprocesses\n"),
            );
        }
    };
    let (text, gc, census) = match (
        flag(params, "debug"),
        flag(params, "gc"),
        flag(params, "census"),
    ) {
        (Ok(t), Ok(g), Ok(c)) => (t, g, c),
        (Err(r), _, _) | (_, Err(r), _) | (_, _, Err(r)) => return r,
    };
    if !(census || text || params.get("pid").is_some()) {
        if let Some(r) = tracked_profile(shared, Opens::Inuse, gc, "heap") {
            return r;
        }
    }
    let census = exclusively(shared, || {
        Spy::attach(pid)
            .and_then(|mut spy| census::take(spy.target_view(), CensusOptions::default()))
    });
    match census {
        Err(busy) => busy,
        Ok(Ok(c)) if text => Response::text(200, &render::text(&c, 100)),
        Ok(Ok(c)) => pprof_file(render::pprof(&c), "heap"),
        Ok(Err(e)) => Response::text(500, &format!("cannot take a census: {e}\n")),
    }
}

/// `/allocs`: every sampled allocation by stack, while tracking is on.
fn allocs(shared: &Shared, params: &Params) -> Response {
    if let Err(r) = params.only(&["gc"]) {
        return r;
    }
    let gc = match flag(params, "gc") {
        Ok(gc) => gc,
        Err(r) => return r,
    };
    tracked_profile(shared, Opens::Allocs, gc, "allocs").unwrap_or_else(|| {
        Response::text(
            404,
            "allocation tracking is off in this process: start it with \
             RubySpy.track_allocations, or RUBYSPY_ALLOCATIONS=1 in its environment\n",
        )
    })
}

/// The tracker's profile, asked for one at a time; None when tracking is off.
fn tracked_profile(shared: &Shared, opens: Opens, gc: bool, name: &str) -> Option<Response> {
    match exclusively(shared, || tracked::ask(AllocsRequest { opens, gc })) {
        Err(busy) => Some(busy),
        Ok(AllocsAnswer::Profile(body)) => Some(pprof_file(body, name)),
        Ok(AllocsAnswer::NotTracking) => None,
        Ok(AllocsAnswer::Unavailable(why)) => Some(Response::text(503, &format!("{why}\n"))),
    }
}

/// Runs `f` unless a profile or census is being taken in this process (then a 429).
fn exclusively<T>(shared: &Shared, f: impl FnOnce() -> T) -> Result<T, Response> {
    if shared.busy.swap(true, Ordering::AcqRel) {
        return Err(Response::text(
            429,
            "a profile or census is already being taken in this process; try again later\n",
        )
        .with_header("retry-after", "1".into()));
    }
    let value = f();
    shared.busy.store(false, Ordering::Release);
    Ok(value)
}

/// A parameter that is 0 or 1 (absent: 0).
fn flag(params: &Params, key: &str) -> Result<bool, Response> {
    match params.get(key) {
        None | Some("0") => Ok(false),
        Some("1") => Ok(true),
        Some(_) => Err(Response::text(400, &format!("{key} must be 0 or 1\n"))),
    }
}

fn pprof_file(body: Vec<u8>, name: &str) -> Response {
    Response {
        status: 200,
        content_type: "application/octet-stream",
        extra: vec![(
            "content-disposition",
            format!("attachment; filename=\"{name}.pb.gz\""),
        )],
        body,
    }
}

/// Every thread of the process (and its Ruby subprocesses), innermost frame first, as
/// `rubyspy snapshot --threads all` prints it.
fn threads(shared: &Shared) -> Response {
    let root = shared.config.pid;
    let mut pids = vec![root];
    if shared.config.subprocesses {
        pids.extend(descendants(root));
    }
    let mut text = String::new();
    for pid in pids {
        let attached = Spy::attach(pid).and_then(|mut spy| {
            let sample = spy.sample(ThreadSelection::All)?;
            Ok((spy.version().to_string(), sample))
        });
        let (
            version,
            Sample {
                threads, dropped, ..
            },
        ) = match attached {
            Ok(found) => found,
            Err(e) if pid == root => return Response::text(500, &format!("cannot read: {e}\n")),
            Err(_) => continue, // a child that is not Ruby, or gone
        };
        let role = worker_name(pid)
            .map(|w| format!(" (worker {w})"))
            .unwrap_or_default();
        let _ = writeln!(
            text,
            "Process {pid}{role}, Ruby {version}, {} threads\n",
            threads.len()
        );
        for t in &threads {
            let _ = writeln!(text, "{}: {}", thread_title(&t.info, pid), t.state.name());
            if !t.tags.is_empty() {
                let tags: Vec<String> = t.tags.iter().map(|(k, v)| format!("{k}={v}")).collect();
                let _ = writeln!(text, "    tags: {}", tags.join(" "));
            }
            for f in t.frames.iter() {
                let _ = writeln!(text, "    {}:{}:in '{}'", f.path, f.lineno, f.label);
            }
            text.push('\n');
        }
        if !dropped.is_empty() {
            let reasons: Vec<&str> = dropped.iter().map(|d| d.name()).collect();
            let _ = writeln!(
                text,
                "{} threads not shown, their stacks did not read: {}\n",
                dropped.len(),
                reasons.join(", ")
            );
        }
    }
    Response::text(200, &text)
}
