//! The shared tier on Redis (DESIGN.md §9): the client every process of a fleet uses to write
//! chunks behind, ask which chunks exist, and read them back, so a prefix computed by one engine
//! is loaded by the others.
//!
//! It speaks to a real Redis server through the `redis` crate on Rust threads (the bindings
//! release the GIL around every call); a Python client would cap the tier at a fraction of the
//! link. How:
//!
//! - **Values**: one value per chunk, the [`header`](super::header) then the data; a chunk above
//!   [`RemoteConfig::part_bytes`] is split into a small fixed set of parts (at most
//!   [`MAX_PARTS`]), part 0 carrying the header. Parts are written last-to-first in one pipeline,
//!   so part 0 (the header) is published last: the two-phase publish.
//! - **Keys** carry the namespace digest of the chunk's place (model, chunk size, block size,
//!   blocks per chunk, rank, group and the optional per-request `cache_salt`: what a scheduler
//!   knows, so it can check existence): `kvo:<namespace>:<key>[:<part>]`. Tenants never share
//!   a key. **Headers** carry the writer's whole layout (also its tensors' element type and
//!   split of a chunk into tensors: [`ChunkNames`]), and every header is checked against the
//!   reader's: an engine of another layout under the same key reads a mismatch, never bytes.
//! - **Pipelined batches**: a call's chunks are packed into sub-batches of about
//!   [`BATCH_BYTES`] for reads and [`WRITE_BATCH_BYTES`] for writes, each one pipeline (one
//!   write of all its commands, then all replies) on a connection from the pool; sub-batches
//!   run in parallel on up to [`RemoteConfig::connections`] threads. Existence checks of any
//!   number of keys are one pipeline: one round trip.
//! - **Deadlines**: every pipeline has [`RemoteConfig::deadline`] and ends by it in wall time,
//!   however the server sends its bytes: before each read and write system call the socket's
//!   timeout is set to the time left. A late or failed operation drops its connection (which
//!   cancels its I/O), and a reply longer than a chunk part and its header fails it too.
//! - **Probation**: after [`RemoteConfig::probation_after`] consecutive failed or late
//!   operations the tier is on probation for [`RemoteConfig::probation`]: writes are dropped and
//!   counted, lookups and reads answer "miss" without I/O. The first operation after that is a
//!   trial: success ends the probation (a *recovery*, counted), failure starts another.
//! - **Chunk values on the wire**: `SET`s of chunk values and `GET` replies go through the small
//!   `bulk` connection: a write is one `writev` of the framing and the caller's memory (no
//!   copy), a reply is read straight into the destination (the crate's parser costs four times
//!   the CPU per byte). Each write thread sends the next pipeline's *lead* (its framing up to
//!   its last large value) after the current pipeline and the rest of it once the current
//!   replies are in, so the server takes each large value without copying it (see
//!   `pack::Packed::finish_split`). Existence checks use the same connections; the crate
//!   parses the URL.
//! - **Verification**: every read checks the header (magic, version, namespace, key, group,
//!   length) and the data's checksum; any mismatch is a miss, counted, and the caller must not
//!   serve the bytes.

//!
//! - **Cluster**: `remote_url = "redis+cluster://[user[:password]@]host:port[,host:port…]"`
//!   names seed nodes of a Redis Cluster (see `cluster.rs`). Keys carry a hash tag of their
//!   chunk (`kvo:{<namespace>:<key>}[:<part>]`): a chunk's parts share a slot, so its parts
//!   and then its header are published in order on one master, and chunks spread over all
//!   slots. Each call is split per master and sent to all of them in parallel; every master
//!   has its own pool, deadline and probation (one slow master costs only its slots).
//!
//! Files: this one the configuration, counters, items and keys; `pack.rs` how a pipeline's
//! commands are laid out (data pieces sent from the caller's memory, the lead split off);
//! `bulk.rs` the connection that sends and receives chunk values; `client.rs` the client of
//! one server (connection pools, probation, counters, write / exists / read); `send.rs` how it
//! sends one operation (deadline, outcome) and runs a call's sub-batches on parallel threads;
//! `cluster.rs` the tier's client, on one server or on a cluster (slot map, per-master
//! split, redirections); `slots.rs` cluster URLs, hash slots and the slot map.

mod bulk;
mod client;
mod cluster;
mod index;
mod pack;
mod send;
mod slots;

pub use cluster::RemoteClient;
pub use index::{RemoteIndex, RemoteIndexConfig, MEDIUM};
pub use slots::{key_slot, slot_of, ClusterUrl, SLOTS};

use std::time::Duration;

use crate::ids::Key;
use crate::tier::counters::atomic_counters;

/// Most parts one chunk is split into.
pub const MAX_PARTS: usize = 16;
/// Target bytes of one pipelined sub-batch (one operation, one deadline).
pub const BATCH_BYTES: usize = 8 << 20;
/// Target bytes of one pipelined sub-batch of writes: a chunk of this size or more is written
/// alone, smaller ones share a pipeline.
///
/// Why smaller than [`BATCH_BYTES`]: the server (one thread, the bottleneck of a write) takes a
/// large value (≥ 32 KiB) without copying it only when its read buffer starts with that value
/// and holds nothing after it; in a pipeline of several such `SET`s it reads past each value
/// and copies it again. Measured with 2 MiB chunks: the server's `memcpy` fell from 15% to 6%
/// of its CPU (perf), the round trip per chunk is hidden by the parallel connections. The rest
/// of that copy came from the command's framing read together with the value's first bytes:
/// the client now sends that framing ahead (see `pack::Packed::finish_split`).
pub const WRITE_BATCH_BYTES: usize = 1 << 20;

/// How to reach the server and how patient to be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteConfig {
    /// `redis://[user:password@]host:port[/db]`, or a cluster's seed nodes:
    /// `redis+cluster://[user:password@]host:port[,host:port…]`; `rediss` instead of `redis`:
    /// over TLS (with [`RemoteConfig::tls_ca`]).
    pub url: String,
    /// Longest wait for one pipelined operation (and for connecting).
    pub deadline: Duration,
    /// Connections in the pool: sub-batches of one call run on this many threads at most.
    pub connections: usize,
    /// Chunks with more data bytes than this are stored as several parts.
    pub part_bytes: usize,
    /// Consecutive failed or late operations that put the tier on probation.
    pub probation_after: u32,
    /// How long a probation lasts before the next trial.
    pub probation: Duration,
    /// For `rediss://` (TLS): the PEM file of the CA certificates that sign the servers'.
    pub tls_ca: Option<std::path::PathBuf>,
}

impl RemoteConfig {
    /// Checks the form of a `url` (a server's or a cluster's) without connecting: a
    /// [`crate::Error::Config`] naming it (password redacted) when the client would refuse it.
    pub fn check_url(url: &str) -> crate::Result<()> {
        match ClusterUrl::parse(url)? {
            Some(_) => Ok(()),
            None => client::parse_url(url).map(|_| ()),
        }
    }

    /// Defaults for `url`: 1 s deadline, one connection per core (at most 4: more only add
    /// contention with the server on small machines; measured 3.1 GB/s writes with 2 on 2
    /// cores against 1.9 with 8), 64 MiB parts, probation after 3 failures for 2 s.
    pub fn new(url: &str) -> Self {
        Self {
            url: url.to_owned(),
            deadline: Duration::from_secs(1),
            connections: std::thread::available_parallelism().map_or(2, |n| n.get().min(4)),
            part_bytes: 64 << 20,
            probation_after: 3,
            probation: Duration::from_secs(2),
            tls_ca: None,
        }
    }
}

atomic_counters! {
    /// The live counters of one client (thread-safe, cumulative).
    pub struct RemoteCounters =>
    /// Counters of one client (cumulative): a copy of its [`RemoteCounters`].
    RemoteStats {
        /// Chunks written (every part acknowledged).
        writes,
        /// Chunks whose write failed (error, deadline, server refusal).
        failed_writes,
        /// Chunks not written because the tier was on probation.
        dropped_writes,
        /// Chunks read and verified.
        read_hits,
        /// Chunks asked for and not found (or found incomplete).
        read_misses,
        /// Chunks whose read failed (error, deadline): not served.
        failed_reads,
        /// Chunks found but refused by verification (header or checksum): not served.
        checksum_mismatches,
        /// Keys looked up.
        lookups,
        /// Keys found by lookups.
        lookup_hits,
        /// Lookups answered "miss" without I/O because the tier was on probation.
        skipped_lookups,
        /// Pipelines sent (each one round trip).
        round_trips,
        /// Operations that failed with an error (connection refused or broken, server error).
        errors,
        /// Operations that missed their deadline.
        deadline_misses,
        /// Times the tier was put on probation.
        probations,
        /// Trials that ended a probation.
        recoveries,
        /// Value bytes written (headers included).
        bytes_written,
        /// Value bytes read (headers included).
        bytes_read,
        /// Commands a cluster answered with a redirection (`MOVED`, `ASK`): sent again.
        redirects,
    }
}

/// The outcome of one chunk's read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadOutcome {
    /// Found and verified: the destination holds the chunk's data.
    Hit,
    /// Not there (never written, evicted, flushed; or a part of it is gone).
    Miss,
    /// Found but refused by verification: the destination holds garbage.
    Corrupt,
    /// The operation failed or was skipped (probation): the destination holds garbage.
    Failed,
}

/// One chunk to write: its identity and its data as pieces (concatenated in order).
#[derive(Clone, Debug)]
pub struct WriteItem<'a> {
    /// The chunk's key.
    pub key: Key,
    /// Its KV group.
    pub group: u32,
    /// The data, as pieces.
    pub data: Vec<&'a [u8]>,
}

/// One chunk to read: its identity and where its data goes (pieces filled in order).
#[derive(Debug)]
pub struct ReadItem<'a> {
    /// The chunk's key.
    pub key: Key,
    /// Its KV group.
    pub group: u32,
    /// Destination pieces; their total length is the data length expected.
    pub dst: Vec<&'a mut [u8]>,
}

impl ReadItem<'_> {
    fn len(&self) -> usize {
        self.dst.iter().map(|d| d.len()).sum()
    }
}

/// `(count, size)` of the parts of a chunk of `len` data bytes.
pub fn parts(len: usize, part_bytes: usize) -> (usize, usize) {
    let size = part_bytes.max(len.div_ceil(MAX_PARTS)).max(1);
    (len.div_ceil(size).max(1), size)
}

/// The namespaces of a chunk in the shared tier: the digest its Redis keys carry (what every
/// engine of a fleet computes from its configuration, so schedulers can check existence) and
/// the digest its header carries (the writer's whole layout, down to its tensors, checked by
/// every reader: chunks of another layout never verify). A plain digest is both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkNames {
    /// Namespace digest in the keys.
    pub key: u128,
    /// Namespace digest in the headers.
    pub header: u128,
}

impl From<u128> for ChunkNames {
    fn from(namespace: u128) -> Self {
        Self {
            key: namespace,
            header: namespace,
        }
    }
}

/// The Redis key of part `part` of chunk `key` in namespace `namespace`.
pub fn value_key(namespace: u128, key: Key, part: usize) -> Vec<u8> {
    if part == 0 {
        format!("kvo:{namespace:032x}:{:032x}", key.0).into_bytes()
    } else {
        format!("kvo:{namespace:032x}:{:032x}:{part}", key.0).into_bytes()
    }
}

/// The Redis key of part `part` of chunk `key` in namespace `namespace` on a cluster: the
/// chunk's identity is its hash tag, so all its parts live in one slot.
pub fn value_key_tagged(namespace: u128, key: Key, part: usize) -> Vec<u8> {
    if part == 0 {
        format!("kvo:{{{namespace:032x}:{:032x}}}", key.0).into_bytes()
    } else {
        format!("kvo:{{{namespace:032x}:{:032x}}}:{part}", key.0).into_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_few_and_cover_the_data() {
        assert_eq!(parts(0, 4096), (1, 4096));
        assert_eq!(parts(4096, 4096), (1, 4096));
        assert_eq!(parts(4097, 4096), (2, 4096));
        let (n, size) = parts(1 << 30, 4096);
        assert!(n <= MAX_PARTS && n * size >= 1 << 30, "{n} x {size}");
    }

    #[test]
    fn keys_carry_the_namespace() {
        assert_ne!(value_key(1, Key(5), 0), value_key(2, Key(5), 0));
        assert_ne!(value_key(1, Key(5), 0), value_key(1, Key(5), 1));
    }
}
