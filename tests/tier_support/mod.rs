//! What the tier integration tests share: a real `redis-server` on loopback, a one-group
//! scheduler configuration, step inputs, and the byte oracle of chunks. Included by each test
//! crate with `mod tier_support;`, which may use only some of it.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use kvoffload::config::{GroupConfig, SchedulerConfig};
use kvoffload::policy::PolicyKind;
use kvoffload::scheduler::StepInput;
use kvoffload::{BlockId, Key};

/// A `redis-server` on 127.0.0.1, a free port and a temporary directory; no persistence,
/// `maxmemory` with `allkeys-lru`. Killed and removed on drop.
pub struct Server {
    pub port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl Server {
    /// Starts a server and waits until it answers.
    pub fn start() -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir =
            std::env::temp_dir().join(format!("kvoffload-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut s = Self {
            port,
            dir,
            child: None,
        };
        s.spawn();
        s
    }

    /// Starts the server (again, on the same port, empty) and waits until it answers.
    pub fn spawn(&mut self) {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .arg("--dir")
            .arg(&self.dir)
            .args(["--save", "", "--appendonly", "no", "--maxmemory", "256mb"])
            .args([
                "--maxmemory-policy",
                "allkeys-lru",
                "--protected-mode",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is installed (make test installs Debian's package)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut c) =
                redis::Client::open(self.url().as_str()).and_then(|c| c.get_connection())
            {
                if redis::cmd("PING").query::<String>(&mut c).is_ok() {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "redis-server did not start");
            sleep(Duration::from_millis(20));
        }
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the server at once (SIGKILL).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }

    /// A fresh connection of the `redis` crate.
    pub fn con(&self) -> redis::Connection {
        redis::Client::open(self.url().as_str())
            .unwrap()
            .get_connection()
            .unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Bytes of a chunk in the scheduler tests (a header's worth more than a page: odd sizes).
pub const CHUNK: usize = 4096 + 24;
/// CPU slots in the scheduler tests.
pub const CPU_CHUNKS: u32 = 16;

/// [`config_with`] of [`CHUNK`] and [`CPU_CHUNKS`].
pub fn config() -> SchedulerConfig {
    config_with(CHUNK as u64, CPU_CHUNKS)
}

/// One full-attention group of 4-token blocks, one block per chunk of `chunk` bytes,
/// `cpu_chunks` CPU slots, 64 GPU blocks, one worker.
pub fn config_with(chunk: u64, cpu_chunks: u32) -> SchedulerConfig {
    SchedulerConfig {
        groups: vec![GroupConfig {
            block_size: 4,
            sliding_window: None,
            bytes_per_chunk: chunk,
        }],
        blocks_per_chunk: 1,
        hash_block_size: 4,
        num_gpu_blocks: 64,
        null_block: Some(BlockId(0)),
        cpu_chunks,
        policy: PolicyKind::Lru,
        num_workers: 1,
        max_loading_requests: 0,
        offload_prompt_only: false,
        max_offload_tokens: None,
        store_threshold: 0,
        debug_skip_deferred_arming: false,
    }
}

/// The [`CHUNK`] bytes of chunk `key`: a function of the key.
pub fn oracle(key: Key) -> Vec<u8> {
    (0..CHUNK)
        .map(|i| (key.0 as usize).wrapping_mul(31).wrapping_add(i * 7) as u8)
        .collect()
}

/// One step: `scheduled` requests with their computed tokens, `finished` ones, and the
/// blocks `written`.
pub fn step(
    scheduled: &[(&'static str, u32)],
    finished: &[&'static str],
    written: &[u32],
) -> StepInput<&'static str> {
    StepInput {
        scheduled: scheduled.iter().map(|(r, _)| *r).collect(),
        computed: scheduled.iter().map(|(_, c)| *c).collect(),
        new_blocks: Vec::new(),
        resumed: Vec::new(),
        finished: finished.to_vec(),
        aborted: Vec::new(),
        preempted: Vec::new(),
        written: Some(written.iter().copied().map(BlockId).collect()),
    }
}
