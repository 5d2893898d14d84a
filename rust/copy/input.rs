//! The copier's two input forms, run lists ([`Runs`]) and rows of a packed runs buffer
//! ([`crate::runs`], read in place), as one kind of [`Row`] for the checker.

use std::ops::Range;

use super::CopyError;
use crate::runs;

/// One run as the checker sees it, whatever form it came in.
#[derive(Debug, Clone, Copy)]
pub(super) struct Row {
    /// Index of the run (or packed row) in the call, for errors.
    pub(super) run: usize,
    pub(super) group: usize,
    pub(super) region: Option<usize>,
    pub(super) gpu: i64,
    pub(super) cpu: i64,
    pub(super) count: i64,
}

/// Runs of one transfer: run `i` copies `counts[i]` rows from/to GPU row `gpu[i]` and CPU row
/// `cpu[i]`, for every region of `group` (or only `region`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Runs {
    /// KV group.
    pub group: usize,
    /// One region of the group, or `None` for all of them.
    pub region: Option<usize>,
    /// First GPU row of each run.
    pub gpu: Vec<i64>,
    /// First CPU row of each run.
    pub cpu: Vec<i64>,
    /// Rows of each run.
    pub counts: Vec<i64>,
}

/// The rows of `runs`, after checking that each run's three lists have one length.
pub(super) fn run_rows(runs: &[Runs]) -> Result<impl Iterator<Item = Row> + Clone + '_, CopyError> {
    for (k, t) in runs.iter().enumerate() {
        if t.gpu.len() != t.counts.len() || t.cpu.len() != t.counts.len() {
            return Err(CopyError::Lengths {
                run: k,
                gpu: t.gpu.len(),
                cpu: t.cpu.len(),
                counts: t.counts.len(),
            });
        }
    }
    Ok(runs.iter().enumerate().flat_map(|(k, t)| {
        (0..t.counts.len()).map(move |i| Row {
            run: k,
            group: t.group,
            region: t.region,
            gpu: t.gpu[i],
            cpu: t.cpu[i],
            count: t.counts[i],
        })
    }))
}

/// Rows `rows` of the packed runs buffer `buf` (each for `region`, or every region), after
/// checking that the buffer is a whole number of rows and holds `rows`.
pub(super) fn packed_rows(
    buf: &[u8],
    rows: Range<usize>,
    region: Option<usize>,
) -> Result<impl Iterator<Item = Row> + Clone + '_, CopyError> {
    let n = runs::num_rows(buf).map_err(|e| CopyError::Packed {
        reason: e.to_string(),
    })?;
    if rows.start > rows.end || rows.end > n {
        return Err(CopyError::Packed {
            reason: format!("rows {rows:?} of a buffer of {n} rows"),
        });
    }
    Ok(rows.map(move |i| {
        let r = runs::row(buf, i);
        Row {
            run: i,
            group: r.group as usize,
            region,
            gpu: i64::from(r.gpu),
            cpu: i64::from(r.cpu),
            count: i64::from(r.len),
        }
    }))
}
