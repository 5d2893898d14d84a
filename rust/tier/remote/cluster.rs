//! The shared tier's client: one Redis server, or a Redis Cluster.
//!
//! On a cluster every call is split by the hash slot of each chunk (see `slots.rs`) into one
//! batch per master, and the batches go to all masters at once (one thread each; each master
//! has its own [`Node`]: connection pool, deadline, probation, counters). A master that fails
//! or is late costs only its slots, for its deadline; its probation skips only its slots.
//!
//! Redirections: a command answered `MOVED slot addr` counts as refused; the slot map is read
//! again (`CLUSTER SLOTS` from a known master or a seed), the slot pointed at `addr`, and the
//! chunks of that slot are sent again to their new master. `ASK slot addr` (a slot being
//! migrated, the key not on the source any more) sends them again to `addr`, each command
//! preceded by `ASKING`. A failed operation (a master killed, not yet replaced) refreshes the
//! map too (at most every [`REFRESH_EVERY`]), so the chunks of a failed-over master reach its
//! promoted replica as soon as the cluster names it. At most [`ROUNDS`] rounds per call.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use super::bulk::{BulkConn, Value};
use super::client::Node;
use super::slots::{redact, slot_of, ClusterUrl, SlotMap};
use super::{
    value_key_tagged, ChunkNames, ReadItem, ReadOutcome, RemoteConfig, RemoteStats, WriteItem,
};
use crate::error::{Error, Result};
use crate::ids::Key;

/// Rounds of one call on a cluster: the first, then retries of redirected chunks.
const ROUNDS: usize = 3;
/// Least time between two refreshes of the slot map not asked for by a `MOVED`.
const REFRESH_EVERY: Duration = Duration::from_millis(100);

/// The shared tier's client: thread-safe; every method blocks its calling thread for at most
/// about one deadline per sub-batch (per round, on a cluster).
pub struct RemoteClient {
    cfg: RemoteConfig,
    mode: Mode,
}

enum Mode {
    Single(Box<Node>),
    Cluster(Box<Cluster>),
}

impl std::fmt::Debug for RemoteClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteClient")
            .field("url", &redact(&self.cfg.url))
            .field("on_probation", &self.on_probation())
            .finish_non_exhaustive()
    }
}

impl RemoteClient {
    /// A client for `cfg.url`. On one server it connects lazily: a server that is down now
    /// only makes the first operations fail. On a cluster it reads the slot map from the
    /// seeds now: a seed that refuses (wrong password, not a cluster node) is a
    /// [`Error::Config`] naming the URL (password redacted); seeds that cannot be reached
    /// leave the map empty until one can. Refuses a URL that is not a Redis URL and
    /// out-of-range settings.
    pub fn new(cfg: RemoteConfig) -> Result<Self> {
        let mode = match ClusterUrl::parse(&cfg.url)? {
            None => {
                let node = Node::new(cfg.clone(), false, false)?;
                node.probe()?;
                Mode::Single(Box::new(node))
            }
            Some(url) => Mode::Cluster(Box::new(Cluster::new(&cfg, url)?)),
        };
        Ok(Self { cfg, mode })
    }

    /// The configuration.
    pub fn config(&self) -> &RemoteConfig {
        &self.cfg
    }

    /// Whether the tier is on probation now (operations are skipped): on a cluster, whether
    /// every master is.
    pub fn on_probation(&self) -> bool {
        match &self.mode {
            Mode::Single(n) => n.on_probation(),
            Mode::Cluster(c) => {
                let nodes = c.masters();
                !nodes.is_empty() && nodes.iter().all(|(_, n)| n.on_probation())
            }
        }
    }

    /// Writes `items` under namespace `namespace` ([`ChunkNames`]: keys and headers); per
    /// item, whether every part was stored. On probation nothing is sent and every item is
    /// counted as dropped.
    pub fn write(&self, namespace: impl Into<ChunkNames>, items: &[WriteItem<'_>]) -> Vec<bool> {
        let names = namespace.into();
        match &self.mode {
            Mode::Single(n) => n.write(names, items),
            Mode::Cluster(c) => c.write(names, items),
        }
    }

    /// Whether each of `keys` exists in namespace `namespace`; one round trip (per master).
    /// `None` when the operation failed or the tier is on probation (the caller treats it as
    /// all-miss); on a cluster, keys of a failed master are misses.
    pub fn exists(&self, namespace: u128, keys: &[Key]) -> Option<Vec<bool>> {
        self.exists_in_all(&[namespace], keys)
    }

    /// Whether each of `keys` exists in every namespace of `namespaces` (e.g. every tensor
    /// parallel rank's); one round trip (per master) for all of them. `None` as for
    /// [`Self::exists`].
    pub fn exists_in_all(&self, namespaces: &[u128], keys: &[Key]) -> Option<Vec<bool>> {
        match &self.mode {
            Mode::Single(n) => n.exists_in_all(namespaces, keys),
            Mode::Cluster(c) => c.exists_in_all(namespaces, keys),
        }
    }

    /// Reads `items` of namespace `namespace` ([`ChunkNames`]: keys and headers) into their
    /// destinations and verifies them.
    pub fn read(
        &self,
        namespace: impl Into<ChunkNames>,
        items: &mut [ReadItem<'_>],
    ) -> Vec<ReadOutcome> {
        let names = namespace.into();
        match &self.mode {
            Mode::Single(n) => n.read(names, items),
            Mode::Cluster(c) => c.read(names, items),
        }
    }

    /// Counters so far (on a cluster, the sum over its masters, a chunk sent again after a
    /// redirection counted once, by its last outcome).
    pub fn stats(&self) -> RemoteStats {
        match &self.mode {
            Mode::Single(n) => n.stats(),
            Mode::Cluster(c) => {
                let mut total = RemoteStats::default();
                for (_, s) in c.node_stats() {
                    total.add(&s);
                }
                let u = c.uncount.snapshot();
                total.failed_writes = total.failed_writes.saturating_sub(u.failed_writes);
                total.read_misses = total.read_misses.saturating_sub(u.read_misses);
                total.failed_reads = total.failed_reads.saturating_sub(u.failed_reads);
                total.lookups = total.lookups.saturating_sub(u.lookups);
                total
            }
        }
    }

    /// Counters per server, `(host:port, counters)`: the one server, or every master (and
    /// migration target) this client has talked to.
    pub fn node_stats(&self) -> Vec<(String, RemoteStats)> {
        match &self.mode {
            Mode::Single(n) => vec![(redact(&self.cfg.url), n.stats())],
            Mode::Cluster(c) => c.node_stats(),
        }
    }

    /// Whether the tier is a cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self.mode, Mode::Cluster(_))
    }
}

struct Cluster {
    cfg: RemoteConfig,
    url: ClusterUrl,
    map: RwLock<Arc<SlotMap>>,
    nodes: Mutex<HashMap<String, Arc<Node>>>,
    askers: Mutex<HashMap<String, Arc<Node>>>,
    /// Clients that only read slot maps (seeds, masters), by address.
    probes: Mutex<HashMap<String, Arc<Node>>>,
    /// Chunk outcomes the masters counted that a later round replaced (a redirected chunk
    /// counted as failed or missing, then sent again): subtracted from the sums.
    uncount: super::RemoteCounters,
    refreshed: Mutex<Option<Instant>>,
}

/// Redirections collected in one round: slots moved (and to where), slots being migrated.
#[derive(Default)]
struct Redirects {
    moved: HashMap<u16, String>,
    ask: HashMap<u16, String>,
}

impl Redirects {
    fn parse(&mut self, line: &str) {
        let mut it = line.split(' ');
        let (Some(kind), Some(slot), Some(addr)) = (it.next(), it.next(), it.next()) else {
            return;
        };
        let Ok(slot) = slot.parse::<u16>() else {
            return;
        };
        match kind {
            "MOVED" => self.moved.insert(slot, addr.to_owned()),
            "ASK" => self.ask.insert(slot, addr.to_owned()),
            _ => None,
        };
    }

    fn touches(&self, slot: u16) -> bool {
        self.moved.contains_key(&slot) || self.ask.contains_key(&slot)
    }
}

/// Why a seed gave no slot map.
enum Fetch {
    Refused(String),
    Unreachable,
}

impl Cluster {
    fn new(cfg: &RemoteConfig, url: ClusterUrl) -> Result<Self> {
        // Settings are checked as for one server.
        Node::new(node_cfg(cfg, &url, &url.seeds[0]), true, false)?;
        let c = Self {
            cfg: cfg.clone(),
            url,
            map: RwLock::new(Arc::new(SlotMap::default())),
            nodes: Mutex::new(HashMap::new()),
            askers: Mutex::new(HashMap::new()),
            probes: Mutex::new(HashMap::new()),
            uncount: super::RemoteCounters::default(),
            refreshed: Mutex::new(None),
        };
        for seed in &c.url.seeds {
            match c.fetch(seed) {
                Ok(map) => {
                    *c.map.write().expect("map lock") = Arc::new(map);
                    *c.refreshed.lock().expect("refresh lock") = Some(Instant::now());
                    break;
                }
                Err(Fetch::Refused(why)) => {
                    return Err(Error::Config(format!(
                        "remote_url: {:?}: seed {seed} {why}",
                        redact(&cfg.url)
                    )))
                }
                Err(Fetch::Unreachable) => {}
            }
        }
        // Every seed must be a node of the cluster: a non-cluster server among them is
        // refused (it would answer the wrong slots).
        for seed in c.url.seeds.iter().skip(1) {
            if let Err(Fetch::Refused(why)) = c.fetch(seed) {
                return Err(Error::Config(format!(
                    "remote_url: {:?}: seed {seed} {why}",
                    redact(&cfg.url)
                )));
            }
        }
        Ok(c)
    }

    /// The slot map as `addr` (`host:port`) knows it.
    fn fetch(&self, addr: &str) -> std::result::Result<SlotMap, Fetch> {
        let node = {
            let mut probes = self.probes.lock().expect("nodes lock");
            if let Some(n) = probes.get(addr) {
                n.clone()
            } else {
                let n = Node::new(node_cfg(&self.cfg, &self.url, addr), true, false)
                    .map_err(|e| Fetch::Refused(e.to_string()))?;
                let n = Arc::new(n);
                probes.insert(addr.to_owned(), n.clone());
                n
            }
        };
        let deadline = Instant::now() + self.cfg.deadline;
        let mut con = BulkConn::connect(
            node.client.get_connection_info(),
            node.tls.as_ref(),
            deadline,
        )
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::InvalidData {
                Fetch::Refused(format!("refused the connection: {e}"))
            } else {
                Fetch::Unreachable
            }
        })?;
        con.send(&super::bulk::pack(&[b"CLUSTER", b"SLOTS"]))
            .map_err(|_| Fetch::Unreachable)?;
        let reply = con.value().map_err(|_| Fetch::Unreachable)?;
        if let Value::Error(e) = &reply {
            return Err(Fetch::Refused(format!("is not a cluster node: {e}")));
        }
        let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
        SlotMap::from_reply(&reply, host).map_err(Fetch::Refused)
    }

    /// Reads the slot map again from a known master or a seed (at most every
    /// [`REFRESH_EVERY`] unless `force`; the `suspects`, masters that just failed, asked
    /// last), then applies `moved`.
    fn refresh(&self, force: bool, moved: &HashMap<u16, String>, suspects: &[String]) {
        {
            let mut last = self.refreshed.lock().expect("refresh lock");
            if !force && last.is_some_and(|t| t.elapsed() < REFRESH_EVERY) {
                return;
            }
            *last = Some(Instant::now());
        }
        let mut known = self.map.read().expect("map lock").addrs.clone();
        known.extend(self.url.seeds.iter().cloned());
        known.sort_by_key(|a| suspects.contains(a));
        known.dedup();
        let mut map = known
            .iter()
            .find_map(|a| self.fetch(a).ok())
            .unwrap_or_else(|| (**self.map.read().expect("map lock")).clone());
        for (&slot, addr) in moved {
            if map.addr(slot) != Some(addr) {
                map.set(slot, addr);
            }
        }
        *self.map.write().expect("map lock") = Arc::new(map);
    }

    fn node(&self, addr: &str, asking: bool) -> Option<Arc<Node>> {
        let pool = if asking { &self.askers } else { &self.nodes };
        let mut pool = pool.lock().expect("nodes lock");
        if let Some(n) = pool.get(addr) {
            return Some(n.clone());
        }
        let n = Arc::new(Node::new(node_cfg(&self.cfg, &self.url, addr), true, asking).ok()?);
        pool.insert(addr.to_owned(), n.clone());
        Some(n)
    }

    /// The masters of the current map with their clients.
    fn masters(&self) -> Vec<(String, Arc<Node>)> {
        let map = self.map.read().expect("map lock").clone();
        let mut used = vec![false; map.addrs.len()];
        for i in map.owner.iter().flatten() {
            used[usize::from(*i)] = true;
        }
        map.addrs
            .iter()
            .zip(used)
            .filter(|(_, u)| *u)
            .filter_map(|(a, _)| Some((a.clone(), self.node(a, false)?)))
            .collect()
    }

    fn node_stats(&self) -> Vec<(String, RemoteStats)> {
        let mut out: Vec<(String, RemoteStats)> = Vec::new();
        for (asking, pool) in [(false, &self.nodes), (true, &self.askers)] {
            for (a, n) in pool.lock().expect("nodes lock").iter() {
                match out.iter_mut().find(|(b, _)| b == a) {
                    Some((_, s)) => s.add(&n.stats()),
                    None if !asking || n.stats() != RemoteStats::default() => {
                        out.push((a.clone(), n.stats()));
                    }
                    None => {}
                }
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// When a master of the map is on probation, a refresh may name its replacement.
    fn refresh_if_on_probation(&self) {
        let suspects: Vec<String> = self
            .masters()
            .into_iter()
            .filter(|(_, n)| n.on_probation())
            .map(|(a, _)| a)
            .collect();
        if !suspects.is_empty() {
            self.refresh(false, &HashMap::new(), &suspects);
        }
    }

    /// Runs rounds of `op` over the item indices `todo` (their slots in `slots`): each round
    /// groups them per master (or `ASK` target), runs `op(node, indices)` on all groups in
    /// parallel, and keeps for the next round the indices `op` reports as not done whose slot
    /// was redirected or changed master.
    fn rounds<R: Send>(
        &self,
        slots: &[u16],
        mut op: impl FnMut(Vec<(Arc<Node>, Vec<usize>)>) -> Vec<(Vec<usize>, R)>,
        mut not_done: impl FnMut(&[usize], R) -> Vec<usize>,
    ) {
        self.refresh_if_on_probation();
        let mut todo: Vec<usize> = (0..slots.len()).collect();
        let mut ask: HashMap<u16, String> = HashMap::new();
        for round in 0..ROUNDS {
            let map = self.map.read().expect("map lock").clone();
            let mut groups: HashMap<(String, bool), Vec<usize>> = HashMap::new();
            for &i in &todo {
                let slot = slots[i];
                let target = match ask.get(&slot) {
                    Some(a) => Some((a.clone(), true)),
                    None => map.addr(slot).map(|a| (a.to_owned(), false)),
                };
                if let Some(t) = target {
                    groups.entry(t).or_default().push(i);
                }
            }
            let groups: Vec<(Arc<Node>, Vec<usize>)> = groups
                .into_iter()
                .filter_map(|((a, asking), idx)| Some((self.node(&a, asking)?, idx)))
                .collect();
            let used: Vec<Arc<Node>> = groups.iter().map(|(n, _)| n.clone()).collect();
            let troubles = |n: &Node| {
                let s = n.stats();
                s.errors + s.deadline_misses
            };
            let before: Vec<u64> = used.iter().map(|n| troubles(n)).collect();
            let mut failed = Vec::new();
            for (idx, r) in op(groups) {
                failed.extend(not_done(&idx, r));
            }
            if failed.is_empty() || round + 1 == ROUNDS {
                return;
            }
            // Masters whose operations failed this round: asked last for the map.
            let suspects: Vec<String> = used
                .iter()
                .zip(before)
                .filter(|(n, b)| troubles(n) > *b)
                .filter_map(|(n, _)| {
                    Some(
                        n.cfg
                            .url
                            .rsplit('@')
                            .next()?
                            .trim_start_matches("redis://")
                            .to_owned(),
                    )
                })
                .collect();
            let mut redirects = Redirects::default();
            for n in &used {
                for line in n.redirects.lock().expect("redirects lock").drain(..) {
                    redirects.parse(&line);
                }
            }
            if redirects.moved.is_empty() && redirects.ask.is_empty() && suspects.is_empty() {
                return;
            }
            self.refresh(!redirects.moved.is_empty(), &redirects.moved, &suspects);
            let after = self.map.read().expect("map lock").clone();
            ask.clone_from(&redirects.ask);
            todo = failed
                .into_iter()
                .filter(|&i| {
                    let s = slots[i];
                    redirects.touches(s) || after.addr(s) != map.addr(s)
                })
                .collect();
            if todo.is_empty() {
                return;
            }
        }
    }

    fn write(&self, names: ChunkNames, items: &[WriteItem<'_>]) -> Vec<bool> {
        let slots: Vec<u16> = items
            .iter()
            .map(|it| chunk_slot(names.key, it.key))
            .collect();
        let mut out = vec![false; items.len()];
        let mut seen = vec![false; items.len()];
        self.rounds(
            &slots,
            |groups| {
                parallel(groups, |node, idx| {
                    let sub: Vec<WriteItem<'_>> = idx.iter().map(|&i| items[i].clone()).collect();
                    node.write(names, &sub)
                })
            },
            |idx, done: Vec<bool>| {
                let mut failed = Vec::new();
                for (&i, ok) in idx.iter().zip(done) {
                    // Sent again: its failure before was a redirection, not a failed write.
                    if std::mem::replace(&mut seen[i], true) {
                        super::client::add(&self.uncount.failed_writes, 1);
                    }
                    out[i] = ok;
                    if !ok {
                        failed.push(i);
                    }
                }
                failed
            },
        );
        out
    }

    fn exists_in_all(&self, namespaces: &[u128], keys: &[Key]) -> Option<Vec<bool>> {
        if keys.is_empty() {
            return Some(Vec::new());
        }
        let pairs: Vec<(u128, Key)> = namespaces
            .iter()
            .flat_map(|&ns| keys.iter().map(move |&k| (ns, k)))
            .collect();
        let slots: Vec<u16> = pairs.iter().map(|&(ns, k)| chunk_slot(ns, k)).collect();
        let mut found = vec![false; pairs.len()];
        let mut seen = vec![false; pairs.len()];
        let mut any = false;
        self.rounds(
            &slots,
            |groups| {
                parallel(groups, |node, idx| {
                    super::client::add(&node.counters.lookups, idx.len());
                    if !node.admit() {
                        super::client::add(&node.counters.skipped_lookups, idx.len());
                        return None;
                    }
                    let names: Vec<Vec<u8>> = idx
                        .iter()
                        .map(|&i| value_key_tagged(pairs[i].0, pairs[i].1, 0))
                        .collect();
                    let r = node.exists_names(&names);
                    if let Some(r) = &r {
                        let hits = r.iter().filter(|&&f| f).count();
                        super::client::add(&node.counters.lookup_hits, hits);
                    }
                    r
                })
            },
            |idx, r: Option<Vec<bool>>| match r {
                Some(r) => {
                    any = true;
                    let mut missed = Vec::new();
                    for (&i, f) in idx.iter().zip(r) {
                        if std::mem::replace(&mut seen[i], true) {
                            super::client::add(&self.uncount.lookups, 1);
                        }
                        found[i] = f;
                        if !f {
                            missed.push(i);
                        }
                    }
                    missed
                }
                None => idx.to_vec(),
            },
        );
        if !any {
            return None;
        }
        let mut out = vec![true; keys.len()];
        for (i, f) in found.into_iter().enumerate() {
            out[i % keys.len()] &= f;
        }
        Some(out)
    }

    fn read(&self, names: ChunkNames, items: &mut [ReadItem<'_>]) -> Vec<ReadOutcome> {
        let slots: Vec<u16> = items
            .iter()
            .map(|it| chunk_slot(names.key, it.key))
            .collect();
        let mut out = vec![ReadOutcome::Failed; items.len()];
        let mut seen = vec![false; items.len()];
        let cells: Vec<Mutex<&mut ReadItem<'_>>> = items.iter_mut().map(Mutex::new).collect();
        self.rounds(
            &slots,
            |groups| {
                parallel(groups, |node, idx| {
                    // The destinations move into this master's items and back.
                    let mut sub: Vec<ReadItem<'_>> = idx
                        .iter()
                        .map(|&i| {
                            let mut it = cells[i].lock().expect("item lock");
                            ReadItem {
                                key: it.key,
                                group: it.group,
                                dst: std::mem::take(&mut it.dst),
                            }
                        })
                        .collect();
                    let r = node.read(names, &mut sub);
                    for (&i, s) in idx.iter().zip(sub) {
                        cells[i].lock().expect("item lock").dst = s.dst;
                    }
                    r
                })
            },
            |idx, r: Vec<ReadOutcome>| {
                let mut again = Vec::new();
                for (&i, o) in idx.iter().zip(r) {
                    // Read again: its outcome before was a redirection's.
                    if std::mem::replace(&mut seen[i], true) {
                        match out[i] {
                            ReadOutcome::Miss => super::client::add(&self.uncount.read_misses, 1),
                            _ => super::client::add(&self.uncount.failed_reads, 1),
                        }
                    }
                    out[i] = o;
                    if matches!(o, ReadOutcome::Miss | ReadOutcome::Failed) {
                        again.push(i);
                    }
                }
                again
            },
        );
        out
    }
}

/// The configuration of one master's client.
fn node_cfg(cfg: &RemoteConfig, url: &ClusterUrl, addr: &str) -> RemoteConfig {
    RemoteConfig {
        url: url.node_url(addr),
        ..cfg.clone()
    }
}

/// The slot of chunk `key` of namespace `namespace`.
fn chunk_slot(namespace: u128, key: Key) -> u16 {
    slot_of(&value_key_tagged(namespace, key, 0))
}

/// Runs `work` on every group at once (one thread per group but the first); results with
/// their groups' indices.
fn parallel<R: Send>(
    groups: Vec<(Arc<Node>, Vec<usize>)>,
    work: impl Fn(&Node, &[usize]) -> R + Sync,
) -> Vec<(Vec<usize>, R)> {
    if groups.len() <= 1 {
        return groups
            .into_iter()
            .map(|(n, idx)| {
                let r = work(&n, &idx);
                (idx, r)
            })
            .collect();
    }
    std::thread::scope(|s| {
        let work = &work;
        let handles: Vec<_> = groups
            .into_iter()
            .map(|(n, idx)| {
                s.spawn(move || {
                    let r = work(&n, &idx);
                    (idx, r)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a master's batch panicked"))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirections_parse_and_name_their_slots() {
        let mut r = Redirects::default();
        r.parse("MOVED 3999 127.0.0.1:6381");
        r.parse("ASK 12 10.0.0.2:7000");
        r.parse("MOVED x 1:2");
        r.parse("CLUSTERDOWN The cluster is down");
        assert_eq!(
            r.moved.get(&3999).map(String::as_str),
            Some("127.0.0.1:6381")
        );
        assert_eq!(r.ask.get(&12).map(String::as_str), Some("10.0.0.2:7000"));
        assert!(r.touches(3999) && r.touches(12) && !r.touches(13));
        assert_eq!(r.moved.len() + r.ask.len(), 2);
    }

    #[test]
    fn a_slot_map_from_cluster_slots() {
        let node = |ip: &str, port: i64| {
            Value::Array(vec![
                Value::Text(ip.into()),
                Value::Int(port),
                Value::Text("id".into()),
            ])
        };
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(8191),
                node("", 7000),
                node("h", 7003),
            ]),
            Value::Array(vec![Value::Int(8192), Value::Int(16383), node("h2", 7001)]),
        ]);
        let map = SlotMap::from_reply(&reply, "seed").unwrap();
        assert_eq!(map.addr(0), Some("seed:7000"));
        assert_eq!(map.addr(8191), Some("seed:7000"));
        assert_eq!(map.addr(8192), Some("h2:7001"));
        let mut partial = SlotMap::from_reply(
            &Value::Array(vec![Value::Array(vec![
                Value::Int(5),
                Value::Int(5),
                node("a", 1),
            ])]),
            "s",
        )
        .unwrap();
        assert_eq!((partial.addr(4), partial.addr(5)), (None, Some("a:1")));
        partial.set(4, "b:2");
        assert_eq!(partial.addr(4), Some("b:2"));
        assert!(SlotMap::from_reply(&Value::Error("ERR no cluster".into()), "s").is_err());
    }
}
