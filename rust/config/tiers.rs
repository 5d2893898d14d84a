//! The lower tiers' options (the disk tier, the shared tier, the CPUs of their I/O threads),
//! checked with the scheduler's own in [`super::SchedulerArgs::resolve`], so that every option
//! is checked in one place whoever builds a scheduler: a bad value is an [`Error::Config`]
//! naming the field and the value, even for a tier that is not configured, and nothing is
//! opened until every value passed (the form of `remote_url` too, without connecting). What
//! can only be checked by opening (the disk directory, the server's certificate) is checked
//! when [`crate::scheduler::Scheduler::open`] attaches the tiers.

use std::path::PathBuf;
use std::time::Duration;

use super::{check_range, check_u32, deadline_ms};
use crate::error::{Error, Result};
use crate::scheduler::{DiskWatch, TierAdmission};
use crate::tier::affinity::CpuSet;
use crate::tier::remote::RemoteConfig;

/// Most MB/s of `disk_write_mbps` (1 TB/s).
pub const MAX_DISK_WRITE_MBPS: f64 = 1e6;

/// How long the shared tier's existence answers are trusted: present keys.
pub const REMOTE_TTL: Duration = Duration::from_secs(60);

/// How long the shared tier's existence answers are trusted: absent keys.
pub const REMOTE_RETRY: Duration = Duration::from_secs(1);

/// The lower tiers' options as the caller gave them: integers not yet narrowed, numbers not
/// yet checked. [`TierArgs::resolve`] checks every value.
#[derive(Debug, Clone, PartialEq)]
pub struct TierArgs {
    /// Directory of the disk tier; `None`: no disk tier.
    pub disk_path: Option<PathBuf>,
    /// Bytes of the disk tier per group and worker (with `disk_path` only).
    pub disk_bytes: Option<i128>,
    /// Weights and dtype in the disk tier's namespace.
    pub disk_model: String,
    /// Longest time a promotion from the disk tier may take, in milliseconds.
    pub disk_deadline_ms: f64,
    /// Failed or expired disk jobs in a row that put the disk tier on probation.
    pub disk_probation_after: i128,
    /// How long a probation of the disk tier lasts, in milliseconds.
    pub disk_probation_ms: f64,
    /// Most MB/s written behind to the disk tier (0: no limit).
    pub disk_write_mbps: f64,
    /// Loads from the CPU pool before a chunk is written behind to the disk tier.
    pub disk_min_hits: i128,
    /// URL of the shared tier; `None`: no shared tier.
    pub remote_url: Option<String>,
    /// Weights and dtype in the shared tier's namespace.
    pub remote_model: String,
    /// Tenant salt in the shared tier's namespace.
    pub cache_salt: String,
    /// Longest wait for one operation of the shared tier, in milliseconds.
    pub remote_deadline_ms: f64,
    /// PEM file of the CAs that sign the servers' certificates (`rediss://`).
    pub remote_tls_ca: Option<PathBuf>,
    /// Loads from the CPU pool before a chunk is written behind to the shared tier.
    pub remote_min_hits: i128,
    /// CPU ids of the lower tiers' I/O threads; `None`: not pinned.
    pub io_cpus: Option<Vec<i64>>,
}

impl Default for TierArgs {
    /// No lower tier; each option at the default a Rust caller gets.
    fn default() -> Self {
        let watch = DiskWatch::default();
        Self {
            disk_path: None,
            disk_bytes: None,
            disk_model: String::new(),
            disk_deadline_ms: watch.deadline.as_secs_f64() * 1000.0,
            disk_probation_after: i128::from(watch.probation_after),
            disk_probation_ms: watch.probation.as_secs_f64() * 1000.0,
            disk_write_mbps: 0.0,
            disk_min_hits: 0,
            remote_url: None,
            remote_model: String::new(),
            cache_salt: String::new(),
            remote_deadline_ms: 1000.0,
            remote_tls_ca: None,
            remote_min_hits: 0,
            io_cpus: None,
        }
    }
}

/// The disk tier of a configuration, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskTier {
    /// Its directory.
    pub path: PathBuf,
    /// Bytes per group and worker.
    pub bytes: u64,
    /// Weights and dtype in its namespace.
    pub model: String,
    /// Its deadline, probation and write rate limit.
    pub watch: DiskWatch,
    /// Which chunks are written behind to it.
    pub admission: TierAdmission,
}

/// The shared tier of a configuration, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteTier {
    /// How its client reaches the server (URL, deadline, CA file).
    pub client: RemoteConfig,
    /// Weights and dtype in its namespace.
    pub model: String,
    /// Tenant salt in its namespace.
    pub cache_salt: String,
    /// Which chunks are written behind to it.
    pub admission: TierAdmission,
}

/// The lower tiers of a configuration, checked; none by default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierConfig {
    /// The disk tier, if any.
    pub disk: Option<DiskTier>,
    /// The shared tier, if any.
    pub remote: Option<RemoteTier>,
    /// CPUs of the lower tiers' I/O threads; `None`: not pinned.
    pub io_cpus: Option<CpuSet>,
}

impl TierArgs {
    /// Checks every value, those of a tier that is not configured too.
    pub fn resolve(&self) -> Result<TierConfig> {
        let watch = DiskWatch {
            deadline: deadline_ms("disk_deadline_ms", self.disk_deadline_ms)?,
            probation_after: check_u32(
                "disk_probation_after",
                self.disk_probation_after,
                1,
                u32::MAX,
            )?,
            probation: deadline_ms("disk_probation_ms", self.disk_probation_ms)?,
            write_bytes_per_s: write_rate(self.disk_write_mbps)?,
        };
        let min_hits = |field: &str, v: i128| {
            check_u32(field, v, 0, u32::MAX).map(|min_hits| TierAdmission { min_hits })
        };
        let disk_admission = min_hits("disk_min_hits", self.disk_min_hits)?;
        let remote_admission = min_hits("remote_min_hits", self.remote_min_hits)?;
        let remote_deadline = deadline_ms("remote_deadline_ms", self.remote_deadline_ms)?;
        let disk = match (&self.disk_path, self.disk_bytes) {
            (None, None) => None,
            (None, Some(b)) => {
                return Err(Error::Config(format!("disk_bytes={b} needs disk_path")));
            }
            (Some(path), bytes) => Some(DiskTier {
                path: path.clone(),
                bytes: match bytes {
                    Some(b) if b > 0 => check_range("disk_bytes", b, 1, u64::MAX)?,
                    Some(b) => return Err(positive_bytes(b)),
                    None => return Err(positive_bytes("None")),
                },
                model: self.disk_model.clone(),
                watch,
                admission: disk_admission,
            }),
        };
        let remote = match &self.remote_url {
            None => None,
            Some(url) => {
                RemoteConfig::check_url(url)?;
                let mut client = RemoteConfig::new(url);
                client.deadline = remote_deadline;
                client.tls_ca.clone_from(&self.remote_tls_ca);
                Some(RemoteTier {
                    client,
                    model: self.remote_model.clone(),
                    cache_salt: self.cache_salt.clone(),
                    admission: remote_admission,
                })
            }
        };
        if let (None, Some(ca)) = (&remote, &self.remote_tls_ca) {
            return Err(Error::Config(format!(
                "remote_tls_ca={} needs remote_url",
                ca.display()
            )));
        }
        let io_cpus = self.io_cpus.as_deref().map(CpuSet::new).transpose()?;
        Ok(TierConfig {
            disk,
            remote,
            io_cpus,
        })
    }
}

fn positive_bytes(got: impl std::fmt::Display) -> Error {
    Error::Config(format!("disk_bytes must be a positive integer, got {got}"))
}

/// Checks `disk_write_mbps`, a number of MB/s in [0, [`MAX_DISK_WRITE_MBPS`]], and turns it
/// into bytes per second (0: no limit).
pub fn write_rate(mbps: f64) -> Result<u64> {
    if mbps.is_finite() && (0.0..=MAX_DISK_WRITE_MBPS).contains(&mbps) {
        Ok((mbps * 1e6) as u64)
    } else {
        Err(Error::Config(format!(
            "disk_write_mbps must be a number of MB/s in [0, 1e6] (0: no limit), got {mbps}"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(a: &TierArgs) -> String {
        match a.resolve() {
            Err(Error::Config(m)) => m,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn no_tier_by_default_and_the_given_ones_resolved() {
        assert_eq!(
            TierArgs::default().resolve().unwrap(),
            TierConfig::default()
        );
        let a = TierArgs {
            disk_path: Some("/d".into()),
            disk_bytes: Some(1 << 20),
            disk_write_mbps: 2.5,
            disk_min_hits: 1,
            remote_url: Some("redis://h:1".into()),
            remote_deadline_ms: 250.0,
            ..TierArgs::default()
        };
        let t = a.resolve().unwrap();
        let disk = t.disk.unwrap();
        assert_eq!(
            (disk.bytes, disk.watch.write_bytes_per_s),
            (1 << 20, 2_500_000)
        );
        assert_eq!(disk.admission.min_hits, 1);
        let remote = t.remote.unwrap();
        assert_eq!(remote.client.deadline, Duration::from_millis(250));
        assert_eq!(remote.admission.min_hits, 0);
    }

    #[test]
    fn bad_values_name_the_field_even_without_the_tier() {
        type Change = fn(&mut TierArgs);
        let bad: [(Change, &str); 11] = [
            (|a| a.disk_deadline_ms = 0.0, "disk_deadline_ms"),
            (
                |a| a.disk_probation_after = 0,
                "disk_probation_after must be in 1..=",
            ),
            (|a| a.disk_probation_ms = f64::NAN, "disk_probation_ms"),
            (|a| a.disk_write_mbps = -1.0, "disk_write_mbps"),
            (|a| a.disk_min_hits = -1, "disk_min_hits must be in 0..="),
            (|a| a.remote_min_hits = 1 << 32, "remote_min_hits"),
            (|a| a.remote_deadline_ms = 4e6, "remote_deadline_ms"),
            (|a| a.disk_bytes = Some(1), "disk_bytes=1 needs disk_path"),
            (
                |a| a.remote_tls_ca = Some("/ca".into()),
                "remote_tls_ca=/ca needs remote_url",
            ),
            (|a| a.remote_url = Some("http://h:1".into()), "remote_url"),
            (
                |a| a.remote_url = Some("redis+cluster://h".into()),
                "seed \"h\" has no port",
            ),
        ];
        for (change, expected) in bad {
            let mut a = TierArgs::default();
            change(&mut a);
            assert!(message(&a).contains(expected), "{}", message(&a));
        }
        let mut a = TierArgs {
            disk_path: Some("/d".into()),
            ..TierArgs::default()
        };
        assert_eq!(
            message(&a),
            "disk_bytes must be a positive integer, got None"
        );
        a.disk_bytes = Some(0);
        assert_eq!(message(&a), "disk_bytes must be a positive integer, got 0");
    }

    #[test]
    fn io_cpus_are_checked_as_the_workers_check_them() {
        let a = TierArgs {
            io_cpus: Some(vec![-1]),
            ..TierArgs::default()
        };
        assert!(message(&a).contains("io_cpus"));
    }
}
