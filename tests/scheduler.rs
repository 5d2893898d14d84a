//! Integration tests of the scheduler core's Rust API (debug build: internal consistency
//! assertions are on). The full behaviour is covered from Python (scenario tests and the
//! differential test against the model); these check the same paths compile and hold in Rust.

use kvoffload::config::{GroupConfig, SchedulerConfig};
use kvoffload::jobs::JobKind;
use kvoffload::policy::PolicyKind;
use kvoffload::scheduler::{Scheduler, Status, StepInput};
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
    SchedulerConfig {
        groups,
        blocks_per_chunk: 1,
        hash_block_size: 4,
        num_gpu_blocks: 64,
        null_block: Some(0),
        cpu_chunks: 16,
        policy: PolicyKind::Lru,
        num_workers: 1,
        max_loading_requests: 0,
        offload_prompt_only: false,
        max_offload_tokens: None,
        store_threshold: 0,
        debug_skip_deferred_arming: false,
    }
}

fn keys(n: u128) -> Vec<Key> {
    (0..n).map(|i| Key(1000 + i)).collect()
}

fn step(scheduled: &[(&str, u32)], finished: &[&str], written: Vec<u32>) -> StepInput<String> {
    StepInput {
        scheduled: scheduled.iter().map(|(r, _)| (*r).to_owned()).collect(),
        computed: scheduled.iter().map(|(_, c)| *c).collect(),
        new_blocks: Vec::new(),
        resumed: Vec::new(),
        finished: finished.iter().map(|r| (*r).to_owned()).collect(),
        aborted: Vec::new(),
        preempted: Vec::new(),
        written: Some(written),
    }
}

#[test]
fn store_finish_flush_load_and_drain() {
    let mut s = Scheduler::new(config(None)).unwrap();
    s.add_request("a", 9, keys(2)).unwrap();
    assert_eq!(s.lookup("a", 0).unwrap(), Some(0));
    assert_eq!(s.allocate("a", &[vec![1, 2, 3]], 0, 0).unwrap(), None);
    let plan = s.schedule(&step(&[("a", 8)], &[], vec![1, 2, 3])).unwrap();
    assert_eq!(plan.stores.len(), 1);
    assert_eq!(plan.stores[0].transfers[0].gpu_blocks, vec![1, 2]);
    assert!(plan.flush.is_empty());
    let store = plan.stores[0].id;

    // a finishes; block 2 is re-allocated and written: its pending store must flush.
    assert!(s
        .schedule(&step(&[], &["a"], vec![]))
        .unwrap()
        .flush
        .is_empty());
    assert_eq!(
        s.schedule(&step(&[], &[], vec![2])).unwrap().flush,
        vec![store]
    );
    let done = s.complete(store, 1, true).unwrap().unwrap();
    assert_eq!((done.kind, done.ok), (JobKind::Store, true));
    assert_eq!(s.status("a"), Err(Error::UnknownRequest("a".into())));

    // b shares the prefix: both chunks come back from the CPU tier.
    s.add_request("b", 9, keys(2)).unwrap();
    assert_eq!(s.lookup("b", 0).unwrap(), Some(8));
    let load = s.allocate("b", &[vec![5, 6, 7]], 0, 8).unwrap().unwrap();
    let plan = s.schedule(&step(&[("b", 9)], &[], vec![5, 6, 7])).unwrap();
    assert_eq!(plan.loads[0].id, load);
    assert_eq!(plan.loads[0].transfers[0].gpu_blocks, vec![5, 6]);
    assert_eq!(s.status("b").unwrap(), Status::Running);
    assert!(s.complete(load, 1, true).unwrap().unwrap().ok);

    // Drain: no leaks.
    s.schedule(&step(&[], &["b"], vec![])).unwrap();
    assert!(s.pending_jobs().is_empty());
    assert_eq!(s.num_requests(), 0);
    assert_eq!(s.armed_pairs(), 0);
}

#[test]
fn failed_load_reports_blocks_drops_chunks_and_preempt_makes_it_lookable() {
    let mut s = Scheduler::new(config(Some(8))).unwrap();
    s.add_request("a", 9, keys(2)).unwrap();
    s.allocate("a", &[vec![1, 2, 3], vec![11, 12, 13]], 0, 0)
        .unwrap();
    let plan = s.schedule(&step(&[("a", 8)], &[], vec![])).unwrap();
    // Window blocks are armed at creation, full-attention blocks are not.
    assert_eq!(s.armed_pairs(), 2);
    for j in &plan.stores {
        s.complete(j.id, 1, true).unwrap();
    }
    s.schedule(&step(&[], &["a"], vec![])).unwrap();
    s.add_request("b", 9, keys(2)).unwrap();
    let n = s.lookup("b", 0).unwrap().unwrap();
    assert_eq!(n, 8);
    let load = s
        .allocate("b", &[vec![5, 6, 7], vec![15, 16, 17]], 0, n)
        .unwrap()
        .unwrap();
    let done = s.complete(load, 1, false).unwrap().unwrap();
    assert!(!done.ok);
    assert_eq!(done.invalid_blocks, vec![5, 6, 15, 16]);
    assert!(matches!(s.lookup("b", 0), Err(Error::RequestState { .. })));
    s.preempt("b").unwrap();
    assert_eq!(s.lookup("b", 0).unwrap(), Some(0)); // the failed chunks were dropped
    assert_eq!(s.stats().failed_loads, 1);
}

#[test]
fn bad_input_changes_nothing() {
    let mut s = Scheduler::new(config(None)).unwrap();
    s.add_request("a", 8, keys(2)).unwrap();
    s.allocate("a", &[vec![1, 2]], 0, 0).unwrap();
    let before = s.stats();
    assert!(matches!(
        s.schedule(&step(&[("a", 8), ("zz", 1)], &[], vec![])),
        Err(Error::UnknownRequest(_))
    ));
    assert!(matches!(
        s.schedule(&step(&[("a", 8)], &[], vec![64])),
        Err(Error::BlockOutOfRange { .. })
    ));
    assert_eq!(
        s.complete(JobId(9), 1, true),
        Err(Error::UnknownJob(JobId(9)))
    );
    assert_eq!(s.stats(), before);
    let mut bad = config(None);
    bad.blocks_per_chunk = 3;
    bad.hash_block_size = 8;
    assert!(matches!(Scheduler::new(bad), Err(Error::Config(_))));
}
