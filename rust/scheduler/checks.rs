//! Input checks shared by `allocate` and `schedule`: engine block ids (range, the engine's null
//! block) and duplicates within one call, found with generation stamps indexed by block or
//! slab index (no allocation, no clearing per call).

use crate::error::{Error, Result};
use crate::ids::BlockId;

use super::handle::RequestRef;
use super::plan::StepInput;
use super::requests::Status;
use super::Scheduler;

/// How many values ahead [`first_repeated`] prefetches their stamps (indexed by block id or
/// slab index: a cache miss each, an allocation's hundreds of blocks spread over the array).
const AHEAD: usize = 16;

/// The first value other than [`BlockId::NULL`] that occurs twice in `values`, found with generation
/// `stamps` indexed by value (no allocation, no clearing per call).
fn first_repeated<I>(stamps: &mut [u32], stamp: &mut u32, values: I) -> Option<u32>
where
    I: IntoIterator<Item = u32>,
    I::IntoIter: Clone,
{
    *stamp = stamp.wrapping_add(1);
    if *stamp == 0 {
        stamps.fill(0);
        *stamp = 1;
    }
    let values = values.into_iter();
    let mut ahead = values.clone().skip(AHEAD);
    for v in values {
        if let Some(s) = ahead.next().and_then(|a| stamps.get(a as usize)) {
            crate::prefetch::prefetch(s);
        }
        if v == BlockId::NULL.0 {
            continue;
        }
        let seen = &mut stamps[v as usize];
        if *seen == *stamp {
            return Some(v);
        }
        *seen = *stamp;
    }
    None
}

impl Scheduler {
    /// The first non-null block that occurs twice in `blocks`, if any.
    pub(super) fn first_repeated<I>(&mut self, blocks: I) -> Option<BlockId>
    where
        I: IntoIterator<Item = BlockId>,
        I::IntoIter: Clone,
    {
        let values = blocks.into_iter().map(|b| b.0);
        first_repeated(&mut self.stamps, &mut self.stamp, values).map(BlockId)
    }

    /// The first request (slab index) that occurs twice in `reqs`, if any.
    pub(super) fn first_repeated_req<I>(&mut self, reqs: I) -> Option<u32>
    where
        I: IntoIterator<Item = u32>,
        I::IntoIter: Clone,
    {
        self.req_stamps.resize(self.reqs.len(), 0);
        first_repeated(&mut self.req_stamps, &mut self.req_stamp, reqs)
    }

    /// An engine block id checked against the range, the engine's null block mapped to
    /// [`BlockId::NULL`].
    pub(super) fn engine_block(&self, b: BlockId) -> Result<BlockId> {
        if b.0 >= self.cfg.num_gpu_blocks {
            return Err(Error::BlockOutOfRange {
                block: b,
                num_blocks: self.cfg.num_gpu_blocks,
            });
        }
        Ok(null_mapped(self.cfg.null_block, b))
    }

    /// [`Scheduler::engine_block`] of each block.
    pub(super) fn engine_blocks(&self, blocks: &[BlockId]) -> Result<Vec<BlockId>> {
        // Sized once (a collect through `Result` would grow it block by block), with room for
        // the blocks the request decodes into: the list becomes its block table.
        let mut out = Vec::with_capacity(blocks.len() + super::requests::TABLE_ROOM);
        for &b in blocks {
            out.push(self.engine_block(b)?);
        }
        Ok(out)
    }
}

/// An engine block id already checked against the range, the engine's null block (`null`)
/// mapped to [`BlockId::NULL`].
pub(super) fn null_mapped(null: Option<BlockId>, b: BlockId) -> BlockId {
    if Some(b) == null {
        BlockId::NULL
    } else {
        b
    }
}

/// A step input checked against the scheduler's state, with request ids resolved to slab
/// indices and the engine's null block mapped to [`BlockId::NULL`] (appended blocks are the
/// input's own, checked: map them with [`null_mapped`]).
pub(super) struct CheckedStep<'a> {
    /// Scheduled requests and their computed tokens.
    pub(super) scheduled: Vec<(u32, u32)>,
    /// Blocks appended per request and group, as the engine names them (checked).
    pub(super) new_blocks: Vec<(u32, usize, &'a [BlockId])>,
    /// Requests resumed from preemption.
    pub(super) resumed: Vec<u32>,
    /// Requests that finished normally.
    pub(super) finished: Vec<u32>,
    /// Requests that were aborted.
    pub(super) aborted: Vec<u32>,
    /// Requests that were preempted.
    pub(super) preempted: Vec<u32>,
    /// Released requests: `finished`, `aborted` and `preempted`, in that order.
    pub(super) released: Vec<u32>,
    /// The explicit written set, if given, without the null block.
    pub(super) written: Option<Vec<BlockId>>,
}

impl Scheduler {
    /// Checks a whole step input before anything changes, in a fixed order so that the same
    /// bad input always raises the same error.
    pub(super) fn check_step<'a, S: RequestRef, B: AsRef<[BlockId]>>(
        &mut self,
        input: &'a StepInput<S, B>,
    ) -> Result<CheckedStep<'a>> {
        if input.scheduled.len() != input.computed.len() {
            return Err(Error::StepInputLength {
                scheduled: input.scheduled.len(),
                computed: input.computed.len(),
            });
        }
        let resumed = self.ids(&input.resumed)?;
        let finished = self.ids(&input.finished)?;
        let aborted = self.ids(&input.aborted)?;
        let preempted = self.ids(&input.preempted)?;
        self.require(
            &resumed,
            |s| matches!(s, Status::Preempted | Status::Running),
            "only a preempted request resumes",
        )?;
        // A request is released at most once per step, and a released request is not
        // scheduled in the same step.
        let released: Vec<u32> = finished
            .iter()
            .chain(&aborted)
            .chain(&preempted)
            .copied()
            .collect();
        if let Some(i) = self.first_repeated_req(released.iter().copied()) {
            return Err(Error::RequestState {
                request: self.req(i).id.clone(),
                reason: "is listed twice among finished, aborted and preempted in one step".into(),
            });
        }
        // Running, or resumed in this step.
        let live = |s: &Self, i: u32, what: &str| {
            let status = s.req(i).status;
            if status == Status::Running || resumed.contains(&i) {
                Ok(())
            } else {
                Err(Self::state_err(&s.req(i).id, status, what))
            }
        };
        let mut scheduled = Vec::with_capacity(input.scheduled.len());
        for (id, computed) in input.scheduled.iter().zip(&input.computed) {
            let i = self.idx_of(id)?;
            live(self, i, "allocate it before scheduling it")?;
            scheduled.push((i, *computed));
        }
        let ids = scheduled
            .iter()
            .map(|(i, _)| *i)
            .chain(released.iter().copied());
        if let Some(i) = self.first_repeated_req(ids) {
            let id = self.req(i).id.clone();
            return Err(Error::RequestState {
                reason: if released.contains(&i) {
                    "is scheduled and released (finished, aborted or preempted) in one step".into()
                } else {
                    "is scheduled twice in one step".into()
                },
                request: id,
            });
        }
        // A request that releases its blocks in this step neither resumes nor gets blocks in it
        // (its release would be applied first, and its new table would outlive it).
        if let Some(&i) = resumed.iter().find(|i| released.contains(i)) {
            return Err(Error::RequestState {
                request: self.req(i).id.clone(),
                reason: "is resumed and released (finished, aborted or preempted) in one step"
                    .into(),
            });
        }
        let mut new_blocks = Vec::with_capacity(input.new_blocks.len());
        for (id, g, blocks) in &input.new_blocks {
            let i = self.idx_of(id)?;
            if !released.is_empty() && released.contains(&i) {
                return Err(Error::RequestState {
                    request: id.id().to_owned(),
                    reason: "gets new blocks and is released (finished, aborted or preempted) \
                        in one step"
                        .into(),
                });
            }
            if *g as usize >= self.cfg.groups.len() {
                return Err(Error::RequestState {
                    request: id.id().to_owned(),
                    reason: format!(
                        "got blocks for group {g}, but the engine has {} KV groups",
                        self.cfg.groups.len()
                    ),
                });
            }
            live(self, i, "only running requests get blocks")?;
            let blocks = blocks.as_ref();
            for &b in blocks {
                self.engine_block(b)?;
            }
            new_blocks.push((i, *g as usize, blocks));
        }
        let null = self.cfg.null_block;
        let fresh = new_blocks
            .iter()
            .flat_map(|(_, _, b)| b.iter().map(move |&b| null_mapped(null, b)));
        if let Some(b) = self.first_repeated(fresh) {
            let (i, _, _) = new_blocks
                .iter()
                .find(|(_, _, bl)| bl.contains(&b))
                .expect("a repeated block was given");
            return Err(Error::RequestState {
                request: self.req(*i).id.clone(),
                reason: format!(
                    "got block {b}, which this step allocates twice; a block holds one position"
                ),
            });
        }
        self.require(
            finished.iter().chain(&aborted),
            |s| !matches!(s, Status::Finished | Status::Aborted),
            "it cannot finish again",
        )?;
        self.require(
            &preempted,
            |s| matches!(s, Status::Running | Status::Preempted),
            "only running requests are preempted",
        )?;
        let written = match &input.written {
            Some(w) => {
                let mut out = Vec::with_capacity(w.len());
                for &b in w {
                    let b = self.engine_block(b)?;
                    if b != BlockId::NULL {
                        out.push(b);
                    }
                }
                Some(out)
            }
            None => None,
        };
        Ok(CheckedStep {
            scheduled,
            new_blocks,
            resumed,
            finished,
            aborted,
            preempted,
            released,
            written,
        })
    }

    /// Checks that every request of `reqs` has a status `ok` accepts.
    fn require<'a>(
        &self,
        reqs: impl IntoIterator<Item = &'a u32>,
        ok: impl Fn(Status) -> bool,
        what: &str,
    ) -> Result<()> {
        for &i in reqs {
            let r = self.req(i);
            if !ok(r.status) {
                return Err(Self::state_err(&r.id, r.status, what));
            }
        }
        Ok(())
    }
}
