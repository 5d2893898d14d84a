//! The constructor's signature, spelled once: [`resolve`] converts `Scheduler(*args, **kwargs)`
//! and hands the values to [`SchedulerArgs::resolve`], the one place that checks them.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use super::super::convert;
use super::super::convert::Arg;
use super::super::errors::to_py;
use super::input::fields;
use crate::config::{GroupArgs, SchedulerArgs, SchedulerConfig};

/// The resolved configuration, handed from [`resolve_config`] to its two callers.
#[pyclass(frozen)]
struct ResolvedConfig(SchedulerConfig);

/// Resolves `Scheduler(*args, **kwargs)` (and `check_config`'s arguments): the one place that
/// spells the constructor's signature. Converts the values as given; [`SchedulerArgs::resolve`]
/// checks them.
pub(super) fn resolve(
    args: &Bound<'_, PyTuple>,
    kwargs: Option<&Bound<'_, PyDict>>,
) -> PyResult<SchedulerConfig> {
    let f = wrap_pyfunction!(resolve_config, args.py())?;
    Ok(f.call(args, kwargs)?
        .cast::<ResolvedConfig>()?
        .get()
        .0
        .clone())
}

/// The constructor's arguments, converted and resolved (see [`resolve`]).
#[pyfunction]
#[pyo3(name = "Scheduler", signature = (
    groups, *, num_gpu_blocks, blocks_per_chunk = Arg::Omitted,
    hash_block_size = Arg::Omitted, cpu_chunks = Arg::Omitted, cpu_bytes = Arg::Omitted,
    policy = Arg::Omitted, num_workers = Arg::Omitted, max_loading_requests = Arg::Omitted,
    offload_prompt_only = Arg::Omitted, max_offload_tokens = Arg::Omitted,
    store_threshold = Arg::Omitted, null_block = Arg::Omitted,
    debug_skip_deferred_arming = Arg::Omitted, tier_write_share = Arg::Omitted
))]
#[allow(clippy::too_many_arguments, clippy::needless_pass_by_value)]
fn resolve_config(
    groups: &Bound<'_, PyAny>,
    num_gpu_blocks: &Bound<'_, PyAny>,
    blocks_per_chunk: Arg<'_>,
    hash_block_size: Arg<'_>,
    cpu_chunks: Arg<'_>,
    cpu_bytes: Arg<'_>,
    policy: Arg<'_>,
    num_workers: Arg<'_>,
    max_loading_requests: Arg<'_>,
    offload_prompt_only: Arg<'_>,
    max_offload_tokens: Arg<'_>,
    store_threshold: Arg<'_>,
    null_block: Arg<'_>,
    debug_skip_deferred_arming: Arg<'_>,
    tier_write_share: Arg<'_>,
) -> PyResult<ResolvedConfig> {
    let config_err = |what: &str, obj: &Bound<'_, PyAny>, expected: &str| {
        to_py(crate::config::type_error(
            what,
            expected,
            convert::describe(obj),
        ))
    };
    let groups = convert::items(
        groups,
        "groups",
        "a sequence of (block_size, sliding_window, bytes_per_block) tuples",
        |m| to_py(crate::error::Error::Config(m)),
    )?
    .iter()
    .enumerate()
    .map(|(g, item)| {
        let what = format!("groups[{g}]");
        let shape = "a (block_size, sliding_window, bytes_per_block) tuple";
        let f =
            fields(item, 3, || what.clone(), shape).map_err(|_| config_err(&what, item, shape))?;
        let window = &f[1];
        Ok(GroupArgs {
            block_size: convert::config_int(&f[0], &format!("{what}.block_size"))?,
            sliding_window: if window.is_none() {
                None
            } else {
                Some(convert::config_int(
                    window,
                    &format!("{what}.sliding_window"),
                )?)
            },
            bytes_per_block: convert::config_int(&f[2], &format!("{what}.bytes_per_block"))?,
        })
    })
    .collect::<PyResult<Vec<_>>>()?;
    let args = SchedulerArgs {
        groups,
        blocks_per_chunk: convert::config_int_or(&blocks_per_chunk, "blocks_per_chunk", 1)?,
        hash_block_size: convert::config_opt_int(&hash_block_size, "hash_block_size", None)?,
        num_gpu_blocks: convert::config_int(num_gpu_blocks, "num_gpu_blocks")?,
        null_block: convert::config_opt_int(&null_block, "null_block", Some(0))?,
        cpu_chunks: convert::config_opt_int(&cpu_chunks, "cpu_chunks", None)?,
        cpu_bytes: convert::config_opt_int(&cpu_bytes, "cpu_bytes", None)?,
        policy: convert::config_str(&policy, "policy", "\"lru\" or \"arc\"", "lru")?,
        num_workers: convert::config_int_or(&num_workers, "num_workers", 1)?,
        max_loading_requests: convert::config_int_or(
            &max_loading_requests,
            "max_loading_requests",
            0,
        )?,
        offload_prompt_only: convert::config_bool(
            &offload_prompt_only,
            "offload_prompt_only",
            false,
        )?,
        max_offload_tokens: convert::config_opt_int(
            &max_offload_tokens,
            "max_offload_tokens",
            None,
        )?,
        store_threshold: convert::config_int_or(&store_threshold, "store_threshold", 0)?,
        tier_write_share: convert::config_float_or(
            &tier_write_share,
            "tier_write_share",
            crate::config::DEFAULT_TIER_WRITE_SHARE,
        )?,
        debug_skip_deferred_arming: convert::config_bool(
            &debug_skip_deferred_arming,
            "debug_skip_deferred_arming",
            false,
        )?,
    };
    Ok(ResolvedConfig(args.resolve().map_err(to_py)?))
}
