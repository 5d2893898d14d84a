//! The scheduler with two lower tiers on one group (DESIGN.md §9): a chunk ready in the CPU
//! pool is written behind to each tier that admits it; a lookup that misses the CPU pool
//! promotes each chunk from the nearest tier holding it (disk before the shared tier); the
//! shared tier's admission filter may wait for a chunk's reuse. The tiers here are indexes
//! only (no I/O: the plans are the subject; bytes are checked end to end by
//! `tests/test_disk.py`): a [`DiskIndex`], and one posing as the shared tier.

use kvoffload::policy::PolicyKind;
use kvoffload::pool::KeyState;
use kvoffload::scheduler::{Scheduler, StepPlan, TierAdmission, TierJobKind};
use kvoffload::tier::disk::{DiskIndex, SlabLayout, BLOCK};
use kvoffload::tier::{Location, Medium, TierEvent, TierIndex, TierStats, TierWritePlan};
use kvoffload::{BlockId, Key};

mod support;
use support::tier::{config, step, CHUNK};

/// A disk index holding `held` (published).
fn disk(held: &[Key]) -> DiskIndex {
    let layout = SlabLayout::new(CHUNK as u64, 32 * (BLOCK + 2 * BLOCK)).unwrap();
    let mut idx = DiskIndex::new(layout, PolicyKind::Lru).unwrap();
    let plan = idx.prepare_write(held).unwrap();
    assert_eq!(plan.keys, held);
    idx.complete_write(held, true).unwrap();
    idx
}

/// A disk index posing as the shared tier (medium `"remote"`).
#[derive(Debug)]
struct Shared(DiskIndex);

impl TierIndex for Shared {
    fn medium(&self) -> Medium {
        Medium::Remote
    }
    fn state(&self, key: Key) -> KeyState {
        self.0.state(key)
    }
    fn lookup(&mut self, keys: &[Key]) -> usize {
        self.0.lookup(keys)
    }
    fn prepare_write(&mut self, keys: &[Key]) -> Option<TierWritePlan> {
        self.0.prepare_write(keys)
    }
    fn complete_write(&mut self, keys: &[Key], ok: bool) -> kvoffload::error::Result<()> {
        self.0.complete_write(keys, ok)
    }
    fn prepare_read(&mut self, keys: &[Key]) -> kvoffload::error::Result<Vec<Location>> {
        self.0.prepare_read(keys)
    }
    fn complete_read(&mut self, keys: &[Key], bad: &[Key]) -> kvoffload::error::Result<()> {
        self.0.complete_read(keys, bad)
    }
    fn take_events(&mut self) -> Vec<TierEvent> {
        self.0.take_events()
    }
    fn set_event_limit(&mut self, limit: usize) {
        self.0.set_event_limit(limit);
    }
    fn stats(&self) -> TierStats {
        self.0.stats()
    }
}

fn keys() -> Vec<Key> {
    (1..=4).map(|i| Key(0xD500 + i)).collect()
}

/// A scheduler whose group 0 has a disk tier holding `on_disk` and a shared tier holding
/// `shared` (attached shared first: the order of attachment does not decide the nearest).
fn scheduler(on_disk: &[Key], shared: &[Key], admit_shared: TierAdmission) -> Scheduler {
    let mut s = Scheduler::new(config()).unwrap();
    s.attach_tier_with(0, Box::new(Shared(disk(shared))), admit_shared)
        .unwrap();
    s.attach_tier(0, Box::new(disk(on_disk))).unwrap();
    s
}

/// Completes every store and tier job of `plan` (ok); returns the tier jobs as
/// `(kind, medium, keys)`.
fn run(s: &mut Scheduler, plan: &StepPlan) -> Vec<(TierJobKind, Medium, Vec<Key>)> {
    for j in &plan.stores {
        s.complete(j.id, 0, true).unwrap();
    }
    for j in &plan.tier_jobs {
        assert_eq!(s.complete(j.id, 0, true).unwrap(), None);
    }
    plan.tier_jobs
        .iter()
        .map(|j| (j.kind, j.medium, j.keys.clone()))
        .collect()
}

/// Request `id` computes the 4 chunks of [`keys`] in blocks `blocks` and finishes; returns
/// the tier jobs of the step after (the write-behind).
fn compute(
    s: &mut Scheduler,
    id: &'static str,
    blocks: [u32; 5],
) -> Vec<(TierJobKind, Medium, Vec<Key>)> {
    s.add_request(id, 17, keys()).unwrap();
    assert_eq!(s.lookup(id, 0).unwrap(), Some(0));
    s.allocate(id, &[blocks.iter().copied().map(BlockId).collect()], 0, 0)
        .unwrap();
    let plan = s.schedule(&step(&[(id, 17)], &[], &blocks)).unwrap();
    assert!(run(s, &plan).is_empty());
    let plan = s.schedule(&step(&[], &[id], &[])).unwrap();
    run(s, &plan)
}

#[test]
fn a_stored_chunk_is_written_behind_to_each_tier() {
    let mut s = scheduler(&[], &[], TierAdmission::default());
    let mut jobs = compute(&mut s, "a", [1, 2, 3, 4, 5]);
    jobs.sort_by_key(|j| j.1);
    assert_eq!(
        jobs,
        [
            (TierJobKind::Write, Medium::Disk, keys()),
            (TierJobKind::Write, Medium::Remote, keys())
        ]
    );
    let st = s.tier_stats();
    assert_eq!(
        (st[0].medium, st[1].medium),
        (Medium::Disk, Medium::Remote),
        "nearest first"
    );
    assert!(st.iter().all(|t| t.tier.writes == 4 && t.pending == 0));
    assert!(s.pending_jobs().is_empty());
}

#[test]
fn a_lookup_promotes_each_chunk_from_the_nearest_tier_holding_it() {
    let k = keys();
    // The disk holds chunks 0 and 2, the shared tier all four.
    let mut s = scheduler(&[k[0], k[2]], &k, TierAdmission::default());
    s.add_request("b", 17, k.clone()).unwrap();
    assert_eq!(
        s.lookup("b", 0).unwrap(),
        None,
        "ask later: promotions in flight"
    );
    let plan = s.schedule(&step(&[], &[], &[])).unwrap();
    let mut jobs = run(&mut s, &plan);
    jobs.sort_by_key(|j| j.1);
    assert_eq!(
        jobs,
        [
            (TierJobKind::Promote, Medium::Disk, vec![k[0], k[2]]),
            (TierJobKind::Promote, Medium::Remote, vec![k[1], k[3]]),
        ]
    );
    let plan = s.schedule(&step(&[], &[], &[])).unwrap();
    // Chunks promoted from the shared tier are written behind to the disk (which lacked them).
    assert_eq!(
        run(&mut s, &plan),
        [(TierJobKind::Write, Medium::Disk, vec![k[1], k[3]])]
    );
    assert_eq!(s.lookup("b", 0).unwrap(), Some(16));
    let st = s.tier_stats();
    assert_eq!((st[0].promoted_chunks, st[1].promoted_chunks), (2, 2));
    assert_eq!((st[0].tier.used, st[1].tier.used), (4, 4));
}

#[test]
fn chunks_on_both_tiers_come_from_the_disk_only() {
    let k = keys();
    let mut s = scheduler(&k, &k, TierAdmission::default());
    s.add_request("b", 17, k.clone()).unwrap();
    assert_eq!(s.lookup("b", 0).unwrap(), None);
    let plan = s.schedule(&step(&[], &[], &[])).unwrap();
    assert_eq!(
        run(&mut s, &plan),
        [(TierJobKind::Promote, Medium::Disk, k.clone())]
    );
    let plan = s.schedule(&step(&[], &[], &[])).unwrap();
    assert!(
        plan.tier_jobs.is_empty(),
        "both tiers hold them: nothing to write"
    );
    assert_eq!(s.lookup("b", 0).unwrap(), Some(16));
    assert_eq!(s.tier_stats()[1].promote_jobs, 0);
}

#[test]
fn a_shared_tier_admitting_on_reuse_gets_chunks_once_they_were_loaded() {
    let k = keys();
    let mut s = scheduler(&[], &[], TierAdmission { min_hits: 1 });
    assert_eq!(
        compute(&mut s, "a", [1, 2, 3, 4, 5]),
        [(TierJobKind::Write, Medium::Disk, k.clone())],
        "the shared tier waits for reuse"
    );
    // "b" reuses the prefix from the CPU pool: once its load completed, the chunks go down.
    s.add_request("b", 17, k.clone()).unwrap();
    assert_eq!(s.lookup("b", 0).unwrap(), Some(16));
    let blocks: Vec<BlockId> = [6, 7, 8, 9, 10].into_iter().map(BlockId).collect();
    let load = s.allocate("b", &[blocks], 0, 16).unwrap().unwrap();
    let plan = s
        .schedule(&step(&[("b", 17)], &[], &[6, 7, 8, 9, 10]))
        .unwrap();
    assert!(plan.tier_jobs.is_empty());
    assert_eq!(s.complete(load, 0, true).unwrap().map(|d| d.ok), Some(true));
    let plan = s.schedule(&step(&[], &["b"], &[])).unwrap();
    assert_eq!(
        run(&mut s, &plan),
        [(TierJobKind::Write, Medium::Remote, k.clone())]
    );
    // Another load of the same chunks writes nothing more (admitted once, at the first).
    s.add_request("c", 17, k.clone()).unwrap();
    assert_eq!(s.lookup("c", 0).unwrap(), Some(16));
    let blocks: Vec<BlockId> = [11, 12, 13, 14, 15].into_iter().map(BlockId).collect();
    let load = s.allocate("c", &[blocks], 0, 16).unwrap().unwrap();
    let plan = s
        .schedule(&step(&[("c", 17)], &[], &[11, 12, 13, 14, 15]))
        .unwrap();
    assert!(run(&mut s, &plan).is_empty());
    s.complete(load, 0, true).unwrap();
    let plan = s.schedule(&step(&[], &["c"], &[])).unwrap();
    assert!(run(&mut s, &plan).is_empty());
    assert_eq!(s.tier_stats()[1].tier.writes, 4);
    assert_eq!(s.tier_stats()[1].write_jobs, 1);
    assert!(s.pending_jobs().is_empty());
}

#[test]
fn a_reset_releases_both_tiers_jobs_and_attachment_is_checked() {
    let mut s = scheduler(&[], &[], TierAdmission::default());
    s.add_request("a", 17, keys()).unwrap();
    assert_eq!(s.lookup("a", 0).unwrap(), Some(0));
    let blocks: Vec<BlockId> = [1, 2, 3, 4, 5].into_iter().map(BlockId).collect();
    s.allocate("a", &[blocks], 0, 0).unwrap();
    let plan = s
        .schedule(&step(&[("a", 17)], &[], &[1, 2, 3, 4, 5]))
        .unwrap();
    s.complete(plan.stores[0].id, 0, true).unwrap();
    let (flushed, _) = s.reset(); // both write-behind jobs created, neither planned yet
    assert_eq!(flushed.len(), 2);
    let st = s.tier_stats();
    assert!(st
        .iter()
        .all(|t| t.pending == 0 && t.tier.writing == 0 && t.tier.writes == 0));
    let mut fresh = Scheduler::new(config()).unwrap();
    fresh.attach_tier(0, Box::new(disk(&[]))).unwrap();
    let again = fresh.attach_tier(0, Box::new(disk(&[])));
    assert!(again
        .unwrap_err()
        .to_string()
        .contains("group 0 has a disk tier already"));
    assert_eq!(
        fresh.tier_stats().len(),
        1,
        "nothing attached by the refused call"
    );
}
