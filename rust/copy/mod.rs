//! Bounded byte copies between registered KV tensors and the CPU pool (the CPU data plane).
//!
//! The data plane registers, once, every buffer it copies between (each KV tensor's storage and
//! the CPU pool) and, per KV group, where each tensor's rows sit in those buffers. A job then
//! names rows only by `(group, region, row)` indices, as run lists or as rows of a plan's
//! packed runs buffer read in place ([`crate::runs`], [`Copier::copy_packed`]): one checker
//! tests every run against the group's row counts before a byte moves (all or nothing) and
//! turns the runs into raw pieces itself, so no caller can read or write outside registered
//! memory. The GPU-side rows of every region are checked at registration to be disjoint from the
//! CPU-side rows, so a copy never overlaps its own source.
//!
//! Rows are split into contiguous pieces of at most [`PIECE`] bytes (large `memcpy` calls were
//! measured slower on the reference machine) and a large job is spread over a few threads by
//! bytes (rayon's warm pool).
//!
//! This is the only module with `unsafe` code (`exec`, and [`Copier::new`]'s contract).
//! [`Copier::new`] is `unsafe`: its caller guarantees that the registered buffers stay allocated
//! for the copier's lifetime (the bindings hold the Python buffer objects); everything after
//! that is checked here.
//!
//! The parts: `error` ([`CopyError`]), `input` (the two input forms, run lists and packed rows,
//! as one kind of row), `check` (the one checker, rows to raw pieces) and `exec` (the `unsafe`
//! copy of checked pieces); this file holds the registration and the entry points.
//!
//! Why the CPU copy runs here and not in torch: `docs/design-notes.md`.

/// Largest contiguous piece copied by one `memcpy`.
pub const PIECE: usize = 256 << 10;

use std::ops::Range;

mod check;
mod error;
mod exec;
mod input;
#[cfg(test)]
mod tests;

pub use self::error::CopyError;
use self::exec::{copy_checked, Piece};
pub use self::input::Runs;

/// A registered buffer: `len` bytes at address `base`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Address of the first byte.
    pub base: usize,
    /// Length in bytes.
    pub len: usize,
}

/// Where one tensor's rows sit: row `i` starts `offset + i * stride` bytes into a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowSpace {
    /// Index of the buffer in the registration.
    pub buffer: usize,
    /// Byte offset of row 0 in the buffer.
    pub offset: usize,
    /// Bytes between rows.
    pub stride: usize,
}

/// One registered tensor of a group: its rows on the GPU side and in the CPU pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// The KV tensor's rows (one row per GPU block).
    pub gpu: RowSpace,
    /// The CPU pool's rows (one row per CPU position).
    pub cpu: RowSpace,
    /// Bytes per row (one block of this tensor).
    pub row_bytes: usize,
}

/// A KV group: its row counts and regions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    /// GPU blocks (rows of every GPU-side row space).
    pub gpu_rows: usize,
    /// CPU positions (rows of every CPU-side row space).
    pub cpu_rows: usize,
    /// The group's tensors.
    pub regions: Vec<Region>,
}

/// Direction of a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// GPU rows → CPU rows.
    Store,
    /// CPU rows → GPU rows.
    Load,
}

/// Registered buffers and groups; copies between them, bounds-checked.
#[derive(Debug)]
pub struct Copier {
    buffers: Vec<Span>,
    groups: Vec<Group>,
}

/// Byte interval `[start, end)` of `rows` rows of a row space, or why it does not fit.
pub(crate) fn extent(
    buffers: &[Span],
    space: RowSpace,
    rows: usize,
    row_bytes: usize,
) -> Result<(usize, usize), String> {
    let Some(buf) = buffers.get(space.buffer) else {
        return Err(format!(
            "buffer {} is not registered ({} buffers)",
            space.buffer,
            buffers.len()
        ));
    };
    if rows > 1 && space.stride < row_bytes {
        return Err(format!(
            "rows overlap: stride {} < {row_bytes} bytes per row",
            space.stride
        ));
    }
    let end = if rows == 0 {
        Some(space.offset)
    } else {
        (rows - 1)
            .checked_mul(space.stride)
            .and_then(|b| b.checked_add(space.offset))
            .and_then(|b| b.checked_add(row_bytes))
    };
    match end {
        Some(end) if end <= buf.len && buf.base.checked_add(end).is_some() => {
            Ok((buf.base + space.offset, buf.base + end))
        }
        _ => Err(format!(
            "{rows} rows of {row_bytes} bytes (stride {}, offset {}) do not fit buffer {} of \
             {} bytes",
            space.stride, space.offset, space.buffer, buf.len
        )),
    }
}

impl Copier {
    /// Registers `buffers` and the `groups` of rows inside them.
    ///
    /// # Errors
    /// A region whose rows leave their buffer, rows that overlap each other, or GPU-side rows
    /// that share bytes with CPU-side rows.
    ///
    /// # Safety
    /// Every span must be memory that stays allocated, readable and writable for the whole
    /// lifetime of the copier. Bytes a copy touches may be accessed concurrently only by
    /// callers that accept torn bytes (the fence's business, not memory safety's).
    #[allow(unsafe_code)]
    pub unsafe fn new(buffers: Vec<Span>, groups: Vec<Group>) -> Result<Self, CopyError> {
        let mut gpu = Vec::new();
        let mut cpu = Vec::new();
        for (g, grp) in groups.iter().enumerate() {
            for (r, reg) in grp.regions.iter().enumerate() {
                let err = |reason: String| CopyError::Region {
                    group: g,
                    region: r,
                    reason,
                };
                if reg.row_bytes == 0 {
                    return Err(err("rows of 0 bytes".into()));
                }
                let gx = extent(&buffers, reg.gpu, grp.gpu_rows, reg.row_bytes)
                    .map_err(|e| err(format!("GPU side: {e}")))?;
                let cx = extent(&buffers, reg.cpu, grp.cpu_rows, reg.row_bytes)
                    .map_err(|e| err(format!("CPU side: {e}")))?;
                gpu.push((gx, g, r));
                cpu.push((cx, g, r));
            }
        }
        // No GPU-side interval may intersect a CPU-side one: sweep both sorted lists.
        gpu.sort_unstable();
        cpu.sort_unstable();
        let (mut i, mut j) = (0, 0);
        while i < gpu.len() && j < cpu.len() {
            let ((gs, ge), gg, gr) = gpu[i];
            let ((cs, ce), cg, cr) = cpu[j];
            if gs < ce && cs < ge {
                return Err(CopyError::Overlap {
                    group: gg,
                    region: gr,
                    side: "GPU",
                    other_group: cg,
                    other_region: cr,
                });
            }
            if ge <= ce {
                i += 1;
            } else {
                j += 1;
            }
        }
        Ok(Self { buffers, groups })
    }

    /// Registered groups.
    pub fn groups(&self) -> &[Group] {
        &self.groups
    }

    /// Checks every run and returns the raw pieces; nothing is copied.
    fn pieces(&self, dir: Direction, runs: &[Runs]) -> Result<Vec<Piece>, CopyError> {
        self.row_pieces(dir, input::run_rows(runs)?)
    }

    /// Copies rows `rows` of a packed runs buffer ([`crate::runs`]) in direction `dir`, for
    /// every region of each run's group (or only `region`), over up to `threads` threads.
    /// Returns the bytes copied. Every row is checked here again, whoever checked it before.
    ///
    /// # Errors
    /// A buffer that is not a whole number of rows, `rows` past its end, or a row that names
    /// an unknown group or region or leaves the registered rows (the error names the row's
    /// index in the buffer). Nothing is copied then.
    pub fn copy_packed(
        &self,
        dir: Direction,
        buf: &[u8],
        rows: Range<usize>,
        region: Option<usize>,
        threads: usize,
    ) -> Result<usize, CopyError> {
        let pieces = self.row_pieces(dir, input::packed_rows(buf, rows, region)?)?;
        // SAFETY: the pieces were just made by this copier's `row_pieces`.
        #[allow(unsafe_code)]
        let copied = unsafe { copy_checked(&pieces, threads) };
        Ok(copied)
    }

    /// Copies the rows of every run in direction `dir`, over up to `threads` threads. Returns
    /// the bytes copied.
    ///
    /// # Errors
    /// A run that names an unknown group or region, or rows outside the registered rows.
    /// Nothing is copied then.
    pub fn copy(&self, dir: Direction, runs: &[Runs], threads: usize) -> Result<usize, CopyError> {
        let pieces = self.pieces(dir, runs)?;
        // SAFETY: the pieces were just made by this copier's `row_pieces`.
        #[allow(unsafe_code)]
        let copied = unsafe { copy_checked(&pieces, threads) };
        Ok(copied)
    }
}
