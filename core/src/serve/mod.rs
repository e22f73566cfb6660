//! The pprof listener: a port of its own, as Go's net/http/pprof has, that serves profiles
//! of this process and its Ruby subprocesses (a preforking server's workers) to scrapers
//! (`go tool pprof`, Grafana Alloy, Parca).
//!
//! It runs on native threads that never touch Ruby: one accepts connections, and each
//! connection gets a short-lived thread of its own (at most `MAX_CONNECTIONS` at once), which
//! reads one request (`http.rs`), answers it (`routes.rs`) and closes. So it answers while
//! every Ruby thread is busy, or while one holds the GVL in a C loop: the recording reads the
//! process from outside its VM, as `crate::record` always does.
//!
//! Fork safety: a forked child (a Puma worker) must not keep the listening socket open, or
//! the port would outlive the process that serves it. Every socket the listener holds is in
//! `OPEN_FDS`, and a `pthread_atfork` child handler closes them all; the child has none of
//! the listener's threads (fork copies only the calling thread), and a [`Server`] value it
//! inherited reports itself stopped there and never joins or closes anything.
mod http;
mod routes;
#[cfg(test)]
mod tests;
mod tracked;

pub use tracked::{provide_allocations, AllocsAnswer, AllocsRequest};

use crate::error::{Error, Result};
use crate::sync::locked;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Connections served at once. A scraper makes one at a time, so this only bounds what many
/// clients can hold (a thread and a socket each). One more takes the place of the oldest
/// still sending its request head after `EVICT_AFTER`, or is closed unanswered.
pub const MAX_CONNECTIONS: usize = 16;
/// How long a client may have been sending its request head before a new client can take
/// its place: a scraper sends its head at once, so one still sending after a second is slow
/// or hostile, and 16 of those would otherwise hold every slot for the whole read deadline.
const EVICT_AFTER: Duration = Duration::from_secs(1);
/// How long a new client waits for an evicted connection's thread to give its slot back.
const ROOM_WAIT: Duration = Duration::from_millis(200);
/// How often the accepting thread looks at the stop flag while no client connects.
const POLL_EVERY: Duration = Duration::from_millis(100);

/// What a listener serves, and to whom.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub addr: SocketAddr,
    /// The secret a client sends as `?token=` or `Authorization: Bearer`; None serves
    /// loopback clients only.
    pub token: Option<String>,
    /// Serve loopback clients that bring no token (not through a proxy).
    pub loopback: bool,
    /// The process recorded: the one serving, as a rule.
    pub pid: i32,
    /// Record its Ruby subprocesses too (a preforking server's workers).
    pub subprocesses: bool,
}

impl ServeConfig {
    /// Refuses what would open the process's stacks to the network.
    fn validate(&self) -> Result<()> {
        if self.token.as_deref() == Some("") {
            return Err(Error::InvalidArgument(
                "the token must not be empty: leave it out to serve loopback clients only".into(),
            ));
        }
        if self.token.is_none() && !self.addr.ip().to_canonical().is_loopback() {
            return Err(Error::InvalidArgument(format!(
                "refusing to serve profiles on {} without a token: anyone who reaches it would \
                 read this process's stacks; bind to 127.0.0.1, or pass a token",
                self.addr
            )));
        }
        if self.token.is_none() && !self.loopback {
            return Err(Error::InvalidArgument(
                "with no token and loopback clients refused, nobody could be served".into(),
            ));
        }
        Ok(())
    }
}

/// What the accepting thread and the connection threads share.
struct Shared {
    config: ServeConfig,
    stop: AtomicBool,
    /// A profile is being recorded (one at a time: 429 for another).
    busy: AtomicBool,
    connections: AtomicUsize,
    /// Connections still reading their request head, oldest first: (socket, accepted). A
    /// socket is open while listed (see `Conn`), so no two entries share one.
    reading: Mutex<Vec<(i32, Instant)>>,
}

/// A running listener; stopping it (or dropping it) closes the port. A profile being
/// recorded when it stops runs to its end on its own thread.
pub struct Server {
    shared: Arc<Shared>,
    addr: SocketAddr,
    accept: Option<JoinHandle<()>>,
    /// The process that started it: in a forked child it is not running.
    owner: u32,
}

impl Server {
    /// Binds the address (errors name it) and starts accepting on a native thread.
    pub fn start(config: ServeConfig) -> Result<Server> {
        config.validate()?;
        let listener = TcpListener::bind(config.addr).map_err(|e| Error::Listen {
            addr: config.addr.to_string(),
            source: e,
        })?;
        let addr = listener.local_addr().unwrap_or(config.addr);
        listener.set_nonblocking(true).map_err(|e| Error::Listen {
            addr: addr.to_string(),
            source: e,
        })?;
        close_in_forked_children();
        let fd = OpenFd::new(listener.as_raw_fd());
        let shared = Arc::new(Shared {
            config,
            stop: AtomicBool::new(false),
            busy: AtomicBool::new(false),
            connections: AtomicUsize::new(0),
            reading: Mutex::new(Vec::new()),
        });
        let s = shared.clone();
        let accept = std::thread::Builder::new()
            .name("rbspy_ext pprof".into())
            .spawn(move || {
                let _fd = fd; // unregistered before the listener closes (dropped first)
                accept_loop(&listener, &s)
            })
            .map_err(|e| Error::Listen {
                addr: addr.to_string(),
                source: e,
            })?;
        Ok(Server {
            shared,
            addr,
            accept: Some(accept),
            owner: std::process::id(),
        })
    }

    /// The address it listens on (with the port the system chose for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// False once stopped, and in a process forked from the one that started it.
    pub fn running(&self) -> bool {
        std::process::id() == self.owner && self.accept.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Closes the port (within `POLL_EVERY`). Connections being answered finish on their own.
    pub fn stop(&mut self) {
        if std::process::id() != self.owner {
            // The accepting thread is the parent's; the child's copy of the socket was
            // closed at fork.
            if let Some(t) = self.accept.take() {
                std::mem::forget(t);
            }
            return;
        }
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// How far a request head gets through the listener without the process behind it: parsed
/// (None while incomplete), routed, its query decoded. The status it is refused with, or
/// 200 when it would go on to be served. What the fuzz target `http_request` drives: the
/// head and query are the only bytes a client controls.
pub fn screen(head: &[u8]) -> Option<u16> {
    match http::parse_head(head) {
        Ok(None) => None,
        Err(_) => Some(400),
        Ok(Some(request)) => Some(routes::route(&request).map_or_else(|r| r.status, |_| 200)),
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    while !shared.stop.load(Ordering::Relaxed) {
        let mut pfd = libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, for the duration of the call.
        let ready = unsafe { libc::poll(&mut pfd, 1, POLL_EVERY.as_millis() as i32) };
        if ready <= 0 {
            continue;
        }
        let Ok((stream, peer)) = listener.accept() else {
            continue;
        };
        // Only this thread adds connections, so a slot seen free stays free until taken.
        if shared.connections.load(Ordering::Acquire) >= MAX_CONNECTIONS && !make_room(shared) {
            continue; // closed unanswered: every slot is held by a client that sent its head
        }
        shared.connections.fetch_add(1, Ordering::AcqRel);
        let conn = Conn::new(stream, shared.clone());
        // A thread that cannot start drops its `Conn`, which gives the slot back.
        let _ = std::thread::Builder::new()
            .name("rbspy_ext pprof conn".into())
            .spawn(move || serve_connection(conn, peer));
    }
}

/// Frees a slot by closing the oldest connection that has been reading its request head for
/// at least `EVICT_AFTER` (its thread reads end-of-stream and ends unanswered), then waits
/// up to `ROOM_WAIT` for that thread to give the slot back.
fn make_room(shared: &Shared) -> bool {
    {
        let mut reading = locked(&shared.reading);
        let Some(i) = reading.iter().position(|r| r.1.elapsed() >= EVICT_AFTER) else {
            return false;
        };
        let (fd, _) = reading.remove(i);
        // SAFETY: the socket is open: its `Conn` leaves this list, under this lock, before it
        // closes it. shutdown ends the connection without closing the descriptor.
        unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
    }
    let until = Instant::now() + ROOM_WAIT;
    while shared.connections.load(Ordering::Acquire) >= MAX_CONNECTIONS {
        if Instant::now() >= until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

/// An accepted connection: listed in `Shared::reading` until its head is read, and counted
/// in `Shared::connections` until it ends. It leaves the list before its socket closes (the
/// fields drop after `drop`), so an eviction never shuts down a descriptor reused since.
struct Conn {
    stream: TcpStream,
    shared: Arc<Shared>,
}

impl Conn {
    fn new(stream: TcpStream, shared: Arc<Shared>) -> Conn {
        locked(&shared.reading).push((stream.as_raw_fd(), Instant::now()));
        Conn { stream, shared }
    }

    /// Out of the list of evictable connections: its head is in.
    fn head_read(&self) {
        let mut reading = locked(&self.shared.reading);
        let fd = self.stream.as_raw_fd();
        reading.retain(|r| r.0 != fd);
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.head_read();
        self.shared.connections.fetch_sub(1, Ordering::AcqRel);
    }
}

fn serve_connection(mut conn: Conn, peer: SocketAddr) {
    let stream = &mut conn.stream;
    // Accepted sockets inherit the listener's non-blocking mode on some systems.
    let _ = stream.set_nonblocking(false);
    let _fd = OpenFd::new(stream.as_raw_fd()); // dropped (unregistered) before the stream
    let read = http::read_request(stream, http::READ_DEADLINE);
    conn.head_read();
    let stream = &mut conn.stream;
    let request = match read {
        Ok(r) => r,
        Err(e) => {
            if let Some(response) = e.response() {
                response.send(stream, false);
            }
            return;
        }
    };
    let response = routes::respond(&conn.shared, &request, peer);
    response.send(stream, request.method == "HEAD");
}

/// The sockets the listener holds, closed in a forked child (see the module docs). A fixed
/// table of atomics, since the child handler runs right after fork, where taking a lock that
/// another thread held at the fork would never return.
static OPEN_FDS: [AtomicI32; MAX_CONNECTIONS + 8] =
    [const { AtomicI32::new(-1) }; MAX_CONNECTIONS + 8];

/// A socket in `OPEN_FDS` while this lives.
struct OpenFd(Option<usize>);

impl OpenFd {
    fn new(fd: i32) -> OpenFd {
        OpenFd(OPEN_FDS.iter().position(|slot| {
            slot.compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        }))
    }
}

impl Drop for OpenFd {
    fn drop(&mut self) {
        if let Some(i) = self.0 {
            OPEN_FDS[i].store(-1, Ordering::Release);
        }
    }
}

extern "C" fn close_listener_sockets() {
    for slot in &OPEN_FDS {
        let fd = slot.swap(-1, Ordering::AcqRel);
        if fd >= 0 {
            // SAFETY: close is async-signal-safe; the fd is the child's copy of a socket of
            // the parent's listener, which nothing in the child uses.
            unsafe { libc::close(fd) };
        }
    }
}

fn close_in_forked_children() {
    static REGISTER: Once = Once::new();
    REGISTER.call_once(|| {
        // SAFETY: registers a child handler that only closes descriptors.
        unsafe { libc::pthread_atfork(None, None, Some(close_listener_sockets)) };
    });
}
