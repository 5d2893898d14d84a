//! The disk tier against its guarantees: every served byte equals the byte
//! oracle (a chunk's bytes are a function of its key), restarts rebuild the index from the
//! headers, 1,000 injected corruptions are 1,000 misses, the bound holds under a workload 10×
//! the tier, and 20 processes killed with SIGKILL while writing lose no committed chunk and
//! leave a directory that verifies.

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use kvoffload::policy::PolicyKind;
use kvoffload::tier::disk::{
    inspect, scan_namespace, write_items, DiskIndex, DiskOptions, DiskTier, SlabFile, SlabLayout,
    WriteItem, BLOCK, SLAB_FILE,
};
use kvoffload::tier::namespace::Namespace;
use kvoffload::tier::{Location, TierIndex};
use kvoffload::Key;

mod support;
use support::serial;

/// A deterministic generator (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The byte oracle: the content of chunk `key`.
fn oracle(key: Key, len: usize) -> Vec<u8> {
    let mut r = Rng(key.0 as u64 ^ (key.0 >> 64) as u64);
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        v.extend_from_slice(&r.next().to_le_bytes());
    }
    v.truncate(len);
    v
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvo-disk-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn ns(model: &str) -> Namespace {
    Namespace {
        model: model.into(),
        dtype: "uint8".into(),
        tensor_shapes: vec![vec![1]],
        block_size: 16,
        blocks_per_chunk: 1,
        rank: 0,
        world_size: 1,
        group: 0,
        cache_salt: String::new(),
    }
}

fn opts(root: &Path, chunk_bytes: u64, slots: u64) -> DiskOptions {
    DiskOptions {
        root: root.to_path_buf(),
        disk_bytes: slots * (BLOCK + chunk_bytes.div_ceil(BLOCK) * BLOCK),
        chunk_bytes,
        policy: PolicyKind::Lru,
        direct: true,
        sync: true,
    }
}

fn put(t: &mut DiskTier, key: Key, len: usize) -> bool {
    let data = oracle(key, len);
    t.put(&[(key, vec![&data[..]])]).is_some_and(|w| w == [key])
}

/// Reads `key`; `Some(true)` served and equal to the oracle, `Some(false)` served and wrong,
/// `None` a miss.
fn get(t: &mut DiskTier, key: Key, len: usize) -> Option<bool> {
    // Two pieces, so the gather path is exercised.
    let mut buf = vec![0u8; len];
    let (a, b) = buf.split_at_mut(len / 3);
    let served = t.get(key, &mut [a, b]);
    served.then(|| buf == oracle(key, len))
}

fn slab_path(root: &Path, ns: &Namespace) -> PathBuf {
    root.join(ns.dir_name()).join(SLAB_FILE)
}

#[test]
fn round_trip_restart_and_generations() {
    let _serial = serial();
    let root = tmp("restart");
    let (len, n) = (10_000usize, 24u64);
    let o = opts(&root, len as u64, 32);
    let mut t = DiskTier::open(&o, &ns("m")).unwrap();
    for k in 1..=n {
        assert!(put(&mut t, Key(u128::from(k) << 70 | 7), len));
    }
    for k in 1..=n {
        assert_eq!(get(&mut t, Key(u128::from(k) << 70 | 7), len), Some(true));
    }
    assert_eq!(get(&mut t, Key(12345), len), None);
    let last_gen = t
        .index()
        .location(Key(u128::from(n) << 70 | 7))
        .unwrap()
        .generation;
    drop(t);

    let mut t = DiskTier::open(&o, &ns("m")).unwrap();
    assert_eq!(t.index().recovered(), n);
    for k in 1..=n {
        assert_eq!(
            get(&mut t, Key(u128::from(k) << 70 | 7), len),
            Some(true),
            "key {k}"
        );
    }
    assert!(put(&mut t, Key(99), len));
    assert!(t.index().location(Key(99)).unwrap().generation > last_gen);
    // Another namespace under the same root sees none of it.
    let mut other = DiskTier::open(&o, &ns("other-model")).unwrap();
    assert_eq!(other.index().recovered(), 0);
    assert_eq!(get(&mut other, Key(1 << 70 | 7), len), None);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn bound_holds_under_a_workload_ten_times_the_tier() {
    let _serial = serial();
    let root = tmp("bound");
    let (len, slots) = (64 << 10, 16u64);
    let o = opts(&root, len as u64, slots);
    let slot_bytes = BLOCK + len as u64;
    let mut t = DiskTier::open(&o, &ns("m")).unwrap();
    let path = slab_path(&root, &ns("m"));
    let mut max_seen = 0;
    for k in 0..slots * 10 {
        assert!(put(&mut t, Key(u128::from(k) + 1), len), "write {k}");
        let m = std::fs::metadata(&path).unwrap();
        max_seen = max_seen.max(m.len()).max(m.blocks() * 512);
    }
    assert!(
        max_seen <= o.disk_bytes + slot_bytes,
        "{max_seen} > {} + {slot_bytes}",
        o.disk_bytes
    );
    let s = t.index().stats();
    assert_eq!(s.evictions, slots * 9);
    assert_eq!(s.used, slots);
    // The most recent `slots` chunks are all there and intact.
    for k in slots * 9..slots * 10 {
        assert_eq!(get(&mut t, Key(u128::from(k) + 1), len), Some(true));
    }
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn ranks_must_agree_on_a_slot_before_it_is_readable() {
    let _serial = serial();
    let root = tmp("ranks");
    let len = 4096u64;
    let layout = SlabLayout::new(len, 8 * (BLOCK + len)).unwrap();
    let base = Namespace {
        world_size: 2,
        ..ns("m")
    };
    let files: Vec<SlabFile> = (0..2)
        .map(|r| SlabFile::open(&root, &base.for_rank(r), layout, false, true).unwrap())
        .collect();
    let data = vec![7u8; len as usize];
    let item = |slot, key, generation| WriteItem {
        slot,
        key: Key(key),
        generation,
        pieces: vec![&data[..]],
    };
    // Slot 0: both ranks, same key and generation. Slot 1: rank 0 only. Slot 2: generations
    // differ. Slot 3: both, an older copy of key 10 that slot 0 supersedes.
    assert!(files[0]
        .write(&[
            item(0, 10, 5),
            item(1, 11, 6),
            item(2, 12, 7),
            item(3, 10, 1)
        ])
        .iter()
        .all(Result::is_ok));
    assert!(files[1]
        .write(&[item(0, 10, 5), item(2, 12, 8), item(3, 10, 1)])
        .iter()
        .all(Result::is_ok));
    let scans: Vec<_> = (0..2)
        .map(|r| scan_namespace(&root, &base.for_rank(r), layout).unwrap())
        .collect();
    let mut idx = DiskIndex::recover(layout, PolicyKind::Lru, &scans).unwrap();
    assert_eq!(idx.recovered(), 1);
    assert_eq!(idx.lookup(&[Key(10)]), 1);
    assert_eq!(
        idx.location(Key(10)),
        Some(Location {
            place: 0,
            generation: 5
        })
    );
    assert_eq!(idx.lookup(&[Key(11)]), 0);
    assert_eq!(idx.lookup(&[Key(12)]), 0);
    // New writes never reuse a generation any rank's file holds.
    let plan = idx.prepare_write(&[Key(13)]).unwrap();
    assert!(plan.locations[0].generation > 8);
    // A rank's file does not serve another rank's bytes.
    let mut buf = vec![0u8; len as usize];
    let err = files[1].read(
        Key(11),
        Location {
            place: 1,
            generation: 6,
        },
        &mut [&mut buf[..]],
    );
    assert!(err.unwrap_err().is_corrupt());
    let _ = std::fs::remove_dir_all(&root);
}

/// One way to damage a committed chunk.
#[derive(Clone, Copy, Debug)]
enum Damage {
    DataBit,
    HeaderBit,
    Foreign,
}

#[test]
fn a_thousand_injected_corruptions_are_a_thousand_misses() {
    let _serial = serial();
    let (len, slots) = (4096 + 100, 110u64);
    let slot_bytes = BLOCK + (len as u64).div_ceil(BLOCK) * BLOCK;
    let mut rng = Rng(2024);
    let (mut injected, mut missed, mut served_wrong, mut quarantined) = (0u64, 0u64, 0u64, 0u64);
    // A chunk of another namespace, same layout, to paste over our slots.
    let foreign_root = tmp("foreign");
    let fo = opts(&foreign_root, len as u64, 1);
    let mut f = DiskTier::open(&fo, &ns("foreign")).unwrap();
    assert!(put(&mut f, Key(1), len));
    let mut foreign_slot = vec![0u8; slot_bytes as usize];
    std::fs::File::open(slab_path(&foreign_root, &ns("foreign")))
        .unwrap()
        .read_exact_at(&mut foreign_slot, 0)
        .unwrap();
    drop(f);

    for round in 0..10u64 {
        let root = tmp(&format!("corrupt{round}"));
        let o = opts(&root, len as u64, slots);
        let mut t = Some(DiskTier::open(&o, &ns("m")).unwrap());
        let keys: Vec<Key> = (0..slots)
            .map(|i| Key(u128::from(round * 1000 + i + 1)))
            .collect();
        for &k in &keys {
            assert!(put(t.as_mut().unwrap(), k, len));
        }
        let reopen = round % 2 == 0;
        if reopen {
            t = None;
        }
        let path = slab_path(&root, &ns("m"));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        // Slots 10..100 damaged in place (data bits, header bits, foreign chunks), then the file
        // truncated inside slot 100, which takes the last 10 with it: 100 corruptions a round;
        // slots 0..10 stay intact.
        let mut damaged = Vec::new();
        for i in 0..90u64 {
            let slot = 10 + i;
            let kind = match i % 9 {
                0..=3 => Damage::DataBit,
                4..=7 => Damage::HeaderBit,
                _ => Damage::Foreign,
            };
            let at = slot * slot_bytes;
            match kind {
                Damage::DataBit => {
                    let off = at + BLOCK + rng.below(len as u64);
                    let mut b = [0u8];
                    file.read_exact_at(&mut b, off).unwrap();
                    b[0] ^= 1 << rng.below(8);
                    file.write_all_at(&b, off).unwrap();
                }
                Damage::HeaderBit => {
                    let off = at + rng.below(72);
                    let mut b = [0u8];
                    file.read_exact_at(&mut b, off).unwrap();
                    b[0] ^= 1 << rng.below(8);
                    file.write_all_at(&b, off).unwrap();
                }
                Damage::Foreign => file.write_all_at(&foreign_slot, at).unwrap(),
            }
            damaged.push(keys[slot as usize]);
        }
        let cut = 100 * slot_bytes + BLOCK + rng.below(len as u64);
        file.set_len(cut).unwrap();
        damaged.extend_from_slice(&keys[100..]);
        drop(file);
        injected += damaged.len() as u64;
        let mut t = t.unwrap_or_else(|| DiskTier::open(&o, &ns("m")).unwrap());
        for &k in &damaged {
            match get(&mut t, k, len) {
                None => missed += 1,
                Some(_) => served_wrong += 1,
            }
        }
        // Every slot damaged in place is quarantined; after a reopen also the truncated slot
        // whose header survived (the file is resized, its data half zeros). In the open tier
        // the truncated slots read short: an I/O error, a miss that says nothing about bytes.
        let q = t.index().stats().quarantined;
        assert_eq!(q, if reopen { 91 } else { 90 }, "round {round}");
        quarantined += q;
        // Nothing else was hurt.
        for &k in &keys {
            if !damaged.contains(&k) {
                assert_eq!(get(&mut t, k, len), Some(true));
            }
        }
        // A second look never serves a quarantined chunk either, nor after another reopen.
        drop(t);
        let mut t = DiskTier::open(&o, &ns("m")).unwrap();
        for &k in &damaged {
            assert_eq!(get(&mut t, k, len), None, "key {k} after reopen");
        }
        let _ = std::fs::remove_dir_all(&root);
    }
    let _ = std::fs::remove_dir_all(&foreign_root);
    eprintln!("corruptions: injected {injected}, missed {missed}, served {served_wrong}, quarantined {quarantined}");
    assert_eq!(injected, 1000);
    assert_eq!(missed, 1000);
    assert_eq!(served_wrong, 0);
    assert_eq!(quarantined, 905);
}

const CRASH_DIR: &str = "KVOFFLOAD_CRASH_DIR";
const CRASH_LEN: usize = 64 << 10;
const CRASH_SLOTS: u64 = 48;

/// The writer of `crash_safety_under_sigkill` (runs only as its child process): writes random
/// batches of chunks forever, printing `C key` once a chunk is committed and `E key` once it
/// was evicted.
#[test]
#[ignore = "child process of crash_safety_under_sigkill"]
fn crash_child() {
    let _serial = serial();
    let Some(dir) = std::env::var_os(CRASH_DIR) else {
        return;
    };
    let o = opts(Path::new(&dir), CRASH_LEN as u64, CRASH_SLOTS);
    let mut t = DiskTier::open(&o, &ns("m")).unwrap();
    let mut rng = Rng(u64::from(std::process::id()) << 20);
    let out = std::io::stdout();
    let mut out = out.lock();
    writeln!(out, "READY").unwrap();
    out.flush().unwrap();
    loop {
        let n = 1 + rng.below(4) as usize;
        let keys: Vec<Key> = (0..n).map(|_| Key(u128::from(rng.next()) + 1)).collect();
        let data: Vec<Vec<u8>> = keys.iter().map(|&k| oracle(k, CRASH_LEN)).collect();
        // Evictions are announced before the slots are overwritten, commits after the headers.
        let plan = t.index_mut().prepare_write(&keys).unwrap();
        for k in &plan.evicted {
            writeln!(out, "E {}", k.0).unwrap();
        }
        out.flush().unwrap();
        let items = write_items(&plan, |k| {
            vec![&data[keys.iter().position(|x| *x == k).unwrap()][..]]
        });
        assert!(t.file().write(&items).iter().all(Result::is_ok));
        t.index_mut().complete_write(&plan.keys, true).unwrap();
        for k in &plan.keys {
            writeln!(out, "C {}", k.0).unwrap();
        }
        out.flush().unwrap();
    }
}

#[test]
fn crash_safety_under_sigkill() {
    let _serial = serial();
    let root = tmp("crash");
    let exe = std::env::current_exe().unwrap();
    let mut rng = Rng(77);
    let mut live: HashSet<u128> = HashSet::new();
    let (mut committed_total, mut found_total, mut served_total) = (0usize, 0usize, 0usize);
    for run in 0..20 {
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                "crash_child",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CRASH_DIR, &root)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        // Wait until the writer is up, then let it write for a random while and kill it.
        for l in lines.by_ref() {
            if l.unwrap().ends_with("READY") {
                break;
            }
        }
        let reader = std::thread::spawn(move || {
            let mut ev = Vec::new();
            for l in lines.map_while(std::result::Result::ok) {
                ev.push(l);
            }
            ev
        });
        std::thread::sleep(Duration::from_millis(20 + rng.below(300)));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        for l in reader.join().unwrap() {
            let Some((tag, key)) = l.split_once(' ') else {
                continue;
            };
            let Ok(key) = key.parse::<u128>() else {
                continue;
            };
            match tag {
                "C" => {
                    live.insert(key);
                }
                "E" => {
                    live.remove(&key);
                }
                _ => {}
            }
        }
        // The killed writer's directory verifies as it is (nothing to attribute, no bad
        // header or chunk, not in use any more).
        for rep in inspect(&root, true).unwrap() {
            assert!(rep.problems.is_empty(), "run {run}: {:?}", rep.problems);
            assert_eq!(rep.verified, rep.chunks, "run {run}");
        }
        // Reopen: every chunk the index recovers is verified against the oracle.
        let o = opts(&root, CRASH_LEN as u64, CRASH_SLOTS);
        let mut t = DiskTier::open(&o, &ns("m")).unwrap();
        let recovered = t.index().recovered();
        let scan = t.file().scan().unwrap();
        let mut now_live = HashSet::new();
        for &(_, k, _) in &scan.chunks {
            if let Some(ok) = get(&mut t, k, CRASH_LEN) {
                assert!(ok, "run {run}: key {k} served wrong bytes");
                served_total += 1;
                now_live.insert(k.0);
            }
        }
        let found = live.iter().filter(|k| now_live.contains(k)).count();
        eprintln!(
            "run {run}: committed before the kill {}, found {found}, recovered {recovered}",
            live.len()
        );
        committed_total += live.len();
        found_total += found;
        live = now_live;
    }
    eprintln!("crash: committed {committed_total}, found {found_total}, served {served_total}");
    assert!(committed_total > 0);
    assert!(
        found_total * 100 >= committed_total * 99,
        "found {found_total} of {committed_total}"
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// `len` bytes at a [`BLOCK`]-aligned address (inside `v`): what `O_DIRECT` may move.
fn aligned_in(v: &mut Vec<u8>, len: usize) -> &mut [u8] {
    v.resize(len + BLOCK as usize, 0);
    let at = v.as_ptr().align_offset(BLOCK as usize);
    &mut v[at..at + len]
}

#[test]
fn the_o_direct_path_round_trips_rewrites_and_catches_corruption() {
    let _serial = serial();
    let root = tmp("direct");
    let len = 3 * BLOCK as usize;
    let o = opts(&root, len as u64, 8);
    let mut t = DiskTier::open(&o, &ns("m")).unwrap();
    if !t.file().direct() {
        eprintln!(
            "the file system under {} refuses O_DIRECT: skipped",
            root.display()
        );
        return;
    }
    // Aligned chunks in two aligned pieces each, written and read with O_DIRECT.
    let (mut src, mut dst) = (Vec::new(), Vec::new());
    let put_aligned = |t: &mut DiskTier, src: &mut Vec<u8>, key: Key| {
        let chunk = aligned_in(src, len);
        chunk.copy_from_slice(&oracle(key, len));
        let (head, tail) = chunk.split_at(BLOCK as usize);
        t.put(&[(key, vec![head, tail])])
            .is_some_and(|w| w == [key])
    };
    let get_aligned = |t: &mut DiskTier, dst: &mut Vec<u8>, key: Key| {
        let chunk = aligned_in(dst, len);
        chunk.fill(0xEE);
        let (head, tail) = chunk.split_at_mut(2 * BLOCK as usize);
        t.get(key, &mut [head, tail])
            .then(|| chunk == oracle(key, len))
    };
    for k in 1..=8 {
        assert!(put_aligned(&mut t, &mut src, Key(k)));
    }
    for k in 1..=8 {
        assert_eq!(get_aligned(&mut t, &mut dst, Key(k)), Some(true), "key {k}");
    }
    // The tier is full: new keys evict old ones and rewrite their slots (header block and
    // data in one O_DIRECT write, the header after the sync, through the page cache).
    for k in 9..=12 {
        assert!(put_aligned(&mut t, &mut src, Key(k)));
    }
    for k in 1..=12 {
        let want = if k <= 4 { None } else { Some(true) };
        assert_eq!(get_aligned(&mut t, &mut dst, Key(k)), want, "key {k}");
    }
    let s = t.file().io_stats();
    assert!(s.direct_pieces > 0 && s.buffered_pieces == 0, "{s:?}");
    // A data bit flipped through the page cache is seen by the next O_DIRECT read.
    let loc = t.index().location(Key(10)).unwrap();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(slab_path(&root, &ns("m")))
        .unwrap();
    let slot_bytes = BLOCK + len as u64;
    let off = loc.place * slot_bytes + BLOCK + 5000;
    let mut b = [0u8];
    file.read_exact_at(&mut b, off).unwrap();
    file.write_all_at(&[b[0] ^ 0x10], off).unwrap();
    assert_eq!(get_aligned(&mut t, &mut dst, Key(10)), None);
    assert_eq!(t.index().stats().quarantined, 1);
    drop(t);
    // Reopened: the headers written through the page cache are found, the quarantined slot
    // is not, and every other chunk reads back equal with O_DIRECT.
    let mut t = DiskTier::open(&o, &ns("m")).unwrap();
    assert_eq!(t.index().recovered(), 7);
    for k in (5..=12).filter(|&k| k != 10) {
        assert_eq!(get_aligned(&mut t, &mut dst, Key(k)), Some(true), "key {k}");
    }
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn batches_check_their_checksums_beside_the_io() {
    use kvoffload::tier::disk::{ChunkRead, ReadError, BESIDE_MIN_BYTES};
    let _serial = serial();
    let root = tmp("beside");
    let len = 256 << 10;
    let n = 6u32;
    assert!(
        u64::from(n) * len as u64 >= BESIDE_MIN_BYTES,
        "the helper thread runs"
    );
    let layout = SlabLayout::new(len as u64, 8 * (BLOCK + len as u64)).unwrap();
    let f = SlabFile::open(&root, &ns("m"), layout, true, true).unwrap();
    let keys: Vec<Key> = (0..n).map(|i| Key(u128::from(i) + 77)).collect();
    let data: Vec<Vec<u8>> = keys.iter().map(|&k| oracle(k, len)).collect();
    let items: Vec<WriteItem<'_>> = keys
        .iter()
        .zip(&data)
        .enumerate()
        .map(|(i, (&key, d))| WriteItem {
            slot: i as u32,
            key,
            generation: 5,
            pieces: vec![&d[..1000], &d[1000..]],
        })
        .collect();
    assert!(f.write(&items).iter().all(Result::is_ok));
    // A data bit of chunk 3 flipped on disk.
    let raw = std::fs::OpenOptions::new()
        .write(true)
        .open(f.path())
        .unwrap();
    let slot_bytes = BLOCK + (len as u64).div_ceil(BLOCK) * BLOCK;
    let off = 3 * slot_bytes + BLOCK + 4321;
    raw.write_all_at(&[data[3][4321] ^ 4], off).unwrap();
    let mut out: Vec<Vec<u8>> = (0..n).map(|_| vec![0xAB; len]).collect();
    let mut reads: Vec<ChunkRead<'_>> = out
        .iter_mut()
        .zip(&keys)
        .enumerate()
        .map(|(i, (o, &key))| {
            let (a, b) = o.split_at_mut(5000);
            ChunkRead {
                key,
                loc: Location {
                    place: i as u64,
                    generation: 5,
                },
                pieces: vec![a, b],
            }
        })
        .collect();
    let results = f.read_batch(&mut reads);
    drop(reads);
    for (i, r) in results.iter().enumerate() {
        if i == 3 {
            assert!(
                matches!(r, Err(ReadError::Checksum { slot: 3, .. })),
                "{r:?}"
            );
        } else {
            assert!(r.is_ok(), "chunk {i}: {r:?}");
            assert!(out[i] == data[i], "chunk {i}: wrong bytes");
        }
    }
    let s = f.io_stats();
    assert_eq!((s.chunks_read, s.read_failures), (5, 1));
    let _ = std::fs::remove_dir_all(&root);
}
