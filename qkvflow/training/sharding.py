"""Per-device memory of the parameters and optimizer state under Levanter's sharding, from shapes alone.

The hypernetwork projections `proj` (axes [time_embed, *target axes], e.g. [time_embed, embed,
heads, head_size]) hold almost all of a DiffEqFormer's parameters. They carry the axis names that
Levanter's parameter mapping (`trainer.mesh`, a `MeshConfig`) shards: by default `embed` over the
`data` mesh axis (FSDP, `param_mapping`) and `mlp` / `heads` over the `model` mesh axis (tensor
parallelism, `shared_mapping`; it splits only when `trainer.mesh.axes` gives `model` more than one
device). This module computes what each device holds, using the same mapping
(`MeshConfig.resolved_param_mapping`, which `TrainerConfig.parameter_axis_mapping` returns),
Haliax's partition specs and JAX's shard shapes on an `AbstractMesh`, so that the paper's 1.86B
model can be checked without allocating it or having the devices.

    per_device_bytes(config.model, 50257, {"data": 8})                      # FSDP over 8 devices
    per_device_bytes(config.model, 50257, {"data": 4, "model": 2})          # FSDP 4 x TP 2
    per_device_bytes(config.model, 50257, mesh_shape(config.trainer.mesh, 8), mesh=config.trainer.mesh)
"""

from __future__ import annotations

import math
import warnings
from typing import Mapping, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jrandom
from haliax import Axis, NamedArray
from haliax.partitioning import pspec_for_axis
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec
from levanter.utils.mesh import MeshConfig

from qkvflow.training.faults import leaf_paths


def parameter_axis_mapping(mesh: Optional[MeshConfig] = None) -> dict:
    """Levanter's logical -> mesh axis mapping for parameters and optimizer state (default `trainer.mesh`:
    embed -> data, mlp and heads -> model)."""
    return dict((mesh or MeshConfig()).resolved_param_mapping)


def mesh_axes(mesh: Optional[MeshConfig] = None) -> tuple[str, ...]:
    """The axis names of the device mesh Levanter builds from `mesh`: its within-slice axes (by default
    data, replica, model), then its across-slice ones (replica_dcn), as `create_mesh_from_axis_specs`."""
    from levanter.utils.mesh import DEFAULT_DCN_AXIS_SPEC, DEFAULT_ICI_AXIS_SPEC

    mesh = mesh or MeshConfig()
    ici, dcn = {**DEFAULT_ICI_AXIS_SPEC, **mesh.axes}, {**DEFAULT_DCN_AXIS_SPEC, **mesh.dcn_axes}
    return (*ici, *(n for n in dcn if n not in ici))


def mesh_shape(mesh: MeshConfig, devices: int, slices: int = 1) -> dict[str, int]:
    """The size of each mesh axis that Levanter gives `mesh` on `devices` devices in `slices` slices."""
    ici, dcn = mesh.axis_shapes(devices, slices)
    return {name: ici.get(name, 1) * dcn.get(name, 1) for name in (*ici, *dcn)}


def abstract_mesh(shape: Mapping[str, int], mesh: Optional[MeshConfig] = None) -> AbstractMesh:
    """An `AbstractMesh` with `mesh`'s axis names; axes missing from `shape` have size 1."""
    names = mesh_axes(mesh)
    unknown = set(shape) - set(names)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; expected some of {names}")
    return AbstractMesh(tuple(shape.get(n, 1) for n in names), names)


def state_shapes(model_config, vocab: Axis, optimizer=None, num_train_steps: int = 1000):
    """(model, optimizer state) as pytrees of shapes; the optimizer defaults to Levanter's AdamW."""
    from levanter.optim import AdamConfig

    optimizer = optimizer or AdamConfig()

    def init():
        model = model_config.build(vocab, key=jrandom.PRNGKey(0))
        return model, tx.init(eqx.filter(model, eqx.is_inexact_array))

    with warnings.catch_warnings():  # Levanter's schedules log to a tracker; there is none here
        warnings.simplefilter("ignore")
        tx = optimizer.build(num_train_steps)
        return eqx.filter_eval_shape(init)


def _spec(leaf, mapping) -> PartitionSpec:
    if isinstance(leaf, NamedArray):
        return pspec_for_axis(leaf.axes, mapping)
    return PartitionSpec()  # plain arrays (optimizer step counts, ...) are replicated


def _shard_shape(shape, spec: PartitionSpec, mesh: AbstractMesh) -> tuple[int, ...]:
    """The largest shard's shape (an uneven split rounds up, as XLA pads it)."""
    ways = []
    for i in range(len(shape)):
        axes = spec[i] if i < len(spec) else None
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        ways.append(math.prod(mesh.shape[a] for a in axes))
    if all(size % w == 0 for size, w in zip(shape, ways)):
        return tuple(NamedSharding(mesh, spec).shard_shape(tuple(shape)))  # JAX's own answer
    return tuple(-(-size // w) for size, w in zip(shape, ways))


def array_bytes(tree, mapping, mesh) -> list[tuple[str, int, int]]:
    """(path, bytes on the fullest device, bytes unsharded) for each array of a tree of shapes."""
    is_named = lambda x: isinstance(x, NamedArray)  # noqa: E731
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=is_named)
    paths = leaf_paths(tree)  # one per array; a NamedArray has one
    out = []
    for path, leaf in zip(paths, leaves):
        array = leaf.array if is_named(leaf) else leaf
        if not isinstance(array, jax.ShapeDtypeStruct):
            continue
        itemsize = jnp.dtype(array.dtype).itemsize
        shard = _shard_shape(array.shape, _spec(leaf, mapping), mesh)
        out.append((path, math.prod(shard) * itemsize, math.prod(array.shape) * itemsize))
    return out


def per_device_bytes(
    model_config,
    vocab_size: int,
    shape: Mapping[str, int],
    *,
    mesh: Optional[MeshConfig] = None,
    optimizer=None,
) -> dict[str, int]:
    """Bytes of parameters and optimizer state on the fullest device, and unsharded.

    `shape` gives the size of Levanter's mesh axes: {"data": FSDP degree, "model": tensor-parallel
    degree, "replica": pure data-parallel degree} (`mesh_shape` computes it from a `MeshConfig`);
    `mesh` (default: Levanter's default `trainer.mesh`) says which logical axes go to which of them.
    The vocabulary is padded as `qkvflow train` pads it (to a multiple of the mesh size its axis is
    sharded over, if any).
    """
    mapping = parameter_axis_mapping(mesh)
    mesh_ = abstract_mesh(shape, mesh)
    vocab = Axis("vocab", vocab_size)
    if "vocab" in mapping:
        names = mapping["vocab"]
        ways = math.prod(mesh_.shape[n] for n in ((names,) if isinstance(names, str) else names))
        vocab = Axis("vocab", -(-vocab_size // ways) * ways)
    model, opt_state = state_shapes(model_config, vocab, optimizer)
    params = sum(b for _, b, _ in array_bytes(model, mapping, mesh_))
    params_total = sum(b for _, _, b in array_bytes(model, mapping, mesh_))
    opt = sum(b for _, b, _ in array_bytes(opt_state, mapping, mesh_))
    opt_total = sum(b for _, _, b in array_bytes(opt_state, mapping, mesh_))
    devices = math.prod(mesh_.shape.values())
    return {
        "devices": devices,
        "params": params,
        "opt_state": opt,
        "total": params + opt,
        "params_unsharded": params_total,
        "opt_state_unsharded": opt_total,
        "total_unsharded": params_total + opt_total,
    }
