//! Probation, shared by the tiers (DESIGN.md §9): a tier whose operations keep failing or
//! missing their deadline is put on probation for a while (stores are dropped and counted,
//! lookups skip it), then tried again.
//!
//! After `after` consecutive failures the tier is on probation for `period`. The first
//! operation admitted after that is a *trial*: a success ends the probation (a *recovery*),
//! a failure starts another one at once. The shared (Redis) tier's client keeps one per
//! client (its operations are pipelines); the scheduler keeps one per disk tier (its
//! operations are tier jobs: a failed or expired job is a failure).

use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// The health of one tier. See the module documentation.
#[derive(Clone, Debug)]
pub struct Health {
    after: u32,
    period: Duration,
    failures: u32,
    until: Option<Instant>,
    trial: bool,
    probations: u64,
    recoveries: u64,
}

/// What [`Health::record`] changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transition {
    /// Nothing.
    None,
    /// A probation started.
    Probation,
    /// A trial succeeded: the probation is over.
    Recovery,
}

impl Health {
    /// Probation after `after` consecutive failures (`>= 1`, else [`Error::Config`] naming
    /// `field`), for `period`.
    pub fn new(field: &str, after: u32, period: Duration) -> Result<Self> {
        if after == 0 {
            return Err(Error::Config(format!("{field} must be >= 1, got 0")));
        }
        Ok(Self {
            after,
            period,
            failures: 0,
            until: None,
            trial: false,
            probations: 0,
            recoveries: 0,
        })
    }

    /// Whether the tier is on probation at `now` (operations are skipped).
    pub fn on_probation(&self, now: Instant) -> bool {
        self.until.is_some_and(|t| now < t)
    }

    /// Whether an operation may run at `now`: not on probation, or the probation is over
    /// (then this operation is the trial).
    pub fn admit(&mut self, now: Instant) -> bool {
        match self.until {
            Some(t) if now < t => false,
            Some(_) => {
                self.until = None;
                self.trial = true;
                true
            }
            None => true,
        }
    }

    /// Records the outcome of an operation that ended at `now`.
    pub fn record(&mut self, ok: bool, now: Instant) -> Transition {
        if ok {
            self.failures = 0;
            if std::mem::take(&mut self.trial) {
                self.recoveries += 1;
                return Transition::Recovery;
            }
            return Transition::None;
        }
        self.failures = self.failures.saturating_add(1);
        if self.until.is_none() && (self.trial || self.failures >= self.after) {
            self.trial = false;
            self.until = Some(now + self.period);
            self.probations += 1;
            return Transition::Probation;
        }
        Transition::None
    }

    /// Times the tier was put on probation.
    pub fn probations(&self) -> u64 {
        self.probations
    }

    /// Trials that ended a probation.
    pub fn recoveries(&self) -> u64 {
        self.recoveries
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probation_after_failures_then_a_trial() {
        let t0 = Instant::now();
        let p = Duration::from_secs(1);
        let mut h = Health::new("x", 2, p).unwrap();
        assert!(Health::new("x_after", 0, p)
            .unwrap_err()
            .to_string()
            .contains("x_after"));
        assert_eq!(h.record(false, t0), Transition::None);
        assert_eq!(h.record(true, t0), Transition::None);
        assert_eq!(h.record(false, t0), Transition::None);
        assert_eq!(h.record(false, t0), Transition::Probation);
        assert!(h.on_probation(t0) && !h.admit(t0));
        // After the period: one trial; its failure starts another probation at once.
        let t1 = t0 + p;
        assert!(h.admit(t1) && !h.on_probation(t1));
        assert_eq!(h.record(false, t1), Transition::Probation);
        assert!(!h.admit(t1));
        let t2 = t1 + p;
        assert!(h.admit(t2));
        assert_eq!(h.record(true, t2), Transition::Recovery);
        assert_eq!((h.probations(), h.recoveries()), (2, 1));
        assert_eq!(h.record(false, t2), Transition::None);
    }
}
