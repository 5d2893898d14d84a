//! The shared tier's connections for chunk values: `SET`s sent straight from the source memory
//! in one vectored write, `GET` replies read straight into the destination memory.
//!
//! The `redis` crate's synchronous parser reads a reply in 8 KiB steps (each zeroed first) and
//! copies every value into a fresh `Vec` that the caller copies again; measured on this
//! project's machine that is ~1.1 s of client CPU per GB read, four times the write path. A
//! chunk read is the one operation whose size matters, so its replies get this small reader:
//! a connection to the address and with the handshake (AUTH, SELECT) the crate parsed from the
//! URL, commands packed as usual, and each bulk reply read with one `read_exact` per
//! destination piece (one kernel copy, no user-space copy). Writes are sent with one `writev`
//! of the pieces (the protocol's framing and the caller's memory) and their `+OK` replies read
//! as lines, existence checks' integer replies likewise.
//!
//! **Deadlines end operations.** A connection carries the deadline of the operation it runs
//! ([`BulkConn::set_deadline`]): before every `read` and `write` system call the socket's
//! timeout is set to the time left, and an expired deadline fails the call at once. A server
//! that trickles bytes, floods, or never answers cannot keep an operation past its deadline
//! (a per-call socket timeout alone would restart with every byte). The caller drops the
//! connection of a failed operation.

use std::io::{self, IoSlice, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
#[cfg(unix)]
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use redis::{ConnectionAddr, ConnectionInfo};

/// Longest reply line (`$<len>`, `-ERR ...`) accepted.
const MAX_LINE: usize = 4096;
/// Size of the small-read buffer.
const BUF: usize = 64 << 10;

/// TLS of a connection (`rediss://`): the client configuration (trusted CAs) and the name
/// the server's certificate must carry.
#[derive(Clone, Debug)]
pub(crate) struct Tls {
    /// Client configuration.
    pub config: std::sync::Arc<rustls::ClientConfig>,
    /// The server's name (a host name or an IP address).
    pub name: rustls_pki_types::ServerName<'static>,
}

impl Tls {
    /// TLS to `host` (a name or an IP address), trusting the CA certificates of the PEM file
    /// `ca`; an error says why not.
    pub(crate) fn new(ca: &std::path::Path, host: &str) -> Result<Self, String> {
        use rustls_pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        let certs = rustls_pki_types::CertificateDer::pem_file_iter(ca)
            .map_err(|e| format!("{}: {e}", ca.display()))?;
        for c in certs {
            let c = c.map_err(|e| format!("{}: {e}", ca.display()))?;
            roots.add(c).map_err(|e| format!("{}: {e}", ca.display()))?;
        }
        if roots.is_empty() {
            return Err(format!("{}: no CA certificate in it", ca.display()));
        }
        // ring, not aws-lc-rs (whose post-quantum key exchange needs a cmake build).
        #[allow(deprecated)]
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let name = rustls_pki_types::ServerName::try_from(host.to_owned())
            .map_err(|e| format!("{host:?}: {e}"))?;
        Ok(Self {
            config: std::sync::Arc::new(config),
            name,
        })
    }
}

#[derive(Debug)]
enum Stream {
    Tcp(TcpStream),
    /// TLS over TCP: the socket's timeouts bound every read and write of the records too.
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
    #[cfg(unix)]
    Unix(UnixStream),
}

impl Stream {
    fn set_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
            Stream::Tls(s) => {
                s.sock.set_read_timeout(t)?;
                s.sock.set_write_timeout(t)
            }
            #[cfg(unix)]
            Stream::Unix(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Tls(s) => s.read(buf),
            #[cfg(unix)]
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Tls(s) => s.write(buf),
            #[cfg(unix)]
            Stream::Unix(s) => s.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write_vectored(bufs),
            Stream::Tls(s) => s.write_vectored(bufs),
            #[cfg(unix)]
            Stream::Unix(s) => s.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn protocol(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

fn late() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "deadline passed")
}

/// Sets `sock`'s timeouts to the time left before `deadline` (an error once it passed).
fn con_arm(sock: &TcpStream, deadline: Instant) -> io::Result<()> {
    let left = deadline
        .checked_duration_since(Instant::now())
        .filter(|d| *d >= Duration::from_micros(1))
        .ok_or_else(late)?;
    sock.set_read_timeout(Some(left))?;
    sock.set_write_timeout(Some(left))
}

/// One connection of the read path.
#[derive(Debug)]
pub(crate) struct BulkConn {
    stream: Stream,
    buf: Vec<u8>,
    pos: usize,
    end: usize,
    /// When the operation running on it must end.
    deadline: Instant,
    /// Cluster redirections (`MOVED …`, `ASK …`, without the `-`) answered to commands since
    /// they were last taken: each such command counts as refused (a write) or absent (a read).
    pub(crate) redirects: Vec<String>,
}

impl BulkConn {
    /// Connects to the server of `info` (over `tls` when given) and runs its handshake, both
    /// by `deadline` (which the connection keeps until [`BulkConn::set_deadline`]). A refusal
    /// (TLS, authentication) is an [`io::ErrorKind::InvalidData`] error.
    pub(crate) fn connect(
        info: &ConnectionInfo,
        tls: Option<&Tls>,
        deadline: Instant,
    ) -> io::Result<Self> {
        let left = || {
            deadline
                .checked_duration_since(Instant::now())
                .filter(|d| !d.is_zero())
                .ok_or_else(late)
        };
        let stream = match info.addr() {
            ConnectionAddr::Tcp(host, port) => {
                let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
                let mut found = None;
                for addr in (host.as_str(), *port).to_socket_addrs()? {
                    match TcpStream::connect_timeout(&addr, left()?) {
                        Ok(s) => {
                            found = Some(s);
                            break;
                        }
                        Err(e) => last = e,
                    }
                }
                let s = found.ok_or(last)?;
                s.set_nodelay(true)?;
                match tls {
                    None => Stream::Tcp(s),
                    Some(t) => {
                        let conn = rustls::ClientConnection::new(t.config.clone(), t.name.clone())
                            .map_err(|e| protocol(format!("TLS: {e}")))?;
                        Stream::Tls(Box::new(rustls::StreamOwned::new(conn, s)))
                    }
                }
            }
            #[cfg(unix)]
            ConnectionAddr::Unix(path) => Stream::Unix(UnixStream::connect(path)?),
            other => {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!("{other:?}: only TCP and Unix sockets"),
                ))
            }
        };
        let mut con = Self {
            stream,
            buf: vec![0; BUF],
            pos: 0,
            end: 0,
            deadline,
            redirects: Vec::new(),
        };
        let settings = info.redis_settings();
        let mut hello: Vec<Vec<u8>> = Vec::new();
        if let Some(pw) = settings.password() {
            let mut args = vec![&b"AUTH"[..]];
            if let Some(user) = settings.username() {
                args.push(user.as_bytes());
            }
            args.push(pw.as_bytes());
            hello.push(pack(&args));
        }
        if settings.db() != 0 {
            let db = settings.db().to_string();
            hello.push(pack(&[b"SELECT", db.as_bytes()]));
        }
        if let Stream::Tls(s) = &mut con.stream {
            // The TLS handshake, by the deadline; a refused certificate is InvalidData.
            while s.conn.is_handshaking() {
                con_arm(&s.sock, deadline)?;
                s.conn.complete_io(&mut s.sock).map_err(|e| {
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) {
                        e
                    } else {
                        protocol(format!("TLS handshake refused: {e}"))
                    }
                })?;
            }
        }
        for cmd in &hello {
            con.send(cmd)?;
        }
        for _ in &hello {
            let line = con.line()?;
            if line != b"+OK" {
                return Err(protocol(format!(
                    "handshake refused: {}",
                    String::from_utf8_lossy(&line)
                )));
            }
        }
        Ok(con)
    }

    /// Sets the deadline of the operation about to run: every read and write after it fails
    /// once it passed.
    pub(crate) fn set_deadline(&mut self, deadline: Instant) {
        self.deadline = deadline;
    }

    /// Sets the socket's timeouts to the time left before the deadline (an error once it
    /// passed): called before every system call that may block.
    fn arm(&self) -> io::Result<()> {
        let left = self
            .deadline
            .checked_duration_since(Instant::now())
            .filter(|d| *d >= Duration::from_micros(1))
            .ok_or_else(late)?;
        self.stream.set_timeout(Some(left))
    }

    /// One `read` system call within the deadline.
    fn read_some(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            self.arm()?;
            match self.stream.read(buf) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                other => return other,
            }
        }
    }

    /// Sends `bytes`.
    pub(crate) fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.send_all(&[bytes])
    }

    /// Sends the concatenation of `pieces` with as few `writev` calls as the socket takes.
    pub(crate) fn send_all(&mut self, pieces: &[&[u8]]) -> io::Result<()> {
        // At most IOV_MAX (1024) slices per call.
        for group in pieces.chunks(1024) {
            let mut slices: Vec<IoSlice<'_>> = group.iter().map(|p| IoSlice::new(p)).collect();
            let mut rest = &mut slices[..];
            IoSlice::advance_slices(&mut rest, 0); // drops leading empty pieces
            while !rest.is_empty() {
                self.arm()?;
                match self.stream.write_vectored(rest) {
                    Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                    Ok(n) => IoSlice::advance_slices(&mut rest, n),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }

    /// Whether `line` is a cluster redirection; if so it is kept in [`Self::redirects`].
    fn redirected(&mut self, line: &[u8]) -> bool {
        let is = line.starts_with(b"-MOVED ") || line.starts_with(b"-ASK ");
        if is {
            self.redirects
                .push(String::from_utf8_lossy(&line[1..]).into_owned());
        }
        is
    }

    /// The next reply as a status: `Ok(true)` for `+OK`, `Ok(false)` for a server error (the
    /// connection stays usable); any other reply is a protocol error.
    pub(crate) fn status(&mut self) -> io::Result<bool> {
        let line = self.line()?;
        match line.first() {
            _ if line == b"+OK" => Ok(true),
            Some(b'-') => {
                self.redirected(&line);
                Ok(false)
            }
            _ => Err(protocol(format!(
                "unexpected reply: {}",
                String::from_utf8_lossy(&line[..line.len().min(200)])
            ))),
        }
    }

    /// Reads one CRLF-terminated line (without the CRLF).
    fn line(&mut self) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        loop {
            if self.pos == self.end {
                self.pos = 0;
                self.end = 0;
                let mut buf = std::mem::take(&mut self.buf);
                let got = self.read_some(&mut buf);
                self.buf = buf;
                self.end = got?;
                if self.end == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
            }
            let avail = &self.buf[self.pos..self.end];
            if let Some(i) = avail.iter().position(|&b| b == b'\n') {
                out.extend_from_slice(&avail[..i]);
                self.pos += i + 1;
                if out.pop() != Some(b'\r') {
                    return Err(protocol("reply line without CR".into()));
                }
                return Ok(out);
            }
            out.extend_from_slice(avail);
            self.pos = self.end;
            if out.len() > MAX_LINE {
                return Err(protocol("reply line too long".into()));
            }
        }
    }

    /// The next reply's bulk length: `Some(n)`, or `None` for a nil reply. A server error or
    /// any other reply type is an error.
    pub(crate) fn bulk_len(&mut self) -> io::Result<Option<usize>> {
        let line = self.line()?;
        match line.first() {
            Some(b'$') if line == b"$-1" => Ok(None),
            Some(b'$') => std::str::from_utf8(&line[1..])
                .ok()
                .and_then(|s| s.parse().ok())
                .map(Some)
                .ok_or_else(|| protocol("bad bulk length".into())),
            Some(b'_') => Ok(None),
            Some(b'-') if self.redirected(&line) => Ok(None),
            _ => Err(protocol(format!(
                "unexpected reply: {}",
                String::from_utf8_lossy(&line[..line.len().min(200)])
            ))),
        }
    }

    /// Fills `dst` with the next bytes of the reply.
    pub(crate) fn read_into(&mut self, mut dst: &mut [u8]) -> io::Result<()> {
        let n = dst.len().min(self.end - self.pos);
        dst[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        dst = &mut dst[n..];
        while !dst.is_empty() {
            match self.read_some(dst)? {
                0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                k => dst = &mut dst[k..],
            }
        }
        Ok(())
    }

    /// The next reply as an integer (`:<n>`); a server error is `Ok(None)` (the connection
    /// stays usable), any other reply a protocol error.
    pub(crate) fn int(&mut self) -> io::Result<Option<i64>> {
        let line = self.line()?;
        match line.first() {
            Some(b':') => std::str::from_utf8(&line[1..])
                .ok()
                .and_then(|s| s.parse().ok())
                .map(Some)
                .ok_or_else(|| protocol("bad integer reply".into())),
            Some(b'-') => {
                self.redirected(&line);
                Ok(None)
            }
            _ => Err(protocol(format!(
                "unexpected reply: {}",
                String::from_utf8_lossy(&line[..line.len().min(200)])
            ))),
        }
    }

    /// The next reply as a whole value (small replies only: `CLUSTER SLOTS`); nesting and
    /// lengths are bounded.
    pub(crate) fn value(&mut self) -> io::Result<Value> {
        self.value_at(0)
    }

    fn value_at(&mut self, depth: usize) -> io::Result<Value> {
        if depth > 8 {
            return Err(protocol("reply nested too deep".into()));
        }
        let line = self.line()?;
        let num = |s: &[u8]| -> io::Result<i64> {
            std::str::from_utf8(s)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| protocol("bad length".into()))
        };
        let text = || String::from_utf8_lossy(&line[1..]).into_owned();
        Ok(match line.first() {
            Some(b'+') => Value::Text(text()),
            Some(b'-') => Value::Error(text()),
            Some(b':') => Value::Int(num(&line[1..])?),
            Some(b'_') => Value::Nil,
            Some(b'$') => match num(&line[1..])? {
                -1 => Value::Nil,
                n if (0..=1 << 20).contains(&n) => {
                    let mut v = vec![0u8; n as usize];
                    self.read_into(&mut v)?;
                    self.end_bulk()?;
                    Value::Text(String::from_utf8_lossy(&v).into_owned())
                }
                _ => return Err(protocol("bulk reply too long".into())),
            },
            Some(b'*') => match num(&line[1..])? {
                -1 => Value::Nil,
                n if (0..=1 << 16).contains(&n) => Value::Array(
                    (0..n)
                        .map(|_| self.value_at(depth + 1))
                        .collect::<io::Result<_>>()?,
                ),
                _ => return Err(protocol("array reply too long".into())),
            },
            _ => return Err(protocol(format!("unexpected reply: {}", text()))),
        })
    }

    /// Discards the next `n` bytes of the reply.
    pub(crate) fn skip(&mut self, mut n: usize) -> io::Result<()> {
        let mut scratch = vec![0u8; n.min(BUF)];
        while n > 0 {
            let k = n.min(scratch.len());
            self.read_into(&mut scratch[..k])?;
            n -= k;
        }
        Ok(())
    }

    /// Reads the CRLF that ends a bulk reply.
    pub(crate) fn end_bulk(&mut self) -> io::Result<()> {
        let mut crlf = [0u8; 2];
        self.read_into(&mut crlf)?;
        if crlf == *b"\r\n" {
            Ok(())
        } else {
            Err(protocol("bulk reply without CRLF".into()))
        }
    }
}

/// A whole reply, for the few small replies read as values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Value {
    /// A simple string or a bulk string (lossy UTF-8).
    Text(String),
    /// A server error, without the `-`.
    Error(String),
    /// An integer.
    Int(i64),
    /// A nil reply.
    Nil,
    /// An array.
    Array(Vec<Value>),
}

/// One command in the Redis protocol.
pub(crate) fn pack(args: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    out
}
