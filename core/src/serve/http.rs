//! The little of HTTP/1.1 the listener speaks: it reads one request head, bounded in size
//! and in time, and writes one response, then closes the connection (`Connection: close`).
//! No bodies are read (only GET and HEAD are served), no keep-alive, no chunking: a scraper
//! asks for one profile per connection, and anything longer-lived would be one more way for
//! a client to hold a thread.
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Largest request head accepted (Go's net/http allows 1 MB; a scrape's is ~200 bytes).
pub const MAX_HEAD: usize = 8 * 1024;
/// A client has this long to send its whole request head (a slow or half-open client is
/// dropped after it, whatever it sends in between).
pub const READ_DEADLINE: Duration = Duration::from_secs(5);
/// A response a client does not take within this long is dropped.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_HEADERS: usize = 32;

/// What the listener needs of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    pub path: String,
    /// The raw query string (after `?`), empty when none.
    pub query: String,
    /// `Authorization: Bearer X`'s X.
    pub bearer: Option<String>,
    /// It came through a proxy (`X-Forwarded-For` or `Forwarded`).
    pub forwarded: bool,
}

/// Why no request could be read; each but `Closed` is answered before closing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadError {
    /// The client closed or reset the connection, or sent nothing in time.
    Closed,
    /// The head did not arrive within `READ_DEADLINE` (408).
    Timeout,
    /// The head is larger than `MAX_HEAD` (431).
    TooLarge,
    /// Not HTTP/1.x (400).
    Malformed,
}

impl ReadError {
    /// The response to send, if any.
    pub fn response(&self) -> Option<Response> {
        match self {
            ReadError::Closed => None,
            ReadError::Timeout => Some(Response::text(408, "request head not received in time\n")),
            ReadError::TooLarge => Some(Response::text(
                431,
                &format!("request head larger than {MAX_HEAD} bytes\n"),
            )),
            ReadError::Malformed => Some(Response::text(400, "malformed HTTP request\n")),
        }
    }
}

/// Reads one request head from `stream` within `deadline` of now.
pub fn read_request(stream: &mut TcpStream, deadline: Duration) -> Result<Request, ReadError> {
    let until = Instant::now() + deadline;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(if buf.is_empty() {
                ReadError::Closed
            } else {
                ReadError::Timeout
            });
        }
        // A read timeout of what is left of the deadline: a client trickling one byte a
        // second still runs out of time.
        stream
            .set_read_timeout(Some(left))
            .map_err(|_| ReadError::Closed)?;
        let n = match stream.read(&mut chunk) {
            Ok(0) => return Err(ReadError::Closed),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue; // the deadline check above decides
            }
            Err(_) => return Err(ReadError::Closed),
        };
        buf.extend_from_slice(&chunk[..n]);
        if let Some(request) = parse_head(&buf)? {
            return Ok(request);
        }
        if buf.len() > MAX_HEAD {
            return Err(ReadError::TooLarge);
        }
    }
}

/// The request in `buf`, or None while its head is incomplete.
pub fn parse_head(buf: &[u8]) -> Result<Option<Request>, ReadError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Partial) => Ok(None),
        Ok(httparse::Status::Complete(_)) => {
            let target = req.path.unwrap_or("/");
            let (path, query) = target.split_once('?').unwrap_or((target, ""));
            let header = |name: &str| {
                req.headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case(name))
                    .map(|h| String::from_utf8_lossy(h.value).trim().to_string())
            };
            Ok(Some(Request {
                method: req.method.unwrap_or("").to_string(),
                path: path.to_string(),
                query: query.to_string(),
                bearer: header("authorization")
                    .and_then(|v| v.strip_prefix("Bearer ").map(|t| t.trim().to_string())),
                forwarded: header("x-forwarded-for").is_some() || header("forwarded").is_some(),
            }))
        }
        Err(httparse::Error::TooManyHeaders) => Err(ReadError::TooLarge),
        Err(_) => Err(ReadError::Malformed),
    }
}

/// One response: a status, its headers and a body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub extra: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn text(status: u16, body: &str) -> Response {
        Response {
            status,
            content_type: "text/plain; charset=utf-8",
            extra: Vec::new(),
            body: body.as_bytes().to_vec(),
        }
    }

    pub fn with_header(mut self, name: &'static str, value: String) -> Response {
        self.extra.push((name, value));
        self
    }

    /// Writes the response (its head alone for HEAD) and closes both directions, so the
    /// client sees the end even if a forked child holds a copy of the socket.
    pub fn send(&self, stream: &mut TcpStream, head_only: bool) {
        let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
        let mut head = format!(
            "HTTP/1.1 {} {}\r\ncontent-type: {}\r\ncontent-length: {}\r\nconnection: close\r\n",
            self.status,
            reason(self.status),
            self.content_type,
            self.body.len()
        );
        for (name, value) in &self.extra {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        let _ = stream.write_all(head.as_bytes());
        if !head_only {
            let _ = stream.write_all(&self.body);
        }
        let _ = stream.flush();
        let _ = stream.shutdown(std::net::Shutdown::Both);
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scrape_head_parses_with_its_query_token_and_proxy_headers() {
        let head = b"GET /debug/pprof/profile?seconds=15&token=a%2Fb HTTP/1.1\r\n\
                     Host: x\r\nAuthorization: Bearer s3cret\r\nX-Forwarded-For: 1.2.3.4\r\n\r\n";
        let r = parse_head(head).unwrap().unwrap();
        assert_eq!(r.method, "GET");
        assert_eq!(r.path, "/debug/pprof/profile");
        assert_eq!(r.query, "seconds=15&token=a%2Fb");
        assert_eq!(r.bearer.as_deref(), Some("s3cret"));
        assert!(r.forwarded);
        let plain = parse_head(b"GET / HTTP/1.0\r\n\r\n").unwrap().unwrap();
        assert_eq!((plain.bearer, plain.forwarded), (None, false));
    }

    #[test]
    fn partial_heads_wait_and_garbage_is_malformed() {
        assert_eq!(parse_head(b"GET /debug/pprof/ HTTP/1.1\r\nHo"), Ok(None));
        assert_eq!(
            parse_head(b"\x16\x03\x01\x02\x00"),
            Err(ReadError::Malformed)
        );
        let many: String = (0..40).map(|i| format!("X-{i}: y\r\n")).collect();
        let head = format!("GET / HTTP/1.1\r\n{many}\r\n");
        assert_eq!(parse_head(head.as_bytes()), Err(ReadError::TooLarge));
    }
}
