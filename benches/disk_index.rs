//! Disk tier index benchmark: a 512-key prefix lookup at 10 M slots.
//!
//! Run with `cargo bench --bench disk_index` (or `make bench`); `KVOFFLOAD_BENCH_SLOTS` sets
//! the size (default 10 M). The index ([`DiskIndex`]) is filled with that many published
//! chunks under pseudo-random 128-bit keys first (a few seconds, about 1 GB of memory), so the
//! lookup probes a table of the size a 10 M-slot disk tier keeps. Numbers are per call;
//! criterion's throughput line turns them into keys per second:
//! - `disk_lookup_512`: `lookup` of a 512-key prefix that is entirely on disk (the admission
//!   check of a long prompt that missed the CPU pool), recency updated.
//! - `disk_state_512`: the per-key state probe the scheduler's promotion planning does.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvoffload::policy::PolicyKind;
use kvoffload::tier::disk::{DiskIndex, SlabLayout, BLOCK};
use kvoffload::tier::TierIndex;
use kvoffload::Key;

/// A well-mixed 128-bit key, like the engine's chained prefix hashes.
fn key(i: u64) -> Key {
    let mut z = i.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    Key(u128::from(z ^ (z >> 31)) << 64 | u128::from(i))
}

fn bench(c: &mut Criterion) {
    let slots: u64 = std::env::var("KVOFFLOAD_BENCH_SLOTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000_000);
    // 2 MiB chunks: the layout only sizes the index, no file is touched.
    let chunk = 2u64 << 20;
    let layout = SlabLayout::new(chunk, slots * (BLOCK + chunk)).expect("layout");
    let mut idx = DiskIndex::new(layout, PolicyKind::Lru).expect("index");
    let batch: Vec<Key> = Vec::with_capacity(4096);
    let mut batch = batch;
    for i in 0..slots {
        batch.push(key(i));
        if batch.len() == 4096 || i + 1 == slots {
            idx.prepare_write(&batch).expect("room");
            idx.complete_write(&batch, true).expect("reserved");
            batch.clear();
        }
    }
    idx.take_events();
    let prefix: Vec<Key> = (slots / 2..slots / 2 + 512).map(key).collect();
    let mut g = c.benchmark_group("disk_index");
    g.throughput(Throughput::Elements(512));
    g.bench_function("disk_lookup_512", |b| {
        b.iter(|| black_box(idx.lookup(black_box(&prefix))));
    });
    g.bench_function("disk_state_512", |b| {
        b.iter(|| {
            black_box(&prefix)
                .iter()
                .filter(|k| idx.state(**k) != kvoffload::pool::KeyState::Absent)
                .count()
        });
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
