//! Bounded byte copies between registered KV tensors and the CPU pool (the CPU data plane).
//!
//! The data plane registers, once, every buffer it copies between (each KV tensor's storage and
//! the CPU pool) and, per KV group, where each tensor's rows sit in those buffers. A job then
//! names rows only by `(group, region, row)` indices, as run lists or as rows of a plan's
//! packed runs buffer read in place ([`crate::runs`], [`Copier::copy_packed`]): one checker
//! tests every run against the group's row counts before a byte moves (all or nothing) and
//! turns the runs into raw pieces itself, so no caller can read or write outside registered memory. The GPU-side rows
//! of every region are checked at registration to be disjoint from the CPU-side rows, so a copy
//! never overlaps its own source.
//!
//! Rows are split into contiguous pieces of at most [`PIECE`] bytes (large `memcpy` calls were
//! measured slower on the reference machine) and a large job is spread over a few threads by
//! bytes (rayon's warm pool).
//!
//! This is the only module with `unsafe` code. [`Copier::new`] is `unsafe`: its caller
//! guarantees that the registered buffers stay allocated for the copier's lifetime (the
//! bindings hold the Python buffer objects); everything after that is checked here.
//!
//! Why the CPU copy runs here and not in torch: `docs/design-notes.md`.

/// Largest contiguous piece copied by one `memcpy`.
pub const PIECE: usize = 256 << 10;

use std::ops::Range;

use crate::runs;

/// A contiguous piece: `(dst, src, len)` addresses.
type Piece = (usize, usize, usize);

/// One run as the checker sees it, whatever form it came in.
#[derive(Debug, Clone, Copy)]
struct Row {
    /// Index of the run (or packed row) in the call, for errors.
    run: usize,
    group: usize,
    region: Option<usize>,
    gpu: i64,
    cpu: i64,
    count: i64,
}

/// What went wrong with a registration or a copy. Nothing was copied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CopyError {
    /// A region's rows do not fit the registration.
    #[error("group {group} region {region}: {reason}")]
    Region {
        /// KV group index.
        group: usize,
        /// Region index within the group.
        region: usize,
        /// What does not fit.
        reason: String,
    },
    /// GPU-side and CPU-side rows share bytes: a copy could overlap its own source.
    #[error(
        "group {group} region {region}: its {side}-side rows overlap the other side's rows of \
         group {other_group} region {other_region}"
    )]
    Overlap {
        /// KV group index.
        group: usize,
        /// Region index within the group.
        region: usize,
        /// `"GPU"` or `"CPU"`.
        side: &'static str,
        /// KV group of the other region.
        other_group: usize,
        /// Region index of the other region.
        other_region: usize,
    },
    /// A run names a group that is not registered.
    #[error("run {run}: group {group} is not registered ({groups} groups)")]
    UnknownGroup {
        /// Index of the run in the call.
        run: usize,
        /// The group named.
        group: usize,
        /// Groups registered.
        groups: usize,
    },
    /// A run names a region its group does not have.
    #[error("run {run}: group {group} has {regions} regions, not region {region}")]
    UnknownRegion {
        /// Index of the run in the call.
        run: usize,
        /// The group.
        group: usize,
        /// The region named.
        region: usize,
        /// Regions of the group.
        regions: usize,
    },
    /// A run's rows leave the registered rows.
    #[error(
        "run {run} (group {group}): {side} rows {start}..{start}+{count} are outside the \
         {rows} registered rows"
    )]
    RowsOutOfRange {
        /// Index of the run in the call.
        run: usize,
        /// The group.
        group: usize,
        /// `"GPU"` or `"CPU"`.
        side: &'static str,
        /// First row, as given.
        start: i64,
        /// Row count, as given.
        count: i64,
        /// Rows registered on that side.
        rows: usize,
    },
    /// A packed runs buffer that is not a whole number of rows, or rows past its end.
    #[error("{reason}")]
    Packed {
        /// What is wrong.
        reason: String,
    },
    /// A run's three row lists differ in length.
    #[error("run {run}: {gpu} GPU starts, {cpu} CPU starts and {counts} counts")]
    Lengths {
        /// Index of the run in the call.
        run: usize,
        /// GPU starts given.
        gpu: usize,
        /// CPU starts given.
        cpu: usize,
        /// Counts given.
        counts: usize,
    },
}

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
        let rows = runs.iter().enumerate().flat_map(|(k, t)| {
            (0..t.counts.len()).map(move |i| Row {
                run: k,
                group: t.group,
                region: t.region,
                gpu: t.gpu[i],
                cpu: t.cpu[i],
                count: t.counts[i],
            })
        });
        self.row_pieces(dir, rows)
    }

    /// Checks every row and returns the raw pieces; nothing is copied. Both kinds of input
    /// (run lists, packed runs) come through here: one checker.
    fn row_pieces<I>(&self, dir: Direction, rows: I) -> Result<Vec<Piece>, CopyError>
    where
        I: Iterator<Item = Row> + Clone,
    {
        // Check everything first: a bad run copies nothing, even after good ones.
        for t in rows.clone() {
            let grp = self.groups.get(t.group).ok_or(CopyError::UnknownGroup {
                run: t.run,
                group: t.group,
                groups: self.groups.len(),
            })?;
            if let Some(region) = t.region {
                if region >= grp.regions.len() {
                    return Err(CopyError::UnknownRegion {
                        run: t.run,
                        group: t.group,
                        region,
                        regions: grp.regions.len(),
                    });
                }
            }
            let n = t.count;
            for (side, start, rows) in [("GPU", t.gpu, grp.gpu_rows), ("CPU", t.cpu, grp.cpu_rows)]
            {
                let fits = start >= 0
                    && n >= 0
                    && start
                        .checked_add(n)
                        .is_some_and(|end| usize::try_from(end).is_ok_and(|e| e <= rows));
                if !fits {
                    return Err(CopyError::RowsOutOfRange {
                        run: t.run,
                        group: t.group,
                        side,
                        start,
                        count: n,
                        rows,
                    });
                }
            }
        }
        let mut out = Vec::new();
        for t in rows {
            let grp = &self.groups[t.group];
            let regions = match t.region {
                Some(r) => &grp.regions[r..=r],
                None => &grp.regions[..],
            };
            // In range (checked above): row * stride + row_bytes <= buffer length.
            let (g0, c0, n) = (t.gpu as usize, t.cpu as usize, t.count as usize);
            let (d0, s0) = match dir {
                Direction::Store => (c0, g0),
                Direction::Load => (g0, c0),
            };
            for reg in regions {
                let (dst, src) = match dir {
                    Direction::Store => (reg.cpu, reg.gpu),
                    Direction::Load => (reg.gpu, reg.cpu),
                };
                let d = self.buffers[dst.buffer].base + dst.offset + d0 * dst.stride;
                let s = self.buffers[src.buffer].base + src.offset + s0 * src.stride;
                if dst.stride == reg.row_bytes && src.stride == reg.row_bytes {
                    push(&mut out, d, s, n * reg.row_bytes);
                } else {
                    for i in 0..n {
                        push(
                            &mut out,
                            d + i * dst.stride,
                            s + i * src.stride,
                            reg.row_bytes,
                        );
                    }
                }
            }
        }
        Ok(out)
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
        let n = runs::num_rows(buf).map_err(|e| CopyError::Packed {
            reason: e.to_string(),
        })?;
        if rows.start > rows.end || rows.end > n {
            return Err(CopyError::Packed {
                reason: format!("rows {rows:?} of a buffer of {n} rows"),
            });
        }
        let it = rows.map(|i| {
            let r = runs::row(buf, i);
            Row {
                run: i,
                group: r.group as usize,
                region,
                gpu: i64::from(r.gpu),
                cpu: i64::from(r.cpu),
                count: i64::from(r.len),
            }
        });
        let pieces = self.row_pieces(dir, it)?;
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

/// Copies pieces that [`Copier::row_pieces`] returned.
///
/// # Safety
/// `pieces` come from `row_pieces` of a live copier (so they lie inside its registered spans).
#[allow(unsafe_code)]
unsafe fn copy_checked(pieces: &[Piece], threads: usize) -> usize {
    let threads = if threads > 1 && !disjoint_destinations(pieces) {
        1 // the same bytes written twice: in order, never by two threads at once
    } else {
        threads
    };
    // SAFETY: every piece lies inside registered spans (checked by `row_pieces` against
    // extents checked by `new`), which the caller of `new` keeps allocated; a destination is
    // always on the other side of its source, and the sides are disjoint (checked by `new`);
    // pieces given to different threads write disjoint bytes (checked just above).
    unsafe { copy_pieces(pieces, threads) }
}

/// Appends `len` bytes from `src` to `dst` as pieces of at most [`PIECE`] bytes.
fn push(out: &mut Vec<Piece>, dst: usize, src: usize, len: usize) {
    let mut off = 0;
    while off < len {
        let n = PIECE.min(len - off);
        out.push((dst + off, src + off, n));
        off += n;
    }
}

/// Whether no two pieces write the same byte.
fn disjoint_destinations(pieces: &[Piece]) -> bool {
    let mut d: Vec<(usize, usize)> = pieces.iter().map(|p| (p.0, p.0 + p.2)).collect();
    d.sort_unstable();
    d.windows(2).all(|w| w[0].1 <= w[1].0)
}

/// Copies every piece, over up to `threads` threads (each takes a contiguous share of the
/// bytes). Returns the bytes copied.
///
/// # Safety
/// Every `(dst, src, len)` must describe valid, live memory: `len` readable bytes at `src` and
/// `len` writable bytes at `dst`, with no destination overlapping any source, and pieces run on
/// different threads writing disjoint bytes.
#[allow(unsafe_code)]
unsafe fn copy_pieces(pieces: &[Piece], threads: usize) -> usize {
    fn run(pieces: &[Piece]) {
        for &(dst, src, len) in pieces {
            // SAFETY: guaranteed by the caller of `copy_pieces`.
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) };
        }
    }
    let total: usize = pieces.iter().map(|p| p.2).sum();
    let threads = threads.clamp(1, pieces.len().max(1));
    if threads == 1 {
        run(pieces);
        return total;
    }
    // Rayon's pool keeps its threads warm: spawning threads per job cost about a fifth of the
    // bandwidth of a 64 MiB job on the reference machine.
    let share = total.div_ceil(threads);
    let mut parts = Vec::with_capacity(threads);
    let (mut start, mut acc) = (0, 0);
    for (i, p) in pieces.iter().enumerate() {
        acc += p.2;
        if acc >= share && i + 1 < pieces.len() {
            parts.push(&pieces[start..=i]);
            start = i + 1;
            acc = 0;
        }
    }
    parts.push(&pieces[start..]);
    rayon::scope(|scope| {
        for part in parts {
            scope.spawn(move |_| run(part));
        }
    });
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A "GPU" buffer of `g` bytes and a "CPU" buffer of `c` bytes.
    struct Bufs {
        gpu: Vec<u8>,
        cpu: Vec<u8>,
    }

    impl Bufs {
        fn new(g: usize, c: usize) -> Self {
            Self {
                gpu: (0..g).map(|i| (i % 251) as u8 + 1).collect(),
                cpu: vec![0; c],
            }
        }

        fn spans(&mut self) -> Vec<Span> {
            vec![
                Span {
                    base: self.gpu.as_mut_ptr() as usize,
                    len: self.gpu.len(),
                },
                Span {
                    base: self.cpu.as_mut_ptr() as usize,
                    len: self.cpu.len(),
                },
            ]
        }
    }

    fn space(buffer: usize, offset: usize, stride: usize) -> RowSpace {
        RowSpace {
            buffer,
            offset,
            stride,
        }
    }

    fn runs(group: usize, gpu: &[i64], cpu: &[i64], counts: &[i64]) -> Runs {
        Runs {
            group,
            region: None,
            gpu: gpu.to_vec(),
            cpu: cpu.to_vec(),
            counts: counts.to_vec(),
        }
    }

    /// One group, one region: 3 GPU rows of 500 bytes at stride 1000, 5 CPU rows at 600.
    fn strided(b: &mut Bufs) -> Copier {
        let g = Group {
            gpu_rows: 3,
            cpu_rows: 5,
            regions: vec![Region {
                gpu: space(0, 0, 1000),
                cpu: space(1, 0, 600),
                row_bytes: 500,
            }],
        };
        // SAFETY: the buffers outlive the copier in every test.
        #[allow(unsafe_code)]
        unsafe {
            Copier::new(b.spans(), vec![g]).unwrap()
        }
    }

    #[test]
    fn strided_rows_round_trip_over_threads() {
        let mut b = Bufs::new(3000, 3000);
        let c = strided(&mut b);
        let n = c
            .copy(Direction::Store, &[runs(0, &[0, 2], &[4, 1], &[1, 1])], 2)
            .unwrap();
        assert_eq!(n, 1000);
        assert_eq!(&b.cpu[2400..2900], &b.gpu[0..500]);
        assert_eq!(&b.cpu[600..1100], &b.gpu[2000..2500]);
        assert!(b.cpu[..600].iter().all(|x| *x == 0));
        assert!(b.cpu[2900..].iter().all(|x| *x == 0));
        b.gpu.fill(0);
        c.copy(Direction::Load, &[runs(0, &[1], &[4], &[1])], 1)
            .unwrap();
        assert_eq!(&b.gpu[1000..1500], &b.cpu[2400..2900]);
        assert!(b.gpu[1500..].iter().all(|x| *x == 0));
    }

    #[test]
    fn rows_outside_the_registration_copy_nothing() {
        let mut b = Bufs::new(3000, 3000);
        let c = strided(&mut b);
        for (g0, c0, n) in [(2, 0, 2), (0, 4, 2), (-1, 0, 1), (0, -1, 1), (0, 0, -1)] {
            let bad = [runs(0, &[0], &[0], &[1]), runs(0, &[g0], &[c0], &[n])];
            let e = c.copy(Direction::Store, &bad, 1).unwrap_err();
            assert!(matches!(e, CopyError::RowsOutOfRange { run: 1, .. }), "{e}");
        }
        let e = c
            .copy(
                Direction::Store,
                &[runs(0, &[i64::MAX], &[0], &[i64::MAX])],
                1,
            )
            .unwrap_err();
        assert!(e.to_string().contains(&i64::MAX.to_string()), "{e}");
        let e = c
            .copy(Direction::Load, &[runs(1, &[0], &[0], &[1])], 1)
            .unwrap_err();
        assert_eq!(e.to_string(), "run 0: group 1 is not registered (1 groups)");
        let e = c
            .copy(Direction::Load, &[runs(0, &[0, 1], &[0], &[1])], 1)
            .unwrap_err();
        assert!(matches!(e, CopyError::Lengths { .. }));
        let mut one = runs(0, &[0], &[0], &[1]);
        one.region = Some(1);
        assert!(matches!(
            c.copy(Direction::Load, &[one], 1),
            Err(CopyError::UnknownRegion { .. })
        ));
        assert!(
            b.cpu.iter().all(|x| *x == 0),
            "a rejected call copied bytes"
        );
    }

    #[test]
    fn registration_rejects_rows_past_their_buffer_and_overlapping_sides() {
        let mut b = Bufs::new(3000, 3000);
        let spans = b.spans();
        let mk = |gpu: RowSpace, cpu: RowSpace, row_bytes: usize| Group {
            gpu_rows: 3,
            cpu_rows: 5,
            regions: vec![Region {
                gpu,
                cpu,
                row_bytes,
            }],
        };
        let cases = [
            mk(space(0, 1, 1000), space(1, 0, 600), 500), // GPU end 2501 ok, CPU ok
            mk(space(0, 0, 1000), space(1, 1, 600), 500), // CPU ends at 2901: ok
            mk(space(0, 0, 1000), space(1, 401, 600), 500), // CPU ends at 3001 > 3000
            mk(space(0, 0, 400), space(1, 0, 600), 500),  // GPU rows overlap
            mk(space(0, 0, 1000), space(2, 0, 600), 500), // unknown buffer
            mk(space(0, 0, 1000), space(0, 1500, 100), 100), // CPU rows among the GPU rows
            mk(space(0, 0, usize::MAX), space(1, 0, 600), 500), // overflow
        ];
        let ok: Vec<bool> = cases
            .iter()
            .map(|g| {
                // SAFETY: the buffers outlive the (dropped at once) copier.
                #[allow(unsafe_code)]
                unsafe {
                    Copier::new(spans.clone(), vec![g.clone()]).is_ok()
                }
            })
            .collect();
        assert_eq!(ok, [true, true, false, false, false, false, false]);
    }

    #[test]
    fn contiguous_rows_merge_and_split_at_piece_size() {
        let rows = 600;
        let mut b = Bufs::new(rows << 10, rows << 10);
        let g = Group {
            gpu_rows: rows,
            cpu_rows: rows,
            regions: vec![Region {
                gpu: space(0, 0, 1 << 10),
                cpu: space(1, 0, 1 << 10),
                row_bytes: 1 << 10,
            }],
        };
        // SAFETY: the buffers outlive the copier.
        #[allow(unsafe_code)]
        let c = unsafe { Copier::new(b.spans(), vec![g]).unwrap() };
        let t = [runs(0, &[0], &[0], &[rows as i64])];
        let ps = c.pieces(Direction::Store, &t).unwrap();
        assert_eq!(ps.len(), (rows << 10).div_ceil(PIECE));
        assert_eq!(c.copy(Direction::Store, &t, 3).unwrap(), rows << 10);
        assert_eq!(b.cpu, b.gpu);
    }

    #[test]
    fn a_destination_written_twice_is_copied_in_order() {
        let mut b = Bufs::new(3000, 3000);
        let c = strided(&mut b);
        // CPU row 0 is written from GPU row 0, then from GPU row 2: the last one wins.
        let t = [runs(0, &[0, 2], &[0, 0], &[1, 1])];
        c.copy(Direction::Store, &t, 4).unwrap();
        assert_eq!(&b.cpu[..500], &b.gpu[2000..2500]);
    }

    #[test]
    fn packed_rows_copy_in_place_and_a_bad_row_copies_nothing() {
        let mut b = Bufs::new(3000, 3000);
        let c = strided(&mut b);
        let mut buf = Vec::new();
        for (job, gpu, cpu, len) in [(0, 0, 4, 1), (1, 1, 0, 2), (1, 2, 2, 9)] {
            let group = 0;
            runs::push(
                &mut buf,
                runs::Run {
                    job,
                    group,
                    gpu,
                    cpu,
                    len,
                },
            );
        }
        // Rows 0..2 only: the third row (out of range) is not read.
        assert_eq!(
            c.copy_packed(Direction::Store, &buf, 0..2, None, 2)
                .unwrap(),
            1500
        );
        assert_eq!(&b.cpu[2400..2900], &b.gpu[0..500]);
        assert_eq!(&b.cpu[0..500], &b.gpu[1000..1500]);
        assert_eq!(&b.cpu[600..1100], &b.gpu[2000..2500]);
        let before = b.cpu.clone();
        b.gpu.fill(9);
        let e = c
            .copy_packed(Direction::Store, &buf, 0..3, None, 1)
            .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("run 2 (group 0): GPU rows 2..2+9"),
            "{e}"
        );
        assert!(c
            .copy_packed(Direction::Store, &buf, 2..4, None, 1)
            .is_err());
        assert!(c
            .copy_packed(Direction::Store, &buf[..7], 0..0, None, 1)
            .is_err());
        assert_eq!(b.cpu, before, "a rejected call copied bytes");
        assert_eq!(
            c.copy_packed(Direction::Load, &buf, 1..1, None, 1).unwrap(),
            0
        );
    }
}
