//! What the shared tier's client puts on the wire, seen by a scripted fake server: each
//! pipeline of large values is preceded by the next pipeline's lead (its framing up to the
//! large value's length line) and nothing more, so Redis reads that lead alone and keeps each
//! value without copying it; a connection that breaks takes the lead with it.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread::{self, sleep};
use std::time::{Duration, Instant};

/// How long the fake server waits for the next command's lead before it replies: a bound
/// only (the lead of a command that follows is waited for, not timed), far past any stall of a
/// loaded machine (2 s was not).
const LEAD_WAIT: Duration = Duration::from_secs(30);
/// After the last command no lead can come: how long the server looks for stray bytes then.
const LAST_WAIT: Duration = Duration::from_secs(2);

use kvoffload::tier::remote::{value_key, RemoteClient, RemoteConfig};

mod support;
use support::remote::{self, key, Cut};

/// Length of a complete command at the start of `buf`, if one is there.
fn command_len(buf: &[u8]) -> Option<usize> {
    let line = |at: usize| -> Option<(usize, usize)> {
        let end = buf[at..].windows(2).position(|w| w == b"\r\n")? + at;
        let n = std::str::from_utf8(&buf[at + 1..end]).ok()?.parse().ok()?;
        Some((n, end + 2))
    };
    assert_eq!(buf.first(), Some(&b'*'), "a command starts with '*'");
    let (args, mut at) = line(0)?;
    for _ in 0..args {
        assert_eq!(buf.get(at), Some(&b'$'), "an argument starts with '$'");
        let (len, start) = line(at)?;
        at = start + len + 2;
        if at > buf.len() {
            return None;
        }
    }
    Some(at)
}

/// Whether `buf` holds exactly a lead: a command's framing up to its last argument's length
/// line, and none of that argument's bytes.
fn is_lead(buf: &[u8]) -> bool {
    let line = |at: usize| -> Option<(usize, usize)> {
        let end = buf.get(at..)?.windows(2).position(|w| w == b"\r\n")? + at;
        let n = std::str::from_utf8(&buf[at + 1..end]).ok()?.parse().ok()?;
        Some((n, end + 2))
    };
    let Some((args, mut at)) = line(0) else {
        return false;
    };
    for arg in 0..args {
        let Some((len, start)) = line(at) else {
            return false;
        };
        if arg + 1 == args {
            return start == buf.len();
        }
        at = start + len + 2;
    }
    false
}

/// What one connection of the fake server saw.
#[derive(Debug, Default)]
struct Seen {
    /// Per command answered: the bytes after it that had arrived when the reply went out.
    ahead: Vec<Vec<u8>>,
}

/// A fake server for `connections` connections, one after the other: it answers each
/// complete command `+OK` once the next command's lead has arrived (or `LEAD_WAIT` passed
/// without one; `LAST_WAIT` after the command that starts with `last`, the client's last) and
/// then `pause` more, and closes a connection after `replies[i]` replies (`None`: when the
/// client does). Waiting for the lead, not for a fixed time, keeps a slow client (a loaded
/// machine) from reading as one that sent nothing ahead.
fn fake_server(
    replies: Vec<Option<usize>>,
    pause: Duration,
    last: Vec<u8>,
) -> (u16, thread::JoinHandle<Vec<Seen>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let handle = thread::spawn(move || {
        replies
            .into_iter()
            .map(|limit| {
                let (mut s, _) = listener.accept().unwrap();
                serve(&mut s, limit, pause, &last)
            })
            .collect()
    });
    (port, handle)
}

fn serve(s: &mut TcpStream, limit: Option<usize>, pause: Duration, last: &[u8]) -> Seen {
    let mut seen = Seen::default();
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 1 << 16];
    loop {
        if let Some(n) = (!buf.is_empty()).then(|| command_len(&buf)).flatten() {
            // Only the last command has no lead to wait for: the bound for the others is long.
            let wait = if buf.starts_with(last) {
                LAST_WAIT
            } else {
                LEAD_WAIT
            };
            buf.drain(..n);
            // Everything the client sent before it could have seen this reply: the next lead
            // (waited for), then whatever else arrives within `pause`.
            let waited = Instant::now();
            let mut lead_seen = false;
            s.set_nonblocking(true).unwrap();
            loop {
                match s.read(&mut chunk) {
                    Ok(0) => break,
                    Ok(k) => buf.extend_from_slice(&chunk[..k]),
                    Err(_) => {
                        if !lead_seen && (is_lead(&buf) || waited.elapsed() > wait) {
                            lead_seen = true;
                            sleep(pause);
                        } else if lead_seen {
                            break;
                        } else {
                            sleep(Duration::from_millis(1));
                        }
                    }
                }
            }
            s.set_nonblocking(false).unwrap();
            seen.ahead.push(buf.clone());
            if limit == Some(seen.ahead.len()) {
                return seen; // closes the connection
            }
            s.write_all(b"+OK\r\n").unwrap();
            continue;
        }
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => return seen,
            Ok(k) => buf.extend_from_slice(&chunk[..k]),
        }
    }
}

fn client(port: u16) -> RemoteClient {
    let mut cfg = RemoteConfig::new(&format!("redis://127.0.0.1:{port}"));
    cfg.connections = 1;
    // Longer than LEAD_WAIT: a reply the server holds for a slow client's lead is not late.
    cfg.deadline = Duration::from_secs(60);
    cfg.probation_after = 100;
    RemoteClient::new(cfg).unwrap()
}

/// 600 KiB chunks: each one a pipeline of its own (two exceed the write batch).
const LEN: usize = 600 << 10;

/// The framing of a `SET` of chunk `key` up to its value's length line.
fn lead(ns: u128, k: u64) -> Vec<u8> {
    let name = value_key(ns, key(k), 0);
    let mut out = format!("*3\r\n$3\r\nSET\r\n${}\r\n", name.len()).into_bytes();
    out.extend_from_slice(&name);
    out.extend_from_slice(format!("\r\n${}\r\n", LEN + 72).as_bytes());
    out
}

fn write(c: &RemoteClient, ns: u128, keys: &[u64]) -> Vec<bool> {
    let data: Vec<Vec<u8>> = keys.iter().map(|&k| vec![k as u8; LEN]).collect();
    remote::write(c, ns, keys, &data, Cut::Half)
}

#[test]
fn the_next_lead_and_nothing_more_arrives_before_each_reply() {
    let (port, server) = fake_server(vec![None], Duration::from_millis(30), lead(7, 4));
    let c = client(port);
    assert_eq!(write(&c, 7, &[1, 2, 3, 4]), vec![true; 4]);
    drop(c); // closes the pooled connection
    let seen = server.join().unwrap();
    let expect: Vec<Vec<u8>> = vec![lead(7, 2), lead(7, 3), lead(7, 4), Vec::new()];
    assert_eq!(seen[0].ahead, expect);
}

#[test]
fn a_broken_connection_takes_the_next_lead_with_it() {
    // The first connection answers one command, then closes while the second is on its way:
    // the third chunk starts on a new connection with its whole command.
    let (port, server) = fake_server(vec![Some(2), None], Duration::from_millis(30), lead(7, 4));
    let c = client(port);
    assert_eq!(write(&c, 7, &[1, 2, 3, 4]), vec![true, false, true, true]);
    let s = c.stats();
    assert_eq!((s.errors, s.failed_writes, s.writes), (1, 1, 3));
    drop(c);
    let seen = server.join().unwrap();
    assert_eq!(seen[0].ahead, vec![lead(7, 2), lead(7, 3)]);
    assert_eq!(seen[1].ahead, vec![lead(7, 4), Vec::new()]);
}
