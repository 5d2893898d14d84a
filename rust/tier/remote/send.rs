//! How the client sends an operation: on a pooled connection (the crate's, or a [`BulkConn`]
//! for chunk values) within [`RemoteConfig::deadline`](super::RemoteConfig::deadline), its
//! outcome recorded in the tier's health; and how a call's sub-batches are grouped and run on
//! up to [`RemoteConfig::connections`](super::RemoteConfig::connections) threads.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Instant;

use super::bulk::BulkConn;
use super::client::{add, Node};
use super::pack::{Packed, Split};

/// Why one pipelined operation failed.
#[derive(Debug)]
pub(super) enum OpError {
    Redis,
    Late,
}

impl Node {
    /// Sends the commands of `packed` (existence checks) on a pooled connection and returns
    /// their integer replies (`None`: a server error), or fails the operation (error or
    /// deadline), recording the outcome in the tier's health.
    /// `asking`: every other command is an `ASKING` (its `+OK` skipped).
    pub(super) fn pipeline(
        &self,
        packed: Packed<'_>,
        asking: bool,
    ) -> std::result::Result<Vec<Option<i64>>, OpError> {
        let (segments, count) = packed.finish();
        self.bulk_op(|c| {
            c.send_all(&segments.iter().map(|s| &**s).collect::<Vec<_>>())?;
            let mut out = Vec::with_capacity(count);
            for i in 0..count {
                if asking && i % 2 == 0 {
                    c.status()?;
                } else {
                    out.push(c.int()?);
                }
            }
            Ok(out)
        })
    }

    /// Runs `work` over `batches` on up to `connections` threads; results in batch order.
    pub(super) fn run_batches<B: Sync, R: Send>(
        &self,
        batches: &[B],
        work: impl Fn(&B) -> R + Sync,
    ) -> Vec<R> {
        let threads = self.cfg.connections.min(batches.len());
        if threads <= 1 {
            return batches.iter().map(&work).collect();
        }
        let next = AtomicUsize::new(0);
        let mut out: Vec<Option<R>> = (0..batches.len()).map(|_| None).collect();
        let results = Mutex::new(&mut out);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Relaxed);
                    let Some(b) = batches.get(i) else { break };
                    let r = work(b);
                    results.lock().expect("results lock")[i] = Some(r);
                });
            }
        });
        out.into_iter()
            .map(|r| r.expect("every batch ran"))
            .collect()
    }

    /// Groups item indices into sub-batches of about `limit` bytes.
    pub(super) fn batches(lens: impl Iterator<Item = usize>, limit: usize) -> Vec<Vec<usize>> {
        let mut out: Vec<Vec<usize>> = Vec::new();
        let mut bytes = 0;
        for (i, len) in lens.enumerate() {
            if out.is_empty() || bytes + len > limit && !out.last().expect("one").is_empty() {
                out.push(Vec::new());
                bytes = 0;
            }
            out.last_mut().expect("one").push(i);
            bytes += len;
        }
        out
    }

    /// Sends `batches` (each packed by `pack` into its lead, tail and command count, see
    /// [`Packed::finish_split`]) on up to `connections` threads, each batch one operation
    /// with its deadline; per batch, each command's status (empty when the operation failed).
    ///
    /// A thread keeps its connection from batch to batch and sends the next batch's lead after
    /// the current batch's tail; the next tail goes once the current replies are in, so the
    /// server has likely read that lead alone and takes the large value that follows without
    /// a copy. The next batch is packed (its checksums computed) while the server reads the
    /// current tail.
    pub(super) fn send_batches<'a, B: Sync>(
        &self,
        batches: &[B],
        pack: impl Fn(&B) -> Split<'a> + Sync,
    ) -> Vec<Vec<bool>> {
        let next = AtomicUsize::new(0);
        let take = || {
            let i = next.fetch_add(1, Relaxed);
            batches.get(i).map(|b| (i, pack(b)))
        };
        let out: Mutex<Vec<Vec<bool>>> = Mutex::new(vec![Vec::new(); batches.len()]);
        let stream = || {
            let mut con = self.idle_bulk.lock().expect("pool lock").pop();
            let mut lead_sent = false;
            let mut cur = take();
            while let Some((
                i,
                Split {
                    lead,
                    tail,
                    commands,
                },
            )) = cur
            {
                let mut following = None;
                let result = self.bulk_op_on(&mut con, |c| {
                    if !lead_sent {
                        c.send_all(&lead.iter().map(|s| &**s).collect::<Vec<_>>())?;
                    }
                    c.send_all(&tail.iter().map(|s| &**s).collect::<Vec<_>>())?;
                    // Packed (checksums) while the server reads the tail.
                    if let Some((_, next)) = following.insert(take()) {
                        c.send_all(&next.lead.iter().map(|s| &**s).collect::<Vec<_>>())?;
                    }
                    (0..commands)
                        .map(|_| c.status())
                        .collect::<std::io::Result<Vec<_>>>()
                });
                let following = following.unwrap_or_else(take);
                // A failed operation dropped the connection, and the next lead with it.
                lead_sent = con.is_some() && following.is_some();
                if let Ok(replies) = result {
                    out.lock().expect("results lock")[i] = replies;
                }
                cur = following;
            }
            if let Some(c) = con {
                self.idle_bulk.lock().expect("pool lock").push(c);
            }
        };
        let threads = self.cfg.connections.min(batches.len());
        if threads <= 1 {
            stream();
        } else {
            std::thread::scope(|s| {
                for _ in 0..threads {
                    s.spawn(stream);
                }
            });
        }
        out.into_inner().expect("results lock")
    }

    /// Runs one operation on a pooled [`BulkConn`] within the deadline, recording the outcome
    /// in the tier's health.
    pub(super) fn bulk_op<R>(
        &self,
        op: impl FnOnce(&mut BulkConn) -> std::io::Result<R>,
    ) -> std::result::Result<R, OpError> {
        let mut con = self.idle_bulk.lock().expect("pool lock").pop();
        let result = self.bulk_op_on(&mut con, op);
        if let Some(c) = con {
            self.idle_bulk.lock().expect("pool lock").push(c);
        }
        result
    }

    /// Runs one operation on `con` (connected first when `None`) within the deadline, in wall
    /// time whatever the server does (every system call is bounded by the time left),
    /// recording the outcome in the tier's health; a failed or late operation leaves `con`
    /// `None` (the connection is dropped: replies may still be on their way, and closing it
    /// cancels the I/O: nothing touches the caller's memory after this returns).
    pub(super) fn bulk_op_on<R>(
        &self,
        con: &mut Option<BulkConn>,
        op: impl FnOnce(&mut BulkConn) -> std::io::Result<R>,
    ) -> std::result::Result<R, OpError> {
        let start = Instant::now();
        let deadline = self.cfg.deadline;
        let classify = |e: std::io::Error| {
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) {
                OpError::Late
            } else {
                OpError::Redis
            }
        };
        let result = (|| {
            // Every read and write of the operation ends by then (see `bulk`).
            let end = start + deadline;
            let c = match con {
                Some(c) => c,
                None => con.insert(
                    BulkConn::connect(self.client.get_connection_info(), self.tls.as_ref(), end)
                        .map_err(classify)?,
                ),
            };
            c.set_deadline(end);
            add(&self.counters.round_trips, 1);
            let out = op(c);
            if !c.redirects.is_empty() {
                add(&self.counters.redirects, c.redirects.len());
                self.redirects
                    .lock()
                    .expect("redirects lock")
                    .append(&mut c.redirects);
            }
            let out = out.map_err(classify)?;
            if start.elapsed() > deadline {
                return Err(OpError::Late);
            }
            Ok(out)
        })();
        if result.is_err() {
            *con = None;
        }
        self.record(result.as_ref().map(|_| ()));
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::remote::{BATCH_BYTES, WRITE_BATCH_BYTES};

    #[test]
    fn large_writes_go_alone_small_ones_share_a_pipeline() {
        let two_mib = [2 << 20; 4];
        let alone = Node::batches(two_mib.iter().copied(), WRITE_BATCH_BYTES);
        assert_eq!(alone, vec![vec![0], vec![1], vec![2], vec![3]]);
        let shared = Node::batches(two_mib.iter().copied(), BATCH_BYTES);
        assert_eq!(shared, vec![vec![0, 1, 2, 3]]);
        let small = Node::batches([64 << 10; 32].into_iter(), WRITE_BATCH_BYTES);
        assert_eq!(small, vec![(0..16).collect::<Vec<_>>(), (16..32).collect()]);
        let mixed = Node::batches([4096, 2 << 20, 4096].into_iter(), WRITE_BATCH_BYTES);
        assert_eq!(mixed, vec![vec![0], vec![1], vec![2]]);
    }
}
