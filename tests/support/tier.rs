//! What the tier integration tests share: a real `redis-server` on loopback, a one-group
//! scheduler configuration, step inputs, the byte oracle of chunks, and a CPU pool with a real
//! tier worker over it.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use kvoffload::config::{GroupConfig, SchedulerConfig};
use kvoffload::copy::{RowSpace, Span};
use kvoffload::scheduler::StepInput;
use kvoffload::tier::disk::{engine_namespace, SlabFile};
use kvoffload::tier::io::{CpuRegion, RemoteGroup, TierGroup, TierWorker};
use kvoffload::tier::namespace::Namespace;
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

    /// Stops the server (SIGSTOP) and returns once the kernel reports it stopped: until
    /// [`Server::resume`] it answers nothing (connections and commands wait in the kernel), so
    /// a test can observe a question in flight without racing the server's answer.
    pub fn pause(&self) {
        let pid = self.signal(libc::SIGSTOP);
        // The signal takes effect asynchronously: wait for state `T` in /proc/PID/stat.
        let stat = format!("/proc/{pid}/stat");
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let s = std::fs::read_to_string(&stat).unwrap();
            let state = s.rsplit(')').next().unwrap().trim_start();
            if state.starts_with('T') {
                return;
            }
            assert!(Instant::now() < until, "redis-server did not stop: {s}");
            sleep(Duration::from_millis(1));
        }
    }

    /// Lets a [`Server::pause`]d server run again (SIGCONT; harmless when it runs).
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    /// Sends `sig` to the server process; returns its pid.
    fn signal(&self, sig: libc::c_int) -> u32 {
        let pid = self.child.as_ref().expect("the server runs").id();
        #[allow(unsafe_code)]
        // SAFETY: kill(2) on our own child's pid (not reaped: `child` is held) with a valid
        // signal number touches no memory of this process.
        let rc = unsafe { libc::kill(pid as libc::pid_t, sig) };
        assert_eq!(
            rc,
            0,
            "kill({pid}, {sig}): {}",
            std::io::Error::last_os_error()
        );
        pid
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
/// `cpu_chunks` CPU slots, 64 GPU blocks, one worker; write-behind may pin every CPU slot
/// (these pools are tiny: `tier_write_bound.rs` tests the bound).
pub fn config_with(chunk: u64, cpu_chunks: u32) -> SchedulerConfig {
    let group = GroupConfig {
        block_size: 4,
        sliding_window: None,
        bytes_per_chunk: chunk,
    };
    SchedulerConfig {
        tier_write_slots: cpu_chunks,
        ..SchedulerConfig::new(vec![group], 64, cpu_chunks)
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

/// The engine namespace of model `"m"` for [`config`]'s group (rank 0 of 1).
pub fn namespace() -> Namespace {
    engine_namespace("m", CHUNK as u64, 4, 1, 0, 1, 0)
}

/// A CPU pool of [`CPU_CHUNKS`] chunks of [`CHUNK`] bytes, one row per chunk, and a real
/// [`TierWorker`] (two threads) that copies between it and the group's tiers.
pub struct CpuTier {
    /// Declared (so dropped) before `cpu`: its threads stop before the bytes go.
    pub worker: TierWorker,
    pub cpu: Box<[u8]>,
}

impl CpuTier {
    /// The pool and its worker over the disk `file` and/or the `remote` tier.
    pub fn new(file: Option<SlabFile>, remote: Option<RemoteGroup>) -> Self {
        let mut cpu = vec![0u8; CPU_CHUNKS as usize * CHUNK].into_boxed_slice();
        let span = Span {
            base: cpu.as_mut_ptr() as usize,
            len: cpu.len(),
        };
        let group = TierGroup {
            cpu_rows: CPU_CHUNKS as usize,
            rows_per_chunk: 1,
            regions: vec![CpuRegion {
                space: RowSpace {
                    buffer: 0,
                    offset: 0,
                    stride: CHUNK,
                },
                row_bytes: CHUNK,
            }],
            file,
            remote,
        };
        #[allow(unsafe_code)]
        // SAFETY: `cpu` is boxed (it never moves) and lives in the same struct as the worker,
        // which is dropped (its threads joined) before it.
        let worker = unsafe { TierWorker::new(&[span], vec![group], 2, None) }.unwrap();
        Self { worker, cpu }
    }

    /// The bytes of CPU slot `s`.
    pub fn slot(&self, s: u32) -> &[u8] {
        &self.cpu[s as usize * CHUNK..(s as usize + 1) * CHUNK]
    }

    /// Writes the [`oracle`] bytes of `key` into slot `s`, as a GPU store copy would.
    pub fn store(&mut self, key: Key, s: u32) {
        let at = s as usize * CHUNK;
        self.cpu[at..at + CHUNK].copy_from_slice(&oracle(key));
    }
}
