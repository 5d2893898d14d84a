//! Two engines sharing the Redis tier through the scheduler: engine A's stored chunks are
//! written behind by a real [`TierWorker`] from its CPU pool memory; engine B's lookup asks
//! the server (ask later while the existence check is in flight), promotes the chunks into
//! its own CPU pool (ask later), then loads them: byte-exact under the oracle. Another tenant
//! salt shares nothing, and a server that is gone means recomputation, never wrong bytes.

use std::sync::Arc;
use std::thread::sleep;
use std::time::{Duration, Instant};

use kvoffload::scheduler::{Scheduler, StepPlan};
use kvoffload::tier::io::{RemoteGroup, WorkerJob};
use kvoffload::tier::remote::{RemoteClient, RemoteConfig};
use kvoffload::{BlockId, Key};

mod support;
use support::tier::{config, namespace, oracle, step, CpuTier, Server};

fn keys() -> Vec<Key> {
    (1..=4).map(|i| Key(0xAB00 + i)).collect()
}

/// One engine: its scheduler, its CPU pool bytes and a real tier worker over them.
struct Engine {
    s: Scheduler,
    tier: CpuTier,
    client: Arc<RemoteClient>,
}

impl Engine {
    fn new(url: &str, salt: &str) -> Self {
        let mut rc = RemoteConfig::new(url);
        // Far longer than any operation of a loaded machine: a healthy server's answer, write
        // or read must never miss it (2 s could); a dead server fails at once all the same.
        rc.deadline = Duration::from_secs(30);
        rc.probation = Duration::from_millis(100);
        let client = Arc::new(RemoteClient::new(rc).unwrap());
        let mut s = Scheduler::new(config()).unwrap();
        s.attach_remote(
            &client,
            "m",
            salt,
            Duration::from_secs(60),
            Duration::from_millis(50),
            None,
        )
        .unwrap();
        let remote = RemoteGroup {
            client: Arc::clone(&client),
            namespace: namespace().salted(salt).digest().into(),
        };
        Engine {
            s,
            tier: CpuTier::new(None, Some(remote)),
            client,
        }
    }

    /// Runs a plan's stores (the oracle's bytes, as a GPU copy would write them) and tier jobs
    /// (on the worker's threads), and reports them; returns the tier jobs' kinds and flags.
    fn execute(&mut self, plan: &StepPlan) -> Vec<(&'static str, bool)> {
        for job in &plan.stores {
            for t in &job.transfers {
                for (k, slot) in t.keys.iter().zip(&t.cpu_blocks) {
                    self.tier.store(*k, *slot);
                }
            }
            self.s.complete(job.id, 0, true).unwrap();
        }
        let jobs: Vec<WorkerJob> = plan.tier_jobs.iter().map(WorkerJob::from).collect();
        let ids: Vec<_> = jobs.iter().map(|j| j.id).collect();
        self.tier.worker.submit(jobs);
        // Longer than the client's deadline: a job's operations end within it.
        let done = self.tier.worker.wait(&ids, Duration::from_secs(60));
        assert_eq!(done.len(), ids.len());
        let mut seen = Vec::new();
        for j in &plan.tier_jobs {
            let ok = done.iter().find(|(id, _)| *id == j.id).unwrap().1;
            seen.push((j.kind.name(), ok));
            assert_eq!(j.medium, kvoffload::tier::Medium::Remote);
            self.s.complete(j.id, 0, ok).unwrap();
        }
        seen
    }

    /// Request `id` computes the 4 chunks and finishes: they are stored, then written behind.
    fn compute(&mut self, id: &'static str) {
        assert_eq!(self.ask(id), Some(0));
        self.s
            .allocate(id, &[(1..=5).map(BlockId).collect()], 0, 0)
            .unwrap();
        let plan = self
            .s
            .schedule(&step(&[(id, 17)], &[], &[1, 2, 3, 4, 5]))
            .unwrap();
        assert!(self.execute(&plan).is_empty());
        let plan = self.s.schedule(&step(&[], &[id], &[])).unwrap();
        assert_eq!(self.execute(&plan), [("write", true)]);
    }

    /// Asks until the lookup answers (bounded), stepping the engine between asks.
    fn ask(&mut self, id: &'static str) -> Option<u32> {
        if self.s.status(id).is_err() {
            self.s.add_request(id, 17, keys()).unwrap();
        }
        // Bounded in time (past the client's deadline), not in asks (2000 were ~2 s).
        let until = Instant::now() + Duration::from_secs(60);
        while Instant::now() < until {
            if let Some(n) = self.s.lookup(id, 0).unwrap() {
                return Some(n);
            }
            let plan = self.s.schedule(&step(&[], &[], &[])).unwrap();
            self.execute(&plan);
            sleep(Duration::from_millis(1));
        }
        None
    }
}

#[test]
fn engine_b_promotes_and_loads_engine_a_chunks_byte_exact() {
    let server = Server::start();
    let mut a = Engine::new(&server.url(), "");
    a.compute("a");
    assert_eq!(a.s.tier_stats()[0].tier.writes, 4);

    let mut b = Engine::new(&server.url(), "");
    b.s.add_request("b", 17, keys()).unwrap();
    assert_eq!(
        b.s.lookup("b", 0).unwrap(),
        None,
        "ask later: existence check in flight"
    );
    assert_eq!(b.ask("b"), Some(16), "promoted from the shared tier");
    let st = b.s.tier_stats()[0];
    assert_eq!(
        (st.promote_jobs, st.failed_promotions, st.tier.promotions),
        (1, 0, 4)
    );
    let load =
        b.s.allocate("b", &[(6..=10).map(BlockId).collect()], 0, 16)
            .unwrap()
            .expect("a load job");
    let plan =
        b.s.schedule(&step(&[("b", 17)], &[], &[6, 7, 8, 9, 10]))
            .unwrap();
    let job = plan.loads.iter().find(|j| j.id == load).unwrap();
    let t = &job.transfers[0];
    assert_eq!(t.keys, keys());
    for (k, slot) in t.keys.iter().zip(&t.cpu_blocks) {
        assert!(
            b.tier.slot(*slot) == oracle(*k),
            "key {k}: promoted bytes differ"
        );
    }
    assert_eq!(b.client.stats().checksum_mismatches, 0);
}

#[test]
fn another_tenant_salt_shares_nothing() {
    let server = Server::start();
    let mut a = Engine::new(&server.url(), "tenant-a");
    a.compute("a");
    let mut b = Engine::new(&server.url(), "tenant-b");
    assert_eq!(b.ask("b"), Some(0));
    assert_eq!(b.s.tier_stats()[0].promote_jobs, 0);
}

#[test]
fn a_dead_server_means_recompute() {
    let server = Server::start();
    let mut a = Engine::new(&server.url(), "");
    a.compute("a");
    let url = server.url();
    drop(server);
    let mut b = Engine::new(&url, "");
    assert_eq!(
        b.ask("b"),
        Some(0),
        "no answer in time: a miss, the request computes"
    );
    // Writes behind of its own chunks fail (or are dropped on probation): never readable.
    b.compute_other();
    let st = b.s.tier_stats()[0];
    assert_eq!(st.tier.writes, 0);
    // One failed existence check (its keys are absent until the retry time: no re-asking)
    // and one failed write; a third failure would put the client on probation
    // (tests/remote.rs, tests/test_remote_engine_faults.py).
    assert_eq!((st.tier.checks, st.tier.expired_checks), (1, 1));
    assert!(b.client.stats().errors >= 2);
}

impl Engine {
    fn compute_other(&mut self) {
        self.s
            .allocate("b", &[(1..=5).map(BlockId).collect()], 0, 0)
            .unwrap();
        let plan = self
            .s
            .schedule(&step(&[("b", 17)], &[], &[1, 2, 3, 4, 5]))
            .unwrap();
        self.execute(&plan);
        let plan = self.s.schedule(&step(&[], &["b"], &[])).unwrap();
        assert_eq!(self.execute(&plan), [("write", false)]);
    }
}
