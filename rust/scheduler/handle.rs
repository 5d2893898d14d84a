//! Request ids resolved once: a caller that names the same request several times per step
//! (the binding's `schedule_batch` reads its hash count and table lengths, appends its hashes,
//! then schedules it) resolves each external id to a [`Resolved`] id once, and every later call
//! finds the request by slab index instead of hashing and comparing the id again.
//!
//! A handle is a slab index plus the request's owner id, which is never reused: a handle whose
//! request was dropped (or whose slab index now holds another request) is stale, and a stale
//! handle falls back to the id lookup, so a handle is never wrong, only slower.

use crate::error::{Error, Result};
use crate::ids::{Key, OwnerId};

use super::Scheduler;

/// A request's slab index and owner id, as [`Scheduler::resolved`] found them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestHandle {
    idx: u32,
    owner: OwnerId,
}

/// A request id as the scheduler's calls take it: the external id, and where it is already
/// resolved, its handle. Every string type is one (never resolved); [`Resolved`] carries one.
pub trait RequestRef {
    /// The external id.
    fn id(&self) -> &str;
    /// The handle `id` resolved to, if it was resolved.
    fn handle(&self) -> Option<RequestHandle> {
        None
    }
}

impl<T: AsRef<str> + ?Sized> RequestRef for T {
    fn id(&self) -> &str {
        self.as_ref()
    }
}

/// An external id and the handle it resolved to (`None`: unknown when resolved), built only by
/// [`Scheduler::resolved`], so the two always belong together.
#[derive(Debug, Clone, Copy)]
pub struct Resolved<S> {
    id: S,
    handle: Option<RequestHandle>,
}

impl<S> Resolved<S> {
    /// The external id.
    pub fn name(&self) -> &S {
        &self.id
    }

    /// The handle, `None` if the request was unknown when resolved.
    pub fn resolved_handle(&self) -> Option<RequestHandle> {
        self.handle
    }

    /// The external id and the handle, taken apart.
    pub fn into_parts(self) -> (S, Option<RequestHandle>) {
        (self.id, self.handle)
    }
}

impl<S: AsRef<str>> Resolved<S> {
    /// The same, borrowing the id.
    pub fn borrowed(&self) -> Resolved<&str> {
        Resolved {
            id: self.id.as_ref(),
            handle: self.handle,
        }
    }
}

impl<S: AsRef<str>> RequestRef for Resolved<S> {
    fn id(&self) -> &str {
        self.id.as_ref()
    }
    fn handle(&self) -> Option<RequestHandle> {
        self.handle
    }
}

impl Scheduler {
    /// `id` with the handle of the request it names now (`None` if it is unknown).
    pub fn resolved<S: AsRef<str>>(&self, id: S) -> Resolved<S> {
        let handle = self.index.get(id.as_ref()).map(|&idx| RequestHandle {
            idx,
            owner: self.req(idx).owner,
        });
        Resolved { id, handle }
    }

    /// `id` resolved by `kept`, a handle the caller kept from an earlier [`Self::resolved`] of
    /// this very id (the caller vouches for that: the binding keys its cache by the identity
    /// of an immutable `str` it holds): `kept` where its request is still live, else `id`
    /// looked up again. The id's string is not read on the fast path.
    pub fn resolved_as<S: AsRef<str>>(&self, id: S, kept: RequestHandle) -> Resolved<S> {
        let live = self.reqs.get(kept.idx as usize).and_then(Option::as_ref);
        match live {
            Some(r) if r.owner == kept.owner => {
                debug_assert_eq!(r.id, id.as_ref(), "a kept handle names another id");
                Resolved {
                    id,
                    handle: Some(kept),
                }
            }
            _ => self.resolved(id),
        }
    }

    /// Prefetches the first line of the request slot `h` names (if any), ahead of a
    /// [`Self::resolved_as`] with it; changes nothing.
    pub fn warm(&self, h: RequestHandle) {
        if let Some(slot) = self.reqs.get(h.idx as usize) {
            crate::prefetch::prefetch(slot);
        }
    }

    /// The slab index of `r`: by its handle where that is still current, else by its id.
    pub(super) fn idx_of<R: RequestRef + ?Sized>(&self, r: &R) -> Result<u32> {
        if let Some(h) = r.handle() {
            let live = self.reqs.get(h.idx as usize).and_then(Option::as_ref);
            if live.is_some_and(|q| q.owner == h.owner) {
                return Ok(h.idx);
            }
        }
        self.idx(r.id())
    }

    /// Appends chained hashes to several requests as their tokens grow: every request is
    /// found first, and one unknown, or named twice, fails the call before any hash is
    /// appended.
    pub fn extend_hashes_many<R: RequestRef, T: AsRef<[Key]>>(
        &mut self,
        tails: &[(R, T)],
    ) -> Result<()> {
        let idx = tails
            .iter()
            .map(|(r, _)| self.idx_of(r))
            .collect::<Result<Vec<u32>>>()?;
        if let Some(i) = self.first_repeated_req(idx.iter().copied()) {
            return Err(Error::RequestState {
                request: self.req(i).id.clone(),
                reason: "gets hashes appended twice in one call".into(),
            });
        }
        for (i, (_, tail)) in idx.into_iter().zip(tails) {
            self.req_mut(i).hashes.extend_from_slice(tail.as_ref());
        }
        Ok(())
    }
}
