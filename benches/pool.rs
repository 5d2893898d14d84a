//! CPU pool benchmarks at one million slots, for both policies.
//!
//! Run with `cargo bench --bench pool` (or `make bench`). Every pool is first filled with
//! 1 M ready entries under pseudo-random 128-bit keys, so each store evicts. Numbers are per
//! call; criterion's throughput line turns them into keys per second:
//! - `lookup_512/<policy>`: `lookup` of a 512-key prefix that is entirely ready (the admission
//!   check of a long prompt). Cost is one hash probe per key.
//! - `store_16_evict/<policy>`: `prepare_store` of 16 new keys in a full pool (16 victims
//!   chosen by the policy, their slots reused as one sorted set of runs) followed by
//!   `complete_store` (one `stored` event). Events are drained every iteration.
//! - `touch_512/<policy>`: `touch` of a 512-key prefix (recency update, ARC promotion).
//! - `refresh_512/<policy>` and `refresh_hinted_512/<policy>`: the recency refresh of a dropped
//!   request's 512 chunks, by key (one index probe each) and with each chunk's slot as a hint
//!   (the scheduler's drop path). Each call takes the next of 64 scattered prefixes, so the
//!   index is mostly out of cache, as in a running engine.
//! - `touch_scattered_512/<policy>` and `touch_hinted_512/<policy>`: the lookup's touch of the
//!   same scattered prefixes, by key and with the slots the lookup found as hints.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvoffload::policy::PolicyKind;
use kvoffload::pool::{Pool, PoolConfig};
use kvoffload::{Key, SlotId};

const SLOTS: u32 = 1 << 20;
const POLICIES: [PolicyKind; 2] = [PolicyKind::Lru, PolicyKind::Arc];

/// A well-mixed 128-bit key, like the engine's chained prefix hashes.
fn key(i: u64) -> Key {
    let mut z = i.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    Key(u128::from(z ^ (z >> 31)) << 64 | u128::from(i))
}

/// A pool of `SLOTS` slots holding keys `0..SLOTS`, all ready.
fn full_pool(policy: PolicyKind) -> Pool {
    let mut pool = Pool::new(PoolConfig {
        capacity: SLOTS,
        policy,
        store_threshold: 0,
    })
    .unwrap();
    let keys: Vec<Key> = (0..u64::from(SLOTS)).map(key).collect();
    for chunk in keys.chunks(4096) {
        let plan = pool.prepare_store(chunk).unwrap();
        pool.complete_store(&plan.keys, true).unwrap();
    }
    pool.take_events();
    pool
}

fn bench_pool(c: &mut Criterion) {
    for policy in POLICIES {
        let mut pool = full_pool(policy);
        let prefix: Vec<Key> = (1000..1512).map(key).collect();

        let mut g = c.benchmark_group("lookup_512");
        g.throughput(Throughput::Elements(512));
        g.bench_function(BenchmarkId::from_parameter(policy), |b| {
            b.iter(|| black_box(pool.lookup(black_box(&prefix))));
        });
        g.finish();

        let mut g = c.benchmark_group("touch_512");
        g.throughput(Throughput::Elements(512));
        g.bench_function(BenchmarkId::from_parameter(policy), |b| {
            b.iter(|| pool.touch(black_box(&prefix)));
        });
        g.finish();

        let prefixes: Vec<Vec<Key>> = (0..64u64)
            .map(|p| {
                (0..512u64)
                    .map(|i| key((i * 2039 + p * 131) % u64::from(SLOTS)))
                    .collect()
            })
            .collect();
        let hints: Vec<Vec<SlotId>> = (prefixes.iter())
            .map(|keys| keys.iter().map(|&k| pool.slot(k).unwrap()).collect())
            .collect();
        let mut g = c.benchmark_group("refresh_512");
        g.throughput(Throughput::Elements(512));
        let mut n = 0;
        g.bench_function(BenchmarkId::from_parameter(policy), |b| {
            b.iter(|| {
                n = (n + 1) % prefixes.len();
                pool.refresh(black_box(&prefixes[n]));
            });
        });
        g.finish();
        let mut g = c.benchmark_group("refresh_hinted_512");
        g.throughput(Throughput::Elements(512));
        g.bench_function(BenchmarkId::from_parameter(policy), |b| {
            b.iter(|| {
                n = (n + 1) % prefixes.len();
                pool.refresh_hinted(black_box(&prefixes[n]), black_box(&hints[n]));
            });
        });
        g.finish();

        // The lookup's touch of a new request: the same scattered prefixes, by key and with the
        // slots its lookup found (`lookup_slots`) as hints.
        let mut g = c.benchmark_group("touch_scattered_512");
        g.throughput(Throughput::Elements(512));
        g.bench_function(BenchmarkId::from_parameter(policy), |b| {
            b.iter(|| {
                n = (n + 1) % prefixes.len();
                pool.touch(black_box(&prefixes[n]));
            });
        });
        g.finish();
        let mut g = c.benchmark_group("touch_hinted_512");
        g.throughput(Throughput::Elements(512));
        g.bench_function(BenchmarkId::from_parameter(policy), |b| {
            b.iter(|| {
                n = (n + 1) % prefixes.len();
                pool.touch_hinted(black_box(&prefixes[n]), black_box(&hints[n]));
            });
        });
        g.finish();

        let mut g = c.benchmark_group("store_16_evict");
        g.throughput(Throughput::Elements(16));
        let mut next = u64::from(SLOTS);
        let mut keys = Vec::with_capacity(16);
        g.bench_function(BenchmarkId::from_parameter(policy), |b| {
            b.iter(|| {
                keys.clear();
                keys.extend((next..next + 16).map(key));
                next += 16;
                let plan = pool.prepare_store(black_box(&keys)).unwrap();
                debug_assert_eq!(plan.evicted.len(), 16);
                pool.complete_store(&plan.keys, true).unwrap();
                black_box(pool.take_events());
            });
        });
        g.finish();
        let stats = pool.stats();
        eprintln!(
            "{policy}: {} stores, {} evictions, {:.2} slots per run ({} of {} allocations contiguous)",
            stats.stores,
            stats.evictions,
            stats.slots_per_run(),
            stats.contiguous_allocations,
            stats.allocations
        );
    }
}

criterion_group!(benches, bench_pool);
criterion_main!(benches);
