//! Arrays the kernel may back with huge pages, for the hot paths' random reads (prefetch
//! hints are [`crate::prefetch`]'s). Nothing here changes what the program computes.

/// `n` copies of `value` in memory the kernel may back with transparent huge pages (Linux,
/// where THP is enabled "always" or "madvise"): the pool's per-slot arrays (the index, the
/// records) are read at random, one cache miss a key, and with 4 KiB pages each of those misses
/// also walks the page table (its entries as cold as the data once the engine ran in between);
/// 2 MiB pages make that walk hit. Only the 2 MiB-aligned pages inside the allocation are
/// advised, before anything is written there; elsewhere (or where the advice is refused) this
/// is `vec![value; n]`.
pub(crate) fn huge_page_vec<T: Clone>(value: T, n: usize) -> Vec<T> {
    const HUGE: usize = 2 << 20;
    let mut v = Vec::with_capacity(n);
    let bytes = n * std::mem::size_of::<T>();
    if cfg!(target_os = "linux") && bytes >= 2 * HUGE {
        let start = v.as_ptr() as usize;
        let (lo, hi) = (start.next_multiple_of(HUGE), (start + bytes) / HUGE * HUGE);
        if hi > lo {
            advise_huge(lo, hi - lo);
        }
    }
    v.resize(n, value);
    v
}

/// Advises the kernel to back `len` bytes at `addr` with huge pages; a refusal changes nothing.
#[allow(unsafe_code)]
fn advise_huge(addr: usize, len: usize) {
    #[cfg(target_os = "linux")]
    // SAFETY: advice on whole pages inside an allocation this process owns and has not handed
    // out; `MADV_HUGEPAGE` changes how pages are backed, never their contents.
    unsafe {
        libc::madvise(addr as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (addr, len);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Advised or not, the vector is `vec![value; n]`: small ones (no whole huge page inside),
    /// ones holding several huge pages, and lengths that end mid-page.
    #[test]
    fn a_huge_page_vec_holds_n_copies_of_its_value() {
        for n in [0, 1, 17, (4 << 20) / 8 - 1, (6 << 20) / 8 + 3] {
            let v = huge_page_vec(0x5A5A_u64, n);
            assert_eq!(v.len(), n);
            assert!(v.iter().all(|&x| x == 0x5A5A), "n = {n}");
        }
        let v = huge_page_vec([7u32, 9], (5 << 20) / 8);
        assert!(v.iter().all(|&x| x == [7, 9]));
    }
}
