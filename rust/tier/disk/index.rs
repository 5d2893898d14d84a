//! The scheduler side of the disk tier: key → slot and generation, no I/O; rebuilt on open
//! from every rank's header scan.

use rustc_hash::{FxHashMap, FxHashSet};

use super::{ScanReport, SlabLayout, WriteItem, MEDIUM};
use crate::error::{Error, Result};
use crate::ids::Key;
use crate::policy::PolicyKind;
use crate::pool::{default_event_limit, KeyState, Pool, PoolConfig, PoolEventKind};
use crate::tier::events::TierEvents;
use crate::tier::{Location, TierEvent, TierIndex, TierStats, TierWritePlan};

/// The scheduler-side index of one namespace's slab (all ranks). See the module documentation.
#[derive(Debug)]
pub struct DiskIndex {
    pool: Pool,
    /// Disk slot of each pool slot (a fixed permutation chosen at recovery).
    disk_of: Vec<u32>,
    /// Generation each disk slot holds (or is being written with).
    gens: Vec<u64>,
    next_gen: u64,
    /// Keys found bad while pinned: dropped when their last pin goes.
    doomed: FxHashSet<Key>,
    events: TierEvents,
    layout: SlabLayout,
    promotions: u64,
    quarantined: u64,
    recovered: u64,
}

impl DiskIndex {
    /// An empty index of `layout.slots` slots.
    pub fn new(layout: SlabLayout, policy: PolicyKind) -> Result<Self> {
        Self::recover(layout, policy, &[])
    }

    /// An index rebuilt from the scans of every rank's slab file (`scans[rank]`): a slot is
    /// readable when every rank holds a committed header with the same key and generation in
    /// it; of two slots with one key the newer generation wins. Recovered keys are ordered by
    /// generation (newest most recent). Slots any rank found bad count as quarantined.
    pub fn recover(layout: SlabLayout, policy: PolicyKind, scans: &[ScanReport]) -> Result<Self> {
        let mut pool = Pool::new(PoolConfig {
            capacity: layout.slots,
            policy,
            store_threshold: 0,
        })?;
        let n = layout.slots as usize;
        let mut gens = vec![0u64; n];
        let mut found: Vec<(u64, Key, u32)> = Vec::new();
        if let Some((first, rest)) = scans.split_first() {
            let mut agreed: FxHashMap<u32, (Key, u64)> = first
                .chunks
                .iter()
                .filter(|c| c.0 < layout.slots)
                .map(|&(s, k, g)| (s, (k, g)))
                .collect();
            for scan in rest {
                let here: FxHashMap<u32, (Key, u64)> =
                    scan.chunks.iter().map(|&(s, k, g)| (s, (k, g))).collect();
                agreed.retain(|s, v| here.get(s) == Some(v));
            }
            let mut newest: FxHashMap<Key, (u64, u32)> = FxHashMap::default();
            for (&slot, &(key, g)) in &agreed {
                let e = newest.entry(key).or_insert((g, slot));
                if (g, slot) > *e {
                    *e = (g, slot);
                }
            }
            found = newest.into_iter().map(|(k, (g, s))| (g, k, s)).collect();
            found.sort_unstable();
            for &(g, _, s) in &found {
                gens[s as usize] = g;
            }
        }
        // Generations are never reused, whatever any rank's file holds.
        let next_gen = scans
            .iter()
            .flat_map(|s| s.chunks.iter().map(|c| c.2))
            .max()
            .unwrap_or(0)
            + 1;
        // Recovered keys take pool slots 0..found in generation order; every pool slot maps to
        // a disk slot, those of the recovered keys first.
        let keys: Vec<Key> = found.iter().map(|f| f.1).collect();
        let mut disk_of: Vec<u32> = found.iter().map(|f| f.2).collect();
        let mut taken = vec![false; n];
        for &d in &disk_of {
            taken[d as usize] = true;
        }
        disk_of.extend((0..layout.slots).filter(|&d| !taken[d as usize]));
        if !keys.is_empty() {
            let plan = pool
                .prepare_store(&keys)
                .expect("an empty pool holds every recovered key");
            debug_assert!(plan
                .slots
                .iter()
                .enumerate()
                .all(|(i, s)| s.0 as usize == i));
            pool.complete_store(&keys, true)?;
            pool.take_events();
        }
        let bad: u64 = scans.iter().map(|s| u64::from(s.bad)).sum();
        Ok(Self {
            pool,
            disk_of,
            gens,
            next_gen,
            doomed: FxHashSet::default(),
            events: TierEvents::new(MEDIUM, default_event_limit(layout.slots)),
            layout,
            promotions: 0,
            quarantined: bad,
            recovered: keys.len() as u64,
        })
    }

    /// Slot geometry.
    pub fn layout(&self) -> SlabLayout {
        self.layout
    }

    /// Keys recovered from the headers at open.
    pub fn recovered(&self) -> u64 {
        self.recovered
    }

    /// The location of `key`, if present (writing or ready).
    pub fn location(&self, key: Key) -> Option<Location> {
        let slot = self.pool.slot(key)?;
        let d = self.disk_of[slot.0 as usize];
        Some(Location {
            place: u64::from(d),
            generation: self.gens[d as usize],
        })
    }

    fn emit(&mut self, kind: PoolEventKind, keys: Vec<Key>) {
        self.events.push(kind, keys);
    }

    /// Relays the pool's events with this tier's medium.
    fn relay_events(&mut self) {
        for e in self.pool.take_events() {
            self.emit(e.kind, e.keys);
        }
    }
}

impl TierIndex for DiskIndex {
    fn medium(&self) -> crate::tier::Medium {
        MEDIUM
    }

    fn state(&self, key: Key) -> KeyState {
        if self.doomed.contains(&key) {
            return KeyState::Absent;
        }
        self.pool.state(key)
    }

    fn lookup(&mut self, keys: &[Key]) -> usize {
        let n = self.pool.lookup(keys);
        let n = keys[..n]
            .iter()
            .position(|k| self.doomed.contains(k))
            .unwrap_or(n);
        if n > 0 {
            self.pool.touch(&keys[..n]);
        }
        n
    }

    fn prepare_write(&mut self, keys: &[Key]) -> Option<TierWritePlan> {
        let plan = self.pool.prepare_store(keys)?;
        let mut locations = Vec::with_capacity(plan.slots.len());
        for s in &plan.slots {
            let d = self.disk_of[s.0 as usize];
            self.gens[d as usize] = self.next_gen;
            locations.push(Location {
                place: u64::from(d),
                generation: self.next_gen,
            });
            self.next_gen += 1;
        }
        self.relay_events();
        Some(TierWritePlan {
            keys: plan.keys,
            locations,
            evicted: plan.evicted,
        })
    }

    fn complete_write(&mut self, keys: &[Key], ok: bool) -> Result<()> {
        self.pool.complete_store(keys, ok)?;
        self.relay_events();
        Ok(())
    }

    fn prepare_read(&mut self, keys: &[Key]) -> Result<Vec<Location>> {
        if let Some(k) = keys.iter().find(|k| self.doomed.contains(k)) {
            return Err(Error::UnknownKey(*k));
        }
        self.pool.prepare_load(keys)?;
        self.promotions += keys.len() as u64;
        Ok(keys
            .iter()
            .map(|&k| self.location(k).expect("pinned keys are present"))
            .collect())
    }

    fn complete_read(&mut self, keys: &[Key], bad: &[Key]) -> Result<()> {
        if let Some(k) = bad.iter().find(|k| !keys.contains(k)) {
            return Err(Error::UnknownKey(*k));
        }
        self.pool.complete_load(keys)?;
        for &k in bad {
            if self.doomed.insert(k) {
                self.quarantined += 1;
            }
        }
        let doomed: Vec<Key> = self.doomed.iter().copied().collect();
        for k in self.pool.discard(&doomed) {
            self.doomed.remove(&k);
        }
        self.relay_events();
        Ok(())
    }

    fn take_events(&mut self) -> Vec<TierEvent> {
        self.relay_events();
        self.events.take()
    }

    fn set_event_limit(&mut self, limit: usize) {
        self.relay_events();
        self.events.set_limit(limit);
        // The pool's queue is relayed after every call: it needs room for one call only.
        self.pool.set_event_limit(if limit == 0 {
            0
        } else {
            default_event_limit(self.layout.slots)
        });
    }

    fn stats(&self) -> TierStats {
        let p = self.pool.stats();
        TierStats {
            capacity: u64::from(p.capacity),
            used: u64::from(p.used),
            bytes_capacity: self.layout.file_bytes(),
            hits: p.hits,
            misses: p.misses,
            writes: p.stores,
            failed_writes: p.failed_stores,
            promotions: self.promotions,
            quarantined: self.quarantined,
            evictions: p.evictions,
            no_room: p.no_room,
            writing: u64::from(p.storing),
            reading: u64::from(p.pinned),
            events_dropped: self.events.dropped() + p.events_dropped,
            ..TierStats::default()
        }
    }
}

/// The slab writes of `plan`: each planned key at its place, with its bytes `pieces(key)`.
pub fn write_items<'a>(
    plan: &TierWritePlan,
    pieces: impl Fn(Key) -> Vec<&'a [u8]>,
) -> Vec<WriteItem<'a>> {
    plan.keys
        .iter()
        .zip(&plan.locations)
        .map(|(&key, loc)| WriteItem {
            slot: u32::try_from(loc.place).unwrap_or(u32::MAX),
            key,
            generation: loc.generation,
            pieces: pieces(key),
        })
        .collect()
}
