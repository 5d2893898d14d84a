//! `kvoffload._core.copy_rows`: one job's copies in one call, with the GIL released.

use pyo3::prelude::*;

use super::errors::KvOffloadError;
use crate::copy::{copy_pieces, pieces, Rows};

/// One region's copies: `(dst_base, dst_stride, src_base, src_stride, row_bytes, dst_rows,
/// src_rows, counts)`; run `i` copies `counts[i]` rows from row `src_rows[i]` to row
/// `dst_rows[i]`.
type Plan = (
    usize,
    usize,
    usize,
    usize,
    usize,
    Vec<usize>,
    Vec<usize>,
    Vec<usize>,
);

/// Copies the rows of every plan (addresses of memory the caller owns and keeps alive),
/// releasing the GIL, over up to `threads` threads. Returns the bytes copied. Private to the
/// data plane: addresses are trusted.
#[pyfunction]
#[pyo3(signature = (plans, threads = 1))]
pub fn copy_rows(py: Python<'_>, plans: Vec<Plan>, threads: usize) -> PyResult<usize> {
    let mut rows = Vec::new();
    for (i, (dst, dst_stride, src, src_stride, row_bytes, d, s, n)) in plans.into_iter().enumerate()
    {
        if d.len() != s.len() || d.len() != n.len() {
            return Err(KvOffloadError::new_err(format!(
                "copy plan {i}: {} destination rows, {} source rows, {} counts",
                d.len(),
                s.len(),
                n.len()
            )));
        }
        for ((&dr, &sr), &count) in d.iter().zip(&s).zip(&n) {
            let at = |base: usize, stride: usize, row: usize| {
                row.checked_mul(stride).and_then(|o| base.checked_add(o))
            };
            let (Some(dst), Some(src)) = (at(dst, dst_stride, dr), at(src, src_stride, sr)) else {
                return Err(KvOffloadError::new_err(format!(
                    "copy plan {i}: row address overflows"
                )));
            };
            rows.push(Rows {
                dst,
                dst_stride,
                src,
                src_stride,
                row_bytes,
                count,
            });
        }
    }
    let pieces =
        pieces(&rows).ok_or_else(|| KvOffloadError::new_err("copy plan: address overflows"))?;
    #[allow(unsafe_code)]
    // SAFETY: the data plane passes addresses of tensors it owns and keeps alive for the
    // call, with rows inside their bounds; destination and source never overlap (a CPU region
    // and a KV tensor are distinct allocations).
    let copied = py.detach(|| unsafe { copy_pieces(&pieces, threads) });
    Ok(copied)
}
