//! Fence and job-table benchmarks.
//!
//! Run with `make bench` (or `cargo bench --bench fence`). Numbers are per operation:
//! - `check_512/<armed>`: the per-step fence check over 512 written blocks while `<armed>`
//!   pairs are armed on other blocks (plus a few on the written ones). Budget: about 1 µs,
//!   flat in the number of armed pairs.
//! - `create_complete_16/<class>`: create a 16-block store job and complete it from one
//!   worker (rank 0), for the eager class (armed at creation) and the deferred class of a
//!   running request (never touches the index).
//! - `prefill_step_512/<groups>`: one `Scheduler::schedule` call in which 512 running requests
//!   each complete a 128-token prompt (8 chunks of one 16-token block per group): 512 store
//!   jobs planned, one per request, plus the step's checks and fence check. `full` has one
//!   full-attention group, `hybrid` adds a 64-token sliding-window group. The requests are
//!   set up (added, looked up, allocated) outside the measurement.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use kvoffload::config::{GroupConfig, SchedulerConfig};
use kvoffload::jobs::JobKind;
use kvoffload::scheduler::{Scheduler, StepInput};
use kvoffload::tracker::Tracker;
use kvoffload::{BlockId, Key, OwnerId};

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

/// Requests of the prefill step, and blocks (chunks) per request and group.
const STEP_REQUESTS: u32 = 512;
const STEP_BLOCKS: u32 = 8;

/// A scheduler of `groups` groups with [`STEP_REQUESTS`] allocated requests of
/// `STEP_BLOCKS` blocks each, nothing computed yet, and the input of the step that computes
/// their whole prompts.
fn prefill_setup(groups: u32) -> (Scheduler, StepInput<String>) {
    let group = |window| GroupConfig {
        block_size: 16,
        sliding_window: window,
        bytes_per_chunk: 1 << 16,
    };
    let per_req = STEP_BLOCKS * groups;
    let mut s = Scheduler::new(SchedulerConfig::new(
        (0..groups).map(|g| group((g > 0).then_some(64))).collect(),
        1 + STEP_REQUESTS * per_req,
        4 * STEP_REQUESTS * per_req,
    ))
    .unwrap();
    let tokens = STEP_BLOCKS * 16;
    let mut written = Vec::new();
    let ids: Vec<String> = (0..STEP_REQUESTS).map(|r| format!("req-{r:04}")).collect();
    for (r, id) in (0u32..).zip(&ids) {
        let hashes = (0..STEP_BLOCKS)
            .map(|c| Key(u128::from(r) << 32 | u128::from(c)))
            .collect();
        s.add_request(id, tokens, hashes).unwrap();
        s.lookup(id, 0).unwrap();
        let tables: Vec<Vec<BlockId>> = (0..groups)
            .map(|g| blocks(1 + r * per_req + g * STEP_BLOCKS, STEP_BLOCKS))
            .collect();
        written.extend(tables.iter().flatten().copied());
        s.allocate(id, &tables, 0, 0).unwrap();
    }
    let input = StepInput {
        computed: vec![tokens; ids.len()],
        scheduled: ids,
        new_blocks: Vec::new(),
        resumed: Vec::new(),
        finished: Vec::new(),
        aborted: Vec::new(),
        preempted: Vec::new(),
        written: Some(written),
    };
    (s, input)
}

fn bench_prefill_step(c: &mut Criterion) {
    let mut g = c.benchmark_group("prefill_step_512");
    g.throughput(Throughput::Elements(u64::from(STEP_REQUESTS)));
    for (name, groups) in [("full", 1), ("hybrid", 2)] {
        let (check, input) = prefill_setup(groups);
        let plan = { check }.schedule(&input).unwrap();
        assert_eq!(plan.stores.len(), STEP_REQUESTS as usize);
        g.bench_function(name, |b| {
            b.iter_batched(
                || prefill_setup(groups),
                |(mut s, input)| {
                    let plan = s.schedule(black_box(&input)).unwrap();
                    (s, plan)
                },
                BatchSize::PerIteration,
            );
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    bench_check,
    bench_create_complete,
    bench_prefill_step
);
criterion_main!(benches);
