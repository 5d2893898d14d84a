//! Tier jobs and tier counters between the core and Python: a plan's tier jobs as tuples or
//! packed rows ([`encode_tier_jobs`]), the jobs a worker's `submit` / `submit_packed` take back
//! (checked: [`worker_jobs`], [`decode_tier_jobs`]), and a tier's counters as a dict. The
//! worker classes are `tier_worker.rs`.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::KvOffloadError;
use crate::ids::{JobId, Key};
use crate::scheduler::{TierGroupStats, TierJob, TierJobKind};
use crate::tier::io::WorkerJob;
use crate::tier::{Location, Medium};

/// One tier job as a plan carries it: `(job_id, kind, medium, group, keys, cpu_slots, places,
/// generations)`.
pub type TierJobTuple = (
    u64,
    &'static str,
    &'static str,
    u32,
    Vec<u128>,
    Vec<u32>,
    Vec<u64>,
    Vec<u64>,
);

/// A tier job as `submit` takes it (the tuple of a plan, kind and medium as strings).
pub type TierJobArg = (
    u64,
    String,
    String,
    u32,
    Vec<u128>,
    Vec<u32>,
    Vec<u64>,
    Vec<u64>,
);

/// A plan's tier job as a tuple.
pub fn tier_job_tuple(j: TierJob) -> TierJobTuple {
    (
        j.id.0,
        j.kind.name(),
        j.medium.as_str(),
        j.group,
        j.keys.iter().map(|k| k.0).collect(),
        j.cpu_slots,
        j.locations.iter().map(|l| l.place).collect(),
        j.locations.iter().map(|l| l.generation).collect(),
    )
}

/// Sets `d[name] = s.name` for every field `name` of `s` listed.
macro_rules! set_counters {
    ($d:expr, $s:expr, $($f:ident),* $(,)?) => {{
        $( $d.set_item(stringify!($f), $s.$f)?; )*
    }};
}
pub(crate) use set_counters;

/// One group's tier counters as a dict.
pub fn tier_stats_dict<'py>(py: Python<'py>, s: &TierGroupStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("medium", s.medium.as_str())?;
    d.set_item("group", s.group)?;
    let t = &s.tier;
    set_counters!(
        d,
        s,
        write_jobs,
        promote_jobs,
        failed_promotions,
        promote_no_room,
        promoted_chunks,
        write_us,
        promote_us,
        expired_promotions,
        held_slots,
        late_reports,
        dropped_writes,
        skipped_writes,
        write_pinned,
        skipped_lookups
    );
    set_counters!(
        d,
        t,
        capacity,
        used,
        bytes_capacity,
        hits,
        misses,
        writes,
        failed_writes,
        promotions,
        quarantined,
        evictions,
        no_room,
        writing,
        reading,
        checks,
        expired_checks,
        skipped_checks,
        asked_later,
        probations,
        recoveries,
        events_dropped
    );
    d.set_item("failed_write_jobs", s.failed_writes)?;
    d.set_item("queue_depth", s.pending)?;
    d.set_item("max_queue_depth", s.max_pending)?;
    d.set_item("promoting_chunks", s.promoting)?;
    Ok(d)
}

/// Tier jobs as plans carry them, checked, for a worker of `medium`.
pub fn worker_jobs(jobs: Vec<TierJobArg>, medium_of_worker: Medium) -> PyResult<Vec<WorkerJob>> {
    let mut out = Vec::with_capacity(jobs.len());
    for (id, kind, medium, group, keys, cpu_slots, places, gens) in jobs {
        let kind = match kind.as_str() {
            "write" => TierJobKind::Write,
            "promote" => TierJobKind::Promote,
            _ => {
                return Err(KvOffloadError::new_err(format!(
                    "tier job {id}: kind {kind:?} is neither \"write\" nor \"promote\""
                )))
            }
        };
        if medium != medium_of_worker.as_str() {
            return Err(KvOffloadError::new_err(format!(
                "tier job {id}: medium {medium:?} is not {medium_of_worker:?}"
            )));
        }
        if keys.len() != cpu_slots.len() || keys.len() != places.len() || keys.len() != gens.len() {
            return Err(KvOffloadError::new_err(format!(
                "tier job {id}: {} keys, {} slots, {} places, {} generations",
                keys.len(),
                cpu_slots.len(),
                places.len(),
                gens.len()
            )));
        }
        out.push(WorkerJob {
            id: JobId(id),
            kind,
            group,
            keys: keys.into_iter().map(Key).collect(),
            cpu_slots,
            locations: places
                .into_iter()
                .zip(gens)
                .map(|(place, generation)| Location { place, generation })
                .collect(),
        });
    }
    Ok(out)
}

/// Words (little-endian `u64`) per chunk row of a packed tier-job buffer.
pub const TIER_ROW_WORDS: usize = 8;

/// A plan's tier jobs packed for a worker: one row of [`TIER_ROW_WORDS`] little-endian `u64`
/// per chunk, `job id, kind (0 write, 1 promote) | medium (0 disk, 1 remote) << 8, group, key
/// (low 64 bits), key (high 64 bits), CPU slot, place, generation`; a job's rows are
/// consecutive. No Python object per chunk on either side.
pub fn encode_tier_jobs(jobs: &[TierJob]) -> Vec<u8> {
    let rows: usize = jobs.iter().map(|j| j.keys.len()).sum();
    let mut out = Vec::with_capacity(rows * TIER_ROW_WORDS * 8);
    for j in jobs {
        let kind = match j.kind {
            TierJobKind::Write => 0,
            TierJobKind::Promote => 1,
        } | (j.medium.code() << 8);
        for ((k, &slot), loc) in j.keys.iter().zip(&j.cpu_slots).zip(&j.locations) {
            let row: [u64; TIER_ROW_WORDS] = [
                j.id.0,
                kind,
                u64::from(j.group),
                k.0 as u64,
                (k.0 >> 64) as u64,
                u64::from(slot),
                loc.place,
                loc.generation,
            ];
            for w in row {
                out.extend_from_slice(&w.to_le_bytes());
            }
        }
    }
    out
}

/// The jobs of a packed tier-job buffer ([`encode_tier_jobs`]) for a worker of `medium`,
/// checked; rows of the other tier's jobs are skipped (a group with a disk and a shared tier
/// has a worker for each, both handed the plan's buffer). A buffer that is not whole rows, an
/// unknown kind or medium, a value out of range or a job whose rows are not consecutive raises
/// `KvOffloadError` naming the row.
pub fn decode_tier_jobs(buf: &[u8], medium: Medium) -> PyResult<Vec<WorkerJob>> {
    let row_bytes = TIER_ROW_WORDS * 8;
    if buf.len() % row_bytes != 0 {
        return Err(KvOffloadError::new_err(format!(
            "tier jobs: {} bytes is not a whole number of {row_bytes}-byte rows",
            buf.len()
        )));
    }
    let mut out: Vec<WorkerJob> = Vec::new();
    for (i, row) in buf.chunks_exact(row_bytes).enumerate() {
        let w: Vec<u64> = row
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect();
        let bad = |what: String| KvOffloadError::new_err(format!("tier jobs row {i}: {what}"));
        let kind = match w[1] & 0xff {
            0 => TierJobKind::Write,
            1 => TierJobKind::Promote,
            k => {
                return Err(bad(format!(
                    "kind {k} is neither 0 (write) nor 1 (promote)"
                )))
            }
        };
        match w[1] >> 8 {
            m if m == medium.code() => {}
            // The other tier's job: that tier's worker runs it.
            0 | 1 => continue,
            m => {
                return Err(bad(format!(
                    "medium code {m} is neither 0 (disk) nor 1 (remote)"
                )))
            }
        }
        let group = u32::try_from(w[2]).map_err(|_| bad(format!("group {}", w[2])))?;
        let slot = u32::try_from(w[5]).map_err(|_| bad(format!("CPU slot {}", w[5])))?;
        let key = Key(u128::from(w[3]) | (u128::from(w[4]) << 64));
        let location = Location {
            place: w[6],
            generation: w[7],
        };
        match out.last_mut() {
            Some(j) if j.id.0 == w[0] => {
                if j.kind != kind || j.group != group {
                    return Err(bad(format!("job {} changes kind or group", w[0])));
                }
                j.keys.push(key);
                j.cpu_slots.push(slot);
                j.locations.push(location);
            }
            _ => {
                if out.iter().any(|j| j.id.0 == w[0]) {
                    return Err(bad(format!("job {}'s rows are not consecutive", w[0])));
                }
                out.push(WorkerJob {
                    id: JobId(w[0]),
                    kind,
                    group,
                    keys: vec![key],
                    cpu_slots: vec![slot],
                    locations: vec![location],
                });
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    const DISK: Medium = Medium::Disk;
    const REMOTE: Medium = Medium::Remote;

    fn job(id: u64, kind: TierJobKind, medium: Medium, keys: &[u128]) -> TierJob {
        TierJob {
            id: JobId(id),
            kind,
            medium,
            group: 1,
            keys: keys.iter().map(|&k| Key(k)).collect(),
            cpu_slots: (0..keys.len() as u32).map(|s| s + 10).collect(),
            locations: (0..keys.len() as u64)
                .map(|p| Location {
                    place: p + 100,
                    generation: p + 7,
                })
                .collect(),
        }
    }

    #[test]
    fn packed_tier_jobs_round_trip_for_their_medium_only() {
        let big = (u128::from(u64::MAX) << 64) | 5;
        let jobs = [
            job(3, TierJobKind::Write, DISK, &[1, big]),
            job(4, TierJobKind::Promote, DISK, &[9]),
        ];
        let buf = encode_tier_jobs(&jobs);
        assert_eq!(buf.len(), 3 * TIER_ROW_WORDS * 8);
        let back = decode_tier_jobs(&buf, DISK).unwrap();
        assert_eq!(back.len(), jobs.len());
        for (b, j) in back.iter().zip(&jobs) {
            assert_eq!((b.id, b.kind, b.group), (j.id, j.kind, j.group));
            assert_eq!((&b.keys, &b.cpu_slots), (&j.keys, &j.cpu_slots));
            assert_eq!(b.locations, j.locations);
        }
        assert!(decode_tier_jobs(&encode_tier_jobs(&[]), DISK)
            .unwrap()
            .is_empty());
        // With both tiers, each worker takes its own medium's jobs from the plan's buffer.
        let mixed = encode_tier_jobs(&[
            job(5, TierJobKind::Write, DISK, &[1, 2]),
            job(6, TierJobKind::Promote, REMOTE, &[3]),
            job(7, TierJobKind::Write, REMOTE, &[4, 5]),
        ]);
        let ids = |m: Medium| -> Vec<u64> {
            let jobs = decode_tier_jobs(&mixed, m).unwrap();
            jobs.iter().map(|j| j.id.0).collect()
        };
        assert_eq!((ids(DISK), ids(REMOTE)), (vec![5], vec![6, 7]));
        assert!(decode_tier_jobs(&buf, REMOTE).unwrap().is_empty());
        // An unknown medium or kind, a torn buffer, rows of one job split apart: refused.
        let mut unknown = buf.clone();
        unknown[8 + 1] = 2;
        assert!(decode_tier_jobs(&unknown, DISK).is_err());
        let mut kind = buf.clone();
        kind[8] = 7;
        assert!(decode_tier_jobs(&kind, DISK).is_err());
        assert!(decode_tier_jobs(&buf[..buf.len() - 8], DISK).is_err());
        let split = [
            job(3, TierJobKind::Write, DISK, &[1]),
            job(4, TierJobKind::Write, DISK, &[2]),
            job(3, TierJobKind::Write, DISK, &[3]),
        ];
        assert!(decode_tier_jobs(&encode_tier_jobs(&split), DISK).is_err());
    }
}
