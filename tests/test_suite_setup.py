"""What tests/conftest.py sets up for every test and the processes tests start."""

import os

from tests.helpers import with_host_devices


def test_the_session_compiles_cheaply_and_subprocesses_keep_it():
    """LLVM at -O0 and, on jaxlib 0.10, the classic fusion emitters, unless the caller chose; and a
    subprocess given several host devices keeps the session's flags (the device count was once the
    whole of XLA_FLAGS, dropping them)."""
    from importlib.metadata import version

    flags = os.environ["XLA_FLAGS"].split()
    assert flags == os.environ["QKVFLOW_TESTS_XLA_FLAGS"].split()  # an xdist worker keeps the session's
    assert sum(f.startswith("--xla_backend_optimization_level=") for f in flags) == 1, flags
    if "QKVFLOW_TESTS_CALLER_XLA_FLAGS" not in os.environ:
        assert "--xla_backend_optimization_level=0" in flags
        assert ("--xla_cpu_use_fusion_emitters=false" in flags) == version("jaxlib").startswith("0.10.")
    assert with_host_devices(4).split() == [*flags, "--xla_force_host_platform_device_count=4"]
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] and os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
