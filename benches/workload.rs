//! The Rust core alone on the shape of `benches/vllm_workload.py` at B=512, full attention: a
//! closed-loop multi-turn chat driven straight through [`Scheduler`], without vLLM or Python.
//!
//! Run with `cargo bench --bench workload`; arguments after `--`: measured steps (default
//! 2000), warmup steps (default 4000: the CPU pool is full by then), `b` (default 512), CPU
//! pool chunks (default 393,216). It prints the thread CPU time per measured step of each call
//! kind (`schedule`, `complete_counts`, `lookup_request`, `allocate`), and their sum, in µs,
//! the heap allocations per measured step of each (exact: a counting allocator), plus the
//! workload's counts per step. That clock may advance by scheduler ticks only (then single
//! calls read 0 or a tick): only sums over many steps mean anything, and other processes on a
//! shared machine still evict the caches, so compare builds in alternated runs. Shape: `b`
//! requests in flight out of `2b` conversations, 4 shared system prompts of 512–1.5k tokens,
//! first prompts of 2–5.5k tokens growing to at most 8k, 64–256 decoded tokens per turn, up to
//! 8 turns, 10–100 idle steps between turns, 16-token blocks, chunked prefill at 8,192 tokens
//! per step, a 200k-block GPU pool and a full CPU pool. Every lookup reports no engine prefix
//! hit (the CPU tier serves every reused prefix: more loads than in vLLM, where its own prefix
//! cache serves some). Jobs complete one step after their plan, all in one `complete_counts`
//! call (as vLLM's connector reports them). Seeded: every run makes the same calls.

use std::collections::VecDeque;
use std::fs::File;
use std::hint::black_box;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use kvoffload::config::{GroupConfig, SchedulerConfig};
use kvoffload::scheduler::{Scheduler, StepInput};
use kvoffload::{BlockId, JobId, Key};

mod support;
use support::Rng;

const BLOCK: u32 = 16;
const GPU_BLOCKS: u32 = 200_000;
const CPU_CHUNKS: u32 = 393_216;
const PREFILL_BUDGET: u32 = 8192;
const MAX_PROMPT: u32 = 8192;

/// The system allocator, counting allocations (reallocations included): the per-call counts
/// are exact, where times are noisy. Not with the `python` feature (the extension's allocator,
/// mimalloc, is the global one there): the counts then read 0.
#[cfg(not(feature = "python"))]
mod counting {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::atomic::{AtomicU64, Ordering};

    pub(super) static ALLOCS: AtomicU64 = AtomicU64::new(0);

    struct Counting;

    // SAFETY: forwards every call to `System` unchanged; the counter has no effect on memory.
    // (A global allocator can only be written with `unsafe`.)
    #[allow(unsafe_code)]
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
            // SAFETY: the caller's contract, passed on.
            unsafe { System.alloc(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: the caller's contract, passed on.
            unsafe { System.dealloc(ptr, layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
            // SAFETY: the caller's contract, passed on.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }

    #[global_allocator]
    static GLOBAL: Counting = Counting;
}

/// Allocations so far (0 with the `python` feature).
fn allocs() -> u64 {
    #[cfg(not(feature = "python"))]
    return counting::ALLOCS.load(std::sync::atomic::Ordering::Relaxed);
    #[cfg(feature = "python")]
    0
}

/// A conversation: its system prompt, the tokens of its history and its turn.
struct Conv {
    sys: u32,
    sys_len: u32,
    len: u32,
    turn: u32,
    gen: u32,
}

/// A request in flight.
struct Req {
    id: String,
    conv: usize,
    prompt: u32,
    computed: u32,
    decode_left: u32,
    blocks: Vec<BlockId>,
    /// Waiting for its load job.
    loading: bool,
}

/// The key of token block `p` (0-based) of conversation `c`: system prompt blocks are shared.
fn key(convs: &[Conv], c: usize, p: u32) -> Key {
    let cv = &convs[c];
    if p < cv.sys_len / BLOCK {
        Key(1 << 100 | u128::from(cv.sys) << 32 | u128::from(p))
    } else {
        Key(u128::from(cv.gen) << 64 | (c as u128) << 32 | u128::from(p))
    }
}

/// This thread's CPU time (`/proc/thread-self/schedstat`), so time the thread spends
/// preempted on a shared machine is not counted; wall time where that file is missing.
struct Clock {
    schedstat: Option<File>,
    start: Instant,
}

impl Clock {
    fn new() -> Self {
        Self {
            schedstat: File::open("/proc/thread-self/schedstat").ok(),
            start: Instant::now(),
        }
    }

    fn since(&self, t0: Duration) -> Duration {
        self.now().saturating_sub(t0)
    }

    fn now(&self) -> Duration {
        let mut buf = [0u8; 64];
        let ns = self.schedstat.as_ref().and_then(|f| {
            let n = f.read_at(&mut buf, 0).ok()?;
            std::str::from_utf8(&buf[..n])
                .ok()?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        });
        ns.map_or_else(|| self.start.elapsed(), Duration::from_nanos)
    }
}

#[derive(Default)]
struct Times {
    schedule: Duration,
    complete: Duration,
    lookup: Duration,
    allocate: Duration,
    /// Heap allocations of each call kind, as the times.
    heap: [u64; 4],
    lookups: u64,
    allocs: u64,
    stores: u64,
    loads: u64,
    finished: u64,
}

#[allow(clippy::too_many_lines, clippy::many_single_char_names)]
fn main() {
    let args: Vec<u32> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let steps = args.first().copied().unwrap_or(2000);
    let warmup = args.get(1).copied().unwrap_or(4000);
    let b = args.get(2).copied().unwrap_or(512) as usize;
    let cpu_chunks = args.get(3).copied().unwrap_or(CPU_CHUNKS);
    let group = GroupConfig {
        block_size: BLOCK,
        sliding_window: None,
        bytes_per_chunk: 1 << 16,
    };
    let mut s = Scheduler::new(SchedulerConfig::new(vec![group], GPU_BLOCKS, cpu_chunks)).unwrap();
    // KV events off, as in the vLLM run.
    s.set_event_limit(0);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut convs: Vec<Conv> = Vec::new();
    let mut ready: VecDeque<(u64, usize)> = VecDeque::new();
    for c in 0..2 * b {
        let sys = rng.range(0, 3);
        convs.push(Conv {
            sys,
            sys_len: 512 + sys * 336 / BLOCK * BLOCK,
            len: 0,
            turn: 0,
            gen: 0,
        });
        ready.push_back((u64::from(rng.range(0, 200)), c));
    }
    // Block 0 is the engine's null block.
    let mut free: Vec<BlockId> = (1..GPU_BLOCKS).rev().map(BlockId).collect();
    let mut running: Vec<Req> = Vec::new();
    let mut waiting: VecDeque<Req> = VecDeque::new();
    let mut to_complete: Vec<(JobId, u32, bool)> = Vec::new();
    // Load jobs of the previous plan and their requests.
    let mut to_load: Vec<String> = Vec::new();
    let mut finished_ids: Vec<String> = Vec::new();
    let mut t = Times::default();
    let clock = Clock::new();
    for step in 0..u64::from(warmup + steps) {
        if step == u64::from(warmup) {
            t = Times::default();
        }
        // Jobs of the previous plan complete, in one batch.
        let (t0, a0) = (clock.now(), allocs());
        let (ok, failed) = s.complete_counts(black_box(&to_complete)).unwrap();
        t.heap[1] += allocs() - a0;
        t.complete += clock.since(t0);
        assert_eq!((ok, failed), (to_complete.len(), 0));
        to_complete.clear();
        for id in to_load.drain(..) {
            if let Some(r) = running.iter_mut().find(|r| r.id == id) {
                r.loading = false;
            }
        }
        // Conversations whose idle time is over start a turn.
        ready.make_contiguous().sort_unstable();
        while ready.front().is_some_and(|(at, _)| *at <= step) {
            let (_, c) = ready.pop_front().unwrap();
            let cv = &mut convs[c];
            let user = if cv.turn == 0 {
                rng.range(2048, 5632) - cv.sys_len.min(1024)
            } else {
                rng.range(32, 512)
            };
            if cv.turn >= 8 || cv.len + user + 256 > MAX_PROMPT {
                cv.turn = 0;
                cv.gen += 1;
                cv.len = cv.sys_len;
            }
            cv.len += user;
            cv.turn += 1;
            waiting.push_back(Req {
                id: format!("c{c}-g{}-t{}", cv.gen, cv.turn),
                conv: c,
                prompt: cv.len,
                computed: 0,
                decode_left: rng.range(64, 256),
                blocks: Vec::new(),
                loading: false,
            });
        }
        // Admission: lookups and allocations while there is room.
        let mut deferred = VecDeque::new();
        // Only as much prefill as one step computes waits at a time (vLLM's token budget).
        let mut budget = PREFILL_BUDGET.saturating_sub(
            running
                .iter()
                .map(|r| r.prompt.saturating_sub(r.computed))
                .sum(),
        );
        while running.len() < b && budget > 0 {
            let Some(mut r) = waiting.pop_front() else {
                break;
            };
            let need = r.prompt.div_ceil(BLOCK) as usize + 1;
            if free.len() < need {
                waiting.push_front(r);
                break;
            }
            // A request asked again (deferred) sends only the hashes the core lacks: none.
            let held = s.num_hashes(r.id.as_str()).map_or(0, |n| n as u32);
            let hashes: Vec<Key> = (held..r.prompt / BLOCK)
                .map(|p| key(&convs, r.conv, p))
                .collect();
            let (t0, a0) = (clock.now(), allocs());
            let n = s
                .lookup_request(&r.id, r.prompt, hashes, held as usize, 0)
                .unwrap();
            t.heap[2] += allocs() - a0;
            t.lookup += clock.since(t0);
            t.lookups += 1;
            let Some(n) = n else {
                deferred.push_back(r);
                continue;
            };
            r.blocks = free.split_off(free.len() - (r.prompt.div_ceil(BLOCK) as usize));
            let (t0, a0) = (clock.now(), allocs());
            let job = s
                .allocate(&r.id, std::slice::from_ref(&r.blocks), 0, n)
                .unwrap();
            t.heap[3] += allocs() - a0;
            t.allocate += clock.since(t0);
            t.allocs += 1;
            r.computed = n;
            r.loading = job.is_some();
            budget = budget.saturating_sub(r.prompt - n);
            running.push(r);
        }
        deferred.append(&mut waiting);
        waiting = deferred;
        // The step: prefill chunks, then decode.
        let mut budget = PREFILL_BUDGET;
        let mut input: StepInput<String> = StepInput {
            scheduled: Vec::new(),
            computed: Vec::new(),
            new_blocks: Vec::new(),
            resumed: Vec::new(),
            finished: std::mem::take(&mut finished_ids),
            aborted: Vec::new(),
            preempted: Vec::new(),
            written: Some(Vec::new()),
        };
        let written = input.written.as_mut().unwrap();
        let mut tails: Vec<(usize, u32, u32)> = Vec::new();
        for (ri, r) in running.iter_mut().enumerate() {
            if r.loading {
                continue;
            }
            let before = r.computed;
            if r.computed < r.prompt {
                let n = (r.prompt - r.computed).min(budget);
                if n == 0 {
                    continue;
                }
                budget -= n;
                r.computed += n;
            } else {
                r.computed += 1;
                r.decode_left -= 1;
                if r.computed > r.blocks.len() as u32 * BLOCK {
                    let nb = free.pop().expect("GPU blocks");
                    r.blocks.push(nb);
                    input.new_blocks.push((r.id.clone(), 0, vec![nb]));
                }
                // Full blocks of the decoded tokens get their hashes.
                if r.computed % BLOCK == 0 {
                    tails.push((ri, r.computed / BLOCK - 1, r.computed / BLOCK));
                }
            }
            written.extend_from_slice(
                &r.blocks[(before / BLOCK) as usize..r.computed.div_ceil(BLOCK) as usize],
            );
            input.scheduled.push(r.id.clone());
            input.computed.push(r.computed);
        }
        for (ri, from, to) in tails {
            let r = &running[ri];
            let h: Vec<Key> = (from..to).map(|p| key(&convs, r.conv, p)).collect();
            s.extend_hashes(r.id.as_str(), &h).unwrap();
        }
        let (t0, a0) = (clock.now(), allocs());
        let mut plan = s.schedule(black_box(&input)).unwrap();
        t.stores += plan.stores.len() as u64;
        t.loads += plan.loads.len() as u64;
        to_complete.extend(
            plan.loads
                .iter()
                .chain(&plan.stores)
                .map(|j| (j.id, 0, true)),
        );
        to_load.extend(
            plan.loads
                .iter_mut()
                .map(|j| std::mem::take(&mut j.request)),
        );
        // Handed back as the Python binding hands back every plan it encoded.
        s.recycle(plan);
        t.heap[0] += allocs() - a0;
        t.schedule += clock.since(t0);
        // Finished requests leave; their conversation idles.
        running.retain_mut(|r| {
            if r.decode_left > 0 {
                return true;
            }
            let cv = &mut convs[r.conv];
            cv.len = r.computed;
            free.extend_from_slice(&r.blocks);
            finished_ids.push(std::mem::take(&mut r.id));
            ready.push_back((step + u64::from(rng.range(10, 100)), r.conv));
            t.finished += 1;
            false
        });
    }
    let per = |d: Duration| d.as_secs_f64() * 1e6 / f64::from(steps);
    let total = t.schedule + t.complete + t.lookup + t.allocate;
    let n = f64::from(steps);
    println!(
        "workload b={b} steps={steps}: schedule {:.1} complete {:.1} lookup {:.1} allocate {:.1} \
         total {:.1} µs/step ; per step: {:.2} lookups {:.2} allocs \
         {:.2} stores {:.2} loads {:.2} finished; pool {} chunks\n\
         heap allocations per step: schedule {:.2} complete {:.2} lookup {:.2} allocate {:.2}",
        per(t.schedule),
        per(t.complete),
        per(t.lookup),
        per(t.allocate),
        per(total),
        t.lookups as f64 / n,
        t.allocs as f64 / n,
        t.stores as f64 / n,
        t.loads as f64 / n,
        t.finished as f64 / n,
        s.pool(0).map_or(0, kvoffload::pool::Pool::len),
        t.heap[0] as f64 / n,
        t.heap[1] as f64 / n,
        t.heap[2] as f64 / n,
        t.heap[3] as f64 / n,
    );
    println!(
        "{:?}\nrunning {} waiting {} free blocks {}",
        s.stats(),
        running.len(),
        waiting.len(),
        free.len()
    );
}
