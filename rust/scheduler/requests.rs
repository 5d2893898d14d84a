//! The request slab: requests live in a `Vec` indexed by a dense `u32` slab index, and external
//! string ids map to it once per call. A request holds its prompt length, chained hashes,
//! computed tokens, status and per-group block tables with their store cursors; it is dropped
//! once it finished and nothing is pending for it.

use crate::config::SchedulerConfig;
use crate::error::{Error, Result};
use crate::ids::{BlockId, JobId, Key, OwnerId, SlotId};

use super::handle::RequestRef;
use super::lookup::LookupResult;
use super::Scheduler;

/// Lifecycle of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Registered, not admitted yet.
    Waiting,
    /// Holds blocks and is scheduled.
    Running,
    /// Released its blocks; will be re-admitted.
    Preempted,
    /// Finished normally; kept until its last store completes.
    Finished,
    /// Aborted; kept until its jobs complete.
    Aborted,
}

impl Status {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Status::Waiting => "waiting",
            Status::Running => "running",
            Status::Preempted => "preempted",
            Status::Finished => "finished",
            Status::Aborted => "aborted",
        }
    }
}

/// A request's block table in one KV group.
#[derive(Debug, Clone)]
pub(super) struct ReqGroup {
    pub(super) blocks: Vec<BlockId>,
    /// Chunks handled (stored, skipped, hit or loaded): the next chunk to consider.
    pub(super) cursor: u32,
    /// The pool slot each chunk was stored into or loaded from, by chunk index
    /// ([`SlotId::NONE`] where unknown): only a hint, checked against the pool before use, so
    /// the drop's recency refresh skips the pool's index (`Pool::refresh_hinted`).
    pub(super) slots: Vec<SlotId>,
}

/// Entries a request's growing tables (its hashes, a group's blocks and slot hints) get to
/// spare when they are sized or reallocated: a decoding request appends a hash and a block per
/// block of tokens and a hint per chunk stored, and the first append past a table sized exactly
/// would copy the whole table, cold, in the middle of a step (a reallocation of kilobytes per
/// request that starts decoding). 32 blocks are 512 tokens of 16-token blocks.
pub const TABLE_ROOM: usize = 32;

/// Lengthens `v` to `n` entries (new ones `fill`); a reallocation leaves [`TABLE_ROOM`]
/// entries to spare, at least (it doubles the room as `Vec` does).
pub(super) fn grow<T: Clone>(v: &mut Vec<T>, n: usize, fill: T) {
    if v.len() < n {
        if v.capacity() < n {
            v.reserve(n + TABLE_ROOM - v.len());
        }
        v.resize(n, fill);
    }
}

impl ReqGroup {
    /// Remembers that chunk `c` sits in `slot`.
    pub(super) fn hint(&mut self, c: u32, slot: SlotId) {
        let c = c as usize;
        grow(&mut self.slots, c + 1, SlotId::NONE);
        self.slots[c] = slot;
    }
}

/// Marks the first line of a [`Request`] as the place of the slab's `Option` discriminant: a
/// one-variant `u64` enum leaves 2^64 - 1 invalid values, more than any other field's niche,
/// so `Option<Request>` keeps `None` here (it chose the `lookup` option's tag, in the third
/// line, before), and telling a live slab entry from a free one reads the line the step reads
/// anyway.
#[derive(Debug, Clone, Copy)]
#[repr(u64)]
pub(super) enum Live {
    Yes = 0,
}

/// A tracked request. The fields a step reads for every scheduled request (the owner that
/// validates a handle, the hash count, the pending load, the computed tokens, the prompt
/// length, the store due point, the status, and the slab's discriminant, [`Live`]) come
/// first, in one 64-byte line (`repr(C, align(64))`): a running request that completes no
/// chunk costs the step one cache line, not three (vLLM evicts the slab between steps).
#[derive(Debug, Clone)]
#[repr(C, align(64))]
pub(super) struct Request {
    pub(super) owner: OwnerId,
    pub(super) hashes: Vec<Key>,
    /// The pending load ([`JobId::NONE`]: none).
    pub(super) load: JobId,
    pub(super) computed: u32,
    pub(super) prompt_len: u32,
    /// The watermark (tokens) from which some group has a full chunk past its store cursor,
    /// as [`Scheduler::store_due`] computes it from the cursors; 0: not known (every write of
    /// a cursor resets it). Store planning skips a request whose watermark is below it
    /// without reading its block tables.
    pub(super) store_due: u32,
    pub(super) status: Status,
    pub(super) live: Live,
    // The rest: read when the request changes, not every step.
    pub(super) id: String,
    pub(super) groups: Vec<ReqGroup>,
    /// Bumped whenever the block table is replaced, so older index entries die.
    pub(super) epoch: u32,
    /// Its entry in the job table as its last job left it: a hint that saves the table's
    /// lookup by hash when its next job is created ([`crate::jobs::JobTable::insert_at`]).
    /// On the line of `groups`, which planning a job reads anyway.
    pub(super) job_entry: u32,
    pub(super) first_ask: Option<u64>,
    /// A lower tier's answer about its chunks was pending at its last ask (a remote tier's
    /// existence check): the next ask may still promote, as the first one could.
    pub(super) tier_pending: bool,
    pub(super) wait_on: Vec<JobId>,
    pub(super) lookup: Option<LookupResult>,
}

// The step's fields share the first cache line.
const _: () = assert!(std::mem::offset_of!(Request, live) + 8 <= 64);
// A job's owner entry shares the second line with the block tables.
const _: () = assert!(
    std::mem::offset_of!(Request, job_entry) / 64 == std::mem::offset_of!(Request, groups) / 64
);

impl Scheduler {
    /// The slab index of request `id`.
    pub(super) fn idx(&self, id: &str) -> Result<u32> {
        self.index
            .get(id)
            .copied()
            .ok_or_else(|| Error::UnknownRequest(id.to_owned()))
    }

    /// The slab index of a waiting (or preempted) request; else an error saying `what`.
    pub(super) fn waiting(&self, id: &str, what: &str) -> Result<u32> {
        let i = self.idx(id)?;
        let status = self.req(i).status;
        if matches!(status, Status::Waiting | Status::Preempted) {
            Ok(i)
        } else {
            Err(Self::state_err(id, status, what))
        }
    }

    /// The request at slab index `i` (which must be live).
    pub(super) fn req(&self, i: u32) -> &Request {
        self.reqs[i as usize]
            .as_ref()
            .expect("indexed request exists")
    }

    /// The request at slab index `i`, mutably.
    pub(super) fn req_mut(&mut self, i: u32) -> &mut Request {
        self.reqs[i as usize]
            .as_mut()
            .expect("indexed request exists")
    }

    /// The error for an operation `what` that a request's status does not allow.
    pub(super) fn state_err(id: &str, status: Status, what: &str) -> Error {
        Error::RequestState {
            request: id.to_owned(),
            reason: format!("is {}; {what}", status.name()),
        }
    }

    /// Registers a request with its prompt length and the chained hashes of its complete
    /// hash blocks so far.
    pub fn add_request(&mut self, id: &str, prompt_len: u32, hashes: Vec<Key>) -> Result<()> {
        if self.index.contains_key(id) {
            return Err(Error::RequestState {
                request: id.to_owned(),
                reason: "is already registered".into(),
            });
        }
        if prompt_len == 0 {
            return Err(Error::RequestState {
                request: id.to_owned(),
                reason: "has an empty prompt (prompt_len 0)".into(),
            });
        }
        let owner = OwnerId(self.next_owner);
        self.next_owner += 1;
        let groups = vec![
            ReqGroup {
                blocks: Vec::new(),
                cursor: 0,
                slots: Vec::new(),
            };
            self.cfg.groups.len()
        ];
        let req = Request {
            id: id.to_owned(),
            owner,
            prompt_len,
            hashes,
            computed: 0,
            status: Status::Waiting,
            groups,
            load: JobId::NONE,
            live: Live::Yes,
            first_ask: None,
            tier_pending: false,
            wait_on: Vec::new(),
            lookup: None,
            store_due: 0,
            epoch: 0,
            job_entry: crate::jobs::NO_ENTRY,
        };
        let i = if let Some(i) = self.free.pop() {
            self.reqs[i as usize] = Some(req);
            i
        } else {
            self.reqs.push(Some(req));
            (self.reqs.len() - 1) as u32
        };
        self.index.insert(id.to_owned(), i);
        Ok(())
    }

    /// Appends chained hashes as the request's tokens grow.
    pub fn extend_hashes<R: RequestRef + ?Sized>(&mut self, id: &R, hashes: &[Key]) -> Result<()> {
        let i = self.idx_of(id)?;
        self.req_mut(i).hashes.extend_from_slice(hashes);
        Ok(())
    }

    /// The key of chunk `chunk` of group `g`, if the request has its hash yet.
    pub(super) fn key(&self, r: &Request, g: usize, chunk: u32) -> Option<Key> {
        Self::chunk_key(&self.cfg, r, g, chunk)
    }

    /// [`Scheduler::key`] borrowing only the configuration.
    fn chunk_key(cfg: &SchedulerConfig, r: &Request, g: usize, chunk: u32) -> Option<Key> {
        let end = (u64::from(chunk) + 1) * u64::from(cfg.chunk_tokens(g));
        let h = (end / u64::from(cfg.hash_block_size)) as usize;
        r.hashes.get(h.checked_sub(1)?).copied()
    }

    /// Store watermark in tokens: what may be stored of this request now.
    pub(super) fn watermark(&self, r: &Request) -> u32 {
        let mut wm = r.computed;
        if self.cfg.offload_prompt_only {
            wm = wm.min(r.prompt_len);
        }
        if let Some(cap) = self.cfg.max_offload_tokens {
            wm = wm.min(cap);
        }
        wm
    }

    /// Slab indices of request ids.
    pub(super) fn ids<S: RequestRef>(&self, ids: &[S]) -> Result<Vec<u32>> {
        ids.iter().map(|id| self.idx_of(id)).collect()
    }

    /// Drops a finished or aborted request once nothing is pending for it.
    pub(super) fn maybe_drop(&mut self, i: u32) {
        let Some(r) = self.reqs[i as usize].as_ref() else {
            return;
        };
        if !matches!(r.status, Status::Finished | Status::Aborted)
            || self.tracker.jobs().owner(r.owner).is_some()
            || self.retry.contains(&i)
        {
            return;
        }
        // Taken out of the slab whole: its id leaves the index without a copy.
        let r = self.reqs[i as usize].take().expect("checked above");
        self.refresh_stored(&r);
        self.tracker.forget(r.owner);
        self.index.remove(&r.id);
        self.free.push(i);
    }

    /// A request done for good refreshes the recency of its chunks still in the pools, the
    /// earliest most recent: a conversation's next turn re-uses the prefix, and without this
    /// its first chunks (stored first, touched only by lookups) would be the oldest and
    /// evicted first, cutting the whole prefix under pressure. Where a chunk is one hash block
    /// (vLLM's shape), its keys are the request's hashes as they are
    /// ([`Scheduler::chunk_key_slice`]); its slot hints are the group's as they are.
    fn refresh_stored(&mut self, r: &Request) {
        for (g, rg) in r.groups.iter().enumerate() {
            let keys = self.chunk_key_slice(r, g, 0..rg.cursor);
            let hints = &rg.slots[..keys.len().min(rg.slots.len())];
            self.pools[g].refresh_hinted(&keys, hints);
        }
    }

    /// The engine released a running request's blocks outside a step (for example after a
    /// failed load it chose not to keep): its pending jobs' deferred pairs are armed, its
    /// remaining stores are planned next step, and it may be looked up again. Idempotent for
    /// a request already preempted; reporting it again in the next step's `preempted` is fine.
    pub fn preempt(&mut self, id: &str) -> Result<()> {
        let i = self.idx(id)?;
        let r = self.req(i);
        match r.status {
            Status::Preempted => Ok(()),
            Status::Running => {
                let owner = r.owner;
                self.req_mut(i).status = Status::Preempted;
                self.tracker.release(owner);
                self.retry.push(i);
                Ok(())
            }
            status => Err(Self::state_err(
                id,
                status,
                "only running requests are preempted",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::positions::tests::{small, step};
    use super::*;

    /// A block table handed over exactly sized becomes the request's with room: the blocks a
    /// decode appends, up to [`TABLE_ROOM`], do not move it (no copy of the whole table).
    #[test]
    fn a_request_s_block_table_takes_its_decode_blocks_in_place() {
        let mut s = small(1);
        s.add_request("a", 9, vec![Key(1), Key(2)]).unwrap();
        assert_eq!(s.lookup("a", 0).unwrap(), Some(0));
        let mut table = vec![BlockId(1), BlockId(2), BlockId(3)];
        table.shrink_to_fit();
        s.allocate("a", &[table], 0, 0).unwrap();
        let i = s.idx("a").unwrap();
        let at = s.req(i).groups[0].blocks.as_ptr();
        for b in 0..TABLE_ROOM as u32 {
            let mut input = step(&[("a", 9)]);
            input
                .new_blocks
                .push(("a".to_owned(), 0, vec![BlockId(10 + b)]));
            s.schedule(&input).unwrap();
        }
        let blocks = &s.req(i).groups[0].blocks;
        assert_eq!(blocks.len(), 3 + TABLE_ROOM);
        assert_eq!(blocks.as_ptr(), at, "the table was reallocated");
    }

    #[test]
    fn grow_lengthens_with_the_fill_keeps_what_is_there_and_leaves_room() {
        let mut v = vec![SlotId(7); 3];
        v.shrink_to_fit();
        grow(&mut v, 2, SlotId::NONE);
        assert_eq!(v, [SlotId(7); 3], "never shortens");
        grow(&mut v, 5, SlotId::NONE);
        assert_eq!(
            v,
            [SlotId(7), SlotId(7), SlotId(7), SlotId::NONE, SlotId::NONE]
        );
        assert!(v.capacity() >= 5 + TABLE_ROOM, "a reallocation leaves room");
        // Appends within the room reallocate nothing.
        let at = v.as_ptr();
        for n in 6..=5 + TABLE_ROOM {
            grow(&mut v, n, SlotId(1));
        }
        assert_eq!((v.as_ptr(), v.len()), (at, 5 + TABLE_ROOM));
        assert_eq!(v[5..], [SlotId(1); TABLE_ROOM]);
    }
}
