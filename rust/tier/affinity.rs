//! `io_cpus`: the CPUs the lower tiers' I/O threads may run on.
//!
//! On a machine with few cores, the I/O threads' checksums and copies take CPU time from the
//! engine's Python thread even at the lowest priority (the stall budget, DESIGN.md §7). Pinned to a CPU
//! set of their own (and the engine kept off it), they cannot. A [`CpuSet`] is checked once,
//! when it is made, before any thread starts; each I/O thread then pins itself
//! ([`CpuSet::pin_current_thread`]) and the threads it starts (the checksum helpers, the shared
//! tier's connections) inherit the set. Linux only (`sched_setaffinity`); elsewhere making a
//! set fails and says so.

use crate::error::{Error, Result};

/// A checked, non-empty set of CPU ids, in the order given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuSet(Vec<usize>);

impl CpuSet {
    /// Checks `ids`: not empty, each `>= 0`, no id twice, each among the CPUs the calling
    /// thread may run on (`sched_getaffinity(0)`). The error names the offending id.
    pub fn new(ids: &[i64]) -> Result<Self> {
        if ids.is_empty() {
            return Err(Error::Config(
                "io_cpus must name at least one CPU, got an empty set".into(),
            ));
        }
        let allowed = allowed_cpus()?;
        let mut out: Vec<usize> = Vec::with_capacity(ids.len());
        for &id in ids {
            let Ok(cpu) = usize::try_from(id) else {
                return Err(Error::Config(format!(
                    "io_cpus: CPU id {id} is negative (ids are >= 0)"
                )));
            };
            if out.contains(&cpu) {
                return Err(Error::Config(format!(
                    "io_cpus: CPU {cpu} is named twice in {ids:?}"
                )));
            }
            if !allowed.contains(&cpu) {
                return Err(Error::Config(format!(
                    "io_cpus: CPU {cpu} is not one this process may run on ({allowed:?})"
                )));
            }
            out.push(cpu);
        }
        Ok(Self(out))
    }

    /// The CPU ids, in the order given.
    pub fn ids(&self) -> &[usize] {
        &self.0
    }

    /// Pins the calling thread to this set; threads it starts afterwards inherit it.
    pub fn pin_current_thread(&self) -> Result<()> {
        pin(&self.0)
    }
}

/// The first thing a thread started for `cpus` does: pins itself to the set (nothing without
/// one) and tells its starter how it went on `report`, which waits for it before it returns.
/// Returns whether the thread may go on (`false`: it could not be pinned and must end).
pub fn pin_and_report(cpus: Option<&CpuSet>, report: &std::sync::mpsc::Sender<Result<()>>) -> bool {
    let pin = cpus.map_or(Ok(()), CpuSet::pin_current_thread);
    let ok = pin.is_ok();
    let _ = report.send(pin);
    ok
}

#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn allowed_cpus() -> Result<Vec<usize>> {
    // SAFETY: `cpu_set_t` is plain bits; all zeros is an empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, writable `cpu_set_t` of the size given; pid 0 is this thread.
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &raw mut set) };
    if rc != 0 {
        return Err(Error::Config(format!(
            "io_cpus: cannot read this thread's CPUs: {}",
            std::io::Error::last_os_error()
        )));
    }
    let max = usize::try_from(libc::CPU_SETSIZE).unwrap_or(0);
    // SAFETY: every id is below `CPU_SETSIZE`, inside the set.
    Ok((0..max)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn pin(cpus: &[usize]) -> Result<()> {
    // SAFETY: as in `allowed_cpus`.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        // SAFETY: `c` was found in a set read by `allowed_cpus`, so it is below `CPU_SETSIZE`.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: `set` is a valid `cpu_set_t` of the size given; pid 0 is the calling thread.
    let rc = unsafe {
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &raw const set)
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "io_cpus: cannot pin an I/O thread to CPUs {cpus:?}: {}",
            std::io::Error::last_os_error()
        )))
    }
}

#[cfg(not(target_os = "linux"))]
fn allowed_cpus() -> Result<Vec<usize>> {
    Err(Error::Config(
        "io_cpus: pinning threads to CPUs needs Linux (sched_setaffinity); leave io_cpus unset"
            .into(),
    ))
}

#[cfg(not(target_os = "linux"))]
fn pin(_: &[usize]) -> Result<()> {
    allowed_cpus().map(|_| ())
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::{allowed_cpus, CpuSet};

    fn own_cpus() -> Vec<usize> {
        allowed_cpus().unwrap()
    }

    #[test]
    fn bad_sets_name_the_offending_id() {
        let last = *own_cpus().last().unwrap() as i64;
        let err = |ids: &[i64]| CpuSet::new(ids).unwrap_err().to_string();
        assert!(err(&[]).contains("empty"));
        assert!(err(&[-3]).contains("-3"), "{}", err(&[-3]));
        assert!(err(&[last, last]).contains(&format!("CPU {last} is named twice")));
        let out = err(&[last + 1]);
        assert!(out.contains(&format!("CPU {}", last + 1)), "{out}");
        assert!(err(&[1 << 40]).contains(&format!("CPU {}", 1i64 << 40)));
    }

    #[test]
    fn a_pinned_thread_and_its_children_run_on_the_set_only() {
        let before = own_cpus();
        let cpu = *before.last().unwrap();
        let set = CpuSet::new(&[cpu as i64]).unwrap();
        assert_eq!(set.ids(), [cpu]);
        let (mine, child) = std::thread::spawn(move || {
            set.pin_current_thread().unwrap();
            (own_cpus(), std::thread::spawn(own_cpus).join().unwrap())
        })
        .join()
        .unwrap();
        assert_eq!((mine, child), (vec![cpu], vec![cpu]));
        assert_eq!(own_cpus(), before, "other threads keep theirs");
    }
}
