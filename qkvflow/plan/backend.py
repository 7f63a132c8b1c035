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
TPU_EXTRA = "pip install -e '.[tpu]'"


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


def devices_for(target: Target, devices: int, slices: int = 1) -> list:
    """The `devices` devices to compile for: compile-only devices of the target's topology (a TPU's in
    `slices` slices), or the host's own for a `cpu:N` target."""
    if target.platform == "cpu":
        return list(jax.devices("cpu"))[:devices]
    if target.platform == "tpu":
        return tpu_devices(target, devices, slices)
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


def tpu_devices(target: Target, devices: int, slices: int = 1) -> list:
    """Compile-only chips of `slices` TPU slices of devices / slices chips each (libtpu's deviceless
    topology, `<generation>:<chip grid>`, e.g. v5p:2x2x2 for 8 chips, with `num_slices` for several),
    the way MaxText's and AXLearn's ahead-of-time compiles name them."""
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        raise UserError(f"--target {target.name} needs libtpu: {TPU_EXTRA}")
    from jax.experimental import topologies

    name = tpu_topology(target.spec, devices, slices)
    try:
        found = list(
            topologies.get_topology_desc(name, "tpu", **({"num_slices": slices} if slices > 1 else {})).devices
        )
    except Exception as e:  # noqa: BLE001 (libtpu raises its runtime's errors)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"--target {target.name}: libtpu refused the topology {name} x {slices}: {first}") from None
    return found


def tpu_topology(generation: str, devices: int, slices: int) -> str:
    """libtpu's name for one of `slices` slices that hold `devices` chips together."""
    if slices < 1 or devices % slices:
        raise UserError(f"--devices {devices} does not split into {slices} TPU slices (trainer.mesh.dcn_axes)")
    return f"{generation}:{tpu_grid(devices // slices, generation)}"


def tpu_grid(chips: int, generation: str) -> str:
    """The chip grid of a slice of `chips` chips: 2D for v5e (2x4 for 8 chips), 3D for v5p (2x2x1 for 4,
    2x2x2 for 8, 2x2x4 for 16)."""
    if chips & (chips - 1):
        raise UserError(f"--devices {chips}: a TPU slice has a power-of-two number of chips")
    dims = [1, 1] if generation == "v5e" else [1, 1, 1]
    i = 0
    while chips > 1:
        dims[i % len(dims)] *= 2
        chips //= 2
        i += 1
    dims = sorted(dims)
    dims = [d for d in dims if d > 1] + [d for d in dims if d == 1] if len(dims) == 3 else dims
    return "x".join(str(d) for d in dims)
