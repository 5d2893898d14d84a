//! The copy itself: checked pieces, over a few threads of rayon's warm pool. The only `unsafe`
//! code besides [`super::Copier::new`]'s contract.

/// A contiguous piece: `(dst, src, len)` addresses.
pub(super) type Piece = (usize, usize, usize);

/// Copies pieces that `Copier::row_pieces` returned.
///
/// # Safety
/// `pieces` come from `row_pieces` of a live copier (so they lie inside its registered spans).
#[allow(unsafe_code)]
pub(super) unsafe fn copy_checked(pieces: &[Piece], threads: usize) -> usize {
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
