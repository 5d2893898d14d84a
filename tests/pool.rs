//! Integration tests of the CPU pool's public API: the reference scenario of DESIGN.md §5, every
//! rule of DESIGN.md §5 for both policies, and a property test that runs random operations
//! against a naive `Vec`-based model of each policy, checking the invariants after every step.

use std::collections::{HashMap, HashSet};

use kvoffload::policy::PolicyKind;
use kvoffload::pool::{KeyState, Pool, PoolConfig, PoolEvent, PoolEventKind, StorePlan, MEDIUM};
use kvoffload::{Error, Key, SlotId};
use proptest::prelude::*;

fn ks(ids: &[u128]) -> Vec<Key> {
    ids.iter().copied().map(Key).collect()
}

fn pool(capacity: u32, policy: PolicyKind) -> Pool {
    Pool::new(PoolConfig {
        capacity,
        policy,
        store_threshold: 0,
    })
    .unwrap()
}

/// Stores and completes `ids` (which must fit without refusal).
fn fill(p: &mut Pool, ids: &[u128]) -> StorePlan {
    let plan = p.prepare_store(&ks(ids)).expect("room");
    p.complete_store(&plan.keys, true).unwrap();
    plan
}

fn stored(ids: &[u128]) -> PoolEvent {
    PoolEvent {
        kind: PoolEventKind::Stored,
        keys: ks(ids),
    }
}

fn removed(ids: &[u128]) -> PoolEvent {
    PoolEvent {
        kind: PoolEventKind::Removed,
        keys: ks(ids),
    }
}

fn order_of(p: &Pool, list: &str) -> Vec<u128> {
    let o = p.order();
    o.resident
        .iter()
        .chain(&o.ghosts)
        .find(|(n, _)| *n == list)
        .map_or_else(
            || panic!("no list {list}"),
            |(_, keys)| keys.iter().map(|k| k.0).collect(),
        )
}

/// Everything observable about a pool, to show that a refused call changed nothing.
fn observe(p: &Pool, universe: &[u128]) -> (Vec<KeyState>, Vec<Option<SlotId>>, String) {
    let states = universe.iter().map(|&k| p.state(Key(k))).collect();
    let slots = universe.iter().map(|&k| p.slot(Key(k))).collect();
    let mut counters = p.stats();
    counters.no_room = 0; // the one counter a refusal bumps
    (states, slots, format!("{counters:?} {:?}", p.order()))
}

// ---------------------------------------------------------------------------------------------
// The reference scenario of DESIGN.md §5.

#[test]
fn reference_scenario_lru() {
    let mut p = pool(4, PolicyKind::Lru);
    let all: Vec<u128> = (1..=9).collect();

    // store [1,2] -> both get slots; 1 is storing until completion.
    let plan = p.prepare_store(&ks(&[1, 2])).unwrap();
    assert_eq!(plan.keys, ks(&[1, 2]));
    assert_eq!(plan.slots.len(), 2);
    assert!(plan.evicted.is_empty());
    let mut states = Vec::new();
    assert_eq!(p.lookup_states(&ks(&[1]), &mut states), 0);
    assert_eq!(states, vec![KeyState::Storing]);
    p.complete_store(&ks(&[1, 2]), true).unwrap();
    assert_eq!(p.lookup(&ks(&[1, 2])), 2);

    // store [2,3,4,5] -> stores 3,4,5 (2 is present), evicts 1.
    let plan = p.prepare_store(&ks(&[2, 3, 4, 5])).unwrap();
    assert_eq!(plan.keys, ks(&[3, 4, 5]));
    assert_eq!(plan.evicted, ks(&[1]));
    assert_eq!(p.state(Key(1)), KeyState::Absent);

    // store [1,6] -> no room (only 2 is evictable), nothing changes.
    let before = observe(&p, &all);
    assert!(p.prepare_store(&ks(&[1, 6])).is_none());
    assert_eq!(observe(&p, &all), before);

    // complete 3,4,5; load [2,3] pins them.
    p.complete_store(&ks(&[3, 4, 5]), true).unwrap();
    p.prepare_load(&ks(&[2, 3])).unwrap();
    assert_eq!(p.state(Key(2)), KeyState::Ready { pins: 1 });

    // store [6,7,8] -> no room (only 4,5 evictable), nothing changes.
    let before = observe(&p, &all);
    assert!(p.prepare_store(&ks(&[6, 7, 8])).is_none());
    assert_eq!(observe(&p, &all), before);

    // complete the load; store [6,7,8] -> evicts 2,3,4.
    p.complete_load(&ks(&[2, 3])).unwrap();
    let plan = p.prepare_store(&ks(&[6, 7, 8])).unwrap();
    assert_eq!(plan.keys, ks(&[6, 7, 8]));
    assert_eq!(plan.evicted, ks(&[2, 3, 4]));
    p.complete_store(&ks(&[6, 7, 8]), true).unwrap();

    // touch [5,6,7]; store [9] -> evicts 8.
    p.touch(&ks(&[5, 6, 7]));
    let plan = p.prepare_store(&ks(&[9])).unwrap();
    assert_eq!(plan.evicted, ks(&[8]));
    let slot9 = plan.slots[0];

    // complete_store([7,9], failed) -> 7 stays readable, 9 is gone and its slot free.
    p.complete_store(&ks(&[7, 9]), false).unwrap();
    assert_eq!(p.state(Key(7)), KeyState::Ready { pins: 0 });
    assert_eq!(p.state(Key(9)), KeyState::Absent);
    assert_eq!(p.stats().free, 1);
    let plan = p.prepare_store(&ks(&[10])).unwrap();
    assert_eq!(plan.slots, vec![slot9]);
    assert!(plan.evicted.is_empty());

    assert_eq!(
        p.take_events(),
        vec![
            stored(&[1, 2]),
            removed(&[1]),
            stored(&[3, 4, 5]),
            removed(&[2, 3, 4]),
            stored(&[6, 7, 8]),
            removed(&[8]),
        ]
    );
    assert!(p.take_events().is_empty());
    let s = p.stats();
    assert_eq!((s.evictions, s.failed_stores, s.no_room), (5, 1, 2));
    assert_eq!((s.stores, s.loads), (8, 2));
    p.check_consistency().unwrap();
}

// ---------------------------------------------------------------------------------------------
// Rules, both policies.

const POLICIES: [PolicyKind; 2] = [PolicyKind::Lru, PolicyKind::Arc];

#[test]
fn zero_and_huge_capacity_are_config_errors() {
    for capacity in [0, kvoffload::pool::MAX_CAPACITY + 1] {
        let err = Pool::new(PoolConfig::new(capacity)).unwrap_err();
        assert!(matches!(err, Error::Config(_)));
        let msg = err.to_string();
        assert!(msg.contains(&format!("got {capacity}")), "{msg}");
        assert!(msg.contains("between 1 and"), "{msg}");
    }
}

#[test]
fn policy_names_parse_case_insensitively() {
    assert_eq!("ARC".parse::<PolicyKind>().unwrap(), PolicyKind::Arc);
    assert_eq!("lru".parse::<PolicyKind>().unwrap(), PolicyKind::Lru);
    let err = "clock".parse::<PolicyKind>().unwrap_err();
    assert!(err.to_string().contains("\"clock\""), "{err}");
}

#[test]
fn lookup_counts_leading_ready_keys_and_reports_states() {
    for policy in POLICIES {
        let mut p = pool(8, policy);
        fill(&mut p, &[1, 2, 4]);
        p.prepare_store(&ks(&[3])).unwrap();
        let mut states = Vec::new();
        assert_eq!(p.lookup_states(&ks(&[1, 2, 3, 4, 5]), &mut states), 2);
        assert_eq!(
            states,
            vec![
                KeyState::Ready { pins: 0 },
                KeyState::Ready { pins: 0 },
                KeyState::Storing,
                KeyState::Ready { pins: 0 },
                KeyState::Absent
            ]
        );
        assert_eq!(p.lookup(&ks(&[5, 1])), 0);
        assert_eq!(p.lookup(&[]), 0);
        let s = p.stats();
        assert_eq!((s.hits, s.misses), (2, 5));
    }
}

#[test]
fn state_and_slot_have_no_side_effects() {
    for policy in POLICIES {
        let mut p = pool(4, policy);
        fill(&mut p, &[1, 2]);
        let before = observe(&p, &[1, 2, 3]);
        assert_eq!(p.state(Key(3)), KeyState::Absent);
        assert_eq!(p.slot(Key(3)), None);
        assert!(p.slot(Key(1)).is_some());
        assert_eq!(observe(&p, &[1, 2, 3]), before);
    }
}

#[test]
fn fill_slots_probes_only_the_unknown_entries_in_batches_and_keeps_the_others() {
    let mut p = pool(64, PolicyKind::Lru);
    let ids: Vec<u128> = (1..=40).collect();
    fill(&mut p, &ids);
    // 50 keys (more than a probe batch), every third one absent; some entries already hold a
    // slot (kept even where it is not the key's: the caller's hint), the rest are unknown.
    let keys: Vec<Key> = (0..50u128)
        .map(|i| Key(if i % 3 == 2 { 1000 + i } else { 1 + i % 40 }))
        .collect();
    let mut slots = vec![SlotId::NONE; keys.len()];
    for i in (0..keys.len()).step_by(7) {
        slots[i] = SlotId(63 - i as u32);
    }
    let given = slots.clone();
    let before = observe(&p, &ids);
    p.fill_slots(&keys, &mut slots);
    for (i, k) in keys.iter().enumerate() {
        let want = if given[i] == SlotId::NONE {
            p.slot(*k).unwrap_or(SlotId::NONE)
        } else {
            given[i]
        };
        assert_eq!(slots[i], want, "entry {i}, key {k}");
    }
    assert!(
        slots.iter().filter(|s| **s == SlotId::NONE).count() >= 10,
        "absent keys stay unknown"
    );
    assert_eq!(observe(&p, &ids), before, "no side effects");
    // Fewer slots than keys: only the slots given are filled.
    let mut short = vec![SlotId::NONE; 3];
    p.fill_slots(&keys, &mut short);
    assert_eq!(
        short,
        [
            p.slot(keys[0]).unwrap(),
            p.slot(keys[1]).unwrap(),
            SlotId::NONE
        ]
    );
}

#[test]
fn touch_resolved_after_fill_slots_is_touch_for_every_policy() {
    for policy in POLICIES {
        // Two equal pools with ghosts (ARC): evicted keys come back as absent touches.
        let (mut a, mut b) = (pool(8, policy), pool(8, policy));
        for p in [&mut a, &mut b] {
            fill(p, &[1, 2, 3, 4, 5, 6, 7, 8]);
            p.touch(&ks(&[2, 3]));
            fill(p, &[9, 10, 11]);
        }
        let keys = ks(&[11, 1, 2, 99, 5, 9, 3, 100]);
        a.touch(&keys);
        // A stale hint (a slot holding another key) is checked, not trusted.
        let mut slots = vec![SlotId::NONE; keys.len()];
        slots[2] = b.slot(Key(6)).unwrap();
        b.fill_slots(&keys, &mut slots);
        b.touch_resolved(&keys, &slots);
        let all: Vec<u128> = (1..=12).chain([99, 100]).collect();
        assert_eq!(observe(&a, &all), observe(&b, &all), "{policy:?}");
    }
}

#[test]
fn prepare_store_skips_present_and_duplicate_keys_in_input_order() {
    for policy in POLICIES {
        let mut p = pool(8, policy);
        fill(&mut p, &[2]);
        p.prepare_store(&ks(&[4])).unwrap();
        let plan = p.prepare_store(&ks(&[5, 2, 3, 5, 4, 1, 3])).unwrap();
        assert_eq!(plan.keys, ks(&[5, 3, 1]));
        assert_eq!(plan.slots.len(), 3);
        let distinct: HashSet<_> = plan.slots.iter().collect();
        assert_eq!(distinct.len(), 3);
        // Long calls deduplicate with a table (`dedup.rs`): same answer, and a second long call
        // does not see the first one's keys as duplicates.
        let long: Vec<u128> = (100..140).chain(100..140).collect();
        let mut q = pool(64, policy);
        assert_eq!(q.prepare_store(&ks(&long)).unwrap().keys, ks(&long[..40]));
        q.complete_store(&ks(&long[..40]), false).unwrap();
        assert_eq!(q.prepare_store(&ks(&long)).unwrap().keys, ks(&long[..40]));
    }
}

#[test]
fn a_call_that_stores_nothing_still_answers() {
    for policy in POLICIES {
        let mut p = pool(2, policy);
        fill(&mut p, &[1, 2]);
        let plan = p.prepare_store(&ks(&[1, 2])).unwrap();
        assert_eq!(plan, StorePlan::default());
        assert_eq!(p.prepare_store(&[]), Some(StorePlan::default()));
        assert_eq!(p.stats().allocations, 1);
    }
}

#[test]
fn no_room_changes_nothing_and_is_counted() {
    for policy in POLICIES {
        let mut p = pool(3, policy);
        fill(&mut p, &[1, 2]);
        p.prepare_store(&ks(&[3])).unwrap(); // storing: not evictable
        p.prepare_load(&ks(&[1])).unwrap(); // pinned: not evictable
        let _ = p.take_events();
        let before = observe(&p, &[1, 2, 3, 4, 5]);
        assert!(p.prepare_store(&ks(&[4, 5])).is_none());
        assert_eq!(observe(&p, &[1, 2, 3, 4, 5]), before);
        assert!(p.take_events().is_empty());
        assert_eq!(p.stats().no_room, 1);
        // More keys than the whole capacity: refused too.
        assert!(p.prepare_store(&ks(&[10, 11, 12, 13])).is_none());
        assert_eq!(p.stats().no_room, 2);
        // One victim is available: a single key fits.
        assert_eq!(p.prepare_store(&ks(&[4])).unwrap().evicted, ks(&[2]));
    }
}

#[test]
fn a_key_of_the_same_call_is_never_evicted() {
    for policy in POLICIES {
        let mut p = pool(2, policy);
        fill(&mut p, &[1, 2]);
        // 1 is the least recent, but it is part of the call.
        let before = observe(&p, &[1, 2, 3, 4]);
        assert!(p.prepare_store(&ks(&[1, 3, 4])).is_none());
        assert_eq!(observe(&p, &[1, 2, 3, 4]), before);
        let plan = p.prepare_store(&ks(&[3, 1])).unwrap();
        assert_eq!(plan.evicted, ks(&[2]));
        assert_eq!(p.state(Key(1)), KeyState::Ready { pins: 0 });
        // The temporary protection left no pin behind.
        assert_eq!(p.stats().pinned, 0);
        p.check_consistency().unwrap();
    }
}

#[test]
fn pinned_and_storing_entries_are_never_evicted() {
    for policy in POLICIES {
        let mut p = pool(4, policy);
        fill(&mut p, &[1, 2]);
        p.prepare_store(&ks(&[3])).unwrap();
        p.prepare_load(&ks(&[1])).unwrap();
        let plan = p.prepare_store(&ks(&[4, 5])).unwrap();
        assert_eq!(plan.evicted, ks(&[2]));
        assert_eq!(p.state(Key(1)), KeyState::Ready { pins: 1 });
        assert_eq!(p.state(Key(3)), KeyState::Storing);
        assert!(p.prepare_store(&ks(&[6])).is_none());
    }
}

#[test]
fn complete_store_publishes_or_drops() {
    for policy in POLICIES {
        let mut p = pool(4, policy);
        let plan = p.prepare_store(&ks(&[1, 2, 3])).unwrap();
        p.complete_store(&ks(&[1, 3]), true).unwrap();
        p.complete_store(&ks(&[2]), false).unwrap();
        assert_eq!(p.state(Key(1)), KeyState::Ready { pins: 0 });
        assert_eq!(p.state(Key(2)), KeyState::Absent);
        assert_eq!(p.slot(Key(2)), None);
        assert_eq!(p.take_events(), vec![stored(&[1, 3])]);
        let s = p.stats();
        assert_eq!(
            (s.used, s.free, s.storing, s.stores, s.failed_stores),
            (2, 2, 0, 2, 1)
        );
        // The failed key's slot is free again and handed out next.
        let again = p.prepare_store(&ks(&[2])).unwrap();
        assert_eq!(again.slots, vec![plan.slots[1]]);
        // Completing a ready key again is a no-op (no second event).
        p.complete_store(&ks(&[1]), true).unwrap();
        p.complete_store(&ks(&[1]), false).unwrap();
        assert_eq!(p.state(Key(1)), KeyState::Ready { pins: 0 });
        assert!(p.take_events().is_empty());
    }
}

#[test]
fn complete_store_of_an_unknown_key_changes_nothing() {
    for policy in POLICIES {
        let mut p = pool(4, policy);
        p.prepare_store(&ks(&[1, 2])).unwrap();
        let before = observe(&p, &[1, 2, 3]);
        let err = p.complete_store(&ks(&[1, 3, 2]), true).unwrap_err();
        assert_eq!(err, Error::UnknownKey(Key(3)));
        assert!(err.to_string().contains("0x3"), "{err}");
        assert_eq!(observe(&p, &[1, 2, 3]), before);
        assert!(p.take_events().is_empty());
        let err = p.complete_store(&ks(&[1, 3]), false).unwrap_err();
        assert_eq!(err, Error::UnknownKey(Key(3)));
        assert_eq!(observe(&p, &[1, 2, 3]), before);
    }
}

#[test]
fn a_failed_store_listed_twice_is_dropped_once() {
    let mut p = pool(4, PolicyKind::Lru);
    p.prepare_store(&ks(&[1])).unwrap();
    p.complete_store(&ks(&[1, 1]), false).unwrap();
    assert_eq!(p.stats().failed_stores, 1);
    p.check_consistency().unwrap();
}

#[test]
fn prepare_load_is_all_or_nothing() {
    for policy in POLICIES {
        let mut p = pool(4, policy);
        fill(&mut p, &[1, 2]);
        p.prepare_store(&ks(&[3])).unwrap();
        let before = observe(&p, &[1, 2, 3, 4]);
        let err = p.prepare_load(&ks(&[1, 4])).unwrap_err();
        assert_eq!(err, Error::UnknownKey(Key(4)));
        let err = p.prepare_load(&ks(&[2, 3])).unwrap_err();
        assert_eq!(err, Error::KeyNotReady(Key(3)));
        assert!(err.to_string().contains("0x3"), "{err}");
        assert_eq!(observe(&p, &[1, 2, 3, 4]), before);
        let slots = p.prepare_load(&ks(&[2, 1, 2])).unwrap();
        assert_eq!(
            slots,
            vec![p.slot(Key(2)).unwrap(), p.slot(Key(1)).unwrap(), slots[0]]
        );
        assert_eq!(p.state(Key(2)), KeyState::Ready { pins: 2 });
        let s = p.stats();
        assert_eq!((s.pinned, s.loads), (2, 3));
    }
}

#[test]
fn complete_load_unpins_and_rejects_unpinned_keys() {
    for policy in POLICIES {
        let mut p = pool(4, policy);
        fill(&mut p, &[1, 2]);
        p.prepare_store(&ks(&[3])).unwrap();
        p.prepare_load(&ks(&[1, 1, 2])).unwrap();
        let before = observe(&p, &[1, 2, 3, 4]);
        // 2 is pinned once: the second occurrence fails, and the first is rolled back.
        let err = p.complete_load(&ks(&[1, 2, 2])).unwrap_err();
        assert_eq!(err, Error::KeyNotPinned(Key(2)));
        assert_eq!(observe(&p, &[1, 2, 3, 4]), before);
        assert_eq!(
            p.complete_load(&ks(&[3])).unwrap_err(),
            Error::KeyNotPinned(Key(3))
        );
        assert_eq!(
            p.complete_load(&ks(&[4])).unwrap_err(),
            Error::UnknownKey(Key(4))
        );
        assert_eq!(observe(&p, &[1, 2, 3, 4]), before);
        p.complete_load(&ks(&[1, 2])).unwrap();
        assert_eq!(p.state(Key(1)), KeyState::Ready { pins: 1 });
        assert_eq!(p.stats().pinned, 1);
        p.complete_load(&ks(&[1])).unwrap();
        assert_eq!(p.stats().pinned, 0);
        assert_eq!(
            p.complete_load(&ks(&[1])).unwrap_err(),
            Error::KeyNotPinned(Key(1))
        );
    }
}

#[test]
fn touch_walks_last_to_first_so_prefixes_outlive_suffixes() {
    let mut p = pool(4, PolicyKind::Lru);
    fill(&mut p, &[1, 2, 3, 4]);
    assert_eq!(order_of(&p, "lru"), vec![1, 2, 3, 4]);
    p.touch(&ks(&[1, 2, 3]));
    assert_eq!(order_of(&p, "lru"), vec![4, 3, 2, 1]);
    // The victims of a full-pool store are the suffix chunks, last chunk first.
    assert_eq!(p.prepare_store(&ks(&[5, 6])).unwrap().evicted, ks(&[4, 3]));
    // Loads do not update recency; touching an absent key does nothing under LRU.
    p.prepare_load(&ks(&[2])).unwrap();
    p.touch(&ks(&[99]));
    assert_eq!(order_of(&p, "lru"), vec![2, 1, 5, 6]);
}

#[test]
fn slots_of_one_call_are_contiguous_when_possible() {
    for policy in POLICIES {
        let mut p = pool(16, policy);
        let first = fill(&mut p, &[1, 2, 3, 4]);
        let second = fill(&mut p, &[5, 6, 7, 8, 9, 10]);
        assert_eq!(first.slots, (0..4).map(SlotId).collect::<Vec<_>>());
        assert_eq!(second.slots, (4..10).map(SlotId).collect::<Vec<_>>());
        // Fail some stores to leave free runs 10..12 (2 slots) and 13..16 (3 slots).
        let third = p.prepare_store(&ks(&[11, 12, 13, 14, 15, 16])).unwrap();
        assert_eq!(third.slots, (10..16).map(SlotId).collect::<Vec<_>>());
        p.complete_store(&ks(&[11, 12, 14, 15, 16]), false).unwrap();
        p.complete_store(&ks(&[13]), true).unwrap();
        // Best fit: a 2-key store takes the 2-slot run, not the start of the 3-slot one.
        let pair = p.prepare_store(&ks(&[20, 21])).unwrap();
        assert_eq!(pair.slots, vec![SlotId(10), SlotId(11)]);
        let triple = p.prepare_store(&ks(&[22, 23, 24])).unwrap();
        assert_eq!(triple.slots, vec![SlotId(13), SlotId(14), SlotId(15)]);
        let s = p.stats();
        assert_eq!((s.allocations, s.allocated_slots), (5, 21));
        assert_eq!((s.allocated_runs, s.contiguous_allocations), (5, 5));
    }
}

#[test]
fn a_fragmented_pool_uses_the_largest_runs_first() {
    let mut p = pool(10, PolicyKind::Lru);
    let all: Vec<u128> = (0..10).collect();
    assert_eq!(p.prepare_store(&ks(&all)).unwrap().slots.len(), 10); // key i in slot i
    p.complete_store(&ks(&[1, 3, 4, 5, 7]), false).unwrap(); // free: {1}, {3, 4, 5}, {7}
    p.complete_store(&ks(&[0, 2, 6, 8, 9]), true).unwrap();
    let plan = p.prepare_store(&ks(&[10, 11, 12, 13, 14])).unwrap();
    assert!(plan.evicted.is_empty());
    // No run holds 5: the 3-slot run first, then the single slots.
    assert_eq!(&plan.slots[..3], &[SlotId(3), SlotId(4), SlotId(5)]);
    let mut rest = plan.slots[3..].to_vec();
    rest.sort();
    assert_eq!(rest, vec![SlotId(1), SlotId(7)]);
    let s = p.stats();
    assert_eq!(
        (s.allocations, s.allocated_slots, s.allocated_runs),
        (2, 15, 4)
    );
    assert_eq!(s.contiguous_allocations, 1);
    assert!((s.slots_per_run() - 15.0 / 4.0).abs() < 1e-9);
}

#[test]
fn a_full_pool_reuses_the_victims_slots_in_order() {
    let mut p = pool(8, PolicyKind::Lru);
    fill(&mut p, &[0, 1, 2, 3, 4, 5, 6, 7]); // key i in slot i
    p.prepare_load(&ks(&[0, 2, 6])).unwrap(); // pinned: slots 0, 2, 6 stay
    p.touch(&ks(&[7, 5])); // LRU order: 0 1 2 3 4 6 5 7
    let plan = p.prepare_store(&ks(&[10, 11, 12, 13, 14])).unwrap();
    assert_eq!(plan.evicted, ks(&[1, 3, 4, 5, 7]));
    // Sorted victim slots: runs {1}, {3, 4, 5}, {7}, in slot order for the keys in order.
    let want: Vec<SlotId> = [1, 3, 4, 5, 7].into_iter().map(SlotId).collect();
    assert_eq!(plan.slots, want);
    let s = p.stats();
    assert_eq!(
        (s.allocations, s.allocated_slots, s.allocated_runs),
        (2, 13, 4)
    );
    p.check_consistency().unwrap();
}

#[test]
fn admission_filter_stores_after_enough_lookups() {
    for policy in POLICIES {
        let mut p = Pool::new(PoolConfig {
            capacity: 4,
            policy,
            store_threshold: 2,
        })
        .unwrap();
        let plan = p.prepare_store(&ks(&[1, 2])).unwrap();
        assert!(plan.keys.is_empty());
        assert_eq!(plan.filtered, ks(&[1, 2]));
        p.lookup(&ks(&[1, 2]));
        p.lookup(&ks(&[1]));
        let plan = p.prepare_store(&ks(&[1, 2])).unwrap();
        assert_eq!(plan.keys, ks(&[1]));
        assert_eq!(plan.filtered, ks(&[2]));
        assert_eq!(p.stats().filtered, 3);
        // Present keys are not counted: storing 1 does not feed its count.
        p.lookup(&ks(&[1, 1, 1]));
        assert_eq!(p.stats().admission_tracked, 2);
    }
}

#[test]
fn admission_tracker_is_bounded() {
    let mut p = Pool::new(PoolConfig {
        capacity: 4,
        policy: PolicyKind::Lru,
        store_threshold: 3,
    })
    .unwrap();
    let keys: Vec<u128> = (0..10_000).collect();
    p.lookup(&ks(&keys));
    let tracked = p.stats().admission_tracked;
    assert!(tracked <= 2048, "{tracked}");
    // Recent keys are still counted.
    p.lookup(&ks(&[9_999]));
    p.lookup(&ks(&[9_999]));
    assert_eq!(p.prepare_store(&ks(&[9_999])).unwrap().keys, ks(&[9_999]));
    // A threshold of 1 is no filter at all.
    let mut q = Pool::new(PoolConfig {
        capacity: 4,
        policy: PolicyKind::Lru,
        store_threshold: 1,
    })
    .unwrap();
    assert_eq!(q.prepare_store(&ks(&[5])).unwrap().keys, ks(&[5]));
}

#[test]
fn events_say_cpu_and_drain() {
    let mut p = pool(1, PolicyKind::Lru);
    fill(&mut p, &[1]);
    fill(&mut p, &[2]);
    let events = p.take_events();
    assert_eq!(events, vec![stored(&[1]), removed(&[1]), stored(&[2])]);
    assert!(events.iter().all(|e| e.medium() == "cpu"));
    assert_eq!(MEDIUM, "cpu");
    assert!(p.take_events().is_empty());
}

#[test]
fn reset_empties_everything() {
    for policy in POLICIES {
        let mut p = pool(4, policy);
        fill(&mut p, &[1, 2, 3]);
        p.prepare_store(&ks(&[4])).unwrap();
        p.prepare_load(&ks(&[2])).unwrap();
        p.touch(&ks(&[1])); // ARC: 1 moves to T2
        let _ = p.take_events();
        p.reset();
        let mut ready: Vec<u128> = p.take_events()[0].keys.iter().map(|k| k.0).collect();
        ready.sort_unstable();
        assert_eq!(ready, vec![1, 2, 3]); // 4 was never announced
        for k in 1..=4 {
            assert_eq!(p.state(Key(k)), KeyState::Absent);
        }
        let s = p.stats();
        assert_eq!(
            (s.used, s.free, s.storing, s.pinned, s.resets),
            (0, 4, 0, 0, 1)
        );
        assert_eq!(s.stores, 3); // counters are cumulative
        assert_eq!(s.ghosts, 0);
        assert!(p.complete_load(&ks(&[2])).is_err());
        assert_eq!(
            fill(&mut p, &[5, 6, 7, 8]).slots,
            (0..4).map(SlotId).collect::<Vec<_>>()
        );
        p.check_consistency().unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// ARC.

#[test]
fn arc_touch_promotes_ready_t1_entries_only() {
    let mut p = pool(4, PolicyKind::Arc);
    fill(&mut p, &[1, 2]);
    p.prepare_store(&ks(&[3])).unwrap();
    p.touch(&ks(&[1, 3]));
    assert_eq!(order_of(&p, "t1"), vec![2, 3]);
    assert_eq!(order_of(&p, "t2"), vec![1]);
    p.complete_store(&ks(&[3]), true).unwrap();
    p.touch(&ks(&[3]));
    assert_eq!(order_of(&p, "t2"), vec![1, 3]);
    p.touch(&ks(&[1]));
    assert_eq!(order_of(&p, "t2"), vec![3, 1]);
}

#[test]
fn arc_victims_go_to_the_ghost_list_of_the_list_they_left() {
    let mut p = pool(4, PolicyKind::Arc);
    fill(&mut p, &[1, 2, 3, 4]);
    p.touch(&ks(&[3, 4])); // T1 = [1, 2], T2 = [4, 3]
                           // target 0 < |T1|: T1 first.
    assert_eq!(p.prepare_store(&ks(&[5])).unwrap().evicted, ks(&[1]));
    assert_eq!(order_of(&p, "b1"), vec![1]);
    // T1 = [2, 5(storing)]: 2 goes, then 5 is not evictable so T2 gives 4.
    assert_eq!(p.prepare_store(&ks(&[6, 7])).unwrap().evicted, ks(&[2, 4]));
    assert_eq!(order_of(&p, "b2"), vec![4]);
    // B1 got 1 and 2, but 6 and 7 entered T1 and |T1| + |B1| <= c drops the older ghost.
    assert_eq!(order_of(&p, "t1"), vec![5, 6, 7]);
    assert_eq!(order_of(&p, "b1"), vec![2]);
}

#[test]
fn arc_ghost_hits_adapt_the_target() {
    let mut p = pool(4, PolicyKind::Arc);
    fill(&mut p, &[1, 2, 3, 4]);
    p.touch(&ks(&[3, 4])); // T1 = [1, 2], T2 = [4, 3]
    fill(&mut p, &[5]); // evicts 1 -> B1
    fill(&mut p, &[6]); // evicts 2 -> B1; T1 = [5, 6]
    p.touch(&ks(&[5, 6])); // T1 = [], T2 = [4, 3, 6, 5]
    fill(&mut p, &[7]); // evicts 4 from T2 (T1 empty) -> B2
    assert_eq!(order_of(&p, "b1"), vec![1, 2]);
    assert_eq!(order_of(&p, "b2"), vec![4]);
    assert_eq!(p.stats().target, Some(0));
    // B1 hit: target += max(|B2| / |B1|, 1) = 1.
    p.touch(&ks(&[1]));
    assert_eq!(p.stats().target, Some(1));
    assert_eq!(order_of(&p, "b1"), vec![2, 1]);
    // B2 hit: target -= max(|B1| / |B2|, 1) = 2, floored at 0.
    p.touch(&ks(&[4]));
    assert_eq!(p.stats().target, Some(0));
    // A B1 ghost that is stored again enters T2 and leaves B1; T1's 7 makes room.
    let plan = p.prepare_store(&ks(&[1])).unwrap();
    assert_eq!(plan.keys, ks(&[1]));
    assert_eq!(plan.evicted, ks(&[7]));
    assert_eq!(order_of(&p, "t2"), vec![3, 6, 5, 1]);
    assert_eq!(order_of(&p, "b1"), vec![2, 7]);
    p.complete_store(&ks(&[1]), true).unwrap();
    // Target 0 and T1 empty: T2 gives its least recent entry.
    assert_eq!(fill(&mut p, &[9]).evicted, ks(&[3])); // T1 = [9]
                                                      // Raise the target to the capacity: T1 (|T1| = 1 <= 4) is kept and T2 gives 6, although
                                                      // with target 0 the T1 entry 9 would go first.
    for _ in 0..4 {
        p.touch(&ks(&[2]));
    }
    assert_eq!(p.stats().target, Some(4));
    assert_eq!(fill(&mut p, &[10]).evicted, ks(&[6]));
}

#[test]
fn arc_replaces_from_t2_when_t1_is_at_its_target() {
    let mut p = pool(2, PolicyKind::Arc);
    fill(&mut p, &[1, 2]);
    fill(&mut p, &[3]); // evicts 1 -> B1 (then trimmed: |T1| + |B1| <= 2)
    p.touch(&ks(&[2])); // T1 = [3], T2 = [2]
    fill(&mut p, &[4]); // |T1| = 1 > 0: evicts 3 -> B1; T1 = [4], T2 = [2], B1 = [3]
    assert_eq!(order_of(&p, "b1"), vec![3]);
    p.touch(&ks(&[3])); // B1 hit: target 1
    assert_eq!(p.stats().target, Some(1));
    // |T1| = 1 == target: T2 gives its entry although T1's 4 is older.
    assert_eq!(fill(&mut p, &[5]).evicted, ks(&[2]));
}

#[test]
fn arc_ghost_lists_never_exceed_capacity() {
    let mut p = pool(3, PolicyKind::Arc);
    for k in 0..50u128 {
        fill(&mut p, &[k]);
        if k % 3 == 0 {
            p.touch(&ks(&[k]));
        }
        let o = p.order();
        let b1 = o.ghosts[0].1.len();
        let b2 = o.ghosts[1].1.len();
        let t1 = o.resident[0].1.len();
        let t2 = o.resident[1].1.len();
        assert!(b1 <= 3 && b2 <= 3, "b1 {b1} b2 {b2}");
        assert!(t1 + b1 <= 3);
        assert!(t1 + t2 + b1 + b2 <= 6);
        p.check_consistency().unwrap();
    }
    assert!(p.stats().ghosts > 0);
}

#[test]
fn arc_failed_store_leaves_the_victim_in_its_ghost_list() {
    let mut p = pool(4, PolicyKind::Arc);
    fill(&mut p, &[1, 2, 3, 4]);
    p.touch(&ks(&[3, 4])); // T1 = [1, 2], T2 = [4, 3]
    let plan = p.prepare_store(&ks(&[5])).unwrap();
    assert_eq!(plan.evicted, ks(&[1]));
    p.complete_store(&ks(&[5]), false).unwrap();
    assert_eq!(order_of(&p, "b1"), vec![1]);
    assert_eq!(order_of(&p, "t1"), vec![2]);
    // The failed key left no trace, and the victim stays evicted.
    assert_eq!(p.stats().ghosts, 1);
    assert_eq!(p.state(Key(1)), KeyState::Absent);
    assert_eq!(p.state(Key(5)), KeyState::Absent);
    // Same for a victim that left T2.
    p.touch(&ks(&[2])); // T1 = [], T2 = [4, 3, 2]
    fill(&mut p, &[6]); // free slot, no eviction
    p.touch(&ks(&[6])); // T2 = [4, 3, 2, 6]
    assert_eq!(p.prepare_store(&ks(&[7])).unwrap().evicted, ks(&[4]));
    p.complete_store(&ks(&[7]), false).unwrap();
    assert_eq!(order_of(&p, "b2"), vec![4]);
    p.check_consistency().unwrap();
}

#[test]
fn arc_never_evicts_a_key_of_the_same_call() {
    let mut p = pool(3, PolicyKind::Arc);
    fill(&mut p, &[1, 2, 3]);
    p.touch(&ks(&[2])); // T1 = [1, 3], T2 = [2]
                        // 1 and 3 are in the call: only 2 (T2) may go, though T1 is preferred.
    let plan = p.prepare_store(&ks(&[1, 4, 3])).unwrap();
    assert_eq!(plan.evicted, ks(&[2]));
    assert_eq!(order_of(&p, "b2"), vec![2]);
    assert!(p.prepare_store(&ks(&[1, 3, 5, 6])).is_none());
}

// ---------------------------------------------------------------------------------------------
// Property test against a naive model of each policy.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MState {
    Storing,
    Ready(u32),
}

/// A slow, obviously-correct model: `Vec`s in recency order (least recent first).
#[derive(Clone, Debug)]
struct Model {
    cap: usize,
    arc: bool,
    threshold: u32,
    states: HashMap<u128, MState>,
    /// LRU: the one list. ARC: T1.
    t1: Vec<u128>,
    t2: Vec<u128>,
    b1: Vec<u128>,
    b2: Vec<u128>,
    p: usize,
    counts: HashMap<u128, u32>,
    /// Events; the flag marks a reset's `removed` event, whose order is by slot.
    events: Vec<(PoolEventKind, Vec<u128>, bool)>,
    hits: u64,
    misses: u64,
    evictions: u64,
    stores: u64,
    failed: u64,
    loads: u64,
    no_room: u64,
    filtered: u64,
}

fn without(v: &mut Vec<u128>, k: u128) -> bool {
    match v.iter().position(|&x| x == k) {
        Some(i) => {
            v.remove(i);
            true
        }
        None => false,
    }
}

impl Model {
    fn new(cap: usize, arc: bool, threshold: u32) -> Self {
        Self {
            cap,
            arc,
            threshold,
            states: HashMap::new(),
            t1: vec![],
            t2: vec![],
            b1: vec![],
            b2: vec![],
            p: 0,
            counts: HashMap::new(),
            events: vec![],
            hits: 0,
            misses: 0,
            evictions: 0,
            stores: 0,
            failed: 0,
            loads: 0,
            no_room: 0,
            filtered: 0,
        }
    }

    fn state(&self, k: u128) -> KeyState {
        match self.states.get(&k) {
            None => KeyState::Absent,
            Some(MState::Storing) => KeyState::Storing,
            Some(&MState::Ready(pins)) => KeyState::Ready { pins },
        }
    }

    fn lookup(&mut self, keys: &[u128]) -> (usize, Vec<KeyState>) {
        let states: Vec<KeyState> = keys.iter().map(|&k| self.state(k)).collect();
        let prefix = states
            .iter()
            .take_while(|s| matches!(s, KeyState::Ready { .. }))
            .count();
        if self.threshold > 1 {
            for (&k, s) in keys.iter().zip(&states) {
                if *s == KeyState::Absent {
                    *self.counts.entry(k).or_default() += 1;
                }
            }
        }
        self.hits += prefix as u64;
        self.misses += (keys.len() - prefix) as u64;
        (prefix, states)
    }

    fn trim(&mut self) {
        let c = self.cap;
        while self.t1.len() + self.b1.len() > c && !self.b1.is_empty() {
            self.b1.remove(0);
        }
        while self.b2.len() > c {
            self.b2.remove(0);
        }
        while self.t1.len() + self.t2.len() + self.b1.len() + self.b2.len() > 2 * c {
            if self.b2.is_empty() {
                self.b1.remove(0);
            } else {
                self.b2.remove(0);
            }
        }
    }

    fn choose(&self, n: usize, call: &[u128]) -> Option<Vec<u128>> {
        let ok = |k: &u128, chosen: &[u128]| {
            self.states[k] == MState::Ready(0) && !call.contains(k) && !chosen.contains(k)
        };
        let mut chosen = vec![];
        let mut t1_len = self.t1.len();
        while chosen.len() < n {
            if !self.arc {
                chosen.push(*self.t1.iter().find(|k| ok(k, &chosen))?);
                continue;
            }
            let in_t1 = self.t1.iter().find(|k| ok(k, &chosen)).copied();
            let in_t2 = self.t2.iter().find(|k| ok(k, &chosen)).copied();
            let (k, from_t1) = if t1_len > self.p {
                in_t1.map(|k| (k, true)).or(in_t2.map(|k| (k, false)))?
            } else {
                in_t2.map(|k| (k, false)).or(in_t1.map(|k| (k, true)))?
            };
            if from_t1 {
                t1_len -= 1;
            }
            chosen.push(k);
        }
        Some(chosen)
    }

    fn prepare_store(&mut self, keys: &[u128]) -> Option<(Vec<u128>, Vec<u128>, Vec<u128>)> {
        let (mut new, mut filtered) = (vec![], vec![]);
        for &k in keys {
            if self.states.contains_key(&k) || new.contains(&k) || filtered.contains(&k) {
                continue;
            }
            if self.threshold > 1 && self.counts.get(&k).copied().unwrap_or(0) < self.threshold {
                filtered.push(k);
            } else {
                new.push(k);
            }
        }
        let free = self.cap - self.states.len();
        let Some(victims) = self.choose(new.len().saturating_sub(free), keys) else {
            self.no_room += 1;
            return None;
        };
        for &v in &victims {
            self.states.remove(&v);
            if without(&mut self.t1, v) {
                if self.arc {
                    self.b1.push(v);
                }
            } else {
                assert!(without(&mut self.t2, v));
                self.b2.push(v);
            }
            if self.arc {
                self.trim();
            }
        }
        if !victims.is_empty() {
            self.evictions += victims.len() as u64;
            self.events
                .push((PoolEventKind::Removed, victims.clone(), true));
        }
        for &k in &new {
            self.states.insert(k, MState::Storing);
            if self.arc && (without(&mut self.b1, k) || without(&mut self.b2, k)) {
                self.t2.push(k);
            } else {
                self.t1.push(k);
            }
            if self.arc {
                self.trim();
            }
        }
        self.filtered += filtered.len() as u64;
        Some((new, victims, filtered))
    }

    fn complete_store(&mut self, keys: &[u128], ok: bool) -> Result<(), Error> {
        if let Some(&k) = keys.iter().find(|k| !self.states.contains_key(k)) {
            return Err(Error::UnknownKey(Key(k)));
        }
        let mut stored = vec![];
        for &k in keys {
            if self.states.get(&k) != Some(&MState::Storing) {
                continue;
            }
            if ok {
                self.states.insert(k, MState::Ready(0));
                stored.push(k);
            } else {
                self.states.remove(&k);
                let _ = without(&mut self.t1, k) || without(&mut self.t2, k);
                self.failed += 1;
            }
        }
        if !stored.is_empty() {
            self.stores += stored.len() as u64;
            self.events.push((PoolEventKind::Stored, stored, true));
        }
        Ok(())
    }

    fn prepare_load(&mut self, keys: &[u128]) -> Result<(), Error> {
        for &k in keys {
            match self.states.get(&k) {
                None => return Err(Error::UnknownKey(Key(k))),
                Some(MState::Storing) => return Err(Error::KeyNotReady(Key(k))),
                Some(MState::Ready(_)) => {}
            }
        }
        for &k in keys {
            if let Some(MState::Ready(p)) = self.states.get_mut(&k) {
                *p += 1;
            }
        }
        self.loads += keys.len() as u64;
        Ok(())
    }

    fn complete_load(&mut self, keys: &[u128]) -> Result<(), Error> {
        let mut states = self.states.clone();
        for &k in keys {
            match states.get_mut(&k) {
                None => return Err(Error::UnknownKey(Key(k))),
                Some(MState::Ready(p)) if *p > 0 => *p -= 1,
                Some(_) => return Err(Error::KeyNotPinned(Key(k))),
            }
        }
        self.states = states;
        Ok(())
    }

    fn touch(&mut self, keys: &[u128]) {
        for &k in keys.iter().rev() {
            if !self.arc {
                if without(&mut self.t1, k) {
                    self.t1.push(k);
                }
            } else if without(&mut self.t1, k) {
                if self.states[&k] == MState::Storing {
                    self.t1.push(k);
                } else {
                    self.t2.push(k);
                }
            } else if without(&mut self.t2, k) {
                self.t2.push(k);
            } else if without(&mut self.b1, k) {
                self.b1.push(k);
                let step = (self.b2.len() / self.b1.len()).max(1);
                self.p = (self.p + step).min(self.cap);
            } else if without(&mut self.b2, k) {
                self.b2.push(k);
                let step = (self.b1.len() / self.b2.len()).max(1);
                self.p = self.p.saturating_sub(step);
            }
        }
    }

    /// Recency only: present keys move to the back of the list they are in, last key first.
    fn refresh(&mut self, keys: &[u128]) {
        for &k in keys.iter().rev() {
            if without(&mut self.t1, k) {
                self.t1.push(k);
            } else if without(&mut self.t2, k) {
                self.t2.push(k);
            }
        }
    }

    fn reset(&mut self) {
        let mut ready: Vec<u128> = self
            .states
            .iter()
            .filter(|(_, s)| matches!(s, MState::Ready(_)))
            .map(|(&k, _)| k)
            .collect();
        if !ready.is_empty() {
            ready.sort_unstable();
            self.events.push((PoolEventKind::Removed, ready, false));
        }
        let cap = self.cap;
        let (arc, threshold) = (self.arc, self.threshold);
        let keep = std::mem::take(&mut self.events);
        let counters = (
            self.hits,
            self.misses,
            self.evictions,
            self.stores,
            self.failed,
            self.loads,
            self.no_room,
            self.filtered,
        );
        *self = Model::new(cap, arc, threshold);
        self.events = keep;
        (
            self.hits,
            self.misses,
            self.evictions,
            self.stores,
            self.failed,
            self.loads,
            self.no_room,
            self.filtered,
        ) = counters;
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// `lookup_slots` (stopping at the first absent key or not).
    Lookup(Vec<u128>, bool),
    Store(Vec<u128>),
    Complete(Vec<u128>, bool, Vec<u32>),
    /// `prepare_load_hinted` with arbitrary slot hints.
    Load(Vec<u128>, Vec<u32>),
    Unload(Vec<u128>, Vec<u32>),
    /// `touch_hinted` with arbitrary slot hints.
    Touch(Vec<u128>, Vec<u32>),
    /// `refresh_hinted` with arbitrary slot hints (right, stale, out of range or none).
    Refresh(Vec<u128>, Vec<u32>),
    /// What a scheduler does on admission: look up, touch, store the rest, complete.
    Access(Vec<u128>),
    Reset,
}

const UNIVERSE: u128 = 10;

fn op() -> impl Strategy<Value = Op> {
    let keys = || prop::collection::vec(0..UNIVERSE, 0..5);
    // Slot hints: right, stale, out of range or none (the pool must check them).
    let hints = || prop::collection::vec(prop_oneof![0u32..8, Just(u32::MAX)], 0..6);
    prop_oneof![
        3 => (keys(), any::<bool>()).prop_map(|(k, stop)| Op::Lookup(k, stop)),
        4 => keys().prop_map(Op::Store),
        4 => (keys(), prop::bool::weighted(0.8), hints())
            .prop_map(|(k, ok, h)| Op::Complete(k, ok, h)),
        2 => (keys(), hints()).prop_map(|(k, h)| Op::Load(k, h)),
        2 => (keys(), hints()).prop_map(|(k, h)| Op::Unload(k, h)),
        3 => (keys(), hints()).prop_map(|(k, h)| Op::Touch(k, h)),
        3 => (keys(), hints()).prop_map(|(k, h)| Op::Refresh(k, h)),
        4 => keys().prop_map(Op::Access),
        1 => Just(Op::Reset),
    ]
}

fn check_against_model(p: &Pool, m: &Model) -> Result<(), TestCaseError> {
    p.check_consistency().map_err(TestCaseError::fail)?;
    let s = p.stats();
    prop_assert_eq!(s.used + s.free, s.capacity);
    prop_assert_eq!(s.used as usize, m.states.len());
    let mut slots = HashSet::new();
    for k in 0..UNIVERSE {
        prop_assert_eq!(p.state(Key(k)), m.state(k), "key {}", k);
        if let Some(slot) = p.slot(Key(k)) {
            prop_assert!(slot.0 < s.capacity);
            prop_assert!(slots.insert(slot), "slot {} given twice", slot);
        }
    }
    let storing = m.states.values().filter(|s| **s == MState::Storing).count();
    let pinned = m
        .states
        .values()
        .filter(|s| matches!(s, MState::Ready(p) if *p > 0))
        .count();
    prop_assert_eq!((s.storing as usize, s.pinned as usize), (storing, pinned));
    prop_assert_eq!(
        (s.hits, s.misses, s.evictions, s.stores, s.failed_stores),
        (m.hits, m.misses, m.evictions, m.stores, m.failed)
    );
    prop_assert_eq!(
        (s.loads, s.no_room, s.filtered),
        (m.loads, m.no_room, m.filtered)
    );
    let order = p.order();
    let keys = |v: &[Key]| v.iter().map(|k| k.0).collect::<Vec<_>>();
    if m.arc {
        prop_assert_eq!(keys(&order.resident[0].1), m.t1.clone());
        prop_assert_eq!(keys(&order.resident[1].1), m.t2.clone());
        prop_assert_eq!(keys(&order.ghosts[0].1), m.b1.clone());
        prop_assert_eq!(keys(&order.ghosts[1].1), m.b2.clone());
        prop_assert_eq!(order.target, Some(m.p as u32));
        prop_assert!(m.b1.len() <= m.cap && m.b2.len() <= m.cap);
        prop_assert!(m.t1.len() + m.b1.len() <= m.cap);
        prop_assert!(m.t1.len() + m.t2.len() + m.b1.len() + m.b2.len() <= 2 * m.cap);
        prop_assert_eq!(s.ghosts as usize, m.b1.len() + m.b2.len());
    } else {
        prop_assert_eq!(keys(&order.resident[0].1), m.t1.clone());
        prop_assert_eq!(s.ghosts, 0);
    }
    Ok(())
}

fn run_ops(cap: u32, policy: PolicyKind, threshold: u32, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut p = Pool::new(PoolConfig {
        capacity: cap,
        policy,
        store_threshold: threshold,
    })
    .unwrap();
    let mut m = Model::new(cap as usize, policy == PolicyKind::Arc, threshold);
    for op in ops {
        let before = m.clone();
        match op {
            Op::Lookup(k, stop) => {
                let (mut states, mut slots) = (vec![], vec![]);
                let prefix = p.lookup_slots(&ks(k), &mut states, &mut slots, *stop);
                let (want_prefix, mut want) = m.lookup(k);
                // Stopping at the first absent key (unless the admission filter needs them
                // all) reports the states up to it, counters unchanged.
                if *stop && threshold <= 1 {
                    if let Some(a) = want.iter().position(|s| *s == KeyState::Absent) {
                        want.truncate(a + 1);
                    }
                }
                prop_assert_eq!((prefix, &states), (want_prefix, &want));
                prop_assert_eq!(slots.len(), states.len());
                for (key, slot) in k.iter().zip(&slots) {
                    prop_assert_eq!(*slot, p.slot(Key(*key)).unwrap_or(SlotId::NONE));
                }
            }
            Op::Store(k) => {
                let got = p.prepare_store(&ks(k));
                let want = m.prepare_store(k);
                match (got, want) {
                    (None, None) => {}
                    (Some(plan), Some((keys, evicted, filtered))) => {
                        prop_assert_eq!(plan.keys, ks(&keys));
                        prop_assert_eq!(plan.evicted.clone(), ks(&evicted));
                        prop_assert_eq!(plan.filtered, ks(&filtered));
                        prop_assert_eq!(plan.slots.len(), keys.len());
                        // Never a pinned, storing or same-call key.
                        for v in &evicted {
                            prop_assert_eq!(before.states[v], MState::Ready(0));
                            prop_assert!(!k.contains(v));
                        }
                    }
                    (got, want) => prop_assert!(false, "pool {:?} model {:?}", got, want),
                }
            }
            Op::Complete(k, ok, hints) => {
                let hints: Vec<SlotId> = hints.iter().copied().map(SlotId).collect();
                let got = p.complete_store_hinted(&ks(k), *ok, &hints);
                prop_assert_eq!(got, m.complete_store(k, *ok));
            }
            Op::Load(k, hints) => {
                let hints: Vec<SlotId> = hints.iter().copied().map(SlotId).collect();
                let got = p.prepare_load_hinted(&ks(k), &hints);
                prop_assert_eq!(
                    got.as_ref().map(Vec::len).map_err(Clone::clone),
                    m.prepare_load(k).map(|()| k.len())
                );
                if let Ok(slots) = got {
                    for (key, slot) in k.iter().zip(&slots) {
                        prop_assert_eq!(Some(*slot), p.slot(Key(*key)));
                    }
                }
            }
            Op::Unload(k, hints) => {
                let hints: Vec<SlotId> = hints.iter().copied().map(SlotId).collect();
                prop_assert_eq!(p.complete_load_hinted(&ks(k), &hints), m.complete_load(k));
            }
            Op::Touch(k, hints) => {
                let hints: Vec<SlotId> = hints.iter().copied().map(SlotId).collect();
                p.touch_hinted(&ks(k), &hints);
                m.touch(k);
            }
            Op::Refresh(k, hints) => {
                let hints: Vec<SlotId> = hints.iter().copied().map(SlotId).collect();
                p.refresh_hinted(&ks(k), &hints);
                m.refresh(k);
            }
            Op::Access(k) => {
                let mut states = vec![];
                let prefix = p.lookup_states(&ks(k), &mut states);
                prop_assert_eq!((prefix, states), m.lookup(k));
                p.touch(&ks(k));
                m.touch(k);
                let got = p.prepare_store(&ks(k)).map(|plan| plan.keys);
                let want = m.prepare_store(k).map(|(keys, _, _)| ks(&keys));
                prop_assert_eq!(&got, &want);
                if let Some(keys) = got {
                    let ids: Vec<u128> = keys.iter().map(|k| k.0).collect();
                    prop_assert_eq!(p.complete_store(&keys, true), m.complete_store(&ids, true));
                }
            }
            Op::Reset => {
                p.reset();
                m.reset();
            }
        }
        // Events: equal to the model's, and consistent with the states after the op.
        let got = p.take_events();
        let want = std::mem::take(&mut m.events);
        prop_assert_eq!(got.len(), want.len(), "events {:?} vs {:?}", got, want);
        for (e, (kind, keys, ordered)) in got.iter().zip(&want) {
            prop_assert_eq!(e.kind, *kind);
            prop_assert_eq!(e.medium(), "cpu");
            let mut ids: Vec<u128> = e.keys.iter().map(|k| k.0).collect();
            if !ordered {
                ids.sort_unstable();
            }
            prop_assert_eq!(&ids, keys);
            for &k in keys {
                if *kind == PoolEventKind::Stored {
                    let ready = matches!(p.state(Key(k)), KeyState::Ready { .. });
                    prop_assert!(ready, "stored key {} is not ready", k);
                } else {
                    prop_assert_eq!(p.state(Key(k)), KeyState::Absent);
                    let was_ready = matches!(before.states.get(&k), Some(MState::Ready(_)));
                    prop_assert!(was_ready, "removed key {} was not ready", k);
                }
            }
        }
        check_against_model(&p, &m)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn lru_matches_model(cap in 1u32..7, threshold in prop_oneof![Just(0u32), Just(2)],
                         ops in prop::collection::vec(op(), 1..80)) {
        run_ops(cap, PolicyKind::Lru, threshold, &ops)?;
    }

    #[test]
    fn arc_matches_model(cap in 1u32..7, threshold in prop_oneof![Just(0u32), Just(2)],
                         ops in prop::collection::vec(op(), 1..80)) {
        run_ops(cap, PolicyKind::Arc, threshold, &ops)?;
    }
}

/// `refresh` is recency only: present keys move to most recent, the earliest last, absent keys
/// are skipped, and ARC keeps every entry in its list (no promotion, no target change).
#[test]
fn refresh_is_recency_without_a_use() {
    let mut p = pool(8, PolicyKind::Lru);
    fill(&mut p, &[1, 2, 3, 4, 5]);
    p.refresh(&ks(&[2, 9, 3]));
    assert_eq!(order_of(&p, "lru"), vec![1, 4, 5, 3, 2]);
    assert_eq!(p.state(Key(9)), KeyState::Absent);

    let mut p = pool(8, PolicyKind::Arc);
    fill(&mut p, &[1, 2, 3]);
    p.touch(&ks(&[3])); // a use: 3 enters T2
    let target = p.stats().target;
    p.refresh(&ks(&[1, 3, 2]));
    assert_eq!(order_of(&p, "t1"), vec![2, 1]);
    assert_eq!(order_of(&p, "t2"), vec![3]);
    assert_eq!(p.stats().target, target);
    p.check_consistency().unwrap();
    // Under pressure the refreshed prefix outlives the rest of T1.
    fill(&mut p, &[4, 5, 6, 7, 8]);
    p.refresh(&ks(&[1]));
    fill(&mut p, &[10]);
    assert_eq!(p.state(Key(2)), KeyState::Absent);
    assert_eq!(p.state(Key(1)), KeyState::Ready { pins: 0 });
}

/// A held slot is a storing entry outside the index: a hint naming it must not complete, unpin
/// or refresh the key's new store in another slot.
#[test]
fn hints_never_reach_a_held_slot() {
    for policy in POLICIES {
        let mut p = pool(4, policy);
        let first = p.prepare_store(&ks(&[1, 2])).unwrap();
        let held = p.hold(&ks(&[1])).unwrap();
        assert_eq!(held, vec![first.slots[0]]);
        let again = p.prepare_store(&ks(&[1])).unwrap();
        assert_ne!(again.slots[0], held[0]);
        p.complete_store_hinted(&ks(&[1, 2]), true, &[held[0], first.slots[1]])
            .unwrap();
        assert_eq!(p.state(Key(1)), KeyState::Ready { pins: 0 });
        assert_eq!(p.slot(Key(1)), Some(again.slots[0]));
        p.prepare_load(&ks(&[1])).unwrap();
        p.complete_load_hinted(&ks(&[1]), &held).unwrap();
        assert_eq!(p.state(Key(1)), KeyState::Ready { pins: 0 });
        p.check_consistency().unwrap();
        p.release_held(&held).unwrap();
        p.check_consistency().unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// Long lookups: past its first probe batch, a lookup takes a key's slot from the record after
// the previous key's when that record holds it (a prefix stored by one call holds consecutive
// slots). Whatever the pool went through, each key's answer is the index's.

#[derive(Clone, Debug)]
enum LongOp {
    /// `prepare_store` of keys `start..start + len`, then complete them (`Some(ok)`) or leave
    /// them storing (`None`).
    Store(u128, u128, Option<bool>),
    /// `hold` the storing keys of `start..start + len` (refused unless all are storing).
    Hold(u128, u128),
    /// `release_held` of everything held.
    Release,
    /// `lookup_slots` of `start..start + len`, or of that range read backwards; then
    /// `fill_slots` of the same keys with the slots of those whose bit is set in the mask
    /// given (the others unknown).
    Lookup(u128, u128, bool, bool, u64),
}

fn long_op() -> impl Strategy<Value = LongOp> {
    let start = || 0..96u128;
    prop_oneof![
        4 => (start(), 1..40u128, prop_oneof![Just(Some(true)), Just(Some(false)), Just(None)])
            .prop_map(|(s, n, ok)| LongOp::Store(s, n, ok)),
        1 => (start(), 1..6u128).prop_map(|(s, n)| LongOp::Hold(s, n)),
        1 => Just(LongOp::Release),
        4 => (start(), 17..80u128, any::<bool>(), any::<bool>(), any::<u64>())
            .prop_map(|(s, n, back, stop, mask)| LongOp::Lookup(s, n, back, stop, mask)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn long_lookups_say_what_the_index_says_key_by_key(
        ops in prop::collection::vec(long_op(), 1..60),
        arc in any::<bool>(),
    ) {
        let policy = if arc { PolicyKind::Arc } else { PolicyKind::Lru };
        let mut p = pool(64, policy);
        let mut held: Vec<SlotId> = Vec::new();
        for op in &ops {
            match *op {
                LongOp::Store(s, n, ok) => {
                    let keys: Vec<u128> = (s..s + n).collect();
                    if let Some(plan) = p.prepare_store(&ks(&keys)) {
                        if let Some(ok) = ok {
                            p.complete_store(&plan.keys, ok).unwrap();
                        }
                    }
                }
                LongOp::Hold(s, n) => {
                    let keys: Vec<u128> = (s..s + n).collect();
                    if let Ok(slots) = p.hold(&ks(&keys)) {
                        held.extend(slots);
                    }
                }
                LongOp::Release => {
                    p.release_held(&held).unwrap();
                    held.clear();
                }
                LongOp::Lookup(s, n, back, stop, mask) => {
                    let mut keys: Vec<u128> = (s..s + n).collect();
                    if back {
                        keys.reverse();
                    }
                    let (mut states, mut slots) = (vec![], vec![]);
                    let prefix = p.lookup_slots(&ks(&keys), &mut states, &mut slots, stop);
                    prop_assert_eq!(slots.len(), states.len());
                    for (i, ((k, state), slot)) in keys.iter().zip(&states).zip(&slots).enumerate() {
                        let want = p.slot(Key(*k));
                        prop_assert_eq!(*slot, want.unwrap_or(SlotId::NONE), "key {} (#{})", k, i);
                        prop_assert_eq!(*state, p.state(Key(*k)), "key {} (#{})", k, i);
                    }
                    let ready = states
                        .iter()
                        .take_while(|s| matches!(s, KeyState::Ready { .. }))
                        .count();
                    prop_assert_eq!(prefix, ready);
                    // Known entries are kept as given (even a wrong one), unknown ones filled.
                    let index: Vec<SlotId> = keys
                        .iter()
                        .map(|&k| p.slot(Key(k)).unwrap_or(SlotId::NONE))
                        .collect();
                    let given: Vec<SlotId> = index
                        .iter()
                        .enumerate()
                        .map(|(i, &s)| match (mask >> (i % 64)) & 3 {
                            0 => SlotId::NONE,
                            1 => SlotId(s.0 ^ 1),
                            _ => s,
                        })
                        .collect();
                    let mut filled = given.clone();
                    p.fill_slots(&ks(&keys), &mut filled);
                    for i in 0..keys.len() {
                        let want = if given[i] == SlotId::NONE { index[i] } else { given[i] };
                        prop_assert_eq!(filled[i], want, "fill_slots, key {} (#{})", keys[i], i);
                    }
                }
            }
        }
    }
}
