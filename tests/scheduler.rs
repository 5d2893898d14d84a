//! Integration tests of the scheduler core's Rust API (debug build: internal consistency
//! assertions are on). The full behaviour is covered from Python (scenario tests and the
//! differential test against the model); these check the same paths compile and hold in Rust.

mod support;
use support::step::{bl, step};

use kvoffload::config::{GroupConfig, SchedulerConfig};
use kvoffload::jobs::JobKind;
use kvoffload::jobs::JobStats;
use kvoffload::policy::PolicyKind;
use kvoffload::pool::KeyState;
use kvoffload::scheduler::{
    CompletedJob, PlanForm, Scheduler, SchedulerStats, Status, StepInput, StepPlan,
};
use kvoffload::tracker::FenceStats;
use kvoffload::{Error, JobId, Key};

fn config(window: Option<u32>) -> SchedulerConfig {
    let mut groups = vec![GroupConfig {
        block_size: 4,
        sliding_window: None,
        bytes_per_chunk: 64,
    }];
    if let Some(w) = window {
        groups.push(GroupConfig {
            block_size: 4,
            sliding_window: Some(w),
            bytes_per_chunk: 64,
        });
    }
    SchedulerConfig::new(groups, 64, 16)
}

fn keys(n: u128) -> Vec<Key> {
    keys_from(1000, n)
}

fn keys_from(first: u128, n: u128) -> Vec<Key> {
    (first..first + n).map(Key).collect()
}

fn workers(n: u32) -> SchedulerConfig {
    SchedulerConfig {
        num_workers: n,
        ..config(None)
    }
}

/// Adds request `id` (9 tokens, `hashes`), gives it `blocks` and computes 8 tokens: returns
/// its store job of 2 chunks.
fn stored(s: &mut Scheduler, id: &str, hashes: Vec<Key>, blocks: &[u32]) -> JobId {
    let blocks = bl(blocks);
    s.add_request(id, 9, hashes).unwrap();
    assert_eq!(s.lookup(id, 0).unwrap(), Some(0));
    assert_eq!(
        s.allocate(id, std::slice::from_ref(&blocks), 0, 0).unwrap(),
        None
    );
    let plan = s
        .schedule(&StepInput {
            written: Some(blocks),
            ..step(&[(id, 8)], &[], &[])
        })
        .unwrap();
    assert_eq!(plan.stores.len(), 1);
    assert!(plan.flush.is_empty());
    plan.stores[0].id
}

/// The pool's state of each key (group 0).
fn states(s: &Scheduler, keys: &[Key]) -> Vec<KeyState> {
    let pool = s.pool(0).unwrap();
    keys.iter().map(|k| pool.state(*k)).collect()
}

/// What a rejected call must leave unchanged.
type View = (
    SchedulerStats,
    (JobStats, FenceStats),
    Vec<JobId>,
    usize,
    Vec<KeyState>,
);

fn view(s: &Scheduler, keys: &[Key]) -> View {
    (
        s.stats(),
        s.tracker_stats(),
        s.pending_jobs(),
        s.armed_pairs(),
        states(s, keys),
    )
}

/// Worker reports `(job, rank, ok)`.
type Batch = Vec<(JobId, u32, bool)>;

fn ids(done: &[CompletedJob]) -> Vec<JobId> {
    done.iter().map(|d| d.id).collect()
}

#[test]
fn store_finish_flush_load_and_drain() {
    let mut s = Scheduler::new(config(None)).unwrap();
    s.add_request("a", 9, keys(2)).unwrap();
    assert_eq!(s.lookup("a", 0).unwrap(), Some(0));
    assert_eq!(s.allocate("a", &[bl(&[1, 2, 3])], 0, 0).unwrap(), None);
    let plan = s.schedule(&step(&[("a", 8)], &[], &[1, 2, 3])).unwrap();
    assert_eq!(plan.stores.len(), 1);
    assert_eq!(plan.stores[0].transfers[0].gpu_blocks, bl(&[1, 2]));
    assert!(plan.flush.is_empty());
    let store = plan.stores[0].id;

    // a finishes; block 2 is re-allocated and written: its pending store must flush.
    assert!(s
        .schedule(&step(&[], &["a"], &[]))
        .unwrap()
        .flush
        .is_empty());
    assert_eq!(
        s.schedule(&step(&[], &[], &[2])).unwrap().flush,
        vec![store]
    );
    let done = s.complete(store, 0, true).unwrap().unwrap();
    assert_eq!((done.kind, done.ok), (JobKind::Store, true));
    assert_eq!(s.status("a"), Err(Error::UnknownRequest("a".into())));

    // b shares the prefix: both chunks come back from the CPU tier.
    s.add_request("b", 9, keys(2)).unwrap();
    assert_eq!(s.lookup("b", 0).unwrap(), Some(8));
    let load = s.allocate("b", &[bl(&[5, 6, 7])], 0, 8).unwrap().unwrap();
    let plan = s.schedule(&step(&[("b", 9)], &[], &[5, 6, 7])).unwrap();
    assert_eq!(plan.loads[0].id, load);
    assert_eq!(plan.loads[0].transfers[0].gpu_blocks, bl(&[5, 6]));
    assert_eq!(s.status("b").unwrap(), Status::Running);
    assert!(s.complete(load, 0, true).unwrap().unwrap().ok);

    // Drain: no leaks.
    s.schedule(&step(&[], &["b"], &[])).unwrap();
    assert!(s.pending_jobs().is_empty());
    assert_eq!(s.num_requests(), 0);
    assert_eq!(s.armed_pairs(), 0);
}

/// Two schedulers take the same calls, one planning with `schedule` and one in
/// `PlanForm::Runs`: a prefill's stores in two groups, then a step with a load, a store and a
/// finish, then a decode store. The same jobs and flush sets each step, the runs
/// those of the transfers (the loads' first), no job carrying a list nor a store job a name,
/// and the same state after (the jobs complete alike).
#[test]
fn a_plan_in_runs_form_packs_the_copies_the_transfers_form_lists() {
    let mut a = Scheduler::new(config(Some(8))).unwrap();
    let mut b = Scheduler::new(config(Some(8))).unwrap();
    let both = |a: &mut Scheduler, b: &mut Scheduler, input: &StepInput| -> StepPlan {
        let want = a.schedule(input).unwrap();
        let got = b.schedule_with(input, PlanForm::Runs).unwrap();
        assert!(want.runs.is_empty());
        let ids = |p: &StepPlan| {
            let jobs = p.loads.iter().chain(&p.stores);
            (
                jobs.map(|j| (j.id, j.kind)).collect::<Vec<_>>(),
                p.flush.clone(),
            )
        };
        assert_eq!(ids(&got), ids(&want));
        assert_eq!(
            got.runs,
            kvoffload::runs::encode(want.loads.iter().chain(&want.stores))
        );
        let names = |p: &StepPlan| {
            p.loads
                .iter()
                .map(|j| j.request.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&got), names(&want));
        for job in got.loads.iter().chain(&got.stores) {
            assert!(job.transfers.is_empty(), "{job:?}");
        }
        for job in &got.stores {
            assert!(job.request.is_empty(), "{job:?}");
        }
        for job in got.loads.iter().chain(&got.stores) {
            assert_eq!(
                a.complete(job.id, 0, true).unwrap().map(|d| (d.kind, d.ok)),
                b.complete(job.id, 0, true).unwrap().map(|d| (d.kind, d.ok))
            );
        }
        want
    };
    for s in [&mut a, &mut b] {
        s.add_request("x", 13, keys(3)).unwrap();
        assert_eq!(s.lookup("x", 0).unwrap(), Some(0));
        s.allocate("x", &[bl(&[1, 2, 3, 4]), bl(&[11, 12, 13, 14])], 0, 0)
            .unwrap();
    }
    let plan = both(&mut a, &mut b, &step(&[("x", 12)], &[], &[1, 2, 3]));
    assert_eq!(plan.stores.len(), 1);
    // y shares x's first two chunks (loaded, both groups: its store waits for the load), z
    // stores its first two; x finishes.
    for s in [&mut a, &mut b] {
        let y = keys_from(1000, 2)
            .into_iter()
            .chain(keys_from(7, 1))
            .collect();
        s.add_request("y", 13, y).unwrap();
        assert_eq!(s.lookup("y", 0).unwrap(), Some(8));
        s.allocate("y", &[bl(&[5, 6, 7, 8]), bl(&[15, 16, 17, 18])], 0, 8)
            .unwrap()
            .expect("a load");
        s.add_request("z", 9, keys_from(50, 2)).unwrap();
        assert_eq!(s.lookup("z", 0).unwrap(), Some(0));
        s.allocate("z", &[bl(&[21, 22, 23]), bl(&[31, 32, 33])], 0, 0)
            .unwrap();
    }
    let input = step(&[("y", 12), ("z", 8)], &["x"], &[5, 6, 7, 21, 22]);
    let plan = both(&mut a, &mut b, &input);
    assert_eq!((plan.loads.len(), plan.stores.len()), (1, 1));
    // y stores its third chunk and, past its fourth, that one too.
    for s in [&mut a, &mut b] {
        s.extend_hashes("y", &keys_from(8, 1)).unwrap();
    }
    let plan = both(&mut a, &mut b, &step(&[("y", 16), ("z", 9)], &[], &[8, 23]));
    assert_eq!(plan.stores.len(), 1);
    both(&mut a, &mut b, &step(&[], &["y", "z"], &[]));
    assert_eq!(a.stats(), b.stats());
    assert_eq!(a.num_requests() + b.num_requests(), 0);
    assert_eq!(a.armed_pairs() + b.armed_pairs(), 0);
}

#[test]
fn failed_load_reports_blocks_drops_chunks_and_preempt_makes_it_lookable() {
    let mut s = Scheduler::new(config(Some(8))).unwrap();
    s.add_request("a", 9, keys(2)).unwrap();
    s.allocate("a", &[bl(&[1, 2, 3]), bl(&[11, 12, 13])], 0, 0)
        .unwrap();
    let plan = s.schedule(&step(&[("a", 8)], &[], &[])).unwrap();
    // Window blocks are armed at creation, full-attention blocks are not.
    assert_eq!(s.armed_pairs(), 2);
    for j in &plan.stores {
        s.complete(j.id, 0, true).unwrap();
    }
    s.schedule(&step(&[], &["a"], &[])).unwrap();
    s.add_request("b", 9, keys(2)).unwrap();
    let n = s.lookup("b", 0).unwrap().unwrap();
    assert_eq!(n, 8);
    let load = s
        .allocate("b", &[bl(&[5, 6, 7]), bl(&[15, 16, 17])], 0, n)
        .unwrap()
        .unwrap();
    // Reported once a plan handed it out.
    assert_eq!(s.complete(load, 0, false), Err(Error::JobNotPlanned(load)));
    s.schedule(&step(&[], &[], &[])).unwrap();
    let done = s.complete(load, 0, false).unwrap().unwrap();
    assert!(!done.ok);
    assert_eq!(done.invalid_blocks, bl(&[5, 6, 15, 16]));
    assert!(matches!(s.lookup("b", 0), Err(Error::RequestState { .. })));
    s.preempt("b").unwrap();
    assert_eq!(s.lookup("b", 0).unwrap(), Some(0)); // the failed chunks were dropped
    assert_eq!(s.stats().failed_loads, 1);
}

#[test]
fn bad_input_changes_nothing() {
    let mut s = Scheduler::new(config(None)).unwrap();
    s.add_request("a", 8, keys(2)).unwrap();
    s.allocate("a", &[bl(&[1, 2])], 0, 0).unwrap();
    let before = s.stats();
    assert!(matches!(
        s.schedule(&step(&[("a", 8), ("zz", 1)], &[], &[])),
        Err(Error::UnknownRequest(_))
    ));
    assert!(matches!(
        s.schedule(&step(&[("a", 8)], &[], &[64])),
        Err(Error::BlockOutOfRange { .. })
    ));
    let mut uneven = step(&[("a", 8)], &[], &[]);
    uneven.computed.push(4);
    let err = s.schedule(&uneven).unwrap_err();
    assert_eq!(
        err,
        Error::StepInputLength {
            scheduled: 1,
            computed: 2
        }
    );
    assert_eq!(
        err.to_string(),
        "step input: 1 scheduled request ids but 2 computed-token counts"
    );
    assert_eq!(
        s.complete(JobId(9), 0, true),
        Err(Error::UnknownJob(JobId(9)))
    );
    assert_eq!(s.stats(), before);
    assert_eq!(s.step(), 0, "no rejected step was applied");
    let mut bad = config(None);
    bad.blocks_per_chunk = 3;
    bad.hash_block_size = 8;
    assert!(matches!(Scheduler::new(bad), Err(Error::Config(_))));
}

#[test]
fn a_duplicated_report_does_not_publish_a_torn_store() {
    // With two workers, worker 0's duplicated report must not stand in for
    // worker 1's, whose copy may still be running.
    let mut s = Scheduler::new(workers(2)).unwrap();
    let ks = keys(2);
    let store = stored(&mut s, "a", ks.clone(), &[1, 2, 3]);
    assert_eq!(states(&s, &ks), vec![KeyState::Storing; 2]);
    assert_eq!(s.complete(store, 0, true), Ok(None));
    let before = view(&s, &ks);
    for ok in [true, false] {
        assert_eq!(
            s.complete(store, 0, ok),
            Err(Error::DuplicateReport {
                job: store,
                worker: 0
            })
        );
        assert_eq!(
            s.complete(store, 2, ok),
            Err(Error::WorkerOutOfRange {
                job: store,
                worker: 2,
                num_workers: 2
            })
        );
        assert_eq!(
            s.complete_many(&[(store, 0, ok)]),
            Err(Error::DuplicateReport {
                job: store,
                worker: 0
            })
        );
    }
    assert_eq!(view(&s, &ks), before, "rejected reports changed state");
    assert_eq!(s.pending_jobs(), vec![store], "the store is still pending");
    assert_eq!(
        states(&s, &ks),
        vec![KeyState::Storing; 2],
        "not readable before worker 1's copy completed"
    );
    // A request with the same prefix is told to ask again later, not given a torn chunk.
    s.add_request("b", 9, ks.clone()).unwrap();
    assert_eq!(s.lookup("b", 0).unwrap(), None);

    let done = s.complete(store, 1, true).unwrap().unwrap();
    assert_eq!((done.id, done.kind, done.ok), (store, JobKind::Store, true));
    assert_eq!(states(&s, &ks), vec![KeyState::Ready { pins: 0 }; 2]);
    assert_eq!(
        s.complete(store, 0, true),
        Err(Error::JobAlreadyCompleted(store))
    );

    // The same rule for a load: a duplicated report does not unpin its slots.
    assert_eq!(s.lookup("b", 0).unwrap(), Some(8));
    let load = s.allocate("b", &[bl(&[5, 6, 7])], 0, 8).unwrap().unwrap();
    s.schedule(&step(&[], &[], &[])).unwrap();
    assert_eq!(states(&s, &ks), vec![KeyState::Ready { pins: 1 }; 2]);
    assert_eq!(s.complete(load, 1, true), Ok(None));
    let before = view(&s, &ks);
    assert_eq!(
        s.complete(load, 1, true),
        Err(Error::DuplicateReport {
            job: load,
            worker: 1
        })
    );
    assert_eq!(view(&s, &ks), before);
    assert_eq!(states(&s, &ks), vec![KeyState::Ready { pins: 1 }; 2]);
    assert_eq!(s.loading_requests(), 1, "b is still loading");
    let done = s.complete(load, 0, true).unwrap().unwrap();
    assert_eq!((done.kind, done.ok), (JobKind::Load, true));
    assert_eq!(s.loading_requests(), 0);
    assert_eq!(states(&s, &ks), vec![KeyState::Ready { pins: 0 }; 2]);
}

#[test]
fn a_failed_report_from_either_worker_keeps_the_store_unreadable() {
    let mut s = Scheduler::new(workers(2)).unwrap();
    let ks = keys(2);
    let store = stored(&mut s, "a", ks.clone(), &[1, 2, 3]);
    assert_eq!(s.complete(store, 1, false), Ok(None));
    assert_eq!(states(&s, &ks), vec![KeyState::Storing; 2]);
    let done = s.complete(store, 0, true).unwrap().unwrap();
    assert!(!done.ok);
    assert_eq!(states(&s, &ks), vec![KeyState::Absent; 2]);
    assert_eq!(s.stats().failed_stores, 1);
}

#[test]
fn complete_many_is_all_or_nothing() {
    let mut s = Scheduler::new(workers(2)).unwrap();
    let ka = keys_from(1000, 2);
    let kb = keys_from(2000, 2);
    let kc = keys_from(3000, 2);
    let a = stored(&mut s, "a", ka.clone(), &[1, 2, 3]);
    let b = stored(&mut s, "b", kb.clone(), &[4, 5, 6]);
    let c = stored(&mut s, "c", kc.clone(), &[7, 8, 9]);
    assert_eq!(s.complete(c, 0, true), Ok(None));
    let all: Vec<Key> = [&ka[..], &kb, &kc].concat();
    let before = view(&s, &all);
    let oob = |job| Error::WorkerOutOfRange {
        job,
        worker: 2,
        num_workers: 2,
    };
    let dup = |job, worker| Error::DuplicateReport { job, worker };
    let bad: Vec<(Batch, Error)> = vec![
        // One unknown id in the middle: the good reports around it are not applied.
        (
            vec![(a, 0, true), (JobId(99), 0, true), (b, 0, true)],
            Error::UnknownJob(JobId(99)),
        ),
        // One rank out of range in the middle.
        (vec![(a, 0, true), (b, 2, true), (b, 0, true)], oob(b)),
        // A duplicate pair inside the batch.
        (vec![(a, 0, true), (b, 0, true), (a, 0, false)], dup(a, 0)),
        // ... and one right after its twin, in an otherwise increasing batch.
        (vec![(a, 0, true), (b, 0, true), (b, 0, false)], dup(b, 0)),
        // A rank that reported before the batch.
        (vec![(a, 0, true), (a, 1, true), (c, 0, true)], dup(c, 0)),
        // Earlier reports would complete c and a; the last one duplicates a's rank 1.
        (
            vec![(c, 1, true), (a, 0, true), (a, 1, true), (a, 1, true)],
            dup(a, 1),
        ),
    ];
    for (batch, err) in bad {
        assert_eq!(s.complete_many(&batch), Err(err), "batch {batch:?}");
        assert_eq!(view(&s, &all), before, "batch {batch:?} changed state");
    }
    assert_eq!(s.complete_many(&[]), Ok(vec![]));
    // Nothing was applied: the same reports are accepted now, in batch order.
    let done = s
        .complete_many(&[(a, 1, true), (c, 1, true), (a, 0, true), (b, 0, true)])
        .unwrap();
    assert_eq!(ids(&done), vec![c, a]);
    assert!(done.iter().all(|d| d.ok && d.kind == JobKind::Store));
    assert_eq!(s.pending_jobs(), vec![b]);
    assert_eq!(states(&s, &ka), vec![KeyState::Ready { pins: 0 }; 2]);
    assert_eq!(states(&s, &kc), vec![KeyState::Ready { pins: 0 }; 2]);
    assert_eq!(states(&s, &kb), vec![KeyState::Storing; 2]);

    // Reports of jobs from before a reset are late: ignored, even twice, but a bad report in
    // the same batch still rejects the whole batch.
    let (flushed, cancelled) = s.reset();
    assert_eq!((flushed, cancelled), (vec![b], vec![]));
    let before = view(&s, &[]);
    assert_eq!(
        s.complete_many(&[(b, 1, true), (JobId(99), 0, true)]),
        Err(Error::UnknownJob(JobId(99)))
    );
    assert_eq!(
        view(&s, &[]),
        before,
        "a late report of a rejected batch counted"
    );
    assert_eq!(
        s.complete_many(&[(b, 1, true), (b, 1, true), (a, 0, true)]),
        Ok(vec![])
    );
    assert_eq!(
        s.tracker_stats().0.late_reports,
        before.1 .0.late_reports + 3
    );
}

/// Runs request `id` (prompt of `n` chunks with `hashes`, blocks `first..`) until its chunks
/// are stored and readable; it keeps running.
fn run_stored(s: &mut Scheduler, id: &str, hashes: Vec<Key>, first: u32) {
    let n = hashes.len() as u32;
    let blocks: Vec<u32> = (first..=first + n).collect();
    s.add_request(id, 4 * n + 1, hashes).unwrap();
    assert_eq!(s.lookup(id, 0).unwrap(), Some(0));
    s.allocate(id, &[bl(&blocks)], 0, 0).unwrap();
    let plan = s.schedule(&step(&[(id, 4 * n)], &[], &blocks)).unwrap();
    assert!(s.complete(plan.stores[0].id, 0, true).unwrap().is_some());
}

/// Pressure keeps prefixes: chunks are stored in order, so a long conversation's first chunks
/// are the pool's oldest. When a request is done its chunks are refreshed, the earliest most
/// recent, so pressure evicts a request that finished earlier, then suffixes, never the prefix
/// first.
#[test]
fn a_finished_prefix_outlives_colder_chunks_under_pressure() {
    for policy in [PolicyKind::Lru, PolicyKind::Arc] {
        let mut s = Scheduler::new(SchedulerConfig {
            policy,
            ..config(None)
        })
        .unwrap();
        let (a, c, d) = (keys_from(100, 8), keys_from(200, 8), keys_from(300, 12));
        run_stored(&mut s, "a", a.clone(), 1); // a's chunks are the oldest
        run_stored(&mut s, "c", c.clone(), 10);
        s.schedule(&step(&[], &["c"], &[])).unwrap(); // c is done first: colder
        s.schedule(&step(&[], &["a"], &[])).unwrap();
        assert_eq!(s.num_requests(), 0);
        // d needs 12 slots of the 16 (all used): c's 8 and a's last 4 leave.
        run_stored(&mut s, "d", d.clone(), 20);
        let ready = KeyState::Ready { pins: 0 };
        let st = states(&s, &a);
        assert_eq!(st[..4], [ready; 4], "{policy}: a's first chunks survive");
        assert_eq!(st[4..], [KeyState::Absent; 4], "{policy}: a's suffix left");
        assert_eq!(states(&s, &c), vec![KeyState::Absent; 8], "{policy}");
        // The next turn of a finds its prefix: 16 tokens come back.
        s.add_request("a2", 33, a).unwrap();
        assert_eq!(s.lookup("a2", 0).unwrap(), Some(16), "{policy}");
    }
}

#[test]
fn extend_hashes_many_checks_every_request_before_appending() {
    let mut s = Scheduler::new(config(None)).unwrap();
    s.add_request("a", 9, keys(1)).unwrap();
    s.add_request("b", 9, keys(1)).unwrap();
    let unknown = [("a", keys_from(5, 2)), ("nope", keys_from(7, 1))];
    assert_eq!(
        s.extend_hashes_many(&unknown),
        Err(Error::UnknownRequest("nope".into()))
    );
    let twice = [
        ("b", keys_from(5, 1)),
        ("a", keys_from(6, 1)),
        ("b", keys_from(7, 1)),
    ];
    assert!(matches!(
        s.extend_hashes_many(&twice),
        Err(Error::RequestState { request, .. }) if request == "b"
    ));
    assert_eq!(
        (s.num_hashes("a").unwrap(), s.num_hashes("b").unwrap()),
        (1, 1)
    );
    s.extend_hashes_many(&[("a", keys_from(5, 2)), ("b", keys_from(7, 1))])
        .unwrap();
    assert_eq!(
        (s.num_hashes("a").unwrap(), s.num_hashes("b").unwrap()),
        (3, 2)
    );
}

/// A handle outlives its request: the slab index is reused by another request, and the stale
/// handle falls back to its id (unknown now), never to the new request at that index.
#[test]
fn stale_handles_resolve_by_id() {
    let mut s = Scheduler::new(config(None)).unwrap();
    let store = stored(&mut s, "a", keys(2), &[1, 2, 3]);
    let a = s.resolved("a".to_owned());
    assert!(a.resolved_handle().is_some());
    assert_eq!(s.num_hashes(&a).unwrap(), 2);
    s.schedule(&step(&[], &["a"], &[])).unwrap();
    s.complete(store, 0, true).unwrap();
    assert_eq!(s.num_requests(), 0);
    // "b" takes a's slab index.
    s.add_request("b", 9, keys_from(50, 1)).unwrap();
    assert_eq!(s.num_hashes(&a), Err(Error::UnknownRequest("a".into())));
    assert_eq!(
        s.extend_hashes_many(&[(a.clone(), keys(1))]),
        Err(Error::UnknownRequest("a".into()))
    );
    let input: StepInput<_> = StepInput {
        scheduled: vec![a],
        computed: vec![4],
        new_blocks: Vec::new(),
        resumed: Vec::new(),
        finished: Vec::new(),
        aborted: Vec::new(),
        preempted: Vec::new(),
        written: None,
    };
    assert_eq!(s.schedule(&input), Err(Error::UnknownRequest("a".into())));
    assert_eq!(s.num_hashes("b").unwrap(), 1);
    // A handle resolved before an unrelated request was added stays valid.
    let b = s.resolved("b");
    s.add_request("c", 9, keys(1)).unwrap();
    s.extend_hashes_many(&[(b, keys_from(51, 1))]).unwrap();
    assert_eq!(s.num_hashes("b").unwrap(), 2);
}

/// Store keys of each store job of a plan.
fn store_keys(plan: &kvoffload::scheduler::StepPlan) -> Vec<Vec<Key>> {
    plan.stores
        .iter()
        .map(|j| j.transfers[0].keys.clone())
        .collect()
}

#[test]
fn decode_stores_each_chunk_in_the_step_that_fills_it_and_again_after_a_failed_load() {
    // Store planning skips a request whose watermark is below its next chunk without reading
    // its block tables: hashes arriving early, tokens one at a time, a finished store and a
    // failed load's rewind must not make it miss (or repeat) a chunk.
    let mut s = Scheduler::new(config(None)).unwrap();
    s.add_request("a", 9, keys(2)).unwrap();
    assert_eq!(s.lookup("a", 0).unwrap(), Some(0));
    s.allocate("a", &[bl(&[1, 2, 3, 4, 5])], 0, 0).unwrap();
    let plan = s.schedule(&step(&[("a", 9)], &[], &[1, 2, 3])).unwrap();
    assert_eq!(store_keys(&plan), vec![keys(2)]);
    s.complete(plan.stores[0].id, 0, true).unwrap();
    // Chunk 2's hash arrives before its tokens are computed (10, 11): nothing to store yet.
    s.extend_hashes("a", &keys_from(1002, 1)).unwrap();
    for computed in [10, 11] {
        let plan = s.schedule(&step(&[("a", computed)], &[], &[3])).unwrap();
        assert!(plan.stores.is_empty(), "{computed}: {plan:?}");
    }
    let plan = s.schedule(&step(&[("a", 12)], &[], &[3])).unwrap();
    assert_eq!(store_keys(&plan), vec![keys_from(1002, 1)]);
    for computed in [13, 14, 15] {
        let plan = s.schedule(&step(&[("a", computed)], &[], &[4])).unwrap();
        assert!(plan.stores.is_empty(), "{computed}: {plan:?}");
    }
    // Computed before its hash arrives: stored in the step that brings the hash.
    let plan = s.schedule(&step(&[("a", 16)], &[], &[4])).unwrap();
    assert!(plan.stores.is_empty());
    s.extend_hashes("a", &keys_from(1003, 1)).unwrap();
    let plan = s.schedule(&step(&[("a", 16)], &[], &[])).unwrap();
    assert_eq!(store_keys(&plan), vec![keys_from(1003, 1)]);
    let plan = s.schedule(&step(&[("a", 17)], &[], &[5])).unwrap();
    assert!(plan.stores.is_empty());

    // b loads a's prefix; the load fails, the engine recomputes it: both chunks are stored
    // again (the failed load dropped them), once.
    s.add_request("b", 9, keys(2)).unwrap();
    assert_eq!(s.lookup("b", 0).unwrap(), Some(8));
    let load = s.allocate("b", &[bl(&[6, 7, 8])], 0, 8).unwrap().unwrap();
    let plan = s.schedule(&step(&[("a", 18)], &[], &[5])).unwrap();
    assert_eq!(plan.loads.len(), 1);
    assert!(!s.complete(load, 0, false).unwrap().unwrap().ok);
    let plan = s.schedule(&step(&[("b", 4)], &[], &[6])).unwrap();
    assert_eq!(store_keys(&plan), vec![keys(1)]);
    let plan = s.schedule(&step(&[("b", 9)], &[], &[7, 8])).unwrap();
    assert_eq!(store_keys(&plan), vec![keys_from(1001, 1)]);
    let plan = s.schedule(&step(&[("b", 10)], &[], &[8])).unwrap();
    assert!(plan.stores.is_empty());
}
