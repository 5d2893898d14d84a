//! The disk tier's deadline and probation, on a real tier worker whose disk reads are made to
//! hang (cargo feature `fault-injection`): a hung promotion expires, the requests waiting for
//! it recompute, its CPU slots are never reused until its late report, a late success serves
//! nothing, and every byte read from the CPU pool is the oracle's. Failed or expired jobs put
//! the tier on probation: stores dropped, lookups skip it, then a trial recovers it.
//!
//! No outcome depends on how loaded the machine is: the hung promotion is held by a gate
//! ([`ReadFault::hang`]), not by time; the deadline and the probation are seconds, far longer
//! than any scheduling hiccup of the steps that must fit in them (a promotion that must succeed,
//! on a nice-19 I/O thread; the steps a probation must cover); and a test waits past them until
//! an instant taken after their clock started, so it is past them when it looks.

use std::path::{Path, PathBuf};
use std::thread::sleep;
use std::time::{Duration, Instant};

use kvoffload::scheduler::{DiskWatch, Scheduler, StepPlan, TierJobKind};
use kvoffload::tier::disk::{SlabFile, SlabLayout, BLOCK};
use kvoffload::tier::fault::ReadFault;
use kvoffload::tier::io::WorkerJob;
use kvoffload::{BlockId, JobId, Key};

mod support;
use support::tier::{config, namespace, oracle, step, CpuTier, CHUNK};

const DISK_BYTES: u64 = 64 * (BLOCK + 2 * BLOCK);

/// A promotion's deadline (see the module documentation).
const DEADLINE: Duration = Duration::from_secs(3);
/// A probation's length (see the module documentation).
const PROBATION: Duration = Duration::from_secs(3);

/// One engine: its scheduler, its CPU pool bytes and a real tier worker over them.
struct Engine {
    s: Scheduler,
    tier: CpuTier,
    /// Tier jobs submitted and not reported yet.
    inflight: Vec<JobId>,
    /// Every `(key, slot)` a store job wrote, in order.
    stored: Vec<(Key, u32)>,
    /// Tier jobs known to hang: [`Engine::settle`] does not wait for them.
    hung: Vec<JobId>,
}

impl Engine {
    fn new(root: &Path, watch: DiskWatch) -> Self {
        let mut s = Scheduler::new(config()).unwrap();
        s.attach_disk_with(root, DISK_BYTES, "m", watch).unwrap();
        let layout = SlabLayout::new(CHUNK as u64, DISK_BYTES).unwrap();
        let file = SlabFile::open(root, &namespace(), layout, false, false).unwrap();
        Engine {
            s,
            tier: CpuTier::new(Some(file), None),
            inflight: Vec::new(),
            stored: Vec::new(),
            hung: Vec::new(),
        }
    }

    /// Runs a plan: stores write the oracle's bytes, loads check them, tier jobs go to the
    /// worker's threads; then reports whatever finished within `wait`.
    fn execute(&mut self, plan: &StepPlan, wait: Duration) {
        for job in &plan.stores {
            for t in &job.transfers {
                for (k, slot) in t.keys.iter().zip(&t.cpu_blocks) {
                    self.tier.store(*k, *slot);
                    self.stored.push((*k, *slot));
                }
            }
            self.s.complete(job.id, 0, true).unwrap();
        }
        for job in &plan.loads {
            for t in &job.transfers {
                for (k, slot) in t.keys.iter().zip(&t.cpu_blocks) {
                    assert!(
                        self.tier.slot(*slot) == oracle(*k),
                        "key {k}: wrong bytes loaded"
                    );
                }
            }
            self.s.complete(job.id, 0, true).unwrap();
        }
        let jobs: Vec<WorkerJob> = plan.tier_jobs.iter().map(WorkerJob::from).collect();
        self.inflight.extend(jobs.iter().map(|j| j.id));
        self.tier.worker.submit(jobs);
        self.pump(wait);
    }

    /// Reports the tier jobs that finish within `wait`.
    fn pump(&mut self, wait: Duration) {
        for (id, ok) in self.tier.worker.wait(&self.inflight, wait) {
            self.inflight.retain(|j| *j != id);
            assert_eq!(self.s.complete(id, 0, ok).unwrap(), None);
        }
    }

    /// Runs empty steps until the worker reported every tier job but the hung ones (bounded).
    fn settle(&mut self) {
        let until = Instant::now() + Duration::from_secs(20);
        while self.inflight.iter().any(|j| !self.hung.contains(j)) {
            assert!(Instant::now() < until, "tier jobs never finished");
            let plan = self.s.schedule(&step(&[], &[], &[])).unwrap();
            self.execute(&plan, Duration::from_millis(20));
        }
    }

    /// Request `id` computes `keys` (one 4-token block per chunk, blocks from `first`),
    /// `per_step` chunks per step, then finishes; its stores and write-behinds run.
    fn compute(&mut self, id: &'static str, keys: &[Key], first: u32, per_step: usize) {
        let n = keys.len() as u32;
        if self.s.status(id).is_err() {
            self.s.add_request(id, 4 * n + 1, keys.to_vec()).unwrap();
            assert_eq!(self.s.lookup(id, 0).unwrap(), Some(0));
        }
        let blocks: Vec<u32> = (first..=first + n).collect();
        self.s
            .allocate(id, &[blocks.iter().copied().map(BlockId).collect()], 0, 0)
            .unwrap();
        let mut done = 0;
        while done < keys.len() {
            done = (done + per_step).min(keys.len());
            let tokens = if done == keys.len() {
                4 * n + 1
            } else {
                4 * done as u32
            };
            let plan = self
                .s
                .schedule(&step(&[(id, tokens)], &[], &blocks))
                .unwrap();
            self.execute(&plan, Duration::from_millis(20));
        }
        let plan = self.s.schedule(&step(&[], &[id], &[])).unwrap();
        self.execute(&plan, Duration::from_millis(20));
        self.settle();
    }

    /// Every chunk ready in the CPU pool holds the oracle's bytes (its latest store's slot).
    fn check_bytes(&self) {
        let pool = self.s.pool(0).unwrap();
        pool.check_consistency().unwrap();
        let mut latest = std::collections::HashMap::new();
        for &(k, s) in &self.stored {
            latest.insert(k, s);
        }
        for (k, s) in latest {
            if matches!(pool.state(k), kvoffload::pool::KeyState::Ready { .. }) {
                assert!(
                    self.tier.slot(s) == oracle(k),
                    "key {k} in slot {s}: wrong bytes"
                );
            }
        }
    }
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvo-deadline-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn keys(base: u128, n: u128) -> Vec<Key> {
    (1..=n).map(|i| Key(base + i)).collect()
}

/// [`DEADLINE`] and [`PROBATION`]; probation only after many failures (or after `after`).
fn watch(after: u32) -> DiskWatch {
    DiskWatch {
        deadline: DEADLINE,
        probation_after: after,
        probation: PROBATION,
        ..DiskWatch::default()
    }
}

/// Sleeps until `t` (at once if it passed).
fn sleep_until(t: Instant) {
    sleep(t.saturating_duration_since(Instant::now()));
}

/// First engine on `root`: 4 chunks computed, written behind to disk; then closed.
fn fill(root: &Path) -> Vec<Key> {
    let a = keys(0xA00, 4);
    let mut e = Engine::new(root, watch(100));
    e.compute("a", &a, 1, 4);
    assert_eq!(e.s.tier_stats()[0].tier.writes, 4);
    a
}

/// A second engine's request `id` on `a`: the lookup creates a promotion (ask later), whose
/// job is handed to the worker, where it hangs; requests `waiting` (also on `a`) look up right
/// after the plan and wait for it. Returns its CPU slots and the instant its deadline is
/// counted from, or a later one.
fn hung_promotion(
    e: &mut Engine,
    fault: &ReadFault,
    id: &'static str,
    waiting: &[&'static str],
    a: &[Key],
) -> (Vec<u32>, Instant) {
    let before = Instant::now();
    e.s.add_request(id, 17, a.to_vec()).unwrap();
    assert_eq!(e.s.lookup(id, 0).unwrap(), None, "promotion: ask later");
    let plan = e.s.schedule(&step(&[], &[], &[])).unwrap();
    let planned = Instant::now();
    assert_eq!(plan.tier_jobs.len(), 1);
    assert_eq!(plan.tier_jobs[0].kind, TierJobKind::Promote);
    for w in waiting {
        e.s.add_request(w, 17, a.to_vec()).unwrap();
        assert_eq!(
            e.s.lookup(w, 0).unwrap(),
            None,
            "{w} waits for the promotion"
        );
    }
    assert!(
        before.elapsed() < DEADLINE,
        "the machine stalled this thread for the whole deadline"
    );
    let slots = plan.tier_jobs[0].cpu_slots.clone();
    e.hung.push(plan.tier_jobs[0].id);
    e.execute(&plan, Duration::from_millis(1));
    let until = Instant::now() + Duration::from_secs(10);
    while fault.reads() == 0 {
        assert!(
            Instant::now() < until,
            "the promotion never reached the disk"
        );
        sleep(Duration::from_millis(1));
    }
    (slots, planned)
}

/// Request `id` (added) on `a`: runs empty steps until its lookup answers; the promotion
/// it waits for finishes well within [`DEADLINE`].
fn promoted(e: &mut Engine, id: &'static str, a: &[Key]) -> Option<u32> {
    e.s.add_request(id, 17, a.to_vec()).unwrap();
    let until = Instant::now() + 2 * DEADLINE;
    loop {
        let answer = e.s.lookup(id, 0).unwrap();
        if answer.is_some() || Instant::now() > until {
            return answer;
        }
        let plan = e.s.schedule(&step(&[], &[], &[])).unwrap();
        e.execute(&plan, Duration::from_millis(5));
    }
}

#[test]
fn a_hung_promotion_expires_its_slots_stay_held_and_a_late_success_serves_nothing() {
    let root = tmp("hung");
    let a = fill(&root);
    let mut e = Engine::new(&root, watch(100));
    let fault = ReadFault::hang(&root);
    let (held, planned) = hung_promotion(&mut e, &fault, "b", &["b2"], &a);
    // Both I/O threads lowered their CPU priority (the hung one before its first job).
    if cfg!(target_os = "linux") {
        assert_eq!(e.tier.worker.low_priority_threads().1, 2);
        assert!(e.tier.worker.low_priority_threads().0 >= 1);
    }
    // A second request ("b2") waits for the promotion in flight.
    sleep_until(planned + DEADLINE);
    // Past the deadline: both requests stop waiting and recompute.
    assert_eq!(e.s.lookup("b", 0).unwrap(), Some(0));
    assert_eq!(e.s.lookup("b2", 0).unwrap(), Some(0));
    let st = e.s.tier_stats()[0];
    assert_eq!(
        (st.expired_promotions, st.held_slots, st.late_reports),
        (1, 4, 0)
    );
    let pool = e.s.pool(0).unwrap();
    assert_eq!(pool.stats().held, 4);
    assert!(a
        .iter()
        .all(|k| pool.state(*k) == kvoffload::pool::KeyState::Absent));
    pool.check_consistency().unwrap();

    // The CPU pool fills up (12 chunks in one store, then 2 more that evict): no store ever
    // gets a held slot.
    let c = keys(0xC40, 14); // low bytes unlike `a`'s: other oracle bytes
    e.compute("c", &c, 10, 12);
    assert!(
        e.stored.iter().all(|(_, s)| !held.contains(s)),
        "a held slot was reused: {:?} held, stores {:?}",
        held,
        e.stored
    );
    assert_eq!(e.s.pool(0).unwrap().stats().held, 4);

    // The late read finishes (successfully) and is reported: its slots are freed, nothing
    // is published, and every ready chunk still has its own bytes.
    let stores = e.s.pool(0).unwrap().stats().stores;
    fault.release();
    e.hung.clear();
    e.settle();
    let st = e.s.tier_stats()[0];
    assert_eq!(
        (st.held_slots, st.late_reports, st.promoted_chunks),
        (0, 1, 0)
    );
    let pool = e.s.pool(0).unwrap();
    assert_eq!((pool.stats().held, pool.stats().stores), (0, stores));
    assert!(a
        .iter()
        .all(|k| pool.state(*k) == kvoffload::pool::KeyState::Absent));
    e.check_bytes();

    // The disk still holds the chunks (a late success only unpins them): a new request
    // promotes them again and loads the oracle's bytes.
    assert_eq!(promoted(&mut e, "d", &a), Some(16));
    e.s.allocate("d", &[(40..=44).map(BlockId).collect()], 0, 16)
        .unwrap()
        .expect("a load");
    let plan =
        e.s.schedule(&step(&[("d", 17)], &[], &[40, 41, 42, 43, 44]))
            .unwrap();
    assert_eq!(plan.loads.len(), 1);
    e.execute(&plan, Duration::from_millis(5));
    e.check_bytes();
    assert_eq!(e.s.tier_stats()[0].promoted_chunks, 4);
    drop(fault);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn expired_and_failed_jobs_put_the_disk_on_probation_then_a_trial_recovers_it() {
    let root = tmp("probation");
    let a = fill(&root);
    let mut e = Engine::new(&root, watch(1));
    let fault = ReadFault::hang(&root);
    let (_, planned) = hung_promotion(&mut e, &fault, "b", &[], &a);
    sleep_until(planned + DEADLINE);
    // The probation starts at this lookup's expiry, between these instants.
    let before = Instant::now();
    assert_eq!(e.s.lookup("b", 0).unwrap(), Some(0));
    let expired = Instant::now();
    let st = e.s.tier_stats()[0];
    assert_eq!((st.expired_promotions, st.tier.probations), (1, 1));

    // On probation: another request's lookup skips the disk (no promotion, a miss), and
    // chunks computed now are not written behind (dropped, counted).
    fault.release();
    e.hung.clear();
    e.settle();
    e.s.add_request("x", 17, a.clone()).unwrap();
    assert_eq!(e.s.lookup("x", 0).unwrap(), Some(0), "the disk is skipped");
    let x = keys(0xE80, 4);
    e.compute("y", &x, 20, 4);
    let st = e.s.tier_stats()[0];
    assert_eq!(st.promote_jobs, 1);
    assert!(st.skipped_lookups >= 4 && st.tier.skipped_checks == st.skipped_lookups);
    assert_eq!(st.dropped_writes, 4);
    assert_eq!(st.tier.writes, 4, "only the first engine's chunks");
    assert!(
        before.elapsed() < PROBATION,
        "the machine stalled the steps above for the whole probation"
    );

    // After the probation: a trial promotion succeeds, the tier recovers.
    sleep_until(expired + PROBATION);
    assert_eq!(promoted(&mut e, "z", &a), Some(16));
    let st = e.s.tier_stats()[0];
    assert_eq!(
        (st.promote_jobs, st.tier.probations, st.tier.recoveries),
        (2, 1, 1)
    );
    e.check_bytes();
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn bad_deadline_and_probation_settings_are_refused_naming_them() {
    let root = tmp("bad-watch");
    let ms = Duration::from_millis;
    for (watch, msg) in [
        (
            DiskWatch {
                probation_after: 0,
                ..watch(3)
            },
            "disk_probation_after must be >= 1, got 0",
        ),
        (
            DiskWatch {
                probation: ms(0),
                ..watch(3)
            },
            "disk_probation_ms must be positive, got 0",
        ),
        (
            DiskWatch {
                deadline: ms(0),
                ..watch(3)
            },
            "disk_deadline_ms must be positive, got 0",
        ),
    ] {
        let mut s = Scheduler::new(config()).unwrap();
        let err = s
            .attach_disk_with(&root, DISK_BYTES, "m", watch)
            .unwrap_err();
        assert!(err.to_string().contains(msg), "{err}");
        assert!(s.tier_stats().is_empty(), "nothing attached");
    }
    let _ = std::fs::remove_dir_all(&root);
}
