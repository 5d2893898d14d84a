//! `lookup_request` and `sync_request` with hostile hash lists: an engine resends its whole
//! list (nothing is appended twice), a shorter list, a list that differs from the held hashes,
//! a list that leaves a gap. Every refusal names the request and changes nothing (hashes,
//! status, counters), and a later good call behaves as if the bad one never came.

mod support;
use support::step::{bl, step};

use kvoffload::config::{GroupConfig, SchedulerConfig};
use kvoffload::scheduler::{Scheduler, Status};
use kvoffload::{Error, Key};

fn core() -> Scheduler {
    let groups = vec![GroupConfig {
        block_size: 4,
        sliding_window: None,
        bytes_per_chunk: 64,
    }];
    Scheduler::new(SchedulerConfig::new(groups, 64, 16)).unwrap()
}

fn keys(first: u128, n: u128) -> Vec<Key> {
    (first..first + n).map(Key).collect()
}

/// What a refused call must leave as it was.
fn view(s: &Scheduler, id: &str) -> (usize, Status, usize, u64) {
    (
        s.num_hashes(id).unwrap(),
        s.status(id).unwrap(),
        s.num_requests(),
        s.stats().lookups,
    )
}

fn refused(r: kvoffload::Result<impl std::fmt::Debug>, id: &str, what: &str) {
    match r {
        Err(Error::RequestState { request, reason }) => {
            assert_eq!(request, id);
            assert!(reason.contains(what), "{reason:?} lacks {what:?}");
        }
        other => panic!("expected a RequestState error, got {other:?}"),
    }
}

/// Request `id` (prompt of `4 * n + 1` tokens, `n` hashes from `first`) stored in the CPU
/// pool and finished, so a later request with the same hashes can load them.
fn store(s: &mut Scheduler, id: &str, first: u128, n: u32, blocks: &[u32]) {
    let hs = keys(first, u128::from(n));
    assert_eq!(
        s.lookup_request(id, 4 * n + 1, hs.clone(), 0, 0).unwrap(),
        Some(0)
    );
    s.allocate(id, &[bl(blocks)], 0, 0).unwrap();
    let plan = s.schedule(&step(&[(id, 4 * n)], &[], blocks)).unwrap();
    for j in plan.stores {
        s.complete(j.id, 0, true).unwrap();
    }
    s.schedule(&step(&[], &[id], &[])).unwrap();
}

#[test]
fn a_resent_whole_list_appends_only_its_new_hashes() {
    let mut s = core();
    let hs = keys(1, 6);
    s.sync_request("a", 25, &hs[..3], 0).unwrap();
    // The whole list again, then grown by three: only those three are appended.
    s.sync_request("a", 25, &hs[..3], 0).unwrap();
    assert_eq!(s.num_hashes("a").unwrap(), 3);
    assert_eq!(
        s.lookup_request("a", 25, hs.clone(), 0, 0).unwrap(),
        Some(0)
    );
    assert_eq!(s.num_hashes("a").unwrap(), 6);
    // From the last held hash on (what the binding sends), and the tail alone.
    assert_eq!(
        s.lookup_request("a", 25, hs[5..].to_vec(), 5, 0).unwrap(),
        Some(0)
    );
    assert_eq!(
        s.lookup_request("a", 25, Vec::new(), 6, 0).unwrap(),
        Some(0)
    );
    assert_eq!(s.num_hashes("a").unwrap(), 6);
}

#[test]
fn a_resent_list_still_finds_the_stored_prefix() {
    let mut s = core();
    store(&mut s, "a", 1, 4, &[1, 2, 3, 4]);
    // "b" shares a's four chunks; the engine sends its whole list on every ask.
    let hs = keys(1, 4);
    for _ in 0..3 {
        assert_eq!(
            s.lookup_request("b", 17, hs.clone(), 0, 0).unwrap(),
            Some(16)
        );
    }
    assert_eq!(s.num_hashes("b").unwrap(), 4);
    assert!(s
        .allocate("b", &[bl(&[9, 10, 11, 12, 13])], 0, 16)
        .unwrap()
        .is_some());
}

#[test]
fn a_shorter_list_is_refused_and_changes_nothing() {
    let mut s = core();
    let hs = keys(1, 5);
    s.sync_request("a", 21, &hs, 0).unwrap();
    let before = view(&s, "a");
    refused(
        s.lookup_request("a", 21, hs[..4].to_vec(), 0, 0),
        "a",
        "a hash list of 4",
    );
    refused(
        s.sync_request("a", 21, &hs[3..4], 3),
        "a",
        "a hash list of 4",
    );
    refused(s.sync_request("a", 21, &[], 0), "a", "a hash list of 0");
    assert_eq!(view(&s, "a"), before);
    assert_eq!(
        s.lookup_request("a", 21, hs.clone(), 0, 0).unwrap(),
        Some(0)
    );
}

#[test]
fn a_different_list_is_refused_and_changes_nothing() {
    let mut s = core();
    let hs = keys(1, 5);
    s.sync_request("a", 41, &hs, 0).unwrap();
    let before = view(&s, "a");
    // Differs at the last held hash (what the binding compares), at the first, or only in
    // the held prefix while extending it.
    let mut other = keys(1, 8);
    other[4] = Key(99);
    refused(
        s.lookup_request("a", 41, other[4..].to_vec(), 4, 0),
        "a",
        "position 4",
    );
    refused(
        s.lookup_request("a", 41, keys(50, 8), 0, 0),
        "a",
        "position 0",
    );
    other = keys(1, 8);
    other[2] = Key(77);
    refused(
        s.sync_request("a", 41, &other, 0),
        "a",
        "yet 0x4d was given",
    );
    assert_eq!(view(&s, "a"), before);
    // A gap: hashes from beyond the held ones.
    refused(
        s.sync_request("a", 41, &keys(7, 2), 6),
        "a",
        "from position 6",
    );
    // Not tracked: only a whole list registers it.
    refused(s.sync_request("b", 41, &keys(1, 2), 1), "b", "not tracked");
    assert!(s.num_hashes("b").is_err());
    assert_eq!(view(&s, "a"), before);
}

#[test]
fn a_running_request_sent_a_bad_list_is_not_released() {
    let mut s = core();
    let hs = keys(1, 3);
    assert_eq!(
        s.lookup_request("a", 13, hs.clone(), 0, 0).unwrap(),
        Some(0)
    );
    s.allocate("a", &[bl(&[1, 2, 3])], 0, 0).unwrap();
    s.schedule(&step(&[("a", 12)], &[], &[])).unwrap();
    assert_eq!(s.status("a").unwrap(), Status::Running);
    let before = view(&s, "a");
    refused(
        s.lookup_request("a", 13, keys(5, 3), 0, 0),
        "a",
        "position 0",
    );
    refused(
        s.lookup_request("a", 13, hs[..2].to_vec(), 0, 0),
        "a",
        "a hash list of 2",
    );
    assert_eq!(view(&s, "a"), before);
    // The right list releases it (the engine queued it again) and looks it up.
    assert!(s.lookup_request("a", 13, hs.clone(), 0, 0).is_ok());
    assert_eq!(s.status("a").unwrap(), Status::Preempted);
}

#[test]
fn a_waiting_re_ask_answers_later_until_its_load_is_done_and_zero_when_nothing_is_left() {
    let mut s = core();
    store(&mut s, "a", 1, 4, &[1, 2, 3, 4]);
    let hs = keys(1, 4);
    assert_eq!(
        s.lookup_request("b", 17, hs.clone(), 0, 0).unwrap(),
        Some(16)
    );
    let load = s
        .allocate("b", &[bl(&[5, 6, 7, 8, 9])], 0, 16)
        .unwrap()
        .expect("a load job");
    // "c" wants the same chunks: it waits for b's load, asked again and again.
    for _ in 0..3 {
        assert_eq!(s.lookup_request("c", 17, hs.clone(), 0, 0).unwrap(), None);
    }
    // The engine's own prefix cache now serves all 16 tokens: nothing is left to load, and
    // the answer is 0 at once, waiting or not.
    assert_eq!(
        s.lookup_request("c", 17, hs.clone(), 4, 16).unwrap(),
        Some(0)
    );
    assert_eq!(s.lookup_request("d", 17, hs.clone(), 0, 0).unwrap(), None);
    s.schedule(&step(&[], &[], &[])).unwrap();
    s.complete(load, 0, true).unwrap();
    assert_eq!(
        s.lookup_request("d", 17, hs.clone(), 0, 0).unwrap(),
        Some(16)
    );
}
