//! Write-behind is bounded (DESIGN.md §9, "a lower tier only ever adds"): a tier whose writes
//! never complete pins at most `tier_write_slots` CPU slots of a group; past it chunks are not
//! written (counted as `skipped_writes`) and every store still finds room. Fresh chunks take
//! half of that room, chunks loaded from the CPU pool (reused) the rest, prefix first; a disk
//! tier's write rate limit skips what is past its rate.

use kvoffload::config::SchedulerConfig;
use kvoffload::policy::PolicyKind;
use kvoffload::scheduler::{DiskWatch, Scheduler, StepPlan, TierJobKind};
use kvoffload::tier::disk::{DiskIndex, SlabLayout, BLOCK};
use kvoffload::{BlockId, Key};

mod support;
use support::tier::{config_with, step, CHUNK};

/// CPU slots: write-behind may pin an eighth of them (8, the default share).
const SLOTS: u32 = 64;
/// Chunks of each request.
const N: u64 = 40;

fn scheduler() -> Scheduler {
    let cfg = SchedulerConfig {
        tier_write_slots: SLOTS / 8, // the default share
        ..config_with(CHUNK as u64, SLOTS)
    };
    let mut s = Scheduler::new(cfg).unwrap();
    let layout = SlabLayout::new(CHUNK as u64, 1024 * (BLOCK + 2 * BLOCK)).unwrap();
    let index = DiskIndex::new(layout, PolicyKind::Lru).unwrap();
    s.attach_tier(0, Box::new(index)).unwrap();
    s
}

fn keys(base: u128) -> Vec<Key> {
    (1..=u128::from(N)).map(|i| Key(base + i)).collect()
}

fn blocks() -> Vec<BlockId> {
    (1..=N as u32 + 1).map(BlockId).collect()
}

/// Completes the plan's stores; tier jobs are left pending (a stuck tier). Returns the keys
/// the plan's write-behind jobs write.
fn stores_done(s: &mut Scheduler, plan: &StepPlan) -> Vec<Key> {
    for job in &plan.stores {
        s.complete(job.id, 0, true).unwrap();
    }
    plan.tier_jobs
        .iter()
        .filter(|j| j.kind == TierJobKind::Write)
        .flat_map(|j| j.keys.clone())
        .collect()
}

/// Request `id` of `N` chunks `keys` computes and stores them all, then finishes; returns the
/// chunks stored and the keys written behind meanwhile.
fn run(s: &mut Scheduler, id: &'static str, keys: &[Key]) -> (usize, Vec<Key>) {
    let tokens = N as u32 * 4 + 1;
    s.add_request(id, tokens, keys.to_vec()).unwrap();
    assert_eq!(s.lookup(id, 0).unwrap(), Some(0));
    s.allocate(id, &[blocks()], 0, 0).unwrap();
    let written: Vec<u32> = blocks().iter().map(|b| b.0).collect();
    let plan = s.schedule(&step(&[(id, tokens)], &[], &written)).unwrap();
    let stored: usize = plan
        .stores
        .iter()
        .flat_map(|j| &j.transfers)
        .map(|t| t.keys.len())
        .sum();
    let mut behind = stores_done(s, &plan);
    let plan = s.schedule(&step(&[], &[id], &[])).unwrap();
    behind.extend(stores_done(s, &plan));
    (stored, behind)
}

#[test]
fn a_stuck_tier_pins_its_share_and_stores_still_find_room() {
    let mut s = scheduler();
    let (stored, behind) = run(&mut s, "a", &keys(0x1000));
    assert_eq!(stored, N as usize);
    // Fresh chunks take half the room (4 of 8), the prefix's first ones.
    assert_eq!(behind, keys(0x1000)[..4].to_vec());
    // The tier never reports: 4 slots stay pinned. A second request's 40 chunks still find
    // room among the other 60 (unbounded, 40 pinned slots left only 24).
    let (stored, behind) = run(&mut s, "b", &keys(0x2000));
    assert_eq!(stored, N as usize, "no store dropped");
    assert!(behind.is_empty(), "the fresh half is taken: {behind:?}");
    let st = s.tier_stats()[0];
    assert_eq!(st.write_pinned, 4);
    assert_eq!(st.skipped_writes, 2 * N - 4);
    assert_eq!(st.write_jobs, 1);
}

#[test]
fn reused_chunks_take_the_rest_of_the_room() {
    let mut s = scheduler();
    run(&mut s, "a", &keys(0x1000));
    // "c" reuses a's chunks: its load from the CPU pool offers the skipped ones again, and
    // reused chunks may fill the whole room (8): 4 more, prefix first.
    let tokens = N as u32 * 4 + 1;
    s.add_request("c", tokens, keys(0x1000)).unwrap();
    let hit = s.lookup("c", 0).unwrap().expect("an answer");
    assert_eq!(hit, N as u32 * 4);
    let load = s
        .allocate("c", &[blocks()], 0, hit)
        .unwrap()
        .expect("a load");
    let written: Vec<u32> = blocks().iter().map(|b| b.0).collect();
    let plan = s.schedule(&step(&[("c", tokens)], &[], &written)).unwrap();
    assert!(plan.loads.iter().any(|j| j.id == load));
    s.complete(load, 0, true).unwrap();
    let plan = s.schedule(&step(&[("c", tokens)], &[], &[])).unwrap();
    let behind = stores_done(&mut s, &plan);
    assert_eq!(behind, keys(0x1000)[4..8].to_vec());
    let st = s.tier_stats()[0];
    assert_eq!(st.write_pinned, 8);
}

#[test]
fn a_write_rate_limit_skips_the_chunks_past_its_rate() {
    // One chunk per second: the bucket holds one chunk (a quarter second's worth is less).
    let root = std::env::temp_dir().join(format!("kvo-wbound-{}-rate", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let mut s = Scheduler::new(config_with(CHUNK as u64, SLOTS)).unwrap();
    let watch = DiskWatch {
        write_bytes_per_s: CHUNK as u64,
        ..DiskWatch::default()
    };
    s.attach_disk_with(&root, 1 << 20, "m", watch).unwrap();
    let (stored, behind) = run(&mut s, "a", &keys(0x1000));
    assert_eq!(stored, N as usize);
    assert_eq!(
        behind,
        keys(0x1000)[..1].to_vec(),
        "the prefix's first chunk"
    );
    let st = s.tier_stats()[0];
    assert_eq!(st.skipped_writes, N - 1);
    let _ = std::fs::remove_dir_all(&root);
}
