//! The shared tier's client against a real `redis-server` (Debian's package; `make test`
//! installs it): byte-exact round trips, namespaces, verification, probation and recovery.

use std::net::TcpListener;
use std::thread::sleep;
use std::time::{Duration, Instant};

use kvoffload::tier::remote::{parts, value_key, ReadOutcome, RemoteClient, RemoteConfig};
use kvoffload::Key;

mod support;
use support::remote::{self, Cut};
use support::tier::Server;

fn config(url: &str) -> RemoteConfig {
    let mut c = RemoteConfig::new(url);
    c.deadline = Duration::from_secs(5);
    c.part_bytes = 4096;
    c.probation = Duration::from_millis(200);
    c
}

/// Deterministic chunk data for `key`.
fn chunk(key: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (key.wrapping_mul(31).wrapping_add(i as u64 * 7) % 251) as u8)
        .collect()
}

/// Writes chunks of `len` bytes, as two pieces (two regions).
fn write(c: &RemoteClient, ns: u128, keys: &[u64], len: usize) -> Vec<bool> {
    let data: Vec<Vec<u8>> = keys.iter().map(|&k| chunk(k, len)).collect();
    remote::write(c, ns, keys, &data, Cut::Third)
}

/// Reads `keys` into two pieces each; returns outcomes and the bytes read.
fn read(c: &RemoteClient, ns: u128, keys: &[u64], len: usize) -> (Vec<ReadOutcome>, Vec<Vec<u8>>) {
    remote::read(c, ns, keys, |_| len, Cut::Third)
}

#[test]
fn chunks_round_trip_byte_exact_single_and_multi_part() {
    let server = Server::start();
    let c = RemoteClient::new(config(&server.url())).unwrap();
    for len in [100, 4096, 4097, 3 * 4096 + 17, 200_000] {
        let keys: Vec<u64> = (0..5).map(|i| len as u64 * 10 + i).collect();
        assert_eq!(write(&c, 7, &keys, len), vec![true; 5], "len {len}");
        let (out, bufs) = read(&c, 7, &keys, len);
        assert_eq!(out, vec![ReadOutcome::Hit; 5], "len {len}");
        for (k, buf) in keys.iter().zip(&bufs) {
            assert_eq!(*buf, chunk(*k, len), "key {k} len {len}");
        }
        let (n, _) = parts(len, 4096);
        let mut con = server.con();
        for part in 0..n {
            let exists: bool = redis::cmd("EXISTS")
                .arg(value_key(7, Key(u128::from(keys[0])), part))
                .query(&mut con)
                .unwrap();
            assert!(exists, "len {len}: part {part} of {n} stored under its key");
        }
    }
    let s = c.stats();
    assert_eq!(
        (
            s.writes,
            s.read_hits,
            s.failed_writes,
            s.checksum_mismatches
        ),
        (25, 25, 0, 0)
    );
}

#[test]
fn other_namespaces_and_absent_keys_miss() {
    let server = Server::start();
    let c = RemoteClient::new(config(&server.url())).unwrap();
    write(&c, 1, &[1, 2, 3], 1000);
    assert_eq!(
        c.exists(1, &[Key(1), Key(2), Key(9), Key(3)]),
        Some(vec![true, true, false, true])
    );
    assert_eq!(c.exists(2, &[Key(1), Key(2)]), Some(vec![false, false]));
    let (out, _) = read(&c, 2, &[1, 2], 1000);
    assert_eq!(out, vec![ReadOutcome::Miss; 2]);
    // A reader that expects another length refuses the chunk (another layout): a shorter
    // value is corrupt; a longer one fails the read (its connection is dropped unread: a
    // reply longer than the chunk is never read to its end).
    let (out, _) = read(&c, 1, &[1], 1001);
    assert_eq!(out, vec![ReadOutcome::Corrupt]);
    let (out, _) = read(&c, 1, &[1], 999);
    assert_eq!(out, vec![ReadOutcome::Failed]);
}

#[test]
fn a_512_chunk_lookup_is_one_round_trip() {
    let server = Server::start();
    let c = RemoteClient::new(config(&server.url())).unwrap();
    let keys: Vec<u64> = (0..512).collect();
    assert!(write(&c, 3, &keys[..300], 64).iter().all(|&ok| ok));
    let before = c.stats().round_trips;
    let found = c
        .exists(
            3,
            &keys.iter().map(|&k| Key(u128::from(k))).collect::<Vec<_>>(),
        )
        .unwrap();
    assert_eq!(c.stats().round_trips - before, 1);
    assert_eq!(found.iter().take_while(|&&f| f).count(), 300);
    assert_eq!(found.iter().filter(|&&f| f).count(), 300);
}

#[test]
fn flipped_bytes_and_lost_parts_are_never_served() {
    let server = Server::start();
    let c = RemoteClient::new(config(&server.url())).unwrap();
    let len = 3 * 4096;
    write(&c, 5, &[1, 2, 3, 4], len);
    let mut con = server.con();
    // Flip one data byte of key 1 (part 1) and one header byte of key 2 (part 0).
    for (key, part, at) in [(1u128, 1usize, 100usize), (2, 0, 40)] {
        let name = value_key(5, Key(key), part);
        let mut v: Vec<u8> = redis::cmd("GET").arg(&name).query(&mut con).unwrap();
        v[at] ^= 0x10;
        let () = redis::cmd("SET").arg(&name).arg(v).query(&mut con).unwrap();
    }
    // Key 3 loses its last part (eviction of one part).
    let () = redis::cmd("DEL")
        .arg(value_key(5, Key(3), 2))
        .query(&mut con)
        .map(|_: i64| ())
        .unwrap();
    let (out, bufs) = read(&c, 5, &[1, 2, 3, 4], len);
    assert_eq!(
        out,
        vec![
            ReadOutcome::Corrupt,
            ReadOutcome::Corrupt,
            ReadOutcome::Miss,
            ReadOutcome::Hit
        ]
    );
    assert_eq!(bufs[3], chunk(4, len));
    let s = c.stats();
    assert_eq!(
        (s.checksum_mismatches, s.read_misses, s.read_hits),
        (2, 1, 1)
    );
}

#[test]
fn a_dead_server_means_probation_then_recovery_after_restart() {
    let mut server = Server::start();
    let c = RemoteClient::new(config(&server.url())).unwrap();
    assert_eq!(write(&c, 1, &[1], 500), vec![true]);
    server.kill();
    // probation_after = 3 failures: lookups fail (None), then writes are dropped without I/O.
    for _ in 0..3 {
        assert_eq!(c.exists(1, &[Key(1)]), None);
    }
    assert!(c.on_probation());
    let trips = c.stats().round_trips;
    assert_eq!(write(&c, 1, &[2], 500), vec![false]);
    assert_eq!(c.exists(1, &[Key(1)]), None);
    let (out, _) = read(&c, 1, &[1], 500);
    assert_eq!(out, vec![ReadOutcome::Failed]);
    let s = c.stats();
    assert_eq!(s.round_trips, trips, "nothing sent on probation");
    assert_eq!(
        (
            s.probations,
            s.dropped_writes,
            s.skipped_lookups,
            s.recoveries
        ),
        (1, 1, 1, 0)
    );
    assert_eq!(s.errors, 3);
    server.spawn();
    sleep(Duration::from_millis(250));
    // The trial succeeds: recovery; the restarted server is empty.
    assert_eq!(c.exists(1, &[Key(1)]), Some(vec![false]));
    assert!(!c.on_probation());
    assert_eq!(c.stats().recoveries, 1);
    assert_eq!(write(&c, 1, &[2], 500), vec![true]);
    assert_eq!(read(&c, 1, &[2], 500).0, vec![ReadOutcome::Hit]);
}

#[test]
fn a_failed_trial_starts_another_probation() {
    let mut server = Server::start();
    let c = RemoteClient::new(config(&server.url())).unwrap();
    server.kill();
    for _ in 0..3 {
        assert_eq!(c.exists(1, &[Key(1)]), None);
    }
    sleep(Duration::from_millis(250));
    assert_eq!(c.exists(1, &[Key(1)]), None, "the trial fails");
    assert!(c.on_probation(), "one failed trial is enough");
    assert_eq!(c.stats().probations, 2);
}

#[test]
fn parallel_batches_keep_every_chunk_apart() {
    let server = Server::start();
    let mut cfg = config(&server.url());
    cfg.part_bytes = 1 << 20;
    cfg.deadline = Duration::from_secs(20); // a debug build on a loaded machine
    let c = RemoteClient::new(cfg).unwrap();
    // 40 chunks of 1 MiB: several sub-batches on several connections.
    let keys: Vec<u64> = (100..140).collect();
    let w = write(&c, 9, &keys, 1 << 20);
    assert!(w.iter().all(|&ok| ok), "{w:?} {:?}", c.stats());
    let (out, bufs) = read(&c, 9, &keys, 1 << 20);
    assert!(out.iter().all(|&o| o == ReadOutcome::Hit));
    for (k, buf) in keys.iter().zip(&bufs) {
        assert!(*buf == chunk(*k, 1 << 20), "key {k}");
    }
    assert!(c.stats().round_trips >= 2 * 5, "{:?}", c.stats());
}

mod index {
    use super::*;
    use kvoffload::pool::KeyState;
    use kvoffload::tier::remote::{RemoteIndex, RemoteIndexConfig};
    use kvoffload::tier::TierIndex;
    use std::sync::Arc;

    fn index(url: &str, deadline: Duration) -> RemoteIndex {
        let mut cfg = config(url);
        cfg.deadline = deadline;
        let client = Arc::new(RemoteClient::new(cfg).unwrap());
        RemoteIndex::new(
            client,
            RemoteIndexConfig {
                namespaces: vec![11],
                ttl: Duration::from_secs(60),
                retry: Duration::from_secs(30),
                cpus: None,
            },
        )
        .unwrap()
    }

    /// Looks `keys` up until the answer is no longer pending (bounded).
    fn settle(ix: &mut RemoteIndex, keys: &[Key]) -> (usize, u32) {
        settle_with(ix, keys, || {})
    }

    /// [`settle`], calling `pending` after each ask that found the answer still pending.
    fn settle_with(ix: &mut RemoteIndex, keys: &[Key], mut pending: impl FnMut()) -> (usize, u32) {
        // Bounded in time, not in asks (1000 asks were ~2 s, less than the index's deadline):
        // far past any deadline here, on a loaded machine.
        let until = Instant::now() + Duration::from_secs(30);
        let mut asks = 0;
        loop {
            ix.lookup(keys);
            asks += 1;
            if !ix.prefetch(keys) {
                // The server's answer may have arrived between that lookup and `prefetch`,
                // which then found nothing pending: only a lookup after it sees the answer.
                return (ix.lookup(keys), asks);
            }
            pending();
            assert!(
                Instant::now() < until,
                "lookup still pending after {asks} asks"
            );
            sleep(Duration::from_millis(2));
        }
    }

    fn keys(range: std::ops::Range<u64>) -> Vec<Key> {
        range.map(|k| Key(u128::from(k))).collect()
    }

    #[test]
    fn lookups_ask_later_then_see_another_writers_chunks() {
        let server = Server::start();
        let writer = RemoteClient::new(config(&server.url())).unwrap();
        write(&writer, 11, &(0..6).collect::<Vec<_>>(), 256);
        let mut ix = index(&server.url(), Duration::from_secs(5));
        let ks = keys(0..10);
        // The server is stopped until settle's first ask found the check pending: a running one
        // could answer before the `prefetch` below or before that ask (a loaded machine).
        server.pause();
        assert_eq!(ix.lookup(&ks), 0, "nothing is known yet");
        assert!(ix.prefetch(&ks), "the request is told to ask later");
        let (n, asks) = settle_with(&mut ix, &ks, || server.resume());
        assert_eq!(n, 6);
        assert!(asks >= 2);
        assert_eq!(
            ix.checks(),
            (1, 0),
            "one existence check for the whole prefix"
        );
        assert_eq!(ix.state(Key(3)), KeyState::Ready { pins: 0 });
        assert_eq!(ix.state(Key(7)), KeyState::Absent);
        // Known answers: no new check, no pending.
        assert_eq!(ix.lookup(&ks), 6);
        assert!(!ix.prefetch(&ks));
        assert_eq!(ix.checks().0, 1);
    }

    #[test]
    fn promotion_pins_and_a_vanished_chunk_becomes_absent() {
        let server = Server::start();
        let writer = RemoteClient::new(config(&server.url())).unwrap();
        write(&writer, 11, &[1, 2], 256);
        let mut ix = index(&server.url(), Duration::from_secs(5));
        let ks = keys(1..3);
        assert_eq!(settle(&mut ix, &ks).0, 2);
        assert_eq!(ix.prepare_read(&ks).unwrap().len(), 2);
        assert_eq!(ix.state(Key(1)), KeyState::Ready { pins: 1 });
        // Unknown keys and wrong `bad` sets are refused without change.
        assert!(ix.prepare_read(&keys(1..4)).is_err());
        assert!(ix.complete_read(&ks, &[Key(9)]).is_err());
        assert_eq!(ix.state(Key(1)), KeyState::Ready { pins: 1 });
        ix.complete_read(&ks, &[Key(2)]).unwrap();
        assert_eq!(ix.state(Key(1)), KeyState::Ready { pins: 0 });
        assert_eq!(ix.state(Key(2)), KeyState::Absent);
        assert!(ix.complete_read(&ks, &[]).is_err(), "not pinned any more");
        let s = ix.stats();
        assert_eq!((s.promotions, s.quarantined, s.reading), (2, 1, 0));
        assert_eq!(ix.lookup(&ks), 1);
    }

    #[test]
    fn our_writes_are_known_without_asking() {
        let server = Server::start();
        let mut ix = index(&server.url(), Duration::from_secs(5));
        let ks = keys(5..8);
        let plan = ix.prepare_write(&ks).unwrap();
        assert_eq!(plan.keys, ks);
        assert_eq!(ix.state(Key(5)), KeyState::Storing);
        assert_eq!(ix.lookup(&ks), 0, "a write in flight is not readable");
        assert!(!ix.prefetch(&ks));
        assert_eq!(
            ix.prepare_write(&ks).unwrap().keys,
            Vec::<Key>::new(),
            "no double write"
        );
        ix.complete_write(&ks[..2], true).unwrap();
        ix.complete_write(&ks[2..], false).unwrap();
        assert!(
            ix.complete_write(&ks, true).is_err(),
            "not writing any more"
        );
        assert_eq!(ix.lookup(&ks), 2);
        assert_eq!(ix.checks().0, 1, "only the failed key is asked about");
        let ev = ix.take_events();
        assert_eq!(ev.len(), 1);
        assert_eq!(
            (ev[0].medium, ev[0].keys.clone()),
            (kvoffload::tier::Medium::Remote, ks[..2].to_vec())
        );
    }

    #[test]
    fn a_silent_server_expires_the_question_and_the_lookup_is_a_miss() {
        // A listener that accepts and never answers: every check outlives its deadline.
        let silent = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("redis://127.0.0.1:{}", silent.local_addr().unwrap().port());
        let mut ix = index(&url, Duration::from_millis(100));
        let ks = keys(0..4);
        assert_eq!(ix.lookup(&ks), 0);
        assert!(ix.prefetch(&ks));
        let start = Instant::now();
        let (n, _) = settle(&mut ix, &ks);
        assert_eq!(n, 0);
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "bounded by the deadline"
        );
        assert_eq!(ix.checks().1, 1, "the question expired");
        // The lookup thread's own failed answer comes after (its client has the same
        // deadline): the question it answers was counted when it expired, not again.
        sleep(Duration::from_millis(500));
        assert_eq!(ix.lookup(&ks), 0);
        assert_eq!(ix.checks().1, 1, "one question, counted once");
    }
}
