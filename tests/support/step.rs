//! Step inputs the scheduler's integration tests share.

use kvoffload::scheduler::StepInput;
use kvoffload::BlockId;

/// Block ids from plain integers.
pub fn bl(ids: &[u32]) -> Vec<BlockId> {
    ids.iter().copied().map(BlockId).collect()
}

/// A step of `scheduled` `(request, computed tokens)` pairs and `finished` requests that writes
/// the blocks `written` (the exact fence), nothing else.
pub fn step(scheduled: &[(&str, u32)], finished: &[&str], written: &[u32]) -> StepInput<String> {
    StepInput {
        scheduled: scheduled.iter().map(|(r, _)| (*r).to_owned()).collect(),
        computed: scheduled.iter().map(|(_, c)| *c).collect(),
        new_blocks: Vec::new(),
        resumed: Vec::new(),
        finished: finished.iter().map(|r| (*r).to_owned()).collect(),
        aborted: Vec::new(),
        preempted: Vec::new(),
        written: Some(bl(written)),
    }
}
