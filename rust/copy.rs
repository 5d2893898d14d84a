//! Batched strided byte copies for the CPU data plane.
//!
//! The Python data plane plans a job as a few strided copies (runs of rows between a KV
//! tensor and its CPU region) and hands them over in one call, so the copy thread takes the
//! GIL once per job instead of once per run: an engine loop that holds the GIL can no longer
//! stall a load. Rows are split into contiguous pieces of at most [`PIECE`] bytes (large
//! `memcpy` calls were measured slower on the reference machine) and the pieces are spread
//! over a few threads by bytes (rayon's pool).
//!
//! This is the only module with `unsafe` code: it writes through raw addresses. Its caller
//! (the data plane, which owns every tensor involved) guarantees that they are valid.

/// Largest contiguous piece copied by one `memcpy`.
pub const PIECE: usize = 256 << 10;

/// `count` rows of `row_bytes` from `src` to `dst`, row `i` at `base + i * stride`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rows {
    /// Address of the first destination row.
    pub dst: usize,
    /// Bytes between destination rows.
    pub dst_stride: usize,
    /// Address of the first source row.
    pub src: usize,
    /// Bytes between source rows.
    pub src_stride: usize,
    /// Bytes per row.
    pub row_bytes: usize,
    /// Number of rows.
    pub count: usize,
}

/// A contiguous piece: `(dst, src, len)`.
pub type Piece = (usize, usize, usize);

/// Splits strided copies into contiguous pieces of at most [`PIECE`] bytes. Rows that follow
/// each other on both sides are merged first. `None` if an address overflows.
pub fn pieces(rows: &[Rows]) -> Option<Vec<Piece>> {
    let mut out = Vec::new();
    let mut push = |dst: usize, src: usize, len: usize| -> Option<()> {
        let mut off = 0;
        while off < len {
            let n = PIECE.min(len - off);
            out.push((dst.checked_add(off)?, src.checked_add(off)?, n));
            off += n;
        }
        Some(())
    };
    for r in rows {
        let total = r.row_bytes.checked_mul(r.count)?;
        if r.dst_stride == r.row_bytes && r.src_stride == r.row_bytes {
            push(r.dst, r.src, total)?;
        } else {
            for i in 0..r.count {
                let d = r.dst.checked_add(i.checked_mul(r.dst_stride)?)?;
                let s = r.src.checked_add(i.checked_mul(r.src_stride)?)?;
                push(d, s, r.row_bytes)?;
            }
        }
    }
    Some(out)
}

/// Copies every piece, over up to `threads` threads (each takes a contiguous share of the
/// bytes). Returns the bytes copied.
///
/// # Safety
/// Every `(dst, src, len)` must describe valid, live, non-overlapping memory: `len` readable
/// bytes at `src` and `len` writable bytes at `dst` that nothing else accesses during the call.
#[allow(unsafe_code)]
pub unsafe fn copy_pieces(pieces: &[Piece], threads: usize) -> usize {
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

    #[test]
    #[allow(unsafe_code)]
    fn strided_rows_round_trip_in_pieces_over_threads() {
        let src: Vec<u8> = (0..3 * 1000).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; 5 * 600];
        // Rows of 500 bytes: source stride 1000, destination stride 600.
        let rows = [Rows {
            dst: dst.as_mut_ptr() as usize,
            dst_stride: 600,
            src: src.as_ptr() as usize,
            src_stride: 1000,
            row_bytes: 500,
            count: 3,
        }];
        let ps = pieces(&rows).unwrap();
        assert_eq!(ps.len(), 3);
        // SAFETY: both buffers live for the call and the rows stay inside them.
        assert_eq!(unsafe { copy_pieces(&ps, 2) }, 1500);
        for r in 0..3 {
            assert_eq!(&dst[r * 600..r * 600 + 500], &src[r * 1000..r * 1000 + 500]);
            assert!(dst[r * 600 + 500..r * 600 + 600].iter().all(|b| *b == 0));
        }
    }

    #[test]
    fn contiguous_rows_merge_and_split_at_piece_size() {
        let rows = [Rows {
            dst: 0,
            dst_stride: 1 << 10,
            src: 1 << 30,
            src_stride: 1 << 10,
            row_bytes: 1 << 10,
            count: 600,
        }];
        let ps = pieces(&rows).unwrap();
        assert_eq!(ps.iter().map(|p| p.2).sum::<usize>(), 600 << 10);
        assert_eq!(ps.len(), (600usize << 10).div_ceil(PIECE));
        assert!(pieces(&[Rows {
            count: usize::MAX,
            ..rows[0]
        }])
        .is_none());
    }
}
