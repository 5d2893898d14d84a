//! The one checker: every row of a call is tested against its group's registration before a
//! byte moves (all or nothing), then turned into raw pieces of at most [`PIECE`] bytes.

use super::exec::Piece;
use super::input::Row;
use super::{Copier, CopyError, Direction, PIECE};

impl Copier {
    /// Checks every row and returns the raw pieces; nothing is copied. Both kinds of input
    /// (run lists, packed runs) come through here: one checker.
    pub(super) fn row_pieces<I>(&self, dir: Direction, rows: I) -> Result<Vec<Piece>, CopyError>
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
