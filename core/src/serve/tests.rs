//! The listener's rules over real sockets. The process served is this test binary, which is
//! not Ruby: everything up to recording is checked here (spec/server_spec.rb records Ruby).
use super::*;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::time::Instant;

fn config(token: Option<&str>) -> ServeConfig {
    ServeConfig {
        addr: (Ipv4Addr::LOCALHOST, 0).into(),
        token: token.map(str::to_string),
        loopback: true,
        pid: std::process::id() as i32,
        subprocesses: false,
    }
}

/// The status line and body of one request sent as `raw`.
fn exchange(server: &Server, raw: &[u8]) -> (String, String) {
    let mut s = TcpStream::connect(server.addr()).unwrap();
    s.write_all(raw).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    (
        head.lines().next().unwrap_or("").to_string(),
        body.to_string(),
    )
}

fn get(server: &Server, target: &str, extra: &str) -> (String, String) {
    exchange(
        server,
        format!("GET {target} HTTP/1.1\r\nHost: x\r\n{extra}\r\n").as_bytes(),
    )
}

#[test]
fn paths_methods_parameters_and_tokens_get_their_answers() {
    let server = Server::start(config(Some("s3cret"))).unwrap();
    let (status, body) = get(&server, "/debug/pprof/", "");
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(body.contains("/debug/pprof/profile?seconds=N"), "{body}");
    assert_eq!(get(&server, "/debug/pprof", "").0, "HTTP/1.1 200 OK");
    assert_eq!(get(&server, "/", "").0, "HTTP/1.1 404 Not Found");
    assert_eq!(
        get(&server, "/debug/pprof/heap/../profile", "").0,
        "HTTP/1.1 404 Not Found"
    );
    let post = exchange(&server, b"POST /debug/pprof/ HTTP/1.1\r\n\r\n");
    assert_eq!(post.0, "HTTP/1.1 405 Method Not Allowed");
    // A wrong token is refused even from loopback; the right one in either place passes.
    assert_eq!(
        get(&server, "/debug/pprof/?token=nope", "").0,
        "HTTP/1.1 403 Forbidden"
    );
    assert_eq!(
        get(&server, "/debug/pprof/", "Authorization: Bearer nope\r\n").0,
        "HTTP/1.1 403 Forbidden"
    );
    assert_eq!(
        get(&server, "/debug/pprof/?token=s3cret", "").0,
        "HTTP/1.1 200 OK"
    );
    assert_eq!(
        get(&server, "/debug/pprof/", "Authorization: Bearer s3cret\r\n").0,
        "HTTP/1.1 200 OK"
    );
    // Through a proxy, loopback is no proof.
    assert_eq!(
        get(&server, "/debug/pprof/", "X-Forwarded-For: 1.2.3.4\r\n").0,
        "HTTP/1.1 403 Forbidden"
    );
    for bad in ["0", "61", "abc", "1.5", "-1", "9999999"] {
        let (status, body) = get(&server, &format!("/debug/pprof/profile?seconds={bad}"), "");
        assert_eq!(
            (status.as_str(), body.as_str()),
            (
                "HTTP/1.1 400 Bad Request",
                "seconds must be a whole number from 1 to 60\n"
            ),
            "{bad}"
        );
    }
    assert_eq!(
        get(&server, "/debug/pprof/profile?rate=5000", "").0,
        "HTTP/1.1 400 Bad Request"
    );
    assert_eq!(
        get(&server, "/debug/pprof/profile?debug=1", "").0,
        "HTTP/1.1 400 Bad Request"
    );
    assert_eq!(
        get(&server, "/debug/pprof/profile?seconds=1&seconds=2", "").0,
        "HTTP/1.1 400 Bad Request"
    );
    assert_eq!(
        get(&server, "/debug/pprof/threads?x=1", "").0,
        "HTTP/1.1 400 Bad Request"
    );
    // This test binary is not Ruby: the recording itself fails, and says so.
    let (status, body) = get(&server, "/debug/pprof/threads", "");
    assert_eq!(status, "HTTP/1.1 500 Internal Server Error");
    assert!(body.contains("not a Ruby process"), "{body}");
}

#[test]
fn slow_half_open_oversized_and_garbage_clients_are_answered_and_dropped() {
    let server = Server::start(config(None)).unwrap();
    // Half-open: connects, sends nothing; other clients are served meanwhile.
    let idle: Vec<TcpStream> = (0..4)
        .map(|_| TcpStream::connect(server.addr()).unwrap())
        .collect();
    assert_eq!(get(&server, "/debug/pprof/", "").0, "HTTP/1.1 200 OK");
    let big = format!("GET /debug/pprof/?{} HTTP/1.1\r\n\r\n", "a".repeat(20_000));
    assert!(exchange(&server, big.as_bytes())
        .0
        .starts_with("HTTP/1.1 431"));
    assert_eq!(
        exchange(&server, b"\x16\x03\x01garbage\r\n\r\n").0,
        "HTTP/1.1 400 Bad Request"
    );
    // A head that never ends within the deadline gets a 408.
    let mut slow = TcpStream::connect(server.addr()).unwrap();
    slow.write_all(b"GET /debug/pprof/ HTTP/1.1\r\n").unwrap();
    let started = std::time::Instant::now();
    let mut out = String::new();
    slow.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 408"), "{out}");
    let waited = started.elapsed();
    assert!(
        waited >= http::READ_DEADLINE - Duration::from_millis(100),
        "{waited:?}"
    );
    // The idle ones were closed at the deadline too: they read end-of-stream.
    for mut s in idle {
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut buf = Vec::new();
        assert!(
            s.read_to_end(&mut buf).is_ok(),
            "an idle client was not closed"
        );
    }
}

#[test]
fn a_port_in_use_and_an_open_bind_without_a_token_fail_at_start() {
    let first = Server::start(config(None)).unwrap();
    let taken = ServeConfig {
        addr: first.addr(),
        ..config(None)
    };
    let e = Server::start(taken).err().expect("the port is taken");
    assert!(matches!(e, Error::Listen { .. }), "{e:?}");
    assert!(
        e.to_string().contains(&first.addr().port().to_string()),
        "{e}"
    );
    let open = ServeConfig {
        addr: (Ipv4Addr::UNSPECIFIED, 0).into(),
        ..config(None)
    };
    let e = Server::start(open).err().expect("refused");
    assert!(e.to_string().contains("without a token"), "{e}");
    assert!(Server::start(config(Some(""))).is_err());
}

#[test]
fn stopping_closes_the_port() {
    let mut server = Server::start(config(None)).unwrap();
    let addr = server.addr();
    assert!(server.running());
    server.stop();
    assert!(!server.running());
    assert!(TcpStream::connect(addr).is_err());
    // The port can be taken again at once.
    let again = Server::start(ServeConfig {
        addr,
        ..config(None)
    });
    assert!(again.is_ok(), "{:?}", again.err());
}

/// Sixteen clients trickling their heads hold every slot; a seventeenth is served anyway, in
/// the place of one that had been sending its head for longer than `EVICT_AFTER`, which is
/// closed unanswered. The others get their 408 at the read deadline, as before.
#[test]
fn a_client_finds_room_when_every_slot_is_held_by_a_slow_head() {
    let server = Server::start(config(None)).unwrap();
    let slow: Vec<TcpStream> = (0..MAX_CONNECTIONS)
        .map(|_| {
            let mut s = TcpStream::connect(server.addr()).unwrap();
            s.write_all(b"GET /debug/pprof/ HTTP/1.1\r\n").unwrap();
            s
        })
        .collect();
    let full = Instant::now() + Duration::from_secs(30);
    while server.shared.connections.load(Ordering::Acquire) < MAX_CONNECTIONS {
        assert!(
            Instant::now() < full,
            "the slow clients were not all accepted"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(EVICT_AFTER);
    // Closed unanswered only if the listener is too loaded to see the slots free up in time.
    let try_get = || -> std::io::Result<String> {
        let mut s = TcpStream::connect(server.addr())?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        s.write_all(b"GET /debug/pprof/ HTTP/1.1\r\n\r\n")?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        Ok(out.lines().next().unwrap_or("").to_string())
    };
    let served = (0..20)
        .filter_map(|_| try_get().ok())
        .find(|status| !status.is_empty());
    assert_eq!(served.as_deref(), Some("HTTP/1.1 200 OK"));
    let answers: Vec<String> = slow
        .into_iter()
        .map(|mut s| {
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            out.lines().next().unwrap_or("").to_string()
        })
        .collect();
    let evicted = answers.iter().filter(|a| a.is_empty()).count();
    assert!(evicted >= 1, "{answers:?}");
    assert!(
        answers
            .iter()
            .all(|a| a.is_empty() || a.starts_with("HTTP/1.1 408")),
        "{answers:?}"
    );
}
