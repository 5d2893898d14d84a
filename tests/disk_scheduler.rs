//! The scheduler with a disk tier: write-behind after stores, restart, promotion into the CPU
//! pool before the normal load, and failed promotions that recompute. A small in-test worker
//! executes the plans on plain byte buffers (the CPU pool) and a real slab file, with a byte
//! oracle: a chunk's bytes are a function of its key.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use kvoffload::config::GroupConfig;
use kvoffload::policy::PolicyKind;
use kvoffload::scheduler::{Scheduler, StepPlan, TierJob, TierJobKind};
use kvoffload::tier::disk::{DiskIndex, SlabFile, SlabLayout, WriteItem, BLOCK, SLAB_FILE};
use kvoffload::tier::namespace::Namespace;
use kvoffload::{BlockId, Key};

mod support;
use support::tier::{config, oracle, step, CHUNK, CPU_CHUNKS};

fn ns() -> Namespace {
    Namespace {
        model: "sched".into(),
        world_size: 1,
        ..Namespace::default()
    }
}

fn layout() -> SlabLayout {
    SlabLayout::new(CHUNK as u64, 32 * (BLOCK + 2 * BLOCK)).unwrap()
}

/// A worker: the CPU pool's bytes and the slab file.
struct Worker {
    cpu: Vec<u8>,
    file: SlabFile,
}

impl Worker {
    fn new(root: &Path) -> Self {
        Self {
            cpu: vec![0; CPU_CHUNKS as usize * CHUNK],
            file: SlabFile::open(root, &ns(), layout(), true, true).unwrap(),
        }
    }

    fn slot(&mut self, s: u32) -> &mut [u8] {
        &mut self.cpu[s as usize * CHUNK..(s as usize + 1) * CHUNK]
    }

    /// Runs a tier job; returns its ok flag.
    fn run(&mut self, j: &TierJob) -> bool {
        match j.kind {
            TierJobKind::Write => {
                let cpu = &self.cpu;
                let items: Vec<WriteItem<'_>> = j
                    .keys
                    .iter()
                    .zip(&j.cpu_slots)
                    .zip(&j.locations)
                    .map(|((k, s), loc)| WriteItem {
                        slot: loc.place as u32,
                        key: *k,
                        generation: loc.generation,
                        pieces: vec![&cpu[*s as usize * CHUNK..(*s as usize + 1) * CHUNK]],
                    })
                    .collect();
                self.file.write(&items).iter().all(Result::is_ok)
            }
            TierJobKind::Promote => {
                let mut ok = true;
                for ((k, s), loc) in j.keys.iter().zip(&j.cpu_slots).zip(&j.locations) {
                    let mut buf = vec![0u8; CHUNK];
                    match self.file.read(*k, *loc, &mut [&mut buf[..]]) {
                        Ok(()) => self.slot(*s).copy_from_slice(&buf),
                        Err(e) => {
                            assert!(e.is_corrupt(), "{e}");
                            self.file.quarantine(loc.place as u32).unwrap();
                            ok = false;
                        }
                    }
                }
                ok
            }
        }
    }

    /// Runs a plan's stores (writing the oracle's bytes, as a GPU copy would) and tier jobs,
    /// and reports them all; returns the tier jobs seen.
    fn execute(&mut self, s: &mut Scheduler, plan: &StepPlan) -> Vec<(TierJobKind, bool)> {
        for job in &plan.stores {
            for t in &job.transfers {
                for (k, slot) in t.keys.iter().zip(&t.cpu_blocks) {
                    self.slot(*slot).copy_from_slice(&oracle(*k));
                }
            }
            s.complete(job.id, 0, true).unwrap();
        }
        let mut seen = Vec::new();
        for j in &plan.tier_jobs {
            let ok = self.run(j);
            seen.push((j.kind, ok));
            assert_eq!(
                s.complete(j.id, 0, ok).unwrap(),
                None,
                "tier jobs belong to no request"
            );
        }
        seen
    }
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvo-dsched-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn keys() -> Vec<Key> {
    (1..=4).map(|i| Key(0xAB00 + i)).collect()
}

fn scheduler_on(root: &Path) -> Scheduler {
    let scan = kvoffload::tier::disk::scan_namespace(root, &ns(), layout()).unwrap();
    let idx = DiskIndex::recover(layout(), PolicyKind::Lru, &[scan]).unwrap();
    let mut s = Scheduler::new(config()).unwrap();
    s.attach_tier(0, Box::new(idx)).unwrap();
    s
}

/// First engine: request "a" stores 4 chunks; they are written behind to disk.
fn fill(root: &Path) {
    let mut s = fill_with(root, None);
    let ev = s.take_tier_events();
    assert_eq!(ev.len(), 1);
    assert_eq!(
        (ev[0].1.medium, ev[0].1.keys.clone()),
        (kvoffload::tier::Medium::Disk, keys())
    );
}

/// [`fill`] with the scheduler's event queues bounded to `limit` keys, if given.
fn fill_with(root: &Path, limit: Option<usize>) -> Scheduler {
    let mut s = scheduler_on(root);
    if let Some(l) = limit {
        s.set_event_limit(l);
    }
    let mut w = Worker::new(root);
    s.add_request("a", 17, keys()).unwrap();
    assert_eq!(s.lookup("a", 0).unwrap(), Some(0));
    s.allocate(
        "a",
        &[vec![1, 2, 3, 4, 5].into_iter().map(BlockId).collect()],
        0,
        0,
    )
    .unwrap();
    let plan = s
        .schedule(&step(&[("a", 17)], &[], &[1, 2, 3, 4, 5]))
        .unwrap();
    assert_eq!(plan.stores.len(), 1);
    assert!(w.execute(&mut s, &plan).is_empty());
    let plan = s.schedule(&step(&[], &["a"], &[])).unwrap();
    assert_eq!(w.execute(&mut s, &plan), [(TierJobKind::Write, true)]);
    let st = s.tier_stats()[0];
    assert_eq!((st.tier.writes, st.write_jobs, st.pending), (4, 1, 0));
    assert!(s.pending_jobs().is_empty());
    s
}

#[test]
fn tier_events_are_bounded_and_drops_counted() {
    // 3 keys fit, the write-behind's event has 4: dropped whole, counted; 0 records none.
    for limit in [3, 0] {
        let root = tmp(&format!("events{limit}"));
        let mut s = fill_with(&root, Some(limit));
        assert!(s.take_tier_events().is_empty());
        assert_eq!(s.tier_stats()[0].tier.events_dropped, 1);
        let _ = std::fs::remove_dir_all(&root);
    }
}

/// Second engine on the same directory: "b" with the same prefix promotes, then loads.
fn reuse(root: &Path, corrupt: bool) -> (Option<u32>, Scheduler, Worker) {
    let mut s = scheduler_on(root);
    let mut w = Worker::new(root);
    assert_eq!(
        s.tier_stats()[0].tier.used,
        4,
        "index rebuilt from the headers"
    );
    if corrupt {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .read(true)
            .open(root.join(ns().dir_name()).join(SLAB_FILE))
            .unwrap();
        let loc = layout().slot_bytes * 2 + BLOCK + 100;
        let mut b = [0u8];
        f.read_exact_at(&mut b, loc).unwrap();
        f.write_all_at(&[b[0] ^ 0x10], loc).unwrap();
    }
    s.add_request("b", 17, keys()).unwrap();
    assert_eq!(
        s.lookup("b", 0).unwrap(),
        None,
        "ask later: promotion in flight"
    );
    // A second request with the same prefix waits for the same promotion, no second one.
    s.add_request("c", 17, keys()).unwrap();
    assert_eq!(s.lookup("c", 0).unwrap(), None);
    let plan = s.schedule(&step(&[], &[], &[])).unwrap();
    assert_eq!(plan.tier_jobs.len(), 1);
    assert_eq!(plan.tier_jobs[0].keys, keys());
    assert_eq!(w.execute(&mut s, &plan), [(TierJobKind::Promote, !corrupt)]);
    (s.lookup("b", 0).unwrap(), s, w)
}

#[test]
fn restart_promotes_from_disk_then_loads_exact_bytes() {
    let root = tmp("ok");
    fill(&root);
    let (answer, mut s, w) = reuse(&root, false);
    assert_eq!(answer, Some(16));
    let load = s
        .allocate(
            "b",
            &[vec![6, 7, 8, 9, 10].into_iter().map(BlockId).collect()],
            0,
            16,
        )
        .unwrap()
        .expect("a load job");
    let plan = s
        .schedule(&step(&[("b", 17)], &[], &[6, 7, 8, 9, 10]))
        .unwrap();
    let job = plan.loads.iter().find(|j| j.id == load).unwrap();
    let t = &job.transfers[0];
    assert_eq!(t.keys, keys());
    for (k, slot) in t.keys.iter().zip(&t.cpu_blocks) {
        let at = *slot as usize * CHUNK;
        assert!(
            w.cpu[at..at + CHUNK] == oracle(*k),
            "key {k}: promoted bytes differ"
        );
    }
    let st = s.tier_stats()[0];
    assert_eq!(
        (st.promote_jobs, st.promoted_chunks, st.failed_promotions),
        (1, 4, 0)
    );
    assert_eq!(st.tier.promotions, 4);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_corrupt_chunk_fails_the_promotion_and_the_request_recomputes() {
    let root = tmp("bad");
    fill(&root);
    let (answer, mut s, _w) = reuse(&root, true);
    assert_eq!(answer, Some(0), "nothing loadable: recompute");
    let st = s.tier_stats()[0];
    assert_eq!((st.failed_promotions, st.tier.quarantined), (1, 4));
    assert_eq!(st.tier.used, 0);
    assert_eq!(s.lookup("c", 0).unwrap(), Some(0));
    // The quarantined slot is never served again, not after another restart either.
    drop(s);
    let s = scheduler_on(&root);
    assert_eq!(s.tier_stats()[0].tier.used, 3);
    assert_eq!(s.tier_stats()[0].tier.quarantined, 1);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn reset_releases_tier_jobs_and_attach_is_checked() {
    let root = tmp("reset");
    fill(&root);
    let mut s = scheduler_on(&root);
    s.add_request("b", 17, keys()).unwrap();
    assert_eq!(s.lookup("b", 0).unwrap(), None);
    let planned = s.schedule(&step(&[], &[], &[])).unwrap();
    assert_eq!(planned.tier_jobs.len(), 1, "the promotion is handed out");
    let (flushed, _) = s.reset();
    assert_eq!(flushed.len(), 1);
    // The next plan names the promotion apart from the copies, once.
    let plan = s.schedule(&step(&[], &[], &[])).unwrap();
    assert_eq!(plan.tier_flush, flushed);
    assert!(plan.flush.is_empty());
    assert!(s
        .schedule(&step(&[], &[], &[]))
        .unwrap()
        .tier_flush
        .is_empty());
    let st = s.tier_stats()[0];
    assert_eq!((st.pending, st.tier.reading), (0, 0));
    assert_eq!(
        st.tier.used, 4,
        "a flushed promotion keeps the chunks on disk"
    );
    assert!(s
        .attach_tier(
            0,
            Box::new(DiskIndex::new(layout(), PolicyKind::Lru).unwrap())
        )
        .is_err());
    let mut fresh = Scheduler::new(config()).unwrap();
    assert!(fresh
        .attach_tier(
            1,
            Box::new(DiskIndex::new(layout(), PolicyKind::Lru).unwrap())
        )
        .is_err());
    let _ = std::fs::remove_dir_all(&root);
}

/// A hybrid model (full attention + an 8-token sliding window, 4-token blocks) with an
/// index-only disk tier on both groups and `cpu_chunks` CPU slots per group.
fn hybrid(cpu_chunks: u32) -> Scheduler {
    let mut cfg = config();
    cfg.groups.push(GroupConfig {
        sliding_window: Some(8),
        ..cfg.groups[0]
    });
    cfg.cpu_chunks = cpu_chunks;
    cfg.tier_write_slots = cpu_chunks;
    let mut s = Scheduler::new(cfg).unwrap();
    for g in 0..2 {
        let idx = DiskIndex::new(layout(), PolicyKind::Lru).unwrap();
        s.attach_tier(g, Box::new(idx)).unwrap();
    }
    s
}

/// Reports every store and tier job of `plan` (no bytes move: these tests are about answers).
fn report_all(s: &mut Scheduler, plan: &StepPlan) -> Vec<(TierJobKind, u32, Vec<Key>)> {
    for job in &plan.stores {
        s.complete(job.id, 0, true).unwrap();
    }
    let mut seen = Vec::new();
    for j in &plan.tier_jobs {
        s.complete(j.id, 0, true).unwrap();
        seen.push((j.kind, j.group, j.keys.clone()));
    }
    seen
}

/// Request `id` computes a 33-token prompt with `keys` (8 blocks per group, first GPU block
/// `first`), is stored, finishes, and its chunks are written behind to both groups' tiers.
fn through_tier(s: &mut Scheduler, id: &'static str, keys: &[Key], first: u32) {
    s.add_request(id, 33, keys.to_vec()).unwrap();
    assert_eq!(s.lookup(id, 0).unwrap(), Some(0));
    let blocks = |o: u32| (first + o..first + o + 9).map(BlockId).collect::<Vec<_>>();
    s.allocate(id, &[blocks(0), blocks(9)], 0, 0).unwrap();
    let written: Vec<u32> = (first..first + 18).collect();
    let plan = s.schedule(&step(&[(id, 33)], &[], &written)).unwrap();
    report_all(s, &plan);
    let plan = s.schedule(&step(&[], &[id], &[])).unwrap();
    let writes = report_all(s, &plan);
    assert_eq!(
        writes.len(),
        2,
        "one write-behind job per group: {writes:?}"
    );
}

fn hybrid_keys(base: u128, shared: &[Key]) -> Vec<Key> {
    let mut k = shared.to_vec();
    k.extend((k.len() as u128..8).map(|i| Key(base + i)));
    k
}

#[test]
fn a_hybrid_promotion_brings_the_window_before_the_shared_prefix_end() {
    // "a" is on disk only (the CPU tier was reset); "b" shares its first 5 blocks, then
    // differs. The best end point is 20 tokens: the full-attention group needs chunks 0..5,
    // the window group the window before token 20 (chunks 3, 4), not the window before b's
    // prompt end (chunks b never shared with anyone).
    let mut s = hybrid(64);
    let a = hybrid_keys(0xA000, &[]);
    through_tier(&mut s, "a", &a, 1);
    s.reset();
    let b = hybrid_keys(0xB000, &a[..5]);
    s.add_request("b", 33, b.clone()).unwrap();
    assert_eq!(
        s.lookup("b", 0).unwrap(),
        None,
        "ask later: promotion in flight"
    );
    let plan = s.schedule(&step(&[], &[], &[])).unwrap();
    let mut promoted = report_all(&mut s, &plan);
    promoted.sort_by_key(|p| p.1);
    assert_eq!(
        promoted,
        [
            (TierJobKind::Promote, 0, a[..5].to_vec()),
            (TierJobKind::Promote, 1, a[3..5].to_vec())
        ]
    );
    assert_eq!(s.lookup("b", 0).unwrap(), Some(20));
    assert!(s.tier_stats().iter().all(|t| t.promoting == 0));
}

#[test]
fn promotions_in_flight_hold_at_most_half_the_cpu_pool_and_later_asks_get_the_room() {
    // 8 CPU slots per group: promotions may hold 4. "a" and "c" are on disk only.
    let mut s = hybrid(8);
    let a = hybrid_keys(0xA000, &[]);
    let c = hybrid_keys(0xC000, &[]);
    through_tier(&mut s, "a", &a, 1);
    through_tier(&mut s, "c", &c, 21);
    s.reset();
    // "b" (a's prefix) alone would need 8 + 2 chunks: it takes the end point whose chunks
    // fit in 4 slots per group (16 tokens: full chunks 0..4, window chunks 2..4).
    s.add_request("b", 33, a.clone()).unwrap();
    assert_eq!(s.lookup("b", 0).unwrap(), None);
    // "d" (c's prefix) finds no room while b's promotion is in flight: it asks later.
    s.add_request("d", 33, c.clone()).unwrap();
    assert_eq!(s.lookup("d", 0).unwrap(), None);
    let plan = s.schedule(&step(&[], &[], &[])).unwrap();
    let mut promoted = report_all(&mut s, &plan);
    promoted.sort_by_key(|p| p.1);
    assert_eq!(
        promoted,
        [
            (TierJobKind::Promote, 0, a[..4].to_vec()),
            (TierJobKind::Promote, 1, a[2..4].to_vec())
        ]
    );
    assert_eq!(s.lookup("b", 0).unwrap(), Some(16));
    // b's promotion finished: d's next ask promotes c's prefix.
    assert_eq!(s.lookup("d", 0).unwrap(), None);
    let plan = s.schedule(&step(&[], &[], &[])).unwrap();
    let promoted = report_all(&mut s, &plan);
    assert_eq!(promoted.len(), 2, "{promoted:?}");
    assert!(promoted.iter().any(|p| p.2 == c[..4]), "{promoted:?}");
    assert_eq!(s.lookup("d", 0).unwrap(), Some(16));
    // A reset while a promotion is in flight gives its room back.
    s.add_request("e", 33, hybrid_keys(0xE000, &a[..5]))
        .unwrap();
    s.reset();
    assert!(s
        .tier_stats()
        .iter()
        .all(|t| t.promoting == 0 && t.pending == 0));
}
