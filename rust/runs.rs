//! The packed copy runs of a step plan: how the plan's copies reach the data plane, once.
//!
//! The core allocates CPU slots in runs, so a job's copies are few runs of consecutive GPU
//! blocks with consecutive CPU positions. A plan hands the data plane all of them in one
//! buffer of little-endian `u32` rows of [`RUN_WORDS`] words: `job index, group, gpu start,
//! cpu start, length`, where the job index counts the plan's loads first, then its stores
//! ([`encode`]). The data plane checks the buffer once against its registered groups
//! ([`check`]: every row in range, the rows of one job consecutive, no destination written
//! twice by one job) and then reads the rows in place ([`row`]): no per-block list is ever
//! built between the core and the copy.

use std::ops::Range;

use crate::ids::BlockId;
use crate::scheduler::PlannedJob;

/// Words (`u32`) per run: job index, group, GPU start, CPU start, length.
pub const RUN_WORDS: usize = 5;
/// Bytes per run.
pub const RUN_BYTES: usize = RUN_WORDS * 4;

/// One run: `len` consecutive GPU blocks from `gpu` and CPU positions from `cpu` of `group`,
/// copied by the plan's job number `job`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// Index of the job in the plan (loads first, then stores).
    pub job: u32,
    /// KV group.
    pub group: u32,
    /// First GPU block.
    pub gpu: u32,
    /// First CPU position (`slot * blocks_per_chunk + offset`).
    pub cpu: u32,
    /// Blocks.
    pub len: u32,
}

/// What the checker must know of one registered KV group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupShape {
    /// GPU blocks of the group.
    pub gpu_rows: u32,
    /// CPU positions of the group.
    pub cpu_rows: u32,
    /// Bytes one block of the group holds, over all its registered tensors.
    pub bytes_per_block: u64,
    /// Registered tensors (regions) of the group: copies per run.
    pub regions: u64,
}

/// One job's part of a checked buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobRows {
    /// Its rows in the buffer.
    pub rows: Range<usize>,
    /// Bytes it copies.
    pub bytes: u64,
    /// Copies it issues (one per run per region).
    pub copies: u64,
}

/// Why a runs buffer was refused. Nothing was copied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RunsError {
    /// The buffer is not a whole number of rows.
    #[error("runs: {len} bytes is not a whole number of {RUN_BYTES}-byte rows")]
    Length {
        /// Bytes given.
        len: usize,
    },
    /// A row names a job the plan does not have.
    #[error("runs row {row}: job index {job}, but the plan has {jobs} jobs")]
    UnknownJob {
        /// Row index.
        row: usize,
        /// The job index named.
        job: u32,
        /// Jobs in the plan.
        jobs: usize,
    },
    /// A job's rows are not consecutive (rows must be sorted by job index).
    #[error("runs row {row}: job index {job} comes after job index {after}")]
    Order {
        /// Row index.
        row: usize,
        /// The job index named.
        job: u32,
        /// The job index of the row before.
        after: u32,
    },
    /// A row names a group that is not registered.
    #[error("runs row {row}: group {group} is not registered ({groups} groups)")]
    UnknownGroup {
        /// Row index.
        row: usize,
        /// The group named.
        group: u32,
        /// Groups registered.
        groups: usize,
    },
    /// A row's blocks or positions leave the group.
    #[error(
        "runs row {row} (group {group}): {side} {start}..{start}+{len} is out of range [0, {rows})"
    )]
    OutOfRange {
        /// Row index.
        row: usize,
        /// The group.
        group: u32,
        /// `"gpu_blocks"` or `"cpu_blocks"`.
        side: &'static str,
        /// First block or position.
        start: u32,
        /// Length of the run.
        len: u32,
        /// Blocks or positions of the group.
        rows: u32,
    },
    /// A job writes one block or position twice.
    #[error("runs row {row}: job index {job} writes {side} {at} of group {group} twice")]
    Twice {
        /// Row index (the later of the two).
        row: usize,
        /// The job index.
        job: u32,
        /// The group.
        group: u32,
        /// `"gpu_blocks"` (a load) or `"cpu_blocks"` (a store).
        side: &'static str,
        /// The first block or position written twice.
        at: u32,
    },
}

/// Row `i` of a buffer whose length is a multiple of [`RUN_BYTES`] and that has more than `i`
/// rows.
///
/// # Panics
/// If the buffer has no row `i`.
#[must_use]
pub fn row(buf: &[u8], i: usize) -> Run {
    let b = &buf[i * RUN_BYTES..(i + 1) * RUN_BYTES];
    let w = |k: usize| u32::from_le_bytes([b[4 * k], b[4 * k + 1], b[4 * k + 2], b[4 * k + 3]]);
    Run {
        job: w(0),
        group: w(1),
        gpu: w(2),
        cpu: w(3),
        len: w(4),
    }
}

/// Rows in `buf`.
///
/// # Errors
/// A buffer that is not a whole number of rows.
pub fn num_rows(buf: &[u8]) -> Result<usize, RunsError> {
    if buf.len() % RUN_BYTES == 0 {
        Ok(buf.len() / RUN_BYTES)
    } else {
        Err(RunsError::Length { len: buf.len() })
    }
}

/// Checks a plan's runs buffer for `jobs` jobs, of which the first `loads` are loads (they
/// write GPU blocks; the others write CPU positions), against the registered `groups`; returns
/// each job's rows, bytes and copies. A job without rows gets an empty range.
///
/// # Errors
/// A buffer that is not a whole number of rows, or the first bad row: an unknown job or
/// group, a job index smaller than the row before's, blocks or positions out of range, or a
/// destination a job writes twice.
pub fn check(
    buf: &[u8],
    jobs: usize,
    loads: usize,
    groups: &[GroupShape],
) -> Result<Vec<JobRows>, RunsError> {
    let n = num_rows(buf)?;
    let mut out: Vec<JobRows> = (0..jobs)
        .map(|_| JobRows {
            rows: 0..0,
            bytes: 0,
            copies: 0,
        })
        .collect();
    let mut dests: Vec<(u32, u32, u32, usize)> = Vec::new(); // (group, start, end, row)
    let mut prev: Option<u32> = None;
    for i in 0..n {
        let r = row(buf, i);
        let k = r.job as usize;
        if k >= jobs {
            return Err(RunsError::UnknownJob {
                row: i,
                job: r.job,
                jobs,
            });
        }
        if let Some(p) = prev.filter(|p| *p > r.job) {
            return Err(RunsError::Order {
                row: i,
                job: r.job,
                after: p,
            });
        }
        if prev != Some(r.job) {
            check_twice(&mut dests, prev, loads)?;
            out[k].rows = i..i;
        }
        prev = Some(r.job);
        let g = groups
            .get(r.group as usize)
            .ok_or(RunsError::UnknownGroup {
                row: i,
                group: r.group,
                groups: groups.len(),
            })?;
        for (side, start, rows) in [
            ("gpu_blocks", r.gpu, g.gpu_rows),
            ("cpu_blocks", r.cpu, g.cpu_rows),
        ] {
            if start.checked_add(r.len).is_none_or(|end| end > rows) {
                return Err(RunsError::OutOfRange {
                    row: i,
                    group: r.group,
                    side,
                    start,
                    len: r.len,
                    rows,
                });
            }
        }
        let dest = if k < loads { r.gpu } else { r.cpu };
        if r.len > 0 {
            dests.push((r.group, dest, dest + r.len, i));
        }
        let job = &mut out[k];
        job.rows.end = i + 1;
        job.bytes += u64::from(r.len) * g.bytes_per_block;
        job.copies += g.regions;
    }
    check_twice(&mut dests, prev, loads)?;
    Ok(out)
}

/// Refuses a job (index `job`) whose destination intervals `dests` overlap; clears them.
fn check_twice(
    dests: &mut Vec<(u32, u32, u32, usize)>,
    job: Option<u32>,
    loads: usize,
) -> Result<(), RunsError> {
    let Some(job) = job else { return Ok(()) };
    dests.sort_unstable();
    let side = if (job as usize) < loads {
        "gpu_blocks"
    } else {
        "cpu_blocks"
    };
    for w in dests.windows(2) {
        let ((g0, _, e0, r0), (g1, s1, _, r1)) = (w[0], w[1]);
        if g0 == g1 && s1 < e0 {
            return Err(RunsError::Twice {
                row: r0.max(r1),
                job,
                group: g1,
                side,
                at: s1,
            });
        }
    }
    dests.clear();
    Ok(())
}

/// Appends one row to `out`.
pub fn push(out: &mut Vec<u8>, r: Run) {
    for w in [r.job, r.group, r.gpu, r.cpu, r.len] {
        out.extend_from_slice(&w.to_le_bytes());
    }
}

/// The runs of a plan's jobs (loads first, then stores): consecutive GPU blocks with
/// consecutive CPU positions form one run. The buffer is sized once, for a run per block at
/// most (a step's few hundred blocks: a few KiB), not grown run by run.
pub fn encode<'a>(jobs: impl Iterator<Item = &'a PlannedJob> + Clone) -> Vec<u8> {
    let blocks: usize = jobs
        .clone()
        .flat_map(|j| &j.transfers)
        .map(|t| t.gpu_blocks.len())
        .sum();
    let mut out = Vec::with_capacity(blocks * RUN_BYTES);
    for (k, job) in jobs.enumerate() {
        for t in &job.transfers {
            push_copies(&mut out, k as u32, t.group, &t.gpu_blocks, &t.cpu_blocks);
        }
    }
    out
}

/// Appends the runs of job number `job`'s copies in `group`: GPU block `gpu_blocks[i]` to CPU
/// position `cpu_blocks[i]`, consecutive pairs merged.
pub fn push_copies(
    out: &mut Vec<u8>,
    job: u32,
    group: u32,
    gpu_blocks: &[BlockId],
    cpu_blocks: &[u32],
) {
    debug_assert_eq!(gpu_blocks.len(), cpu_blocks.len());
    let n = gpu_blocks.len();
    let mut i = 0;
    while i < n {
        let (g0, c0) = (gpu_blocks[i].0, cpu_blocks[i]);
        let mut len = 1;
        while i + len < n
            && gpu_blocks[i + len].0 == g0.wrapping_add(len as u32)
            && cpu_blocks[i + len] == c0.wrapping_add(len as u32)
        {
            len += 1;
        }
        push(
            out,
            Run {
                job,
                group,
                gpu: g0,
                cpu: c0,
                len: len as u32,
            },
        );
        i += len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{BlockId, JobId};
    use crate::jobs::JobKind;
    use crate::scheduler::GroupTransfer;

    fn words(b: &[u8]) -> Vec<u32> {
        b.chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    fn buf(rows: &[[u32; RUN_WORDS]]) -> Vec<u8> {
        let mut out = Vec::new();
        for r in rows {
            push(
                &mut out,
                Run {
                    job: r[0],
                    group: r[1],
                    gpu: r[2],
                    cpu: r[3],
                    len: r[4],
                },
            );
        }
        out
    }

    const SHAPES: [GroupShape; 2] = [
        GroupShape {
            gpu_rows: 10,
            cpu_rows: 8,
            bytes_per_block: 100,
            regions: 2,
        },
        GroupShape {
            gpu_rows: 4,
            cpu_rows: 4,
            bytes_per_block: 10,
            regions: 1,
        },
    ];

    #[test]
    fn runs_coalesce_consecutive_blocks_and_slots_only() {
        let job = |id, gpu: &[u32], cpu: &[u32]| PlannedJob {
            id: JobId(id),
            kind: JobKind::Store,
            request: "r".into(),
            transfers: vec![GroupTransfer {
                group: 1,
                gpu_blocks: gpu.iter().map(|b| BlockId(*b)).collect(),
                cpu_blocks: cpu.to_vec(),
                keys: Vec::new(),
            }],
        };
        let jobs = [job(7, &[4, 5, 6, 9], &[10, 11, 13, 14]), job(8, &[1], &[0])];
        let b = encode(jobs.iter());
        assert_eq!(
            words(&b),
            vec![0, 1, 4, 10, 2, 0, 1, 6, 13, 1, 0, 1, 9, 14, 1, 1, 1, 1, 0, 1]
        );
        assert_eq!(
            row(&b, 1),
            Run {
                job: 0,
                group: 1,
                gpu: 6,
                cpu: 13,
                len: 1
            }
        );
    }

    #[test]
    fn check_returns_each_jobs_rows_bytes_and_copies() {
        // job 0 (a load) in both groups, job 1 without rows, job 2 (a store).
        let b = buf(&[[0, 0, 0, 0, 3], [0, 1, 0, 3, 1], [2, 0, 5, 5, 3]]);
        let got = check(&b, 3, 1, &SHAPES).unwrap();
        assert_eq!(
            got,
            vec![
                JobRows {
                    rows: 0..2,
                    bytes: 310,
                    copies: 3
                },
                JobRows {
                    rows: 0..0,
                    bytes: 0,
                    copies: 0
                },
                JobRows {
                    rows: 2..3,
                    bytes: 300,
                    copies: 2
                },
            ]
        );
        assert_eq!(check(&[], 2, 0, &SHAPES).unwrap()[1].rows, 0..0);
    }

    #[test]
    fn bad_rows_are_named() {
        let cases: [(&[[u32; RUN_WORDS]], &str); 8] = [
            (
                &[[0, 0, 0, 0, 1], [2, 0, 0, 0, 1]],
                "runs row 1: job index 2, but the plan has 2",
            ),
            (&[[0, 2, 0, 0, 1]], "runs row 0: group 2 is not registered"),
            (
                &[[0, 0, 8, 0, 3]],
                "runs row 0 (group 0): gpu_blocks 8..8+3 is out of range [0, 10)",
            ),
            (
                &[[1, 1, 0, 2, 3]],
                "cpu_blocks 2..2+3 is out of range [0, 4)",
            ),
            (&[[0, 0, u32::MAX, 0, 2]], "out of range"),
            (
                &[[1, 0, 0, 0, 1], [0, 0, 1, 1, 1]],
                "runs row 1: job index 0 comes after job index 1",
            ),
            (
                &[[0, 0, 0, 0, 1], [1, 0, 1, 1, 1], [0, 0, 2, 2, 1]],
                "row 2: job index 0 comes after",
            ),
            (
                &[[1, 0, 0, 4, 2], [1, 0, 6, 5, 1]],
                "runs row 1: job index 1 writes cpu_blocks 5 of group 0 twice",
            ),
        ];
        for (rows, needle) in cases {
            let e = check(&buf(rows), 2, 1, &SHAPES).unwrap_err().to_string();
            assert!(e.contains(needle), "{e} lacks {needle}");
        }
        // A load writes GPU blocks: the same CPU positions twice are fine, GPU blocks are not.
        assert!(check(&buf(&[[0, 0, 0, 4, 1], [0, 0, 1, 4, 1]]), 2, 1, &SHAPES).is_ok());
        let e = check(
            &buf(&[[0, 0, 2, 0, 2], [0, 1, 2, 0, 1], [0, 0, 3, 4, 1]]),
            2,
            1,
            &SHAPES,
        );
        assert!(e
            .unwrap_err()
            .to_string()
            .contains("writes gpu_blocks 3 of group 0 twice"));
        let e = check(&[0; 21], 1, 0, &SHAPES).unwrap_err();
        assert_eq!(e, RunsError::Length { len: 21 });
    }
}
