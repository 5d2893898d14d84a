//! The client of one Redis server (a whole single-server tier, or one master of a cluster):
//! its configuration, connection pools, probation ([`Health`]) and counters, and the three
//! operations (write, exists, read). How one operation
//! is sent (deadlines, parallel sub-batches) is in `send.rs`; see the parent module for how.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::bulk::{self, BulkConn, Tls};
use super::pack::{slice_pieces, Packed};
use super::send::OpError;
use super::slots::redact;
use super::{
    parts, value_key, value_key_tagged, ChunkNames, ReadItem, ReadOutcome, RemoteConfig,
    RemoteCounters, RemoteStats, WriteItem, BATCH_BYTES, WRITE_BATCH_BYTES,
};
use crate::error::{Error, Result};
use crate::ids::Key;
use crate::tier::header::{checksum, ChunkHeader, HEADER_LEN};
use crate::tier::health::{Health, Transition};

pub(super) fn add(c: &AtomicU64, n: usize) {
    c.fetch_add(n as u64, Relaxed);
}

/// A client of one Redis server: connection pool, health, counters. Thread-safe; every
/// method blocks its calling thread for at most about one deadline per sub-batch.
pub(super) struct Node {
    pub(super) cfg: RemoteConfig,
    /// Cluster key names (a chunk's parts share its hash slot, see [`value_key_tagged`]).
    tagged: bool,
    /// Each command preceded by `ASKING` (a twin for keys of a slot being imported).
    asking: bool,
    /// Redirections answered since the cluster last took them.
    pub(super) redirects: Mutex<Vec<String>>,
    /// TLS (`rediss://`).
    pub(super) tls: Option<Tls>,
    pub(super) client: redis::Client,
    pub(super) idle_bulk: Mutex<Vec<BulkConn>>,
    health: Mutex<Health>,
    pub(super) counters: RemoteCounters,
    generation: AtomicU64,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("url", &self.cfg.url)
            .field("on_probation", &self.on_probation())
            .finish_non_exhaustive()
    }
}

/// Parses a single server's `url` (`redis://`, `rediss://` or `unix://`) without connecting:
/// the crate's client of the address and credentials, and whether it is over TLS (which is
/// ours). A malformed URL is an [`Error::Config`] naming it (password redacted).
pub(super) fn parse_url(url: &str) -> Result<(redis::Client, bool)> {
    let shown = redact(url);
    if !["redis://", "rediss://", "unix://"]
        .iter()
        .any(|s| url.starts_with(s))
    {
        return Err(Error::Config(format!(
            "remote_url: {shown:?} is not a redis:// or rediss:// URL"
        )));
    }
    let over_tls = url.starts_with("rediss://");
    let plain = url.replacen("rediss://", "redis://", 1);
    let client = redis::Client::open(plain.as_str())
        .map_err(|e| Error::Config(format!("remote_url: {shown:?}: {e}")))?;
    Ok((client, over_tls))
}

impl Node {
    /// A client for `cfg.url`. Connects lazily: a server that is down now only makes the first
    /// operations fail. Refuses a URL that is not a Redis URL and out-of-range settings.
    /// `tagged`: cluster key names; `asking`: every command preceded by `ASKING`.
    pub(super) fn new(cfg: RemoteConfig, tagged: bool, asking: bool) -> Result<Self> {
        let bad = |field: &str, why: String| Error::Config(format!("{field}: {why}"));
        let shown = redact(&cfg.url);
        let (client, over_tls) = parse_url(&cfg.url)?;
        let tls = match (over_tls, &cfg.tls_ca) {
            (false, None) => None,
            (false, Some(ca)) => {
                return Err(bad(
                    "remote_tls_ca",
                    format!("{} given but {shown:?} is not rediss://", ca.display()),
                ))
            }
            (true, None) => {
                return Err(bad(
                    "remote_tls_ca",
                    format!(
                    "{shown:?} is rediss://: give the CA file that signs the server's certificate"
                ),
                ))
            }
            (true, Some(ca)) => {
                let redis::ConnectionAddr::Tcp(host, _) = client.get_connection_info().addr()
                else {
                    return Err(bad("remote_url", format!("{shown:?}: TLS needs TCP")));
                };
                Some(Tls::new(ca, host).map_err(|e| bad("remote_tls_ca", e))?)
            }
        };
        if cfg.deadline.is_zero() || cfg.deadline > Duration::from_secs(3600) {
            return Err(bad(
                "remote_deadline",
                format!("{:?} is not within (0, 1 h]", cfg.deadline),
            ));
        }
        if !(1..=64).contains(&cfg.connections) {
            return Err(bad(
                "remote_connections",
                format!("{} is not within 1..=64", cfg.connections),
            ));
        }
        if !(4096..=(512 << 20) - HEADER_LEN).contains(&cfg.part_bytes) {
            return Err(bad(
                "remote_part_bytes",
                format!("{} is not within 4096..=512 MiB - header", cfg.part_bytes),
            ));
        }
        let health = Health::new("remote_probation_after", cfg.probation_after, cfg.probation)?;
        Ok(Self {
            cfg,
            tagged,
            asking,
            redirects: Mutex::new(Vec::new()),
            client,
            tls,
            idle_bulk: Mutex::new(Vec::new()),
            health: Mutex::new(health),
            counters: RemoteCounters::default(),
            generation: AtomicU64::new(0),
        })
    }

    /// Connects once now: a server that refuses (certificate, password) is a
    /// [`Error::Config`] naming the URL (password redacted); one that cannot be reached is
    /// not (the first operations fail). The connection is kept in the pool.
    pub(super) fn probe(&self) -> Result<()> {
        let end = Instant::now() + self.cfg.deadline;
        match BulkConn::connect(self.client.get_connection_info(), self.tls.as_ref(), end) {
            Ok(c) => {
                self.idle_bulk.lock().expect("pool lock").push(c);
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => Err(Error::Config(format!(
                "remote_url: {:?}: {e}",
                redact(&self.cfg.url)
            ))),
            Err(_) => Ok(()),
        }
    }

    /// The Redis key of part `part` of chunk `key` in namespace `namespace`.
    pub(super) fn key(&self, namespace: u128, key: Key, part: usize) -> Vec<u8> {
        if self.tagged {
            value_key_tagged(namespace, key, part)
        } else {
            value_key(namespace, key, part)
        }
    }

    /// Whether the tier is on probation now (operations are skipped).
    pub fn on_probation(&self) -> bool {
        self.health
            .lock()
            .expect("health lock")
            .on_probation(Instant::now())
    }

    /// Whether an operation may run now: not on probation, or the probation is over (then this
    /// operation is the trial).
    pub(super) fn admit(&self) -> bool {
        self.health
            .lock()
            .expect("health lock")
            .admit(Instant::now())
    }

    pub(super) fn record(&self, outcome: std::result::Result<(), &OpError>) {
        if let Err(e) = outcome {
            add(
                match e {
                    OpError::Redis => &self.counters.errors,
                    OpError::Late => &self.counters.deadline_misses,
                },
                1,
            );
        }
        let now = Instant::now();
        let t = self
            .health
            .lock()
            .expect("health lock")
            .record(outcome.is_ok(), now);
        match t {
            Transition::Probation => {
                add(&self.counters.probations, 1);
                // Pooled connections are likely broken too.
                self.idle_bulk.lock().expect("pool lock").clear();
            }
            Transition::Recovery => add(&self.counters.recoveries, 1),
            Transition::None => {}
        }
    }

    /// Writes `items` under namespace `namespace` ([`ChunkNames`]: keys and headers); per
    /// item, whether every part was stored. On probation nothing is sent and every item is
    /// counted as dropped.
    pub fn write(&self, namespace: impl Into<ChunkNames>, items: &[WriteItem<'_>]) -> Vec<bool> {
        let names = namespace.into();
        if items.is_empty() {
            return Vec::new();
        }
        if !self.admit() {
            add(&self.counters.dropped_writes, items.len());
            return vec![false; items.len()];
        }
        let lens: Vec<usize> = items
            .iter()
            .map(|it| it.data.iter().map(|p| p.len()).sum())
            .collect();
        let batches = Self::batches(lens.iter().copied(), WRITE_BATCH_BYTES);
        // One sub-batch as commands: per item, its parts last to first, so part 0 (the header)
        // is published after all the data.
        let pack = |batch: &Vec<usize>| {
            let mut packed = Packed::default();
            for &i in batch {
                let (it, len) = (&items[i], lens[i]);
                let header = ChunkHeader {
                    group: it.group,
                    namespace: names.header,
                    key: it.key,
                    length: len as u64,
                    generation: self.generation.fetch_add(1, Relaxed) + 1,
                    checksum: checksum(it.data.iter().copied()),
                }
                .encode();
                let (count, size) = parts(len, self.cfg.part_bytes);
                for part in (0..count).rev() {
                    let value = slice_pieces(&it.data, part * size, ((part + 1) * size).min(len));
                    let prefix: &[u8] = if part == 0 { &header } else { &[] };
                    let name = self.key(names.key, it.key, part);
                    if self.asking {
                        packed.command(&[b"ASKING"], None);
                    }
                    packed.command(&[b"SET", &name], Some((prefix, &value)));
                }
            }
            packed.finish_split()
        };
        let done = self.send_batches(&batches, pack);
        let mut out = vec![false; items.len()];
        for (batch, replies) in batches.iter().zip(done) {
            let mut at = replies.iter();
            for &i in batch {
                // All parts acknowledged (a failed operation has no replies).
                let n = parts(lens[i], self.cfg.part_bytes).0 * (1 + usize::from(self.asking));
                let ok = at.by_ref().take(n).filter(|&&r| r).count() == n;
                out[i] = ok;
                if ok {
                    add(&self.counters.writes, 1);
                    add(&self.counters.bytes_written, lens[i] + HEADER_LEN);
                } else {
                    add(&self.counters.failed_writes, 1);
                }
            }
        }
        out
    }

    /// Whether each of `keys` exists in every namespace of `namespaces` (e.g. every tensor
    /// parallel rank's); one round trip for all of them. `None` as for [`Self::exists`].
    pub fn exists_in_all(&self, namespaces: &[u128], keys: &[Key]) -> Option<Vec<bool>> {
        if keys.is_empty() {
            return Some(Vec::new());
        }
        add(&self.counters.lookups, keys.len());
        if !self.admit() {
            add(&self.counters.skipped_lookups, keys.len());
            return None;
        }
        let names: Vec<Vec<u8>> = namespaces
            .iter()
            .flat_map(|&ns| keys.iter().map(move |&k| self.key(ns, k, 0)))
            .collect();
        let replies = self.exists_names(&names)?;
        let mut found = vec![true; keys.len()];
        for (i, &v) in replies.iter().enumerate() {
            found[i % keys.len()] &= v;
        }
        add(
            &self.counters.lookup_hits,
            found.iter().filter(|&&f| f).count(),
        );
        Some(found)
    }

    /// Whether each key of `names` exists; one round trip, no probation check (the caller
    /// admitted it). `None` when the operation failed.
    pub(super) fn exists_names(&self, names: &[Vec<u8>]) -> Option<Vec<bool>> {
        let mut packed = Packed::default();
        for name in names {
            if self.asking {
                packed.command(&[b"ASKING"], None);
            }
            packed.command(&[b"EXISTS", name], None);
        }
        let replies = self.pipeline(packed, self.asking).ok()?;
        Some(
            replies
                .iter()
                .map(|v| matches!(v, Some(n) if *n > 0))
                .collect(),
        )
    }

    /// Reads `items` of namespace `namespace` ([`ChunkNames`]: keys and headers) into their
    /// destinations and verifies them.
    pub fn read(
        &self,
        namespace: impl Into<ChunkNames>,
        items: &mut [ReadItem<'_>],
    ) -> Vec<ReadOutcome> {
        let names = namespace.into();
        if items.is_empty() {
            return Vec::new();
        }
        if !self.admit() {
            add(&self.counters.failed_reads, items.len());
            return vec![ReadOutcome::Failed; items.len()];
        }
        let lens: Vec<usize> = items.iter().map(ReadItem::len).collect();
        let batches = Self::batches(lens.iter().copied(), BATCH_BYTES);
        // Each batch is one pipeline on one connection; its replies land in its items.
        let slots: Vec<Mutex<Option<&mut ReadItem<'_>>>> =
            items.iter_mut().map(|it| Mutex::new(Some(it))).collect();
        let done = self.run_batches(&batches, |batch| {
            let mut guards: Vec<_> = batch
                .iter()
                .map(|&i| slots[i].lock().expect("item lock"))
                .collect();
            let mut packed = Vec::new();
            for (g, &i) in guards.iter().zip(batch) {
                let key = g.as_ref().expect("item").key;
                for part in 0..parts(lens[i], self.cfg.part_bytes).0 {
                    let name = self.key(names.key, key, part);
                    if self.asking {
                        packed.extend_from_slice(&bulk::pack(&[b"ASKING"]));
                    }
                    packed.extend_from_slice(&bulk::pack(&[b"GET", &name]));
                }
            }
            let result = self.bulk_op(|con| {
                con.send(&packed)?;
                guards
                    .iter_mut()
                    .zip(batch)
                    .map(|(g, &i)| {
                        self.read_item(con, names.header, g.as_mut().expect("item"), lens[i])
                    })
                    .collect::<std::io::Result<Vec<ReadOutcome>>>()
            });
            result.unwrap_or_else(|_| vec![ReadOutcome::Failed; batch.len()])
        });
        let mut out = vec![ReadOutcome::Failed; items.len()];
        for (batch, outcomes) in batches.iter().zip(done) {
            for (&i, o) in batch.iter().zip(outcomes) {
                out[i] = o;
                match o {
                    ReadOutcome::Hit => {
                        add(&self.counters.read_hits, 1);
                        add(&self.counters.bytes_read, lens[i] + HEADER_LEN);
                    }
                    ReadOutcome::Miss => add(&self.counters.read_misses, 1),
                    ReadOutcome::Corrupt => add(&self.counters.checksum_mismatches, 1),
                    ReadOutcome::Failed => add(&self.counters.failed_reads, 1),
                }
            }
        }
        out
    }

    /// Reads the replies of one chunk's parts into its destination and verifies it. An `Err`
    /// is a broken connection (the operation fails); anything the server holds that is not
    /// this chunk is a [`ReadOutcome::Corrupt`], a part it lacks a [`ReadOutcome::Miss`].
    fn read_item(
        &self,
        con: &mut BulkConn,
        namespace: u128,
        item: &mut ReadItem<'_>,
        len: usize,
    ) -> std::io::Result<ReadOutcome> {
        let (count, size) = parts(len, self.cfg.part_bytes);
        let mut header = [0u8; HEADER_LEN];
        let mut outcome = ReadOutcome::Hit;
        for part in 0..count {
            let start = part * size;
            let data = ((part + 1) * size).min(len) - start;
            let want = data + if part == 0 { HEADER_LEN } else { 0 };
            if self.asking && !con.status()? {
                return Err(std::io::Error::other("ASKING refused"));
            }
            match con.bulk_len()? {
                None => {
                    if outcome == ReadOutcome::Hit {
                        outcome = ReadOutcome::Miss;
                    }
                }
                // Longer than the chunk and its header: not ours, and possibly huge (a
                // flood): the operation fails and the connection is dropped.
                Some(n) if n > want => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("a reply of {n} bytes for a chunk part of {want}"),
                    ));
                }
                Some(n) if n != want || outcome != ReadOutcome::Hit => {
                    con.skip(n)?;
                    con.end_bulk()?;
                    if outcome == ReadOutcome::Hit {
                        outcome = ReadOutcome::Corrupt;
                    }
                }
                Some(_) => {
                    if part == 0 {
                        con.read_into(&mut header)?;
                    }
                    let mut at = 0;
                    for d in &mut item.dst {
                        let (lo, hi) = (at, at + d.len());
                        at = hi;
                        if hi <= start || lo >= start + data {
                            continue;
                        }
                        let from = start.max(lo) - lo;
                        let to = (start + data).min(hi) - lo;
                        con.read_into(&mut d[from..to])?;
                    }
                    con.end_bulk()?;
                }
            }
        }
        if outcome != ReadOutcome::Hit {
            return Ok(outcome);
        }
        let Ok(h) = ChunkHeader::decode(&header) else {
            return Ok(ReadOutcome::Corrupt);
        };
        let ok = h.namespace == namespace
            && h.key == item.key
            && h.group == item.group
            && h.length == len as u64
            && h.checksum == checksum(item.dst.iter().map(|d| &**d));
        Ok(if ok {
            ReadOutcome::Hit
        } else {
            ReadOutcome::Corrupt
        })
    }

    /// Counters so far.
    pub fn stats(&self) -> RemoteStats {
        self.counters.snapshot()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_settings_are_refused_by_name() {
        let err = |cfg: RemoteConfig| Node::new(cfg, false, false).unwrap_err().to_string();
        assert!(err(RemoteConfig::new("http://x")).contains("remote_url"));
        let mut c = RemoteConfig::new("redis://127.0.0.1:1");
        c.connections = 0;
        assert!(err(c).contains("remote_connections"));
    }
}
