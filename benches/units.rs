//! The core's per-unit budgets (DESIGN.md §7), each measured with the data cold and the code
//! warm, beside the machine's floor for the same memory work, in one run.
//!
//! Run with `cargo bench --bench units`; arguments after `--`: cycles (default 96; a cycle is
//! 16 decode steps at B=512 and four new requests). It prints, per unit, the median over the
//! samples with the data cold and with the caches as the loop leaves them (hot), the budget and
//! the cold median's share of it, then the floors.
//!
//! **Data cold, code warm.** Two identical engines (a [`Scheduler`] each, with the same seeded
//! calls, so the same state) take every call. Before a timed call on the first, a buffer twice
//! the last-level cache's size (`/sys/devices/system/cpu/cpu0/cache/index3/size`, else 32 MiB)
//! is rewritten, one write per cache line: every cache level and the data TLB lose the
//! scheduler's tables. Then the same call runs on the twin, untimed: its code and the code's
//! TLB entries are back in the caches, and the twin's data, not the first engine's (separate
//! allocations). Then the call on the first engine is timed (`Instant`, the TSC): its code is
//! warm, its data comes from memory, as after the engine's own work between two of our calls.
//! The floors run the same way on two tables of their own. *Hot* skips the rewrite.
//!
//! **The state.** One full-attention group of 16-token blocks, 262,144 GPU blocks, a CPU pool
//! of 393,216 chunks filled before the first sample (every store evicts), KV events off; 512
//! running requests in decode with prompts of 2–5.5k tokens, their prompt chunks in the pool,
//! in two phases: 32 of them cross a chunk boundary at one step of every 16 and the other 480
//! eight steps later, so 12 steps of 16 change nothing but the token counts. Every plan's jobs
//! complete before the next call (untimed unless the unit times them). Steps are planned as
//! the engine binding plans them (`schedule_with(.., PlanForm::Runs)`: the copies packed as
//! runs, no per-job lists).
//!
//! **The units.** (a) A new request of 331 chunks, in seven calls, each timed cold on its
//! own: `lookup_request`, `allocate`, `schedule` of a step where it waits for its load (the
//! plan hands out the load job), `complete_counts` of the load, `schedule` of its prefill (the
//! store of its new chunks planned), `complete_counts` of the stores, `schedule` of the step
//! it finished in. Two kinds alternate: a later turn (its first 300 chunks were stored by the
//! turn before: 300 loaded, 31 stored) and a first turn (331 stored). The three steps include
//! a step's fixed cost: the empty step's median is printed beside them. (b) A decode step of
//! the 512 requests in which none crosses a chunk boundary, divided by 512, as is and less
//! the empty step (`schedule` of a step that schedules nothing). The decoding requests are
//! named by the handles they resolved to when they started (`Resolved`), as the binding names
//! the ids it kept from the step before: the core finds each by slab index, not by hashing
//! its id. (c) One decode store chunk,
//! planned to published: the step where 32 requests cross a boundary (their new hash given
//! with `extend_hashes`, then `schedule`) plus `complete_counts` of its jobs, less the
//! unchanged step, per chunk. (d) The completions of that step: `complete_counts` of its jobs.
//!
//! **Floors.** 375 random 32-byte record reads in a table of the pool's size on huge pages (as
//! the pool's index and records are; one read per chunk probed by a lookup of that size),
//! independent (the memory system overlaps them: the floor of a lookup) and dependent (a
//! pointer chase: a cold read's latency); 512 independent ones (a record per running request)
//! and a scan of 512 `u32`s (the floors of a step's pass over its running requests). And per
//! call of (a), the floor of its memory work: as many cold lines as the call must touch in the
//! current layout, counted from the code ([`LATER_LINES`], [`FIRST_LINES`]), read at random
//! in the same table, each call's lines timed cold on their own; and (c)'s, the lines of the
//! step's 32 one-chunk stores ([`CHUNK_LINES`]), per chunk. Every line is taken as
//! random; where this bench's data is adjacent (its blocks and slots are handed out in runs:
//! the position entries a step drops, the records a completion publishes) a call can beat its
//! floor, so compare the calls row by row. Samples are medians: single calls on this shared
//! 2-core VM get preempted; compare units with their floors in one run.
//!
//! The bench allocates through mimalloc, as the extension does (`rust/py/mod.rs`): the engine's
//! calls reach the core through it.

use std::collections::HashMap;
use std::hint::black_box;
use std::time::Instant;

use kvoffload::config::{GroupConfig, SchedulerConfig};
use kvoffload::scheduler::{PlanForm, Resolved, Scheduler, StepInput, StepPlan};
use kvoffload::{BlockId, JobId, Key};

mod support;
use support::Rng;

/// The extension's allocator (`rust/py/mod.rs`, which sets it itself with the `python` feature).
#[cfg(not(feature = "python"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const BLOCK: u32 = 16;
const GPU_BLOCKS: u32 = 262_144;
const CPU_CHUNKS: u32 = 393_216;
const B: usize = 512;
/// Requests crossing a chunk boundary in the step of unit (c): 512 / 16, a decode step's mean.
const K: usize = 32;
/// A new request's chunks, and those of them a later turn finds in the pool.
const NEW_CHUNKS: u32 = 331;
const HIT_CHUNKS: u32 = 300;
/// Records read by the lookup floor.
const FLOOR_READS: usize = 375;

/// Key namespaces: pool filler, conversations (a later turn and the turn before), first turns,
/// the decode requests.
const FILL: u128 = 1;
const CONV: u128 = 2;
const FIRST: u128 = 3;
const DECODE: u128 = 4;

fn key(ns: u128, id: u32, chunk: u32) -> Key {
    Key(ns << 100 | u128::from(id) << 32 | u128::from(chunk))
}

/// A request that goes through its whole life in the unit (a) calls.
struct NewReq {
    id: String,
    ns: u128,
    n: u32,
    chunks: u32,
    /// Tokens its lookup must find in the pool (the bench's decisions are checked).
    hit: u32,
}

/// A request in decode.
struct Running {
    /// The id with the handle it resolved to when the request started: the binding keeps each
    /// scheduled id's handle from step to step (matched by the `str` object), so the core finds
    /// a request by slab index, not by hashing its id.
    id: Resolved<String>,
    n: u32,
    blocks: Vec<BlockId>,
    computed: u32,
}

/// One scheduler and the engine-side state the bench drives it with.
struct Engine {
    s: Scheduler,
    free: Vec<BlockId>,
    running: Vec<Running>,
    /// The last plan's jobs, to complete.
    jobs: Vec<(JobId, u32, bool)>,
    /// The new request in flight: its blocks and the tokens its lookup found.
    blocks: Vec<BlockId>,
    loadable: u32,
}

impl Engine {
    fn new() -> Self {
        let group = GroupConfig {
            block_size: BLOCK,
            sliding_window: None,
            bytes_per_chunk: 1 << 16,
        };
        let cfg = SchedulerConfig::new(vec![group], GPU_BLOCKS, CPU_CHUNKS);
        let mut s = Scheduler::new(cfg).unwrap();
        s.set_event_limit(0);
        Self {
            s,
            // Block 0 is the engine's null block.
            free: (1..GPU_BLOCKS).rev().map(BlockId).collect(),
            running: Vec::new(),
            jobs: Vec::new(),
            blocks: Vec::new(),
            loadable: 0,
        }
    }

    fn take(&mut self, plan: StepPlan) {
        let jobs = plan
            .loads
            .iter()
            .chain(&plan.stores)
            .map(|j| (j.id, 0, true));
        self.jobs.extend(jobs);
        self.s.recycle(plan);
    }

    fn schedule(&mut self, input: &StepInput) -> f64 {
        let t0 = Instant::now();
        let plan = self
            .s
            .schedule_with(black_box(input), PlanForm::Runs)
            .unwrap();
        self.take(plan);
        t0.elapsed().as_secs_f64() * 1e9
    }

    fn complete(&mut self) -> f64 {
        let t0 = Instant::now();
        let (ok, failed) = self.s.complete_counts(black_box(&self.jobs)).unwrap();
        let dt = t0.elapsed().as_secs_f64() * 1e9;
        assert_eq!((ok, failed), (self.jobs.len(), 0));
        self.jobs.clear();
        dt
    }

    /// Call `stage` (0..7) of request `r`'s life; the call's nanoseconds.
    fn stage(&mut self, r: &NewReq, stage: usize) -> f64 {
        let prompt = r.chunks * BLOCK;
        match stage {
            0 => {
                let hashes = (0..r.chunks).map(|c| key(r.ns, r.n, c)).collect();
                let t0 = Instant::now();
                let found = self.s.lookup_request(&r.id, prompt, hashes, 0, 0).unwrap();
                let dt = t0.elapsed().as_secs_f64() * 1e9;
                self.loadable = found.expect("nothing in flight defers a lookup");
                assert_eq!(self.loadable, r.hit, "{}", r.id);
                dt
            }
            1 => {
                let tables = [self.free.split_off(self.free.len() - r.chunks as usize)];
                let t0 = Instant::now();
                self.s.allocate(&r.id, &tables, 0, self.loadable).unwrap();
                let dt = t0.elapsed().as_secs_f64() * 1e9;
                let [blocks] = tables;
                self.blocks = blocks;
                dt
            }
            2 => self.schedule(&step(Vec::new(), Vec::new(), Vec::new())),
            4 => {
                let written = self.blocks[(self.loadable / BLOCK) as usize..].to_vec();
                self.schedule(&step(vec![r.id.clone()], vec![prompt], written))
            }
            6 => {
                let mut input = step(Vec::new(), Vec::new(), Vec::new());
                input.finished.push(r.id.clone());
                let dt = self.schedule(&input);
                self.free.append(&mut self.blocks);
                dt
            }
            _ => self.complete(),
        }
    }

    /// Request `r`'s whole life, untimed.
    fn life(&mut self, r: &NewReq) {
        for k in 0..7 {
            self.stage(r, k);
        }
    }

    /// The decode step after `t` steps: every running request one token further; the hashes of
    /// the chunks filled given first. Timed: the hashes and `schedule`.
    fn decode(&mut self) -> f64 {
        let mut input = step(Vec::new(), Vec::new(), Vec::new());
        let mut filled = Vec::new();
        for (i, r) in self.running.iter_mut().enumerate() {
            r.computed += 1;
            if r.computed > r.blocks.len() as u32 * BLOCK {
                let nb = self.free.pop().expect("GPU blocks");
                r.blocks.push(nb);
                input.new_blocks.push((r.id.clone(), 0, vec![nb]));
            }
            if r.computed % BLOCK == 0 {
                filled.push((i, key(DECODE, r.n, r.computed / BLOCK - 1)));
            }
            input.scheduled.push(r.id.clone());
            input.computed.push(r.computed);
            let w = input.written.as_mut().unwrap();
            w.push(r.blocks[((r.computed - 1) / BLOCK) as usize]);
        }
        let t0 = Instant::now();
        for &(i, k) in &filled {
            self.s.extend_hashes(&self.running[i].id, &[k]).unwrap();
        }
        let plan = self
            .s
            .schedule_with(black_box(&input), PlanForm::Runs)
            .unwrap();
        self.take(plan);
        t0.elapsed().as_secs_f64() * 1e9
    }
}

fn step<S>(scheduled: Vec<S>, computed: Vec<u32>, written: Vec<BlockId>) -> StepInput<S> {
    StepInput {
        scheduled,
        computed,
        new_blocks: Vec::new(),
        resumed: Vec::new(),
        finished: Vec::new(),
        aborted: Vec::new(),
        preempted: Vec::new(),
        written: Some(written),
    }
}

/// Rewrites a buffer twice the last-level cache's size, one write per line.
struct Evict(Vec<u8>);

impl Evict {
    fn new() -> Self {
        let llc = std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cache/index3/size")
            .ok()
            .and_then(|s| {
                let s = s.trim();
                let (n, unit) = s.split_at(s.len() - 1);
                let n: usize = n.parse().ok()?;
                Some(match unit {
                    "K" => n << 10,
                    "M" => n << 20,
                    _ => return None,
                })
            })
            .unwrap_or(32 << 20);
        Self(vec![1; 2 * llc])
    }

    fn run(&mut self) {
        for line in self.0.chunks_exact_mut(64) {
            line[0] = line[0].wrapping_add(1);
        }
        black_box(&mut self.0);
    }

    fn bytes(&self) -> usize {
        self.0.len()
    }
}

/// `n` zeroed records on transparent huge pages where the kernel takes the advice, as the
/// pool's index and slot records are (`kvoffload::mem`, private to the crate): the floor of a
/// read into them has no page walk that misses.
fn huge_records(n: usize) -> Vec<[u64; 4]> {
    const HUGE: usize = 2 << 20;
    let mut v: Vec<[u64; 4]> = Vec::with_capacity(n);
    let base = v.as_ptr() as usize;
    let (lo, hi) = (base.next_multiple_of(HUGE), (base + n * 32) / HUGE * HUGE);
    #[cfg(target_os = "linux")]
    if hi > lo {
        #[allow(unsafe_code)]
        // SAFETY: advice on whole pages inside the vector's allocation, nothing written there
        // yet; `MADV_HUGEPAGE` changes how pages are backed, never their contents.
        unsafe {
            libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE);
        }
    }
    v.resize(n, [0; 4]);
    v
}

/// The floors' memory: records of 32 bytes, as many as the pool's chunks, the first word of
/// each the index of the next in one random cycle (Sattolo), and 512 `u32`s.
struct Floor {
    records: Vec<[u64; 4]>,
    words: Vec<u32>,
}

impl Floor {
    fn new(rng: &mut Rng) -> Self {
        let n = CPU_CHUNKS as usize;
        let mut perm: Vec<u64> = (0..n as u64).collect();
        for i in (1..n).rev() {
            perm.swap(i, (rng.next() % i as u64) as usize);
        }
        let mut records = huge_records(n);
        for w in perm.windows(2) {
            records[w[0] as usize][0] = w[1];
        }
        records[perm[n - 1] as usize][0] = perm[0];
        let words = (0..B as u32).collect();
        Self { records, words }
    }

    /// `n` records at random, independent of each other.
    fn reads(&self, n: usize, x: u64) -> f64 {
        self.work(Lines(n, 0), x)
    }

    /// `lines.0` records at random, independent of each other, then `lines.1` two-level reads
    /// (a record, then the record whose index it holds: a bucket of the pool's index, then the
    /// slot record it names), independent of each other.
    fn work(&self, lines: Lines, mut x: u64) -> f64 {
        let n = self.records.len() as u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n) as usize
        };
        let t0 = Instant::now();
        let mut sum = 0u64;
        for _ in 0..lines.0 {
            sum = sum.wrapping_add(self.records[next()][1]);
        }
        for _ in 0..lines.1 {
            let to = self.records[next()][0] as usize;
            sum = sum.wrapping_add(self.records[to][1]);
        }
        black_box(sum);
        t0.elapsed().as_secs_f64() * 1e9
    }

    /// `FLOOR_READS` records, each read's address from the one before.
    fn chase(&self, start: u64) -> f64 {
        let t0 = Instant::now();
        let mut i = start % self.records.len() as u64;
        for _ in 0..FLOOR_READS {
            i = self.records[i as usize][0];
        }
        black_box(i);
        t0.elapsed().as_secs_f64() * 1e9
    }

    fn scan(&self) -> f64 {
        let t0 = Instant::now();
        let s: u32 = black_box(&self.words)
            .iter()
            .fold(0, |a, &w| a.wrapping_add(w));
        black_box(s);
        t0.elapsed().as_secs_f64() * 1e9
    }
}

/// Samples per measure, cold and hot.
#[derive(Default)]
struct Samples(HashMap<&'static str, [Vec<f64>; 2]>);

impl Samples {
    fn add(&mut self, name: &'static str, cold: bool, ns: f64) {
        self.0.entry(name).or_default()[usize::from(!cold)].push(ns);
    }

    /// The median of `name`'s cold (or hot) samples, in ns.
    fn median(&self, name: &str, cold: bool) -> f64 {
        let mut xs = self.0[name][usize::from(!cold)].clone();
        xs.sort_by(f64::total_cmp);
        xs.get(xs.len() / 2).copied().unwrap_or(f64::NAN)
    }
}

/// Both engines, the eviction buffer and the samples.
struct Bench {
    a: Engine,
    twin: Engine,
    evict: Evict,
    samples: Samples,
}

impl Bench {
    /// `f` on both engines, the twin first; the first engine's call timed (data cold if
    /// `cold`).
    fn both(&mut self, name: &'static str, cold: bool, f: impl Fn(&mut Engine) -> f64) -> f64 {
        if cold {
            self.evict.run();
        }
        f(&mut self.twin);
        let ns = f(&mut self.a);
        self.samples.add(name, cold, ns);
        ns
    }

    /// `f` on both engines, untimed.
    fn untimed(&mut self, f: impl Fn(&mut Engine)) {
        f(&mut self.twin);
        f(&mut self.a);
    }
}

const STAGES: [&str; 7] = [
    "lookup_request",
    "allocate",
    "schedule (load planned)",
    "complete_counts (load)",
    "schedule (prefill: stores planned)",
    "complete_counts (stores)",
    "schedule (finished)",
];

#[allow(clippy::too_many_lines)]
fn main() {
    let cycles = std::env::args()
        .skip(1)
        .find_map(|a| a.parse::<u32>().ok())
        .unwrap_or(96);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut bench = Bench {
        a: Engine::new(),
        twin: Engine::new(),
        evict: Evict::new(),
        samples: Samples::default(),
    };
    // The pool, filled: every store from now on evicts.
    for f in 0..=CPU_CHUNKS / NEW_CHUNKS {
        let r = NewReq {
            id: format!("fill{f}"),
            ns: FILL,
            n: f,
            chunks: NEW_CHUNKS,
            hit: 0,
        };
        bench.untimed(|e| e.life(&r));
    }
    // 512 requests in decode: K of them one token past a chunk boundary, the others nine.
    let prompts: Vec<u32> = (0..B)
        .map(|i| {
            let phase = if i < K { 1 } else { 9 };
            rng.range(2048, 5632) / BLOCK * BLOCK + phase
        })
        .collect();
    bench.untimed(|e| {
        for (i, &p) in prompts.iter().enumerate() {
            let id = format!("dec{i}");
            let hashes = (0..p / BLOCK).map(|c| key(DECODE, i as u32, c)).collect();
            assert_eq!(e.s.lookup_request(&id, p, hashes, 0, 0).unwrap(), Some(0));
            let blocks = e.free.split_off(e.free.len() - p.div_ceil(BLOCK) as usize);
            e.s.allocate(&id, std::slice::from_ref(&blocks), 0, 0)
                .unwrap();
            let written = blocks.clone();
            e.schedule(&step(vec![id.clone()], vec![p], written));
            e.complete();
            e.running.push(Running {
                id: e.s.resolved(id),
                n: i as u32,
                blocks,
                computed: p,
            });
        }
    });
    let mut floors = [Floor::new(&mut rng), Floor::new(&mut rng)];
    let mut conv = 0;
    for cycle in 0..cycles {
        // Steps 1..=16 after the K requests were one token past a boundary: they cross at the
        // 15th, the others at the 7th; new blocks at the 8th and 16th.
        for t in 1..=16u32 {
            let cold = t % 2 == 0;
            match t {
                15 => {
                    let cold = cycle % 2 == 0;
                    bench.both("crossing step", cold, Engine::decode);
                    // One store job per request that filled a chunk, planned in this step.
                    assert_eq!(bench.a.jobs.len(), K);
                    bench.both("completions", cold, Engine::complete);
                }
                7 | 8 | 16 => bench.untimed(|e| {
                    e.decode();
                    e.complete();
                }),
                _ => {
                    bench.both("unchanged step", cold, Engine::decode);
                    bench.untimed(|e| {
                        assert!(e.jobs.is_empty());
                    });
                }
            }
        }
        for cold in [true, false] {
            let empty = step(Vec::new(), Vec::new(), Vec::new());
            bench.both("empty step", cold, |e| e.schedule(&empty));
            // A later turn: the turn before stored its first 300 chunks.
            let before = NewReq {
                id: format!("conv{conv}-turn1"),
                ns: CONV,
                n: conv,
                chunks: HIT_CHUNKS,
                hit: 0,
            };
            bench.untimed(|e| e.life(&before));
            let later = NewReq {
                id: format!("conv{conv}-turn2"),
                hit: HIT_CHUNKS * BLOCK,
                chunks: NEW_CHUNKS,
                ..before
            };
            let first = NewReq {
                id: format!("first{conv}"),
                ns: FIRST,
                n: conv,
                chunks: NEW_CHUNKS,
                hit: 0,
            };
            conv += 1;
            for (r, names) in [(&later, LATER), (&first, FIRST_TURN)] {
                for (k, &name) in names.iter().enumerate() {
                    bench.both(name, cold, |e| e.stage(r, k));
                }
            }
            let seed = rng.next() | 1;
            if cold {
                for &(name, l) in LATER_LINES.iter().chain(&FIRST_LINES).chain(&CHUNK_LINES) {
                    bench.evict.run();
                    floors[1].work(l, seed);
                    let ns = floors[0].work(l, seed);
                    bench.samples.add(name, true, ns);
                }
            }
            bench.evict.run();
            floors[1].reads(FLOOR_READS, seed);
            let ns = floors[0].reads(FLOOR_READS, seed);
            bench.samples.add("floor reads", true, ns);
            bench.evict.run();
            floors[1].reads(B, seed);
            let ns = floors[0].reads(B, seed);
            bench.samples.add("floor 512 reads", true, ns);
            bench.evict.run();
            floors[1].chase(seed);
            let ns = floors[0].chase(seed);
            bench.samples.add("floor chase", true, ns);
            bench.evict.run();
            floors[1].scan();
            let ns = floors[0].scan();
            bench.samples.add("floor scan", true, ns);
            floors.swap(0, 1);
        }
    }
    report(&bench, cycles);
}

/// Sample names of the stages of a later turn and of a first turn.
const LATER: [&str; 7] = [
    "later lookup",
    "later allocate",
    "later sched load",
    "later complete load",
    "later sched prefill",
    "later complete stores",
    "later sched finish",
];
const FIRST_TURN: [&str; 7] = [
    "first lookup",
    "first allocate",
    "first sched load",
    "first complete load",
    "first sched prefill",
    "first complete stores",
    "first sched finish",
];

/// Cold lines a call must touch: `(independent, two-level)` (see [`Floor::work`]).
#[derive(Clone, Copy)]
struct Lines(usize, usize);

/// Each of a later turn's seven calls: its floor's sample name and the cold lines it must touch
/// in the current layout, counted from the code (each taken as random: see the module doc):
/// the lookup probes its first batch's 16 index buckets and the hits' records behind them, then
/// reads the other 284 hits' records by guess (each in the slot after the one before: the
/// turn before stored them in one job) and probes the 31 misses' buckets; `allocate` pins the 300 loaded chunks'
/// records; the next step drops the 331 new blocks' position entries (indexing the 31 unstored
/// ones in the same lines); the load's completion unpins the 300 records; the prefill's store
/// probes its 31 new keys' buckets and removes its 31 victims' (the victims' records are the
/// recency list's head, adjacent slots here); the stores' completion publishes 31 records; the
/// drop refreshes 331 records (their recency neighbours are each other's).
const LATER_LINES: [(&str, Lines); 7] = [
    ("later floor lookup", Lines(31 + 284, 16)),
    ("later floor allocate", Lines(300, 0)),
    ("later floor sched load", Lines(331, 0)),
    ("later floor complete load", Lines(300, 0)),
    ("later floor sched prefill", Lines(62, 0)),
    ("later floor complete stores", Lines(31, 0)),
    ("later floor sched finish", Lines(331, 0)),
];

/// [`LATER_LINES`] for a first turn: its lookup stops after the first batch of 16 probes (all
/// absent), nothing is loaded, the prefill's store probes 331 buckets and removes 331 victims',
/// 331 records are published and refreshed.
const FIRST_LINES: [(&str, Lines); 7] = [
    ("first floor lookup", Lines(16, 0)),
    ("first floor allocate", Lines(0, 0)),
    ("first floor sched load", Lines(331, 0)),
    ("first floor complete load", Lines(0, 0)),
    ("first floor sched prefill", Lines(662, 0)),
    ("first floor complete stores", Lines(331, 0)),
    ("first floor sched finish", Lines(331, 0)),
];

/// Unit (c)'s floor: the cold lines each of the step's [`K`] one-chunk stores must touch, planned
/// to published, in the current layout: the request's due hash, its block-table entry and slot
/// hint, the new key's index bucket, the victim's record and its bucket, and the record again
/// when the completion publishes it (the engine's work evicted it in between). The job's own
/// lists and table entries are not counted: they are what a packed job of the step's stores
/// would not have.
const CHUNK_LINES: [(&str, Lines); 1] = [("decode chunk floor", Lines(7 * K, 0))];

fn report(bench: &Bench, cycles: u32) {
    let s = &bench.samples;
    let m = |name: &str, cold: bool| s.median(name, cold);
    println!(
        "units: {cycles} cycles; data cold = a {} MiB rewrite, then the call on the twin engine, \
         then the timed call; medians",
        bench.evict.bytes() >> 20
    );
    println!(
        "{:<64} {:>11} {:>11} {:>9} {:>8}",
        "unit", "cold", "hot", "budget", "share"
    );
    let fmt = |ns: f64| {
        if ns.is_nan() {
            "-".to_owned()
        } else if ns >= 1e4 {
            format!("{:.1} us", ns / 1e3)
        } else if ns >= 1e3 {
            format!("{:.2} us", ns / 1e3)
        } else {
            format!("{ns:.1} ns")
        }
    };
    let row = |unit: &str, cold: f64, hot: f64, budget: Option<f64>| {
        let (b, share) = budget.map_or((String::new(), String::new()), |b| {
            (fmt(b), format!("{:.0}%", 100.0 * cold / b))
        });
        println!(
            "{unit:<64} {:>11} {:>11} {b:>9} {share:>8}",
            fmt(cold),
            fmt(hot)
        );
    };
    let empty = [m("empty step", true), m("empty step", false)];
    for (kind, names, floors, what) in [
        ("later turn", LATER, LATER_LINES, "300 loaded + 31 stored"),
        ("first turn", FIRST_TURN, FIRST_LINES, "331 stored"),
    ] {
        let total = |cold: bool| names.iter().map(|n| m(n, cold)).sum::<f64>();
        let unit = format!("(a) new request, {kind}: {what}, 7 calls");
        row(&unit, total(true), total(false), Some(50e3));
        let less = |cold: bool| total(cold) - 3.0 * empty[usize::from(!cold)];
        row(
            "    less 3 empty steps",
            less(true),
            less(false),
            Some(50e3),
        );
        for ((stage, n), (f, _)) in STAGES.iter().zip(names).zip(floors) {
            let unit = format!("      {stage} (floor {})", fmt(m(f, true)));
            row(&unit, m(n, true), m(n, false), None);
        }
        let floor: f64 = floors.iter().map(|(n, _)| m(n, true)).sum();
        row(
            "    the floor of its memory work (the lines its calls touch)",
            floor,
            f64::NAN,
            Some(50e3),
        );
        println!(
            "    {kind}: ours / that floor {:.2}x (cold)",
            total(true) / floor
        );
    }
    let unchanged = [m("unchanged step", true), m("unchanged step", false)];
    let per = |x: f64| x / B as f64;
    row(
        "(b) running request, nothing changed (step of 512 / 512)",
        per(unchanged[0]),
        per(unchanged[1]),
        Some(40.0),
    );
    row(
        "    less the empty step",
        per(unchanged[0] - empty[0]),
        per(unchanged[1] - empty[1]),
        Some(40.0),
    );
    row(
        "    the step of 512",
        unchanged[0],
        unchanged[1],
        Some(20e3),
    );
    row("    the empty step", empty[0], empty[1], None);
    let chunk = |cold: bool| {
        let i = usize::from(!cold);
        (m("crossing step", cold) + m("completions", cold) - unchanged[i]) / K as f64
    };
    row(
        "(c) decode store chunk, planned to published (32 cross), per chunk",
        chunk(true),
        chunk(false),
        Some(500.0),
    );
    let chunk_floor = m(CHUNK_LINES[0].0, true) / K as f64;
    row(
        "    the floor of its memory work (7 lines a chunk)",
        chunk_floor,
        f64::NAN,
        Some(500.0),
    );
    println!(
        "    decode store chunk: ours / that floor {:.2}x (cold)",
        chunk(true) / chunk_floor
    );
    row(
        "    the step of 512, 32 crossing",
        m("crossing step", true),
        m("crossing step", false),
        None,
    );
    row(
        "(d) completions of that step (its 32 store jobs)",
        m("completions", true),
        m("completions", false),
        Some(10e3),
    );
    println!("floors (data cold, the same way):");
    let reads = m("floor reads", true);
    let chase = m("floor chase", true);
    let scan = m("floor scan", true);
    let nan = f64::NAN;
    row(
        "  375 random 32-byte record reads, independent",
        reads,
        nan,
        None,
    );
    row(
        "  375 random 32-byte record reads, dependent (a chase)",
        chase,
        nan,
        None,
    );
    row(
        "    one dependent read",
        chase / FLOOR_READS as f64,
        nan,
        None,
    );
    row("  a scan of 512 u32s", scan, nan, None);
    let reads512 = m("floor 512 reads", true);
    row(
        "  512 random 32-byte record reads, independent",
        reads512,
        nan,
        None,
    );
    let later: f64 = LATER.iter().map(|n| m(n, true)).sum();
    println!(
        "ratios: (a) later turn / 375 independent reads {:.1}x; (b) the step of 512 / the \
         scan of 512 u32s {:.1}x, / 512 independent reads {:.1}x",
        later / reads,
        unchanged[0] / scan,
        unchanged[0] / reads512
    );
}
