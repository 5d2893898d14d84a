//! A real Redis Cluster on loopback for the shared tier's tests: three masters and three
//! replicas of Debian's `redis-server` (`make test` installs it), free ports, temporary
//! directories, created with `redis-cli --cluster create --cluster-replicas 1`; stopped and
//! removed on drop.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::thread::sleep;
use std::time::{Duration, Instant};

/// One node: its port, directory and process.
pub struct NodeProc {
    pub port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

/// A cluster of six nodes.
pub struct Cluster {
    pub nodes: Vec<NodeProc>,
    root: PathBuf,
    /// The directory of the certificates ([`certificates`]) of a cluster over TLS.
    pub tls: Option<PathBuf>,
    /// One cluster at a time per test binary: six nodes forming a cluster (and failing over)
    /// beside another six on two cores took longer than any bound in a clean-clone CI run.
    _one_at_a_time: MutexGuard<'static, ()>,
}

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn openssl(dir: &std::path::Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .expect("openssl is installed (make test installs it)");
    assert!(out.status.success(), "openssl {args:?}: {out:?}");
}

/// Certificates in `dir`: `ca.crt`, `server.crt`/`server.key` (127.0.0.1), `other-ca.crt`
/// (a CA that signed nothing of the server's).
pub fn certificates(dir: &std::path::Path) {
    for ca in ["ca", "other-ca"] {
        openssl(
            dir,
            &[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "2",
                "-subj",
                &format!("/CN=kvoffload test {ca}"),
                "-keyout",
                &format!("{ca}.key"),
                "-out",
                &format!("{ca}.crt"),
            ],
        );
    }
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ],
    );
    std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            "-out",
            "server.crt",
        ],
    );
}

/// A free port whose cluster bus port (`+10000`) is free too.
fn free_port() -> u16 {
    loop {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        if port < 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

/// `redis-cli -p port args…`, its output (panics when it fails).
pub fn cli(port: u16, args: &[&str]) -> String {
    cli_tls(None, port, args)
}

/// [`cli`], over TLS with the certificates in `tls` when given.
pub fn cli_tls(tls: Option<&std::path::Path>, port: u16, args: &[&str]) -> String {
    let mut cmd = Command::new("redis-cli");
    if let Some(dir) = tls {
        cmd.arg("--tls").arg("--cacert").arg(dir.join("ca.crt"));
    }
    let out = cmd
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("redis-cli is installed (Debian's redis-server package)");
    assert!(out.status.success(), "redis-cli {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// One line of `CLUSTER NODES`.
#[derive(Clone, Debug)]
pub struct NodeLine {
    pub id: String,
    pub port: u16,
    pub master: bool,
    pub failed: bool,
    /// The master's id, for a replica.
    pub of: String,
}

impl Cluster {
    /// Starts six nodes, creates the cluster and waits until every node sees it complete.
    pub fn start() -> Self {
        Self::start_with(false)
    }

    /// [`Cluster::start`], over TLS only (clients, cluster bus, replication) when `tls`, with
    /// certificates made in its directory ([`certificates`]).
    pub fn start_with(tls: bool) -> Self {
        let one_at_a_time = ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner);
        let root = std::env::temp_dir().join(format!(
            "kvoffload-cluster-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&root).unwrap();
        let certs = tls.then(|| {
            certificates(&root);
            root.clone()
        });
        let mut nodes = Vec::new();
        for _ in 0..6 {
            let port = free_port();
            let dir = root.join(port.to_string());
            std::fs::create_dir_all(&dir).unwrap();
            let mut cmd = Command::new("redis-server");
            match &certs {
                None => cmd.args(["--port", &port.to_string()]),
                Some(c) => cmd
                    .args(["--port", "0", "--tls-port", &port.to_string()])
                    .args(["--tls-cluster", "yes", "--tls-replication", "yes"])
                    .arg("--tls-cert-file")
                    .arg(c.join("server.crt"))
                    .arg("--tls-key-file")
                    .arg(c.join("server.key"))
                    .arg("--tls-ca-cert-file")
                    .arg(c.join("ca.crt"))
                    .args(["--tls-auth-clients", "no"]),
            };
            let child = cmd
                .args(["--bind", "127.0.0.1"])
                .arg("--dir")
                .arg(&dir)
                .args([
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                ])
                .args(["--cluster-node-timeout", "2000"])
                // A master that is down costs only its slots.
                .args(["--cluster-require-full-coverage", "no"])
                .args(["--cluster-allow-reads-when-down", "no"])
                .args(["--repl-diskless-sync-delay", "0"])
                .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server is installed (make test installs Debian's package)");
            nodes.push(NodeProc {
                port,
                dir,
                child: Some(child),
            });
        }
        let c = Self {
            nodes,
            root,
            tls: certs,
            _one_at_a_time: one_at_a_time,
        };
        for n in &c.nodes {
            Self::wait(|| {
                let mut cmd = Command::new("redis-cli");
                if let Some(dir) = &c.tls {
                    cmd.arg("--tls").arg("--cacert").arg(dir.join("ca.crt"));
                }
                cmd.args(["-p", &n.port.to_string(), "ping"])
                    .output()
                    .is_ok_and(|o| o.stdout.starts_with(b"PONG"))
            });
        }
        let addrs: Vec<String> = c
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let mut args: Vec<&str> = vec!["--cluster", "create"];
        args.extend(addrs.iter().map(String::as_str));
        args.extend(["--cluster-replicas", "1", "--cluster-yes"]);
        c.cli(c.nodes[0].port, &args);
        c.wait_ok();
        c
    }

    /// Waits until every live node reports `cluster_state:ok`, all slots served, and sees
    /// three live masters.
    pub fn wait_ok(&self) {
        Self::wait(|| {
            self.nodes.iter().filter(|n| n.child.is_some()).all(|n| {
                let info = self.cli(n.port, &["cluster", "info"]);
                let masters = self
                    .cli(n.port, &["cluster", "nodes"])
                    .lines()
                    .filter(|l| {
                        let flags = l.split(' ').nth(2).unwrap_or("");
                        flags.contains("master") && !flags.contains("fail")
                    })
                    .count();
                let repl = self.cli(n.port, &["info", "replication"]);
                info.contains("cluster_state:ok")
                    && info.contains("cluster_slots_ok:16384")
                    && masters == 3
                    && (repl.contains("role:master") || repl.contains("master_link_status:up"))
            })
        });
    }

    fn wait(mut ok: impl FnMut() -> bool) {
        let until = Instant::now() + Duration::from_secs(90);
        while !ok() {
            assert!(Instant::now() < until, "the cluster did not become ready");
            sleep(Duration::from_millis(50));
        }
    }

    /// [`cli_tls`] with this cluster's certificates.
    pub fn cli(&self, port: u16, args: &[&str]) -> String {
        cli_tls(self.tls.as_deref(), port, args)
    }

    /// `redis+cluster://` (`rediss+cluster://` over TLS) with one seed (the first node).
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}+cluster://127.0.0.1:{}", self.nodes[0].port)
    }

    /// `CLUSTER NODES` as one live node sees it.
    pub fn topology(&self) -> Vec<NodeLine> {
        let live = self.nodes.iter().find(|n| n.child.is_some()).unwrap();
        self.cli(live.port, &["cluster", "nodes"])
            .lines()
            .filter(|l| !l.is_empty())
            .map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                let port = f[1]
                    .split('@')
                    .next()
                    .unwrap()
                    .rsplit(':')
                    .next()
                    .unwrap()
                    .parse()
                    .unwrap();
                NodeLine {
                    id: f[0].to_owned(),
                    port,
                    master: f[2].contains("master"),
                    failed: f[2].contains("fail"),
                    of: f[3].to_owned(),
                }
            })
            .collect()
    }

    /// Ports of the live masters, ascending.
    pub fn masters(&self) -> Vec<u16> {
        let mut m: Vec<u16> = self
            .topology()
            .iter()
            .filter(|n| n.master && !n.failed)
            .map(|n| n.port)
            .collect();
        m.sort_unstable();
        m
    }

    /// The node process on `port`.
    pub fn node(&self, port: u16) -> &NodeProc {
        self.nodes.iter().find(|n| n.port == port).unwrap()
    }

    /// Kills the node on `port` (SIGKILL).
    pub fn kill(&mut self, port: u16) {
        let n = self.nodes.iter_mut().find(|n| n.port == port).unwrap();
        if let Some(mut c) = n.child.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }

    /// Sends `sig` to the node on `port`.
    pub fn signal(&self, port: u16, sig: libc::c_int) {
        let pid = self.node(port).child.as_ref().unwrap().id();
        #[allow(unsafe_code)]
        // SAFETY: kill(2) on our own, unreaped child with a valid signal number.
        let rc = unsafe { libc::kill(pid as libc::pid_t, sig) };
        assert_eq!(rc, 0);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut c) = n.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
            let _ = std::fs::remove_dir_all(&n.dir);
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}
