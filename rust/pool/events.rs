//! Changes visible to caches that index the CPU tier (stored / removed keys, medium `cpu`),
//! queued in a bounded queue and drained by the caller.

use crate::ids::Key;

use super::Pool;

/// The medium of every event of this pool.
pub const MEDIUM: &str = "cpu";

/// The default bound of the event queue, in keys: twice the capacity, at least 65536.
pub fn default_event_limit(capacity: u32) -> usize {
    (2 * capacity as usize).max(1 << 16)
}

/// What happened to the keys of a [`PoolEvent`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PoolEventKind {
    /// The keys became readable (a store completed).
    Stored,
    /// The keys were evicted or dropped by a reset; they are no longer readable.
    Removed,
}

impl PoolEventKind {
    /// `"stored"` or `"removed"`.
    pub fn name(self) -> &'static str {
        match self {
            PoolEventKind::Stored => "stored",
            PoolEventKind::Removed => "removed",
        }
    }
}

/// A change visible to caches that index this tier, e.g. a router.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolEvent {
    /// Stored or removed.
    pub kind: PoolEventKind,
    /// The keys, in the order of the call that changed them.
    pub keys: Vec<Key>,
}

impl PoolEvent {
    /// The medium the keys live on: always [`MEDIUM`] (`"cpu"`).
    pub fn medium(&self) -> &'static str {
        MEDIUM
    }
}

impl Pool {
    /// Drains the queued events, oldest first.
    pub fn take_events(&mut self) -> Vec<PoolEvent> {
        self.event_keys = 0;
        std::mem::take(&mut self.events)
    }

    /// Bounds the event queue to `limit` keys (0: record no events). Events already queued
    /// stay until drained.
    pub fn set_event_limit(&mut self, limit: usize) {
        self.event_limit = limit;
    }

    /// The bound of the event queue, in keys (0: events are not recorded).
    pub fn event_limit(&self) -> usize {
        self.event_limit
    }

    /// Queues an event if it fits under the limit, else counts it as dropped.
    pub(super) fn emit(&mut self, kind: PoolEventKind, keys: Vec<Key>) {
        if self.event_fits(keys.len()) {
            self.events.push(PoolEvent { kind, keys });
        }
    }

    /// [`Pool::emit`] of a copy of `keys`, made only when the event fits (no work when events
    /// are off).
    pub(super) fn emit_copy(&mut self, kind: PoolEventKind, keys: &[Key]) {
        if self.event_fits(keys.len()) {
            let keys = keys.to_vec();
            self.events.push(PoolEvent { kind, keys });
        }
    }

    /// Whether an event of `n` keys fits under the limit: if so its keys are counted as
    /// queued, else the event is counted as dropped.
    fn event_fits(&mut self, n: usize) -> bool {
        if self.event_keys + n > self.event_limit {
            self.stats.events_dropped += 1;
            return false;
        }
        self.event_keys += n;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::PoolConfig;

    fn stored(pool: &mut Pool, keys: &[u128]) {
        let keys: Vec<Key> = keys.iter().map(|&k| Key(k)).collect();
        pool.prepare_store(&keys).expect("room");
        pool.complete_store(&keys, true).unwrap();
    }

    #[test]
    fn the_event_queue_is_bounded_and_counts_what_it_dropped() {
        let mut pool = Pool::new(PoolConfig::new(16)).unwrap();
        assert_eq!(pool.event_limit(), 1 << 16);
        pool.set_event_limit(3);
        stored(&mut pool, &[1, 2]);
        stored(&mut pool, &[3, 4]); // would make 4 keys: dropped whole
        stored(&mut pool, &[5]);
        let s = pool.stats();
        assert_eq!((s.events_dropped, s.event_keys_queued), (1, 3));
        let events = pool.take_events();
        let keys: Vec<Vec<u128>> = events
            .iter()
            .map(|e| e.keys.iter().map(|k| k.0).collect())
            .collect();
        assert_eq!(keys, vec![vec![1, 2], vec![5]]);
        assert_eq!(pool.stats().event_keys_queued, 0);
        // Draining makes room again.
        stored(&mut pool, &[6, 7, 8]);
        assert_eq!(pool.take_events().len(), 1);
        // Limit 0: nothing is recorded, everything is counted.
        pool.set_event_limit(0);
        stored(&mut pool, &[9]);
        assert!(pool.take_events().is_empty());
        assert_eq!(pool.stats().events_dropped, 2);
    }
}
