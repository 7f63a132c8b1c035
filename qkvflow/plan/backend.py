"""Devices to compile for that are not there: XLA's deviceless ("compile-only") topologies.

    jax.config.update("jax_platforms", "cpu")         # before any backend starts
    jax.config.update("jax_num_cpu_devices", N)      # so that Levanter's mesh arithmetic sees N devices
    topologies.get_topology_desc(platform="cuda", target_config=<GpuTargetConfigProto text>,
                                 topology="1x<nodes>x<devices per node>")

The CUDA plugin (`pip install -e '.[gpu]'`) registers the `cuda` platform, and compiles for the
`GpuTargetConfigProto` it is given, with no GPU and no driver; `CUDA_VISIBLE_DEVICES=-1` alone is not
enough (without a driver the plugin never registers `cuda`: "topology not implemented for cuda"). The
topology string is XLA's `<partitions>x<hosts per partition>x<devices per host>`: several nodes are
several hosts of one partition. A `cpu:N` target is the process's own N host devices.
"""

from __future__ import annotations

import jax

from qkvflow.errors import UserError
from qkvflow.plan.targets import Target

GPU_EXTRA = "pip install -e '.[gpu]'"


def start(devices: int) -> None:
    """Start JAX on the host with `devices` devices (the count Levanter's trainer config divides its
    mesh by); refused in one line when the backend already started with another count."""
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", devices)
    except RuntimeError:  # the backend has started: only its own device count can be used
        pass
    if jax.device_count() != devices:
        raise UserError(
            f"--devices {devices}: this process already started JAX with {jax.device_count()} devices; "
            "run `qkvflow plan` in a fresh process"
        )


def topology_string(devices: int, per_node: int) -> str:
    """XLA's topology name for `devices` devices, `per_node` to a node (a part-filled node: one node)."""
    if devices <= per_node:
        return f"1x1x{devices}"
    if devices % per_node:
        raise UserError(f"--devices {devices} is not a whole number of {per_node}-device nodes")
    return f"1x{devices // per_node}x{per_node}"


def devices_for(target: Target, devices: int) -> list:
    """The `devices` devices to compile for: compile-only devices of the target's topology, or the
    host's own for a `cpu:N` target."""
    if target.platform == "cpu":
        return list(jax.devices("cpu"))[:devices]
    if target.platform != "gpu":
        raise UserError(f"--target {target.name}: {target.platform} targets are not supported")
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        raise UserError(f"--target {target.name} needs the CUDA plugin: {GPU_EXTRA}") from None
    from jax.experimental import topologies

    name = topology_string(devices, target.devices_per_node)
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=target.spec_text(), topology=name)
    except (NotImplementedError, RuntimeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"--target {target.name}: XLA refused the topology {name}: {first}") from None
    return list(topology.devices)
