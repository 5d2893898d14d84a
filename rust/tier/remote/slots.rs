//! Redis Cluster addressing: the cluster URL (seed nodes and credentials), the hash slot of a
//! key (CRC16 of the key or of its hash tag, modulo 16384, as the server computes it) and the
//! slot map read from `CLUSTER SLOTS` (which master serves each slot).

use super::bulk::Value;
use crate::error::{Error, Result};
use crate::ids::Key;

/// Hash slots of a cluster.
pub const SLOTS: usize = 16384;

/// CRC16-CCITT (XMODEM: polynomial 0x1021, initial value 0), the cluster's key hash.
fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The hash slot of the Redis key `name`: of its hash tag (the bytes between the first `{`
/// and the next `}`, when not empty), else of the whole key.
pub fn slot_of(name: &[u8]) -> u16 {
    let tagged = name.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &name[open + 1..];
        rest.iter()
            .position(|&b| b == b'}')
            .filter(|&close| close > 0)
            .map(|close| &rest[..close])
    });
    crc16(tagged.unwrap_or(name)) % SLOTS as u16
}

/// The hash slot of chunk `key` of namespace `namespace` (all its parts).
pub fn key_slot(namespace: u128, key: Key) -> u16 {
    slot_of(&super::value_key_tagged(namespace, key, 0))
}

/// A parsed `redis+cluster://[user[:password]@]host:port[,host:port…]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterUrl {
    /// `user:password@`, `:password@` or empty: prepended to a node's address in its URL.
    credentials: String,
    /// Seed nodes, `host:port`.
    pub seeds: Vec<String>,
    /// Over TLS (`rediss+cluster://`).
    pub tls: bool,
}

/// The URL scheme of a cluster.
pub const CLUSTER_SCHEME: &str = "redis+cluster://";
/// The URL scheme of a cluster over TLS.
pub const CLUSTER_TLS_SCHEME: &str = "rediss+cluster://";

impl ClusterUrl {
    /// Parses `url`; `None` when it is not a cluster URL, a [`Error::Config`] naming the
    /// (redacted) URL when it is one but malformed.
    pub fn parse(url: &str) -> Result<Option<Self>> {
        let (rest, tls) = match (
            url.strip_prefix(CLUSTER_SCHEME),
            url.strip_prefix(CLUSTER_TLS_SCHEME),
        ) {
            (Some(rest), _) => (rest, false),
            (_, Some(rest)) => (rest, true),
            _ => return Ok(None),
        };
        let bad = |why: &str| {
            Error::Config(format!(
                "remote_url: {:?} is not a cluster URL ({why}; expected {CLUSTER_SCHEME}\
                 [user[:password]@]host:port[,host:port...])",
                redact(url)
            ))
        };
        let (credentials, hosts) = match rest.rfind('@') {
            Some(at) => (&rest[..=at], &rest[at + 1..]),
            None => ("", rest),
        };
        let hosts = hosts.strip_suffix('/').unwrap_or(hosts);
        if hosts.contains(['/', '?', '#']) {
            return Err(bad("no database, path or options in a cluster URL"));
        }
        let mut seeds = Vec::new();
        for h in hosts.split(',') {
            let Some((host, port)) = h.rsplit_once(':') else {
                return Err(bad(&format!("seed {h:?} has no port")));
            };
            if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
                return Err(bad(&format!("seed {h:?} is not host:port")));
            }
            seeds.push(h.to_owned());
        }
        Ok(Some(Self {
            credentials: credentials.to_owned(),
            seeds,
            tls,
        }))
    }

    /// The single-server URL of the node at `addr` (`host:port`), with the credentials.
    pub fn node_url(&self, addr: &str) -> String {
        let scheme = if self.tls { "rediss" } else { "redis" };
        format!("{scheme}://{}{addr}", self.credentials)
    }
}

/// `url` with its password replaced by `***`.
pub fn redact(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.to_owned();
    };
    let Some(at) = url[scheme_end..].rfind('@').map(|i| i + scheme_end) else {
        return url.to_owned();
    };
    let cred = &url[scheme_end..at];
    let user = cred.split_once(':').map_or("", |(u, _)| u);
    format!("{}{user}:***{}", &url[..scheme_end], &url[at..])
}

/// Which master serves each slot: addresses and, per slot, an index into them.
#[derive(Clone, Debug, Default)]
pub(super) struct SlotMap {
    /// Masters, `host:port`.
    pub addrs: Vec<String>,
    /// Per slot, the index of its master in `addrs`; `None` while no master serves it.
    pub owner: Vec<Option<u16>>,
}

impl SlotMap {
    /// The master serving `slot`.
    pub fn addr(&self, slot: u16) -> Option<&str> {
        self.owner
            .get(usize::from(slot))
            .copied()
            .flatten()
            .map(|i| self.addrs[usize::from(i)].as_str())
    }

    /// Points `slot` at `addr` (a `MOVED` answer).
    pub fn set(&mut self, slot: u16, addr: &str) {
        if self.owner.len() != SLOTS {
            self.owner = vec![None; SLOTS];
        }
        let i = self
            .addrs
            .iter()
            .position(|a| a == addr)
            .unwrap_or_else(|| {
                self.addrs.push(addr.to_owned());
                self.addrs.len() - 1
            });
        self.owner[usize::from(slot)] = u16::try_from(i).ok();
    }

    /// The map of a `CLUSTER SLOTS` reply given by the node at `host` (an empty address in
    /// the reply means that node's host).
    pub fn from_reply(reply: &Value, host: &str) -> std::result::Result<Self, String> {
        let Value::Array(ranges) = reply else {
            return Err(format!("CLUSTER SLOTS answered {reply:?}"));
        };
        let mut map = SlotMap {
            addrs: Vec::new(),
            owner: vec![None; SLOTS],
        };
        for r in ranges {
            let Value::Array(r) = r else {
                return Err("CLUSTER SLOTS: a range is not an array".into());
            };
            let (Some(Value::Int(lo)), Some(Value::Int(hi)), Some(Value::Array(master))) =
                (r.first(), r.get(1), r.get(2))
            else {
                return Err("CLUSTER SLOTS: a range without start, end and master".into());
            };
            let (Some(Value::Text(ip)), Some(Value::Int(port))) = (master.first(), master.get(1))
            else {
                return Err("CLUSTER SLOTS: a master without address".into());
            };
            let ip = if ip.is_empty() || ip == "?" { host } else { ip };
            let addr = format!("{ip}:{port}");
            let (Ok(lo), Ok(hi)) = (u16::try_from(*lo), u16::try_from(*hi)) else {
                return Err("CLUSTER SLOTS: a slot out of range".into());
            };
            if lo > hi || usize::from(hi) >= SLOTS {
                return Err("CLUSTER SLOTS: a slot out of range".into());
            }
            for slot in lo..=hi {
                map.set(slot, &addr);
            }
        }
        Ok(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_the_servers() {
        // Values from the cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(slot_of(b"foo"), 12182);
        assert_eq!(slot_of(b"{user1000}.following"), slot_of(b"user1000"));
        // An empty tag is no tag: the whole key is hashed.
        assert_eq!(slot_of(b"foo{}{bar}"), crc16(b"foo{}{bar}") % SLOTS as u16);
        let k = super::super::value_key_tagged(3, Key(9), 2);
        assert_eq!(slot_of(&k), key_slot(3, Key(9)));
    }

    #[test]
    fn cluster_urls() {
        assert_eq!(ClusterUrl::parse("redis://h:1").unwrap(), None);
        let u = ClusterUrl::parse("redis+cluster://u:p@a:1,b:2/")
            .unwrap()
            .unwrap();
        assert_eq!(u.seeds, vec!["a:1", "b:2"]);
        assert_eq!(u.node_url("c:3"), "redis://u:p@c:3");
        for bad in [
            "redis+cluster://",
            "redis+cluster://a",
            "redis+cluster://a:0",
            "redis+cluster://u:secret@a:1/0",
        ] {
            let e = ClusterUrl::parse(bad).unwrap_err().to_string();
            assert!(e.contains("remote_url") && !e.contains("secret"), "{e}");
        }
        assert_eq!(redact("redis://u:secret@h:1"), "redis://u:***@h:1");
        assert_eq!(redact("redis://h:1"), "redis://h:1");
    }
}
