"""Start `jax.distributed` only where there is more than one process to join.

Levanter's `DistributedConfig.initialize` calls `jax.distributed.initialize` when any cluster type of jax's
reports itself present, counting the opt-in-only ones: `Mpi4pyCluster.is_env_present()` is true wherever
the `mpi4py` package is installed (NVIDIA's JAX images ship it). jax's own detection skips opt-in types,
finds no coordinator and stops a single-GPU run with "coordinator_address should be defined". Here a run
with nothing configured (no `trainer.distributed.*`, no `JAX_COORDINATOR_ADDRESS`) and no cluster that
jax itself would detect is a single process: initialisation is skipped, with a log line. A configured or
detected cluster goes through Levanter unchanged, and a coordinator jax cannot find ends in one line
saying what to set.
"""

import logging
import os

from qkvflow.errors import UserError

logger = logging.getLogger(__name__)

SET_ME = (
    "set trainer.distributed.coordinator_address (host:port), num_processes and process_id for a "
    "multi-process run, or --trainer.distributed.initialize_jax_distributed false for a single process"
)


def detected_cluster() -> str | None:
    """The cluster environment jax's automatic detection would use (opt-in-only types excluded, as jax
    excludes them), or None."""
    from jax._src import clusters

    for env in clusters.ClusterEnv._cluster_types:
        if not env.opt_in_only_method and env.is_env_present():
            return env.__name__
    return None


def _iris_job() -> bool:
    """Levanter's own managed-job launcher (it initialises from the job, before any cluster check)."""
    try:
        from levanter.distributed import get_job_info
    except ImportError:
        return False
    return get_job_info() is not None


def is_single_process(config) -> bool:
    """True when `config` (Levanter's DistributedConfig) names nothing and no cluster is detected."""
    configured = (config.coordinator_address, config.num_processes, config.process_id, config.local_device_ids)
    if any(v is not None for v in configured) or os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return False
    return not _iris_job() and detected_cluster() is None


def initialize(config) -> None:
    """`config.initialize()` (Levanter's), skipped for a single process; jax's missing-coordinator
    error becomes one line naming what to set."""
    if not config.initialize_jax_distributed:
        return
    if is_single_process(config):
        logger.info(
            "single process (no trainer.distributed settings, no cluster detected): not starting jax.distributed"
        )
        return
    try:
        config.initialize()
    except ValueError as e:
        if "coordinator_address" not in str(e):
            raise
        raise UserError(
            f"jax.distributed found no coordinator (cluster detected: {detected_cluster() or 'none'}): {SET_ME}"
        ) from None
