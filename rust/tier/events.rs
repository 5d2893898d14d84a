//! The bounded event queue of a lower tier (the CPU pool's rule, `pool/events.rs`): an event
//! that does not fit under the limit (in keys) is dropped whole and counted, so a caller that
//! never drains costs bounded memory and one that does can tell when its index went stale.

use crate::ids::Key;
use crate::pool::PoolEventKind;

use super::{Medium, TierEvent};

/// A tier's event queue. See the module documentation.
#[derive(Clone, Debug)]
pub struct TierEvents {
    medium: Medium,
    events: Vec<TierEvent>,
    keys: usize,
    limit: usize,
    dropped: u64,
}

impl TierEvents {
    /// An empty queue of events of `medium`, bounded to `limit` keys (0: records nothing).
    pub fn new(medium: Medium, limit: usize) -> Self {
        Self {
            medium,
            events: Vec::new(),
            keys: 0,
            limit,
            dropped: 0,
        }
    }

    /// Queues an event if it fits under the limit, else counts it as dropped.
    pub fn push(&mut self, kind: PoolEventKind, keys: Vec<Key>) {
        if keys.is_empty() {
            return;
        }
        if self.keys + keys.len() > self.limit {
            self.dropped += 1;
            return;
        }
        self.keys += keys.len();
        self.events.push(TierEvent {
            medium: self.medium,
            kind,
            keys,
        });
    }

    /// Drains the queued events, oldest first.
    pub fn take(&mut self) -> Vec<TierEvent> {
        self.keys = 0;
        std::mem::take(&mut self.events)
    }

    /// Bounds the queue to `limit` keys (0: record no events); queued events stay.
    pub fn set_limit(&mut self, limit: usize) {
        self.limit = limit;
    }

    /// Events dropped so far (the queue was full, or recording was off).
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Keys in the events queued now.
    pub fn queued_keys(&self) -> usize {
        self.keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_drops_whole_events_and_counts_them() {
        let mut q = TierEvents::new(Medium::Disk, 3);
        q.push(PoolEventKind::Stored, vec![Key(1), Key(2)]);
        q.push(PoolEventKind::Stored, vec![Key(3), Key(4)]);
        q.push(PoolEventKind::Removed, vec![Key(1)]);
        assert_eq!((q.dropped(), q.queued_keys()), (1, 3));
        let e = q.take();
        assert_eq!(e.len(), 2);
        assert_eq!(
            (e[1].kind, e[1].medium),
            (PoolEventKind::Removed, Medium::Disk)
        );
        q.set_limit(0);
        q.push(PoolEventKind::Stored, vec![Key(5)]);
        assert!(q.take().is_empty());
        assert_eq!(q.dropped(), 2);
    }
}
