//! Fence and job-table benchmarks.
//!
//! Run with `make bench` (or `cargo bench --bench fence`). Numbers are per operation:
//! - `check_512/<armed>`: the per-step fence check over 512 written blocks while `<armed>`
//!   pairs are armed on other blocks (plus a few on the written ones). Budget: about 1 µs,
//!   flat in the number of armed pairs.
//! - `create_complete_16/<class>`: create a 16-block store job and complete it from one
//!   worker (rank 0), for the eager class (armed at creation) and the deferred class of a
//!   running request (never touches the index).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvoffload::jobs::JobKind;
use kvoffload::tracker::Tracker;
use kvoffload::{BlockId, OwnerId};

const NUM_BLOCKS: u32 = 1 << 20;

fn blocks(start: u32, n: u32) -> Vec<BlockId> {
    (start..start + n).map(BlockId).collect()
}

fn bench_check(c: &mut Criterion) {
    let mut g = c.benchmark_group("check_512");
    g.throughput(Throughput::Elements(512));
    for armed in [0u32, 1_000, 100_000] {
        let mut t: Tracker<()> = Tracker::new(1, NUM_BLOCKS).unwrap();
        // Armed pairs live on blocks 4096.. (16 per job); 8 jobs also sit on written blocks.
        for j in 0..armed / 16 {
            t.create(
                JobKind::Store,
                OwnerId(u64::from(j)),
                blocks(4096 + j * 16, 16),
                vec![],
                (),
            )
            .unwrap();
        }
        if armed > 0 {
            for j in 0..8 {
                t.create(
                    JobKind::Store,
                    OwnerId(1 << 40 | j),
                    vec![BlockId(j as u32 * 64)],
                    vec![],
                    (),
                )
                .unwrap();
            }
        }
        let written = blocks(0, 512);
        let mut out = Vec::with_capacity(64);
        g.bench_with_input(BenchmarkId::from_parameter(armed), &written, |b, w| {
            b.iter(|| {
                out.clear();
                t.check_into(black_box(w), &mut out).unwrap();
                black_box(out.len())
            });
        });
    }
    g.finish();
}

fn bench_create_complete(c: &mut Criterion) {
    let mut g = c.benchmark_group("create_complete_16");
    g.throughput(Throughput::Elements(1));
    for (name, eager) in [("eager", true), ("deferred", false)] {
        let mut t: Tracker<()> = Tracker::new(1, NUM_BLOCKS).unwrap();
        let mut start = 0u32;
        g.bench_function(name, |b| {
            b.iter(|| {
                let bs = blocks(start, 16);
                start = (start + 16) % (NUM_BLOCKS - 16);
                let (eager_blocks, deferred_blocks) =
                    if eager { (bs, vec![]) } else { (vec![], bs) };
                let id = t
                    .create(
                        JobKind::Store,
                        OwnerId(7),
                        eager_blocks,
                        deferred_blocks,
                        (),
                    )
                    .unwrap();
                black_box(t.complete(black_box(id), 0, true).unwrap());
            });
        });
    }
    g.finish();
}

criterion_group!(benches, bench_check, bench_create_complete);
criterion_main!(benches);
