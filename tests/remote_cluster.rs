//! The shared tier on a real Redis Cluster (three masters, three replicas of Debian's
//! `redis-server` on loopback): chunks written by one engine's client read byte-exact by
//! another's, keys spread over the masters, a stopped master costing only its slots for the
//! deadline, failover and resharding during a run, and cluster URLs refused clearly.

use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::sleep;
use std::time::{Duration, Instant};

use kvoffload::tier::remote::{ReadOutcome, RemoteClient, RemoteConfig, WriteItem};
use kvoffload::Key;

mod support;
use support::cluster::{cli, Cluster};
use support::remote::{self, key, Cut};

const NS: u128 = 0x5eed;

fn config(url: &str, deadline_ms: u64) -> RemoteConfig {
    let mut c = RemoteConfig::new(url);
    c.deadline = Duration::from_millis(deadline_ms);
    c.part_bytes = 4096;
    c.probation = Duration::from_millis(200);
    c
}

/// Deterministic chunk data of `key` (its length depends on the key: one or several parts).
fn chunk(key: u64) -> Vec<u8> {
    let len = [100, 4096, 9000][(key % 3) as usize];
    (0..len)
        .map(|i| (key.wrapping_mul(131).wrapping_add(i as u64 * 7) % 251) as u8)
        .collect()
}

fn write(c: &RemoteClient, keys: &[u64]) -> Vec<bool> {
    let data: Vec<Vec<u8>> = keys.iter().map(|&k| chunk(k)).collect();
    remote::write(c, NS, keys, &data, Cut::Third)
}

/// Reads `keys`; every hit is checked against the oracle here (a wrong byte fails the test).
fn read(c: &RemoteClient, keys: &[u64]) -> Vec<ReadOutcome> {
    let (out, bufs) = remote::read(c, NS, keys, |k| chunk(k).len(), Cut::Whole);
    for ((&k, o), b) in keys.iter().zip(&out).zip(&bufs) {
        assert_ne!(*o, ReadOutcome::Corrupt, "key {k}");
        if *o == ReadOutcome::Hit {
            assert_eq!(*b, chunk(k), "a wrong byte served for key {k}");
        }
    }
    out
}

fn slot_master(cluster_slots: &[(u16, u16, u16)], slot: u16) -> u16 {
    cluster_slots
        .iter()
        .find(|(lo, hi, _)| (*lo..=*hi).contains(&slot))
        .unwrap()
        .2
}

/// `(first, last, master port)` of each slot range, from `redis-cli cluster slots`.
fn slot_ranges(port: u16) -> Vec<(u16, u16, u16)> {
    // redis-cli prints an array reply one element per line: lo, hi, ip, port, id, (replica…).
    let raw = cli(port, &["cluster", "slots"]);
    let lines: Vec<&str> = raw.lines().collect();
    let mut ranges = Vec::new();
    let mut i = 0;
    while i + 3 < lines.len() {
        if let (Ok(lo), Ok(hi)) = (lines[i].parse::<u16>(), lines[i + 1].parse::<u16>()) {
            if lines[i + 2] == "127.0.0.1" {
                ranges.push((lo, hi, lines[i + 3].parse().unwrap()));
                i += 4;
                continue;
            }
        }
        i += 1;
    }
    ranges
}

#[test]
fn engines_share_chunks_spread_over_every_master_and_a_stopped_master_costs_only_its_slots() {
    let cluster = Cluster::start();
    let a = RemoteClient::new(config(&cluster.url(), 5000)).unwrap();
    let b = RemoteClient::new(config(&cluster.url(), 5000)).unwrap();
    assert!(a.is_cluster());
    let keys: Vec<u64> = (0..300).collect();
    assert_eq!(write(&a, &keys), vec![true; keys.len()]);
    // Engine B finds and reads engine A's chunks, byte-exact.
    let ids: Vec<Key> = keys.iter().map(|&k| key(k)).collect();
    let mut ask = ids.clone();
    ask.push(Key(1 << 100));
    let found = b.exists(NS, &ask).unwrap();
    assert_eq!(&found[..keys.len()], vec![true; keys.len()].as_slice());
    assert!(!found[keys.len()]);
    assert_eq!(read(&b, &keys), vec![ReadOutcome::Hit; keys.len()]);
    // Every master holds some.
    let masters = cluster.masters();
    assert_eq!(masters.len(), 3);
    for &m in &masters {
        let n: u64 = cli(m, &["dbsize"]).trim().parse().unwrap();
        assert!(n > 50, "master {m} holds {n} keys");
    }

    // 10^5 small chunks: bytes per master within 20%.
    let before: Vec<(String, u64)> = a
        .node_stats()
        .into_iter()
        .map(|(n, s)| (n, s.bytes_written))
        .collect();
    let t0 = Instant::now();
    let many: Vec<u64> = (1_000_000..1_100_000).collect();
    let small = [7u8; 64];
    for batch in many.chunks(20_000) {
        let items: Vec<WriteItem<'_>> = batch
            .iter()
            .map(|&k| WriteItem {
                key: key(k),
                group: 0,
                data: vec![&small],
            })
            .collect();
        assert!(a.write(NS, &items).iter().all(|&ok| ok));
    }
    let after = a.node_stats();
    let grew: Vec<u64> = after
        .iter()
        .map(|(n, s)| s.bytes_written - before.iter().find(|(m, _)| m == n).map_or(0, |(_, b)| *b))
        .collect();
    assert_eq!(grew.len(), 3, "{after:#?}");
    let (max, min) = (*grew.iter().max().unwrap(), *grew.iter().min().unwrap());
    eprintln!(
        "1e5 chunks in {:?}: bytes per master {grew:?}, max/min {:.3}",
        t0.elapsed(),
        max as f64 / min as f64
    );
    assert!(max as f64 / min as f64 <= 1.2, "bytes per master {grew:?}");

    // A master that never answers (SIGSTOP): its slots fail by the deadline, the others'
    // are served, and the tier is not on probation.
    let ranges = slot_ranges(masters[0]);
    let stopped = masters[1];
    let on_stopped: Vec<bool> = keys
        .iter()
        .map(|&k| slot_master(&ranges, kvoffload::tier::remote::key_slot(NS, key(k))) == stopped)
        .collect();
    let c = RemoteClient::new(config(&cluster.url(), 300)).unwrap();
    cluster.signal(stopped, libc::SIGSTOP);
    // (Stopped for less than the cluster's node timeout: no failover.)
    for _ in 0..2 {
        let t = Instant::now();
        let out = read(&c, &keys);
        let took = t.elapsed();
        assert!(took < Duration::from_millis(300 + 300), "{took:?}");
        for (o, &s) in out.iter().zip(&on_stopped) {
            assert_eq!(
                *o,
                if s {
                    ReadOutcome::Failed
                } else {
                    ReadOutcome::Hit
                }
            );
        }
        assert!(!c.on_probation());
    }
    cluster.signal(stopped, libc::SIGCONT);
    sleep(Duration::from_millis(300));
    assert_eq!(read(&c, &keys), vec![ReadOutcome::Hit; keys.len()]);

    // URLs: a non-cluster seed among cluster seeds, a wrong password, a bad URL.
    let plain = support::tier::Server::start();
    let mixed = format!("{},127.0.0.1:{}", cluster.url(), plain.port);
    let e = RemoteClient::new(config(&mixed, 1000))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("remote_url")
            && e.contains(&plain.port.to_string())
            && e.contains("not a cluster node"),
        "{e}"
    );
    let wrong = cluster.url().replace("://", "://kvo:hunter2@");
    let e = RemoteClient::new(config(&wrong, 1000))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("remote_url") && e.contains("kvo:***") && !e.contains("hunter2"),
        "{e}"
    );
    let e = RemoteClient::new(config("redis+cluster://127.0.0.1", 1000))
        .unwrap_err()
        .to_string();
    assert!(e.contains("remote_url") && e.contains("has no port"), "{e}");
}

#[test]
fn a_killed_master_fails_its_slots_by_the_deadline_then_its_promoted_replica_serves_them() {
    let mut cluster = Cluster::start();
    let c = RemoteClient::new(config(&cluster.url(), 500)).unwrap();
    let keys: Vec<u64> = (0..300).collect();
    assert_eq!(write(&c, &keys), vec![true; keys.len()]);
    let topo = cluster.topology();
    let victim = cluster.masters()[0];
    let vid = topo.iter().find(|n| n.port == victim).unwrap().id.clone();
    let replica = topo.iter().find(|n| n.of == vid).unwrap().port;
    // Replication is asynchronous (what a replica lacks is a miss): wait until the victim's
    // replica has its offset (`WAIT` from a fresh connection waits for nothing).
    let offset = |port: u16, field: &str| -> i64 {
        cli(port, &["info", "replication"])
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .map_or(-1, |v| v.trim().parse().unwrap())
    };
    let until = Instant::now() + Duration::from_secs(20);
    while offset(replica, "slave_repl_offset:") < offset(victim, "master_repl_offset:") {
        assert!(Instant::now() < until, "the replica did not catch up");
        sleep(Duration::from_millis(20));
    }
    let ranges = slot_ranges(victim);
    let on_victim: Vec<bool> = keys
        .iter()
        .map(|&k| slot_master(&ranges, kvoffload::tier::remote::key_slot(NS, key(k))) == victim)
        .collect();
    let sizes = (cli(victim, &["dbsize"]), cli(replica, &["dbsize"]));
    cluster.kill(victim);
    // Until the promotion: the victim's chunks fail fast, the others' are served and written.
    for round in 0..3 {
        let t = Instant::now();
        let out = read(&c, &keys);
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        for (o, &v) in out.iter().zip(&on_victim) {
            if v {
                assert_ne!(*o, ReadOutcome::Hit);
            } else {
                assert_eq!(*o, ReadOutcome::Hit, "round {round}");
            }
        }
        let fresh: Vec<u64> = (10_000 * (round + 1)..10_000 * (round + 1) + 100).collect();
        let ok = write(&c, &fresh);
        assert!(ok.iter().any(|&w| w) && !ok.iter().all(|&w| w), "{ok:?}");
    }
    let said = cli(replica, &["cluster", "failover", "takeover"]);
    eprintln!("{sizes:?} {said}");
    assert!(said.starts_with("OK"), "{said}");
    // After the promotion every slot is served again (no wrong byte ever: `read` checks).
    let until = Instant::now() + Duration::from_secs(20);
    let fresh: Vec<u64> = (50_000..50_300).collect();
    loop {
        let ok = write(&c, &fresh);
        let out = read(&c, &keys);
        if ok.iter().all(|&w| w) && out.iter().all(|&o| o == ReadOutcome::Hit) {
            break;
        }
        assert!(
            Instant::now() < until,
            "the promoted replica never served its slots: {sizes:?} {} writes failed, {:?} reads, {:#?}, {}",
            ok.iter().filter(|&&w| !w).count(),
            out.iter().filter(|&&o| o != ReadOutcome::Hit).collect::<Vec<_>>(),
            c.node_stats(),
            cli(replica, &["cluster", "nodes"])
        );
        sleep(Duration::from_millis(100));
    }
    assert_eq!(read(&c, &fresh), vec![ReadOutcome::Hit; fresh.len()]);
    assert!(cluster.masters().contains(&replica));
}

#[test]
fn reads_and_writes_stay_correct_while_slots_migrate() {
    let cluster = Cluster::start();
    let c = RemoteClient::new(config(&cluster.url(), 5000)).unwrap();
    let mut written: Vec<u64> = (0..600).collect();
    assert_eq!(write(&c, &written), vec![true; written.len()]);
    let topo = cluster.topology();
    let masters = cluster.masters();
    let id = |p: u16| topo.iter().find(|n| n.port == p).unwrap().id.clone();
    let (from, to) = (id(masters[0]), id(masters[1]));
    let done = AtomicBool::new(false);
    let port = masters[0].to_string();
    std::thread::scope(|s| {
        s.spawn(|| {
            cli(
                cluster.nodes[0].port,
                &[
                    "--cluster",
                    "reshard",
                    &format!("127.0.0.1:{port}"),
                    "--cluster-from",
                    &from,
                    "--cluster-to",
                    &to,
                    "--cluster-slots",
                    "3000",
                    "--cluster-yes",
                    "--cluster-pipeline",
                    "5",
                ],
            );
            done.store(true, Ordering::Release);
        });
        let mut next = 100_000;
        let mut rounds = 0;
        while !done.load(Ordering::Acquire) || rounds < 2 {
            let fresh: Vec<u64> = (next..next + 60).collect();
            next += 60;
            assert_eq!(write(&c, &fresh), vec![true; fresh.len()], "round {rounds}");
            written.extend(&fresh);
            assert_eq!(
                read(&c, &written),
                vec![ReadOutcome::Hit; written.len()],
                "round {rounds}"
            );
            rounds += 1;
        }
    });
    cluster.wait_ok();
    assert_eq!(read(&c, &written), vec![ReadOutcome::Hit; written.len()]);
    let s = c.stats();
    eprintln!(
        "migration: {} chunks, {} redirects",
        written.len(),
        s.redirects
    );
    assert!(s.redirects > 0, "{s:?}");
    // Every chunk counted once, by its last outcome: redirections are not failures.
    assert_eq!(
        (
            s.checksum_mismatches,
            s.failed_writes,
            s.read_misses,
            s.failed_reads
        ),
        (0, 0, 0, 0),
        "{s:?}"
    );
}

#[test]
fn a_cluster_over_tls_serves_chunks_and_refuses_another_cas_certificate() {
    let cluster = Cluster::start_with(true);
    let dir = cluster.tls.clone().unwrap();
    let mut cfg = config(&cluster.url(), 5000);
    cfg.tls_ca = Some(dir.join("ca.crt"));
    let c = RemoteClient::new(cfg.clone()).unwrap();
    let keys: Vec<u64> = (0..150).collect();
    assert_eq!(write(&c, &keys), vec![true; keys.len()]);
    assert_eq!(read(&c, &keys), vec![ReadOutcome::Hit; keys.len()]);
    assert_eq!(c.node_stats().len(), 3);
    cfg.tls_ca = Some(dir.join("other-ca.crt"));
    let e = RemoteClient::new(cfg).unwrap_err().to_string();
    assert!(e.contains("remote_url") && e.contains("TLS"), "{e}");
}
