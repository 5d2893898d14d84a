//! What the Scheduler reports: its counters and the pool and tier events, read under the core
//! lock into plain values (the Python objects are built after it is released).

use crate::pool::{PoolEventKind, PoolStats};
use crate::scheduler::Scheduler as Core;

/// The scheduler's, the job table's and the fence's counters, and each group's pool stats.
pub(super) fn snapshot(core: &Core) -> ([(&'static str, u64); 27], Vec<PoolStats>) {
    let st = core.stats();
    let (jobs, fence) = core.tracker_stats();
    let counters = [
        ("steps", st.steps),
        ("lookups", st.lookups),
        ("lookups_deferred", st.lookups_deferred),
        ("lookup_hit_tokens", st.lookup_hit_tokens),
        ("max_lookup_wait_steps", st.max_lookup_wait_steps),
        ("store_jobs", st.store_jobs),
        ("store_chunks", st.store_chunks),
        ("store_bytes", st.store_bytes),
        ("load_jobs", st.load_jobs),
        ("load_blocks", st.load_blocks),
        ("load_tokens", st.load_tokens),
        ("load_bytes", st.load_bytes),
        ("flushes_necessary", st.flushes_necessary),
        ("flushes_conservative", st.flushes_conservative),
        ("flushes_reset", st.flushes_reset),
        ("store_no_room", st.store_no_room),
        ("chunks_dropped", st.chunks_dropped),
        ("failed_stores", st.failed_stores),
        ("failed_loads", st.failed_loads),
        ("resets", st.resets),
        ("jobs_completed", jobs.completed),
        ("late_reports", jobs.late_reports),
        ("fence_checks", fence.checks),
        ("pending_jobs", core.pending_jobs().len() as u64),
        ("armed_pairs", core.armed_pairs() as u64),
        ("requests", core.num_requests() as u64),
        ("loading_requests", u64::from(core.loading_requests())),
    ];
    let pools = (0..core.config().groups.len())
        .map(|g| core.pool(g).expect("group pool").stats())
        .collect();
    (counters, pools)
}

/// Drains pool and tier events: `(kind, group, keys, medium)`, the pools' with medium `"cpu"`.
pub(super) fn take_events(core: &mut Core) -> Vec<(&'static str, u32, Vec<u128>, &'static str)> {
    let name = |k: PoolEventKind| match k {
        PoolEventKind::Stored => "stored",
        PoolEventKind::Removed => "removed",
    };
    let mut out: Vec<_> = core
        .take_events()
        .into_iter()
        .map(|e| {
            (
                name(e.kind),
                e.group,
                e.keys.iter().map(|k| k.0).collect(),
                "cpu",
            )
        })
        .collect();
    out.extend(core.take_tier_events().into_iter().map(|(g, e)| {
        (
            name(e.kind),
            g,
            e.keys.iter().map(|k| k.0).collect(),
            e.medium.as_str(),
        )
    }));
    out
}
