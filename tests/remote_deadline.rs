//! The shared tier's deadline ends every operation in wall time, whatever the server does: a
//! fake server on loopback that trickles a byte every 50 ms, floods, sends a value larger than
//! a chunk, or never answers. Each operation (write, existence check, read) must end within
//! its deadline plus 100 ms, fail, and drop its connection. A per-read socket timeout alone
//! (restarted by every byte) kept a trickling server's operation alive until the server gave
//! up; a value larger than the chunk was read to its end.
//!
//! The fake server gives up after [`SERVER_LIFE`] (it closes every connection), so a client
//! that does not keep its deadline fails these tests in bounded time instead of hanging.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::thread::{self, sleep};
use std::time::{Duration, Instant};

use kvoffload::tier::header::HEADER_LEN;
use kvoffload::tier::remote::{ReadOutcome, RemoteClient, RemoteConfig};

mod support;
use support::remote::{key, read, write, Cut};

/// The client's deadline.
const DEADLINE: Duration = Duration::from_millis(300);
/// How far past its deadline an operation may end (waking up, closing the connection).
const SLACK: Duration = Duration::from_millis(100);
/// How long the fake server keeps a connection open before it closes it.
const SERVER_LIFE: Duration = Duration::from_secs(5);
/// Bytes of the test's chunk.
const LEN: usize = 4096;

/// What the fake server sends on every connection, whatever it is asked.
#[derive(Clone, Copy, Debug)]
enum Behaviour {
    /// A reply line that never ends (`+OOO...`), one byte every 50 ms.
    TrickleLine,
    /// The header of a bulk reply as long as the chunk and its header, then its bytes one
    /// every 50 ms.
    TrickleValue,
    /// A bulk reply of a terabyte, sent as fast as the socket takes it.
    Flood,
    /// A complete bulk reply one byte longer than the chunk and its header.
    Oversized,
    /// Nothing at all (the requests are read and ignored).
    Silent,
}

/// A fake server: accepts connections and answers each as `how` says, until
/// [`SERVER_LIFE`] passed; returns its port and the count of connections accepted.
fn server(how: Behaviour) -> (u16, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&accepted);
    thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(s) = s else { return };
            count.fetch_add(1, SeqCst);
            thread::spawn(move || serve(s, how));
        }
    });
    (port, accepted)
}

fn serve(mut s: TcpStream, how: Behaviour) {
    let start = Instant::now();
    // Requests are drained so that the client's writes never block on a full buffer.
    let mut reader = s.try_clone().unwrap();
    thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 16];
        while matches!(reader.read(&mut buf), Ok(n) if n > 0) {}
    });
    let alive = || start.elapsed() < SERVER_LIFE;
    // Replies start once a request arrived.
    sleep(Duration::from_millis(5));
    let trickle = |s: &mut TcpStream, head: &[u8]| {
        if s.write_all(head).is_err() {
            return;
        }
        while alive() && s.write_all(b"O").is_ok() {
            sleep(Duration::from_millis(50));
        }
    };
    match how {
        Behaviour::TrickleLine => trickle(&mut s, b"+"),
        Behaviour::TrickleValue => trickle(&mut s, format!("${}\r\n", LEN + HEADER_LEN).as_bytes()),
        Behaviour::Flood => {
            let zeros = vec![0u8; 1 << 16];
            let _ = s.write_all(format!("${}\r\n", 1u64 << 40).as_bytes());
            while alive() && s.write_all(&zeros).is_ok() {}
        }
        Behaviour::Oversized => {
            let mut reply = format!("${}\r\n", LEN + HEADER_LEN + 1).into_bytes();
            reply.resize(reply.len() + LEN + HEADER_LEN + 1, 7);
            reply.extend_from_slice(b"\r\n");
            let _ = s.write_all(&reply);
            while alive() {
                sleep(Duration::from_millis(20));
            }
        }
        Behaviour::Silent => {
            while alive() {
                sleep(Duration::from_millis(20));
            }
        }
    }
    let _ = s.shutdown(std::net::Shutdown::Both);
}

fn client(port: u16) -> RemoteClient {
    let mut cfg = RemoteConfig::new(&format!("redis://127.0.0.1:{port}"));
    cfg.connections = 1;
    cfg.deadline = DEADLINE;
    cfg.probation_after = 1000;
    RemoteClient::new(cfg).unwrap()
}

/// The three operations, each checked to fail within the deadline and the slack.
#[derive(Clone, Copy, Debug)]
enum Op {
    Write,
    Exists,
    Read,
}

/// Runs `op` against a server behaving as `how`: it must fail, and end in time.
fn ends_in_time(how: Behaviour, op: Op) {
    let (port, _) = server(how);
    let c = client(port);
    let t = Instant::now();
    let failed = match op {
        Op::Write => write(&c, 7, &[42], &[vec![1u8; LEN]], Cut::Whole) == vec![false],
        Op::Exists => c.exists(7, &[key(42)]).is_none(),
        Op::Read => read(&c, 7, &[42], |_| LEN, Cut::Whole).0 == vec![ReadOutcome::Failed],
    };
    let took = t.elapsed();
    assert!(
        took <= DEADLINE + SLACK,
        "{op:?} against {how:?} took {took:?}, deadline {DEADLINE:?}"
    );
    assert!(failed, "{op:?} against {how:?} must fail");
}

#[test]
fn a_trickling_server_cannot_keep_an_operation_past_its_deadline() {
    for op in [Op::Write, Op::Exists, Op::Read] {
        ends_in_time(Behaviour::TrickleLine, op);
    }
    ends_in_time(Behaviour::TrickleValue, Op::Read);
}

#[test]
fn a_flooding_server_cannot_keep_an_operation_past_its_deadline() {
    for op in [Op::Write, Op::Exists, Op::Read] {
        ends_in_time(Behaviour::Flood, op);
    }
}

#[test]
fn a_silent_server_cannot_keep_an_operation_past_its_deadline() {
    for op in [Op::Write, Op::Exists, Op::Read] {
        ends_in_time(Behaviour::Silent, op);
    }
}

#[test]
fn a_value_longer_than_a_chunk_fails_the_read_and_drops_the_connection() {
    let (port, accepted) = server(Behaviour::Oversized);
    let c = client(port);
    for round in 1..=2 {
        let t = Instant::now();
        let (out, _) = read(&c, 7, &[42], |_| LEN, Cut::Whole);
        assert_eq!(out, vec![ReadOutcome::Failed]);
        assert!(t.elapsed() <= DEADLINE + SLACK, "took {:?}", t.elapsed());
        // Each read needed a new connection: the one that carried the long value is gone.
        assert_eq!(accepted.load(SeqCst), round);
    }
    let s = c.stats();
    assert_eq!((s.failed_reads, s.checksum_mismatches), (2, 0));
}
