//! The shared tier over TLS (`rediss://`) against a real `redis-server` with certificates this
//! test makes with `openssl` (a CA, a server certificate for 127.0.0.1, and a second CA that
//! signed nothing of the server's): byte-exact round trips; a certificate not signed by the
//! given CA, a missing CA file and a wrong password refused at startup with a configuration
//! error naming the URL, password redacted.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use kvoffload::tier::remote::{ReadOutcome, RemoteClient, RemoteConfig};

mod support;
use support::cluster::certificates;
use support::remote::{read, write, Cut};

struct TlsServer {
    port: u16,
    dir: PathBuf,
    child: Child,
}

impl TlsServer {
    fn start(password: Option<&str>) -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = std::env::temp_dir().join(format!("kvoffload-tls-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        certificates(&dir);
        let mut cmd = Command::new("redis-server");
        cmd.args([
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
        ])
        .arg("--dir")
        .arg(&dir)
        .args([
            "--tls-cert-file",
            "server.crt",
            "--tls-key-file",
            "server.key",
        ])
        .args(["--tls-ca-cert-file", "ca.crt", "--tls-auth-clients", "no"])
        .args(["--save", "", "--appendonly", "no"])
        .current_dir(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        if let Some(pw) = password {
            cmd.args(["--requirepass", pw]);
        }
        let child = cmd.spawn().expect("redis-server is installed");
        let until = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < until, "redis-server (TLS) did not start");
            sleep(Duration::from_millis(20));
        }
        Self { port, dir, child }
    }

    fn config(&self, url: &str, ca: &str) -> RemoteConfig {
        let mut c = RemoteConfig::new(url);
        c.deadline = Duration::from_secs(5);
        c.part_bytes = 4096;
        c.tls_ca = Some(self.dir.join(ca));
        c
    }
}

impl Drop for TlsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn chunk(key: u64) -> Vec<u8> {
    (0..10_000).map(|i| ((key * 7 + i) % 251) as u8).collect()
}

#[test]
fn chunks_round_trip_over_tls_and_bad_certificates_or_passwords_fail_at_startup() {
    let server = TlsServer::start(Some("right"));
    let url = format!("rediss://:right@127.0.0.1:{}", server.port);
    let c = RemoteClient::new(server.config(&url, "ca.crt")).unwrap();
    let keys: Vec<u64> = (1..=20).collect();
    let data: Vec<Vec<u8>> = keys.iter().map(|&k| chunk(k)).collect();
    assert_eq!(
        write(&c, 9, &keys, &data, Cut::Whole),
        vec![true; keys.len()]
    );
    let (out, bufs) = read(&c, 9, &keys, |_| 10_000, Cut::Whole);
    assert_eq!(out, vec![ReadOutcome::Hit; keys.len()]);
    assert_eq!(bufs, data);

    let err = |cfg: RemoteConfig| RemoteClient::new(cfg).unwrap_err().to_string();
    // A server certificate the given CA did not sign.
    let e = err(server.config(&url, "other-ca.crt"));
    assert!(
        e.contains("remote_url") && e.contains(":***@") && !e.contains("right"),
        "{e}"
    );
    // A wrong password.
    let wrong = format!("rediss://:hunter2@127.0.0.1:{}", server.port);
    let e = err(server.config(&wrong, "ca.crt"));
    assert!(e.contains("remote_url") && !e.contains("hunter2"), "{e}");
    // rediss:// without a CA file, and a CA file that is not there.
    let mut no_ca = server.config(&url, "ca.crt");
    no_ca.tls_ca = None;
    assert!(err(no_ca).contains("remote_tls_ca"));
    assert!(err(server.config(&url, "missing.crt")).contains("missing.crt"));
}
