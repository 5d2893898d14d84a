//! The constructor's signature, spelled once: [`resolve`] converts `Scheduler(*args, **kwargs)`
//! (the scheduler's options and its lower tiers', named as `OffloadConfig`'s fields) and hands
//! the values to [`SchedulerArgs::resolve`], the one place that checks them. It only converts
//! Python objects into Rust values: a value of the wrong type is a `ConfigError` naming the
//! field; every range and combination is the core's.

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use super::super::convert;
use super::super::convert::Arg;
use super::super::errors::to_py;
use super::input::fields;
use crate::config::{GroupArgs, SchedulerArgs, SchedulerConfig, TierArgs};

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

/// The constructor's arguments, converted and resolved (see [`resolve`]). Omitted ones keep
/// [`SchedulerArgs::new`]'s defaults.
#[pyfunction]
#[pyo3(name = "Scheduler", signature = (
    groups, *, num_gpu_blocks, blocks_per_chunk = Arg::Omitted,
    hash_block_size = Arg::Omitted, cpu_chunks = Arg::Omitted, cpu_bytes = Arg::Omitted,
    policy = Arg::Omitted, num_workers = Arg::Omitted, max_loading_requests = Arg::Omitted,
    offload_prompt_only = Arg::Omitted, max_offload_tokens = Arg::Omitted,
    store_threshold = Arg::Omitted, null_block = Arg::Omitted,
    debug_skip_deferred_arming = Arg::Omitted, disk_path = Arg::Omitted,
    disk_bytes = Arg::Omitted, disk_model = Arg::Omitted, disk_deadline_ms = Arg::Omitted,
    disk_probation_after = Arg::Omitted, disk_probation_ms = Arg::Omitted,
    disk_write_mbps = Arg::Omitted, remote_url = Arg::Omitted, remote_model = Arg::Omitted,
    cache_salt = Arg::Omitted, remote_deadline_ms = Arg::Omitted, remote_tls_ca = Arg::Omitted,
    disk_min_hits = Arg::Omitted, remote_min_hits = Arg::Omitted,
    tier_write_share = Arg::Omitted, io_cpus = Arg::Omitted
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
    disk_path: Arg<'_>,
    disk_bytes: Arg<'_>,
    disk_model: Arg<'_>,
    disk_deadline_ms: Arg<'_>,
    disk_probation_after: Arg<'_>,
    disk_probation_ms: Arg<'_>,
    disk_write_mbps: Arg<'_>,
    remote_url: Arg<'_>,
    remote_model: Arg<'_>,
    cache_salt: Arg<'_>,
    remote_deadline_ms: Arg<'_>,
    remote_tls_ca: Arg<'_>,
    disk_min_hits: Arg<'_>,
    remote_min_hits: Arg<'_>,
    tier_write_share: Arg<'_>,
    io_cpus: Arg<'_>,
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
    let d = SchedulerArgs::new(
        groups,
        convert::config_int(num_gpu_blocks, "num_gpu_blocks")?,
    );
    let t = &d.tiers;
    let ms = "a number of milliseconds";
    let tiers = TierArgs {
        disk_path: convert::config_opt_path(&disk_path, "disk_path", t.disk_path.clone())?,
        disk_bytes: convert::config_opt_int(&disk_bytes, "disk_bytes", t.disk_bytes)?,
        disk_model: convert::config_str(&disk_model, "disk_model", "a string", &t.disk_model)?,
        disk_deadline_ms: convert::config_float_as(
            &disk_deadline_ms,
            "disk_deadline_ms",
            ms,
            t.disk_deadline_ms,
        )?,
        disk_probation_after: convert::config_int_or(
            &disk_probation_after,
            "disk_probation_after",
            t.disk_probation_after,
        )?,
        disk_probation_ms: convert::config_float_as(
            &disk_probation_ms,
            "disk_probation_ms",
            ms,
            t.disk_probation_ms,
        )?,
        disk_write_mbps: convert::config_float_as(
            &disk_write_mbps,
            "disk_write_mbps",
            "a number of MB/s",
            t.disk_write_mbps,
        )?,
        disk_min_hits: convert::config_int_or(&disk_min_hits, "disk_min_hits", t.disk_min_hits)?,
        remote_url: convert::config_opt_str(&remote_url, "remote_url", t.remote_url.clone())?,
        remote_model: convert::config_str(
            &remote_model,
            "remote_model",
            "a string",
            &t.remote_model,
        )?,
        cache_salt: convert::config_str(&cache_salt, "cache_salt", "a string", &t.cache_salt)?,
        remote_deadline_ms: convert::config_float_as(
            &remote_deadline_ms,
            "remote_deadline_ms",
            ms,
            t.remote_deadline_ms,
        )?,
        remote_tls_ca: convert::config_opt_path(
            &remote_tls_ca,
            "remote_tls_ca",
            t.remote_tls_ca.clone(),
        )?,
        remote_min_hits: convert::config_int_or(
            &remote_min_hits,
            "remote_min_hits",
            t.remote_min_hits,
        )?,
        io_cpus: match &io_cpus {
            Arg::Given(v) if !v.is_none() => Some(convert::cpu_ids(v)?),
            _ => t.io_cpus.clone(),
        },
    };
    let args = SchedulerArgs {
        blocks_per_chunk: convert::config_int_or(
            &blocks_per_chunk,
            "blocks_per_chunk",
            d.blocks_per_chunk,
        )?,
        hash_block_size: convert::config_opt_int(
            &hash_block_size,
            "hash_block_size",
            d.hash_block_size,
        )?,
        null_block: convert::config_opt_int(&null_block, "null_block", d.null_block)?,
        cpu_chunks: convert::config_opt_int(&cpu_chunks, "cpu_chunks", d.cpu_chunks)?,
        cpu_bytes: convert::config_opt_int(&cpu_bytes, "cpu_bytes", d.cpu_bytes)?,
        policy: convert::config_str(&policy, "policy", "\"lru\" or \"arc\"", &d.policy)?,
        num_workers: convert::config_int_or(&num_workers, "num_workers", d.num_workers)?,
        max_loading_requests: convert::config_int_or(
            &max_loading_requests,
            "max_loading_requests",
            d.max_loading_requests,
        )?,
        offload_prompt_only: convert::config_bool(
            &offload_prompt_only,
            "offload_prompt_only",
            d.offload_prompt_only,
        )?,
        max_offload_tokens: convert::config_opt_int(
            &max_offload_tokens,
            "max_offload_tokens",
            d.max_offload_tokens,
        )?,
        store_threshold: convert::config_int_or(
            &store_threshold,
            "store_threshold",
            d.store_threshold,
        )?,
        tier_write_share: convert::config_float_as(
            &tier_write_share,
            "tier_write_share",
            "a number",
            d.tier_write_share,
        )?,
        debug_skip_deferred_arming: convert::config_bool(
            &debug_skip_deferred_arming,
            "debug_skip_deferred_arming",
            d.debug_skip_deferred_arming,
        )?,
        tiers,
        ..d
    };
    Ok(ResolvedConfig(args.resolve().map_err(to_py)?))
}

/// What each omitted keyword of the constructor takes ([`SchedulerArgs::new`]), by name: the
/// required ones (`groups`, `num_gpu_blocks`) left out.
pub(super) fn defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = SchedulerArgs::new(Vec::new(), 0);
    let t = &d.tiers;
    let path = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
    let out = PyDict::new(py);
    out.set_item("blocks_per_chunk", d.blocks_per_chunk)?;
    out.set_item("hash_block_size", d.hash_block_size)?;
    out.set_item("cpu_chunks", d.cpu_chunks)?;
    out.set_item("cpu_bytes", d.cpu_bytes)?;
    out.set_item("policy", &d.policy)?;
    out.set_item("num_workers", d.num_workers)?;
    out.set_item("max_loading_requests", d.max_loading_requests)?;
    out.set_item("offload_prompt_only", d.offload_prompt_only)?;
    out.set_item("max_offload_tokens", d.max_offload_tokens)?;
    out.set_item("store_threshold", d.store_threshold)?;
    out.set_item("null_block", d.null_block)?;
    out.set_item("debug_skip_deferred_arming", d.debug_skip_deferred_arming)?;
    out.set_item("disk_path", path(&t.disk_path))?;
    out.set_item("disk_bytes", t.disk_bytes)?;
    out.set_item("disk_model", &t.disk_model)?;
    out.set_item("disk_deadline_ms", t.disk_deadline_ms)?;
    out.set_item("disk_probation_after", t.disk_probation_after)?;
    out.set_item("disk_probation_ms", t.disk_probation_ms)?;
    out.set_item("disk_write_mbps", t.disk_write_mbps)?;
    out.set_item("remote_url", &t.remote_url)?;
    out.set_item("remote_model", &t.remote_model)?;
    out.set_item("cache_salt", &t.cache_salt)?;
    out.set_item("remote_deadline_ms", t.remote_deadline_ms)?;
    out.set_item("remote_tls_ca", path(&t.remote_tls_ca))?;
    out.set_item("disk_min_hits", t.disk_min_hits)?;
    out.set_item("remote_min_hits", t.remote_min_hits)?;
    out.set_item("tier_write_share", d.tier_write_share)?;
    out.set_item("io_cpus", &t.io_cpus)?;
    Ok(out)
}
