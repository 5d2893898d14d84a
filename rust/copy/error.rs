//! [`CopyError`]: what went wrong with a registration or a copy (nothing was copied).

/// What went wrong with a registration or a copy. Nothing was copied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CopyError {
    /// A region's rows do not fit the registration.
    #[error("group {group} region {region}: {reason}")]
    Region {
        /// KV group index.
        group: usize,
        /// Region index within the group.
        region: usize,
        /// What does not fit.
        reason: String,
    },
    /// GPU-side and CPU-side rows share bytes: a copy could overlap its own source.
    #[error(
        "group {group} region {region}: its {side}-side rows overlap the other side's rows of \
         group {other_group} region {other_region}"
    )]
    Overlap {
        /// KV group index.
        group: usize,
        /// Region index within the group.
        region: usize,
        /// `"GPU"` or `"CPU"`.
        side: &'static str,
        /// KV group of the other region.
        other_group: usize,
        /// Region index of the other region.
        other_region: usize,
    },
    /// A run names a group that is not registered.
    #[error("run {run}: group {group} is not registered ({groups} groups)")]
    UnknownGroup {
        /// Index of the run in the call.
        run: usize,
        /// The group named.
        group: usize,
        /// Groups registered.
        groups: usize,
    },
    /// A run names a region its group does not have.
    #[error("run {run}: group {group} has {regions} regions, not region {region}")]
    UnknownRegion {
        /// Index of the run in the call.
        run: usize,
        /// The group.
        group: usize,
        /// The region named.
        region: usize,
        /// Regions of the group.
        regions: usize,
    },
    /// A run's rows leave the registered rows.
    #[error(
        "run {run} (group {group}): {side} rows {start}..{start}+{count} are outside the \
         {rows} registered rows"
    )]
    RowsOutOfRange {
        /// Index of the run in the call.
        run: usize,
        /// The group.
        group: usize,
        /// `"GPU"` or `"CPU"`.
        side: &'static str,
        /// First row, as given.
        start: i64,
        /// Row count, as given.
        count: i64,
        /// Rows registered on that side.
        rows: usize,
    },
    /// A packed runs buffer that is not a whole number of rows, or rows past its end.
    #[error("{reason}")]
    Packed {
        /// What is wrong.
        reason: String,
    },
    /// A run's three row lists differ in length.
    #[error("run {run}: {gpu} GPU starts, {cpu} CPU starts and {counts} counts")]
    Lengths {
        /// Index of the run in the call.
        run: usize,
        /// GPU starts given.
        gpu: usize,
        /// CPU starts given.
        cpu: usize,
        /// Counts given.
        counts: usize,
    },
}
