//! The CPU pool: the scheduler-side view of the CPU tier (DESIGN.md §5).
//!
//! The pool decides where each chunk lives and which chunk leaves; it holds no bytes (the data
//! plane does). It has a fixed number of slots. Each key is *absent*, *storing* (a slot is
//! reserved, the copy is in flight, nothing is readable) or *ready* with a pin count (loads in
//! flight). Only ready, unpinned entries are ever evicted.
//!
//! How it is laid out, for a million slots on the engine's hot path:
//! - a key index `Key -> SlotId` ([`FxHashMap`]) and one dense array of per-slot records: the
//!   entry's state, its key and its links in the policy's lists, 32 bytes, so each slot touched
//!   costs one cache miss, not three (the engine's own work evicts the caches between calls);
//! - the eviction order lives in an [`EvictionPolicy`] (intrusive lists over slot indices, O(1)
//!   per insert / touch / evict, no allocation per operation), threaded through the records'
//!   links;
//! - free slots are a run-length set: maximal free runs indexed by start and by length (two
//!   B-trees, O(log runs) per allocation or release). A store call asks for all its slots at
//!   once: the smallest free run that holds them all (best fit), else the largest runs first,
//!   so the data plane copies a job with few large copies. In a full pool (the steady state)
//!   the victims' slots are the only free ones: they are handed out directly, sorted, without
//!   touching the B-trees. [`PoolStats`] says how contiguous allocations are.
//!
//! Every operation checks its input before it changes anything: an `Err` (or a `None` from
//! [`Pool::prepare_store`]) means nothing changed. Changes visible to other caches are queued
//! as [`PoolEvent`]s (medium [`MEDIUM`]) and drained with [`Pool::take_events`]. The queue is
//! bounded ([`Pool::set_event_limit`], by default [`default_event_limit`] keys): an event that
//! does not fit is dropped whole and counted in [`PoolStats::events_dropped`], so a caller that
//! never drains costs bounded memory and one that does can tell when its index went stale.
//!
//! One concept per file: this one holds the pool, its configuration and key states; `lookup.rs`
//! reads and recency (`touch`, `refresh`), `store.rs` and `load.rs` the two directions,
//! `free.rs` the free-run set, `hold.rs` slots held for a late writer, `admission.rs` the admission filter, `events.rs` the event
//! queue, `inspect.rs` counters, order and the consistency check.
//!
//! Departures from DESIGN.md §5 (one pool per KV group, `refresh` on a request's drop) and
//! their reasons: `docs/design-notes.md`.

mod admission;
mod dedup;
mod events;
mod free;
mod hold;
mod index;
mod inspect;
mod load;
mod lookup;
mod store;

use crate::error::{Error, Result};
use crate::ids::{Key, SlotId};
use crate::policy::{EvictionPolicy, LinkNode, PolicyKind, Touch, UNLINKED};

use admission::Admission;
use dedup::CallKeys;
use free::FreeSlots;
use index::SlotIndex;

pub use events::{default_event_limit, PoolEvent, PoolEventKind, MEDIUM};
pub use inspect::{PoolOrder, PoolStats};
pub use store::StorePlan;

/// The largest capacity a pool accepts (2^28 slots, about 10 GiB of bookkeeping).
pub const MAX_CAPACITY: u32 = 1 << 28;

/// How a pool is configured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Number of slots (`1..=MAX_CAPACITY`).
    pub capacity: u32,
    /// Eviction policy.
    pub policy: PolicyKind,
    /// Admission filter: a key is stored only after it was looked up (while absent) this many
    /// times. `0` or `1` means no filter.
    pub store_threshold: u32,
}

impl PoolConfig {
    /// `capacity` slots, LRU, no admission filter.
    pub fn new(capacity: u32) -> Self {
        Self {
            capacity,
            policy: PolicyKind::Lru,
            store_threshold: 0,
        }
    }
}

/// What the pool knows about one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyState {
    /// Not in the pool.
    Absent,
    /// A slot is reserved and the store is in flight: not readable, ask again later.
    Storing,
    /// Readable; `pins` loads are in flight.
    Ready {
        /// Number of loads in flight (pinned entries are never evicted).
        pins: u32,
    },
}

impl KeyState {
    /// `"absent"`, `"storing"` or `"ready"`.
    pub fn name(self) -> &'static str {
        match self {
            KeyState::Absent => "absent",
            KeyState::Storing => "storing",
            KeyState::Ready { .. } => "ready",
        }
    }
}

/// State of one slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    Free,
    Storing,
    Ready(u32),
}

/// One slot: its state, its key and its links in the policy's lists (which only the policy
/// reads and writes), side by side so that a slot touched costs one cache miss. Aligned to 32
/// bytes, its size, so a record never straddles a cache line.
#[derive(Clone, Copy, Debug)]
#[repr(align(32))]
struct Record {
    entry: Entry,
    key: Key,
    links: [u32; 2],
}

const _: () = assert!(std::mem::size_of::<Record>() == 32);

impl Record {
    const FREE: Record = Record {
        entry: Entry::Free,
        key: Key(0),
        links: UNLINKED,
    };
}

impl LinkNode for Record {
    fn links(&self) -> [u32; 2] {
        self.links
    }
    fn links_mut(&mut self) -> &mut [u32; 2] {
        &mut self.links
    }
}

/// The CPU pool. See the module documentation.
#[derive(Debug)]
pub struct Pool {
    config: PoolConfig,
    index: SlotIndex,
    records: Vec<Record>,
    free: FreeSlots,
    policy: Box<dyn EvictionPolicy<Record>>,
    admission: Admission,
    events: Vec<PoolEvent>,
    event_keys: usize,
    event_limit: usize,
    storing: u32,
    /// Slots held for a late writer (`hold.rs`).
    held: u32,
    pinned: u32,
    stats: PoolStats,
    victims: Vec<SlotId>,
    /// Reused per call (slots of `complete_store`'s keys, `prepare_store`'s protected ones).
    scratch: Vec<SlotId>,
    /// Reused per call (`prepare_store`'s duplicate check).
    seen: CallKeys,
    /// Reused per call (`touch_batch`'s batch).
    touches: Vec<Touch>,
}

impl Pool {
    /// An empty pool. Fails when the capacity is 0 or above [`MAX_CAPACITY`].
    pub fn new(config: PoolConfig) -> Result<Pool> {
        let c = config.capacity;
        if c == 0 || c > MAX_CAPACITY {
            return Err(Error::Config(format!(
                "pool capacity must be between 1 and {MAX_CAPACITY} slots, got {c}: \
                 size it as CPU bytes for KV / bytes per chunk"
            )));
        }
        Ok(Pool {
            config,
            index: SlotIndex::new(c),
            records: crate::mem::huge_page_vec(Record::FREE, c as usize),
            free: FreeSlots::all(c),
            policy: config.policy.build(c),
            admission: Admission::new(config.store_threshold, c),
            events: Vec::new(),
            event_keys: 0,
            event_limit: default_event_limit(c),
            storing: 0,
            held: 0,
            pinned: 0,
            stats: PoolStats::default(),
            victims: Vec::new(),
            scratch: Vec::new(),
            seen: CallKeys::default(),
            touches: Vec::new(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> PoolConfig {
        self.config
    }

    /// Number of slots.
    pub fn capacity(&self) -> u32 {
        self.config.capacity
    }

    /// The eviction policy in use.
    pub fn policy(&self) -> PolicyKind {
        self.config.policy
    }

    /// Number of keys present (storing or ready).
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether no key is present.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Empties the pool: every entry (pinned and storing ones included), the policy's order
    /// and history, and the admission counts. Ready keys are announced in one `removed` event
    /// (queued after any undrained events). Counters are kept; `resets` counts the call.
    pub fn reset(&mut self) {
        let mut removed: Vec<(SlotId, Key)> = self
            .index
            .iter(&self.records)
            .filter(|&(_, s)| matches!(self.entry(s), Entry::Ready(_)))
            .map(|(k, s)| (s, k))
            .collect();
        removed.sort_unstable();
        if !removed.is_empty() {
            self.emit(
                PoolEventKind::Removed,
                removed.into_iter().map(|(_, k)| k).collect(),
            );
        }
        self.index.clear();
        self.records.fill(Record::FREE);
        self.free = FreeSlots::all(self.config.capacity);
        self.policy.clear(&mut self.records);
        self.admission.clear();
        self.storing = 0;
        self.held = 0;
        self.pinned = 0;
        self.stats.resets += 1;
    }

    /// The state of `slot` (in range).
    fn entry(&self, slot: SlotId) -> Entry {
        self.records[slot.0 as usize].entry
    }

    /// The state of `slot` (in range), mutably.
    fn entry_mut(&mut self, slot: SlotId) -> &mut Entry {
        &mut self.records[slot.0 as usize].entry
    }

    /// The key `slot` holds or last held (in range).
    fn key_of(&self, slot: SlotId) -> Key {
        self.records[slot.0 as usize].key
    }
}
