//! Cache prefetch hints for the hot paths whose data is cold on every call (an engine's own
//! work evicts the caches between two of its calls into the core).
//!
//! A prefetch does not hold up the instructions after it, where reading the value ahead
//! (`std::hint::black_box(*r)`) does: a load that misses blocks the core's retirement until its
//! line arrives, so a loop that reads ahead by loads still waits for every miss in turn.

/// Asks the CPU to bring the cache line holding `*r` in; changes nothing the program can see.
#[inline]
pub fn prefetch<T>(r: &T) {
    prefetch_ptr(std::ptr::from_ref(r).cast());
}

/// [`prefetch`] of the lines holding the first and the last byte of `*r` (a value that may
/// straddle two lines).
#[inline]
pub fn prefetch_all<T>(r: &T) {
    let p: *const u8 = std::ptr::from_ref(r).cast();
    prefetch_ptr(p);
    prefetch_ptr(p.wrapping_add(std::mem::size_of::<T>().saturating_sub(1)));
}

/// [`prefetch`] of a line by address (any address: a prefetch never faults).
#[inline]
#[allow(unsafe_code)]
pub fn prefetch_ptr(p: *const u8) {
    // SAFETY: a prefetch never faults and reads nothing the program sees, whatever `p` is.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}
