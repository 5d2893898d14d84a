//! The job table: every asynchronous transfer in flight, with per-worker completion counting.
//!
//! Job ids are monotonic, so the table is a ring (`VecDeque`) indexed by `id - base`: creation
//! pushes at the back, completion clears a slot and pops finished slots from the front. Jobs
//! complete roughly in creation order, so the ring stays short. A job is done when every worker
//! rank `0..num_workers` reported it once: each report names its rank, so a duplicated report
//! can never stand in for another worker's (whose copy may still be running). Ids below the
//! last reset's floor are *late*: their completions are ignored and counted. A completion for a
//! job that already completed, for an id never issued, from a rank out of range or from a rank
//! that already reported the job is an error and changes nothing.
//!
//! The table also enforces the per-request rule of DESIGN.md §4, invariant 7: a request has one
//! pending load or any number of pending stores, never both.
//!
//! Completions are tied to worker ranks, a departure explained in `docs/design-notes.md`.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use crate::error::{Error, Result};
use crate::ids::{BlockId, JobId, OwnerId};

/// Direction of a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum JobKind {
    /// GPU -> CPU: reads its blocks.
    Store,
    /// CPU -> GPU: writes its blocks.
    Load,
}

/// One pending transfer.
#[derive(Debug, Clone)]
pub struct Job<P> {
    /// Its id.
    pub id: JobId,
    /// Store or load.
    pub kind: JobKind,
    /// The request it belongs to.
    pub owner: OwnerId,
    /// Its owner's entry in the table (a completion reaches the entry without hashing).
    entry: u32,
    /// GPU blocks of the *eager* class (armed in the fence from creation).
    pub eager: Vec<BlockId>,
    /// GPU blocks of the *deferred* class (armed once the owner releases its blocks).
    pub deferred: Vec<BlockId>,
    /// Whether the deferred blocks are armed.
    pub deferred_armed: bool,
    /// Whether any worker reported a failure.
    pub failed: bool,
    /// Worker reports still expected.
    pub remaining: u32,
    /// Ranks that reported (bit `r` for rank `r`).
    pub reported: u128,
    /// Caller data carried with the job (keys, slots, ...).
    pub payload: P,
}

/// Pending jobs of one request.
#[derive(Debug, Default, Clone)]
pub struct OwnerJobs {
    /// Pending store jobs.
    pub stores: u32,
    /// Pending load jobs (0 or 1).
    pub loads: u32,
    /// Ids of all pending jobs, in creation order.
    pub jobs: Vec<JobId>,
    /// The owner the entry is mapped to (`None`: a free entry), so that an entry named by a
    /// caller's hint can be checked ([`JobTable::insert_at`]).
    owner: Option<OwnerId>,
}

/// No entry hint: the owner is looked up by hash ([`JobTable::insert_at`]).
pub const NO_ENTRY: u32 = u32::MAX;

/// Result of one completion report.
#[derive(Debug)]
pub enum Completion<P> {
    /// More workers must still report.
    Pending {
        /// Reports still expected.
        remaining: u32,
    },
    /// The last worker reported: the job left the table.
    Done(Job<P>),
    /// The job was created before the last reset: the report is ignored (and counted).
    Late,
}

/// Counters of the job table.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct JobStats {
    /// Store jobs created.
    pub stores_created: u64,
    /// Load jobs created.
    pub loads_created: u64,
    /// Jobs that completed (all workers reported).
    pub completed: u64,
    /// Completed jobs with at least one failed report.
    pub failed: u64,
    /// Reports for jobs from before a reset, ignored.
    pub late_reports: u64,
    /// Resets.
    pub resets: u64,
}

/// Most worker ranks a job table serves (one bit each per job; 128 covers TP x PP = 8 x 16).
pub const MAX_WORKERS: u32 = 128;

/// The table of pending jobs.
#[derive(Debug)]
pub struct JobTable<P> {
    num_workers: u32,
    next: u64,
    floor: u64,
    base: u64,
    ring: VecDeque<Option<Job<P>>>,
    live: usize,
    /// Owners' entries, dense: each job names its owner's (`Job::entry`), so a completion
    /// reaches it without hashing the owner, and its cache line can be asked for ahead
    /// ([`JobTable::warm_owner`]). An owner keeps its entry while it has no pending job (a
    /// decoding request goes from one store job to the next), until [`JobTable::forget`], or
    /// until a sweep ([`JobTable::sweep`]) when idle entries outnumber both the busy ones and
    /// [`IDLE_ENTRIES`] (a caller that never forgets its owners).
    entries: Vec<OwnerJobs>,
    /// The entry of each owner that has one.
    slots: FxHashMap<OwnerId, u32>,
    /// Entries free for the next owners.
    free: Vec<u32>,
    /// Owners with pending jobs.
    busy: usize,
    stats: JobStats,
}

/// Idle owner entries a [`JobTable`] keeps at least before sweeping them.
const IDLE_ENTRIES: usize = 1024;

impl<P> JobTable<P> {
    /// An empty table whose jobs complete after `num_workers` reports each.
    pub fn new(num_workers: u32) -> Result<Self> {
        if num_workers == 0 || num_workers > MAX_WORKERS {
            return Err(Error::Config(format!(
                "num_workers must be in 1..={MAX_WORKERS}, got {num_workers}"
            )));
        }
        Ok(Self {
            num_workers,
            next: 0,
            floor: 0,
            base: 0,
            ring: VecDeque::new(),
            live: 0,
            entries: Vec::new(),
            slots: FxHashMap::default(),
            free: Vec::new(),
            busy: 0,
            stats: JobStats::default(),
        })
    }

    /// Workers that must report each job.
    pub fn num_workers(&self) -> u32 {
        self.num_workers
    }

    /// Checks that `owner` may get a job of `kind` (invariant 7).
    pub fn check_owner(&self, owner: OwnerId, kind: JobKind) -> Result<()> {
        self.check_owner_at(owner, NO_ENTRY, kind)
    }

    /// [`JobTable::check_owner`] with a hint of the owner's entry ([`JobTable::insert_at`]).
    pub fn check_owner_at(&self, owner: OwnerId, hint: u32, kind: JobKind) -> Result<()> {
        let Some(e) = self.find(owner, hint) else {
            return Ok(());
        };
        let o = &self.entries[e as usize];
        match kind {
            JobKind::Load if o.loads > 0 => Err(Error::OwnerBusy {
                owner,
                reason: "already has a pending load",
            }),
            JobKind::Load if o.stores > 0 => Err(Error::OwnerBusy {
                owner,
                reason: "has pending stores; a load must wait until they complete",
            }),
            JobKind::Store if o.loads > 0 => Err(Error::OwnerBusy {
                owner,
                reason: "has a pending load; stores must wait until it completes",
            }),
            _ => Ok(()),
        }
    }

    /// Adds a job. The caller has validated blocks and called [`JobTable::check_owner`].
    pub fn insert(
        &mut self,
        kind: JobKind,
        owner: OwnerId,
        eager: Vec<BlockId>,
        deferred: Vec<BlockId>,
        deferred_armed: bool,
        payload: P,
    ) -> JobId {
        let (id, _) = self.insert_at(
            kind,
            owner,
            NO_ENTRY,
            eager,
            deferred,
            deferred_armed,
            payload,
        );
        id
    }

    /// [`JobTable::insert`] with a hint of the owner's entry: what the owner's last
    /// `insert_at` returned beside its job id ([`NO_ENTRY`]: none). A hint still the owner's
    /// saves the lookup by hash (a cache miss on the map per job); a stale one (the entry was
    /// freed, swept, handed to another owner or reset since) is only ignored. Returns the
    /// job's id and the owner's entry, the hint for its next job.
    #[allow(clippy::too_many_arguments)]
    pub fn insert_at(
        &mut self,
        kind: JobKind,
        owner: OwnerId,
        hint: u32,
        eager: Vec<BlockId>,
        deferred: Vec<BlockId>,
        deferred_armed: bool,
        payload: P,
    ) -> (JobId, u32) {
        let id = JobId(self.next);
        self.next += 1;
        let entry = self.entry_of(owner, hint);
        let o = &mut self.entries[entry as usize];
        if o.jobs.is_empty() {
            self.busy += 1;
        }
        match kind {
            JobKind::Store => {
                o.stores += 1;
                self.stats.stores_created += 1;
            }
            JobKind::Load => {
                o.loads += 1;
                self.stats.loads_created += 1;
            }
        }
        o.jobs.push(id);
        if self.ring.is_empty() {
            self.base = id.0;
        }
        self.ring.push_back(Some(Job {
            id,
            kind,
            owner,
            entry,
            eager,
            deferred,
            deferred_armed,
            failed: false,
            remaining: self.num_workers,
            reported: 0,
            payload,
        }));
        self.live += 1;
        (id, entry)
    }

    /// The pending job `id`, if any.
    pub fn get(&self, id: JobId) -> Option<&Job<P>> {
        let i = id.0.checked_sub(self.base)?;
        self.ring.get(usize::try_from(i).ok()?)?.as_ref()
    }

    /// The pending job `id`, mutably.
    pub fn get_mut(&mut self, id: JobId) -> Option<&mut Job<P>> {
        let i = id.0.checked_sub(self.base)?;
        self.ring.get_mut(usize::try_from(i).ok()?)?.as_mut()
    }

    /// Validates a report of worker `worker` for `id` without changing anything: `Ok(false)`
    /// for a late report (a job from before the last reset).
    pub fn validate(&self, id: JobId, worker: u32) -> Result<bool> {
        if id.0 < self.floor {
            return Ok(false);
        }
        if id.0 >= self.next {
            return Err(Error::UnknownJob(id));
        }
        if worker >= self.num_workers {
            return Err(Error::WorkerOutOfRange {
                job: id,
                worker,
                num_workers: self.num_workers,
            });
        }
        let job = self.get(id).ok_or(Error::JobAlreadyCompleted(id))?;
        if job.reported & (1u128 << worker) != 0 {
            return Err(Error::DuplicateReport { job: id, worker });
        }
        Ok(true)
    }

    /// Records worker `worker`'s report for `id`; `ok == false` marks the job failed.
    pub fn complete(&mut self, id: JobId, worker: u32, ok: bool) -> Result<Completion<P>> {
        if !self.validate(id, worker)? {
            self.stats.late_reports += 1;
            return Ok(Completion::Late);
        }
        let idx = (id.0 - self.base) as usize;
        let job = self.ring[idx].as_mut().expect("validated");
        job.reported |= 1u128 << worker;
        job.remaining -= 1;
        job.failed |= !ok;
        if job.remaining > 0 {
            return Ok(Completion::Pending {
                remaining: job.remaining,
            });
        }
        let job = self.ring[idx].take().expect("validated");
        self.live -= 1;
        while matches!(self.ring.front(), Some(None)) {
            self.ring.pop_front();
            self.base += 1;
        }
        self.stats.completed += 1;
        self.stats.failed += u64::from(job.failed);
        let o = &mut self.entries[job.entry as usize];
        debug_assert_eq!(self.slots.get(&job.owner), Some(&job.entry));
        match job.kind {
            JobKind::Store => o.stores -= 1,
            JobKind::Load => o.loads -= 1,
        }
        if let Some(i) = o.jobs.iter().position(|j| *j == id) {
            o.jobs.remove(i);
        }
        if o.jobs.is_empty() {
            self.busy -= 1;
        }
        Ok(Completion::Done(job))
    }

    /// The entry of `owner`, if it has one: `hint` if that is still the owner's, else the
    /// map's.
    fn find(&self, owner: OwnerId, hint: u32) -> Option<u32> {
        match self.entries.get(hint as usize) {
            Some(o) if o.owner == Some(owner) => Some(hint),
            _ => self.slots.get(&owner).copied(),
        }
    }

    /// The entry of `owner` (`hint`: see [`JobTable::find`]), made (or taken from the free
    /// ones) if it has none. Sweeps the idle entries first when they are too many.
    fn entry_of(&mut self, owner: OwnerId, hint: u32) -> u32 {
        if let Some(e) = self.find(owner, hint) {
            return e;
        }
        if self.slots.len() - self.busy > IDLE_ENTRIES.max(self.busy) {
            self.sweep();
        }
        let e = self.free.pop().unwrap_or_else(|| {
            self.entries.push(OwnerJobs::default());
            u32::try_from(self.entries.len() - 1).expect("fewer than 2**32 owners")
        });
        self.slots.insert(owner, e);
        self.entries[e as usize].owner = Some(owner);
        e
    }

    /// Frees every idle entry (owners with no pending job): amortized over the entries made
    /// since the last sweep, which are at least as many.
    fn sweep(&mut self) {
        let entries = &mut self.entries;
        let free = &mut self.free;
        self.slots.retain(|_, e| {
            let o = &mut entries[*e as usize];
            let idle = o.jobs.is_empty();
            if idle {
                o.owner = None;
                free.push(*e);
            }
            !idle
        });
    }

    /// `owner` is gone for good (no job is pending for it, none will be created): its entry,
    /// if idle, serves the next owners. An owner with pending jobs keeps it.
    pub fn forget(&mut self, owner: OwnerId) {
        if let Some(&e) = self.slots.get(&owner) {
            if self.entries[e as usize].jobs.is_empty() {
                self.slots.remove(&owner);
                self.entries[e as usize].owner = None;
                self.free.push(e);
            }
        }
    }

    /// Asks for the entry of `job`'s owner ahead of the job's completion; changes nothing. The
    /// entry's address is known from the job, so the prefetch waits for no other miss, and
    /// those of a step's jobs overlap.
    pub fn warm_owner(&self, job: &Job<P>) {
        if let Some(e) = self.entries.get(job.entry as usize) {
            crate::prefetch::prefetch(e);
        }
    }

    /// Asks for the job list of `job`'s owner (once [`JobTable::warm_owner`] brought its entry
    /// in); changes nothing.
    pub fn warm_owner_jobs(&self, job: &Job<P>) {
        if let Some(e) = self.entries.get(job.entry as usize) {
            crate::prefetch::prefetch_ptr(e.jobs.as_ptr().cast());
        }
    }

    /// Pending jobs of `owner` (`None`: none pending).
    pub fn owner(&self, owner: OwnerId) -> Option<&OwnerJobs> {
        let &e = self.slots.get(&owner)?;
        let o = &self.entries[e as usize];
        (!o.jobs.is_empty()).then_some(o)
    }

    /// Ids of all pending jobs, in creation order.
    pub fn pending_ids(&self) -> impl Iterator<Item = JobId> + '_ {
        self.ring.iter().flatten().map(|j| j.id)
    }

    /// Empties the table; reports for every id issued so far become late. Returns the jobs
    /// that were pending, in creation order.
    pub fn reset(&mut self) -> Vec<Job<P>> {
        let pending: Vec<Job<P>> = self.ring.drain(..).flatten().collect();
        self.live = 0;
        self.entries.clear();
        self.slots.clear();
        self.free.clear();
        self.busy = 0;
        self.floor = self.next;
        self.base = self.next;
        self.stats.resets += 1;
        pending
    }

    /// Number of pending jobs.
    pub fn len(&self) -> usize {
        self.live
    }

    /// Whether no job is pending.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Number of requests with pending jobs.
    pub fn owners_len(&self) -> usize {
        self.busy
    }

    /// The id the next job will get.
    pub fn next_id(&self) -> JobId {
        JobId(self.next)
    }

    /// Counters.
    pub fn stats(&self) -> JobStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(t: &mut JobTable<()>, owner: u64) -> JobId {
        t.insert(
            JobKind::Store,
            OwnerId(owner),
            vec![],
            vec![BlockId(1)],
            false,
            (),
        )
    }

    fn done(t: &mut JobTable<()>, id: JobId) {
        assert!(matches!(t.complete(id, 0, true), Ok(Completion::Done(_))));
    }

    #[test]
    fn idle_entries_stay_bounded_for_owners_never_forgotten_and_busy_ones_survive_sweeps() {
        let mut t = JobTable::new(1).unwrap();
        let kept = store(&mut t, u64::MAX);
        for owner in 0..20_000 {
            let id = store(&mut t, owner);
            done(&mut t, id);
            assert!(t.owner(OwnerId(owner)).is_none());
            assert!(
                t.entries.len() <= IDLE_ENTRIES + 2 && t.slots.len() <= IDLE_ENTRIES + 2,
                "owner {owner}: {} entries, {} mapped",
                t.entries.len(),
                t.slots.len()
            );
        }
        assert_eq!(t.owners_len(), 1);
        assert_eq!(t.owner(OwnerId(u64::MAX)).unwrap().jobs, vec![kept]);
        // A swept owner comes back with a fresh entry: no job of another owner shows under it.
        let again = store(&mut t, 7);
        assert_eq!(t.owner(OwnerId(7)).unwrap().jobs, vec![again]);
        done(&mut t, kept);
        done(&mut t, again);
        assert_eq!(t.owners_len(), 0);
        assert!(t.owner(OwnerId(u64::MAX)).is_none() && t.owner(OwnerId(7)).is_none());
    }

    fn insert_at(t: &mut JobTable<()>, kind: JobKind, owner: u64, hint: u32) -> (JobId, u32) {
        t.insert_at(
            kind,
            OwnerId(owner),
            hint,
            vec![],
            vec![BlockId(1)],
            false,
            (),
        )
    }

    #[test]
    fn an_entry_hint_is_used_while_it_is_the_owner_s_and_ignored_once_stale() {
        let mut t = JobTable::new(1).unwrap();
        let (a1, e1) = insert_at(&mut t, JobKind::Store, 1, NO_ENTRY);
        // The owner's own hint: the same entry, its jobs together.
        let (a2, entry) = insert_at(&mut t, JobKind::Store, 1, e1);
        assert_eq!(entry, e1);
        assert_eq!(t.owner(OwnerId(1)).unwrap().jobs, vec![a1, a2]);
        // A hint naming another owner's entry: owner 2 gets an entry of its own.
        let (load2, e2) = insert_at(&mut t, JobKind::Load, 2, e1);
        assert_ne!(e2, e1);
        assert_eq!(t.owner(OwnerId(1)).unwrap().jobs, vec![a1, a2]);
        assert_eq!(t.owner(OwnerId(2)).unwrap().jobs, vec![load2]);
        // ... and the check reads owner 2's pending load, not owner 1's stores.
        assert!(t.check_owner_at(OwnerId(2), e1, JobKind::Store).is_err());
        assert!(t.check_owner_at(OwnerId(1), e2, JobKind::Store).is_ok());
        assert!(t.check_owner_at(OwnerId(1), e2, JobKind::Load).is_err());
        // Owner 1 done and forgotten: its entry goes to owner 3, and owner 1's old hint then
        // names owner 3's entry. Owner 1 comes back with an entry of its own.
        done(&mut t, a1);
        done(&mut t, a2);
        t.forget(OwnerId(1));
        let (load3, e3) = insert_at(&mut t, JobKind::Load, 3, NO_ENTRY);
        assert_eq!(e3, e1, "the forgotten entry serves owner 3");
        assert!(t.check_owner_at(OwnerId(1), e1, JobKind::Load).is_ok());
        let (a3, entry) = insert_at(&mut t, JobKind::Store, 1, e1);
        assert_ne!(entry, e1);
        assert_eq!(t.owner(OwnerId(3)).unwrap().jobs, vec![load3]);
        assert_eq!(t.owner(OwnerId(1)).unwrap().jobs, vec![a3]);
        // A freed entry no owner took yet is no owner's, not even the one it was freed from:
        // an owner forgotten and back (a caller reusing an id) with its old hint takes an
        // entry through the map, and the free one later serves another owner alone.
        done(&mut t, a3);
        t.forget(OwnerId(1));
        assert!(t.owner(OwnerId(1)).is_none());
        let (a4, e4) = insert_at(&mut t, JobKind::Store, 4, NO_ENTRY);
        done(&mut t, a4);
        t.forget(OwnerId(4));
        let (a5, e5) = insert_at(&mut t, JobKind::Store, 4, e4);
        let (a6, e6) = insert_at(&mut t, JobKind::Store, 6, NO_ENTRY);
        assert_ne!(e5, e6);
        assert_eq!(t.owner(OwnerId(4)).unwrap().jobs, vec![a5]);
        assert_eq!(t.owner(OwnerId(6)).unwrap().jobs, vec![a6]);
        // After a reset every hint is stale, out of range or not.
        t.reset();
        let (job9, _) = insert_at(&mut t, JobKind::Store, 9, NO_ENTRY);
        for hint in [0, e2, e3, 1 << 20] {
            assert!(t.check_owner_at(OwnerId(2), hint, JobKind::Load).is_ok());
        }
        let (job2, entry) = insert_at(&mut t, JobKind::Store, 2, 0);
        assert_ne!(entry, 0, "entry 0 is owner 9's");
        assert_eq!(t.owner(OwnerId(9)).unwrap().jobs, vec![job9]);
        assert_eq!(t.owner(OwnerId(2)).unwrap().jobs, vec![job2]);
    }

    #[test]
    fn a_swept_entry_is_no_owner_s_hint() {
        let mut t = JobTable::new(1).unwrap();
        let (a, e) = insert_at(&mut t, JobKind::Store, 0, NO_ENTRY);
        done(&mut t, a);
        // Owners never forgotten: their idle entries are swept, owner 0's among them.
        for owner in 1..=2 * IDLE_ENTRIES as u64 + 2 {
            let id = store(&mut t, owner);
            done(&mut t, id);
        }
        assert!(
            !t.slots.contains_key(&OwnerId(0)),
            "owner 0's entry was swept"
        );
        let (b, _) = insert_at(&mut t, JobKind::Store, 0, e);
        assert_eq!(t.owner(OwnerId(0)).unwrap().jobs, vec![b]);
        let holder = t.entries[e as usize].owner;
        if let Some(other) = holder.filter(|&o| o != OwnerId(0)) {
            assert!(t.owner(other).is_none_or(|o| !o.jobs.contains(&b)));
        }
        // Every mapped entry names its owner, and only mapped entries name one.
        for (o, &e) in &t.slots {
            assert_eq!(t.entries[e as usize].owner, Some(*o));
        }
        let named = t.entries.iter().filter(|o| o.owner.is_some()).count();
        assert_eq!(named, t.slots.len());
    }

    #[test]
    fn a_forgotten_owner_s_entry_serves_the_next_owner_but_a_busy_owner_keeps_its_own() {
        let mut t = JobTable::new(1).unwrap();
        let a = store(&mut t, 1);
        t.forget(OwnerId(1));
        assert_eq!(t.owner(OwnerId(1)).unwrap().jobs, vec![a], "still pending");
        let b = store(&mut t, 2);
        assert_eq!(
            t.entries.len(),
            2,
            "the busy owner's entry was not handed on"
        );
        done(&mut t, a);
        assert!(t.owner(OwnerId(1)).is_none());
        t.forget(OwnerId(1));
        let c = store(&mut t, 3);
        assert_eq!(
            t.entries.len(),
            2,
            "the forgotten owner's entry serves owner 3"
        );
        assert!(t.owner(OwnerId(1)).is_none());
        assert_eq!(t.owner(OwnerId(3)).unwrap().jobs, vec![c]);
        assert_eq!(t.owner(OwnerId(2)).unwrap().jobs, vec![b]);
        t.reset();
        assert!(t.entries.is_empty() && t.slots.is_empty() && t.free.is_empty());
        assert_eq!(t.owners_len(), 0);
    }
}
