"""qkvflow.training.distributed: a single process never reaches `jax.distributed.initialize`, a cluster
still does, and a coordinator jax cannot find ends in one line saying what to set. The environments are
faked (environment variables, and mpi4py's presence, which is all jax's Mpi4pyCluster checks)."""

import jax
import pytest
from jax._src.clusters import mpi4py_cluster
from levanter.distributed import DistributedConfig

from qkvflow.errors import UserError
from qkvflow.training import distributed

CLUSTER_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID",
                "OMPI_MCA_orte_hnp_uri", "KUBERNETES_SERVICE_HOST", "JAX_COORDINATOR_ADDRESS")  # fmt: skip


@pytest.fixture
def calls(monkeypatch):
    """A bare environment, with mpi4py 'installed' (as in NVIDIA's JAX images), and jax.distributed.initialize
    replaced by a recorder."""
    for var in CLUSTER_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(mpi4py_cluster.Mpi4pyCluster, "is_env_present", classmethod(lambda cls: True))
    seen = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: seen.append((a, k)))
    return seen


def test_a_single_process_skips_initialisation(calls):
    config = DistributedConfig()
    assert config._is_distributed()  # Levanter alone would call jax.distributed.initialize here, and stop
    assert distributed.detected_cluster() is None and distributed.is_single_process(config)
    distributed.initialize(config)
    assert calls == []


def test_a_slurm_job_still_initialises(calls, monkeypatch):
    env = {"SLURM_JOB_ID": "4097", "SLURM_STEP_NODELIST": "node[001-002]", "SLURM_NTASKS": "2",
           "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("SLURM_LOCAL_PROCESS_COUNT", "1")
    assert distributed.detected_cluster() is not None
    distributed.initialize(DistributedConfig())
    assert len(calls) == 1 and calls[0][0][:2] == ("node001:61441", 2)  # port: 4097 mod 4096 + 61440


@pytest.mark.parametrize("how", ["config", "env"])
def test_a_named_coordinator_still_initialises(calls, monkeypatch, how):
    config = DistributedConfig(coordinator_address="127.0.0.1:4321", num_processes=2, process_id=0)
    if how == "env":
        monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:4321")
        config = DistributedConfig()
    assert not distributed.is_single_process(config)
    distributed.initialize(config)
    assert len(calls) == 1


def test_switched_off_is_not_started(calls, monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:4321")
    distributed.initialize(DistributedConfig(initialize_jax_distributed=False))
    assert calls == []


def test_a_coordinator_jax_cannot_find_is_one_line(calls, monkeypatch):
    monkeypatch.setenv("OMPI_MCA_orte_hnp_uri", "1531576320.0;tcp://10.96.0.1:34911")

    def no_coordinator(*a, **k):
        raise ValueError("coordinator_address should be defined.")

    monkeypatch.setattr(jax.distributed, "initialize", no_coordinator)
    with pytest.raises(UserError) as e:
        distributed.initialize(DistributedConfig())
    message = str(e.value)
    assert "\n" not in message and "OmpiCluster" in message
    assert "trainer.distributed.coordinator_address" in message and "initialize_jax_distributed false" in message
