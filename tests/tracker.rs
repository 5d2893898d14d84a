//! Integration tests of the job table, the fence and the tracker (DESIGN.md §4).
//!
//! The first half checks each rule on a hand-written schedule. The second half is a proptest
//! that drives [`Tracker`] with long random schedules (stores, loads, releases, reacquires,
//! fence checks, worker reports by rank in any order, failed reports, duplicated ranks,
//! out-of-range ranks, unknown and completed ids, resets, late reports) next to a naive model —
//! a plain `Vec` of pending jobs, each with its set of reported ranks, whose check scans every
//! job — and checks the invariants of §4 after every operation. It is the tracker's one
//! random-schedule model (`tests/test_tracker_binding.py` checks the binding alone: negative
//! and over-32-bit ranks, wrong types); it predicts every report's verdict in the tracker's check
//! order, so a duplicate rank that counted, or a rank checked before the id, fails it.

use std::collections::BTreeSet;

use kvoffload::error::Error;
use kvoffload::fence::Fence;
use kvoffload::jobs::{Completion, JobKind, JobStats, JobTable, MAX_WORKERS};
use kvoffload::tracker::{FenceStats, Tracker};
use kvoffload::{BlockId, JobId, OwnerId};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

fn blocks(ids: &[u32]) -> Vec<BlockId> {
    ids.iter().copied().map(BlockId).collect()
}

fn jobs(ids: &[u64]) -> Vec<JobId> {
    ids.iter().copied().map(JobId).collect()
}

const O1: OwnerId = OwnerId(1);
const O2: OwnerId = OwnerId(2);

/// Everything a caller can observe of a tracker, for "an error changes nothing" checks.
#[derive(Debug, PartialEq)]
struct Snapshot {
    pending: Vec<PendingView>,
    index: Vec<Vec<JobId>>,
    armed_pairs: usize,
    owners: Vec<Option<(u32, u32, Vec<JobId>)>>,
    owners_len: usize,
    released: Vec<bool>,
    released_len: usize,
    next: JobId,
    job_stats: JobStats,
    fence_stats: FenceStats,
}

#[derive(Debug, PartialEq)]
struct PendingView {
    id: JobId,
    kind: JobKind,
    owner: OwnerId,
    eager: Vec<BlockId>,
    deferred: Vec<BlockId>,
    deferred_armed: bool,
    failed: bool,
    remaining: u32,
    reported: u128,
    payload: u64,
}

/// Snapshot of `t`, looking at owners `0..num_owners`.
fn snapshot(t: &Tracker<u64>, num_owners: u64) -> Snapshot {
    let pending = t
        .jobs()
        .pending_ids()
        .map(|id| {
            let j = t.jobs().get(id).expect("a pending id resolves to its job");
            assert_eq!(j.id, id);
            PendingView {
                id,
                kind: j.kind,
                owner: j.owner,
                eager: j.eager.clone(),
                deferred: j.deferred.clone(),
                deferred_armed: j.deferred_armed,
                failed: j.failed,
                remaining: j.remaining,
                reported: j.reported,
                payload: j.payload,
            }
        })
        .collect();
    let index = (0..t.fence().num_blocks())
        .map(|b| {
            let mut on = t.fence().jobs_on(BlockId(b));
            on.sort_unstable();
            on
        })
        .collect();
    let owners = (0..num_owners)
        .map(|o| {
            t.jobs()
                .owner(OwnerId(o))
                .map(|oj| (oj.stores, oj.loads, oj.jobs.clone()))
        })
        .collect();
    let released = (0..num_owners).map(|o| t.is_released(OwnerId(o))).collect();
    Snapshot {
        pending,
        index,
        armed_pairs: t.fence().armed_pairs(),
        owners,
        owners_len: t.jobs().owners_len(),
        released,
        released_len: t.released_len(),
        next: t.jobs().next_id(),
        job_stats: t.job_stats(),
        fence_stats: t.fence_stats(),
    }
}

/// Runs `op`, asserts it fails with `expected` and that nothing observable changed.
#[track_caller]
fn assert_rejected<T: std::fmt::Debug>(
    t: &mut Tracker<u64>,
    expected: &Error,
    op: impl FnOnce(&mut Tracker<u64>) -> Result<T, Error>,
) {
    let before = snapshot(t, 8);
    let got = op(t);
    match got {
        Err(e) => assert!(same_error(&e, expected), "expected {expected:?}, got {e:?}"),
        Ok(v) => panic!("expected {expected:?}, got Ok({v:?})"),
    }
    assert_eq!(
        snapshot(t, 8),
        before,
        "a rejected operation changed the tracker"
    );
}

/// Error equality that ignores the wording of `OwnerBusy` reasons.
fn same_error(a: &Error, b: &Error) -> bool {
    match (a, b) {
        (Error::OwnerBusy { owner: x, .. }, Error::OwnerBusy { owner: y, .. }) => x == y,
        _ => a == b,
    }
}

fn done(c: Completion<u64>) -> kvoffload::jobs::Job<u64> {
    match c {
        Completion::Done(j) => j,
        other => panic!("expected Done, got {other:?}"),
    }
}

fn tracker(workers: u32, num_blocks: u32) -> Tracker<u64> {
    Tracker::new(workers, num_blocks).expect("valid config")
}

fn store(t: &mut Tracker<u64>, owner: OwnerId, eager: &[u32], deferred: &[u32]) -> JobId {
    t.create(JobKind::Store, owner, blocks(eager), blocks(deferred), 0)
        .expect("store accepted")
}

// ---------------------------------------------------------------------------------------------
// Configuration and input validation
// ---------------------------------------------------------------------------------------------

#[test]
fn zero_or_too_many_workers_or_zero_blocks_is_a_config_error() {
    let e = Tracker::<()>::new(0, 8).unwrap_err();
    assert!(
        matches!(&e, Error::Config(m) if m.contains("num_workers")),
        "{e}"
    );
    let e = Tracker::<()>::new(1, 0).unwrap_err();
    assert!(
        matches!(&e, Error::Config(m) if m.contains("num_blocks")),
        "{e}"
    );
    assert!(matches!(JobTable::<()>::new(0), Err(Error::Config(_))));
    // One bit per rank and job: at most MAX_WORKERS workers.
    for n in [MAX_WORKERS + 1, u32::MAX] {
        let e = Tracker::<()>::new(n, 8).unwrap_err();
        assert!(
            matches!(&e, Error::Config(m) if m.contains("num_workers") && m.contains("128")),
            "{e}"
        );
        assert!(matches!(JobTable::<()>::new(n), Err(Error::Config(_))));
    }
    assert_eq!(
        Tracker::<()>::new(MAX_WORKERS, 8)
            .unwrap()
            .jobs()
            .num_workers(),
        MAX_WORKERS
    );
    let t = Tracker::<()>::new(3, 1).unwrap();
    assert_eq!(t.jobs().num_workers(), 3);
    assert_eq!(t.fence().num_blocks(), 1);
}

#[test]
fn out_of_range_blocks_are_rejected_and_change_nothing() {
    let mut t = tracker(1, 8);
    store(&mut t, O1, &[1], &[2]);
    let oob = Error::BlockOutOfRange {
        block: BlockId(8),
        num_blocks: 8,
    };
    assert_rejected(&mut t, &oob, |t| {
        t.create(JobKind::Store, O2, blocks(&[0, 8]), vec![], 0)
    });
    assert_rejected(&mut t, &oob, |t| {
        t.create(JobKind::Load, O2, vec![], blocks(&[7, 8, 9]), 0)
    });
    // Even for a released owner, whose job would be armed at once.
    t.release(O2);
    assert_rejected(&mut t, &oob, |t| {
        t.create(JobKind::Store, O2, blocks(&[3]), blocks(&[8]), 0)
    });
    // The check validates too, and a rejected check is not counted.
    assert_rejected(&mut t, &oob, |t| t.check(&blocks(&[1, 8])));
    assert_eq!(t.fence_stats().checks, 0);
    let e = Error::BlockOutOfRange {
        block: BlockId(u32::MAX),
        num_blocks: 8,
    };
    assert!(e.to_string().contains("4294967295") && e.to_string().contains('8'));
    assert_rejected(&mut t, &e, |t| t.check(&blocks(&[u32::MAX])));
}

#[test]
fn a_job_without_blocks_is_rejected() {
    let mut t = tracker(1, 8);
    for kind in [JobKind::Store, JobKind::Load] {
        assert_rejected(&mut t, &Error::EmptyJob(O1), |t| {
            t.create(kind, O1, vec![], vec![], 0)
        });
    }
    assert!(Error::EmptyJob(OwnerId(42)).to_string().contains("42"));
}

// ---------------------------------------------------------------------------------------------
// Lifecycle classes: eager, deferred, release, reacquire, forget
// ---------------------------------------------------------------------------------------------

#[test]
fn eager_pairs_are_armed_at_creation_deferred_pairs_of_a_running_owner_never() {
    let mut t = tracker(1, 16);
    let a = store(&mut t, O1, &[1, 2], &[3, 4, 5]);
    assert_eq!(t.fence().armed_pairs(), 2, "only the eager pairs");
    assert_eq!(t.fence().jobs_on(BlockId(1)), &[a]);
    for b in [3, 4, 5] {
        assert!(t.fence().jobs_on(BlockId(b)).is_empty());
    }
    // A running full-attention request's blocks cannot be re-allocated: no flush.
    assert_eq!(t.check(&blocks(&[3, 4, 5])).unwrap(), vec![]);
    assert_eq!(t.check(&blocks(&[2, 3])).unwrap(), vec![a]);
    assert!(!t.jobs().get(a).unwrap().deferred_armed);
}

#[test]
fn release_arms_the_pending_jobs_of_the_owner_once() {
    let mut t = tracker(2, 16);
    let a = store(&mut t, O1, &[], &[3, 4]);
    let b = store(&mut t, O1, &[5], &[6]);
    let other = store(&mut t, O2, &[], &[7]);
    assert_eq!(t.fence().armed_pairs(), 1);
    t.release(O1);
    assert!(t.is_released(O1) && !t.is_released(O2));
    assert_eq!(
        t.fence().armed_pairs(),
        4,
        "3 deferred pairs of owner 1 + 1 eager"
    );
    assert_eq!(t.check(&blocks(&[4, 6, 7])).unwrap(), vec![a, b]);
    assert!(!t.jobs().get(other).unwrap().deferred_armed);
    // A second release must not arm the same pairs twice.
    t.release(O1);
    assert_eq!(t.fence().armed_pairs(), 4);
    assert_eq!(t.fence().jobs_on(BlockId(4)), &[a]);
    // Completing disarms every pair of the job, eager and deferred.
    t.complete(a, 0, true).unwrap();
    done(t.complete(a, 1, true).unwrap());
    t.complete(b, 1, true).unwrap();
    assert_eq!(t.fence().armed_pairs(), 2, "b still pending");
    done(t.complete(b, 0, true).unwrap());
    assert_eq!(t.fence().armed_pairs(), 0);
    assert_eq!(t.check(&blocks(&[3, 4, 5, 6])).unwrap(), vec![]);
}

#[test]
fn release_without_pending_jobs_arms_later_jobs_at_creation() {
    let mut t = tracker(1, 16);
    t.release(O1);
    assert_eq!(t.fence().armed_pairs(), 0);
    let a = store(&mut t, O1, &[], &[9, 10]);
    assert!(t.jobs().get(a).unwrap().deferred_armed);
    assert_eq!(t.fence().armed_pairs(), 2);
    // The same single check covers it in the step it is created.
    assert_eq!(t.check(&blocks(&[10])).unwrap(), vec![a]);
    let l = t
        .create(JobKind::Load, O2, vec![], blocks(&[11]), 0)
        .unwrap();
    t.release(O2);
    assert_eq!(
        t.check(&blocks(&[11])).unwrap(),
        vec![l],
        "a load writes its blocks"
    );
}

#[test]
fn reacquire_makes_new_jobs_deferred_and_keeps_armed_pairs_armed() {
    let mut t = tracker(1, 16);
    let old = store(&mut t, O1, &[], &[1, 2]);
    t.release(O1); // preempted
    assert_eq!(t.fence().armed_pairs(), 2);
    t.reacquire(O1); // resumed with new blocks
    assert!(!t.is_released(O1));
    let new = store(&mut t, O1, &[], &[3, 4]);
    assert!(!t.jobs().get(new).unwrap().deferred_armed);
    assert!(t.jobs().get(old).unwrap().deferred_armed);
    assert_eq!(t.fence().armed_pairs(), 2);
    assert_eq!(t.check(&blocks(&[1, 2, 3, 4])).unwrap(), vec![old]);
    // Preempted again: only the unarmed job gets armed now.
    t.release(O1);
    assert_eq!(t.fence().armed_pairs(), 4);
    assert_eq!(t.fence().jobs_on(BlockId(1)), &[old]);
    assert_eq!(t.check(&blocks(&[1, 3])).unwrap(), vec![old, new]);
}

#[test]
fn forget_clears_the_released_mark_only() {
    let mut t = tracker(1, 16);
    let a = store(&mut t, O1, &[], &[1]);
    t.release(O1);
    assert_eq!(t.released_len(), 1);
    t.forget(O1);
    assert!(!t.is_released(O1));
    assert_eq!(t.released_len(), 0);
    // The armed pair stays armed until the job completes.
    assert_eq!(t.check(&blocks(&[1])).unwrap(), vec![a]);
    done(t.complete(a, 0, true).unwrap());
    assert_eq!(t.fence().armed_pairs(), 0);
    t.forget(OwnerId(77)); // unknown owner: a no-op
    assert_eq!(t.released_len(), 0);
}

// ---------------------------------------------------------------------------------------------
// The check
// ---------------------------------------------------------------------------------------------

#[test]
fn check_returns_each_armed_job_on_a_written_block_once_sorted() {
    let mut t = tracker(1, 32);
    let wide = store(&mut t, O1, &[5, 6, 7], &[]);
    let shared = store(&mut t, O2, &[6], &[]);
    let far = store(&mut t, OwnerId(3), &[20], &[]);
    let running = store(&mut t, OwnerId(4), &[], &[6]);
    let flush = t.check(&blocks(&[7, 6, 6, 5, 1])).unwrap();
    assert_eq!(
        flush,
        vec![wide, shared],
        "far is on an unwritten block, running is not armed"
    );
    assert_eq!(t.check(&[]).unwrap(), vec![]);
    let mut out = jobs(&[1000]);
    t.check_into(&blocks(&[20, 6]), &mut out).unwrap();
    assert_eq!(
        out,
        vec![JobId(1000), wide, shared, far],
        "appends after what the buffer holds"
    );
    let s = t.fence_stats();
    assert_eq!((s.checks, s.flushed), (3, 5));
    // The check itself changes nothing but its counters.
    assert_eq!(t.fence().armed_pairs(), 5);
    assert_eq!(t.jobs().len(), 4);
    // Once its request lets go of block 6, the same write flushes it too.
    t.release(OwnerId(4));
    assert_eq!(t.check(&blocks(&[6])).unwrap(), vec![wide, shared, running]);
}

#[test]
fn duplicate_blocks_in_a_job_are_fully_disarmed() {
    let mut t = tracker(1, 8);
    t.release(O1);
    let a = store(&mut t, O1, &[2, 2], &[2, 3]);
    assert_eq!(t.check(&blocks(&[2])).unwrap(), vec![a]);
    done(t.complete(a, 0, true).unwrap());
    assert_eq!(t.fence().armed_pairs(), 0);
    assert!(t.fence().jobs_on(BlockId(2)).is_empty());
}

// ---------------------------------------------------------------------------------------------
// Completion
// ---------------------------------------------------------------------------------------------

/// The `Job::reported` mask of `ranks`.
fn mask(ranks: &[u32]) -> u128 {
    ranks.iter().fold(0, |m, r| m | 1u128 << r)
}

#[test]
fn a_job_completes_after_every_rank_reported_once() {
    let mut t = tracker(4, 8);
    let a = t
        .create(JobKind::Store, O1, blocks(&[1]), vec![], 1234)
        .unwrap();
    // Ranks report in any order.
    for (rank, left) in [(2, 3), (0, 2), (3, 1)] {
        match t.complete(a, rank, true).unwrap() {
            Completion::Pending { remaining } => assert_eq!(remaining, left, "after rank {rank}"),
            other => panic!("rank {rank}: expected Pending, got {other:?}"),
        }
    }
    let j = t.jobs().get(a).unwrap();
    assert_eq!((j.remaining, j.reported), (1, mask(&[0, 2, 3])));
    assert_eq!(
        t.fence().jobs_on(BlockId(1)),
        &[a],
        "still armed until the last report"
    );
    let j = done(t.complete(a, 1, true).unwrap());
    assert_eq!(
        (j.id, j.owner, j.kind, j.payload, j.failed),
        (a, O1, JobKind::Store, 1234, false)
    );
    assert_eq!((j.remaining, j.reported), (0, mask(&[0, 1, 2, 3])));
    assert!(t.jobs().get(a).is_none());
    assert_eq!(t.job_stats().completed, 1);
    assert_eq!(t.fence().armed_pairs(), 0);
    // One worker: rank 0 completes the job, rank 1 does not exist.
    let mut t = tracker(1, 8);
    let b = store(&mut t, O1, &[2], &[]);
    let bad = Error::WorkerOutOfRange {
        job: b,
        worker: 1,
        num_workers: 1,
    };
    assert_rejected(&mut t, &bad, |t| t.complete(b, 1, true));
    done(t.complete(b, 0, true).unwrap());
    assert_eq!(t.job_stats().completed, 1);
}

#[test]
fn the_widest_engine_uses_every_bit_of_the_mask() {
    assert_eq!(MAX_WORKERS, 128);
    let mut t = tracker(MAX_WORKERS, 8);
    let a = store(&mut t, O1, &[1], &[]);
    for rank in (1..MAX_WORKERS).rev() {
        match t.complete(a, rank, true).unwrap() {
            Completion::Pending { remaining } => assert_eq!(remaining, rank),
            other => panic!("rank {rank}: expected Pending, got {other:?}"),
        }
    }
    assert_eq!(t.jobs().get(a).unwrap().reported, u128::MAX - 1);
    for rank in [127, 1] {
        let dup = Error::DuplicateReport {
            job: a,
            worker: rank,
        };
        assert_rejected(&mut t, &dup, |t| t.complete(a, rank, false));
    }
    for rank in [128, 129, u32::MAX] {
        let oob = Error::WorkerOutOfRange {
            job: a,
            worker: rank,
            num_workers: 128,
        };
        assert_rejected(&mut t, &oob, |t| t.complete(a, rank, true));
    }
    let j = done(t.complete(a, 0, true).unwrap());
    assert_eq!((j.reported, j.remaining, j.failed), (u128::MAX, 0, false));
}

#[test]
fn one_failed_report_fails_the_job() {
    let mut t = tracker(3, 8);
    let a = store(&mut t, O1, &[1], &[]);
    t.complete(a, 1, true).unwrap();
    t.complete(a, 0, false).unwrap();
    assert!(t.jobs().get(a).unwrap().failed);
    let j = done(t.complete(a, 2, true).unwrap());
    assert!(j.failed);
    assert_eq!((t.job_stats().completed, t.job_stats().failed), (1, 1));
    assert_eq!(
        t.fence().armed_pairs(),
        0,
        "a failed job leaves the fence too"
    );
}

#[test]
fn a_duplicated_report_never_stands_in_for_another_worker() {
    // A torn store: with two workers, worker 0 reports twice while
    // worker 1 may still be copying. The job stays pending, and fenced, until worker 1 reports.
    let mut t = tracker(2, 8);
    t.release(O1);
    let a = store(&mut t, O1, &[1], &[2]);
    assert!(matches!(
        t.complete(a, 0, true).unwrap(),
        Completion::Pending { remaining: 1 }
    ));
    for ok in [true, false] {
        let dup = Error::DuplicateReport { job: a, worker: 0 };
        assert_rejected(&mut t, &dup, |t| t.complete(a, 0, ok));
    }
    let j = t.jobs().get(a).unwrap();
    assert_eq!((j.remaining, j.reported, j.failed), (1, mask(&[0]), false));
    assert_eq!(t.jobs().pending_ids().collect::<Vec<_>>(), vec![a]);
    assert_eq!(t.fence().armed_pairs(), 2);
    assert_eq!(t.job_stats().completed, 0);
    assert_eq!(
        t.check(&blocks(&[2])).unwrap(),
        vec![a],
        "still fenced: worker 1 may be reading block 2"
    );
    let j = done(t.complete(a, 1, true).unwrap());
    assert!(!j.failed, "the rejected failed duplicate left no mark");
    assert_eq!(t.fence().armed_pairs(), 0);
    assert_rejected(&mut t, &Error::JobAlreadyCompleted(a), |t| {
        t.complete(a, 0, true)
    });
}

#[test]
fn bad_reports_are_errors_and_change_nothing() {
    let mut t = tracker(2, 8);
    let finished = store(&mut t, O1, &[1], &[]);
    let open = store(&mut t, O2, &[1], &[2]);
    t.complete(open, 1, false).unwrap();
    t.complete(finished, 0, true).unwrap();
    done(t.complete(finished, 1, true).unwrap());

    // Any rank of a completed job.
    for rank in [0, 1] {
        assert_rejected(&mut t, &Error::JobAlreadyCompleted(finished), |t| {
            t.complete(finished, rank, true)
        });
    }
    // The rank that reported `open` already, whatever it says now.
    for ok in [true, false] {
        let dup = Error::DuplicateReport {
            job: open,
            worker: 1,
        };
        assert_rejected(&mut t, &dup, |t| t.complete(open, 1, ok));
    }
    // Ranks the engine does not have.
    for rank in [2, 3, 127, 128, u32::MAX] {
        let oob = Error::WorkerOutOfRange {
            job: open,
            worker: rank,
            num_workers: 2,
        };
        assert_rejected(&mut t, &oob, |t| t.complete(open, rank, true));
    }
    // Ids never issued.
    assert_rejected(&mut t, &Error::UnknownJob(JobId(2)), |t| {
        t.complete(JobId(2), 0, true)
    });
    assert_rejected(&mut t, &Error::UnknownJob(JobId(u64::MAX)), |t| {
        t.complete(JobId(u64::MAX), 1, false)
    });
    // Messages name the ids and ranks.
    let m = Error::WorkerOutOfRange {
        job: JobId(17),
        worker: 5,
        num_workers: 3,
    }
    .to_string();
    assert!(
        m.contains("17") && m.contains('5') && m.contains('3'),
        "{m}"
    );
    let m = Error::DuplicateReport {
        job: JobId(16),
        worker: 4,
    }
    .to_string();
    assert!(m.contains("16") && m.contains('4'), "{m}");
    assert!(Error::UnknownJob(JobId(99)).to_string().contains("99"));
    assert!(Error::JobAlreadyCompleted(JobId(98))
        .to_string()
        .contains("98"));
    // open is still pending with rank 1's report and its failure.
    let j = t.jobs().get(open).unwrap();
    assert_eq!((j.remaining, j.reported, j.failed), (1, mask(&[1]), true));
    let j = done(t.complete(open, 0, true).unwrap());
    assert!(j.failed);
}

#[test]
fn report_checks_run_in_a_fixed_order() {
    // Late id, then unknown id, then rank out of range, then completed job, then duplicate
    // rank: the first check that fails names the error.
    let mut t = tracker(2, 8);
    let old = store(&mut t, O1, &[1], &[]);
    t.complete(old, 0, true).unwrap();
    t.reset();
    let finished = store(&mut t, O1, &[1], &[]);
    t.complete(finished, 1, true).unwrap();
    done(t.complete(finished, 0, true).unwrap());
    let open = store(&mut t, O2, &[2], &[]);
    t.complete(open, 0, true).unwrap();
    let unknown = JobId(3);

    let jt = t.jobs();
    assert_eq!(
        jt.validate(old, 0),
        Ok(false),
        "late beats a duplicate rank"
    );
    assert_eq!(jt.validate(old, 2), Ok(false), "late beats a bad rank");
    assert_eq!(
        jt.validate(unknown, 2),
        Err(Error::UnknownJob(unknown)),
        "unknown id beats a bad rank"
    );
    assert_eq!(
        jt.validate(finished, 2),
        Err(Error::WorkerOutOfRange {
            job: finished,
            worker: 2,
            num_workers: 2
        }),
        "a bad rank beats a completed job"
    );
    assert_eq!(
        jt.validate(finished, 0),
        Err(Error::JobAlreadyCompleted(finished))
    );
    assert_eq!(
        jt.validate(open, 0),
        Err(Error::DuplicateReport {
            job: open,
            worker: 0
        })
    );
    assert_eq!(jt.validate(open, 1), Ok(true));
    // complete() agrees with validate().
    for (id, rank) in [(old, 0), (old, 2)] {
        assert!(matches!(
            t.complete(id, rank, true).unwrap(),
            Completion::Late
        ));
    }
    for (id, rank) in [(unknown, 2), (finished, 2), (finished, 0), (open, 0)] {
        let want = t.jobs().validate(id, rank).unwrap_err();
        assert_rejected(&mut t, &want, |t| t.complete(id, rank, true));
    }
    done(t.complete(open, 1, true).unwrap());
}

#[test]
fn jobs_complete_out_of_order() {
    let mut t = tracker(1, 64);
    let ids: Vec<JobId> = (0..6)
        .map(|i| store(&mut t, OwnerId(i), &[i as u32], &[]))
        .collect();
    for &i in &[4usize, 0, 2] {
        let j = done(t.complete(ids[i], 0, true).unwrap());
        assert_eq!(j.id, ids[i]);
    }
    assert_eq!(
        t.jobs().pending_ids().collect::<Vec<_>>(),
        vec![ids[1], ids[3], ids[5]]
    );
    for &i in &[1usize, 3, 5] {
        assert_eq!(t.jobs().get(ids[i]).unwrap().owner, OwnerId(i as u64));
    }
    let late_new = store(&mut t, OwnerId(9), &[40], &[]);
    assert_eq!(late_new, JobId(6));
    assert_eq!(
        t.check(&blocks(&[0, 1, 2, 3, 4, 5, 40])).unwrap(),
        vec![ids[1], ids[3], ids[5], late_new]
    );
    for &i in &[5usize, 3, 1] {
        done(t.complete(ids[i], 0, true).unwrap());
    }
    assert_eq!(t.jobs().pending_ids().collect::<Vec<_>>(), vec![late_new]);
    assert!(t.jobs().get(ids[5]).is_none());
    assert_rejected(&mut t, &Error::JobAlreadyCompleted(ids[0]), |t| {
        t.complete(ids[0], 0, true)
    });
}

// ---------------------------------------------------------------------------------------------
// Per-request rule (invariant 7) and the owner map
// ---------------------------------------------------------------------------------------------

#[test]
fn a_request_has_one_pending_load_or_any_number_of_stores() {
    let mut t = tracker(1, 16);
    let s1 = store(&mut t, O1, &[1], &[]);
    let s2 = store(&mut t, O1, &[], &[2]);
    assert_eq!(t.jobs().owner(O1).unwrap().stores, 2);
    let busy = Error::OwnerBusy {
        owner: O1,
        reason: "",
    };
    assert_rejected(&mut t, &busy, |t| {
        t.create(JobKind::Load, O1, vec![], blocks(&[3]), 0)
    });
    done(t.complete(s1, 0, true).unwrap());
    assert_rejected(&mut t, &busy, |t| {
        t.create(JobKind::Load, O1, vec![], blocks(&[3]), 0)
    });
    done(t.complete(s2, 0, true).unwrap());
    let l = t
        .create(JobKind::Load, O1, vec![], blocks(&[3]), 0)
        .unwrap();
    let o = t.jobs().owner(O1).unwrap();
    assert_eq!((o.stores, o.loads, o.jobs.clone()), (0, 1, vec![l]));
    assert_rejected(&mut t, &busy, |t| {
        t.create(JobKind::Load, O1, vec![], blocks(&[4]), 0)
    });
    assert_rejected(&mut t, &busy, |t| {
        t.create(JobKind::Store, O1, blocks(&[4]), vec![], 0)
    });
    // Another request is not affected.
    store(&mut t, O2, &[4], &[]);
    done(t.complete(l, 0, true).unwrap());
    store(&mut t, O1, &[5], &[]);
    let m = t
        .create(JobKind::Load, O1, vec![], blocks(&[6]), 0)
        .unwrap_err()
        .to_string();
    assert!(m.contains("request 1"), "{m}");
}

#[test]
fn the_owner_map_empties_when_the_last_job_of_a_request_completes() {
    let mut t = tracker(2, 16);
    let a = store(&mut t, O1, &[1], &[]);
    let b = store(&mut t, O1, &[], &[2]);
    assert_eq!(t.jobs().owner(O1).unwrap().jobs, vec![a, b]);
    t.complete(b, 1, true).unwrap();
    assert_eq!(
        t.jobs().owner(O1).unwrap().jobs,
        vec![a, b],
        "b waits for rank 0"
    );
    done(t.complete(b, 0, true).unwrap());
    assert_eq!(t.jobs().owner(O1).unwrap().jobs, vec![a]);
    t.complete(a, 0, true).unwrap();
    assert_eq!(t.jobs().owners_len(), 1, "a still has one report to go");
    done(t.complete(a, 1, true).unwrap());
    assert!(t.jobs().owner(O1).is_none());
    assert_eq!(t.jobs().owners_len(), 0);
    assert!(t.jobs().is_empty());
    assert_eq!(t.fence().armed_pairs(), 0);
}

// ---------------------------------------------------------------------------------------------
// Reset and late reports
// ---------------------------------------------------------------------------------------------

#[test]
fn reset_returns_every_pending_job_and_empties_everything() {
    let mut t = tracker(2, 16);
    let a = store(&mut t, O1, &[1], &[2]);
    let b = store(&mut t, O2, &[], &[3]);
    let c = t
        .create(JobKind::Load, OwnerId(3), vec![], blocks(&[4]), 0)
        .unwrap();
    t.release(O2);
    t.release(OwnerId(5));
    t.complete(b, 0, true).unwrap();
    done(t.complete(b, 1, true).unwrap());
    t.complete(a, 1, true).unwrap();
    let pending: Vec<JobId> = t.reset().into_iter().map(|j| j.id).collect();
    assert_eq!(pending, vec![a, c], "pending jobs in creation order");
    assert!(t.jobs().is_empty());
    assert_eq!(t.jobs().pending_ids().count(), 0);
    assert_eq!(t.jobs().owners_len(), 0);
    assert_eq!(t.released_len(), 0);
    assert_eq!(t.fence().armed_pairs(), 0);
    assert!((0..16).all(|bl| t.fence().jobs_on(BlockId(bl)).is_empty()));
    assert_eq!(t.check(&blocks(&[1, 2, 3, 4])).unwrap(), vec![]);
    assert_eq!(
        (t.job_stats().resets, t.fence_stats().reset_flushed),
        (1, 2)
    );
    // A request blocked by a pre-reset load may create jobs again.
    t.create(JobKind::Store, OwnerId(3), blocks(&[4]), vec![], 0)
        .unwrap();
    assert!(t.reset().len() == 1 && t.reset().is_empty());
}

#[test]
fn job_ids_are_monotonic_across_completions_and_resets() {
    let mut t = tracker(1, 8);
    let mut last = None;
    for round in 0..4 {
        for _ in 0..3 {
            let id = store(&mut t, OwnerId(round), &[1], &[]);
            assert!(last.is_none_or(|l| id > l), "{id:?} after {last:?}");
            last = Some(id);
        }
        if round % 2 == 0 {
            t.reset();
        } else {
            let ids: Vec<JobId> = t.jobs().pending_ids().collect();
            for id in ids {
                done(t.complete(id, 0, true).unwrap());
            }
        }
    }
    assert_eq!(last, Some(JobId(11)));
    assert_eq!(t.jobs().next_id(), JobId(12));
}

#[test]
fn reports_for_jobs_created_before_a_reset_are_late() {
    let mut t = tracker(2, 8);
    let a = store(&mut t, O1, &[1], &[]);
    let b = store(&mut t, O2, &[2], &[]);
    t.complete(b, 0, true).unwrap();
    done(t.complete(b, 1, true).unwrap());
    t.complete(a, 0, true).unwrap();
    t.reset();
    let c = store(&mut t, O1, &[1], &[]);
    let before = snapshot(&t, 8);
    // Valid, duplicated, completed-job and out-of-range reports of old jobs are all just late,
    // and a late report never counts for a new job.
    let late = [(a, 1), (a, 1), (a, 0), (b, 0), (a, 2), (b, u32::MAX)];
    for (id, rank) in late {
        assert!(matches!(
            t.complete(id, rank, false).unwrap(),
            Completion::Late
        ));
    }
    let after = snapshot(&t, 8);
    assert_eq!(after.job_stats.late_reports, late.len() as u64);
    assert_eq!(
        Snapshot {
            job_stats: JobStats {
                late_reports: 0,
                ..after.job_stats
            },
            ..after
        },
        before,
        "late reports change nothing but their counter"
    );
    // The new job is unaffected: it still needs both of its own reports.
    assert!(matches!(
        t.complete(c, 1, true).unwrap(),
        Completion::Pending { remaining: 1 }
    ));
    assert!(!done(t.complete(c, 0, true).unwrap()).failed);
    assert_rejected(&mut t, &Error::UnknownJob(JobId(3)), |t| {
        t.complete(JobId(3), 0, true)
    });
}

// ---------------------------------------------------------------------------------------------
// JobTable and Fence directly
// ---------------------------------------------------------------------------------------------

#[test]
fn job_table_counts_and_validates_without_changing_state() {
    let mut jt: JobTable<&str> = JobTable::new(2).unwrap();
    let s = jt.insert(JobKind::Store, O1, blocks(&[1]), vec![], false, "s");
    let l = jt.insert(JobKind::Load, O2, vec![], blocks(&[2]), true, "l");
    assert_eq!((s, l), (JobId(0), JobId(1)));
    assert_eq!((jt.validate(s, 0), jt.validate(s, 1)), (Ok(true), Ok(true)));
    assert_eq!(
        jt.validate(s, 2),
        Err(Error::WorkerOutOfRange {
            job: s,
            worker: 2,
            num_workers: 2
        })
    );
    assert_eq!(jt.validate(JobId(2), 0), Err(Error::UnknownJob(JobId(2))));
    let j = jt.get(s).unwrap();
    assert_eq!(
        (j.remaining, j.reported),
        (2, 0),
        "validate changes nothing"
    );
    assert!(jt.check_owner(O1, JobKind::Store).is_ok());
    assert!(matches!(
        jt.check_owner(O1, JobKind::Load),
        Err(Error::OwnerBusy { owner: O1, .. })
    ));
    assert!(matches!(
        jt.check_owner(O2, JobKind::Store),
        Err(Error::OwnerBusy { owner: O2, .. })
    ));
    assert!(jt.check_owner(OwnerId(3), JobKind::Load).is_ok());
    assert!(matches!(
        jt.complete(l, 1, true).unwrap(),
        Completion::Pending { remaining: 1 }
    ));
    assert_eq!(
        jt.validate(l, 1),
        Err(Error::DuplicateReport { job: l, worker: 1 })
    );
    assert_eq!(
        jt.complete(l, 1, true).unwrap_err(),
        Error::DuplicateReport { job: l, worker: 1 }
    );
    assert_eq!(jt.get(l).unwrap().reported, mask(&[1]));
    let Completion::Done(job) = jt.complete(l, 0, true).unwrap() else {
        panic!("load done")
    };
    assert_eq!((job.payload, job.deferred_armed), ("l", true));
    assert_eq!(jt.validate(l, 0), Err(Error::JobAlreadyCompleted(l)));
    assert_eq!(jt.len(), 1);
    jt.reset();
    assert_eq!(jt.validate(s, 0), Ok(false), "pre-reset ids are late");
    assert_eq!(jt.validate(s, 9), Ok(false), "whatever the rank");
    let st = jt.stats();
    assert_eq!(
        (st.stores_created, st.loads_created, st.completed, st.resets),
        (1, 1, 1, 1)
    );
}

#[test]
fn fence_arms_disarms_and_clears_exact_pairs() {
    let mut f = Fence::new(8);
    f.arm(JobId(1), &blocks(&[0, 3]));
    f.arm(JobId(2), &blocks(&[3, 7]));
    assert_eq!(f.armed_pairs(), 4);
    f.disarm(JobId(1), &blocks(&[3]));
    assert_eq!(
        f.jobs_on(BlockId(3)),
        &[JobId(2)],
        "only job 1's pair left block 3"
    );
    assert_eq!(f.jobs_on(BlockId(0)), &[JobId(1)]);
    assert_eq!(f.armed_pairs(), 3);
    // Disarming a pair that is not armed is a no-op.
    f.disarm(JobId(9), &blocks(&[0, 3]));
    assert_eq!(f.armed_pairs(), 3);
    let mut out = Vec::new();
    f.check(&blocks(&[7, 100, 0, 3]), &mut out);
    assert_eq!(out, jobs(&[1, 2]), "out-of-range blocks hold nothing");
    assert!(f.jobs_on(BlockId(100)).is_empty());
    f.clear();
    assert_eq!(f.armed_pairs(), 0);
    out.clear();
    f.check(&blocks(&[0, 3, 7]), &mut out);
    assert!(out.is_empty());
}

// ---------------------------------------------------------------------------------------------
// Random schedules against a naive model
// ---------------------------------------------------------------------------------------------

const NUM_BLOCKS: u32 = 16;
const NUM_OWNERS: u64 = 6;

/// One pending job of the model.
#[derive(Debug, Clone)]
struct MJob {
    id: u64,
    kind: JobKind,
    owner: u64,
    eager: Vec<u32>,
    deferred: Vec<u32>,
    /// Deferred blocks are armed (the owner released since, or before, creation).
    armed: bool,
    /// The owner's holding period in which the job was created, if the owner held blocks.
    held_in: Option<u64>,
    /// Ranks that reported the job.
    reported: BTreeSet<u32>,
    failed: bool,
    payload: u64,
}

impl MJob {
    /// Reports still expected.
    fn remaining(&self, num_workers: u32) -> u32 {
        num_workers - self.reported.len() as u32
    }

    /// Ranks that have not reported the job yet, ascending.
    fn unreported(&self, num_workers: u32) -> Vec<u32> {
        (0..num_workers)
            .filter(|r| !self.reported.contains(r))
            .collect()
    }
}

/// What the engine knows of a request: whether it holds its blocks, and which holding period.
#[derive(Debug, Clone, Copy, Default)]
struct MOwner {
    released: bool,
    period: u64,
}

/// What the model expects of a valid report.
#[derive(Debug)]
enum MOutcome {
    Late,
    Pending(u32),
    Done(MJob),
}

/// The naive model: pending jobs in a `Vec`, a check that scans every one of them.
#[derive(Debug)]
struct Model {
    num_workers: u32,
    jobs: Vec<MJob>,
    owners: [MOwner; NUM_OWNERS as usize],
    next: u64,
    floor: u64,
    /// Ids completed since the last reset.
    completed: Vec<u64>,
    stats: JobStats,
    checks: u64,
    flushed: u64,
    reset_flushed: u64,
}

impl Model {
    fn new(num_workers: u32) -> Self {
        Self {
            num_workers,
            jobs: Vec::new(),
            owners: [MOwner::default(); NUM_OWNERS as usize],
            next: 0,
            floor: 0,
            completed: Vec::new(),
            stats: JobStats::default(),
            checks: 0,
            flushed: 0,
            reset_flushed: 0,
        }
    }

    fn create(
        &mut self,
        kind: JobKind,
        owner: u64,
        eager: &[u32],
        deferred: &[u32],
    ) -> Result<u64, Error> {
        if eager.is_empty() && deferred.is_empty() {
            return Err(Error::EmptyJob(OwnerId(owner)));
        }
        if let Some(&b) = eager.iter().chain(deferred).find(|&&b| b >= NUM_BLOCKS) {
            return Err(Error::BlockOutOfRange {
                block: BlockId(b),
                num_blocks: NUM_BLOCKS,
            });
        }
        let mine = self.jobs.iter().filter(|j| j.owner == owner);
        let (stores, loads) = mine.fold((0, 0), |(s, l), j| match j.kind {
            JobKind::Store => (s + 1, l),
            JobKind::Load => (s, l + 1),
        });
        if loads > 0 || (kind == JobKind::Load && stores > 0) {
            return Err(Error::OwnerBusy {
                owner: OwnerId(owner),
                reason: "",
            });
        }
        let id = self.next;
        self.next += 1;
        let o = self.owners[owner as usize];
        self.jobs.push(MJob {
            id,
            kind,
            owner,
            eager: eager.to_vec(),
            deferred: deferred.to_vec(),
            armed: o.released,
            held_in: (!o.released).then_some(o.period),
            reported: BTreeSet::new(),
            failed: false,
            payload: payload_of(id),
        });
        match kind {
            JobKind::Store => self.stats.stores_created += 1,
            JobKind::Load => self.stats.loads_created += 1,
        }
        Ok(id)
    }

    fn release(&mut self, owner: u64) {
        let o = &mut self.owners[owner as usize];
        if !o.released {
            o.released = true;
            o.period += 1;
        }
        for j in self.jobs.iter_mut().filter(|j| j.owner == owner) {
            j.armed = true;
        }
    }

    fn reacquire(&mut self, owner: u64) {
        let o = &mut self.owners[owner as usize];
        if o.released {
            o.released = false;
            o.period += 1;
        }
    }

    fn forget(&mut self, owner: u64) {
        self.owners[owner as usize].released = false;
    }

    /// Whether the engine cannot write `block`: a request that holds its blocks reads it.
    fn held(&self, block: u32) -> bool {
        self.jobs.iter().any(|j| {
            let o = self.owners[j.owner as usize];
            !o.released && j.held_in == Some(o.period) && j.deferred.contains(&block)
        })
    }

    /// Armed blocks of a job (with repetitions).
    fn armed_blocks(j: &MJob) -> impl Iterator<Item = u32> + '_ {
        let deferred: &[u32] = if j.armed { &j.deferred } else { &[] };
        j.eager.iter().chain(deferred).copied()
    }

    fn check(&mut self, written: &[u32]) -> Result<Vec<u64>, Error> {
        if let Some(&b) = written.iter().find(|&&b| b >= NUM_BLOCKS) {
            return Err(Error::BlockOutOfRange {
                block: BlockId(b),
                num_blocks: NUM_BLOCKS,
            });
        }
        let flush: Vec<u64> = self
            .jobs
            .iter()
            .filter(|j| Self::armed_blocks(j).any(|b| written.contains(&b)))
            .map(|j| j.id)
            .collect(); // creation order = id order
        self.checks += 1;
        self.flushed += flush.len() as u64;
        Ok(flush)
    }

    /// A report of rank `worker`, checked in the order of `JobTable::validate`: late, unknown
    /// id, rank out of range, completed job, duplicate rank.
    fn complete(&mut self, id: u64, worker: u32, ok: bool) -> Result<MOutcome, Error> {
        if id < self.floor {
            self.stats.late_reports += 1;
            return Ok(MOutcome::Late);
        }
        if id >= self.next {
            return Err(Error::UnknownJob(JobId(id)));
        }
        if worker >= self.num_workers {
            return Err(Error::WorkerOutOfRange {
                job: JobId(id),
                worker,
                num_workers: self.num_workers,
            });
        }
        let Some(i) = self.jobs.iter().position(|j| j.id == id) else {
            assert!(
                self.completed.contains(&id),
                "ids in floor..next are pending or completed"
            );
            return Err(Error::JobAlreadyCompleted(JobId(id)));
        };
        let j = &mut self.jobs[i];
        if !j.reported.insert(worker) {
            return Err(Error::DuplicateReport {
                job: JobId(id),
                worker,
            });
        }
        j.failed |= !ok;
        let remaining = j.remaining(self.num_workers);
        if remaining > 0 {
            return Ok(MOutcome::Pending(remaining));
        }
        let j = self.jobs.remove(i);
        self.completed.push(id);
        self.stats.completed += 1;
        self.stats.failed += u64::from(j.failed);
        Ok(MOutcome::Done(j))
    }

    fn reset(&mut self) -> Vec<u64> {
        let ids: Vec<u64> = self.jobs.drain(..).map(|j| j.id).collect();
        self.floor = self.next;
        self.completed.clear();
        for o in &mut self.owners {
            if o.released {
                o.released = false;
                o.period += 1;
            }
        }
        self.stats.resets += 1;
        self.reset_flushed += ids.len() as u64;
        ids
    }
}

fn payload_of(id: u64) -> u64 {
    id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xA5A5
}

/// One step of a random schedule. Selectors (`pick`, `sel`) are reduced modulo whatever they
/// choose from when the step runs, so every generated schedule is meaningful.
#[derive(Debug, Clone)]
enum Op {
    Create {
        kind: JobKind,
        owner: u64,
        eager: Vec<u32>,
        deferred: Vec<u32>,
    },
    Release(u64),
    Reacquire(u64),
    Forget(u64),
    /// The step's fence check; with `drain`, every flushed job is then completed by all
    /// workers (the engine waits for the flush set before the writes).
    Check {
        written: Vec<u32>,
        drain: bool,
    },
    /// A valid report: the `sel`-th (modulo) rank that has not reported a pending job yet,
    /// so ranks report in any order.
    Report {
        pick: usize,
        sel: u32,
        ok: bool,
    },
    /// Any report, valid or not: a job id of class `target` from a rank of class `rank`. The
    /// model says what must happen; an error must change nothing, a late report nothing but
    /// its counter.
    AnyReport {
        target: Target,
        rank: Rank,
        pick: usize,
        sel: u32,
        ok: bool,
    },
    Reset,
}

/// Which job id an [`Op::AnyReport`] names.
#[derive(Debug, Clone, Copy)]
enum Target {
    /// A pending job.
    Pending,
    /// A job completed since the last reset.
    Completed,
    /// An id never issued.
    Unknown,
    /// A job created before the last reset.
    Late,
}

/// Which rank an [`Op::AnyReport`] comes from.
#[derive(Debug, Clone, Copy)]
enum Rank {
    /// One that has not reported the job (for a pending job; any in-range rank otherwise).
    Fresh,
    /// One that already reported the job (for a pending job with reports; any in-range rank
    /// otherwise).
    Reported,
    /// One the engine does not have.
    OutOfRange,
}

fn block_strategy() -> impl Strategy<Value = u32> {
    prop_oneof![40 => 0..NUM_BLOCKS, 1 => NUM_BLOCKS..NUM_BLOCKS + 3, 1 => Just(u32::MAX)]
}

fn target_strategy() -> impl Strategy<Value = Target> {
    prop_oneof![
        3 => Just(Target::Pending),
        2 => Just(Target::Completed),
        1 => Just(Target::Unknown),
        2 => Just(Target::Late),
    ]
}

fn rank_strategy() -> impl Strategy<Value = Rank> {
    prop_oneof![
        1 => Just(Rank::Fresh),
        3 => Just(Rank::Reported),
        2 => Just(Rank::OutOfRange),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let owner = 0..NUM_OWNERS;
    let kind = prop_oneof![3 => Just(JobKind::Store), 1 => Just(JobKind::Load)];
    prop_oneof![
        10 => (kind, owner.clone(), prop::collection::vec(block_strategy(), 0..3),
               prop::collection::vec(block_strategy(), 0..5))
            .prop_map(|(kind, owner, eager, deferred)| Op::Create { kind, owner, eager, deferred }),
        3 => owner.clone().prop_map(Op::Release),
        2 => owner.clone().prop_map(Op::Reacquire),
        1 => owner.prop_map(Op::Forget),
        6 => (prop::collection::vec(prop_oneof![60 => 0..NUM_BLOCKS, 1 => Just(NUM_BLOCKS)], 0..7),
              any::<bool>())
            .prop_map(|(written, drain)| Op::Check { written, drain }),
        12 => (any::<usize>(), any::<u32>(), prop::bool::weighted(0.9))
            .prop_map(|(pick, sel, ok)| Op::Report { pick, sel, ok }),
        6 => (target_strategy(), rank_strategy(), any::<usize>(), any::<u32>(), any::<bool>())
            .prop_map(|(target, rank, pick, sel, ok)| Op::AnyReport { target, rank, pick, sel, ok }),
        1 => Just(Op::Reset),
    ]
}

/// Compares everything observable of `t` with the model and checks the invariants of §4.
fn check_invariants(t: &Tracker<u64>, m: &Model) {
    let s = snapshot(t, NUM_OWNERS);
    // The job table is the model's list of pending jobs.
    let expected: Vec<PendingView> = m
        .jobs
        .iter()
        .map(|j| PendingView {
            id: JobId(j.id),
            kind: j.kind,
            owner: OwnerId(j.owner),
            eager: blocks(&j.eager),
            deferred: blocks(&j.deferred),
            deferred_armed: j.armed,
            failed: j.failed,
            remaining: j.remaining(m.num_workers),
            reported: mask(&j.reported.iter().copied().collect::<Vec<_>>()),
            payload: j.payload,
        })
        .collect();
    assert_eq!(s.pending, expected);
    // Invariant 5: a pending job waits for exactly the ranks that have not reported it.
    for p in &s.pending {
        assert_eq!(
            p.reported.checked_shr(m.num_workers).unwrap_or(0),
            0,
            "job {}: rank out of range recorded",
            p.id
        );
        assert_eq!(p.remaining + p.reported.count_ones(), m.num_workers);
        assert!(p.remaining > 0, "job {} is done but still pending", p.id);
    }
    assert_eq!(t.jobs().len(), m.jobs.len());
    assert_eq!(s.next, JobId(m.next), "ids are monotonic");

    // The fence index holds exactly the armed pairs: eager pairs and released owners' pairs.
    let mut index = vec![Vec::new(); NUM_BLOCKS as usize];
    for j in &m.jobs {
        for b in Model::armed_blocks(j) {
            index[b as usize].push(JobId(j.id));
        }
    }
    for on in &mut index {
        on.sort_unstable();
    }
    assert_eq!(s.index, index);
    assert_eq!(s.armed_pairs, index.iter().map(Vec::len).sum::<usize>());
    // Deferred pairs of a request that still holds its blocks are never in the index.
    for j in m.jobs.iter().filter(|j| !j.armed) {
        for b in &j.deferred {
            let on = t
                .fence()
                .jobs_on(BlockId(*b))
                .iter()
                .filter(|x| x.0 == j.id)
                .count();
            let eager = j.eager.iter().filter(|e| *e == b).count();
            assert_eq!(
                on, eager,
                "deferred pair ({b}, {}) of a running owner is armed",
                j.id
            );
        }
    }

    // Owner map, released owners and invariant 7.
    for o in 0..NUM_OWNERS {
        let mine: Vec<&MJob> = m.jobs.iter().filter(|j| j.owner == o).collect();
        let stores = mine.iter().filter(|j| j.kind == JobKind::Store).count() as u32;
        let loads = mine.len() as u32 - stores;
        assert!(
            loads == 0 || (loads == 1 && stores == 0),
            "invariant 7 broken for request {o}"
        );
        let want =
            (!mine.is_empty()).then(|| (stores, loads, mine.iter().map(|j| JobId(j.id)).collect()));
        assert_eq!(s.owners[o as usize], want, "owner map of request {o}");
        assert_eq!(s.released[o as usize], m.owners[o as usize].released);
    }
    let with_jobs = (0..NUM_OWNERS)
        .filter(|o| m.jobs.iter().any(|j| j.owner == *o))
        .count();
    assert_eq!(s.owners_len, with_jobs);
    assert_eq!(
        s.released_len,
        m.owners.iter().filter(|o| o.released).count()
    );

    // Counters.
    assert_eq!(s.job_stats, m.stats);
    assert_eq!(
        s.fence_stats,
        FenceStats {
            checks: m.checks,
            flushed: m.flushed,
            reset_flushed: m.reset_flushed,
        }
    );

    // Invariant 6: nothing pending, nothing left anywhere.
    if m.jobs.is_empty() {
        assert!(t.jobs().is_empty());
        assert_eq!(t.jobs().pending_ids().count(), 0);
        assert_eq!(t.jobs().owners_len(), 0);
        assert_eq!(t.fence().armed_pairs(), 0);
        assert!(s.index.iter().all(Vec::is_empty));
    }
}

/// Applies a valid report to both and compares the outcomes (invariant 5).
fn report(t: &mut Tracker<u64>, m: &mut Model, id: u64, worker: u32, ok: bool) {
    let want = m
        .complete(id, worker, ok)
        .expect("the schedule only sends valid reports here");
    let got = t
        .complete(JobId(id), worker, ok)
        .expect("valid report accepted");
    compare_outcome(id, worker, want, got);
}

/// Compares the outcome of an accepted report: a job is done exactly when its last rank
/// reported, and leaves the table with every rank's bit set.
fn compare_outcome(id: u64, worker: u32, want: MOutcome, got: Completion<u64>) {
    match (want, got) {
        (MOutcome::Late, Completion::Late) => {}
        (MOutcome::Pending(r), Completion::Pending { remaining }) => assert_eq!(remaining, r),
        (MOutcome::Done(mj), Completion::Done(j)) => {
            let ranks: Vec<u32> = mj.reported.iter().copied().collect();
            assert_eq!(
                (
                    j.id,
                    j.kind,
                    j.owner,
                    j.failed,
                    j.payload,
                    j.remaining,
                    j.reported
                ),
                (
                    JobId(mj.id),
                    mj.kind,
                    OwnerId(mj.owner),
                    mj.failed,
                    mj.payload,
                    0,
                    mask(&ranks)
                )
            );
            assert_eq!(
                (j.eager, j.deferred),
                (blocks(&mj.eager), blocks(&mj.deferred))
            );
        }
        (w, g) => panic!("report ({id}, rank {worker}): model {w:?}, tracker {g:?}"),
    }
}

fn apply_create(t: &mut Tracker<u64>, m: &mut Model, op: (JobKind, u64, &[u32], &[u32])) {
    let (kind, owner, eager, deferred) = op;
    let before = snapshot(t, NUM_OWNERS);
    let payload = payload_of(m.next);
    let want = m.create(kind, owner, eager, deferred);
    let got = t.create(
        kind,
        OwnerId(owner),
        blocks(eager),
        blocks(deferred),
        payload,
    );
    match (&want, &got) {
        (Ok(w), Ok(g)) => assert_eq!(*g, JobId(*w), "ids are issued in order"),
        (Err(w), Err(g)) => {
            assert!(same_error(g, w), "model {w:?}, tracker {g:?}");
            let after = snapshot(t, NUM_OWNERS);
            assert_eq!(after, before, "rejected create changed state");
        }
        _ => panic!("create: model {want:?}, tracker {got:?}"),
    }
}

fn apply_check(t: &mut Tracker<u64>, m: &mut Model, written: &[u32], drain: bool) {
    let before = snapshot(t, NUM_OWNERS);
    let want = m.check(written);
    let got = t.check(&blocks(written));
    let flush = match (want, got) {
        (Ok(w), Ok(g)) => {
            // Invariant 2 (minimal flush) and completeness: exactly the model's set.
            assert_eq!(g, jobs(&w), "flush set for written {written:?}");
            w
        }
        (Err(w), Err(g)) => {
            assert_eq!(g, w);
            let after = snapshot(t, NUM_OWNERS);
            assert_eq!(after, before, "rejected check changed state");
            return;
        }
        (w, g) => panic!("check: model {w:?}, tracker {g:?}"),
    };
    // Invariant 1 (no torn store), stated over what the engine may write: every block not
    // held by a running request. Any pending job that reads or writes such a block must be
    // in the flush set.
    for &b in written.iter().filter(|&&b| !m.held(b)) {
        for j in &m.jobs {
            if j.eager.contains(&b) || j.deferred.contains(&b) {
                assert!(
                    flush.contains(&j.id),
                    "block {b} written while job {} touches it, unflushed",
                    j.id
                );
            }
        }
    }
    if drain {
        // The engine waits for the flush set: every rank that has not reported yet does,
        // highest first.
        for id in flush {
            let Some(j) = m.jobs.iter().find(|j| j.id == id) else {
                continue;
            };
            for rank in j.unreported(m.num_workers).into_iter().rev() {
                report(t, m, id, rank, true);
            }
            assert!(
                m.jobs.iter().all(|j| j.id != id),
                "flushed job {id} drained"
            );
        }
    }
}

/// The `(job, rank)` of an [`Op::AnyReport`], if the model has a job of class `target`.
fn pick_report(m: &Model, target: Target, rank: Rank, pick: usize, sel: u32) -> Option<(u64, u32)> {
    let n = m.num_workers;
    let (id, job) = match target {
        Target::Pending if !m.jobs.is_empty() => {
            let j = &m.jobs[pick % m.jobs.len()];
            (j.id, Some(j))
        }
        Target::Completed if !m.completed.is_empty() => {
            (m.completed[pick % m.completed.len()], None)
        }
        Target::Unknown if sel % 8 == 7 => (u64::MAX, None),
        Target::Unknown => (m.next + u64::from(sel % 4), None),
        Target::Late if m.floor > 0 => (pick as u64 % m.floor, None),
        _ => return None,
    };
    let worker = match (rank, job) {
        (Rank::Fresh, Some(j)) => {
            let fresh = j.unreported(n);
            fresh[sel as usize % fresh.len()]
        }
        (Rank::Reported, Some(j)) if !j.reported.is_empty() => {
            let done: Vec<u32> = j.reported.iter().copied().collect();
            done[sel as usize % done.len()]
        }
        (Rank::Fresh | Rank::Reported, _) => sel % n,
        (Rank::OutOfRange, _) => {
            let bad: Vec<u32> = [n, n + 1, 127, 128, u32::MAX]
                .into_iter()
                .filter(|r| *r >= n)
                .collect();
            bad[sel as usize % bad.len()]
        }
    };
    Some((id, worker))
}

fn apply_any_report(t: &mut Tracker<u64>, m: &mut Model, op: (Target, Rank, usize, u32, bool)) {
    let (target, rank, pick, sel, ok) = op;
    let Some((id, worker)) = pick_report(m, target, rank, pick, sel) else {
        return;
    };
    let before = snapshot(t, NUM_OWNERS);
    let want = m.complete(id, worker, ok);
    let got = t.complete(JobId(id), worker, ok);
    match (want, got) {
        (Err(w), Err(g)) => {
            assert_eq!(g, w, "report ({id}, rank {worker})");
            let after = snapshot(t, NUM_OWNERS);
            assert_eq!(after, before, "a rejected report changed state");
        }
        (Ok(MOutcome::Late), Ok(Completion::Late)) => {
            let after = snapshot(t, NUM_OWNERS);
            let late = before.job_stats.late_reports + 1;
            assert_eq!(after.job_stats.late_reports, late);
            let rest = Snapshot {
                job_stats: before.job_stats,
                ..after
            };
            assert_eq!(rest, before, "a late report changed more than its counter");
        }
        (Ok(w), Ok(g)) => compare_outcome(id, worker, w, g),
        (w, g) => panic!("report ({id}, rank {worker}): model {w:?}, tracker {g:?}"),
    }
}

/// Runs one op on both and checks what it returned.
fn apply(t: &mut Tracker<u64>, m: &mut Model, op: &Op) {
    match op {
        Op::Create {
            kind,
            owner,
            eager,
            deferred,
        } => apply_create(t, m, (*kind, *owner, eager, deferred)),
        Op::Release(o) => {
            m.release(*o);
            t.release(OwnerId(*o));
        }
        Op::Reacquire(o) => {
            m.reacquire(*o);
            t.reacquire(OwnerId(*o));
        }
        Op::Forget(o) => {
            m.forget(*o);
            t.forget(OwnerId(*o));
        }
        Op::Check { written, drain } => apply_check(t, m, written, *drain),
        Op::Report { pick, sel, ok } => {
            if !m.jobs.is_empty() {
                let j = &m.jobs[pick % m.jobs.len()];
                let fresh = j.unreported(m.num_workers);
                let (id, rank) = (j.id, fresh[*sel as usize % fresh.len()]);
                report(t, m, id, rank, *ok);
            }
        }
        Op::AnyReport {
            target,
            rank,
            pick,
            sel,
            ok,
        } => apply_any_report(t, m, (*target, *rank, *pick, *sel, *ok)),
        Op::Reset => {
            let want = m.reset();
            let got: Vec<JobId> = t.reset().into_iter().map(|j| j.id).collect();
            assert_eq!(
                got,
                jobs(&want),
                "reset returns every pending job in creation order"
            );
        }
    }
}

fn run_schedule(num_workers: u32, ops: &[Op]) {
    let mut t: Tracker<u64> = Tracker::new(num_workers, NUM_BLOCKS).unwrap();
    let mut m = Model::new(num_workers);
    for op in ops {
        apply(&mut t, &mut m, op);
        check_invariants(&t, &m);
    }
    // Drain: complete every pending job, newest first, one rank at a time, lowest first.
    while let Some(j) = m.jobs.last() {
        let (id, rank) = (j.id, j.unreported(num_workers)[0]);
        report(&mut t, &mut m, id, rank, true);
        check_invariants(&t, &m);
    }
    // Invariant 6 at the end of every schedule.
    assert!(t.jobs().is_empty());
    assert_eq!(t.jobs().owners_len(), 0);
    assert_eq!(t.fence().armed_pairs(), 0);
}

proptest! {
    // 256 schedules of up to 300 operations; failing seeds are kept next to this file.
    #![proptest_config(ProptestConfig {
        cases: 256,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "tests/tracker.proptest-regressions",
        ))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_schedules_keep_the_fence_invariants(
        num_workers in 1u32..4,
        ops in prop::collection::vec(op_strategy(), 1..300),
    ) {
        run_schedule(num_workers, &ops);
    }
}
