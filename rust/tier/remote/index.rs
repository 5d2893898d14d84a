//! The scheduler-side index of the shared (Redis) tier: what this process knows about which
//! chunks the server holds, with lookups answered asynchronously.
//!
//! Unlike the disk tier, the truth lives on the server: other engines write chunks there and
//! the server evicts them (LRU) at any time. The index therefore keeps *answers*, not the
//! tier's contents: a key is known present (our own completed write, or an existence check),
//! known absent, or unknown. [`TierIndex::lookup`] answers from what is known and never waits:
//! for the first unknown key of a prefix it sends one batched existence check of the rest of
//! the prefix to a lookup thread (one round trip, see [`RemoteClient::exists`]) and reports the
//! lookup as pending ([`TierIndex::prefetch`]): the request is told "ask later". The
//! check's answer arrives on a later lookup; a check that fails or outlives the client's
//! deadline is forgotten and its keys count as absent until [`RemoteIndexConfig::retry`] passes
//! (then they are asked about again), so a slow or dead server costs recomputation, never a
//! stalled step nor a request that keeps asking. Answers are trusted for [`RemoteIndexConfig::ttl`];
//! keys pinned by a promotion stay present until it completes. A present key may still be gone
//! when a worker reads it (evicted meanwhile): the read is a miss, the promotion fails and
//! [`TierIndex::complete_read`] records the key absent.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;

use super::RemoteClient;
use crate::error::{Error, Result};
use crate::ids::Key;
use crate::pool::{KeyState, PoolEventKind};
use crate::tier::affinity::{pin_and_report, CpuSet};
use crate::tier::events::TierEvents;
use crate::tier::{Location, Medium, TierEvent, TierIndex, TierStats, TierWritePlan};

/// The medium events and stats of this tier carry.
pub const MEDIUM: Medium = Medium::Remote;
/// Most keys one existence check asks about.
pub const MAX_CHECK: usize = 4096;

/// Settings of a [`RemoteIndex`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteIndexConfig {
    /// Namespace digests of this index's chunks, one per tensor parallel rank (model, layout,
    /// rank, group, salt): a chunk is present when every rank's part is.
    pub namespaces: Vec<u128>,
    /// How long a "present" answer is trusted.
    pub ttl: Duration,
    /// How long an "absent" answer (or a check that got none in time) stands before the key
    /// is asked about again.
    pub retry: Duration,
    /// The CPUs the lookup thread runs on (`io_cpus`; `None`: not pinned).
    pub cpus: Option<CpuSet>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    /// On the server as far as we know (since `at`); `pins` promotions in flight.
    Present { at: Instant, pins: u32 },
    /// Our write is in flight: not readable.
    Writing,
    /// Not on the server (since `at`).
    Absent { at: Instant },
}

type Answer = (Vec<Key>, Option<Vec<bool>>);

/// The scheduler-side index of the shared tier for one namespace. See the module docs.
#[derive(Debug)]
pub struct RemoteIndex {
    cfg: RemoteIndexConfig,
    client: Arc<RemoteClient>,
    entries: FxHashMap<Key, Entry>,
    /// Keys asked about, and when the question expires.
    inflight: FxHashMap<Key, Instant>,
    ask: Sender<(Vec<Key>, Instant)>,
    answers: Receiver<Answer>,
    events: TierEvents,
    stats: TierStats,
}

impl RemoteIndex {
    /// An index over `client` for `cfg.namespaces`, with its lookup thread (pinned to
    /// `cfg.cpus` before `new` returns; an error if it cannot be).
    pub fn new(client: Arc<RemoteClient>, cfg: RemoteIndexConfig) -> Result<Self> {
        if cfg.ttl.is_zero() || cfg.retry.is_zero() || cfg.namespaces.is_empty() {
            return Err(Error::Config(format!(
                "remote index: ttl {:?} and retry {:?} must be > 0, with >= 1 namespace ({})",
                cfg.ttl,
                cfg.retry,
                cfg.namespaces.len()
            )));
        }
        let (ask, questions) = channel::<(Vec<Key>, Instant)>();
        let (tell, answers) = channel::<Answer>();
        let worker = Arc::clone(&client);
        let ns = cfg.namespaces.clone();
        let cpus = cfg.cpus.clone();
        let (pinned_tx, pinned) = channel::<Result<()>>();
        std::thread::Builder::new()
            .name("kvoffload-remote-lookup".into())
            .spawn(move || {
                if !pin_and_report(cpus.as_ref(), &pinned_tx) {
                    return;
                }
                // Ends when the index (the only sender) is dropped.
                for (keys, due) in questions {
                    // A question nobody waits for any more is not sent.
                    let found = if Instant::now() < due {
                        worker.exists_in_all(&ns, &keys)
                    } else {
                        None
                    };
                    if tell.send((keys, found)).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| Error::Io(format!("remote tier: cannot start a thread: {e}")))?;
        pinned.recv().expect("the lookup thread reports")?;
        Ok(Self {
            cfg,
            client,
            entries: FxHashMap::default(),
            inflight: FxHashMap::default(),
            ask,
            answers,
            events: TierEvents::new(MEDIUM, crate::pool::default_event_limit(0)),
            stats: TierStats::default(),
        })
    }

    /// The client this index asks.
    pub fn client(&self) -> &Arc<RemoteClient> {
        &self.client
    }

    /// Existence checks sent, and those forgotten after their deadline.
    pub fn checks(&self) -> (u64, u64) {
        (self.stats.checks, self.stats.expired_checks)
    }

    /// Takes in the answers that arrived and forgets questions past their deadline.
    fn drain(&mut self) {
        let now = Instant::now();
        while let Ok((keys, found)) = self.answers.try_recv() {
            // A check that failed (error, deadline, probation) is a miss like an expired one:
            // its keys are absent until the retry time passes (asking again at once would hold
            // the requests while the server stays slow). One that expired first was counted
            // then: its late answer is not counted again.
            let mut live = false;
            for (i, k) in keys.iter().enumerate() {
                if self.inflight.remove(k).is_none() {
                    continue; // expired meanwhile: the late answer is not trusted
                }
                live = true;
                if !matches!(
                    self.entries.get(k),
                    Some(Entry::Writing | Entry::Present { pins: 1.., .. })
                ) {
                    let e = match &found {
                        Some(f) if f[i] => Entry::Present { at: now, pins: 0 },
                        _ => Entry::Absent { at: now },
                    };
                    self.entries.insert(*k, e);
                }
            }
            self.stats.expired_checks += u64::from(live && found.is_none());
        }
        // Unanswered in time: a miss until the retry time passes.
        let mut expired = Vec::new();
        self.inflight.retain(|k, due| {
            let keep = *due > now;
            if !keep {
                expired.push(*k);
            }
            keep
        });
        if !expired.is_empty() {
            self.stats.expired_checks += 1;
        }
        for k in expired {
            if !matches!(
                self.entries.get(&k),
                Some(Entry::Writing | Entry::Present { .. })
            ) {
                self.entries.insert(k, Entry::Absent { at: now });
            }
        }
    }

    fn fresh(&self, at: Instant, now: Instant) -> bool {
        now.duration_since(at) < self.cfg.ttl
    }

    fn absent(&self, at: Instant, now: Instant) -> bool {
        now.duration_since(at) < self.cfg.retry
    }

    /// Leading keys known readable, and the index of the first key whose answer is unknown
    /// (or stale), if the prefix stopped there.
    fn known_prefix(&self, keys: &[Key], now: Instant) -> (usize, Option<usize>) {
        for (i, k) in keys.iter().enumerate() {
            match self.entries.get(k) {
                Some(Entry::Present { pins: 1.., .. }) => {}
                Some(Entry::Present { at, .. }) if self.fresh(*at, now) => {}
                Some(Entry::Writing) => return (i, None),
                Some(Entry::Absent { at }) if self.absent(*at, now) => return (i, None),
                _ => return (i, Some(i)),
            }
        }
        (keys.len(), None)
    }
}

impl TierIndex for RemoteIndex {
    fn medium(&self) -> Medium {
        MEDIUM
    }

    fn state(&self, key: Key) -> KeyState {
        match self.entries.get(&key) {
            Some(Entry::Present { pins, .. }) => KeyState::Ready { pins: *pins },
            Some(Entry::Writing) => KeyState::Storing,
            Some(Entry::Absent { .. }) | None => KeyState::Absent,
        }
    }

    fn lookup(&mut self, keys: &[Key]) -> usize {
        self.prefetch(keys);
        let (n, _) = self.known_prefix(keys, Instant::now());
        self.stats.hits += n as u64;
        self.stats.misses += (keys.len() - n) as u64;
        n
    }

    fn prefetch(&mut self, keys: &[Key]) -> bool {
        self.drain();
        let now = Instant::now();
        let (n, unknown) = self.known_prefix(keys, now);
        let Some(first) = unknown else {
            return false;
        };
        let ask: Vec<Key> = keys[first..]
            .iter()
            .copied()
            .filter(|k| !self.inflight.contains_key(k))
            .take(MAX_CHECK)
            .collect();
        if !ask.is_empty() {
            if self.client.on_probation() {
                self.stats.skipped_checks += 1;
            } else {
                let due = now + self.client.config().deadline;
                for &k in &ask {
                    self.inflight.insert(k, due);
                }
                self.stats.checks += 1;
                // The thread lives as long as the index; a send cannot fail before.
                let _ = self.ask.send((ask, due));
            }
        }
        let pending = self.inflight.contains_key(&keys[n]);
        self.stats.asked_later += u64::from(pending);
        pending
    }

    fn prepare_write(&mut self, keys: &[Key]) -> Option<TierWritePlan> {
        let now = Instant::now();
        let mut plan = TierWritePlan::default();
        for &k in keys {
            let skip = match self.entries.get(&k) {
                Some(Entry::Writing | Entry::Present { pins: 1.., .. }) => true,
                Some(Entry::Present { at, .. }) => self.fresh(*at, now),
                _ => false,
            };
            if !skip && !plan.keys.contains(&k) {
                plan.keys.push(k);
                plan.locations.push(Location {
                    place: 0,
                    generation: 0,
                });
            }
        }
        for &k in &plan.keys {
            self.entries.insert(k, Entry::Writing);
        }
        self.stats.writing += plan.keys.len() as u64;
        Some(plan)
    }

    fn complete_write(&mut self, keys: &[Key], ok: bool) -> Result<()> {
        if let Some(k) = keys
            .iter()
            .find(|k| self.entries.get(k) != Some(&Entry::Writing))
        {
            return Err(Error::UnknownKey(*k));
        }
        let now = Instant::now();
        for &k in keys {
            if ok {
                self.entries.insert(k, Entry::Present { at: now, pins: 0 });
            } else {
                self.entries.remove(&k);
            }
        }
        self.stats.writing -= keys.len() as u64;
        if ok {
            self.stats.writes += keys.len() as u64;
            self.events.push(PoolEventKind::Stored, keys.to_vec());
        } else {
            self.stats.failed_writes += keys.len() as u64;
        }
        Ok(())
    }

    fn prepare_read(&mut self, keys: &[Key]) -> Result<Vec<Location>> {
        if let Some(k) = keys
            .iter()
            .find(|k| !matches!(self.entries.get(k), Some(Entry::Present { .. })))
        {
            return Err(Error::UnknownKey(*k));
        }
        for k in keys {
            if let Some(Entry::Present { pins, .. }) = self.entries.get_mut(k) {
                *pins += 1;
            }
        }
        self.stats.promotions += keys.len() as u64;
        self.stats.reading += keys.len() as u64;
        Ok(vec![
            Location {
                place: 0,
                generation: 0,
            };
            keys.len()
        ])
    }

    fn complete_read(&mut self, keys: &[Key], bad: &[Key]) -> Result<()> {
        if let Some(k) = bad.iter().find(|k| !keys.contains(k)) {
            return Err(Error::UnknownKey(*k));
        }
        if let Some(k) = keys
            .iter()
            .find(|k| !matches!(self.entries.get(k), Some(Entry::Present { pins: 1.., .. })))
        {
            return Err(Error::KeyNotPinned(*k));
        }
        let now = Instant::now();
        for k in keys {
            if let Some(Entry::Present { pins, .. }) = self.entries.get_mut(k) {
                *pins -= 1;
            }
        }
        for &k in bad {
            if matches!(self.entries.get(&k), Some(Entry::Present { pins: 0, .. })) {
                self.entries.insert(k, Entry::Absent { at: now });
                self.stats.quarantined += 1;
            }
        }
        self.stats.reading -= keys.len() as u64;
        if !bad.is_empty() {
            self.events.push(PoolEventKind::Removed, bad.to_vec());
        }
        Ok(())
    }

    fn take_events(&mut self) -> Vec<TierEvent> {
        self.events.take()
    }

    fn set_event_limit(&mut self, limit: usize) {
        self.events.set_limit(limit);
    }

    fn stats(&self) -> TierStats {
        let client = self.client.stats();
        TierStats {
            probations: client.probations,
            recoveries: client.recoveries,
            events_dropped: self.events.dropped(),
            used: self
                .entries
                .values()
                .filter(|e| !matches!(e, Entry::Absent { .. }))
                .count() as u64,
            ..self.stats
        }
    }
}
